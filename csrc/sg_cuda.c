/* The CUDA device of stream-ordered groups (sgroup.h): stream memory
 * operations batched into one driver call (cuStreamBatchMemOp, else one
 * call each), copies on the copy engine (cuMemcpyAsync), events, and a
 * reduction kernel compiled by NVRTC on first use (one module per device
 * and element type, kept for the life of the process: a kernel queued by
 * a failed group may still run).  Memory is shared through the endpoint:
 * registrations, the keys of their export records, CUDA IPC mappings
 * checked against them (ipc_share.c). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_loader.h"
#include "ring.h"
#include "sgroup.h"
#include "status.h"

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
    int fz_scope;             /* spinning launches' fences: 0 not known yet, FENCE_GPU, FENCE_SYS */
};

/* The reduction kernel: out[i] <- op over the sources (rank order) of
 * src[r][i], accumulated as torch accumulates (float for 16-bit floats,
 * 64-bit for integers), rounded once; AVG rounds the sum to the type, then
 * divides (integers: truncated), as SUM then division does. */
static const char kernel_src[] =
    "typedef unsigned char u8; typedef unsigned short u16; typedef unsigned int u32;\n"
    "typedef unsigned long long u64; typedef long long i64;\n"
    "struct Args { u64 out; u64 src[64]; u64 count; int nsrc; int op; };\n"
    "struct alignas(16) V16 { u32 w[4]; };\n"
    "enum { SUM, PROD, MIN, MAX, BAND, BOR, BXOR, AVG };\n"
    "__device__ __forceinline__ float h2f(u16 h) { float f; asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(f) : \"h\"(h)); return f; }\n"
    "__device__ __forceinline__ u16 f2h(float f) { u16 h; asm(\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(h) : \"f\"(f)); return h; }\n"
    "__device__ __forceinline__ float b2f(u16 b) { union { u32 u; float f; } c; c.u = (u32)b << 16; return c.f; }\n"
    "__device__ __forceinline__ u16 f2b(float f) { u16 h; asm(\"cvt.rn.bf16.f32 %0, %1;\" : \"=h\"(h) : \"f\"(f)); return h; }\n"
    "#define PLAIN(N, TT, AA, F) struct N { typedef TT T; typedef AA A; enum { FLT = F, BOOL = 0 };\\\n"
    "  static __device__ __forceinline__ A ld(T x) { return (A)x; }\\\n"
    "  static __device__ __forceinline__ T st(A x) { return (T)x; } };\n"
    "PLAIN(F32, float, float, 1) PLAIN(F64, double, double, 1) PLAIN(I8, signed char, i64, 0)\n"
    "PLAIN(U8, u8, i64, 0) PLAIN(I16, short, i64, 0) PLAIN(I32, int, i64, 0) PLAIN(I64, i64, i64, 0)\n"
    "struct F16 { typedef u16 T; typedef float A; enum { FLT = 1, BOOL = 0 };\n"
    "  static __device__ __forceinline__ A ld(T x) { return h2f(x); }\n"
    "  static __device__ __forceinline__ T st(A x) { return f2h(x); } };\n"
    "struct BF16 { typedef u16 T; typedef float A; enum { FLT = 1, BOOL = 0 };\n"
    "  static __device__ __forceinline__ A ld(T x) { return b2f(x); }\n"
    "  static __device__ __forceinline__ T st(A x) { return f2b(x); } };\n"
    "struct BOOLT { typedef u8 T; typedef int A; enum { FLT = 0, BOOL = 1 };\n"
    "  static __device__ __forceinline__ A ld(T x) { return x != 0; }\n"
    "  static __device__ __forceinline__ T st(A x) { return (T)(x != 0); } };\n"
    "template <class D, int OP> __device__ __forceinline__ typename D::A\n"
    "apply(typename D::A a, typename D::A x) {\n"
    "  typedef typename D::A A;\n"
    "  if constexpr (D::BOOL) {\n"
    "    if constexpr (OP == PROD || OP == MIN || OP == BAND) return a & x;\n"
    "    else if constexpr (OP == BXOR) return a ^ x;\n"
    "    else return a | x;\n"
    "  } else if constexpr (OP == SUM || OP == AVG) {\n"
    "    if constexpr (D::FLT) return a + x; else return (A)((u64)a + (u64)x);\n"
    "  } else if constexpr (OP == PROD) {\n"
    "    if constexpr (D::FLT) return a * x; else return (A)((u64)a * (u64)x);\n"
    "  } else if constexpr (OP == MIN) {\n"
    "    if constexpr (D::FLT) return a != a ? a : (x != x ? x : (x < a ? x : a));\n"
    "    else return x < a ? x : a;\n"
    "  } else if constexpr (OP == MAX) {\n"
    "    if constexpr (D::FLT) return a != a ? a : (x != x ? x : (x > a ? x : a));\n"
    "    else return x > a ? x : a;\n"
    "  } else if constexpr (D::FLT) { return a;\n"
    "  } else if constexpr (OP == BAND) { return a & x;\n"
    "  } else if constexpr (OP == BOR) { return a | x;\n"
    "  } else { return a ^ x; }\n"
    "}\n"
    "template <class D, int OP> __device__ __forceinline__ typename D::T fin(typename D::A acc, int n) {\n"
    "  if constexpr (OP == AVG) return D::st(D::ld(D::st(acc)) / (typename D::A)n);\n"
    "  else return D::st(acc);\n"
    "}\n"
    "template <class D, int OP> __device__ void body(const Args &a) {\n"
    "  typedef typename D::T T; typedef typename D::A A;\n"
    "  constexpr int V = 16 / sizeof(T);\n"
    "  u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;\n"
    "  int n = a.nsrc;\n"
    "  bool vec = (a.out & 15) == 0;\n"
    "  for (int r = 0; r < n; r++) vec = vec && (a.src[r] & 15) == 0;\n"
    "  u64 nv = vec ? a.count / V : 0;\n"
    "  union U { V16 u; T t[V]; };\n"
    /* Two vectors a thread (j, j + stride: the same vectors a thread of
     * copy_bytes moves), up to four sources' loads issued before any is
     * used: the loads, not the arithmetic, bound this loop, and one load in
     * flight a thread leaves most of the memory's bandwidth unused.  The
     * sources are still applied in rank order. */
    "  for (u64 j = tid; j < nv; j += 2 * stride) {\n"
    "    bool two = j + stride < nv;\n"
    "    A acc[2][V];\n"
    "    for (int r0 = 0; r0 < n; r0 += 4) {\n"
    "      U x[2][4];\n"
    "#pragma unroll\n"
    "      for (int q = 0; q < 4; q++)\n"
    "        if (r0 + q < n) {\n"
    "          x[0][q].u = ((const V16 *)a.src[r0 + q])[j];\n"
    "          if (two) x[1][q].u = ((const V16 *)a.src[r0 + q])[j + stride];\n"
    "        }\n"
    "#pragma unroll\n"
    "      for (int q = 0; q < 4; q++)\n"
    "        if (r0 + q < n) {\n"
    "#pragma unroll\n"
    "          for (int m = 0; m < 2; m++)\n"
    "#pragma unroll\n"
    "            for (int v = 0; v < V; v++) {\n"
    "              A y = D::ld(x[m][q].t[v]);\n"
    "              acc[m][v] = r0 + q == 0 ? y : apply<D, OP>(acc[m][v], y);\n"
    "            }\n"
    "        }\n"
    "    }\n"
    "#pragma unroll\n"
    "    for (int m = 0; m < 2; m++) {\n"
    "      if (m && !two) break;\n"
    "      U y;\n"
    "#pragma unroll\n"
    "      for (int v = 0; v < V; v++) y.t[v] = fin<D, OP>(acc[m][v], n);\n"
    "      ((V16 *)a.out)[j + m * stride] = y.u;\n"
    "    }\n"
    "  }\n"
    "  for (u64 i = nv * V + tid; i < a.count; i += stride) {\n"
    "    A acc = D::ld(((const T *)a.src[0])[i]);\n"
    "    for (int r = 1; r < n; r++) acc = apply<D, OP>(acc, D::ld(((const T *)a.src[r])[i]));\n"
    "    ((T *)a.out)[i] = fin<D, OP>(acc, n);\n"
    "  }\n"
    "}\n"
    "__device__ __forceinline__ void reduce_all(const Args &a) {\n"
    "  switch (a.op) {\n"
    "  case SUM: body<UCCL_DT, SUM>(a); break;   case PROD: body<UCCL_DT, PROD>(a); break;\n"
    "  case MIN: body<UCCL_DT, MIN>(a); break;   case MAX: body<UCCL_DT, MAX>(a); break;\n"
    "  case BAND: body<UCCL_DT, BAND>(a); break; case BOR: body<UCCL_DT, BOR>(a); break;\n"
    "  case BXOR: body<UCCL_DT, BXOR>(a); break; case AVG: body<UCCL_DT, AVG>(a); break;\n"
    "  }\n"
    "}\n"
    "extern \"C\" __global__ void uccl_sg_reduce(Args a) { reduce_all(a); }\n";

