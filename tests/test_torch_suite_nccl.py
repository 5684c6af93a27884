"""benchmarks/torch_suite.py --as nccl, checked without a GPU: torch's own
distributed suite with its decisions taken as for NCCL while its groups are
uccl's (docs/torch-suite.md).  The rewrite applies to this torch, the copy
imports and makes uccl groups where it asks for NCCL, a few tests run for
real skip as NCCL's do without GPUs, and the ranges and their merge are
checked on synthetic result files.  The run on GPUs is
benchmarks/device_torch_suite_nccl.sh."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAUNCHER = ROOT / "benchmarks" / "torch_suite.py"


def _launcher():
    spec = importlib.util.spec_from_file_location("torch_suite", LAUNCHER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _suite_text() -> str:
    spec = importlib.util.find_spec("torch.testing._internal.distributed.distributed_test")
    return pathlib.Path(spec.origin).read_text()


def test_rewrite_applies_to_this_torch(tmp_path):
    ts = _launcher()
    notes = ts.make_copy_as_nccl(tmp_path)
    assert not [n for n in notes if "rule" in n], notes   # every rule found something
    src = (tmp_path / "_uccl_distributed_test.py").read_text()
    # the gating is left as NCCL's; the comparisons of a group's name read it as NCCL's
    assert 'BACKEND != "nccl"' in src and 'BACKEND == "nccl"' in src
    assert "_UCCL_AS_GLOO" not in src
    assert "dist = _UcclDist(dist)" in src
    assert "_uccl_gated(dist.get_backend())" in src
    assert "torch.distributed.new_group(" not in src


@pytest.mark.parametrize("missing", ["BACKEND = os.environ[\"BACKEND\"]\n",
                                     "import torch.distributed as dist\n",
                                     "backend=BACKEND,"])
def test_a_missing_required_text_stops_the_rewrite_naming_it(tmp_path, missing):
    ts = _launcher()
    src = _suite_text().replace(missing, "")
    with pytest.raises(SystemExit, match=re.escape(repr(missing.strip()))):
        ts.make_copy_as_nccl(tmp_path, src)


def test_a_missing_required_rule_stops_the_rewrite_naming_it(tmp_path):
    ts = _launcher()
    src = _suite_text().replace("dist.get_backend(", "dist.get_backend_(")
    with pytest.raises(SystemExit, match=r"get_backend"):
        ts.make_copy_as_nccl(tmp_path, src)


_PROBE = r'''
import os, sys
sys.path.insert(0, sys.argv[1])
import torch, uccl_collective  # noqa: F401
import torch.distributed as real
import _uccl_distributed_test as dt
out = {"BACKEND": dt.BACKEND}
dt.dist.init_process_group(backend=dt.BACKEND, store=real.HashStore(), rank=0, world_size=1)
out["default"] = real.get_backend()
out["default_as_read"] = dt._uccl_gated(dt.dist.get_backend())
out["nccl_positional"] = real.get_backend(dt.dist.new_group([0], None, dt.dist.Backend.NCCL))
out["gloo"] = real.get_backend(dt.dist.new_group(backend="gloo"))
out["mixed"] = real.get_backend(dt.dist.new_group(backend="cpu:gloo,cuda:nccl"))
out["gloo_as_read"] = dt._uccl_gated("gloo")
out["profiling"] = list(dt.PROFILING_SUPPORTED_BACKENDS)
out["same_module"] = dt.dist.all_reduce is real.all_reduce
real.destroy_process_group()
print("PROBE " + __import__("json").dumps(out))
'''


def test_the_copy_makes_uccl_groups_where_it_asks_for_nccl(tmp_path):
    ts = _launcher()
    ts.make_copy_as_nccl(tmp_path)
    (tmp_path / "probe.py").write_text(_PROBE)
    env = dict(os.environ, BACKEND="nccl", UCCL_SUITE_PG_BACKEND="uccl", WORLD_SIZE="2",
               TEMP_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(tmp_path / "probe.py"), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=180, cwd=ROOT)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert line, p.stdout[-2000:] + p.stderr[-3000:]
    got = json.loads(line[len("PROBE "):])
    assert got["BACKEND"] == "nccl"
    assert got["default"] == "uccl" and got["default_as_read"] == "nccl"
    assert got["nccl_positional"] == "uccl"
    assert got["gloo"] == "gloo" and got["gloo_as_read"] == "gloo"
    assert got["mixed"] == "cpu:gloo,cuda:uccl"
    assert "nccl" in got["profiling"] and "uccl" in got["profiling"]
    assert got["same_module"]


def test_gated_as_nccl_tests_skip_without_gpus(tmp_path):
    # run for real (ranks started by fork: quick), as the GPU machine would with no GPU
    names = ["test_all_reduce_sum", "test_send_recv_nccl", "test_all_reduce_sum_cuda",
             "test_get_backend"]
    cmd = [sys.executable, str(LAUNCHER), "--as", "nccl", "--backends", "uccl", "--tests",
           ",".join(names), "--start", "fork", "--out", str(tmp_path), "--timeout", "240",
           "--test-timeout", "60"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    results = tmp_path / "results_uccl_ws2.jsonl"
    assert results.exists(), p.stdout[-2000:] + p.stderr[-3000:]
    got = {r["test"]: r for r in map(json.loads, results.read_text().splitlines())}
    assert set(got) == set(names), got
    # NCCL's gating, read in the class body ("Nccl ...", not the copy for Gloo's)
    assert got["test_all_reduce_sum"]["status"] == "skipped"
    assert got["test_all_reduce_sum"]["reason"] == "Nccl does not support CPU tensors"
    # gated "BACKEND != nccl" (the Gloo-style copy skips it as "NCCL Send Recv Only"): it
    # reaches the ranks, which skip for want of CUDA, as every NCCL test there
    for n in ("test_send_recv_nccl", "test_all_reduce_sum_cuda", "test_get_backend"):
        assert got[n]["status"] == "skipped", got[n]
        assert got[n]["reason"] == "CUDA is not available.", got[n]
    manifest = json.loads((tmp_path / "tests_uccl_ws2.json").read_text())
    assert sorted(manifest["tests"]) == sorted(names) and manifest["as"] == "nccl"


def test_ranges_cover_the_names_once():
    ts = _launcher()
    names = [f"test_{i:03d}" for i in range(29)]
    for n in (1, 4, 12, 29, 40):
        parts = [ts.shard(list(reversed(names)), f"{i}/{n}") for i in range(1, n + 1)]
        flat = [t for part, _ in parts for t in part]
        assert flat == names                      # contiguous, in name order, each once
        assert len({sfx for _, sfx in parts}) == n
    assert ts.shard(names, "3/12")[1] == "_shard03of12"
    for bad in ("0/4", "5/4", "4", "a/b", ""):
        with pytest.raises(SystemExit, match="--shard"):
            ts.shard(names, bad)


def _write_range(folder: pathlib.Path, backend: str, suffix: str, given: list[str],
                 records: dict[str, tuple[str, str]]):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"tests_{backend}_ws2{suffix}.json").write_text(json.dumps(
        {"backend": backend, "world_size": 2, "as": "nccl", "suffix": suffix,
         "torch": "2.11.0+cu130", "tests": given}))
    with open(folder / f"results_{backend}_ws2{suffix}.jsonl", "w") as f:
        for n, (status, reason) in records.items():
            f.write(json.dumps({"test": n, "status": status, "reason": reason,
                                "seconds": 1.0}) + "\n")


def test_merge_of_ranges_writes_the_table(tmp_path):
    ts = _launcher()
    excepted = "test_ddp_profiling_torch_profiler"
    assert excepted in ts.NCCL_ITSELF
    r1 = ["test_a_both", "test_b_regressed", excepted]
    r2 = ["test_c_cut_short", "test_d_skipped", "test_e_uccl_only"]
    # two calls: ranges 1 and 2 of 2 in separate folders, as they come back
    _write_range(tmp_path / "call1" / "torch_suite_nccl", "nccl", "_shard01of02", r1,
                 {"test_a_both": ("passed", ""), "test_b_regressed": ("passed", ""),
                  excepted: ("passed", "")})
    _write_range(tmp_path / "call1" / "torch_suite_nccl", "uccl", "_shard01of02", r1,
                 {"test_a_both": ("passed", ""),
                  "test_b_regressed": ("failed", "RuntimeError: boom"),
                  excepted: ("failed", "AssertionError: 0 not greater than 0")})
    _write_range(tmp_path / "call2", "nccl", "_shard02of02", r2,
                 {"test_c_cut_short": ("passed", ""), "test_d_skipped": ("skipped", "x"),
                  "test_e_uccl_only": ("failed", "NCCL error")})
    _write_range(tmp_path / "call2", "uccl", "_shard02of02", r2,   # cut before test_c
                 {"test_d_skipped": ("skipped", "x"), "test_e_uccl_only": ("passed", "")})
    out = tmp_path / "merged"
    rc = ts.main(["--as", "nccl", "--from", str(tmp_path / "call1"), "--from",
                  str(tmp_path / "call2"), "--out", str(out)])
    assert rc == 1
    md = (out / "torch_suite.md").read_text()
    assert "| uccl | 2 | 2 | 2 | 1 | 1 |" in md, md     # passed, failed, skipped, not run
    assert "| nccl | 2 | 4 | 1 | 1 | 0 |" in md, md
    assert "torch 2.11.0+cu130" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| 2 | test_")]
    assert [r.split(" | ")[1] for r in rows] == [
        "test_b_regressed", "test_c_cut_short", excepted, "test_e_uccl_only"], rows
    assert "RuntimeError: boom" in rows[0] and "not run" in rows[1]
    assert "excepted: " in rows[2]
    assert f"| {excepted} | failed | passed |" in md
    res = {b: ts.merge([tmp_path], b, 2) for b in ("uccl", "nccl")}
    assert ts.regressions(res["nccl"], res["uccl"], ts.NCCL_ITSELF) == [
        "test_b_regressed", "test_c_cut_short"]


def test_merge_passes_when_only_excepted_tests_differ(tmp_path):
    ts = _launcher()
    names = ["test_a", "test_nccl_high_priority_stream"]
    _write_range(tmp_path, "nccl", "_shard01of01", names,
                 {n: ("passed", "") for n in names})
    _write_range(tmp_path, "uccl", "_shard01of01", names,
                 {"test_a": ("passed", ""), names[1]: ("failed", "why")})
    assert ts.main(["--as", "nccl", "--from", str(tmp_path), "--out",
                    str(tmp_path / "m")]) == 0
    # -k narrows a merge as it narrows a run
    assert ts.main(["--as", "nccl", "--from", str(tmp_path), "-k", "test_a", "--out",
                    str(tmp_path / "k")]) == 0
    assert "high_priority" not in (tmp_path / "k" / "torch_suite.md").read_text()


def test_device_script_is_valid_bash():
    script = ROOT / "benchmarks" / "device_torch_suite_nccl.sh"
    p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    text = script.read_text()
    assert "--as nccl" in text and "--shard" in text and "--from" in text


def test_reference_reads_every_range(tmp_path):
    ts = _launcher()
    _write_range(tmp_path / "a", "nccl", "_shard01of02", ["test_a"], {"test_a": ("passed", "")})
    _write_range(tmp_path / "b", "nccl", "_shard02of02", ["test_b", "test_c"],
                 {"test_b": ("failed", "x")})
    got = ts.load(tmp_path, "nccl", 2, ["test_a", "test_b", "test_c", "test_z"])
    assert {n: r["status"] for n, r in got.items()} == {
        "test_a": "passed", "test_b": "failed", "test_c": "not run", "test_z": "not run"}
    with pytest.raises(SystemExit, match="--reference"):
        ts.load(tmp_path, "uccl", 2, ["test_a"])


def test_ranges_share_out_the_tests_that_start_ranks():
    ts = _launcher()
    names = [f"test_{i:03d}" for i in range(100)]
    skips = {n for n in names[:80]}          # the first 80 skip at import, the last 20 run
    parts = [ts.shard(names, f"{i}/4", skips)[0] for i in range(1, 5)]
    assert [t for part in parts for t in part] == names
    running = [len(set(p) - skips) for p in parts]
    assert max(running) - min(running) <= 2 and sum(running) == 20, running
    assert set(parts[0]) >= skips             # the cheap ones go together


def test_the_listing_tells_static_skips(tmp_path):
    ts = _launcher()
    ts.make_copy_as_nccl(tmp_path)
    skips: set = set()
    names = ts.list_tests(tmp_path, "nccl", skips)
    assert len(names) > 100 and names == sorted(names)
    # gated at import as for NCCL: a CPU-tensor test skips there, a CUDA one starts ranks
    assert "test_all_reduce_sum" in skips and "test_all_reduce_sum_cuda" not in skips
    assert "test_send_recv_nccl" not in skips and "test_send_recv" in skips


def test_a_range_run_again_later_wins(tmp_path):
    ts = _launcher()
    names = ["test_a", "test_b"]
    _write_range(tmp_path / "call1", "uccl", "_shard01of01", names,
                 {"test_a": ("failed", "timeout")})                      # cut short
    _write_range(tmp_path / "call2", "uccl", "_shard01of01", names,
                 {"test_a": ("passed", ""), "test_b": ("passed", "")})   # run again
    got = ts.merge([tmp_path / "call1", tmp_path / "call2"], "uccl", 2)
    assert {n: r["status"] for n, r in got.items()} == {"test_a": "passed", "test_b": "passed"}
    got = ts.merge([tmp_path / "call2", tmp_path / "call1"], "uccl", 2)
    assert got["test_a"]["status"] == "failed"
