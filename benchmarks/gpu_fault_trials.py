"""Fault trials on GPUs: one rank SIGKILLed, or SIGSTOPped, at a
random moment of a loop of each operation, one process per GPU; every
survivor must raise within the timeout + 5 s, raise again at once, get its
CUDA stream back, close and give its GPU memory back, and nothing may stay
in /dev/shm or on the GPUs (tests/_gpu_faults.py says how).  Prints one line
a trial and a table; --json keeps every trial.

    python3 benchmarks/gpu_fault_trials.py --world 4 --trials 10
    python3 benchmarks/gpu_fault_trials.py --world 2 --mode stop --trials 2
    python3 benchmarks/gpu_fault_trials.py --world 4 --ops gpu_ring --only 2   # one trial again
    python3 benchmarks/gpu_fault_trials.py --device cpu --world 3 --trials 1   # the harness, no GPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import _gpu_faults as G  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="ranks, one per GPU (default 2)")
    ap.add_argument("--trials", type=int, default=10, help="trials of each op (default 10)")
    ap.add_argument("--ops", default=",".join(G.OPS), help="comma-separated ops (default all: "
                    + ", ".join(G.OPS) + ")")
    ap.add_argument("--mode", choices=("kill", "stop"), default="kill",
                    help="SIGKILL the victim, or SIGSTOP it (continued at the end)")
    ap.add_argument("--timeout", type=float, default=5.0, help="the group's timeout, s (default 5)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: CPU tensors (a check of the harness on a machine without GPUs)")
    ap.add_argument("--seed", type=int, default=20261127)
    ap.add_argument("--only", help="comma-separated trial numbers to run alone (drawn as in "
                    "the whole campaign: --trials 10 --only 2 runs trial 2 of 10)")
    ap.add_argument("--json", help="write every trial here")
    a = ap.parse_args()
    ops = [o for o in a.ops.split(",") if o]
    if a.device == "cuda":
        n = G.gpu_count()
        if n < a.world:
            print(f"--world {a.world} needs {a.world} GPUs; nvidia-smi lists {n}")
            return 2
    else:
        ops = [o for o in ops if o not in G.GPU_ONLY]
    trials = G.campaign(ops, a.world, a.trials, mode=a.mode, timeout_s=a.timeout,
                        device=a.device, seed=a.seed, log=lambda s: print(s, flush=True),
                        only={int(x) for x in a.only.split(",")} if a.only else None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(trials, f, indent=1)
    print(f"\n| op | ranks | signal | trials | passed | survivors' raise, s (max) | "
          f"next call, s (max) | kept by a failed group, MiB (max) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for op in ops:
        ts = [t for t in trials if t["op"] == op]
        surv = [r for t in ts for r in t["results"] if r.get("rank") != t["victim"]]
        rs = [r["raised_s"] for r in surv if r.get("raised_s") is not None]
        ns = [r["next_s"] for r in surv if r.get("next_s") is not None]
        kept = [r["gpu_leak"] >> 20 for r in surv if r.get("gpu_leak") is not None]
        print(f"| {op} | {a.world} | SIG{a.mode.upper()} | {len(ts)} | "
              f"{sum(1 for t in ts if not t['bad'])} | {max(rs, default=float('nan')):.2f} | "
              f"{max(ns, default=float('nan')):.3f} | {max(kept, default='-')} |")
    failed = [t for t in trials if t["bad"]]
    print(f"\n{len(trials) - len(failed)} of {len(trials)} trials passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
