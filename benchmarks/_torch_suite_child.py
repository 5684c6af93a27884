"""One run of torch's distributed conformance suite (one backend, one world
size), started by benchmarks/torch_suite.py: not meant to be run by hand.

Environment (set by the launcher): BACKEND, WORLD_SIZE, TEMP_DIR as torch's
own launcher (test/distributed/test_distributed_spawn.py) sets them;
UCCL_SUITE_COPY_DIR, the folder holding the launcher's rewritten copy of
distributed_test.py (module _uccl_distributed_test); UCCL_SUITE_RESULTS,
the JSON-lines file each test's outcome is appended to; with --as nccl,
UCCL_SUITE_AS=nccl and UCCL_SUITE_PG_BACKEND, the backend of the groups the
copy makes (BACKEND is then "nccl").

Every rank is a process spawned by the suite (multiprocessing "spawn"), which
imports this file again as __mp_main__: what is done at import here (the
backend registered, uccl added to the suite's feature sets) holds in every
rank.
"""
import json
import os
import sys
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.environ["UCCL_SUITE_COPY_DIR"])

import torch  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

import uccl_collective  # noqa: E402,F401  (registers "uccl")

# Wherever the suite lists the backends that have a feature, uccl is listed
# as Gloo is ("plugin": require_backend_is_available accepts it).  Not with
# --as nccl (UCCL_SUITE_AS=nccl): there the suite reads BACKEND as "nccl" and
# NCCL's entries decide; the copy's prelude makes the groups uccl's.
if os.environ.get("UCCL_SUITE_AS") != "nccl":
    for _feature in ("gpu", "cuda", "ddp", "subgroup", "plugin"):
        DistTestCases.backend_feature.setdefault(_feature, set()).add("uccl")

import _uccl_distributed_test as _dt  # noqa: E402


class TestDistBackendWithSpawn(_dt.TestDistBackend, _dt.DistributedTest._DistTestBase):
    """As torch's test_distributed_spawn.py combines them."""

    def setUp(self):
        super().setUp()
        if os.environ.get("UCCL_SUITE_START") == "fork":   # as torch's former
            # test_distributed_fork.py (MultiProcessTestCase._fork_processes, gone from torch)
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


def _gist(text: str) -> str:
    """The line of a traceback that says what went wrong."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if any(w in ln for w in ("Error", "Exception", "Expected", "Timeout", "exited with",
                                 "Process ")):
            return ln[:300]
    return lines[-1][:300] if lines else ""


class _Recorder(unittest.TextTestResult):
    """Appends {"test", "status", "reason", "seconds"} per test to a file, as
    each ends (a run cut short by the launcher's timeout keeps what ran)."""

    def __init__(self, *args, path: str, **kwargs):
        super().__init__(*args, **kwargs)
        self._path, self._t0 = path, 0.0

    def startTest(self, test):
        self._t0 = time.monotonic()
        super().startTest(test)

    def _write(self, test, status: str, reason: str = "") -> None:
        rec = {"test": test.id().rsplit(".", 1)[-1], "status": status,
               "reason": _gist(reason),
               "seconds": round(time.monotonic() - self._t0, 1)}
        with open(self._path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def addSuccess(self, test):
        super().addSuccess(test)
        self._write(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._write(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._write(test, "failed", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._write(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._write(test, "xfail")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._write(test, "failed", "unexpected success")


def _selected(names: list[str]) -> unittest.TestSuite:
    loader = unittest.TestLoader()
    all_names = loader.getTestCaseNames(TestDistBackendWithSpawn)
    if names:
        missing = sorted(set(names) - set(all_names))
        if missing:
            raise SystemExit(f"not tests of this torch's suite: {missing}")
        all_names = [n for n in all_names if n in set(names)]
    return unittest.TestSuite(TestDistBackendWithSpawn(n) for n in all_names)


def main() -> int:
    names = [n for n in sys.argv[1:] if n]
    if names == ["--list"]:
        # "name" per test, "name skip" for one the suite skips before starting ranks
        # (a skip decorator that its gating chose at import)
        for n in unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn):
            skip = getattr(getattr(TestDistBackendWithSpawn, n), "__unittest_skip__", False)
            print(f"{n} skip" if skip else n)
        return 0
    suite = _selected(names)
    runner = unittest.TextTestRunner(verbosity=2, resultclass=lambda *a, **k: _Recorder(
        *a, path=os.environ["UCCL_SUITE_RESULTS"], **k))
    runner.run(suite)
    return 0


if __name__ == "__main__":
    sys.exit(main())
