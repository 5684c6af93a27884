"""Upstream UCCL's own GPU scripts, unchanged but for their import, on a
host with a GPU per rank (benchmarks/run_upstream.py --multi-gpu): the
collective benchmark in every mode, the allgather and alltoall benchmarks,
the NVLink test, and upstream's NCCL baselines beside them.  They bootstrap
through a Gloo group with init_collective()'s defaults, so every CUDA
tensor between ranks of this host must go through the engine's copy-engine
path (the routing rule, docs/api.md).

Upstream's files are never kept in this repository: the test reads them
from the folder UCCL_UPSTREAM_SRC names (a checkout, or its p2p/ files),
else from _upstream/old (benchmarks/device_upstream.sh's carried folder),
and skips, saying so, where neither exists or the host has fewer GPUs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpus() -> int:
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    n = sum(1 for line in p.stdout.splitlines() if line.startswith("GPU "))
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")   # nvidia-smi lists them all
    return n if vis is None else min(n, len([v for v in vis.split(",") if v.strip()]))


def _src() -> str | None:
    for d in (os.environ.get("UCCL_UPSTREAM_SRC"), os.path.join(REPO, "_upstream", "old")):
        if d and os.path.isdir(d):
            return d
    return None


@pytest.mark.parametrize("ranks", [2, 4])
def test_upstream_gpu_scripts_pass_unchanged(ranks, tmp_path):
    if _gpus() < ranks:
        pytest.skip(f"needs {ranks} GPUs (one per rank); nvidia-smi lists {_gpus()}")
    src = _src()
    if src is None:
        pytest.skip("upstream's files are not here: set UCCL_UPSTREAM_SRC to a checkout of "
                    "uccl-project/uccl (681068e4 has the collective benchmarks)")
    out = tmp_path / "upstream.json"
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "run_upstream.py"),
                        "--src", src, "--multi-gpu", "--ranks", str(ranks), "--nvtx-stub",
                        "--timeout", "90", "--json", str(out)],
                       capture_output=True, text=True, timeout=1200, cwd=REPO)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    failed = [(r["name"], r["why"]) for r in rows if r["result"] not in ("pass", "not run")]
    assert not failed, failed
    ran = [r["name"] for r in rows if r["result"] == "pass"]
    # every entry runs, but those upstream wrote for 2 ranks only, at 4
    two_only = [r for r in rows if r["result"] == "not run"]
    assert all("accepts 2 ranks only" in r["why"] for r in two_only), two_only
    assert ranks == 4 or not two_only, two_only
    for name in ("benchmark_uccl_collective --ring", "benchmark_uccl_allgather",
                 "benchmark_uccl_alltoall", "benchmark_nccl_allgather"):
        assert name in ran, (name, rows)
