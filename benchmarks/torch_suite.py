"""Runs torch's own distributed conformance suite against "uccl" and Gloo.

The suite is ``torch.testing._internal.distributed.distributed_test``
(``DistributedTest._DistTestBase`` with ``TestDistBackend``), as torch's
``test/distributed/test_distributed_spawn.py`` combines them under BACKEND,
WORLD_SIZE and TEMP_DIR.  The suite gates its tests by backend name
(``BACKEND == "gloo"``, ``require_backend_is_available({"gloo"})``, the
profiling allow-lists, ``DistTestCases.backend_feature``): a copy of it,
rewritten so that these treat "uccl" as they treat "gloo", is generated at
run time into a temporary folder (torch's code is never committed here).

    python3 benchmarks/torch_suite.py                     # uccl and gloo, 2 and 3 ranks
    python3 benchmarks/torch_suite.py --world-sizes 2 -k send_recv -k sparse
    python3 benchmarks/torch_suite.py --device cuda --world-sizes 2   # ranks share GPU 0

Writes OUT/results_<backend>_ws<N>.jsonl (one line per test) and
OUT/torch_suite.md (counts, and every test whose outcome differs); exits 1
when a test passes with Gloo and not with uccl (tests torch reserves for
Gloo by name, RESERVED below, excepted).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
CHILD = HERE / "_torch_suite_child.py"

#: Tests torch itself reserves for Gloo by name, with the reason; their
#: outcome with uccl is reported but not counted as a regression.
RESERVED = {
    "test_monitored_barrier_gloo": "calls dist.monitored_barrier, which raises for every backend "
                                   "but Gloo (\"monitored_barrier is only implemented for GLOO "
                                   "backend\"); the group's own method works",
    "test_monitored_barrier_gloo_subgroup": "as test_monitored_barrier_gloo",
    "test_monitored_barrier_failure_order": "as test_monitored_barrier_gloo",
    "test_monitored_barrier_wait_all_ranks": "as test_monitored_barrier_gloo",
}

# (pattern, replacement, required): applied to distributed_test.py's text.
# A required rule that matches nothing stops the run (the suite changed);
# the others are reported.
_AS_GLOO = [
    (r'BACKEND == "gloo"', 'BACKEND in _UCCL_AS_GLOO', True),
    (r'BACKEND != "gloo"', 'BACKEND not in _UCCL_AS_GLOO', True),
    (r'require_backend_is_available\(\{"gloo"\}\)',
     'require_backend_is_available({"gloo", "uccl"})', False),
]
_PRELUDE_AT = 'BACKEND = os.environ["BACKEND"]\n'
_PRELUDE = '''
# --- added by uccl-collective's benchmarks/torch_suite.py ---------------------
_UCCL_AS_GLOO = ("gloo", "uccl")
for _l in (PROFILING_SUPPORTED_BACKENDS, CUDA_PROFILING_SUPPORTED_BACKENDS,
           SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
    _l.append("uccl")
_UCCL_SHARE_GPU = os.environ.get("UCCL_SUITE_SHARE_GPU") == "1"
if _UCCL_SHARE_GPU:
    import functools as _functools

    # One GPU, shared by every rank: each rank's "GPUs" are [0].
    def init_multigpu_helper(world_size, backend):
        return {i: [0] for i in range(world_size)}

    def skip_if_no_gpu(func):
        @_functools.wraps(func)
        def wrapper(*args, **kwargs):
            if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
                sys.exit(TEST_SKIPS["no_cuda"].exit_code)
            return func(*args, **kwargs)
        return wrapper
# -------------------------------------------------------------------------------
'''
_EXPECTTEST_STUB = '''"""Stand-in for the expecttest package (torch's test utilities subclass
its TestCase; this suite never calls assertExpectedInline)."""
import unittest


class TestCase(unittest.TestCase):
    def assertExpectedInline(self, actual, expect, skip=0):
        self.assertEqual(str(actual).strip(), str(expect).strip())
'''
_GPU_COUNT = ("if torch.cuda.is_available() and torch.cuda.device_count() < int(",
              "if not _UCCL_SHARE_GPU and torch.cuda.is_available() and "
              "torch.cuda.device_count() < int(")


def make_copy(dest: pathlib.Path) -> list[str]:
    """Writes the rewritten suite to dest/_uccl_distributed_test.py; returns
    notes on rules that matched nothing."""
    import importlib.util
    path = importlib.util.find_spec("torch.testing._internal.distributed.distributed_test").origin
    src = pathlib.Path(path).read_text()
    notes = []
    for pat, rep, required in _AS_GLOO:
        src, n = re.subn(pat, rep, src)
        if n == 0:
            if required:
                raise SystemExit(f"torch_suite: {pat!r} not found in {path}: "
                                 "this torch's suite gates differently; update _AS_GLOO")
            notes.append(f"rule {pat!r} matched nothing")
    if _PRELUDE_AT not in src:
        raise SystemExit(f"torch_suite: {_PRELUDE_AT.strip()!r} not found in {path}")
    src = src.replace(_PRELUDE_AT, _PRELUDE_AT + _PRELUDE, 1)
    # tests that pick the device by rank (torch.cuda.set_device(self.rank))
    src = src.replace("torch.cuda.set_device(self.rank)",
                      "torch.cuda.set_device(0 if _UCCL_SHARE_GPU else self.rank)")
    if _GPU_COUNT[0] in src:
        src = src.replace(*_GPU_COUNT)
    else:
        notes.append("the GPU-count check in TestDistBackend._run was not found (GPU sharing "
                     "may skip every test)")
    (dest / "_uccl_distributed_test.py").write_text(src)
    if importlib.util.find_spec("expecttest") is None:
        # torch's test utilities import it for one base class; where it cannot
        # be installed (the GPU machine), a stand-in serves this suite.
        (dest / "expecttest.py").write_text(_EXPECTTEST_STUB)
        notes.append("expecttest is not installed: a stand-in was used")
    return notes


def _env(backend: str, ws: int, copy_dir: pathlib.Path, results: pathlib.Path,
         device: str, test_timeout: int, start: str = "spawn") -> dict:
    env = dict(os.environ)
    env["UCCL_SUITE_START"] = start
    env.update(BACKEND=backend, WORLD_SIZE=str(ws), UCCL_SUITE_COPY_DIR=str(copy_dir),
               UCCL_SUITE_RESULTS=str(results),
               DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(test_timeout),
               PYTORCH_PRINT_REPRO_ON_FAILURE="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
                   os.pathsep))
    if device == "cuda":
        env["UCCL_SUITE_SHARE_GPU"] = "1"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""   # CPU run: the suite's CUDA cases skip
    return env


def list_tests(copy_dir: pathlib.Path) -> list[str]:
    env = _env("gloo", 2, copy_dir, copy_dir / "unused", "cpu", 60)
    with tempfile.TemporaryDirectory() as tmp:
        env["TEMP_DIR"] = tmp
        out = subprocess.run([sys.executable, str(CHILD), "--list"], env=env, check=True,
                             capture_output=True, text=True, timeout=300).stdout
    return [n for n in out.split() if n.startswith("test_")]


def run_one(backend: str, ws: int, names: list[str], copy_dir: pathlib.Path,
            out: pathlib.Path, device: str, timeout: float, test_timeout: int,
            pre_skipped: dict | None = None, start: str = "spawn") -> dict:
    """Runs the named tests; {test: record}.  Tests not reached before
    timeout are recorded as "not run"; those in pre_skipped ({test:
    reason}) as skipped, without running them."""
    results = out / f"results_{backend}_ws{ws}.jsonl"
    results.unlink(missing_ok=True)
    pre_skipped = {n: r for n, r in (pre_skipped or {}).items() if n in set(names)}
    with open(results, "w") as f:
        for n in names:
            if n in pre_skipped:
                f.write(json.dumps({"test": n, "status": "skipped", "reason": pre_skipped[n],
                                    "seconds": 0}) + "\n")
    names = [n for n in names if n not in pre_skipped]
    log = out / f"log_{backend}_ws{ws}.txt"
    env = _env(backend, ws, copy_dir, results, device, test_timeout, start)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="uccl_suite_") as tmp, open(log, "w") as lf:
        env["TEMP_DIR"] = tmp
        if not names:   # all pre-skipped (the child, given no name, would run every test)
            return _read(results)
        proc = subprocess.Popen([sys.executable, str(CHILD), *names], env=env, stdout=lf,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
    got = _read(results)
    for n in names + list(pre_skipped):
        got.setdefault(n, {"test": n, "status": "not run",
                           "reason": f"launcher timeout ({timeout:g} s) or crash: see {log.name}",
                           "seconds": 0})
    print(f"{backend} ws={ws}: {_counts(got)} in {time.monotonic() - t0:.0f} s", flush=True)
    return got


def _read(results: pathlib.Path) -> dict:
    got = {}
    if results.exists():
        for line in results.read_text().splitlines():
            rec = json.loads(line)
            got[rec["test"]] = rec
    return got


def load(folder: pathlib.Path, backend: str, ws: int, names: list[str]) -> dict:
    """An earlier run's results for the selected tests."""
    path = folder / f"results_{backend}_ws{ws}.jsonl"
    if not path.exists():
        raise SystemExit(f"--reference: {path} does not exist")
    got = {n: r for n, r in _read(path).items() if n in set(names)}
    for n in names:
        got.setdefault(n, {"test": n, "status": "not run", "reason": f"not in {path}",
                           "seconds": 0})
    return got


