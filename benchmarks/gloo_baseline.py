#!/usr/bin/env python3
"""Gloo point-to-point baselines through torch.distributed (two processes, one host).

Prints two lines (median over --rounds timed rounds, with the range):
  gloo send/recv bandwidth, 256 MiB, rank 0 -> rank 1, in GB/s (1e9 bytes/s)
  gloo ping-pong one-way latency (round trip / 2), 64 KiB, in microseconds

Usage: python3 gloo_baseline.py [--rounds N] [--bw-bytes N] [--bw-iters N]
                                [--lat-bytes N] [--lat-iters N]
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gloo_ops import gloo_pingpong  # this script's folder is on sys.path


def free_port():
    # Ask the kernel for an unused port so repeated or parallel runs do not collide.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, port, args, results):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # Two cores shared by two ranks: extra intra-op threads would only steal
    # time from the other rank.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peer = 1 - rank

    # --- bandwidth: one direction, rank 0 -> rank 1 ---
    buf = torch.ones(args.bw_bytes, dtype=torch.uint8)  # touched, so no page faults in the timing
    for _ in range(args.bw_warmup):
        if rank == 0:
            dist.send(buf, dst=peer)
        else:
            dist.recv(buf, src=peer)
    # No barrier: the last recv returning means rank 0 is already on to the
    # next send, so rank 1's clock starts close to when data starts moving, and
    # the final recv returning is when all data has arrived.
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(args.bw_iters):
            if rank == 0:
                dist.send(buf, dst=peer)
            else:
                dist.recv(buf, src=peer)
        dt = time.perf_counter() - t0
        if rank == 1:
            results.put(("bw", args.bw_bytes, args.bw_iters * args.bw_bytes / dt / 1e9))
    del buf

    # --- latency: ping-pong, one-way = round trip / 2 ---
    small = torch.ones(args.lat_bytes, dtype=torch.uint8)

    gloo_pingpong(rank, small, small, args.lat_warmup)
    for _ in range(args.rounds):
        dt = sum(gloo_pingpong(rank, small, small, args.lat_iters))
        if rank == 0:
            results.put(("lat", args.lat_bytes, dt / args.lat_iters / 2 * 1e6))

    dist.destroy_process_group()


def human(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bw-bytes", type=int, default=256 << 20)
    p.add_argument("--bw-warmup", type=int, default=2)
    p.add_argument("--bw-iters", type=int, default=10)
    p.add_argument("--lat-bytes", type=int, default=64 << 10)
    p.add_argument("--lat-warmup", type=int, default=20)
    p.add_argument("--lat-iters", type=int, default=200)
    # Timed rounds per figure; median and range are printed because this
    # 2-core VM swings by 2x or more from one run to the next.
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.spawn(worker, args=(free_port(), args, results), nprocs=2, join=True)

    got = {"bw": [], "lat": []}
    sizes = {}
    while not results.empty():
        kind, size, val = results.get()
        got[kind].append(val)
        sizes[kind] = size
    tv = torch.__version__
    for kind, what, unit in (("bw", f"gloo send/recv, rank0->rank1 (torch {tv})", "GB/s"),
                             ("lat", f"gloo ping-pong one-way (torch {tv})", "us")):
        vals = got[kind]
        # Same layout as baselines.sh: what, size, median, units (range, n).
        print(f"{what:<52} {human(sizes[kind]):>8}  {statistics.median(vals):9.2f} "
              f"{unit} (range {min(vals):.2f}-{max(vals):.2f}, n={len(vals)})")


if __name__ == "__main__":
    main()
