/* The CUDA C++ that stream-ordered groups hand NVRTC at run time, as
 * parts that sg_cuda.c joins into modules (sg_kernels.h says which), and
 * the layouts of their arguments (sg_kernels.h mirrors them in C).  The
 * reduction and the one-launch round are compiled once per element type;
 * the others once per device. */
#include "sgdev/sg_kernels.h"

/* What every module starts with: the types, and the two primitives of the
 * spinning launches.  The fences that publish this rank's bytes and words
 * are at the GPU's scope where every peer is a process on this GPU (at 4
 * ranks, 1 MiB all_reduce: 21.7 -> 16.9 us a call), the system's where a
 * peer reads over NVLink/PCIe. */
const char uccl__sg_prelude_src[] =
    "typedef unsigned char u8; typedef unsigned short u16; typedef unsigned int u32;\n"
    "typedef unsigned long long u64; typedef long long i64;\n"
    "struct alignas(16) V16 { u32 w[4]; };\n"
    "__device__ __forceinline__ void fence(bool sys) { if (sys) __threadfence_system(); else __threadfence(); }\n"
    "__device__ __forceinline__ bool before(u64 word, u32 k) { return (int)(*(volatile u32 *)word - k) < 0; }\n"
    /* a spin until word reaches k (a cyclic count) or, where failed is not
     * 0, the group's failed flag (the page, over PCIe: read every 64th
     * poll) is up; then the poller's own fence, which orders what it reads
     * next after the word.  A block's wait for block 0's seen word reads no
     * flag: block 0 writes it however its own wait ends, and a read over
     * PCIe would only delay the block's start */
    "__device__ __forceinline__ void wait_word(u64 word, u32 k, u64 failed, bool sys) {\n"
    "  for (u32 i = 1; before(word, k); i++) {\n"
    "    if (failed && (i & 63) == 0 && *(volatile u32 *)failed) break;\n"
    "    __nanosleep(32);\n"
    "  }\n"
    "  fence(sys);\n"
    "}\n";

/* The reduction kernel: out[i] <- op over the sources (rank order) of
 * src[r][i], accumulated as torch accumulates (float for 16-bit floats,
 * 64-bit for integers), rounded once; AVG rounds the sum to the type, then
 * divides (integers: truncated), as SUM then division does. */
const char uccl__sg_reduce_src[] =
    "struct Args { u64 out; u64 src[64]; u64 count; int nsrc; int op; };\n"
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

/* The copy of the launches that spin: every thread of the grid moves 16
 * bytes at a time where both ends are aligned, four loads in flight before
 * the stores (the compiler cannot hoist a load above a store that may
 * alias it); and the grid-wide arrival after it. */
const char uccl__sg_copy_fn_src[] =
    "__device__ __forceinline__ void copy_bytes(u64 dst, u64 src, u64 len) {\n"
    "  u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;\n"
    "  u64 nv = ((dst | src) & 15) == 0 ? len / 16 : 0, j = tid;\n"
    "  const V16 *s = (const V16 *)src; V16 *d = (V16 *)dst;\n"
    "  for (; j + 3 * stride < nv; j += 4 * stride) {\n"
    "    V16 t0 = s[j], t1 = s[j + stride], t2 = s[j + 2 * stride], t3 = s[j + 3 * stride];\n"
    "    d[j] = t0; d[j + stride] = t1; d[j + 2 * stride] = t2; d[j + 3 * stride] = t3;\n"
    "  }\n"
    "  for (; j < nv; j += stride) d[j] = s[j];\n"
    "  for (u64 i = nv * 16 + tid; i < len; i += stride) ((u8 *)dst)[i] = ((const u8 *)src)[i];\n"
    "}\n"
    /* whether this block is the last of the grid to get here, every block's
     * writes before it fenced; the counter (zero between launches) back to 0 */
    "__device__ __forceinline__ bool last_block(u32 *ctr) {\n"
    "  __shared__ bool last;\n"
    "  __syncthreads();\n"
    "  if (threadIdx.x == 0) {\n"
    "    __threadfence();\n"
    "    last = atomicAdd(ctr, 1u) == gridDim.x - 1;\n"
    "    if (last) *(volatile u32 *)ctr = 0;\n"
    "  }\n"
    "  __syncthreads();\n"
    "  return last;\n"
    "}\n"
    /* the blocks other than 0 wait until block 0 has seen its peers (it
     * raises seen, in device memory: every block polling the peers' words
     * cost ~4x at 64 KiB); no failed flag read here, as block 0 raises it
     * however its own wait ends */
    "__device__ __forceinline__ void after_block0(u64 seen, u32 k, bool sys) {\n"
    "  if (threadIdx.x == 0) {\n"
    "    if (blockIdx.x == 0) *(volatile u32 *)seen = k; else wait_word(seen, k, 0, sys);\n"
    "  }\n"
    "  __syncthreads();\n"
    "}\n";