/* A one-launch round (sgroup.h, struct uccl__sg_fused_args), appended to
 * kernel_src: every block stages its share of the input into this rank's
 * slot; the last block to finish writes this rank's ready word (fenced, so
 * a peer that sees it sees the bytes), in its arena and in the page (what
 * the host reads); block 0 waits until each peer's arena word reaches the
 * round, thread r polling rank r's (all peers at once: one after the
 * other cost 1.5-3 us more a call at 4 ranks; device memory, where the
 * page's word over PCIe cost 1.5 us a call at 2 ranks and 3 at 4), then
 * raises a flag in device memory that the other blocks wait for (every
 * block polling the host page cost ~4x at 64 KiB); every block then
 * computes from the slots (this rank's input read in place) and the last
 * block writes fin.  Its blocks spin, so its grid is small (cuda_fused):
 * on a GPU the ranks share, the peers' launches must be resident beside
 * it, and they run at once only under MPS (without it a spinning launch
 * holds the GPU for its time slice).  A failed group's flag, read every
 * 64th poll, ends the spin. */
#define FUSED_BLOCKS 32
#define FUSED_THREADS 256
enum { FENCE_GPU = 1, FENCE_SYS = 2 }; /* cuda_dev.fz_scope */
static const char fused_src[] =
    "struct FArgs { u64 in, out, ctr, nbytes, count; u64 slot[8]; u64 ready[8]; u64 dready[8];\n"
    "  u64 fin, failed;\n"
    "  u32 k; int gather, op, n, me, sys; };\n"
    /* the fences that publish this rank's bytes and words: the GPU's scope
     * where every peer is a process on this GPU (at 4 ranks, 1 MiB: 21.7 ->
     * 16.9 us a call), the system's where a peer reads over NVLink/PCIe */
    "__device__ __forceinline__ void fence(bool sys) { if (sys) __threadfence_system(); else __threadfence(); }\n"
    "__device__ __forceinline__ void copy_bytes(u64 dst, u64 src, u64 len) {\n"
    "  u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;\n"
    "  u64 nv = ((dst | src) & 15) == 0 ? len / 16 : 0, j = tid;\n"
    "  const V16 *s = (const V16 *)src; V16 *d = (V16 *)dst;\n"
    /* four loads in flight before the stores (the compiler cannot hoist a
     * load above a store that may alias it) */
    "  for (; j + 3 * stride < nv; j += 4 * stride) {\n"
    "    V16 t0 = s[j], t1 = s[j + stride], t2 = s[j + 2 * stride], t3 = s[j + 3 * stride];\n"
    "    d[j] = t0; d[j + stride] = t1; d[j + 2 * stride] = t2; d[j + 3 * stride] = t3;\n"
    "  }\n"
    "  for (; j < nv; j += stride) d[j] = s[j];\n"
    "  for (u64 i = nv * 16 + tid; i < len; i += stride) ((u8 *)dst)[i] = ((const u8 *)src)[i];\n"
    "}\n"
    "__device__ __forceinline__ void arrive(u32 *ctr, u64 dword, u64 word, u32 k, bool sys) {\n"
    "  __syncthreads();\n"
    "  if (threadIdx.x == 0) {\n"
    "    __threadfence();\n"
    "    if (atomicAdd(ctr, 1u) == gridDim.x - 1) {\n"
    "      *(volatile u32 *)ctr = 0;\n"
    "      fence(sys);\n"
    "      if (dword) *(volatile u32 *)dword = k;\n"
    "      *(volatile u32 *)word = k;\n"
    "    }\n"
    "  }\n"
    "}\n"
    "__device__ __forceinline__ bool before(u64 word, u32 k) { return (int)(*(volatile u32 *)word - k) < 0; }\n"
    "extern \"C\" __global__ void uccl_sg_fused(FArgs a) {\n"
    "  copy_bytes(a.slot[a.me], a.in, a.nbytes);\n"
    "  arrive((u32 *)a.ctr, a.dready[a.me], a.ready[a.me], a.k, a.sys);\n"
    "  u64 seen = a.ctr + 8;\n"
    "  if (blockIdx.x == 0) {\n"
    "    int r = threadIdx.x;\n"
    "    if (r < a.n && r != a.me) {\n"
    "      for (u32 i = 1; before(a.dready[r], a.k); i++) {\n"
    "        if ((i & 63) == 0 && *(volatile u32 *)a.failed) break;\n"
    "        __nanosleep(32);\n"
    "      }\n"
    "      fence(a.sys);\n"
    "    }\n"
    "    __syncthreads();\n"
    "    if (threadIdx.x == 0) *(volatile u32 *)seen = a.k;\n"
    "  } else if (threadIdx.x == 0) {\n"
    "    while (before(seen, a.k)) __nanosleep(32);\n"
    "    fence(a.sys);\n"
    "  }\n"
    "  __syncthreads();\n"
    "  if (a.gather) {\n"
    "    for (int r = 0; r < a.n; r++) {\n"
    "      u64 src = r == a.me ? a.in : a.slot[r], dst = a.out + (u64)r * a.nbytes;\n"
    "      if (dst != src) copy_bytes(dst, src, a.nbytes);\n"
    "    }\n"
    "  } else if (a.count) {\n"
    "    Args b; b.out = a.out; b.count = a.count; b.nsrc = a.n; b.op = a.op;\n"
    "    for (int r = 0; r < a.n; r++) b.src[r] = r == a.me ? a.in : a.slot[r];\n"
    "    reduce_all(b);\n"
    "  }\n"
    "  arrive((u32 *)a.ctr + 1, 0, a.fin, a.k, a.sys);\n"
    "}\n";
