"""What one GPU shared by several processes costs a host-synchronised copy:
the floor under any collective that waits for its copies on the host.

    torchrun --nproc_per_node 2 benchmarks/gpu_share_floor.py [--size 64K] [--iters 500]

Each rank maps its right neighbour's buffer through CUDA IPC (torch's
reduce_tensor) and times, per iteration, one copy of --size bytes from that
mapping followed by a wait for it on the host:
  alone          one rank at a time copies while the others wait in a barrier
  together       every rank copies at once (what an allgather does)
  together-poll  the same, the wait a busy cudaEventQuery loop (what the
                 engine does) instead of cudaStreamSynchronize
  together-local every rank copies within its own memory, no IPC mapping
Run it with and without CUDA MPS (nvidia-cuda-mps-control -d) to see what
time-slicing the GPU between processes costs.  Prints p50 and mean per
iteration in microseconds, slowest rank.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from bench_common import parse_sizes


def timed(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="64K")
    p.add_argument("--iters", type=int, default=500)
    args = p.parse_args()
    size = parse_sizes(args.size)[0]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    src = torch.full((size,), rank, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    handles = [None] * world
    dist.all_gather_object(handles, reduce_tensor(src))
    fn, fargs = handles[(rank + 1) % world]
    peer = fn(*fargs)
    torch.cuda.synchronize()
    ev = torch.cuda.Event()

    def copy_sync(s=peer):
        dst.copy_(s, non_blocking=True)
        torch.cuda.current_stream().synchronize()

    def copy_poll():
        dst.copy_(peer, non_blocking=True)
        ev.record()
        while not ev.query():
            pass

    rows = []

    def report(name, samples):
        stats = torch.tensor([statistics.median(samples), statistics.fmean(samples)],
                             dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        rows.append((name, stats[0].item(), stats[1].item()))

    for _ in range(20):
        copy_sync()
    dist.barrier()
    for r in range(world):
        if rank == r:
            s = timed(copy_sync, args.iters)
        dist.barrier()
        if rank == r:
            alone = s
    report("alone", alone)
    for name, f in (("together", copy_sync), ("together-poll", copy_poll),
                    ("together-local", lambda: copy_sync(src))):
        dist.barrier()
        report(name, timed(f, args.iters))
    dst.copy_(peer)
    torch.cuda.synchronize()
    if not bool((dst == (rank + 1) % world).all()):
        raise SystemExit(f"rank {rank}: the IPC copy did not deliver the peer's bytes")
    if rank == 0:
        mps = "on" if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else "off (unless started outside)"
        print(f"{world} processes on {torch.cuda.get_device_name(dev)}, {size} B per copy, "
              f"{args.iters} iterations, MPS {mps}")
        for name, p50, mean in rows:
            print(f"  {name:<15} p50 {p50:9.1f} us  mean {mean:9.1f} us")
    dist.barrier()
    del peer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