#: Skip reasons that depend on the machine, not on the backend.
ENV_SKIP = re.compile(r"CUDA is not available|CUDA devices|GPUs? |multi-gpu|no_cuda", re.I)


def env_skips(folder: pathlib.Path) -> dict:
    """{test: reason} of the tests some earlier run in folder skipped for
    want of CUDA or GPUs."""
    out = {}
    for path in sorted(folder.glob("results_*.jsonl")):
        for n, r in _read(path).items():
            if r["status"] == "skipped" and r["seconds"] > 0 and ENV_SKIP.search(r["reason"]):
                out.setdefault(n, f"not run: {path.name} skipped it ({r['reason']})")
    return out


def _counts(res: dict) -> str:
    c = {}
    for r in res.values():
        c[r["status"]] = c.get(r["status"], 0) + 1
    return ", ".join(f"{k} {c[k]}" for k in ("passed", "failed", "skipped", "xfail", "not run")
                     if k in c)


def regressions(ref: dict, got: dict) -> list[str]:
    """Tests that pass with the reference and not here, reserved ones excepted."""
    return sorted(n for n, r in ref.items() if r["status"] == "passed"
                  and got.get(n, {}).get("status") != "passed" and n not in RESERVED)


def report(all_res: dict, backends: list[str], world_sizes: list[int], argv: list[str],
           device: str) -> str:
    lines = [f"# torch distributed suite: {' vs '.join(backends)} ({device})", "",
             f"- command: `python3 benchmarks/torch_suite.py {' '.join(argv)}`",
             f"- date: {datetime.date.today().isoformat()}; torch {_torch_version()}", "",
             "| backend | world size | passed | failed | skipped | not run |",
             "| --- | --- | --- | --- | --- | --- |"]
    for ws in world_sizes:
        for b in backends:
            res = all_res[(b, ws)]
            c = {s: sum(r["status"] == s for r in res.values())
                 for s in ("passed", "failed", "skipped", "not run")}
            lines.append(f"| {b} | {ws} | {c['passed']} | {c['failed']} | {c['skipped']} | "
                         f"{c['not run']} |")
    if len(backends) >= 2:
        b0, ref = backends[0], backends[1]
        lines += ["", f"Tests whose outcome differs ({b0} vs {ref}):", "",
                  f"| world size | test | {b0} | {ref} | note |", "| --- | --- | --- | --- | --- |"]
        for ws in world_sizes:
            a, r = all_res[(b0, ws)], all_res[(ref, ws)]
            for n in sorted(set(a) | set(r)):
                sa, sr = a.get(n, {}).get("status"), r.get(n, {}).get("status")
                if sa != sr:
                    note = RESERVED.get(n, "") or (a.get(n, {}).get("reason", "") if sa !=
                                                    "passed" else r.get(n, {}).get("reason", ""))
                    note = note.replace("|", "/")
                    lines.append(f"| {ws} | {n} | {sa} | {sr} | {note} |")
    return "\n".join(lines) + "\n"