/* Its argument, laid out as struct FArgs (whose arrays hold UCCL_SG_FUSED_RANKS). */
_Static_assert(UCCL_SG_FUSED_RANKS == 8, "struct FArgs holds 8 ranks' slots and words");
struct fused_args {
    uint64_t in, out, ctr, nbytes, count, slot[8], ready[8], dready[8], fin, failed;
    uint32_t k;
    int32_t gather, op, n, me, sys;
};

/* Several copies in one launch (block row y copies segment y), 16 bytes
 * at a time where both ends are aligned: one driver call where each
 * cuMemcpyAsync costs several microseconds of the host's time. */
#define COPY_SEGS 32
static const char copy_src[] =
    "typedef unsigned long long u64; typedef unsigned int u32;\n"
    "struct alignas(16) V16 { u32 w[4]; };\n"
    "struct CopyArgs { u64 dst[32]; u64 src[32]; u64 len[32]; int n; };\n"
    "extern \"C\" __global__ void uccl_sg_copy(CopyArgs a) {\n"
    "  int s = blockIdx.y;\n"
    "  if (s >= a.n) return;\n"
    "  u64 len = a.len[s];\n"
    "  const unsigned char *src = (const unsigned char *)a.src[s];\n"
    "  unsigned char *dst = (unsigned char *)a.dst[s];\n"
    "  u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;\n"
    "  u64 nv = ((a.dst[s] | a.src[s]) & 15) == 0 ? len / 16 : 0;\n"
    "  for (u64 j = tid; j < nv; j += stride) ((V16 *)dst)[j] = ((const V16 *)src)[j];\n"
    "  for (u64 i = nv * 16 + tid; i < len; i += stride) dst[i] = src[i];\n"
    "}\n";
