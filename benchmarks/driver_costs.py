"""Host cost of the CUDA calls a stream-ordered collective makes, one process:

    python3 benchmarks/driver_costs.py [--iters 20000]

Each line is the median host time of one call (microseconds), timed in
batches of 100 with nothing waited for: what the issuing thread pays, not
the GPU.  Run it under CUDA MPS and without to see what MPS adds per call.
(The first run, docs/benchmark-log.md, also timed the stream memory operations
through a module function that the engine's stream-ordered groups have
since replaced.)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def per_call_us(fn, iters: int) -> float:
    batch, ts = 100, []
    for _ in range(max(1, iters // batch)):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        ts.append((time.perf_counter() - t0) / batch)
    return statistics.median(ts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20000)
    args = ap.parse_args()
    dev = 0
    torch.cuda.set_device(dev)
    s = torch.cuda.Stream(dev)
    a = torch.zeros(1024, device="cuda")
    b = torch.zeros(1024, device="cuda")
    ev = torch.cuda.Event()
    cases = [
        ("torch.cuda.Event()", torch.cuda.Event),
        ("Event.record(stream)", lambda: ev.record(s)),
        ("stream.wait_event(ev)", lambda: s.wait_event(ev)),
        ("tensor.record_stream(s)", lambda: a.record_stream(s)),
        ("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev)),
        ("torch._C._cuda_getCurrentRawStream(dev)", lambda: torch._C._cuda_getCurrentRawStream(dev)),
        ("with torch.cuda.stream(s): pass", lambda: _enter(s)),
        ("a.add_(1) (a kernel launch)", lambda: a.add_(1)),
        ("torch.sum(rows, 0, out=...)", lambda: torch.sum(b.view(2, 512), 0, out=a[:512])),
        ("stream.query()", s.query),
    ]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}; host us per call "
          f"(median of batches of 100, {args.iters} calls)")
    for name, fn in cases:
        with torch.cuda.stream(s):
            fn()
            torch.cuda.synchronize()
            us = per_call_us(fn, args.iters)
            torch.cuda.synchronize()
        print(f"  {name:<44} {us:8.2f}")


def _enter(s) -> None:
    with torch.cuda.stream(s):
        pass


if __name__ == "__main__":
    main()
