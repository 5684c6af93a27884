"""Helpers shared by the benchmark scripts: size parsing, printing, result files,
and the timing of calls back to back (as nccl-tests time)."""
from __future__ import annotations

import argparse
import csv
import json
import re
import time

import torch
import torch.distributed as dist


def parse_size(text: str) -> int:
    # Binary units, as upstream's sweep (1K = 1024); "64K", "64KB", "64KiB" all work.
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 4096, 64K, 1M, 256M, 1G")
    n = int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return n


def serve_window(conn, zero, read) -> None:
    """A window owner's side of a benchmark's pipe, until ("stop",):
    ("zero",) runs zero() and answers "zeroed"; ("get", off, ln) answers
    read(off, ln), the bytes there (for the writer's check)."""
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "zero":
            zero()
            conn.send("zeroed")
        elif msg[0] == "get":
            conn.send(read(msg[1], msg[2]))


def parse_sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def pretty(n: int) -> str:
    for unit, shift in (("GB", 30), ("MB", 20), ("KB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def write_results(rows: list[dict], args: argparse.Namespace) -> None:
    """--json FILE and --csv FILE, when given (call on one rank)."""
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "torch": torch.__version__,
                       "results": rows}, f, indent=2)
    if getattr(args, "csv", None):
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)


def settle(dev: torch.device) -> None:
    """Wait for everything queued on the GPU (a no-op on the CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, iters: int, group=None, dev: torch.device | None = None) -> float:
    """Seconds per call, the slowest rank's: every rank starts after a
    barrier with its GPU idle, and stops the clock once its GPU is done."""
    dev = dev or torch.device("cpu")
    settle(dev)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    settle(dev)
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's time
    return float(dt) / iters