struct copy_args {
    uint64_t dst[COPY_SEGS], src[COPY_SEGS], len[COPY_SEGS];
    int32_t n;
};

/* A two-sided round's handshake (struct uccl__sg_sync_args) as one launch
 * of one warp: thread 0 sets this rank's words, thread r waits for rank
 * r's arena word, then thread 0 writes fin.  It spins, as the one-launch
 * round does, so it runs only where those do (one block: beside any
 * launch); the page's failed flag, read every 64th poll, ends it. */
static const char sync_src[] =
    "typedef unsigned long long u64; typedef unsigned int u32;\n"
    "struct SArgs { u64 mine, page, fin, failed; u64 peer[8]; u32 k, mask; int me, n, sys; };\n"
    "__device__ __forceinline__ void fence(bool sys) { if (sys) __threadfence_system(); else __threadfence(); }\n"
    "extern \"C\" __global__ void uccl_sg_sync(SArgs a) {\n"
    "  int r = threadIdx.x;\n"
    "  if (r == 0) {\n"
    "    fence(a.sys);\n"
    "    *(volatile u32 *)a.mine = a.k;\n"
    "    *(volatile u32 *)a.page = a.k;\n"
    "  }\n"
    "  if (r < a.n && ((a.mask >> r) & 1)) {\n"
    "    for (u32 i = 1; (int)(*(volatile u32 *)a.peer[r] - a.k) < 0; i++) {\n"
    "      if ((i & 63) == 0 && *(volatile u32 *)a.failed) break;\n"
    "      __nanosleep(32);\n"
    "    }\n"
    "  }\n"
    "  __syncthreads();\n"
    "  if (r == 0) {\n"
    "    fence(a.sys);\n"
    "    if (a.fin) *(volatile u32 *)a.fin = a.k;\n"
    "  }\n"
    "}\n";
