/* What a pointer is, and device memory shared between processes (gpu.h). */
#define _GNU_SOURCE
#include "gpu/gpu.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "load/cuda_loader.h"
#include "base/log.h"
#include "base/status.h"
#include "gpu/gpu_api.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

#define EXPORT_MAGIC 0x3175706c6c636375ull /* "ucclgpu1" */
#define MAX_SEGS 65536                     /* 1.3 TB of torch's 20 MiB chunks */
#define MAX_IMPORTS 512                    /* per process; the oldest one goes */
#define SLOW_DRIVER_NS (100ull * 1000000ull) /* a map or unmap this long is logged */

/* ------------------------------------------------------------------------- */
/* classification                                                             */

/* Can this process read the bytes at p?  (process_vm_readv on ourselves
 * fails with EFAULT where a plain read would fault.)  Where the call itself
 * is refused (a seccomp filter: EPERM, ENOSYS) we cannot tell, and take the
 * caller's word, as before pointers were classified. */
static int host_readable(uintptr_t p)
{
    char b;
    struct iovec l = {&b, 1}, r = {(void *)p, 1};
    return process_vm_readv(getpid(), &l, 1, &r, 1, 0) == 1 || errno != EFAULT;
}

struct ptr_attrs {
    unsigned mtype;
    unsigned long long buffer_id;
    int dev;
    uintptr_t start;
    size_t size;
    int legacy; /* the driver writes a bool here: zero it first */
};

static void query(const struct uccl__cuda *cu, uintptr_t p, struct ptr_attrs *a)
{
    int attrs[] = {CU_PA_MEMORY_TYPE, CU_PA_BUFFER_ID, CU_PA_DEVICE_ORDINAL,
                   CU_PA_RANGE_START_ADDR, CU_PA_RANGE_SIZE, CU_PA_IS_LEGACY_IPC_CAPABLE};
    memset(a, 0, sizeof(*a));
    void *data[] = {&a->mtype, &a->buffer_id, &a->dev, &a->start, &a->size, &a->legacy};
    cu_result rc = cu->PointerGetAttributes(6, attrs, data, (cu_ptr)p);
    if (rc == CU_ERR_INVALID_CONTEXT && uccl__cuda_use(0) == UCCL_OK) {
        memset(a, 0, sizeof(*a));
        rc = cu->PointerGetAttributes(6, attrs, data, (cu_ptr)p);
    }
    if (rc != CU_OK) /* not memory the driver knows (pageable host, or nothing) */
        memset(a, 0, sizeof(*a));
}

int uccl__gpu_classify(uintptr_t addr, size_t len, struct uccl__gpu_info *info_p)
{
    struct uccl__gpu_info info = {.mkind = UCCL_MK(UCCL_MK_HOST, 0)};
    if (len == 0) { /* nothing will be touched */
        *info_p = info;
        return UCCL_OK;
    }
    uintptr_t last = addr + len - 1;
    /* Without cuInit in this process no CUDA memory exists here. */
    const struct uccl__cuda *cu = uccl__cuda_initialised() ? uccl__cuda() : NULL;
    struct ptr_attrs a = {0}, b = {0};
    if (cu)
        query(cu, addr, &a);
    if (a.mtype == CU_MEMORYTYPE_DEVICE) {
        query(cu, last, &b);
        /* cudaMalloc memory: its block must hold the whole range.  cuMem*
         * memory (expandable segments): RANGE is the reserved span, and
         * every byte up to the last must be mapped device memory of the
         * same device; a range over two physical chunks is fine. */
        if (addr < a.start || last - a.start >= a.size || b.mtype != CU_MEMORYTYPE_DEVICE ||
            b.dev != a.dev || (a.legacy && b.buffer_id != a.buffer_id))
            return uccl__err(UCCL_ERR_INVALID, "[0x%zx, +%zu) is not inside one CUDA "
                             "allocation (the one at 0x%zx holds %zu bytes; the last byte %s): "
                             "register each allocation separately", (size_t)addr, len,
                             (size_t)a.start, a.size,
                             b.mtype != CU_MEMORYTYPE_DEVICE ? "is not device memory"
                                                             : "belongs to another allocation");
        info = (struct uccl__gpu_info){.mkind = UCCL_MK(UCCL_MK_DEVICE, a.dev),
                                       .buffer_id = a.buffer_id, .alloc_base = a.start,
                                       .alloc_size = a.size, .legacy_ipc = a.legacy != 0};
        *info_p = info;
        return UCCL_OK;
    }
    if (a.mtype == CU_MEMORYTYPE_HOST && a.size > 0 && addr >= a.start && last - a.start < a.size)
        info.mkind = UCCL_MK(UCCL_MK_PINNED, a.dev > 0 ? a.dev : 0);
    else if (!host_readable(addr) || !host_readable(last)) {
        if (!cu && !uccl__cuda())
            return uccl__err(UCCL_ERR_INVALID, "[0x%zx, +%zu) is not readable host memory, and "
                             "CUDA memory cannot be used here (%s)", (size_t)addr, len,
                             uccl_last_error());
        return uccl__err(UCCL_ERR_INVALID, "[0x%zx, +%zu) is neither CUDA memory of this "
                         "process nor readable host memory (freed, or a device pointer of "
                         "another process?)", (size_t)addr, len);
    }
    *info_p = info;
    return UCCL_OK;
}

