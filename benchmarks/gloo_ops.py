"""Gloo timings shared by the benchmarks: the comparison every figure of
ours is set against, measured the same way wherever it is used."""
import time

import torch.distributed as dist


def gloo_pingpong(rank, src, dst, count):
    """Per-round-trip times in seconds of `count` ping-pongs between ranks 0 and 1
    (rank 0 sends src first; one-way latency = round trip / 2)."""
    times = []
    peer = 1 - rank
    for _ in range(count):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(src, dst=peer)
            dist.recv(dst, src=peer)
        else:
            dist.recv(dst, src=peer)
            dist.send(src, dst=peer)
        times.append(time.perf_counter() - t0)
    return times