struct sync_args {
    uint64_t mine, page, fin, failed, peer[8];
    uint32_t k, mask;
    int32_t me, n, sys;
};

/* The kernel's argument, laid out as its struct Args. */
struct kernel_args {
    uint64_t out, src[UCCL_SG_MAX_RANKS], count;
    int32_t nsrc, op;
};

static const char *const dt_names[UCCL_DT_COUNT] = {
    [UCCL_DT_F32] = "F32", [UCCL_DT_F64] = "F64", [UCCL_DT_F16] = "F16",
    [UCCL_DT_BF16] = "BF16", [UCCL_DT_I8] = "I8", [UCCL_DT_U8] = "U8", [UCCL_DT_I16] = "I16",
    [UCCL_DT_I32] = "I32", [UCCL_DT_I64] = "I64", [UCCL_DT_BOOL] = "BOOLT",
};

/* Compiled kernels, per device and element type, for the life of the process. */
static struct {
    pthread_mutex_t mu;
    uccl_kernel_t *k[MAX_DEVS][UCCL_DT_COUNT];
    uccl_kernel_t *fused[MAX_DEVS][UCCL_DT_COUNT];
    char fused_failed[MAX_DEVS][UCCL_DT_COUNT];
    uccl_kernel_t *copy[MAX_DEVS], *sync[MAX_DEVS];
    char copy_failed[MAX_DEVS], sync_failed[MAX_DEVS];
    int sms[MAX_DEVS];
} kernels = {PTHREAD_MUTEX_INITIALIZER, {{NULL}}, {{NULL}}, {{0}}, {NULL}, {NULL}, {0}, {0}, {0}};

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

/* A kernel of no element type for device dev, compiled once (*slot), or
 * NULL where it cannot be (no NVRTC: *failed, not tried again). */