/* ------------------------------------------------------------------------- */
/* export records: read by peers with process_vm_readv, so plain data         */

struct gpu_seg {
    uint64_t base, size;
    uint64_t buffer_id;        /* the driver's id of the chunk (or allocation) */
    int32_t fd;                /* cuMem chunk: a descriptor peers take with pidfd_getfd */
    uint32_t pad;
    cu_ipc_handle handle;      /* cudaMalloc block: its legacy IPC handle */
};

struct uccl__gpu_export {
    uint64_t magic;
    uint64_t owner;            /* random per owning process: a reused pid is another owner */
    uint64_t id;               /* the importers' cache key: the allocation's buffer id
                                  (legacy IPC), else random per export (cuMem) */
    uint64_t base, size;       /* the exported span: contiguous segments */
    uint32_t nseg, legacy;
    int32_t dev;
    uint32_t pad;
    struct gpu_seg seg[];
};

/* This process's owner nonce (write-once; a racing first call loses its own). */
static uint64_t owner_nonce(void)
{
    static _Atomic uint64_t nonce;
    uint64_t n = atomic_load(&nonce);
    if (!n) {
        uint64_t zero = 0;
        n = uccl__random64();
        if (!atomic_compare_exchange_strong(&nonce, &zero, n))
            n = zero;
    }
    return n;
}

static const struct gpu_seg *seg_of(const struct uccl__gpu_export *e, uintptr_t p)
{
    uint32_t lo = 0, hi = e->nseg; /* segments ascend and touch */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (p < e->seg[mid].base)
            hi = mid;
        else if (p - e->seg[mid].base >= e->seg[mid].size)
            lo = mid + 1;
        else
            return &e->seg[mid];
    }
    return NULL;
}

int uccl__gpu_check_live(const struct uccl__gpu_info *info, const struct uccl__gpu_export *e,
                         uintptr_t addr, size_t len)
{
    if (!UCCL_MK_ON_GPU(info->mkind) || len == 0)
        return UCCL_OK;
    const struct uccl__cuda *cu = uccl__cuda();
    uintptr_t ends[2] = {addr, addr + len - 1};
    for (int i = 0; i < 2; i++) {
        /* the id this byte had at registration: its allocation's, or its
         * chunk's; cuMem memory that could not be exported: mapped is all */
        const struct gpu_seg *sg = info->legacy_ipc || !e ? NULL : seg_of(e, ends[i]);
        uint64_t want = info->legacy_ipc ? info->buffer_id : sg ? sg->buffer_id : 0;
        unsigned long long id = 0;
        int ok = cu && cu->PointerGetAttribute(&id, CU_PA_BUFFER_ID, (cu_ptr)ends[i]) == CU_OK &&
                 (id == want || (!info->legacy_ipc && !e));
        if (!ok)
            return uccl__err(UCCL_ERR_INVALID, "device memory [0x%zx, +%zu) was freed after it "
                             "was registered (the driver's id of the byte at 0x%zx was %llu, is "
                             "now %llu): deregister and register it again", (size_t)addr, len,
                             (size_t)ends[i], (unsigned long long)want, id);
    }
    return UCCL_OK;
}

