/* Copies on the copy engine, events on callers' streams, staging memory (gpu.h). */
#define _GNU_SOURCE
#include "gpu/gpu.h"

#include <pthread.h>
#include <sched.h>
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

/* Each thread that copies owns a few non-blocking streams (and an event
 * each) per device: copies of different threads never queue behind each
 * other, and none waits for the legacy default stream torch works on. */
struct lanes {
    cu_stream s[MAX_STREAMS + 1]; /* [0, UCCL_P2P_CUDA_STREAMS): copies; the next: copy_start's */
    cu_event e[MAX_STREAMS + 1];
    int n;
};
struct thread_lanes {
    struct lanes dev[MAX_DEVS];
};

static pthread_key_t lanes_key;
static pthread_once_t lanes_once = PTHREAD_ONCE_INIT;

static void lanes_free(void *p)
{
    struct thread_lanes *t = p;
    const struct uccl__cuda *cu = uccl__cuda();
    for (int d = 0; cu && d < MAX_DEVS; d++) {
        if (t->dev[d].n == 0 || uccl__cuda_use(d) != UCCL_OK)
            continue;
        for (int i = 0; i < t->dev[d].n; i++) {
            cu->EventDestroy(t->dev[d].e[i]);
            cu->StreamDestroy(t->dev[d].s[i]);
        }
    }
    free(t);
}

static void lanes_key_make(void) { pthread_key_create(&lanes_key, lanes_free); }

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

/* This thread's lanes on device dev (whose context is current), at least want. */
static int lanes_get(int dev, unsigned want, struct lanes **l_p)
{
    if (dev < 0 || dev >= MAX_DEVS)
        return uccl__err(UCCL_ERR_INVALID, "CUDA device %d: at most %d devices", dev, MAX_DEVS);
    pthread_once(&lanes_once, lanes_key_make);
    struct thread_lanes *t = pthread_getspecific(lanes_key);
    if (!t) {
        t = calloc(1, sizeof(*t));
        if (!t || pthread_setspecific(lanes_key, t)) {
            free(t);
            return uccl__err(UCCL_ERR_NOMEM, "out of memory");
        }
    }
    const struct uccl__cuda *cu = uccl__cuda();
    struct lanes *l = &t->dev[dev];
    while ((unsigned)l->n < want) {
        cu_result r = cu->StreamCreate(&l->s[l->n], CU_STREAM_NON_BLOCKING);
        if (r == CU_OK) {
            r = cu->EventCreate(&l->e[l->n], CU_EVENT_DISABLE_TIMING);
            if (r != CU_OK)
                cu->StreamDestroy(l->s[l->n]);
        }
        if (r != CU_OK)
            return uccl__cuda_err(r, "creating a copy stream");
        l->n++;
    }
    *l_p = l;
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
    struct lanes *l = NULL;
    if ((rc = lanes_get(dev, parts, &l)) != UCCL_OK)
        return rc;
    /* Page-aligned pieces, rounded up so that there are at most `parts`. */
    size_t step = ((len + parts - 1) / parts + 4095) & ~(size_t)4095, off = 0;
    unsigned used = 0;
    for (; off < len; used++) {
        size_t n = len - off < step ? len - off : step;
        cu_result r = cu->MemcpyAsync((cu_ptr)(uintptr_t)dst + off, (cu_ptr)(uintptr_t)src + off,
                                      n, l->s[used]);
        if (r == CU_OK)
            r = cu->EventRecord(l->e[used], l->s[used]);
        if (r != CU_OK) { /* let what was queued finish before reporting */
            wait_events(cu, l->e, (int)used, timeout_ns, "GPU copy");
            return uccl__cuda_err(r, "queueing a GPU copy");
        }
        off += n;
    }
    rc = wait_events(cu, l->e, (int)used, timeout_ns, "GPU copy");
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
    unsigned side = lanes_wanted(); /* a stream of its own: the thread's copies never queue behind it */
    struct lanes *l = NULL;
    if ((rc = lanes_get(dev, side + 1, &l)) != UCCL_OK)
        return rc;
    cu_event ev = NULL;
    cu_result r = ev_p ? cu->EventCreate(&ev, CU_EVENT_DISABLE_TIMING) : CU_OK;
    if (r != CU_OK)
        return uccl__cuda_err(r, "creating an event");
    r = cu->MemcpyAsync((cu_ptr)(uintptr_t)dst, (cu_ptr)(uintptr_t)src, len, l->s[side]);
    if (r == CU_OK && ev)
        r = cu->EventRecord(ev, l->s[side]);
    if (r != CU_OK) { /* what was queued ends first (bounded: a hung copy is not waited out) */
        uint64_t until = uccl__now_ns() + 30000000000ull;
        while (cu->StreamQuery(l->s[side]) == CU_ERR_NOT_READY && uccl__now_ns() < until)
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
    unsigned side = lanes_wanted();
    struct lanes *l = NULL;
    if ((rc = lanes_get(dev, side + 1, &l)) != UCCL_OK)
        return rc;
    cu_event ev;
    cu_result r = cu->EventCreate(&ev, CU_EVENT_DISABLE_TIMING);
    if (r == CU_OK && (r = cu->EventRecord(ev, l->s[side])) != CU_OK)
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
