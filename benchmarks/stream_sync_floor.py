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
Not a benchmark against a reference: it tells what the issue's ipc-copy
target leaves for the handshakes (BENCHMARKS.md keeps what it showed).
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import time

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from bench_common import parse_size  # noqa: E402 (this folder is on sys.path)
from uccl_collective import _stream_group

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
    upg = dist.new_group(backend="uccl")
    sg = upg._get_backend(torch.device("cuda", idx))._stream_group(idx)
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


if __name__ == "__main__":
    main()