void uccl__gpu_export_free(struct uccl__gpu_export *e)
{
    if (!e)
        return;
    for (uint32_t i = 0; i < e->nseg; i++)
        if (e->seg[i].fd >= 0)
            close(e->seg[i].fd);
    e->magic = 0; /* a peer reading a stale address sees no record */
    free(e);
}

static int export_chunks(const struct uccl__cuda *cu, uintptr_t addr, size_t len,
                         struct uccl__gpu_export **e_p)
{
    struct uccl__gpu_export *e = NULL;
    uintptr_t p = addr, end = addr + len;
    int rc = UCCL_OK;
    while (p < end && rc == UCCL_OK) {
        uintptr_t mb = 0;
        size_t ms = 0;
        cu_memhandle h;
        int fd = -1;
        cu_result r = cu->PointerGetAttribute(&mb, CU_PA_MAPPING_BASE_ADDR, (cu_ptr)p);
        if (r == CU_OK)
            r = cu->PointerGetAttribute(&ms, CU_PA_MAPPING_SIZE, (cu_ptr)p);
        if (r != CU_OK || ms == 0 || mb > p || (e && mb != e->base + e->size))
            return uccl__gpu_export_free(e), uccl__cuda_err(r ? r : CU_ERR_INVALID_VALUE,
                                                            "finding the chunks of cuMem memory");
        uint32_t n = e ? e->nseg : 0;
        if (n >= MAX_SEGS)
            return uccl__gpu_export_free(e), uccl__err(UCCL_ERR_INVALID, "more than %d chunks",
                                                       MAX_SEGS);
        struct uccl__gpu_export *g = realloc(e, sizeof(*e) + (n + 1) * sizeof(struct gpu_seg));
        if (!g)
            return uccl__gpu_export_free(e), uccl__err(UCCL_ERR_NOMEM, "out of memory");
        if (!e)
            *g = (struct uccl__gpu_export){.magic = EXPORT_MAGIC, .base = mb};
        e = g;
        e->seg[n] = (struct gpu_seg){.base = mb, .size = ms, .fd = -1};
        r = cu->PointerGetAttribute(&e->seg[n].buffer_id, CU_PA_BUFFER_ID, (cu_ptr)p);
        if (r != CU_OK)
            return uccl__gpu_export_free(e), uccl__cuda_err(r, "the id of a cuMem chunk");
        e->nseg = n + 1;
        e->size += ms;
        r = cu->MemRetainAllocationHandle(&h, (void *)p);
        if (r == CU_OK) {
            r = cu->MemExportToShareableHandle(&fd, h, CU_HANDLE_POSIX_FD, 0);
            cu->MemRelease(h); /* the descriptor keeps the chunk for peers */
        }
        if (r != CU_OK)
            rc = uccl__cuda_err(r, "exporting a cuMem chunk as a file descriptor");
        e->seg[n].fd = fd;
        p = mb + ms;
    }
    if (rc) {
        uccl__gpu_export_free(e);
        return rc;
    }
    *e_p = e;
    return UCCL_OK;
}

int uccl__gpu_export_new(uintptr_t addr, size_t len, const struct uccl__gpu_info *info,
                         struct uccl__gpu_export **exp_p)
{
    int rc = uccl__cuda_use(UCCL_MK_DEV(info->mkind)); /* loads the driver, or says why not */
    if (rc)
        return rc;
    const struct uccl__cuda *cu = uccl__cuda();
    struct uccl__gpu_export *e = NULL;
    if (info->legacy_ipc) {
        e = calloc(1, sizeof(*e) + sizeof(struct gpu_seg));
        if (!e)
            return uccl__err(UCCL_ERR_NOMEM, "out of memory");
        *e = (struct uccl__gpu_export){.magic = EXPORT_MAGIC, .base = info->alloc_base,
                                       .size = info->alloc_size, .nseg = 1, .legacy = 1};
        e->seg[0] = (struct gpu_seg){.base = info->alloc_base, .size = info->alloc_size,
                                     .buffer_id = info->buffer_id, .fd = -1};
        cu_result r = cu->IpcGetMemHandle(&e->seg[0].handle, (cu_ptr)info->alloc_base);
        if (r != CU_OK) {
            free(e);
            return uccl__cuda_err(r, "cuIpcGetMemHandle");
        }
    } else if ((rc = export_chunks(cu, addr, len, &e)) != UCCL_OK) {
        return rc;
    }
    e->owner = owner_nonce();
    e->id = info->legacy_ipc ? info->buffer_id : uccl__random64();
    e->dev = UCCL_MK_DEV(info->mkind);
    *exp_p = e;
    return UCCL_OK;
}

