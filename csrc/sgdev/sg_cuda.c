/* The CUDA device of stream-ordered groups (sg_dev.h): stream memory
 * operations batched into one driver call (cuStreamBatchMemOp, else one
 * call each), copies on the copy engine (cuMemcpyAsync), events, and the
 * kernels of sg_kernels.c compiled by NVRTC on first use and launched (one
 * module per device, and per element type for the reduction's, kept for
 * the life of the process: a kernel queued by a failed group may still
 * run).  Memory is shared through the endpoint:
 * registrations, the keys of their export records, CUDA IPC mappings
 * checked against them (ipc_share.c). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "load/cuda_loader.h"
#include "gpu/gpu.h"
#include "sgdev/sg_kernels.h"
#include "sgdev/sg_dev.h"
#include "base/config.h"
#include "base/log.h"
#include "base/status.h"

#define MAX_DEVS 64
#define THREADS 256

/* CUstreamBatchMemOpParams (cuda.h): a union of 48 bytes */
union batch_op {
    struct {
        uint32_t operation, pad0;
        uint64_t address;
        uint64_t value;     /* value (32-bit) or value64 */
        uint32_t flags, pad1;
        uint64_t alias;
    } v;
    uint64_t pad[6];
};
_Static_assert(sizeof(union batch_op) == 48, "CUstreamBatchMemOpParams is 48 bytes");
enum { OP_WAIT_32 = 1, OP_WRITE_32 = 2, CU_ERR_NOT_SUPPORTED = 801 };

struct cuda_dev {
    uccl_ep_t *ep;
    int dev, rank, size;
    uint64_t *conns;
    int batch_off;            /* the driver refused a batch: one call per operation */
    uccl_kernel_t *copy_k;    /* copies of one phase in one launch, or NULL */
    size_t kernel_copy_bytes; /* ... when they move at most this (UCCL_SG_KERNEL_COPY_BYTES) */
    size_t gather_bytes;      /* one-phase rounds as one launch up to this (cuda_gather) */
    /* the handshake and gather kernels, and how many gather blocks fit an
     * SM (-1: the driver cannot tell), found at the group's first use:
     * the group's calls are one at a time, so no lock is taken per call */
    uccl_kernel_t *sync_k, *gather_k;
    int gather_fit;
    int fz_scope;             /* spinning launches' fences: 0 not known yet, FENCE_GPU, FENCE_SYS */
    cu_stream zero_stream;    /* where cuda_alloc zeroes, made at its first call */
};

/* The one-launch round's grid (cuda_fused). */
#define FUSED_BLOCKS 32
#define FUSED_THREADS 256
enum { FENCE_GPU = 1, FENCE_SYS = 2 }; /* cuda_dev.fz_scope */

static const char *const dt_names[UCCL_DT_COUNT] = {
    [UCCL_DT_F32] = "F32", [UCCL_DT_F64] = "F64", [UCCL_DT_F16] = "F16",
    [UCCL_DT_BF16] = "BF16", [UCCL_DT_I8] = "I8", [UCCL_DT_U8] = "U8", [UCCL_DT_I16] = "I16",
    [UCCL_DT_I32] = "I32", [UCCL_DT_I64] = "I64", [UCCL_DT_BOOL] = "BOOLT",
};

/* Compiled kernels, per device and element type, for the life of the process. */
static struct {
    pthread_mutex_t mu;
    uccl_kernel_t *k[MAX_DEVS][UCCL_DT_COUNT];
    uccl_kernel_t *fused[MAX_DEVS][UCCL_DT_COUNT], *cfused[MAX_DEVS][UCCL_DT_COUNT],
        *cll[MAX_DEVS][UCCL_DT_COUNT];
    char fused_failed[MAX_DEVS][UCCL_DT_COUNT], cfused_failed[MAX_DEVS][UCCL_DT_COUNT],
        cll_failed[MAX_DEVS][UCCL_DT_COUNT];
    uccl_kernel_t *copy[MAX_DEVS], *sync[MAX_DEVS], *gather[MAX_DEVS], *eops[MAX_DEVS];
    char copy_failed[MAX_DEVS], sync_failed[MAX_DEVS], gather_failed[MAX_DEVS],
        eops_failed[MAX_DEVS];
    int sms[MAX_DEVS];
} kernels = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* Under kernels.mu: the device's SM count (grid sizes), once. */
static void read_sms(int dev)
{
    cu_device d;
    const struct uccl__cuda *cu = uccl__cuda();
    if (kernels.sms[dev])
        return;
    if (cu->DeviceGet(&d, dev) != CU_OK ||
        cu->DeviceGetAttribute(&kernels.sms[dev], CU_DEV_ATTR_SM_COUNT, d) != CU_OK ||
        kernels.sms[dev] < 1)
        kernels.sms[dev] = 32;
}

