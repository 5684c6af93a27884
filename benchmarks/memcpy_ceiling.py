"""How fast can this machine copy memory at all?  The ceiling for any
same-host transport: one copy of N bytes, with 1 thread and with 2 threads
(numpy releases the GIL while it copies).  GB/s = 1e9 bytes/s.

    python3 benchmarks/memcpy_ceiling.py --size 256M --iters 10
"""
import argparse
import threading
import time

import numpy as np


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s)


def copy_rate(src, dst, threads: int, iters: int) -> float:
    n = src.nbytes
    bounds = [n * i // threads for i in range(threads + 1)]

    def part(i):
        np.copyto(dst[bounds[i]:bounds[i + 1]], src[bounds[i]:bounds[i + 1]])

    best = 0.0
    for _ in range(iters):
        ts = [threading.Thread(target=part, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = max(best, n / (time.perf_counter() - t0) / 1e9)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="256M")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    n = parse_size(args.size)
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    dst = np.ones(n, dtype=np.uint8)  # touched: no first-touch page faults in the timing
    for threads in (1, 2):
        print(f"memcpy {args.size} {threads} thread(s): best {copy_rate(src, dst, threads, args.iters):.2f} GB/s")


if __name__ == "__main__":
    main()