/* A one-launch round (sgroup.h, struct uccl__sg_fused_args), after the
 * reduction and the copy: every block stages its share of the input into
 * this rank's slot; the last block to finish writes this rank's ready word
 * (fenced, so a peer that sees it sees the bytes), in its arena and in the
 * page (what the host reads); block 0 waits until each peer's arena word
 * reaches the round, thread r polling rank r's (all peers at once: one
 * after the other cost 1.5-3 us more a call at 4 ranks; device memory,
 * where the page's word over PCIe cost 1.5 us a call at 2 ranks and 3 at
 * 4), then raises a flag in device memory that the other blocks wait for
 * (every block polling the host page cost ~4x at 64 KiB); every block then
 * computes from the slots (this rank's input read in place) and the last
 * block writes fin.  Its blocks spin, so its grid is small (cuda_fused):
 * on a GPU the ranks share, the peers' launches must be resident beside
 * it, and they run at once only under MPS (without it a spinning launch
 * holds the GPU for its time slice).  A failed group's flag, read every
 * 64th poll, ends the spin. */
const char uccl__sg_fused_src[] =
    "struct FArgs { u64 in, out, ctr, nbytes, count; u64 slot[8]; u64 ready[8]; u64 dready[8];\n"
    "  u64 fin, failed, epoch, flip;\n"
    "  u32 k; int gather, op, n, me, sys; };\n"
    "__device__ __forceinline__ void arrive(u32 *ctr, u64 dword, u64 word, u32 k, bool sys) {\n"
    "  if (last_block(ctr) && threadIdx.x == 0) {\n"
    "    fence(sys);\n"
    "    if (dword) *(volatile u32 *)dword = k;\n"
    "    if (word) *(volatile u32 *)word = k;\n"
    "  }\n"
    "}\n"
    "extern \"C\" __global__ void uccl_sg_fused(FArgs a) {\n"
    "  copy_bytes(a.slot[a.me], a.in, a.nbytes);\n"
    "  arrive((u32 *)a.ctr, a.dready[a.me], a.ready[a.me], a.k, a.sys);\n"
    "  if (blockIdx.x == 0) {\n"
    "    int r = threadIdx.x;\n"
    "    if (r < a.n && r != a.me) wait_word(a.dready[r], a.k, a.failed, a.sys);\n"
    "    __syncthreads();\n"
    "  }\n"
    "  after_block0(a.ctr + 8, a.k, a.sys);\n"
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

/* A one-launch round captured in a CUDA graph (sg_dev.h, fused_args.epoch;
 * sg_graph.c), after the one-launch round's parts: it pushes where the
 * other pulls.  Its number is its arena's epoch + 1, read as it runs (the
 * launch before it on this stream wrote it at its end, so every block reads
 * the same).  Every block writes its share of the input into slot [me] of
 * the number's parity in every rank's arena, this one's too (posted
 * writes over NVLink), and after the block's barrier one thread fences
 * them at the system's scope (sys is always set here: sg_cuda.c; the
 * fence is cumulative over what the barrier ordered before it); the last
 * block then writes word [me] of every rank's ready words.  Block 0 polls
 * this rank's own ready words (its memory: no read crosses a link, where
 * the pull's poll and reads each cost a round trip), raises seen, and every
 * block computes out from the slots of its own arena.  A replay writes a
 * peer's slot of its parity only once that peer has shown, at the replay
 * before, that it is past the replay before that, which read it. */