/* ------------------------------------------------------------------------- */
/* imports                                                                    */

struct uccl__gpu_import {
    struct uccl__gpu_import *next;
    uint32_t pid;
    uint64_t owner, id;         /* the export's keys */
    int dev;
    uint64_t base, size;
    char *local;              /* where [base, +size) appears in this process */
    int how;                  /* 0 same process, 1 legacy IPC, 2 cuMem mapping */
    cu_memhandle *handles;    /* cuMem: one per chunk */
    uint32_t nseg;
    int refs, dead;
};

/* The process's table (gpu.h says why it is one per process). */
static struct {
    pthread_mutex_t mu;
    struct uccl__gpu_import *head;
    unsigned n;
} imports = {PTHREAD_MUTEX_INITIALIZER, NULL, 0};

/* Maps and unmaps of a peer's memory are the driver calls that may wait for
 * the device (the closer's comment): each one is logged at INFO, and at
 * WARNING where it took SLOW_DRIVER_NS or more, with what it was. */
static void log_driver_call(const char *what, const struct uccl__gpu_import *x, uint64_t t0)
{
    uint64_t ns = uccl__now_ns() - t0;
    UCCL_LOG(ns >= SLOW_DRIVER_NS ? UCCL_LOG_WARNING : UCCL_LOG_INFO,
             "%s pid %u's GPU memory [0x%llx, +%llu) on device %d took %.3f ms%s", what, x->pid,
             (unsigned long long)x->base, (unsigned long long)x->size, x->dev, (double)ns / 1e6,
             ns >= SLOW_DRIVER_NS ? " (the driver waited for the device?)" : "");
}

/* Undo what import_open mapped, in device x->dev's context. */
static void import_unmap(struct uccl__gpu_import *x)
{
    const struct uccl__cuda *cu = uccl__cuda();
    if (cu && x->how && uccl__cuda_use(x->dev) == UCCL_OK) {
        if (x->how == 1) {
            cu->IpcCloseMemHandle((cu_ptr)(uintptr_t)x->local);
        } else {
            if (x->local) {
                cu->MemUnmap((cu_ptr)(uintptr_t)x->local, x->size);
                cu->MemAddressFree((cu_ptr)(uintptr_t)x->local, x->size);
            }
            for (uint32_t i = 0; x->handles && i < x->nseg; i++) /* none: failed early */
                if (x->handles[i])
                    cu->MemRelease(x->handles[i]);
        }
    }
}

static void import_free(struct uccl__gpu_import *x)
{
    free(x->handles);
    free(x);
}

/* ------------------------------------------------------------------------- */
/* the closer: imports are closed on a thread of their own                    */

/* Why: imports are got and put, and so dropped, by the engine thread that
 * serves a peer's write (tp/tp_shm_ipc.c), and cuIpcCloseMemHandle,
 * cuMemUnmap and cuMemRelease may wait for kernels running on the device,
 * while a GPU ring's kernel spins on the device until its puts complete: a
 * serving thread blocked in a close would wait for a kernel that waits for
 * it (benchmarks/ipc_close_probe.py asks the driver whether it waits).  So
 * no close runs on the caller's thread: one detached thread per process,
 * started by the first close, makes the device current and closes what is
 * queued, in order.
 *
 * Closed late, the same memory must not be opened again while its close is
 * queued or running: the driver opens one IPC handle once per context, and
 * a close that ran after the reopen would unmap what the new import hands
 * out.  So an import stays at the head of the queue while it is closed (and
 * is freed after), and uccl__gpu_import_get, before it opens anything,
 * waits on `done` (without imports.mu, CLOSE_WAIT_NS at most) until no
 * queued or running close has the same (pid, base, device).  Every close is
 * queued under imports.mu, as the opens are made, so no close of what a
 * getter found not pending can be queued before its open is done.
 *
 * Where the thread cannot be started, a close runs where it is queued, as
 * before the closer (under imports.mu).  Nothing stops the thread: at exit
 * the driver releases what is left, and what is still queued stays
 * reachable from `closer` (no leak to report, no exit handler to block). */