static uccl_kernel_t *once_kernel(int dev, const char *src, const char *name,
                                  uccl_kernel_t **slot, char *failed)
{
    pthread_mutex_lock(&kernels.mu);
    if (!*slot && !*failed) {
        if (uccl_gpu_compile(dev, src, name, 0, NULL, NULL, 0, NULL, NULL, 0, slot) != UCCL_OK)
            *failed = 1;
        else
            read_sms(dev);
    }
    uccl_kernel_t *k = *slot;
    pthread_mutex_unlock(&kernels.mu);
    return k;
}

/* The copy kernel, compiled at the first group; without it copies go one
 * by one on the copy engine. */
static uccl_kernel_t *copy_kernel(int dev)
{
    return once_kernel(dev, copy_src, "uccl_sg_copy", &kernels.copy[dev],
                       &kernels.copy_failed[dev]);
}

/* Under kernels.mu: compile kernel_src (and `more`) for dtype, taking `name`. */
static int compile_for(int dev, int dtype, const char *more, const char *name,
                       uccl_kernel_t **k_p)
{
    size_t len = sizeof(kernel_src) + strlen(more) + 64;
    char *src = malloc(len);
    if (!src)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    snprintf(src, len, "#define UCCL_DT %s\n%s%s", dt_names[dtype], kernel_src, more);
    int rc = uccl_gpu_compile(dev, src, name, 0, NULL, NULL, 0, NULL, NULL, 0, k_p);
    free(src);
    if (rc == UCCL_OK)
        read_sms(dev);
    return rc;
}

int uccl_sg_kernel_ready(int dev, int dtype)
{
    if (dev < 0 || dev >= MAX_DEVS || !uccl_dtype_size(dtype))
        return uccl__err(UCCL_ERR_INVALID, "reduction kernel: device %d, type %d", dev, dtype);
    pthread_mutex_lock(&kernels.mu);
    int rc = kernels.k[dev][dtype] ? UCCL_OK
                                   : compile_for(dev, dtype, "", "uccl_sg_reduce",
                                                 &kernels.k[dev][dtype]);
    pthread_mutex_unlock(&kernels.mu);
    return rc;
}

/* NULL where it cannot be built (no NVRTC, a GPU older than sm_70): the
 * round then queues its steps one by one (sg_round.c), once tried. */
static uccl_kernel_t *fused_kernel(int dev, int dtype)
{
    pthread_mutex_lock(&kernels.mu);
    if (!kernels.fused[dev][dtype] && !kernels.fused_failed[dev][dtype] &&
        compile_for(dev, dtype, fused_src, "uccl_sg_fused", &kernels.fused[dev][dtype]))
        kernels.fused_failed[dev][dtype] = 1;
    uccl_kernel_t *k = kernels.fused[dev][dtype];
    pthread_mutex_unlock(&kernels.mu);
    return k;
}