def _torch_version() -> str:
    import torch
    return torch.__version__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="uccl,gloo",
                   help="comma-separated; the first is judged against the second (default "
                        "uccl,gloo)")
    p.add_argument("--world-sizes", default="2,3")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: every rank uses GPU 0 (the suite's GPU gating made to allow "
                        "ranks sharing one GPU), and only tests named *cuda*/*gpu* run "
                        "unless -k/--tests say otherwise")
    p.add_argument("-k", action="append", default=[],
                   help="run only tests whose name contains this (repeatable)")
    p.add_argument("--tests", default="", help="comma-separated test names to run")
    p.add_argument("--reference", default=None, metavar="DIR",
                   help="take the reference backend's (the second's) results from an earlier "
                        "run's output folder instead of running it again")
    p.add_argument("--skip-env-skips", default=None, metavar="DIR",
                   help="do not run the tests that an earlier run (its output folder) skipped "
                        "for want of CUDA or GPUs (recorded as skipped, saying so): saves time "
                        "on a CPU machine, where they skip for every backend")
    p.add_argument("--from", dest="from_dir", default=None, metavar="DIR",
                   help="run nothing: write the report from the results_*.jsonl of earlier "
                        "runs gathered in DIR")
    p.add_argument("--start", choices=("spawn", "fork"), default="spawn",
                   help="how the suite starts each test's ranks: spawn (torch's "
                        "test_distributed_spawn.py; default) or fork (torch's former "
                        "test_distributed_fork.py: the same tests, several times faster)")
    p.add_argument("--out", default=None, help="output folder (default: a new temp folder)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds for each backend x world size run (default 3600)")
    p.add_argument("--test-timeout", type=int, default=120,
                   help="seconds one test may take (the suite's own limit; default 120)")
    args = p.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    world_sizes = [int(w) for w in args.world_sizes.split(",") if w]
    if any(w < 2 for w in world_sizes):
        raise SystemExit(f"--world-sizes: each must be at least 2, got {world_sizes}")
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="torch_suite_"))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="uccl_suite_copy_") as copy_tmp:
        copy_dir = pathlib.Path(copy_tmp)
        for note in make_copy(copy_dir):
            print(f"torch_suite: note: {note}", flush=True)
        names = list_tests(copy_dir)
        if args.tests:
            wanted = [t for t in args.tests.split(",") if t]
            unknown = sorted(set(wanted) - set(names))
            if unknown:
                raise SystemExit(f"--tests: not in this torch's suite: {unknown}")
            names = [n for n in names if n in set(wanted)]
        elif args.k:
            names = [n for n in names if any(k in n for k in args.k)]
        elif args.device == "cuda":
            names = [n for n in names if "cuda" in n or "gpu" in n.lower()]
        if not names:
            raise SystemExit("no test selected")
        pre = env_skips(pathlib.Path(args.skip_env_skips)) if args.skip_env_skips else {}
        all_res = {}
        for ws in world_sizes:
            for b in backends:
                if args.from_dir:
                    all_res[(b, ws)] = load(pathlib.Path(args.from_dir), b, ws, names)
                    continue
                if args.reference and len(backends) >= 2 and b == backends[1]:
                    all_res[(b, ws)] = load(pathlib.Path(args.reference), b, ws, names)
                    continue
                all_res[(b, ws)] = run_one(b, ws, names, copy_dir, out, args.device,
                                           args.timeout, args.test_timeout, pre, args.start)
    md = report(all_res, backends, world_sizes, argv, args.device)
    (out / "torch_suite.md").write_text(md)
    print(md)
    print(f"results in {out}")
    bad = []
    if len(backends) >= 2:
        for ws in world_sizes:
            bad += [f"ws={ws} {n}" for n in regressions(all_res[(backends[1], ws)],
                                                        all_res[(backends[0], ws)])]
    if bad:
        print(f"{len(bad)} test(s) pass with {backends[1]} and not with {backends[0]}: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
