"""The least a stream-ordered in-place allgather costs on one GPU shared by
the ranks: its copies, and the two handshakes between the ranks' streams
that a correct one needs (before the copies: every peer's chunk is written;
after: every peer has read this rank's chunk, so the caller may overwrite
it), each timed on the GPU alone.

    torchrun --nproc_per_node 2 benchmarks/stream_sync_floor.py [--size 16M] [--iters 40]

Each row is the GPU's time per iteration, slowest rank, with the host out of
the way: the stream first waits on a gate word, the host queues --iters
iterations, and the gate opens once every rank has queued them (so --iters
must fit the stream's queue: 40 at 4 ranks).  Rows:
  torch add_ 4 B              one small kernel: the launches' own pace
  handshake, page words       each rank's stream writes its word, then waits
                              for every peer's: words in pinned host memory
                              (the engine's page), polled over PCIe
  handshake, device words     the same with the words in device memory
                              (CUDA IPC), what the engine's one-launch rounds poll
  copies (ipc-copy)           the N-1 chunks copied through IPC mappings,
                              nothing else: benchmark_uccl_collective.py's
                              --compare ipc-copy --in-place
  handshake, copies, handshake   the least a correct round does, per kind of word
  engine, in place            the engine's allgather of --size bytes a rank
                              (a two-sided round above UCCL_SG_FUSED_BYTES)
  engine, in place, 4 B       the same for 4 bytes (one launch, unless
                              UCCL_SG_FUSED_BYTES=0 makes it two-sided)
  SM copies GxT               the copies by a kernel of G blocks of T threads
                              (--sm-grids), no handshake
  one launch GxT              handshake, SM copies, handshake in one kernel
                              (every block waits for block 0's handshake;
                              the last block to finish makes the second)
Not a benchmark against a reference: it tells what the 1.25x ipc-copy
target leaves for the handshakes (docs/benchmark-log.md keeps what it showed).
"""
from __future__ import annotations

import argparse
import ctypes
import struct
import mmap
import os
import time

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from bench_common import parse_size  # noqa: E402 (this folder is on sys.path)
from uccl_collective.core import stream_group as _stream_group

GEQ = 0                    # CU_STREAM_WAIT_VALUE_GEQ
HOST_REGISTER = 1 | 2      # CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP
GATE = 1024                # the gate word's offset in the shared page


class Driver:
    """The few CUDA driver calls torch does not expose (the v2 stream memory
    operations: the unversioned ones need a device attribute turned on)."""

    def __init__(self):
        cu = ctypes.CDLL("libcuda.so.1")
        self.wait = cu.cuStreamWaitValue32_v2
        self.write = cu.cuStreamWriteValue32_v2
        for f in (self.wait, self.write):
            f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self.register = cu.cuMemHostRegister_v2
        self.register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self.unregister = cu.cuMemHostUnregister
        self.unregister.argtypes = [ctypes.c_void_p]
        self.devptr = cu.cuMemHostGetDevicePointer_v2
        self.devptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]

    @staticmethod
    def ok(r: int, what: str) -> None:
        if r != 0:
            raise RuntimeError(f"{what}: CUresult {r}")