/* This thread's capture mode made relaxed for driver calls that a capture
 * in global mode refuses (a memory handle exported or opened, a module
 * loaded): a round captured in a CUDA graph does its host part (this
 * rank's buffers registered, the peers' mapped, a kernel's first load)
 * while the caller's stream captures, as torch's allocator relaxes it for
 * cudaMalloc.  Returns the mode to put back, or -1 (no such driver call). */
static int relax(void)
{
    const struct uccl__cuda *cu = uccl__cuda();
    int mode = 2; /* CU_STREAM_CAPTURE_MODE_RELAXED */
    if (!cu || !cu->ThreadExchangeStreamCaptureMode ||
        cu->ThreadExchangeStreamCaptureMode(&mode) != CU_OK)
        return -1;
    return mode;
}

static void unrelax(int mode)
{
    if (mode >= 0)
        uccl__cuda()->ThreadExchangeStreamCaptureMode(&mode);
}

/* Under kernels.mu: the module of the parts (sg_kernels.h, NULL-ended),
 * after "#define UCCL_DT <type>" where dtype >= 0, compiled for device dev;
 * its kernel `name`. */
static int compile_parts(int dev, int dtype, const char *const *parts, const char *name,
                         uccl_kernel_t **k_p)
{
    size_t len = 64;
    for (int i = 0; parts[i]; i++)
        len += strlen(parts[i]);
    char *src = malloc(len);
    if (!src)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    size_t at = 0;
    src[0] = '\0';
    if (dtype >= 0)
        at = (size_t)snprintf(src, len, "#define UCCL_DT %s\n", dt_names[dtype]);
    for (int i = 0; parts[i]; i++)
        at += (size_t)snprintf(src + at, len - at, "%s", parts[i]);
    int m = relax(); /* a first use may come in a captured round */
    int rc = uccl_gpu_compile(dev, src, name, 0, NULL, NULL, 0, NULL, NULL, 0, k_p);
    unrelax(m);
    free(src);
    if (rc == UCCL_OK)
        read_sms(dev);
    return rc;
}

/* A kernel for device dev (for element type dtype, or -1: of none),
 * compiled once (*slot), or NULL where it cannot be (no NVRTC: *failed,
 * not tried again). */
static uccl_kernel_t *once_kernel(int dev, int dtype, const char *const *parts,
                                  const char *name, uccl_kernel_t **slot, char *failed)
{
    pthread_mutex_lock(&kernels.mu);
    if (!*slot && !*failed && compile_parts(dev, dtype, parts, name, slot) != UCCL_OK)
        *failed = 1;
    uccl_kernel_t *k = *slot;
    pthread_mutex_unlock(&kernels.mu);
    return k;
}

/* The copy kernel, compiled at the first group; without it copies go one
 * by one on the copy engine. */
static uccl_kernel_t *copy_kernel(int dev)
{
    static const char *const parts[] = {uccl__sg_prelude_src, uccl__sg_copy_fn_src,
                                        uccl__sg_copy_src, NULL};
    return once_kernel(dev, -1, parts, "uccl_sg_copy", &kernels.copy[dev],
                       &kernels.copy_failed[dev]);
}

int uccl_sg_kernel_ready(int dev, int dtype)
{
    if (dev < 0 || dev >= MAX_DEVS || !uccl_dtype_size(dtype))
        return uccl__err(UCCL_ERR_INVALID, "reduction kernel: device %d, type %d", dev, dtype);
    static const char *const parts[] = {uccl__sg_prelude_src, uccl__sg_reduce_src, NULL};
    pthread_mutex_lock(&kernels.mu);
    int rc = kernels.k[dev][dtype] ? UCCL_OK
                                   : compile_parts(dev, dtype, parts, "uccl_sg_reduce",
                                                   &kernels.k[dev][dtype]);
    pthread_mutex_unlock(&kernels.mu);
    return rc;
}

/* NULL where it cannot be built (no NVRTC, a GPU older than sm_70): the
 * round then queues its steps one by one (sg_round.c), once tried. */
static uccl_kernel_t *fused_kernel(int dev, int dtype)
{
    static const char *const parts[] = {uccl__sg_prelude_src, uccl__sg_reduce_src,
                                        uccl__sg_copy_fn_src, uccl__sg_fused_src, NULL};
    return once_kernel(dev, dtype, parts, "uccl_sg_fused", &kernels.fused[dev][dtype],
                       &kernels.fused_failed[dev][dtype]);
}

/* The captured one-launch round's (sg_kernels.c, uccl_sg_cfused). */
static uccl_kernel_t *cfused_kernel(int dev, int dtype)
{
    static const char *const parts[] = {uccl__sg_prelude_src, uccl__sg_reduce_src,
                                        uccl__sg_copy_fn_src, uccl__sg_fused_src,
                                        uccl__sg_cfused_src, NULL};
    return once_kernel(dev, dtype, parts, "uccl_sg_cfused", &kernels.cfused[dev][dtype],
                       &kernels.cfused_failed[dev][dtype]);
}

