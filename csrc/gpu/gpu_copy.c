/* Copies on the copy engine, events on callers' streams, staging memory (gpu.h). */
#define _GNU_SOURCE
#include "gpu/gpu.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "load/cuda_loader.h"
#include "net/sock.h"
#include "base/config.h"
#include "base/status.h"

#define MAX_STREAMS 8
#define MAX_DEVS 16
#define SPLIT_BYTES (8u << 20) /* a copy is split over streams from here on */

/* The copy streams are the process's, a few per device shared by every
 * thread, not each thread's own.  Why: a context has a few hardware work
 * queues per device (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default); streams
 * are dealt onto them in turn as they are made, and the work of one queue
 * runs in order.  Past that many streams in a process, a copy of ours can
 * wait in one queue behind a kernel on a user's stream; a GPU ring's kernel
 * spins until the copies it asked for are done, so such a copy would never
 * start.  (Seen: 4-GPU rings with per-thread streams, some 20 streams a
 * process; copies into a GPU whose ring kernel spun stalled until the
 * timeout, at random, never at 2 GPUs.)  POOL_MIN copy streams and one for
 * copy_start, non-blocking (none waits for the legacy default stream torch
 * works on), made once; each thread starts at its own stream of the pool,
 * so threads' copies spread over them.  Each thread has its own events. */
#define POOL_MIN 4

struct dev_streams {
    cu_stream s[MAX_STREAMS + 1]; /* [0, n - 1): copies; [n - 1]: copy_start's */
    _Atomic int n;                /* 0 until made */
};
static struct dev_streams pools[MAX_DEVS];
static pthread_mutex_t pools_mu = PTHREAD_MUTEX_INITIALIZER;

struct thread_events {
    cu_event e[MAX_DEVS][MAX_STREAMS];
    unsigned start;               /* this thread's first stream of each pool */
};

static pthread_key_t events_key;
static pthread_once_t events_once = PTHREAD_ONCE_INIT;

static void events_free(void *p)
{
    struct thread_events *t = p;
    const struct uccl__cuda *cu = uccl__cuda();
    for (int d = 0; cu && d < MAX_DEVS; d++)
        for (int i = 0; i < MAX_STREAMS; i++)
            if (t->e[d][i] && uccl__cuda_use(d) == UCCL_OK)
                cu->EventDestroy(t->e[d][i]);
    free(t);
}

static void events_key_make(void) { pthread_key_create(&events_key, events_free); }

static unsigned lanes_wanted(void)
{
    _Static_assert(MAX_STREAMS == 8, "base/config.h: UCCL_P2P_CUDA_STREAMS is 1..8");
    static int n; /* UCCL_P2P_CUDA_STREAMS, read once (a benign race: same value) */
    if (!n) {
        long v; /* a bad value: the default here (endpoint creation raises on it) */
        n = uccl__cfg_long(UCCL_CFG_P2P_CUDA_STREAMS, &v) ? 2 : (int)v;
    }
    return (unsigned)n;
}

/* Device dev's pool (its context is current): its copy streams' count in
 * *ncopy_p. */
static int pool_get(int dev, struct dev_streams **p_p, unsigned *ncopy_p)
{
    if (dev < 0 || dev >= MAX_DEVS)
        return uccl__err(UCCL_ERR_INVALID, "CUDA device %d: at most %d devices", dev, MAX_DEVS);
    struct dev_streams *p = &pools[dev];
    if (!atomic_load(&p->n)) {
        pthread_mutex_lock(&pools_mu);
        int want = (int)(lanes_wanted() > POOL_MIN ? lanes_wanted() : POOL_MIN) + 1, made = 0;
        cu_result r = CU_OK;
        while (!atomic_load(&p->n) && made < want &&
               (r = uccl__cuda()->StreamCreate(&p->s[made], CU_STREAM_NON_BLOCKING)) == CU_OK)
            made++;
        if (!atomic_load(&p->n) && made == want)
            atomic_store(&p->n, want);
        else
            for (int i = 0; i < made; i++) /* not all of them: none */
                uccl__cuda()->StreamDestroy(p->s[i]);
        pthread_mutex_unlock(&pools_mu);
        if (r != CU_OK)
            return uccl__cuda_err(r, "creating a copy stream");
    }
    *p_p = p;
    *ncopy_p = (unsigned)atomic_load(&p->n) - 1;
    return UCCL_OK;
}

