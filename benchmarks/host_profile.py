"""Where the host time of one blocking dist.* op on CUDA tensors goes, through
the "uccl" group: every rank calls it back to back (no synchronize), first
without the profiler (Python's garbage collector on, off, on again: how
often it ran and how long), then rank 0 under cProfile, which lists the
Python functions the calls went through, how often (which route each call
took: Dispatch.round, Dispatch.task, the C fast path) and their own time.

    torchrun --nproc_per_node 2 benchmarks/host_profile.py --op all_to_all_single --size 64K

Not a benchmark against a reference: it says which part of the host path to
cut (docs/benchmark-log.md keeps what it showed).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import uccl_collective  # noqa: F401  registers the "uccl" backend
from bench_common import parse_size  # noqa: E402 (this folder is on sys.path)

OPS = ("all_to_all_single", "all_to_all", "all_gather_into_tensor", "all_reduce")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--op", choices=OPS, default="all_to_all_single")
    p.add_argument("--size", default="64K", help="bytes a rank sends (default 64K)")
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--top", type=int, default=30, help="rows of the profile to print")
    args = p.parse_args()
    idx = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(idx)
    dev = torch.device("cuda", idx)
    dist.init_process_group("uccl", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    n = max(world, parse_size(args.size) // 4 // world * world)
    x, y = torch.randn(n, device=dev), torch.empty(n, device=dev)
    out = torch.empty(world * n, device=dev)
    xs, ys = list(x.chunk(world)), list(y.chunk(world))
    call = {"all_to_all_single": lambda: dist.all_to_all_single(y, x),
            "all_to_all": lambda: dist.all_to_all(ys, xs),
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, x),
            "all_reduce": lambda: dist.all_reduce(x)}[args.op]
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    dist.barrier()
    gcs = {"n": [0, 0, 0], "s": 0.0, "t0": 0.0}

    def on_gc(phase, info):   # every collection during the timed loops: how many, how long
        if phase == "start":
            gcs["t0"] = time.perf_counter()
        else:
            gcs["n"][info["generation"]] += 1
            gcs["s"] += time.perf_counter() - gcs["t0"]
    gc.callbacks.append(on_gc)
    plain = []
    for mode in ("gc on", "gc off", "gc on"):
        if mode == "gc off":
            gc.disable()
        gcs.update(n=[0, 0, 0], s=0.0)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            call()
        plain.append((mode, (time.perf_counter() - t0) * 1e6 / args.iters, list(gcs["n"]),
                      gcs["s"] * 1e6 / args.iters))
        gc.enable()
    if rank == 0:
        import threading
        print(f"[Rank 0] threads: {[t.name for t in threading.enumerate()]}")
        for mode, us, per_gen, gc_us in plain:
            print(f"[Rank 0] {mode}: {us:.1f} us of host time a call; collections by generation "
                  f"{per_gen}, {gc_us:.1f} us a call in them")
    prof = cProfile.Profile() if rank == 0 else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(args.iters):
        call()
    if prof:
        prof.disable()
    us = (time.perf_counter() - t0) * 1e6 / args.iters
    torch.cuda.synchronize()
    if rank == 0:
        print(f"[Rank 0] {args.op} of {n * 4} bytes, {world} ranks, "
              f"{torch.cuda.get_device_name(dev)}: "
              f"{us:.1f} us of host time a call under the profiler, {args.iters} calls")
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
            print(s.getvalue())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