# the SM rows' kernel: copies of the peers' chunks, and the handshakes on
# device words (a rank's word: 2k-1 when it reached call k, 2k when it has
# read its peers' chunks for call k)
SM_SRC = r"""
typedef unsigned long long u64; typedef unsigned int u32;
#define PLAIN_LD(p) (*(p))
#define PLAIN_ST(p, v) (*(p) = (v))
struct A { u64 dst[8], src[8], len, mine, go, ctr, peer[8]; u32 k; int nseg, n, me, first, last; };
__device__ __forceinline__ bool before(u64 w, u32 v) { return (int)(*(volatile u32 *)w - v) < 0; }
__device__ __forceinline__ void wait_peers(const A &a, u32 v) {
  int r = threadIdx.x;
  if (r < a.n && r != a.me) while (before(a.peer[r], v)) __nanosleep(32);
  __syncthreads();
}
#ifndef TMA
#define TMA 0
#endif
__device__ __forceinline__ u32 sa(const void *p) { return (u32)__cvta_generic_to_shared(p); }
#if TMA
__device__ __forceinline__ void tma_load(const A &a, int sg, u64 j, int q, unsigned char *b, u64 *bar) {
  u64 off = (blockIdx.x + j * gridDim.x) * (u64)CH;
  u32 bytes = (u32)(a.len - off < CH ? a.len - off : CH);
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sa(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(sa(b)), "l"(a.src[sg] + off), "r"(bytes), "r"(sa(bar)) : "memory");
}
#endif
extern "C" __global__ void __launch_bounds__(512, 2) floor_copy(A a) {
  if (a.first) {
    if (blockIdx.x == 0) {
      if (threadIdx.x == 0) { __threadfence(); *(volatile u32 *)a.mine = 2 * a.k - 1; }
      wait_peers(a, 2 * a.k - 1);
      if (threadIdx.x == 0) { __threadfence(); *(volatile u32 *)a.go = a.k; }
    } else if (threadIdx.x == 0) {
      while (before(a.go, a.k)) __nanosleep(32);
      __threadfence();
    }
    if (threadIdx.x == 0) asm volatile("fence.proxy.async;" ::: "memory");
    __syncthreads();
  }
#if TMA
  /* the bulk copy unit (sm_90): thread 0 of each block moves chunks of CH
   * bytes (chunk c by block c mod grid) global -> shared -> global, S
   * chunks' loads in flight */
  __shared__ alignas(128) unsigned char buf[S][CH];
  __shared__ alignas(8) u64 bar[S];
  if (threadIdx.x == 0) {
    for (int q = 0; q < S; q++)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(&bar[q])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async;" ::: "memory");
    u32 uses[S];
    for (int q = 0; q < S; q++) uses[q] = 0;
    for (int sg = 0; sg < a.nseg; sg++) {
      u64 nch = (a.len + CH - 1) / CH, G = gridDim.x;
      u64 mine = nch > blockIdx.x ? (nch - blockIdx.x + G - 1) / G : 0;
      for (u64 j = 0; j < mine && j < S; j++) tma_load(a, sg, j, (int)j, buf[j], &bar[j]);
      for (u64 j = 0; j < mine; j++) {
        int q = (int)(j % S);
        u32 ok = 0, par = uses[q] & 1;
        while (!ok)
          asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                       : "=r"(ok) : "r"(sa(&bar[q])), "r"(par) : "memory");
        uses[q]++;
        u64 off = (blockIdx.x + j * G) * (u64)CH;
        u32 bytes = (u32)(a.len - off < CH ? a.len - off : CH);
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(a.dst[sg] + off), "r"(sa(buf[q])), "r"(bytes) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (j + S < mine) {
          asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
          tma_load(a, sg, j + S, q, buf[q], &bar[q]);
        }
      }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async;" ::: "memory");
  }
#else
  u64 nv = a.len / 16;
#if CONTIG
  u64 lo = nv * blockIdx.x / gridDim.x, hi = nv * (blockIdx.x + 1) / gridDim.x;
  u64 tid = lo + threadIdx.x, stride = blockDim.x;
#else
  u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x, hi = nv;
#endif
  for (int s = 0; s < a.nseg; s++) {
    const uint4 *src = (const uint4 *)a.src[s]; uint4 *dst = (uint4 *)a.dst[s];
    u64 j = tid;
    for (; j + (UNROLL - 1) * stride < hi; j += UNROLL * stride) {
      uint4 t[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; u++) t[u] = LD(src + j + u * stride);
#pragma unroll
      for (int u = 0; u < UNROLL; u++) ST(dst + j + u * stride, t[u]);
    }
    for (; j < hi; j += stride) ST(dst + j, LD(src + j));
  }
#endif
  if (!a.last) return;
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd((u32 *)a.ctr, 1u) == gridDim.x - 1;
    if (last) { *(volatile u32 *)a.ctr = 0; __threadfence(); *(volatile u32 *)a.mine = 2 * a.k; }
  }
  __syncthreads();
  if (last) wait_peers(a, 2 * a.k);
}
"""


# name: (loads in flight a thread, a contiguous range a block, load, store)
VARIANTS = {
    "u4": (4, 0, "PLAIN_LD", "PLAIN_ST"), "u8": (8, 0, "PLAIN_LD", "PLAIN_ST"),
    "u8cs": (8, 0, "__ldcs", "__stcs"), "u8c": (8, 1, "PLAIN_LD", "PLAIN_ST"),
    "u8ccs": (8, 1, "__ldcs", "__stcs"), "u4ldg": (4, 0, "__ldg", "PLAIN_ST"),
    "u8lu": (8, 0, "__ldlu", "__stcs"),
    # the bulk copy unit: chunk bytes, chunks in flight (blocks of 32 threads suffice)
    "tma16x2": (16384, 2), "tma8x5": (8192, 5), "tma12x3": (12288, 3), "tma4x8": (4096, 8),
}