/* This thread's events on device dev (whose context is current), the first n made. */
static int events_get(int dev, unsigned n, struct thread_events **t_p)
{
    static _Atomic unsigned threads;
    pthread_once(&events_once, events_key_make);
    struct thread_events *t = pthread_getspecific(events_key);
    if (!t) {
        t = calloc(1, sizeof(*t));
        if (!t || pthread_setspecific(events_key, t)) {
            free(t);
            return uccl__err(UCCL_ERR_NOMEM, "out of memory");
        }
        t->start = atomic_fetch_add(&threads, 1);
    }
    for (unsigned i = 0; i < n; i++)
        if (!t->e[dev][i]) {
            cu_result r = uccl__cuda()->EventCreate(&t->e[dev][i], CU_EVENT_DISABLE_TIMING);
            if (r != CU_OK) {
                t->e[dev][i] = NULL;
                return uccl__cuda_err(r, "creating an event");
            }
        }
    *t_p = t;
    return UCCL_OK;
}

/* Poll events until all are done: spin for the first tens of microseconds
 * (most copies end there), then yield, then sleep a little between polls. */
static int wait_events(const struct uccl__cuda *cu, cu_event *ev, int n, uint64_t timeout_ns,
                       const char *what)
{
    uint64_t start = uccl__now_ns();
    int done = 0;
    for (;;) {
        while (done < n) {
            cu_result r = cu->EventQuery(ev[done]);
            if (r == CU_ERR_NOT_READY)
                break;
            if (r != CU_OK) {
                char why[120];
                snprintf(why, sizeof(why), "%s failed", what);
                return uccl__cuda_err(r, why);
            }
            done++;
        }
        if (done == n)
            return UCCL_OK;
        uint64_t el = uccl__now_ns() - start;
        if (el > timeout_ns)
            return uccl__err(UCCL_ERR_TIMEOUT, "%s not done after %.1f s", what,
                             (double)el / 1e9);
        if (el > 2000000)
            usleep(50);
        else if (el > 50000)
            sched_yield();
    }
}

int uccl__gpu_copy(int dev, void *dst, const void *src, size_t len, int split,
                   uint64_t timeout_ns)
{
    if (len == 0)
        return UCCL_OK;
    int rc = uccl__cuda_use(dev); /* loads the driver, or says why not */
    if (rc)
        return rc;
    const struct uccl__cuda *cu = uccl__cuda();
    unsigned parts = split && len >= 2 * (size_t)SPLIT_BYTES ? (unsigned)(len / SPLIT_BYTES) : 1;
    if (parts > lanes_wanted())
        parts = lanes_wanted();
    struct dev_streams *p;
    struct thread_events *t;
    unsigned ncopy;
    if ((rc = pool_get(dev, &p, &ncopy)) != UCCL_OK || (rc = events_get(dev, parts, &t)) != UCCL_OK)
        return rc;
    cu_event *ev = t->e[dev];
    /* Page-aligned pieces, rounded up so that there are at most `parts`. */
    size_t step = ((len + parts - 1) / parts + 4095) & ~(size_t)4095, off = 0;
    unsigned used = 0;
    for (; off < len; used++) {
        size_t n = len - off < step ? len - off : step;
        cu_stream s = p->s[(t->start + used) % ncopy];
        cu_result r = cu->MemcpyAsync((cu_ptr)(uintptr_t)dst + off, (cu_ptr)(uintptr_t)src + off,
                                      n, s);
        if (r == CU_OK)
            r = cu->EventRecord(ev[used], s);
        if (r != CU_OK) { /* let what was queued finish before reporting */
            wait_events(cu, ev, (int)used, timeout_ns, "GPU copy");
            return uccl__cuda_err(r, "queueing a GPU copy");
        }
        off += n;
    }
    rc = wait_events(cu, ev, (int)used, timeout_ns, "GPU copy");
    if (rc == UCCL_ERR_IO)
        return uccl__err(rc, "copying %zu bytes 0x%zx -> 0x%zx on device %d: %s", len,
                         (size_t)src, (size_t)dst, dev, uccl_last_error());
    return rc;
}