#define CLOSE_WAIT_NS (10ull * 1000000000ull)

static struct {
    pthread_once_t once;           /* the condition variables' init */
    pthread_mutex_t mu;            /* taken after imports.mu, never before */
    pthread_cond_t work, done;     /* something is queued; a close finished */
    struct uccl__gpu_import *head, *tail; /* the head is being closed */
    int started;
} closer = {.once = PTHREAD_ONCE_INIT, .mu = PTHREAD_MUTEX_INITIALIZER};

static void closer_init(void)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* uccl__now_ns deadlines */
    pthread_cond_init(&closer.work, &ca);
    pthread_cond_init(&closer.done, &ca);
    pthread_condattr_destroy(&ca);
}

static void *closer_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&closer.mu);
    for (;;) {
        while (!closer.head)
            pthread_cond_wait(&closer.work, &closer.mu);
        struct uccl__gpu_import *x = closer.head;
        pthread_mutex_unlock(&closer.mu);
        uint64_t t0 = uccl__now_ns();
        import_unmap(x); /* may wait for the device: no lock held */
        log_driver_call("closing", x, t0);
        pthread_mutex_lock(&closer.mu);
        closer.head = x->next;
        if (!closer.head)
            closer.tail = NULL;
        pthread_cond_broadcast(&closer.done);
        import_free(x);
    }
    return NULL;
}

/* Under imports.mu: x is out of the table and nobody copies through it. */
static void import_close(struct uccl__gpu_import *x)
{
    if (!x->how) { /* nothing mapped: no driver call to wait for */
        import_free(x);
        return;
    }
    pthread_mutex_lock(&closer.mu);
    if (!closer.started) {
        pthread_once(&closer.once, closer_init);
        pthread_attr_t a;
        pthread_t th;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        closer.started = pthread_create(&th, &a, closer_main, NULL) == 0;
        pthread_attr_destroy(&a);
    }
    int queued = closer.started;
    if (queued) {
        x->next = NULL;
        if (closer.tail)
            closer.tail->next = x;
        else
            closer.head = x;
        closer.tail = x;
        pthread_cond_signal(&closer.work);
    }
    pthread_mutex_unlock(&closer.mu);
    if (!queued) {
        uint64_t t0 = uccl__now_ns();
        import_unmap(x);
        log_driver_call("closing (no closer thread)", x, t0);
        import_free(x);
    }
}

/* Under closer.mu: is a close of the import of (pid, base, dev) queued or
 * running? */
static int close_pending(uint32_t pid, uint64_t base, int dev)
{
    for (const struct uccl__gpu_import *x = closer.head; x; x = x->next)
        if (x->pid == pid && x->base == base && x->dev == dev)
            return 1;
    return 0;
}

/* Under closer.mu (released on return), imports.mu not held: wait until no
 * close of (pid, base, dev) is queued or running, until deadline at most. */
static int close_wait(uint32_t pid, uint64_t base, int dev, uint64_t deadline)
{
    int rc = UCCL_OK;
    while (close_pending(pid, base, dev)) {
        if (uccl__now_ns() >= deadline) {
            rc = uccl__err(UCCL_ERR_TIMEOUT, "pid %u's GPU memory at 0x%llx (device %d): its "
                           "earlier mapping was still being closed after %llu s (the driver "
                           "waits for a kernel?)", pid, (unsigned long long)base, dev,
                           CLOSE_WAIT_NS / 1000000000ull);
            break;
        }
        struct timespec ts = {.tv_sec = (time_t)(deadline / 1000000000ull),
                              .tv_nsec = (long)(deadline % 1000000000ull)};
        pthread_cond_timedwait(&closer.done, &closer.mu, &ts);
    }
    pthread_mutex_unlock(&closer.mu);
    return rc;
}