const char uccl__sg_cfused_src[] =
    "extern \"C\" __global__ void uccl_sg_cfused(FArgs a) {\n"
    "  u32 k = *(volatile u32 *)a.epoch + 1u;\n"
    "  u64 par = (u64)(k & 1u) * (u64)a.n * a.flip, mine = (u64)a.me * a.flip;\n"
    "  for (int r = 0; r < a.n; r++) copy_bytes(a.slot[r] + par + mine, a.in, a.nbytes);\n"
    "  __syncthreads();\n"
    "  if (threadIdx.x == 0) fence(a.sys);\n"
    "  if (last_block((u32 *)a.ctr) && threadIdx.x == 0) {\n"
    "    fence(a.sys);\n"
    "    for (int r = 0; r < a.n; r++) *(volatile u32 *)(a.dready[r] + 4u * a.me) = k;\n"
    "  }\n"
    "  if (blockIdx.x == 0) {\n"
    "    int r = threadIdx.x;\n"
    "    if (r < a.n) wait_word(a.dready[a.me] + 4u * r, k, a.failed, a.sys);\n"
    "    __syncthreads();\n"
    "  }\n"
    "  after_block0(a.ctr + 8, k, a.sys);\n"
    "  u64 base = a.slot[a.me] + par;\n"
    "  if (a.gather) {\n"
    "    for (int r = 0; r < a.n; r++) copy_bytes(a.out + (u64)r * a.nbytes, base + r * a.flip, a.nbytes);\n"
    "  } else if (a.count) {\n"
    "    Args b; b.out = a.out; b.count = a.count; b.nsrc = a.n; b.op = a.op;\n"
    "    for (int r = 0; r < a.n; r++) b.src[r] = base + r * a.flip;\n"
    "    reduce_all(b);\n"
    "  }\n"
    "  if (last_block((u32 *)a.ctr + 1) && threadIdx.x == 0) *(volatile u32 *)a.epoch = k;\n"
    "}\n";

/* A captured one-launch round of at most GRAPH_LL_BYTES a rank, after the
 * one-launch round's parts: NCCL's LL protocol.  Each 16-byte line of a
 * slot holds 8 bytes of data and the round's number twice ({d0, k, d1, k},
 * one 16-byte store, which the GPU makes visible whole, as NCCL relies
 * on), so the data carry their own flag: no fence, no ready word, and a
 * receiver that sees k in both halves has the bytes.  Every thread pushes
 * its 16-byte vectors of the input into slot [me] of the number's parity
 * in every rank's arena (two lines a vector), then reads the vectors it
 * computes from every rank's slot in its own arena, spinning on each line
 * until it carries k (every 4096th poll the group's failed flag, which ends
 * the spin: every thread spins here, and the flag is the host's page, read
 * over PCIe, where such reads from many warps queue; NCCL reads its abort
 * flag every 10^6 spins); the last block writes the epoch.  A vector past the input's
 * end is zero-padded; unaligned input or output goes byte by byte. */
