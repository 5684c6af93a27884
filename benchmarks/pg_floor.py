"""The floor of any process group written in Python: a torch.distributed
call through a backend whose operations do nothing, timed against the same
call through "uccl" in the same run.

    torchrun --nproc_per_node 2 benchmarks/pg_floor.py [--device gpu] [--iters 2000]

"noop" is a ProcessGroup subclass registered here whose all_reduce and
all_gather_into_tensor return a finished Work at once (nothing moves, so
its results are not checked).  What a call costs there is what torch's
dist.* wrappers and the C++ -> Python dispatch cost on this machine, which
no Python backend can go below.  Each figure is per call, calls back to
back with one synchronize at the end (as nccl-tests time), the slowest
rank's, median of --rounds rounds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from bench_common import timed  # noqa: E402 (this folder is on sys.path)


class NoopWork(dist._Work):
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


class NoopGroup(dist.ProcessGroup):
    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)

    def getBackendName(self):
        return "noop"

    def _get_backend(self, device):   # as the uccl group: itself for every device
        return self

    def allreduce(self, tensors, opts=None):
        return NoopWork()

    def _allgather_base(self, output, input, opts=None):
        return NoopWork()

    all_gather_single = _allgather_base   # torch's newer name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="4,1048576", help="bytes per rank, comma-separated")
    args = ap.parse_args()
    import uccl_collective  # noqa: F401  registers "uccl"
    dist.Backend.register_backend("noop", NoopGroup, devices=["cpu", "cuda"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cpu")
    if args.device == "gpu":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    gloo = dist.group.WORLD
    noop = dist.new_group(backend="noop")
    uccl = dist.new_group(backend="uccl")
    ag = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    if rank == 0:
        print(f"[Rank 0] per call, {world} ranks, {dev}, torch {torch.__version__}, "
              f"{args.iters} calls back to back x {args.rounds} rounds (median), slowest rank")
    for size in [int(s) for s in args.sizes.split(",")]:
        n = max(1, size // 4)
        x = torch.zeros(n, device=dev)
        y = torch.empty(n * world, device=dev)
        paths = [("noop dist.all_reduce", lambda: dist.all_reduce(x, group=noop)),
                 ("uccl dist.all_reduce", lambda: dist.all_reduce(x, group=uccl)),
                 ("noop dist.all_gather_into_tensor", lambda: ag(y, x, group=noop)),
                 ("uccl dist.all_gather_into_tensor", lambda: ag(y, x, group=uccl))]
        for _, fn in paths:   # warm up (registrations, kernels compiled)
            for _ in range(20):
                fn()
        got = {name: [] for name, _ in paths}
        for _ in range(args.rounds):
            for name, fn in paths:
                got[name].append(timed(fn, args.iters, gloo, dev) * 1e6)
        if rank == 0:
            for name, ts in got.items():
                print(f"  {size:>9} B  {name:<34} {statistics.median(ts):8.1f} us")
    dist.barrier(group=gloo)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