int uccl__gpu_copy_start(int dev, void *dst, const void *src, size_t len, void **ev_p)
{
    if (ev_p)
        *ev_p = NULL;
    if (len == 0)
        return UCCL_OK;
    int rc = uccl__cuda_use(dev);
    if (rc)
        return rc;
    const struct uccl__cuda *cu = uccl__cuda();
    struct dev_streams *p; /* the pool's last stream: copies never queue behind these */
    unsigned side;
    if ((rc = pool_get(dev, &p, &side)) != UCCL_OK)
        return rc;
    cu_event ev = NULL;
    cu_result r = ev_p ? cu->EventCreate(&ev, CU_EVENT_DISABLE_TIMING) : CU_OK;
    if (r != CU_OK)
        return uccl__cuda_err(r, "creating an event");
    r = cu->MemcpyAsync((cu_ptr)(uintptr_t)dst, (cu_ptr)(uintptr_t)src, len, p->s[side]);
    if (r == CU_OK && ev)
        r = cu->EventRecord(ev, p->s[side]);
    if (r != CU_OK) { /* what was queued ends first (bounded: a hung copy is not waited out) */
        uint64_t until = uccl__now_ns() + 30000000000ull;
        while (cu->StreamQuery(p->s[side]) == CU_ERR_NOT_READY && uccl__now_ns() < until)
            sched_yield();
        if (ev)
            cu->EventDestroy(ev);
        return uccl__cuda_err(r, "queueing a GPU copy");
    }
    if (ev_p)
        *ev_p = ev;
    return UCCL_OK;
}

int uccl__gpu_copy_start_mark(int dev, void **ev_p)
{
    int rc = uccl__cuda_use(dev);
    if (rc)
        return rc;
    const struct uccl__cuda *cu = uccl__cuda();
    struct dev_streams *p;
    unsigned side;
    if ((rc = pool_get(dev, &p, &side)) != UCCL_OK)
        return rc;
    cu_event ev;
    cu_result r = cu->EventCreate(&ev, CU_EVENT_DISABLE_TIMING);
    if (r == CU_OK && (r = cu->EventRecord(ev, p->s[side])) != CU_OK)
        cu->EventDestroy(ev);
    if (r != CU_OK)
        return uccl__cuda_err(r, "recording an event after queued GPU copies");
    *ev_p = ev;
    return UCCL_OK;
}

/* The device to work on for a copy between memory kinds a and b. */
static int copy_dev(uint32_t mk_a, uint32_t mk_b)
{
    if (UCCL_MK_ON_GPU(mk_a))
        return UCCL_MK_DEV(mk_a);
    if (UCCL_MK_ON_GPU(mk_b))
        return UCCL_MK_DEV(mk_b);
    return UCCL_MK_KIND(mk_a) == UCCL_MK_PINNED ? UCCL_MK_DEV(mk_a) : UCCL_MK_DEV(mk_b);
}

int uccl__gpu_copy_kinds(void *dst, uint32_t dst_mk, const void *src, uint32_t src_mk, size_t len,
                         uint64_t timeout_ns)
{
    if (!UCCL_MK_ON_GPU(dst_mk) && !UCCL_MK_ON_GPU(src_mk)) {
        memcpy(dst, src, len);
        return UCCL_OK;
    }
    return uccl__gpu_copy(copy_dev(dst_mk, src_mk), dst, src, len,
                          UCCL_MK_KIND(dst_mk) != UCCL_MK_HOST && UCCL_MK_KIND(src_mk) != UCCL_MK_HOST,
                          timeout_ns);
}

int uccl__gpu_event_record(int dev, uintptr_t stream, void **ev_p)
{
    int rc = uccl__cuda_use(dev);
    if (rc)
        return rc;
    const struct uccl__cuda *cu = uccl__cuda();
    cu_event ev;
    cu_result r = cu->StreamQuery((cu_stream)stream);
    if (r == CU_OK) { /* nothing queued there: nothing to wait for */
        *ev_p = NULL;
        return UCCL_OK;
    }
    if (r != CU_ERR_NOT_READY)
        return uccl__cuda_err(r, "querying the caller's stream (is it a stream of the "
                              "buffer's device?)");
    r = cu->EventCreate(&ev, CU_EVENT_DISABLE_TIMING);
    if (r != CU_OK)
        return uccl__cuda_err(r, "creating an event");
    r = cu->EventRecord(ev, (cu_stream)stream);
    if (r != CU_OK) {
        cu->EventDestroy(ev);
        return uccl__cuda_err(r, "recording an event on the caller's stream (is it a stream "
                              "of the buffer's device?)");
    }
    *ev_p = ev;
    return UCCL_OK;
}

int uccl__gpu_event_poll(void *ev)
{
    cu_result r = uccl__cuda()->EventQuery((cu_event)ev);
    if (r == CU_OK)
        return 1;
    if (r == CU_ERR_NOT_READY)
        return 0;
    return uccl__cuda_err(r, "work queued on the caller's stream failed");
}