/* ... and its LL form (uccl_sg_cll). */
static uccl_kernel_t *cll_kernel(int dev, int dtype)
{
    static const char *const parts[] = {uccl__sg_prelude_src, uccl__sg_reduce_src,
                                        uccl__sg_copy_fn_src, uccl__sg_fused_src,
                                        uccl__sg_cll_src, NULL};
    return once_kernel(dev, dtype, parts, "uccl_sg_cll", &kernels.cll[dev][dtype],
                       &kernels.cll_failed[dev][dtype]);
}

/* Operations counted from an epoch, or bumps: one launch of uccl_sg_eops. */
static int epoch_ops(struct cuda_dev *d, uintptr_t stream, const struct uccl__sg_memop *ops, int n)
{
    static const char *const parts[] = {uccl__sg_prelude_src, uccl__sg_eops_src, NULL};
    if (n > UCCL__K_EOPS)
        return uccl__err(UCCL_ERR_INVALID, "%d memory operations counted from an epoch in one "
                         "launch (at most %d)", n, UCCL__K_EOPS);
    uccl_kernel_t *k = once_kernel(d->dev, -1, parts, "uccl_sg_eops", &kernels.eops[d->dev],
                                   &kernels.eops_failed[d->dev]);
    if (!k)
        return uccl__err(UCCL_ERR_UNAVAIL, "captured rounds need the uccl_sg_eops kernel, "
                         "which did not compile: %s", uccl_last_error());
    struct uccl__k_eops a; /* 1.7 KB; cuLaunchKernel copies it */
    memset(&a, 0, sizeof(a));
    for (int i = 0; i < n; i++) {
        a.addr[i] = (uint64_t)(uintptr_t)ops[i].addr;
        a.epoch[i] = (uint64_t)(uintptr_t)ops[i].epoch;
        a.value[i] = ops[i].value;
        a.kind[i] = ops[i].wait;
    }
    a.n = n;
    void *params[] = {&a};
    return uccl__gpu_launch_unchecked(k, 1, 1, 1, stream, params);
}

static int cuda_memops(void *dp, uintptr_t stream, const struct uccl__sg_memop *ops, int n)
{
    struct cuda_dev *d = dp;
    const struct uccl__cuda *cu = uccl__cuda();
    int rc = n > 0 ? uccl__cuda_use(d->dev) : UCCL_OK; /* the caller's thread may have none current */
    if (n <= 0 || rc)
        return rc;
    for (int i = 0; i < n; i++)
        if (ops[i].epoch || ops[i].wait == UCCL__SG_BUMP)
            return epoch_ops(d, stream, ops, n);
    if (cu->StreamBatchMemOp && !d->batch_off && n > 1) {
        union batch_op b[2 * UCCL_SG_MAX_RANKS + 2];
        if (n > (int)(sizeof(b) / sizeof(b[0])))
            return uccl__err(UCCL_ERR_INVALID, "%d stream memory operations in one batch", n);
        memset(b, 0, (size_t)n * sizeof(b[0]));
        for (int i = 0; i < n; i++) {
            b[i].v.operation = ops[i].wait ? OP_WAIT_32 : OP_WRITE_32;
            b[i].v.address = (uint64_t)(uintptr_t)ops[i].addr;
            b[i].v.value = ops[i].value;
            b[i].v.flags = ops[i].wait ? CU_STREAM_WAIT_VALUE_GEQ : 0;
        }
        cu_result r = cu->StreamBatchMemOp((cu_stream)stream, (unsigned)n, b, 0);
        if (r == CU_OK)
            return UCCL_OK;
        if (r != CU_ERR_NOT_SUPPORTED)
            return uccl__cuda_err(r, "cuStreamBatchMemOp");
        d->batch_off = 1;
    }
    for (int i = 0; i < n; i++) {
        cu_ptr a = (cu_ptr)(uintptr_t)ops[i].addr;
        /* writes: flags 0, a fence first, so what the stream wrote before
         * (kernels, copies) is visible to whoever sees the value */
        cu_result r = ops[i].wait
                          ? cu->StreamWaitValue32((cu_stream)stream, a, ops[i].value,
                                                  CU_STREAM_WAIT_VALUE_GEQ)
                          : cu->StreamWriteValue32((cu_stream)stream, a, ops[i].value, 0);
        if (r != CU_OK)
            return uccl__cuda_err(r, ops[i].wait ? "cuStreamWaitValue32" : "cuStreamWriteValue32");
    }
    return UCCL_OK;
}