const char uccl__sg_cll_src[] =
    "__device__ __forceinline__ void st_ll(u64 d, u32 w0, u32 w1, u32 k) {\n"
    "  asm volatile(\"st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};\" :: \"l\"(d), \"r\"(w0), \"r\"(k), \"r\"(w1), \"r\"(k) : \"memory\");\n"
    "}\n"
    "__device__ __forceinline__ void ld_ll(u64 s, u32 k, u64 failed, u32 &w0, u32 &w1) {\n"
    "  u32 f0, f1;\n"
    "  for (u32 i = 1;; i++) {\n"
    "    asm volatile(\"ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];\" : \"=r\"(w0), \"=r\"(f0), \"=r\"(w1), \"=r\"(f1) : \"l\"(s) : \"memory\");\n"
    "    if ((f0 == k && f1 == k) || ((i & 4095) == 0 && *(volatile u32 *)failed)) return;\n"
    "  }\n"
    "}\n"
    /* vector j of [p, +n): whole where aligned and inside, else byte by byte */
    "__device__ __forceinline__ V16 ld_vec(u64 p, u64 j, u64 n) {\n"
    "  V16 v; v.w[0] = v.w[1] = v.w[2] = v.w[3] = 0;\n"
    "  if ((p & 15) == 0 && 16 * j + 16 <= n) return ((const V16 *)p)[j];\n"
    "  for (u64 b = 16 * j; b < n && b < 16 * j + 16; b++) ((u8 *)v.w)[b - 16 * j] = ((const u8 *)p)[b];\n"
    "  return v;\n"
    "}\n"
    "__device__ __forceinline__ void st_vec(u64 p, u64 j, u64 n, V16 v) {\n"
    "  if ((p & 15) == 0 && 16 * j + 16 <= n) { ((V16 *)p)[j] = v; return; }\n"
    "  for (u64 b = 16 * j; b < n && b < 16 * j + 16; b++) ((u8 *)p)[b] = ((const u8 *)v.w)[b - 16 * j];\n"
    "}\n"
    "__device__ __forceinline__ V16 ld_line2(u64 s, u32 k, u64 failed) {\n"
    "  V16 v; ld_ll(s, k, failed, v.w[0], v.w[1]); ld_ll(s + 16, k, failed, v.w[2], v.w[3]);\n"
    "  return v;\n"
    "}\n"
    "template <class D, int OP> __device__ void ll_reduce(const FArgs &a, u64 base, u32 k) {\n"
    "  typedef typename D::T T; typedef typename D::A A;\n"
    "  constexpr int V = 16 / sizeof(T);\n"
    "  union U { V16 u; T t[V]; };\n"
    "  u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;\n"
    "  for (u64 j = tid; j < (a.nbytes + 15) / 16; j += stride) {\n"
    "    A acc[V];\n"
    "    for (int r = 0; r < a.n; r++) {\n"
    "      U x; x.u = ld_line2(base + (u64)r * a.flip + 32 * j, k, a.failed);\n"
    "#pragma unroll\n"
    "      for (int v = 0; v < V; v++) { A y = D::ld(x.t[v]); acc[v] = r ? apply<D, OP>(acc[v], y) : y; }\n"
    "    }\n"
    "    U y;\n"
    "#pragma unroll\n"
    "    for (int v = 0; v < V; v++) y.t[v] = fin<D, OP>(acc[v], a.n);\n"
    "    st_vec(a.out, j, a.nbytes, y.u);\n"
    "  }\n"
    "}\n"
    "extern \"C\" __global__ void uccl_sg_cll(FArgs a) {\n"
    "  u32 k = *(volatile u32 *)a.epoch + 1u;\n"
    "  u64 par = (u64)(k & 1u) * (u64)a.n * a.flip, mine = (u64)a.me * a.flip;\n"
    "  u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;\n"
    "  u64 nv = (a.nbytes + 15) / 16;\n"
    "  for (u64 j = tid; j < nv; j += stride) {\n"
    "    V16 v = ld_vec(a.in, j, a.nbytes);\n"
    "    for (int r = 0; r < a.n; r++) {\n"
    "      u64 d = a.slot[r] + par + mine + 32 * j;\n"
    "      st_ll(d, v.w[0], v.w[1], k); st_ll(d + 16, v.w[2], v.w[3], k);\n"
    "    }\n"
    "  }\n"
    "  u64 base = a.slot[a.me] + par;\n"
    "  if (a.gather) {\n"
    "    for (int r = 0; r < a.n; r++)\n"
    "      for (u64 j = tid; j < nv; j += stride)\n"
    "        st_vec(a.out + (u64)r * a.nbytes, j, a.nbytes, ld_line2(base + (u64)r * a.flip + 32 * j, k, a.failed));\n"
    "  } else if (a.count) {\n"
    "    switch (a.op) {\n"
    "    case SUM: ll_reduce<UCCL_DT, SUM>(a, base, k); break;   case PROD: ll_reduce<UCCL_DT, PROD>(a, base, k); break;\n"
    "    case MIN: ll_reduce<UCCL_DT, MIN>(a, base, k); break;   case MAX: ll_reduce<UCCL_DT, MAX>(a, base, k); break;\n"
    "    case BAND: ll_reduce<UCCL_DT, BAND>(a, base, k); break; case BOR: ll_reduce<UCCL_DT, BOR>(a, base, k); break;\n"
    "    case BXOR: ll_reduce<UCCL_DT, BXOR>(a, base, k); break; case AVG: ll_reduce<UCCL_DT, AVG>(a, base, k); break;\n"
    "    }\n"
    "  }\n"
    "  if (last_block((u32 *)a.ctr + 1) && threadIdx.x == 0) *(volatile u32 *)a.epoch = k;\n"
    "}\n";

/* Several copies in one launch, after the copy: block row y copies
 * segment y (the copy's grid-wide split over a row's blocks), one driver
 * call where each cuMemcpyAsync costs several microseconds of the host's
 * time. */
const char uccl__sg_copy_src[] =
    "struct CopyArgs { u64 dst[32]; u64 src[32]; u64 len[32]; int n; };\n"
    "extern \"C\" __global__ void uccl_sg_copy(CopyArgs a) {\n"
    "  int s = blockIdx.y;\n"
    "  if (s < a.n) copy_bytes(a.dst[s], a.src[s], a.len[s]);\n"
    "}\n";