int uccl__gpu_event_wait(void *ev, uint64_t timeout_ns)
{
    cu_event e = ev;
    return wait_events(uccl__cuda(), &e, 1, timeout_ns, "the work queued on the caller's stream");
}

void uccl__gpu_event_free(void *ev)
{
    if (ev)
        uccl__cuda()->EventDestroy((cu_event)ev);
}

int uccl__gpu_host_alloc(int dev, size_t len, void **p)
{
    int rc = uccl__cuda_use(dev);
    if (rc)
        return rc;
    cu_result r = uccl__cuda()->MemHostAlloc(p, len, CU_MEMHOSTALLOC_PORTABLE);
    return r == CU_OK ? UCCL_OK : uccl__cuda_err(r, "allocating page-locked staging memory");
}

void uccl__gpu_host_free(int dev, void *p)
{
    if (p && uccl__cuda_use(dev) == UCCL_OK)
        uccl__cuda()->MemFreeHost(p);
}

/* ------------------------------------------------------------------------- */
/* flags for stream waits                                                     */

#define FLAG_SLOTS 1024

struct uccl__gpu_flags {
    pthread_mutex_t mu;
    uint32_t *page;                 /* FLAG_SLOTS words, page-locked, mapped for the GPU */
    uint32_t gen[FLAG_SLOTS];       /* the last generation handed out per slot */
    unsigned char used[FLAG_SLOTS];
    int dev;
};

void uccl__gpu_flags_free(struct uccl__gpu_flags *f)
{
    if (!f)
        return;
    /* A stream still waiting would wait on freed memory: release it. */
    for (int i = 0; i < FLAG_SLOTS; i++)
        if (f->used[i])
            __atomic_store_n(&f->page[i], f->gen[i], __ATOMIC_RELEASE);
    uccl__gpu_host_free(f->dev, f->page);
    pthread_mutex_destroy(&f->mu);
    free(f);
}

int uccl__gpu_flags_new(int dev, struct uccl__gpu_flags **f_p)
{
    int rc = uccl__cuda_use(dev);
    if (rc)
        return rc;
    struct uccl__gpu_flags *f = calloc(1, sizeof(*f));
    if (!f)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    cu_result r = uccl__cuda()->MemHostAlloc((void **)&f->page, FLAG_SLOTS * sizeof(uint32_t),
                                             CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
    if (r != CU_OK) {
        free(f);
        return uccl__cuda_err(r, "allocating stream-wait flags");
    }
    memset(f->page, 0, FLAG_SLOTS * sizeof(uint32_t));
    pthread_mutex_init(&f->mu, NULL);
    f->dev = dev;
    *f_p = f;
    return UCCL_OK;
}

int uccl__gpu_flag_wait(struct uccl__gpu_flags *f, int dev, uintptr_t stream, uint32_t **slot_p,
                        uint32_t *gen_p)
{
    int rc = uccl__cuda_use(dev);
    if (rc)
        return rc;
    pthread_mutex_lock(&f->mu);
    int i = 0;
    while (i < FLAG_SLOTS && f->used[i])
        i++;
    if (i == FLAG_SLOTS) {
        pthread_mutex_unlock(&f->mu);
        return uccl__err(UCCL_ERR_NOMEM, "all %d stream-wait slots are taken", FLAG_SLOTS);
    }
    f->used[i] = 1;
    uint32_t gen = ++f->gen[i];
    pthread_mutex_unlock(&f->mu);
    /* Unified addressing: the page's host address is its device address. */
    cu_result r = uccl__cuda()->StreamWaitValue32((cu_stream)stream, (cu_ptr)(uintptr_t)&f->page[i],
                                                   gen, CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CU_OK) {
        uccl__gpu_flag_set(f, &f->page[i], gen);
        return uccl__cuda_err(r, "cuStreamWaitValue32 on the caller's stream");
    }
    *slot_p = &f->page[i];
    *gen_p = gen;
    return UCCL_OK;
}

void uccl__gpu_flag_set(struct uccl__gpu_flags *f, uint32_t *slot, uint32_t gen)
{
    __atomic_store_n(slot, gen, __ATOMIC_RELEASE);
    pthread_mutex_lock(&f->mu);
    f->used[slot - f->page] = 0;
    pthread_mutex_unlock(&f->mu);
}
