"""Helpers shared by the benchmark scripts: size parsing, printing, result files."""
from __future__ import annotations

import argparse
import csv
import json
import re

import torch


def parse_size(text: str) -> int:
    # Binary units, as upstream's sweep (1K = 1024); "64K", "64KB", "64KiB" all work.
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 4096, 64K, 1M, 256M, 1G")
    n = int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return n


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