/* A two-sided round's handshake (struct uccl__sg_sync_args): thread 0
 * sets this rank's words, thread r waits for rank r's arena word, then
 * thread 0 writes fin.  As a launch of one warp (uccl_sg_sync) it spins,
 * as the one-launch round does, so it runs only where those do (one block:
 * beside any launch); the page's failed flag, read every 64th poll, ends
 * it. */
const char uccl__sg_sync_src[] =
    "struct SArgs { u64 mine, page, fin, failed; u64 peer[8]; u32 k, mask; int me, n, sys; };\n"
    "__device__ __forceinline__ void handshake(const SArgs &a) {\n"
    "  int r = threadIdx.x;\n"
    "  if (r == 0) {\n"
    "    fence(a.sys);\n"
    "    *(volatile u32 *)a.mine = a.k;\n"
    "    *(volatile u32 *)a.page = a.k;\n"
    "  }\n"
    /* each poller fences (wait_word): what block 0 of the gather launch
     * reads next is the peers' bytes */
    "  if (r < a.n && ((a.mask >> r) & 1)) wait_word(a.peer[r], a.k, a.failed, a.sys);\n"
    "  __syncthreads();\n"
    "  if (r == 0) {\n"
    "    fence(a.sys);\n"
    "    if (a.fin) *(volatile u32 *)a.fin = a.k;\n"
    "  }\n"
    "}\n"
    "extern \"C\" __global__ void uccl_sg_sync(SArgs a) { handshake(a); }\n";

/* A one-phase two-sided round with no reduction (sgroup.h,
 * uccl__sg_dev.gather) as one launch, after the handshake and the copy:
 * block 0 makes the ready handshake and raises the seen flag (device
 * memory) that the other blocks wait for; every block copies its share of
 * each segment from the peers' buffers, mapped; the last block to finish
 * makes the done handshake and writes fin.  The three launches it replaces
 * (handshake, copies, handshake) left the GPU idle between them: 16 MiB
 * in place on one H200 shared by 4 ranks under MPS, 109-110 us a call
 * against 88-89 as one launch (benchmarks/stream_sync_floor.py, docs/benchmark-log.md).
 * Every block spins until block 0 has seen its peers, so the grid is
 * bounded (cuda_gather) for the peers' launches to be resident beside it. */
const char uccl__sg_gather_src[] =
    "struct GArgs { SArgs ready, done; u64 ctr, seen; u64 dst[16], src[16], len[16]; int nseg; };\n"
    "extern \"C\" __global__ void __launch_bounds__(256, 4) uccl_sg_gather(GArgs a) {\n"
    "  if (blockIdx.x == 0) handshake(a.ready);\n"
    "  after_block0(a.seen, a.ready.k, a.ready.sys);\n"
    "  for (int s = 0; s < a.nseg; s++) copy_bytes(a.dst[s], a.src[s], a.len[s]);\n"
    "  if (last_block((u32 *)a.ctr)) handshake(a.done);\n"
    "}\n";

/* Stream memory operations counted from an epoch (sg_dev.h, the words of a
 * round captured in a CUDA graph), which the driver's own cannot compute:
 * one thread runs them in order.  A write is fenced first (what the stream
 * did before is visible to whoever sees the value); a wait spins until the
 * word reaches the value (cyclic), then fences; a bump adds one to the
 * epoch word (this rank's stream alone writes it).  A failed group's
 * release sets the words waited on far ahead, which ends a wait. */
const char uccl__sg_eops_src[] =
    "struct EArgs { u64 addr[72]; u64 epoch[72]; u32 value[72]; int kind[72]; int n; };\n"
    "extern \"C\" __global__ void uccl_sg_eops(EArgs a) {\n"
    "  for (int i = 0; i < a.n; i++) {\n"
    "    volatile u32 *w = (volatile u32 *)a.addr[i];\n"
    "    u32 v = a.value[i] + (a.epoch[i] ? *(volatile u32 *)a.epoch[i] : 0u);\n"
    "    if (a.kind[i] == 2) { *w = *w + 1u; __threadfence_system(); }\n"
    "    else if (a.kind[i] == 1) { while ((int)(*w - v) < 0) __nanosleep(64); __threadfence_system(); }\n"
    "    else { __threadfence_system(); *w = v; }\n"
    "  }\n"
    "}\n";
