"""torch's own distributed conformance suite against "uccl": a fast subset
for CI (benchmarks/torch_suite.py runs the whole of it; docs/torch-suite.md).
The subset covers what the whole run once found
failing against Gloo (receive from any source, sparse all_reduce, the
profiler's events, DDP's no_sync) and a few collectives; every test in it
must pass, not skip."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAUNCHER = ROOT / "benchmarks" / "torch_suite.py"

SUBSET = {
    2: ["test_all_reduce_sum", "test_broadcast", "test_reduce_sum", "test_isend_autograd_profiler",
        "test_send_recv_torch_profiler", "test_send_recv_any_source_autograd_profiler",
        "test_sparse_all_reduce_sum", "test_accumulate_gradients_no_sync",
        "test_all_gather_coalesced_simple", "test_all_reduce_coalesced_sum",
        "test_batch_isend_irecv_gloo"],
    3: ["test_send_recv_any_source", "test_sparse_all_reduce_sum", "test_all_reduce_sum"],
}


def _launcher():
    spec = importlib.util.spec_from_file_location("torch_suite", LAUNCHER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gating_rewrite_applies_to_this_torch(tmp_path):
    # the copy of the suite treats uccl as gloo wherever it names gloo
    notes = _launcher().make_copy(tmp_path)
    src = (tmp_path / "_uccl_distributed_test.py").read_text()
    assert 'BACKEND == "gloo"' not in src and 'BACKEND != "gloo"' not in src
    assert "BACKEND in _UCCL_AS_GLOO" in src and '_l.append("uccl")' in src
    assert not [n for n in notes if "rule" in n], notes


def test_regressions_and_reserved():
    ts = _launcher()
    ref = {n: {"status": "passed"} for n in ("test_a", "test_b", "test_monitored_barrier_gloo")}
    got = {"test_a": {"status": "passed"}, "test_b": {"status": "failed"},
           "test_monitored_barrier_gloo": {"status": "failed"}}
    assert ts.regressions(ref, got) == ["test_b"]
    assert ts.regressions(ref, {}) == ["test_a", "test_b"]   # not run is not a pass


@pytest.mark.parametrize("ws", sorted(SUBSET))
def test_suite_subset_passes_with_uccl(tmp_path, ws):
    names = SUBSET[ws]
    cmd = [sys.executable, str(LAUNCHER), "--backends", "uccl", "--world-sizes", str(ws),
           "--tests", ",".join(names), "--out", str(tmp_path), "--timeout", "480",
           "--test-timeout", "90"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=ROOT)
    results = tmp_path / f"results_uccl_ws{ws}.jsonl"
    assert results.exists(), f"no results ({proc.returncode}):\n{proc.stdout[-3000:]}" \
                             f"\n{proc.stderr[-3000:]}"
    got = {r["test"]: r for r in map(json.loads, results.read_text().splitlines())}
    bad = [f"{n}: {got.get(n, {}).get('status', 'not run')} "
           f"{got.get(n, {}).get('reason', '')}" for n in names
           if got.get(n, {}).get("status") != "passed"]
    log = (tmp_path / f"log_uccl_ws{ws}.txt")
    tail = log.read_text()[-4000:] if log.exists() else ""
    assert not bad, "\n".join(bad) + "\n--- log tail:\n" + tail