static int peer_read(uint32_t pid, uint64_t addr, void *dst, size_t len)
{
    struct iovec l = {dst, len}, r = {(void *)(uintptr_t)addr, len};
    ssize_t n = process_vm_readv((pid_t)pid, &l, 1, &r, 1, 0);
    if (n != (ssize_t)len)
        return uccl__err(UCCL_ERR_PROTO, "reading the peer's GPU export record at 0x%llx "
                         "(pid %u): %s", (unsigned long long)addr, pid,
                         n < 0 ? strerror(errno) : "short read");
    return UCCL_OK;
}

/* Map the chunks of a cuMem export contiguously: reserve its span, map
 * each chunk (taken from the owner with pidfd_getfd) at its offset. */
static int map_chunks(const struct uccl__cuda *cu, struct uccl__gpu_import *x,
                      const struct gpu_seg *segs)
{
    int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)x->pid, 0);
    if (pidfd < 0)
        return uccl__err(UCCL_ERR_UNAVAIL, "pidfd_open(%u) for a GPU export: %s", x->pid,
                         strerror(errno));
    int rc = UCCL_OK;
    cu_ptr va = 0;
    cu_result r = cu->MemAddressReserve(&va, x->size, 0, 0, 0);
    if (r != CU_OK) {
        close(pidfd);
        return uccl__cuda_err(r, "reserving address space for a peer's GPU memory");
    }
    x->local = (char *)(uintptr_t)va;
    x->handles = calloc(x->nseg, sizeof(*x->handles));
    if (!x->handles)
        rc = uccl__err(UCCL_ERR_NOMEM, "out of memory");
    uint64_t off = 0;
    for (uint32_t i = 0; rc == UCCL_OK && i < x->nseg; off += segs[i].size, i++) {
        int fd = (int)syscall(SYS_pidfd_getfd, pidfd, segs[i].fd, 0);
        if (fd < 0) {
            rc = uccl__err(UCCL_ERR_UNAVAIL, "pidfd_getfd(pid %u, fd %d) for a GPU export: %s",
                           x->pid, segs[i].fd, strerror(errno));
            break;
        }
        r = cu->MemImportFromShareableHandle(&x->handles[i], (void *)(uintptr_t)fd,
                                             CU_HANDLE_POSIX_FD);
        close(fd);
        if (r == CU_OK)
            r = cu->MemMap(va + off, segs[i].size, 0, x->handles[i], 0);
        if (r != CU_OK)
            rc = uccl__cuda_err(r, "mapping a peer's cuMem chunk");
    }
    close(pidfd);
    if (rc == UCCL_OK) {
        cu_mem_access acc = {{CU_LOCATION_DEVICE, x->dev}, CU_ACCESS_READWRITE};
        r = cu->MemSetAccess(va, x->size, &acc, 1);
        if (r != CU_OK)
            rc = uccl__cuda_err(r, "granting access to a peer's cuMem memory");
    }
    if (rc) { /* unmap what was mapped: import_unmap unmaps the whole span */
        for (uint32_t i = 0; x->handles && i < x->nseg; i++)
            if (x->handles[i])
                cu->MemUnmap(va + (cu_ptr)(segs[i].base - x->base), segs[i].size);
        cu->MemAddressFree(va, x->size);
        x->local = NULL;
    }
    return rc;
}