/* The bytes the n copies move in all, and the longest one's. */
static size_t copy_span(const struct uccl_sg_copy *cs, int n, size_t *longest_p)
{
    size_t total = 0, longest = 0;
    for (int i = 0; i < n; i++) {
        total += cs[i].len;
        longest = cs[i].len > longest ? cs[i].len : longest;
    }
    *longest_p = longest;
    return total;
}

static int cuda_copies(void *dp, uintptr_t stream, const struct uccl_sg_copy *cs, int n)
{
    struct cuda_dev *d = dp;
    size_t longest, total = copy_span(cs, n, &longest);
    uccl_kernel_t *k = n <= UCCL__K_COPY_SEGS && total <= d->kernel_copy_bytes ? d->copy_k : NULL;
    if (k) {
        struct uccl__k_copy a;
        memset(&a, 0, sizeof(a));
        for (int i = 0; i < n; i++) {
            a.dst[i] = cs[i].dst;
            a.src[i] = cs[i].src;
            a.len[i] = cs[i].len;
        }
        a.n = n;
        size_t blocks = (longest / 16 + THREADS) / THREADS, cap = (size_t)kernels.sms[d->dev] * 4;
        void *params[] = {&a};
        return uccl__gpu_launch_unchecked(k, (unsigned)(blocks < cap ? blocks : cap), (unsigned)n,
                                          THREADS, stream, params);
    }
    for (int i = 0; i < n; i++) {
        cu_result r = uccl__cuda()->MemcpyAsync((cu_ptr)cs[i].dst, (cu_ptr)cs[i].src, cs[i].len,
                                                (cu_stream)stream);
        if (r != CU_OK)
            return uccl__cuda_err(r, "cuMemcpyAsync on the group's stream");
    }
    return UCCL_OK;
}

static int cuda_reduce(void *dp, uintptr_t stream, const struct uccl__sg_red_args *a)
{
    struct cuda_dev *d = dp;
    int rc = uccl_sg_kernel_ready(d->dev, a->dtype);
    if (rc)
        return rc;
    struct uccl__k_reduce ka = {.out = a->out, .count = a->count, .nsrc = a->nsrc, .op = a->op};
    int aligned = (a->out & 15) == 0;
    for (int r = 0; r < a->nsrc; r++) {
        ka.src[r] = a->src[r];
        aligned = aligned && (a->src[r] & 15) == 0;
    }
    size_t per = aligned ? 16 / uccl_dtype_size(a->dtype) : 1;
    size_t items = (a->count + per - 1) / per;
    size_t blocks = (items + THREADS - 1) / THREADS, cap = (size_t)kernels.sms[d->dev] * 8;
    if (blocks > cap)
        blocks = cap;
    void *params[] = {&ka};
    return uccl__gpu_launch_unchecked(kernels.k[d->dev][a->dtype], (unsigned)(blocks ? blocks : 1),
                                      1, THREADS, stream, params);
}

/* Is a peer's arena memory of this rank's GPU (ranks that are processes
 * sharing it)?  Where every peer's is, the launches that spin on the arenas'
 * words fence at the GPU's scope only. */
static int on_gpu(const struct cuda_dev *d, uintptr_t p)
{
    int ord = -1;
    return uccl__cuda()->PointerGetAttribute(&ord, CU_PA_DEVICE_ORDINAL, (cu_ptr)p) == CU_OK &&
           ord == d->dev;
}

/* Whether the group's spinning launches fence at the system's scope, decided
 * at the first from the peers' arena words (peer[me] is not looked at):
 * the arenas stay mapped for the group's life. */
static int fence_sys(struct cuda_dev *d, const uintptr_t *peer, int n, int me)
{
    if (!d->fz_scope) {
        int gpu = 1;
        for (int r = 0; r < n; r++)
            gpu = gpu && (r == me || on_gpu(d, peer[r]));
        d->fz_scope = gpu ? FENCE_GPU : FENCE_SYS;
        /* the reading is of the peers' IPC mappings: with peers on other
         * GPUs too it has been seen to say "this GPU" (docs/benchmark-log.md) */
        LOG_INFO("stream-ordered group (rank %d, cuda:%d): its spinning launches fence at "
                 "the %s's scope", d->rank, d->dev, gpu ? "GPU" : "system");
    }
    return d->fz_scope == FENCE_SYS;
}

/* A captured round (a->epoch) pushes its bytes into the peers' memory and
 * always fences at the system's scope: with fence_sys's choice, a peer on
 * another H200 read part of its slot still zero after the flag. */