static int cuda_memops(void *dp, uintptr_t stream, const struct uccl__sg_memop *ops, int n)
{
    struct cuda_dev *d = dp;
    const struct uccl__cuda *cu = uccl__cuda();
    int rc = n > 0 ? uccl__cuda_use(d->dev) : UCCL_OK; /* the caller's thread may have none current */
    if (n <= 0 || rc)
        return rc;
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

static int cuda_copies(void *dp, uintptr_t stream, const struct uccl_sg_copy *cs, int n)
{
    struct cuda_dev *d = dp;
    size_t total = 0, longest = 0;
    for (int i = 0; i < n; i++) {
        total += cs[i].len;
        longest = cs[i].len > longest ? cs[i].len : longest;
    }
    uccl_kernel_t *k = n <= COPY_SEGS && total <= d->kernel_copy_bytes ? d->copy_k : NULL;
    if (k) {
        struct copy_args a;
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
    struct kernel_args ka = {.out = a->out, .count = a->count, .nsrc = a->nsrc, .op = a->op};
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
    }
    return d->fz_scope == FENCE_SYS;
}

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
    if (!a->gather && a->in == a->out && (a->in & 15))
        return UCCL_ERR_UNAVAIL;
    uccl_kernel_t *k = fused_kernel(d->dev, dt);
    if (!k)
        return UCCL_ERR_UNAVAIL;
    struct fused_args fa = {.in = a->in, .out = a->out, .ctr = a->ctr, .nbytes = a->nbytes,
                            .count = a->count, .fin = (uint64_t)(uintptr_t)a->fin,
                            .failed = (uint64_t)(uintptr_t)a->failed, .k = a->k,
                            .gather = a->gather, .op = a->op, .n = a->nsrc, .me = a->me,
                            .sys = fence_sys(d, a->dready, a->nsrc, a->me)};
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
     * BENCHMARKS.md): 2 ranks 14.6 us with 16 blocks, 12.6 with 32, 11.3
     * with 64; 4 ranks 28.3 with 16, 25.4 with 32 */
    size_t cap = (size_t)kernels.sms[d->dev] / (size_t)a->nsrc; /* set by fused_kernel */
    cap = cap < 1 ? 1 : cap > FUSED_BLOCKS ? FUSED_BLOCKS : cap;
    size_t blocks = (a->nbytes + 2 * 16 * FUSED_THREADS - 1) / (2 * 16 * FUSED_THREADS);
    blocks = blocks < 1 ? 1 : blocks > cap ? cap : blocks;
    void *params[] = {&fa};
    return uccl__gpu_launch_unchecked(k, (unsigned)blocks, 1, FUSED_THREADS, stream, params);
}

static int cuda_sync(void *dp, uintptr_t stream, const struct uccl__sg_sync_args *a)
{
    struct cuda_dev *d = dp;
    int rc = uccl__cuda_use(d->dev);
    if (rc)
        return rc;
    uccl_kernel_t *k = once_kernel(d->dev, sync_src, "uccl_sg_sync", &kernels.sync[d->dev],
                                   &kernels.sync_failed[d->dev]);
    if (!k || a->n > UCCL_SG_FUSED_RANKS)
        return UCCL_ERR_UNAVAIL;
    struct sync_args sa = {.mine = a->mine, .page = (uint64_t)(uintptr_t)a->page,
                           .fin = (uint64_t)(uintptr_t)a->fin,
                           .failed = (uint64_t)(uintptr_t)a->failed, .k = a->k,
                           .mask = a->mask, .me = a->me, .n = a->n,
                           .sys = fence_sys(d, a->peer, a->n, a->me)};
    memcpy(sa.peer, a->peer, sizeof(sa.peer));
    void *params[] = {&sa};
    return uccl__gpu_launch_unchecked(k, 1, 1, 32, stream, params);
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
    return uccl_ep_reg(d->ep, ptr, len, reg_p);
}

static int cuda_key(void *dp, uint64_t reg, uintptr_t ptr, size_t len, uint64_t *key_p)
{
    struct cuda_dev *d = dp;
    return uccl_ep_ipc_key(d->ep, any_conn(d), reg, ptr, len, key_p);
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
    int rc = uccl_ep_ipc_map(d->ep, d->conns[peer], key, addr, len, d->dev, &ptr, imp_p);
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
        free(d->conns);
        free(d);
    }
}

static const struct uccl__sg_dev cuda_ops = {
    .memops = cuda_memops, .copies = cuda_copies, .reduce = cuda_reduce,
    .event_new = cuda_event_new, .event_free = cuda_event_free, .record = cuda_record,
    .wait_event = cuda_wait_event, .query = cuda_query, .reg = cuda_reg, .key = cuda_key,
    .dereg = cuda_dereg, .map = cuda_map, .unmap = cuda_unmap, .destroy = cuda_destroy,
    .fused = cuda_fused, .fused_id = cuda_fused_id, .sync = cuda_sync,
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
    int bad = 0;
    long kb = uccl__env_long("UCCL_SG_KERNEL_COPY_BYTES", 8l << 20, 0, 1l << 40, &bad);
    if (bad) {
        free(d);
        free(c);
        return UCCL_ERR_INVALID;
    }
    *d = (struct cuda_dev){ep, dev, rank, size, c, 0, kb ? copy_kernel(dev) : NULL, (size_t)kb, 0};
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