def peer_views(t: torch.Tensor, world: int, rank: int) -> list[torch.Tensor]:
    """Every rank's t, mapped here through CUDA IPC (this rank's: t)."""
    handles = [None] * world
    dist.all_gather_object(handles, reduce_tensor(t))
    return [t if r == rank else handles[r][0](*handles[r][1]) for r in range(world)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("16M"),
                   help="bytes a rank (a multiple of 4)")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--sm-grids", default="",
                   help="SM rows' kernels, blocks x threads, comma-separated: 132x512,264x256")
    p.add_argument("--sm-variants", default="u4",
                   help="the SM copy loop's variants, comma-separated: " + ", ".join(VARIANTS))
    args = p.parse_args()
    os.environ.setdefault("UCCL_SOCKET_IFNAME", "lo")
    idx = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(idx)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cu, ok = Driver(), Driver.ok

    # the page: one word a rank (a cache line each) and the gate, in a
    # shared file that every rank maps and registers with the driver
    name = [f"/dev/shm/uccl_sync_floor_{os.getpid()}"]
    dist.broadcast_object_list(name, src=0)
    if rank == 0:
        with open(name[0], "wb") as fh:
            fh.write(b"\0" * 4096)
    dist.barrier()
    fd = os.open(name[0], os.O_RDWR)
    page = mmap.mmap(fd, 4096)
    os.close(fd)
    host = ctypes.addressof((ctypes.c_char * 4096).from_buffer(page))
    ok(cu.register(host, 4096, HOST_REGISTER), "cuMemHostRegister")
    hdev = ctypes.c_uint64()
    ok(cu.devptr(ctypes.byref(hdev), host, 0), "cuMemHostGetDevicePointer")
    gate_word = ctypes.c_uint32.from_buffer(page, GATE)
    words = {"page": [hdev.value + 64 * r for r in range(world)]}
    mine = torch.zeros(16, dtype=torch.int32, device="cuda")
    dwords = peer_views(mine, world, rank)
    words["device"] = [t.data_ptr() for t in dwords]

    n = args.size // 4
    y = torch.empty(n * world, device="cuda")
    ys = y.chunk(world)
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    ys[rank].copy_(torch.rand(n, device="cuda", generator=g))
    peers = peer_views(y, world, rank)
    pulls = [(ys[r], peers[r].chunk(world)[r]) for r in range(world) if r != rank]
    torch.cuda.synchronize()
    dist.barrier()
    s = torch.cuda.current_stream().cuda_stream
    count = {"page": 0, "device": 0, "gate": 0}

    def handshake(kind: str) -> None:
        count[kind] += 1
        w, k = words[kind], count[kind]
        ok(cu.write(s, w[rank], k, 0), "cuStreamWriteValue32")
        for r in range(world):
            if r != rank:
                ok(cu.wait(s, w[r], k, GEQ), "cuStreamWaitValue32")

    def copies() -> None:
        for dst, src in pulls:
            dst.copy_(src)

    def gpu_us(label: str, fn) -> None:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        count["gate"] += 1
        ok(cu.wait(s, hdev.value + GATE, count["gate"], GEQ), "gate")
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(args.iters):
            fn()
        b.record()
        dist.barrier()   # every rank has queued its iterations: open the gate
        if rank == 0:
            gate_word.value = count["gate"]
        torch.cuda.synchronize()
        v = torch.tensor([a.elapsed_time(b) * 1e3 / args.iters], dtype=torch.float64)
        every = [torch.empty_like(v) for _ in range(world)]
        dist.all_gather(every, v)
        if rank == 0:
            print(f"[Rank 0] {world} ranks  {label:<44} {max(e.item() for e in every):8.1f} us",
                  flush=True)

    if rank == 0:
        print(f"[Rank 0] {torch.cuda.get_device_name()}, {world} ranks, {args.size} bytes a rank, "
              f"{args.iters} iterations, GPU time per iteration (slowest rank)")
    x = torch.zeros(world, device="cuda")
    gpu_us("torch add_ 4 B", lambda: x.add_(1))
    for kind in ("page", "device"):
        gpu_us(f"handshake, {kind} words", lambda kind=kind: handshake(kind))
    gpu_us("copies (ipc-copy)", copies)
    for kind in ("page", "device"):
        gpu_us(f"handshake, copies, handshake ({kind} words)",
               lambda kind=kind: (handshake(kind), copies(), handshake(kind)))
    if args.sm_grids:
        sm_rows(args, idx, rank, world, ys, peers, gpu_us, s)
    upg = dist.new_group(backend="uccl")
    sg = upg._get_backend(torch.device("cuda", idx))._d.stream_group(idx)
    raw = _stream_group._raw_stream
    gpu_us(f"engine, in place, {args.size} B",
           lambda: sg.c.allgather(raw(idx), True, 0, ys[rank].data_ptr(), args.size, y.data_ptr()))
    gpu_us("engine, in place, 4 B",
           lambda: sg.c.allgather(raw(idx), True, 0, x[rank:].data_ptr(), 4, x.data_ptr()))

    # every chunk of y is its owner's (the last run was the engine's)
    torch.cuda.synchronize()
    got = [torch.empty(n) for _ in range(world)]
    dist.all_gather(got, ys[rank].cpu())
    for r in range(world):
        if not torch.equal(ys[r].cpu(), got[r]):
            raise SystemExit(f"rank {rank}: chunk {r} of the allgather is not rank {r}'s")
    del pulls, peers, dwords
    torch.cuda.synchronize()
    dist.barrier()   # no rank unmaps or frees before every rank is done
    ok(cu.unregister(host), "cuMemHostUnregister")
    if rank == 0:
        os.unlink(name[0])
    dist.destroy_process_group()