static int cuda_fused(void *dp, uintptr_t stream, const struct uccl__sg_fused_args *a)
{
    struct cuda_dev *d = dp;
    int dt = a->gather ? UCCL_DT_U8 : a->dtype, rc = uccl__cuda_use(d->dev);
    if (rc)
        return rc;
    if (a->nsrc > UCCL_SG_FUSED_RANKS || !uccl_dtype_size(dt))
        return uccl__err(UCCL_ERR_INVALID, "one-launch round: %d ranks, type %d", a->nsrc, dt);
    /* The steps instead (UCCL_ERR_UNAVAIL) where the kernel cannot be built,
     * or for an in-place all_reduce that is not 16-byte aligned: the
     * launch's staging and its reduction then split the bytes between its
     * blocks differently, and one block could overwrite input another is
     * still to stage. */
    if (!a->epoch && !a->gather && a->in == a->out && (a->in & 15))
        return UCCL_ERR_UNAVAIL;
    /* (a first compile and load in a capture: compile_parts relaxes it) */
    uccl_kernel_t *k = !a->epoch ? fused_kernel(d->dev, dt)
                       : a->ll   ? cll_kernel(d->dev, dt) : cfused_kernel(d->dev, dt);
    if (!k)
        return a->epoch ? uccl__err(UCCL_ERR_UNAVAIL, "a captured one-launch round needs the "
                                    "%s kernel, which did not compile: %s",
                                    a->ll ? "uccl_sg_cll" : "uccl_sg_cfused",
                                    uccl_last_error())
                        : UCCL_ERR_UNAVAIL;
    struct uccl__k_fused fa = {.in = a->in, .out = a->out, .ctr = a->ctr, .nbytes = a->nbytes,
                            .count = a->count, .fin = (uint64_t)(uintptr_t)a->fin,
                            .failed = (uint64_t)(uintptr_t)a->failed,
                            .epoch = (uint64_t)(uintptr_t)a->epoch, .flip = a->flip, .k = a->k,
                            .gather = a->gather, .op = a->op, .n = a->nsrc, .me = a->me,
                            .sys = a->epoch ? 1 : fence_sys(d, a->dready, a->nsrc, a->me)};
    for (int r = 0; r < a->nsrc; r++) {
        fa.slot[r] = a->slot[r];
        fa.ready[r] = (uint64_t)(uintptr_t)a->ready[r];
        fa.dready[r] = a->dready[r];
    }
    /* a block per 8 KiB (two 16-byte loads a thread), up to FUSED_BLOCKS, and
     * for the group's launches together one block per SM: they spin, so on a
     * GPU the ranks share they must all be resident at once, and a block of
     * FUSED_THREADS fits an SM whatever its registers.  1 MiB all_reduce,
     * the launches' own time per call on an H200 under MPS (fused_probe.py,
     * docs/benchmark-log.md): 2 ranks 14.6 us with 16 blocks, 12.6 with 32, 11.3
     * with 64; 4 ranks 28.3 with 16, 25.4 with 32 */
    size_t cap = (size_t)kernels.sms[d->dev] / (size_t)a->nsrc; /* set by fused_kernel */
    cap = cap < 1 ? 1 : cap > FUSED_BLOCKS ? FUSED_BLOCKS : cap;
    size_t blocks = (a->nbytes + 2 * 16 * FUSED_THREADS - 1) / (2 * 16 * FUSED_THREADS);
    blocks = blocks < 1 ? 1 : blocks > cap ? cap : blocks;
    void *params[] = {&fa};
    return uccl__gpu_launch_unchecked(k, (unsigned)blocks, 1, FUSED_THREADS, stream, params);
}

/* A handshake's argument as the kernels take it. */
static struct uccl__k_sync sync_arg(struct cuda_dev *d, const struct uccl__sg_sync_args *a)
{
    struct uccl__k_sync sa = {.mine = a->mine, .page = (uint64_t)(uintptr_t)a->page,
                              .fin = (uint64_t)(uintptr_t)a->fin,
                              .failed = (uint64_t)(uintptr_t)a->failed, .k = a->k,
                              .mask = a->mask, .me = a->me, .n = a->n,
                              .sys = fence_sys(d, a->peer, a->n, a->me)};
    memcpy(sa.peer, a->peer, sizeof(sa.peer));
    return sa;
}

static int cuda_sync(void *dp, uintptr_t stream, const struct uccl__sg_sync_args *a)
{
    static const char *const parts[] = {uccl__sg_prelude_src, uccl__sg_sync_src, NULL};
    struct cuda_dev *d = dp;
    int rc = uccl__cuda_use(d->dev);
    if (rc)
        return rc;
    if (!d->sync_k)
        d->sync_k = once_kernel(d->dev, -1, parts, "uccl_sg_sync", &kernels.sync[d->dev],
                                &kernels.sync_failed[d->dev]);
    uccl_kernel_t *k = d->sync_k;
    if (!k || a->n > UCCL_SG_FUSED_RANKS)
        return UCCL_ERR_UNAVAIL;
    struct uccl__k_sync sa = sync_arg(d, a);
    void *params[] = {&sa};
    return uccl__gpu_launch_unchecked(k, 1, 1, 32, stream, params);
}