static int import_open(struct uccl__gpu_import *x, uint64_t rec_addr,
                       const struct uccl__gpu_export *hdr)
{
    if (x->pid == (uint32_t)getpid()) { /* a connection to ourselves */
        x->local = (char *)(uintptr_t)x->base;
        return UCCL_OK;
    }
    int rc = uccl__cuda_use(x->dev); /* loads the driver, or says why not */
    if (rc)
        return rc;
    const struct uccl__cuda *cu = uccl__cuda();
    size_t bytes = (size_t)hdr->nseg * sizeof(struct gpu_seg);
    struct gpu_seg *segs = malloc(bytes);
    if (!segs)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    rc = peer_read(x->pid, rec_addr + offsetof(struct uccl__gpu_export, seg), segs, bytes);
    uint64_t at = x->base;
    for (uint32_t i = 0; rc == UCCL_OK && i < hdr->nseg; at += segs[i].size, i++)
        if (segs[i].base != at || segs[i].size == 0 || segs[i].size > x->base + x->size - at)
            rc = uccl__err(UCCL_ERR_PROTO, "peer's GPU export record: chunk %u [0x%llx, +%llu) "
                           "out of place", i, (unsigned long long)segs[i].base,
                           (unsigned long long)segs[i].size);
    if (rc == UCCL_OK && at != x->base + x->size)
        rc = uccl__err(UCCL_ERR_PROTO, "peer's GPU export record: chunks do not fill its span");
    if (rc == UCCL_OK && hdr->legacy) {
        cu_ptr p = 0, b = 0;
        size_t sz = 0;
        cu_result r = cu->IpcOpenMemHandle(&p, segs[0].handle, CU_IPC_LAZY_PEER_ACCESS);
        if (r != CU_OK) {
            rc = uccl__cuda_err(r, "cuIpcOpenMemHandle of the peer's GPU memory");
        } else {
            x->how = 1;
            x->local = (char *)(uintptr_t)p;
            /* The mapping, not the peer's word, bounds what we touch. */
            if (cu->MemGetAddressRange(&b, &sz, p) != CU_OK || b != p || sz < x->size)
                rc = uccl__err(UCCL_ERR_PROTO, "peer's GPU export claims %llu bytes, its "
                               "mapping has %zu", (unsigned long long)x->size, sz);
        }
    } else if (rc == UCCL_OK) {
        x->how = 2;
        rc = map_chunks(cu, x, segs);
    }
    free(segs);
    return rc;
}

/* Under imports.mu: forget x (closed now if nobody copies through it, else
 * by the last uccl__gpu_import_put). */
static void import_drop(struct uccl__gpu_import **link, const char *why)
{
    struct uccl__gpu_import *x = *link;
    LOG_INFO("dropping the mapping of pid %u's GPU memory [0x%llx, +%llu) on device %d (%s; "
             "%u copies still use it)", x->pid, (unsigned long long)x->base,
             (unsigned long long)x->size, x->dev, why, x->refs);
    *link = x->next;
    imports.n--;
    x->dead = 1;
    if (x->refs == 0)
        import_close(x);
}