def sm_rows(args, idx, rank, world, ys, peers, gpu_us, s) -> None:
    """The --sm-grids rows (the docstring's): one kernel's copies and handshakes."""
    from uccl_collective import _engine
    ks = {}
    for v in args.sm_variants.split(","):
        if v.startswith("tma"):
            ch, st = VARIANTS[v]
            opts = ["-DTMA=1", f"-DCH={ch}", f"-DS={st}"]
        else:
            u, c, ld, st = VARIANTS[v]
            opts = [f"-DUNROLL={u}", f"-DCONTIG={c}", f"-DLD={ld}", f"-DST={st}"]
        ks[v] = _engine.gpu_compile(idx, SM_SRC, "floor_copy", [], opts)
    words = torch.zeros(64, dtype=torch.int32, device="cuda")   # mine at 0, go at 16, ctr at 32
    wv = peer_views(words, world, rank)
    torch.cuda.synchronize()
    dist.barrier()
    segs = [(ys[r].data_ptr(), peers[r].chunk(world)[r].data_ptr()) for r in range(world) if r != rank]
    k = [0]

    def launch(grid, block, first, last, v):
        dst = [d for d, _ in segs] + [0] * (8 - len(segs))
        src = [x for _, x in segs] + [0] * (8 - len(segs))
        peer = [t.data_ptr() for t in wv] + [0] * (8 - world)
        blob = struct.pack("<8Q8Q4Q8QIiiiii", *dst, *src, args.size, words.data_ptr(),
                           words.data_ptr() + 64, words.data_ptr() + 128, *peer, k[0],
                           len(segs), world, rank, first, last)
        blob += b"\0" * (-len(blob) % 8)
        _engine.gpu_launch(ks[v], (grid, 1, 1), (block, 1, 1), 0, s, blob, [(0, len(blob))])

    for v, spec in ((v, spec) for v in args.sm_variants.split(",")
                    for spec in args.sm_grids.split(",")):
        g, t = (int(x) for x in spec.lower().split("x"))

        def copies_only(g=g, t=t, v=v):
            launch(g, t, 0, 0, v)

        def one(g=g, t=t, v=v):
            k[0] += 1
            launch(g, t, 1, 1, v)

        gpu_us(f"SM copies {v} {spec}", copies_only)
        gpu_us(f"one launch {v} {spec}", one)
        torch.cuda.synchronize()
        got = [torch.empty(ys[0].numel()) for _ in range(world)]
        dist.all_gather(got, ys[rank].cpu())
        bad = [r for r in range(world) if not torch.equal(ys[r].cpu(), got[r])]
        if bad:
            raise SystemExit(f"rank {rank}: SM rows {spec}: chunks {bad} are not their owners'")
    torch.cuda.synchronize()
    dist.barrier()
    del wv


if __name__ == "__main__":
    main()