#define GATHER_THREADS 256
/* The gather kernel, and how many of its blocks (GATHER_THREADS each) fit
 * one SM (its registers, threads and shared memory); 0 where either is not
 * to be had (the launch is not used then). */
static int gather_kernel(struct cuda_dev *d, uccl_kernel_t **k_p)
{
    static const char *const parts[] = {uccl__sg_prelude_src, uccl__sg_copy_fn_src,
                                        uccl__sg_sync_src, uccl__sg_gather_src, NULL};
    if (!d->gather_fit) {
        int n = 0;
        d->gather_k = once_kernel(d->dev, -1, parts, "uccl_sg_gather", &kernels.gather[d->dev],
                                  &kernels.gather_failed[d->dev]);
        d->gather_fit = d->gather_k && uccl__gpu_blocks_per_sm(d->gather_k, GATHER_THREADS,
                                                               &n) == UCCL_OK && n > 0 ? n : -1;
    }
    *k_p = d->gather_k;
    return d->gather_fit > 0 ? d->gather_fit : 0;
}

/* Where every peer is a process on this GPU and the copies move at most
 * UCCL_SG_GATHER_LAUNCH_BYTES in all: the round as one launch.  Elsewhere
 * (UCCL_ERR_UNAVAIL) its handshakes and copies go one by one: across GPUs
 * the copy engine, and on one GPU large copies, where the engine moves the
 * bytes faster than the SMs (64 MiB in place, 2 ranks on one H200: 63.0 us
 * of copies on the engine, 71.6-71.9 by the SMs) and the launches' gaps
 * no longer count; an unaligned segment is copied a byte at a time here,
 * so only short ones are taken. */
static int cuda_gather(void *dp, uintptr_t stream, const struct uccl__sg_sync_args *ready,
                       const struct uccl_sg_copy *cs, int n,
                       const struct uccl__sg_sync_args *done, uintptr_t ctr)
{
    struct cuda_dev *d = dp;
    size_t longest, total = copy_span(cs, n, &longest);
    for (int i = 0; i < n; i++)
        if (((cs[i].dst | cs[i].src) & 15) && cs[i].len > (64u << 10))
            return UCCL_ERR_UNAVAIL;
    int rc = uccl__cuda_use(d->dev);
    if (rc)
        return rc;
    if (!d->gather_bytes || n > UCCL__K_GATHER_SEGS || total > d->gather_bytes ||
        ready->n > UCCL_SG_FUSED_RANKS || fence_sys(d, ready->peer, ready->n, ready->me))
        return UCCL_ERR_UNAVAIL;
    uccl_kernel_t *k;
    int fit = gather_kernel(d, &k);
    if (!fit)
        return UCCL_ERR_UNAVAIL;
    struct uccl__k_gather ga = {.ready = sync_arg(d, ready), .done = sync_arg(d, done),
                                .ctr = ctr, .seen = ctr + UCCL_SG_FUSED_SEEN, .nseg = n};
    for (int i = 0; i < n; i++) {
        ga.dst[i] = cs[i].dst;
        ga.src[i] = cs[i].src;
        ga.len[i] = cs[i].len;
    }
    /* a block per 16 KiB of the longest segment (four 16-byte loads a
     * thread), and for the group's launches together one block an SM less
     * than fit: every block spins until block 0 has seen its peers, so all
     * ranks' launches must be resident at once, with room left for another
     * spinning launch's block.  16 MiB in place on one H200 under MPS
     * (stream_sync_floor.py, docs/benchmark-log.md): 2 ranks 24.7 us with 2 blocks
     * an SM for the group, 23.7 with 4; 4 ranks 96.2 and 93.5 */
    size_t per_sm = fit > 1 ? (size_t)fit - 1 : 1;
    size_t cap = per_sm * (size_t)kernels.sms[d->dev] / (size_t)ready->n; /* set by once_kernel */
    size_t blocks = (longest + 64 * GATHER_THREADS - 1) / (64 * GATHER_THREADS); /* 16 KiB */
    blocks = blocks < cap ? blocks : cap;
    blocks = blocks < 1 ? 1 : blocks;
    void *params[] = {&ga};
    return uccl__gpu_launch_unchecked(k, (unsigned)blocks, 1, GATHER_THREADS, stream, params);
}