int uccl__gpu_import_get(uint32_t pid, uint64_t rec_addr, uint64_t addr, size_t len, int dev,
                         void **ptr_p, struct uccl__gpu_import **imp_p)
{
    struct uccl__gpu_export hdr;
    int rc = peer_read(pid, rec_addr, &hdr, sizeof(hdr));
    if (rc)
        return rc;
    if (hdr.magic != EXPORT_MAGIC || hdr.nseg == 0 || hdr.nseg > MAX_SEGS || hdr.legacy > 1 ||
        (hdr.legacy && hdr.nseg != 1) || hdr.base + hdr.size < hdr.base || hdr.size == 0)
        return uccl__err(UCCL_ERR_PROTO, "no valid GPU export record at 0x%llx of pid %u "
                         "(deregistered?)", (unsigned long long)rec_addr, pid);
    if (addr < hdr.base || addr - hdr.base > hdr.size || len > hdr.size - (addr - hdr.base))
        return uccl__err(UCCL_ERR_PROTO, "peer's GPU range [0x%llx, +%zu) is outside its "
                         "export [0x%llx, +%llu)", (unsigned long long)addr, len,
                         (unsigned long long)hdr.base, (unsigned long long)hdr.size);
    uint64_t deadline = 0;
    pthread_mutex_lock(&imports.mu);
    struct uccl__gpu_import *x;
    for (;;) {
        x = imports.head;
        while (x && !(x->pid == pid && x->owner == hdr.owner && x->id == hdr.id && x->dev == dev))
            x = x->next;
        if (x) {
            x->refs++;
            pthread_mutex_unlock(&imports.mu);
            *ptr_p = x->local + (addr - x->base);
            *imp_p = x;
            return UCCL_OK;
        }
        /* Not while a close of the same memory is under way (the closer's
         * comment says why); the table may have it when we come back. */
        pthread_mutex_lock(&closer.mu);
        if (!close_pending(pid, hdr.base, dev)) {
            pthread_mutex_unlock(&closer.mu);
            break;
        }
        pthread_mutex_unlock(&imports.mu);
        if (!deadline) {
            deadline = uccl__now_ns() + CLOSE_WAIT_NS;
            LOG_INFO("opening pid %u's GPU memory at 0x%llx on device %d waits for its earlier "
                     "mapping's close", pid, (unsigned long long)hdr.base, dev);
        }
        if ((rc = close_wait(pid, hdr.base, dev, deadline)) != UCCL_OK)
            return rc;
        pthread_mutex_lock(&imports.mu);
    }
    /* Opened under the lock: the driver may refuse to open one IPC handle
     * twice in a context, so two threads must not race to it. */
    x = calloc(1, sizeof(*x));
    if (!x) {
        pthread_mutex_unlock(&imports.mu);
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    *x = (struct uccl__gpu_import){.pid = pid, .owner = hdr.owner, .id = hdr.id, .dev = dev,
                                   .base = hdr.base, .size = hdr.size, .nseg = hdr.nseg,
                                   .refs = 1};
    uint64_t t0 = uccl__now_ns();
    rc = import_open(x, rec_addr, &hdr);
    log_driver_call(rc ? "failing to open" : "opening", x, t0);
    if (rc) {
        import_close(x);
        pthread_mutex_unlock(&imports.mu);
        return rc;
    }
    /* Another export of the owner over the same addresses: a cudaMalloc
     * allocation with another id was freed (its address is reused); a cuMem
     * export over the same chunks maps them again and may go (both may be
     * live: its next use maps them anew). */
    for (struct uccl__gpu_import **l = &imports.head; *l;) {
        struct uccl__gpu_import *o = *l;
        if (o->pid == pid && o->owner == x->owner && o->id != x->id &&
            o->base < x->base + x->size && x->base < o->base + o->size)
            import_drop(l, "another export over its addresses");
        else
            l = &o->next;
    }
    while (imports.n >= MAX_IMPORTS) { /* drop the oldest (the list's tail) */
        struct uccl__gpu_import **l = &imports.head;
        while ((*l)->next)
            l = &(*l)->next;
        import_drop(l, "the table is full");
    }
    x->next = imports.head;
    imports.head = x;
    imports.n++;
    pthread_mutex_unlock(&imports.mu);
    *ptr_p = x->local + (addr - x->base);
    *imp_p = x;
    return UCCL_OK;
}

void uccl__gpu_import_put(struct uccl__gpu_import *x)
{
    if (!x)
        return;
    pthread_mutex_lock(&imports.mu);
    if (--x->refs == 0 && x->dead) /* queued under the lock: the closer says why */
        import_close(x);
    pthread_mutex_unlock(&imports.mu);
}

/* ------------------------------------------------------------------------- */
/* GPUs by PCI bus id                                                          */

int uccl_gpu_bus_id(int dev, char out[32])
{
    int rc = uccl__cuda_init();
    if (rc)
        return rc;
    const struct uccl__cuda *cu = uccl__cuda();
    int n = 0;
    cu_device d;
    if (cu->DeviceGetCount(&n) != CU_OK || dev < 0 || dev >= n || cu->DeviceGet(&d, dev) != CU_OK)
        return uccl__err(UCCL_ERR_NOTFOUND, "no CUDA device %d (this host has %d)", dev, n);
    cu_result r = cu->DeviceGetPCIBusId(out, 32, d);
    if (r != CU_OK)
        return uccl__cuda_err(r, "cuDeviceGetPCIBusId");
    out[31] = '\0';
    for (char *c = out; *c; c++) /* the driver spells hex digits in upper case */
        if (*c >= 'A' && *c <= 'F')
            *c = (char)(*c - 'A' + 'a');
    return UCCL_OK;
}

int uccl_gpu_of_bus_id(const char *bdf, int *dev_p)
{
    int rc = uccl__cuda_init();
    if (rc)
        return rc;
    const struct uccl__cuda *cu = uccl__cuda();
    cu_device d;
    if (cu->DeviceGetByPCIBusId(&d, bdf) != CU_OK)
        return uccl__err(UCCL_ERR_NOTFOUND, "no CUDA device of this host has PCI bus id '%s'",
                         bdf);
    *dev_p = (int)d; /* a CUdevice is its ordinal */
    return UCCL_OK;
}
