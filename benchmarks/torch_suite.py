"""Runs torch's own distributed conformance suite against "uccl" and Gloo (or NCCL).

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

With --as nccl the copy takes every decision as for NCCL (BACKEND is
"nccl": its gating, skip_if_lt_x_gpu, the "nccl" entries of
DistTestCases.backend_feature, the test bodies' own choices), while every
process group it creates is of the backend under test ("uccl", or "nccl"
itself for the reference); one rank per GPU:

    python3 benchmarks/torch_suite.py --as nccl --backends nccl --shard 1/12 --out DIR
    python3 benchmarks/torch_suite.py --as nccl --backends uccl --shard 1/12 --out DIR
    python3 benchmarks/torch_suite.py --as nccl --from DIR     # merge the ranges: the table

Writes OUT/results_<backend>_ws<N>[_shard<i>of<N>].jsonl (one line per
test) and OUT/torch_suite.md (counts, and every test whose outcome differs);
exits 1 when a test passes with the reference (Gloo, or NCCL with --as nccl)
and not with uccl (the tests of the reference itself, RESERVED and
NCCL_ITSELF below, excepted).
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

#: With --as nccl: tests of NCCL itself (its environment variables,
#: ProcessGroupNCCL's internals, its error strings), with the reason; their
#: outcome with uccl is reported but not counted as a regression.  Found by
#: reading the suite; the run on two GPUs says which of them differ.
NCCL_ITSELF = {
    "test_nccl_high_priority_stream": "builds a dist.ProcessGroupNCCL itself, with "
                                      "ProcessGroupNCCL.Options (is_high_priority_stream): no "
                                      "group of the backend under test is involved",
    "test_ddp_profiling_torch_profiler": "checks the \"record_param_comms\" profiler events with "
                                         "NCCL's metadata that ProcessGroupNCCL inserts "
                                         "(get_profiler_nccl_meta); uccl records <backend>:<op> "
                                         "events, as Gloo does",
    "test_ddp_profiling_execution_trace": "checks NCCL's metadata (\"record_param_comms\" nodes) "
                                          "in the execution trace, as the test above",
    "test_monitored_barrier_allreduce_hang": "sets TORCH_NCCL_BLOCKING_WAIT (with_nccl_blocking_wait) "
                                             "and expects NCCL's watchdog error string \"caught "
                                             "collective operation timeout\" from a hung allreduce",
    "test_monitored_barrier_allreduce_hang_wait_all_ranks": "as "
                                                            "test_monitored_barrier_allreduce_hang",
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


def _rewrite(src: str, rules: list, name: str, path: str, mode: str, notes: list) -> str:
    """src with every (pattern, replacement, required) rule applied; a
    required rule that matches nothing stops the run, naming it; the others
    go into notes."""
    for pat, rep, required in rules:
        src, n = re.subn(pat, rep, src)
        if n == 0:
            if required:
                raise SystemExit(f"torch_suite:{mode} {pat!r} not found in {path}: "
                                 f"this torch's suite differs; update {name}")
            notes.append(f"rule {pat!r} matched nothing")
    return src


def make_copy(dest: pathlib.Path) -> list[str]:
    """Writes the rewritten suite to dest/_uccl_distributed_test.py; returns
    notes on rules that matched nothing."""
    import importlib.util
    path = importlib.util.find_spec("torch.testing._internal.distributed.distributed_test").origin
    src = pathlib.Path(path).read_text()
    notes = []
    src = _rewrite(src, _AS_GLOO, "_AS_GLOO", path, "", notes)
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


# --as nccl.  The copy's BACKEND stays "nccl" (the launcher sets it), so the
# suite's gating and the test bodies' choices are NCCL's; the prelude below
# makes every group the copy creates one of UCCL_SUITE_PG_BACKEND, and the
# rules make the bodies' comparisons of a group's backend name read it as
# "nccl".  (pattern, replacement, required), as _AS_GLOO.
_AS_NCCL = [
    # a group's backend name compared with a name: read as NCCL's
    (r'dist\.get_backend\(([^()]*)\)(\s*(?:==|!=))', r'_uccl_gated(dist.get_backend(\1))\2',
     True),
    (r'assertEqual\(\s*dist\.get_backend\(([^()]*)\)\s*,',
     r'assertEqual(_uccl_gated(dist.get_backend(\1)),', False),
    # groups made through torch.distributed rather than dist
    (r'\btorch\.distributed\.(init_process_group|new_group|new_subgroups'
     r'|new_subgroups_by_enumeration)\(', r'dist.\1(', False),
]
#: Texts that must be in the suite for the prelude to hold: each group it
#: makes goes through `dist`, and the default group is made of BACKEND.
_AS_NCCL_NEEDED = ["import torch.distributed as dist\n", "dist.init_process_group(",
                   "backend=BACKEND,", 'BACKEND == "nccl" and not torch.cuda.is_available()',
                   "PROFILING_SUPPORTED_BACKENDS = ["]
_NCCL_PRELUDE = '''
# --- added by uccl-collective's benchmarks/torch_suite.py (--as nccl) ---------
# Decisions are taken as for NCCL (BACKEND is "nccl"); every process group
# made here is of _UCCL_PG_BACKEND ("uccl", or "nccl" for the reference run).
import inspect as _uccl_inspect
import re as _uccl_re
import types as _uccl_types

_UCCL_PG_BACKEND = os.environ.get("UCCL_SUITE_PG_BACKEND", BACKEND)


def _uccl_pg_backend(name):
    """A backend the suite asks a group constructor for, as made here
    ("nccl", dist.Backend.NCCL, "cpu:gloo,cuda:nccl"; Gloo stays Gloo)."""
    if not isinstance(name, str) or _UCCL_PG_BACKEND == "nccl":
        return name
    return _uccl_re.sub(r"\\bnccl\\b", _UCCL_PG_BACKEND, str(name), flags=_uccl_re.I)


def _uccl_gated(name):
    """A group's backend name as the suite's decisions read it."""
    return "nccl" if name == _UCCL_PG_BACKEND else name


class _UcclDist(_uccl_types.ModuleType):
    """torch.distributed, whose group constructors make _UCCL_PG_BACKEND
    groups where the suite asks for NCCL; everything else is torch's own
    (looked up at each use)."""

    def __init__(self, real):
        super().__init__(real.__name__)
        self.__dict__["_uccl_real"] = real

    def __getattr__(self, name):
        if name in ("init_process_group", "new_group", "new_subgroups",
                    "new_subgroups_by_enumeration"):
            return self._make(name)
        return getattr(self._uccl_real, name)

    def __setattr__(self, name, value):
        setattr(self._uccl_real, name, value)

    def __delattr__(self, name):
        delattr(self._uccl_real, name)

    def _make(self, fname):
        real = getattr(self._uccl_real, fname)

        def make(*args, **kwargs):
            try:
                bound = _uccl_inspect.signature(real).bind_partial(*args, **kwargs)
            except (TypeError, ValueError):
                return real(*args, **kwargs)   # torch's own error for a bad call
            if "backend" in bound.arguments:
                bound.arguments["backend"] = _uccl_pg_backend(bound.arguments["backend"])
            return real(*bound.args, **bound.kwargs)
        make.__name__ = fname
        return make


dist = _UcclDist(dist)
if _UCCL_PG_BACKEND != "nccl":
    # the profiler checks expect "<backend>:<op>" events where NCCL's would be
    for _l in (PROFILING_SUPPORTED_BACKENDS, CUDA_PROFILING_SUPPORTED_BACKENDS,
               SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
        if "nccl" in _l:
            _l.append(_UCCL_PG_BACKEND)
# -------------------------------------------------------------------------------
'''


def make_copy_as_nccl(dest: pathlib.Path, src: str | None = None) -> list[str]:
    """Writes the copy for --as nccl to dest/_uccl_distributed_test.py (src:
    the suite's text, default this torch's); returns notes on the optional
    rules that matched nothing.  A required text or rule that is missing
    stops the run, naming it."""
    import importlib.util
    path = importlib.util.find_spec("torch.testing._internal.distributed.distributed_test").origin
    if src is None:
        src = pathlib.Path(path).read_text()
    notes = []
    for needed in _AS_NCCL_NEEDED + [_PRELUDE_AT]:
        if needed not in src:
            raise SystemExit(f"torch_suite: --as nccl: {needed.strip()!r} not found in {path}: "
                             "this torch's suite differs; update _AS_NCCL_NEEDED")
    src = _rewrite(src, _AS_NCCL, "_AS_NCCL", path, " --as nccl:", notes)
    src = src.replace(_PRELUDE_AT, _PRELUDE_AT + _NCCL_PRELUDE, 1)
    (dest / "_uccl_distributed_test.py").write_text(src)
    if importlib.util.find_spec("expecttest") is None:
        (dest / "expecttest.py").write_text(_EXPECTTEST_STUB)
        notes.append("expecttest is not installed: a stand-in was used")
    return notes


def _env(backend: str, ws: int, copy_dir: pathlib.Path, results: pathlib.Path,
         device: str, test_timeout: int, start: str = "spawn", as_: str = "gloo") -> dict:
    env = dict(os.environ)
    env["UCCL_SUITE_START"] = start
    env.update(BACKEND=backend, WORLD_SIZE=str(ws), UCCL_SUITE_COPY_DIR=str(copy_dir),
               UCCL_SUITE_RESULTS=str(results),
               DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(test_timeout),
               PYTORCH_PRINT_REPRO_ON_FAILURE="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
                   os.pathsep))
    env.pop("UCCL_SUITE_SHARE_GPU", None)
    if as_ == "nccl":
        # the suite reads BACKEND as NCCL; the groups are the backend's under test;
        # one rank per GPU, as with NCCL
        env.update(BACKEND="nccl", UCCL_SUITE_PG_BACKEND=backend, UCCL_SUITE_AS="nccl")
    elif device == "cuda":
        env["UCCL_SUITE_SHARE_GPU"] = "1"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""   # CPU run: the suite's CUDA cases skip
    return env


def list_tests(copy_dir: pathlib.Path, as_: str = "gloo",
               static_skips: set | None = None) -> list[str]:
    """The suite's test names; static_skips, if given, receives those it
    skips by a decorator chosen at import (no rank is started for them)."""
    env = _env("nccl" if as_ == "nccl" else "gloo", 2, copy_dir, copy_dir / "unused", "cpu", 60,
               as_=as_)
    with tempfile.TemporaryDirectory() as tmp:
        env["TEMP_DIR"] = tmp
        out = subprocess.run([sys.executable, str(CHILD), "--list"], env=env, check=True,
                             capture_output=True, text=True, timeout=300).stdout
    names = []
    for line in out.splitlines():
        words = line.split()
        if words and words[0].startswith("test_"):
            names.append(words[0])
            if static_skips is not None and words[1:] == ["skip"]:
                static_skips.add(words[0])
    return names


#: A test skipped by a decorator at import costs next to nothing.
_STATIC_SKIP_WEIGHT = 0.01


def shard(names: list[str], spec: str, static_skips: set | None = None
          ) -> tuple[list[str], str]:
    """The i-th of N contiguous ranges of the names in name order, spec
    "i/N" (1 <= i <= N), and the suffix of its files ("_shard03of12").  The
    ranges are cut so that each holds about as many tests that start ranks
    (those not in static_skips) as the others."""
    m = re.fullmatch(r"(\d+)/(\d+)", spec or "")
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise SystemExit(f"--shard: expected i/N with 1 <= i <= N, got {spec!r}")
    i, n = int(m.group(1)), int(m.group(2))
    names = sorted(names)
    skips = static_skips or set()
    weights = [_STATIC_SKIP_WEIGHT if t in skips else 1.0 for t in names]
    total, before, part = sum(weights), 0.0, []
    for t, w in zip(names, weights):
        if min(n - 1, int((before + w / 2) / total * n)) == i - 1:
            part.append(t)
        before += w
    return part, f"_shard{i:02d}of{n:02d}"


def run_one(backend: str, ws: int, names: list[str], copy_dir: pathlib.Path,
            out: pathlib.Path, device: str, timeout: float, test_timeout: int,
            pre_skipped: dict | None = None, start: str = "spawn", as_: str = "gloo",
            suffix: str = "") -> dict:
    """Runs the named tests; {test: record}.  Tests not reached before
    timeout are recorded as "not run"; those in pre_skipped ({test:
    reason}) as skipped, without running them.  Files: results_<backend>_ws<N>
    <suffix>.jsonl, log_..., and tests_....json (the tests this run was given:
    a merge counts those missing from the results as not run)."""
    results = out / f"results_{backend}_ws{ws}{suffix}.jsonl"
    results.unlink(missing_ok=True)
    (out / f"tests_{backend}_ws{ws}{suffix}.json").write_text(json.dumps(
        {"backend": backend, "world_size": ws, "as": as_, "suffix": suffix,
         "torch": _torch_version(), "tests": names}, indent=0) + "\n")
    pre_skipped = {n: r for n, r in (pre_skipped or {}).items() if n in set(names)}
    with open(results, "w") as f:
        for n in names:
            if n in pre_skipped:
                f.write(json.dumps({"test": n, "status": "skipped", "reason": pre_skipped[n],
                                    "seconds": 0}) + "\n")
    names = [n for n in names if n not in pre_skipped]
    log = out / f"log_{backend}_ws{ws}{suffix}.txt"
    env = _env(backend, ws, copy_dir, results, device, test_timeout, start, as_)
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
    print(f"{backend} ws={ws}{suffix}: {_counts(got)} in {time.monotonic() - t0:.0f} s",
          flush=True)
    return got


def _read(results: pathlib.Path) -> dict:
    got = {}
    if results.exists():
        for line in results.read_text().splitlines():
            rec = json.loads(line)
            got[rec["test"]] = rec
    return got


def load(folder: pathlib.Path, backend: str, ws: int, names: list[str]) -> dict:
    """An earlier run's results for the selected tests (every range of it
    found in folder and its subfolders)."""
    if not any(folder.rglob(f"results_{backend}_ws{ws}*.jsonl")):
        raise SystemExit(f"--reference: no results_{backend}_ws{ws}*.jsonl in {folder}")
    got = {n: r for n, r in merge([folder], backend, ws).items() if n in set(names)}
    for n in names:
        got.setdefault(n, {"test": n, "status": "not run",
                           "reason": f"not in {folder}'s results_{backend}_ws{ws}*.jsonl",
                           "seconds": 0})
    return got


def merge(folders: list[pathlib.Path], backend: str, ws: int) -> dict:
    """The results of every range run for backend and world size, gathered
    from the folders (searched recursively): {test: record}.  A test that a
    range was given (its tests_*.json) and that has no result is "not run";
    a test recorded more than once keeps the record of the last folder (a
    range run again in a later call wins), within a folder of the last file
    in name order."""
    got, given = {}, {}
    for folder in folders:
        for path in sorted(folder.rglob(f"tests_{backend}_ws{ws}*.json")):
            manifest = json.loads(path.read_text())
            for n in manifest["tests"]:
                given.setdefault(n, (path.name, manifest.get("torch")))
        for path in sorted(folder.rglob(f"results_{backend}_ws{ws}*.jsonl")):
            got.update(_read(path))
    for n, (where, torch_version) in given.items():
        got.setdefault(n, {"test": n, "status": "not run",
                           "reason": f"given to a range ({where}) that recorded nothing for it",
                           "seconds": 0})
        if torch_version:
            got[n]["torch"] = torch_version
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


def regressions(ref: dict, got: dict, excepted: dict | None = None) -> list[str]:
    """Tests that pass with the reference and not here, the excepted ones
    (default RESERVED: the reference's own tests) left out."""
    excepted = RESERVED if excepted is None else excepted
    return sorted(n for n, r in ref.items() if r["status"] == "passed"
                  and got.get(n, {}).get("status") != "passed" and n not in excepted)


def report(all_res: dict, backends: list[str], world_sizes: list[int], argv: list[str],
           device: str, excepted: dict | None = None, title: str = "") -> str:
    excepted = RESERVED if excepted is None else excepted
    lines = [f"# torch distributed suite: {' vs '.join(backends)} ({title or device})", "",
             f"- command: `python3 benchmarks/torch_suite.py {' '.join(argv)}`",
             f"- date: {datetime.date.today().isoformat()}; torch {_torch_versions(all_res)}",
             "", "| backend | world size | passed | failed | skipped | not run |",
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
                    note = (f"excepted: {excepted[n]}" if n in excepted else
                            a.get(n, {}).get("reason", "") if sa != "passed" else
                            r.get(n, {}).get("reason", ""))
                    note = note.replace("|", "/")
                    lines.append(f"| {ws} | {n} | {sa} | {sr} | {note} |")
        listed = sorted(n for n in excepted if any(n in all_res[(b, ws)] for b in backends
                                                   for ws in world_sizes))
        if listed:
            lines += ["", f"Tests of {ref} itself, not counted against {b0} (outcome per "
                      "world size):", "", f"| test | {b0} | {ref} | why |",
                      "| --- | --- | --- | --- |"]
            for n in listed:
                oa = ", ".join(str(all_res[(b0, ws)].get(n, {}).get("status")) for ws in
                               world_sizes)
                orf = ", ".join(str(all_res[(ref, ws)].get(n, {}).get("status")) for ws in
                                world_sizes)
                lines.append(f"| {n} | {oa} | {orf} | {excepted[n].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _torch_version() -> str:
    import torch
    return torch.__version__


def _torch_versions(all_res: dict) -> str:
    """The torch the results came from (the ranges' tests_*.json say; else this one)."""
    got = sorted({r.get("torch") for res in all_res.values() for r in res.values()} - {None})
    return ", ".join(got) if got else _torch_version()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--as", dest="as_", choices=("gloo", "nccl"), default="gloo",
                   help="gloo (default): the suite treats the backend under test as it treats "
                        "Gloo, the reference is Gloo.  nccl: the suite takes every decision as "
                        "for NCCL (BACKEND is \"nccl\") while each process group it makes is "
                        "of the backend under test; one rank per GPU (needs as many GPUs as "
                        "ranks, else the tests skip); the reference is NCCL itself; default "
                        "--backends uccl,nccl --world-sizes 2, every test")
    p.add_argument("--backends", default=None,
                   help="comma-separated; the first is judged against the second (default "
                        "uccl,gloo; with --as nccl uccl,nccl)")
    p.add_argument("--world-sizes", default=None, help="default 2,3; with --as nccl 2")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: every rank uses GPU 0 (the suite's GPU gating made to allow "
                        "ranks sharing one GPU), and only tests named *cuda*/*gpu* run "
                        "unless -k/--tests say otherwise (not with --as nccl)")
    p.add_argument("-k", action="append", default=[],
                   help="run only tests whose name contains this (repeatable)")
    p.add_argument("--tests", default="", help="comma-separated test names to run")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="run only the I-th of N contiguous ranges of the selected tests in "
                        "name order, cut so that each holds about as many tests that start "
                        "ranks; its files are named ..._shardIIofNN (merge them with --from)")
    p.add_argument("--reference", default=None, metavar="DIR",
                   help="take the reference backend's (the second's) results from an earlier "
                        "run's output folder instead of running it again")
    p.add_argument("--skip-env-skips", default=None, metavar="DIR",
                   help="do not run the tests that an earlier run (its output folder) skipped "
                        "for want of CUDA or GPUs (recorded as skipped, saying so): saves time "
                        "on a CPU machine, where they skip for every backend")
    p.add_argument("--from", dest="from_dirs", action="append", default=[], metavar="DIR",
                   help="run nothing: write the report from the results of earlier runs "
                        "(every range of them, searched for in DIR and its subfolders; "
                        "repeatable; a test recorded in several folders is taken from the "
                        "last); tests a range was given but did not record are not run")
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
    nccl = args.as_ == "nccl"
    if nccl and args.device == "cuda":
        raise SystemExit("--device cuda shares GPU 0 between ranks; --as nccl gives each rank "
                         "its own GPU: leave --device out")
    backends = [b for b in (args.backends or ("uccl,nccl" if nccl else "uccl,gloo")).split(",")
                if b]
    world_sizes = [int(w) for w in (args.world_sizes or ("2" if nccl else "2,3")).split(",")
                   if w]
    if any(w < 2 for w in world_sizes):
        raise SystemExit(f"--world-sizes: each must be at least 2, got {world_sizes}")
    excepted = NCCL_ITSELF if nccl else RESERVED
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="torch_suite_"))
    out.mkdir(parents=True, exist_ok=True)
    suffix = ""

    def pick(names: list[str]) -> list[str]:
        if args.tests:
            wanted = [t for t in args.tests.split(",") if t]
            unknown = sorted(set(wanted) - set(names))
            if unknown:
                raise SystemExit(f"--tests: not in this torch's suite: {unknown}")
            return [n for n in names if n in set(wanted)]
        if args.k:
            return [n for n in names if any(k in n for k in args.k)]
        if args.device == "cuda":
            return [n for n in names if "cuda" in n or "gpu" in n.lower()]
        return names

    all_res = {}
    if args.from_dirs:
        folders = [pathlib.Path(d) for d in args.from_dirs]
        for d in folders:
            if not d.is_dir():
                raise SystemExit(f"--from: {d} is not a folder")
        for ws in world_sizes:
            for b in backends:
                all_res[(b, ws)] = merge(folders, b, ws)
        everything = sorted({n for res in all_res.values() for n in res})
        keep = set(pick(everything)) if (args.tests or args.k) else set(everything)
        all_res = {key: {n: r for n, r in res.items() if n in keep}
                   for key, res in all_res.items()}
        empty = [f"{b} ws={ws}" for (b, ws), res in all_res.items() if not res]
        if empty:
            print(f"torch_suite: no results for {empty} in {args.from_dirs}", flush=True)
    else:
        with tempfile.TemporaryDirectory(prefix="uccl_suite_copy_") as copy_tmp:
            copy_dir = pathlib.Path(copy_tmp)
            for note in (make_copy_as_nccl(copy_dir) if nccl else make_copy(copy_dir)):
                print(f"torch_suite: note: {note}", flush=True)
            static_skips: set = set()
            names = pick(list_tests(copy_dir, args.as_, static_skips))
            if args.shard:
                names, suffix = shard(names, args.shard, static_skips)
                if not names:
                    print(f"torch_suite: range {args.shard}: no test", flush=True)
                    return 0
                print(f"torch_suite: range {args.shard}: {len(names)} tests "
                      f"({len(set(names) - static_skips)} start ranks), {names[0]} .. "
                      f"{names[-1]}", flush=True)
            if not names:
                raise SystemExit("no test selected")
            pre = env_skips(pathlib.Path(args.skip_env_skips)) if args.skip_env_skips else {}
            for ws in world_sizes:
                for b in backends:
                    if args.reference and len(backends) >= 2 and b == backends[1]:
                        all_res[(b, ws)] = load(pathlib.Path(args.reference), b, ws, names)
                        continue
                    all_res[(b, ws)] = run_one(b, ws, names, copy_dir, out, args.device,
                                               args.timeout, args.test_timeout, pre, args.start,
                                               args.as_, suffix)
    title = ("decisions as for NCCL, one rank per GPU" if nccl else args.device)
    md = report(all_res, backends, world_sizes, argv, args.device, excepted, title)
    (out / f"torch_suite{suffix}.md").write_text(md)
    print(md)
    print(f"results in {out}")
    bad = []
    if len(backends) >= 2:
        for ws in world_sizes:
            bad += [f"ws={ws} {n}" for n in regressions(all_res[(backends[1], ws)],
                                                        all_res[(backends[0], ws)], excepted)]
    if bad:
        print(f"{len(bad)} test(s) pass with {backends[1]} and not with {backends[0]}: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