static uint64_t cuda_fused_id(void *dp)
{
    struct cuda_dev *d = dp;
    const struct uccl__cuda *cu = uccl__cuda();
    cu_device dv;
    int mps = 0;
    unsigned dom = 0, bus = 0, slot = 0;
    char bdf[32];
    if (cu->DeviceGet(&dv, d->dev) != CU_OK)
        return (uint64_t)d->dev + 1;
    if (cu->DeviceGetAttribute(&mps, CU_DEV_ATTR_MPS_ENABLED, dv) == CU_OK && mps)
        return 0;
    /* MPS unknown to an older driver: taken as off (two-sided rounds are the safe side) */
    if (uccl_gpu_bus_id(d->dev, bdf) != UCCL_OK || sscanf(bdf, "%x:%x:%x", &dom, &bus, &slot) != 3)
        return (uint64_t)d->dev + 1;
    return 1 + ((uint64_t)dom << 32 | (uint64_t)bus << 8 | slot);
}

static int cuda_event_new(void *dp, void **ev_p)
{
    struct cuda_dev *d = dp;
    int rc = uccl__cuda_use(d->dev);
    if (rc)
        return rc;
    cu_event ev;
    cu_result r = uccl__cuda()->EventCreate(&ev, CU_EVENT_DISABLE_TIMING);
    if (r != CU_OK)
        return uccl__cuda_err(r, "cuEventCreate");
    *ev_p = ev;
    return UCCL_OK;
}

static void cuda_event_free(void *dp, void *ev)
{
    struct cuda_dev *d = dp;
    if (ev && uccl__cuda_use(d->dev) == UCCL_OK)
        uccl__cuda()->EventDestroy((cu_event)ev);
}

static int cuda_record(void *dp, void *ev, uintptr_t stream)
{
    struct cuda_dev *d = dp;
    int rc = uccl__cuda_use(d->dev);
    if (rc)
        return rc;
    cu_result r = uccl__cuda()->EventRecord((cu_event)ev, (cu_stream)stream);
    return r == CU_OK ? UCCL_OK : uccl__cuda_err(r, "cuEventRecord");
}

static int cuda_wait_event(void *dp, uintptr_t stream, void *ev)
{
    struct cuda_dev *d = dp;
    int rc = uccl__cuda_use(d->dev);
    if (rc)
        return rc;
    cu_result r = uccl__cuda()->StreamWaitEvent((cu_stream)stream, (cu_event)ev, 0);
    return r == CU_OK ? UCCL_OK : uccl__cuda_err(r, "cuStreamWaitEvent");
}

static int cuda_query(void *dp, void *ev)
{
    struct cuda_dev *d = dp;
    int rc = uccl__cuda_use(d->dev);
    if (rc)
        return rc;
    cu_result r = uccl__cuda()->EventQuery((cu_event)ev);
    if (r == CU_OK)
        return 1;
    return r == CU_ERR_NOT_READY ? 0 : uccl__cuda_err(r, "cuEventQuery");
}

static uint64_t any_conn(struct cuda_dev *d) { return d->conns[(d->rank + 1) % d->size]; }

static int cuda_reg(void *dp, uintptr_t ptr, size_t len, uint64_t *reg_p)
{
    struct cuda_dev *d = dp;
    int m = relax(), rc = uccl_ep_reg(d->ep, ptr, len, reg_p);
    unrelax(m);
    return rc;
}

static int cuda_key(void *dp, uint64_t reg, uintptr_t ptr, size_t len, uint64_t *key_p)
{
    struct cuda_dev *d = dp;
    int m = relax(), rc = uccl_ep_ipc_key(d->ep, any_conn(d), reg, ptr, len, key_p);
    unrelax(m);
    return rc;
}

static void cuda_dereg(void *dp, uint64_t reg)
{
    struct cuda_dev *d = dp;
    if (d->ep)
        uccl_ep_dereg(d->ep, reg);
}

static int cuda_map(void *dp, int peer, uint64_t key, uint64_t addr, size_t len,
                    uintptr_t *ptr_p, void **imp_p)
{
    struct cuda_dev *d = dp;
    void *ptr = NULL;
    int m = relax(), rc = uccl_ep_ipc_map(d->ep, d->conns[peer], key, addr, len, d->dev, &ptr,
                                          imp_p);
    unrelax(m);
    if (rc == UCCL_OK)
        *ptr_p = (uintptr_t)ptr;
    return rc;
}

static void cuda_unmap(void *dp, void *imp)
{
    (void)dp;
    uccl_ep_ipc_unmap(imp);
}

static void cuda_destroy(void *dp)
{
    struct cuda_dev *d = dp;
    if (d) {
        if (d->zero_stream && uccl__cuda_use(d->dev) == UCCL_OK)
            uccl__cuda()->StreamDestroy(d->zero_stream);
        free(d->conns);
        free(d);
    }
}

static int cuda_capturing(void *dp, uintptr_t stream)
{
    struct cuda_dev *d = dp;
    const struct uccl__cuda *cu = uccl__cuda();
    int status = 0, rc = uccl__cuda_use(d->dev);
    if (rc)
        return rc;
    if (!cu->StreamIsCapturing) /* a driver before graphs: nothing captures */
        return 0;
    cu_result r = cu->StreamIsCapturing((cu_stream)stream, &status);
    if (r != CU_OK)
        return uccl__cuda_err(r, "cuStreamIsCapturing on the caller's stream");
    if (status == 2)
        return uccl__err(UCCL_ERR_INVALID, "the caller's stream is in a CUDA graph capture "
                         "that was invalidated");
    return status == 1;
}

/* Zeroed on a stream of the device's own, waited for here: the caller's
 * stream may be capturing (relaxed mode lets these calls through), and a
 * synchronous memset would order itself after the capturing stream's
 * work, which a capture refuses. */
static int cuda_alloc(void *dp, size_t len, uintptr_t *ptr_p)
{
    struct cuda_dev *d = dp;
    const struct uccl__cuda *cu = uccl__cuda();
    int rc = uccl__cuda_use(d->dev);
    if (rc)
        return rc;
    if (!cu->MemsetD32Async || !cu->StreamSynchronize)
        return uccl__err(UCCL_ERR_UNAVAIL, "this CUDA driver lacks cuMemsetD32Async or "
                         "cuStreamSynchronize (captured one-launch rounds)");
    int mode = relax();
    cu_ptr p = 0;
    cu_result r = cu->MemAlloc(&p, (len + 3) / 4 * 4);
    const char *call = "cuMemAlloc";
    if (r == CU_OK && !d->zero_stream &&
        (r = cu->StreamCreate(&d->zero_stream, CU_STREAM_NON_BLOCKING)) != CU_OK)
        call = "cuStreamCreate";
    if (r == CU_OK && (r = cu->MemsetD32Async(p, 0, (len + 3) / 4, d->zero_stream)) != CU_OK)
        call = "cuMemsetD32Async";
    if (r == CU_OK && (r = cu->StreamSynchronize(d->zero_stream)) != CU_OK)
        call = "cuStreamSynchronize";
    unrelax(mode);
    if (r != CU_OK) {
        if (p)
            cu->MemFree(p);
        return uccl__cuda_err(r, call);
    }
    *ptr_p = (uintptr_t)p;
    return UCCL_OK;
}

static void cuda_free_mem(void *dp, uintptr_t ptr)
{
    struct cuda_dev *d = dp;
    if (uccl__cuda_use(d->dev) == UCCL_OK)
        uccl__cuda()->MemFree((cu_ptr)ptr);
}

static const struct uccl__sg_dev cuda_ops = {
    .memops = cuda_memops, .copies = cuda_copies, .reduce = cuda_reduce,
    .event_new = cuda_event_new, .event_free = cuda_event_free, .record = cuda_record,
    .wait_event = cuda_wait_event, .query = cuda_query, .reg = cuda_reg, .key = cuda_key,
    .dereg = cuda_dereg, .map = cuda_map, .unmap = cuda_unmap, .destroy = cuda_destroy,
    .fused = cuda_fused, .fused_id = cuda_fused_id, .sync = cuda_sync, .gather = cuda_gather,
    .capturing = cuda_capturing, .alloc = cuda_alloc, .free_mem = cuda_free_mem,
};

int uccl_sg_cuda_new(uccl_ep_t *ep, const uint64_t *conns, int rank, int size, int dev,
                      const struct uccl__sg_dev **ops_p, void **d_p)
{
    if (!ep || size < 1 || size > UCCL_SG_MAX_RANKS || rank < 0 || rank >= size)
        return uccl__err(UCCL_ERR_INVALID, "stream-ordered group on CUDA: endpoint %p, %d ranks",
                         (void *)ep, size);
    int rc = uccl__cuda_use(dev);
    if (rc)
        return rc;
    struct cuda_dev *d = calloc(1, sizeof(*d));
    uint64_t *c = calloc((size_t)size, sizeof(*c));
    if (!d || !c) {
        free(d);
        free(c);
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    memcpy(c, conns, (size_t)size * sizeof(*c));
    long kb, gb;
    if ((rc = uccl__cfg_long(UCCL_CFG_SG_KERNEL_COPY_BYTES, &kb)) ||
        (rc = uccl__cfg_long(UCCL_CFG_SG_GATHER_LAUNCH_BYTES, &gb))) {
        free(d);
        free(c);
        return rc;
    }
    *d = (struct cuda_dev){.ep = ep, .dev = dev, .rank = rank, .size = size, .conns = c,
                           .copy_k = kb ? copy_kernel(dev) : NULL, .kernel_copy_bytes = (size_t)kb,
                           .gather_bytes = (size_t)gb};
    *ops_p = &cuda_ops;
    *d_p = d;
    return UCCL_OK;
}

/* The endpoint went away before the group: its registrations went with it. */
void uccl_sg_cuda_forget_ep(void *dp)
{
    struct cuda_dev *d = dp;
    d->ep = NULL;
}
