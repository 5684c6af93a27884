"""Runs test files against the engine built for the sanitizers
(docs/testing.md, "Sanitizers and fuzzing"):

    python3 tests/sanitize/run.py address tests/test_transfers.py ...   # ASan + UBSan
    python3 tests/sanitize/run.py thread tests/test_concurrency.py ...  # TSan

It builds the engine with UCCL_SANITIZE (setup.py), runs pytest on it with
the sanitizer's runtime preloaded (python itself is not sanitized, and the
runtime must come first), every process's reports written to a folder,
then reads them.  A report with a frame in the engine (a csrc/ source line,
or the module) is a finding; reports with none (python's own, torch's, a
compiler's that a test ran) are counted, not findings.  The suppression
files beside this one (asan.supp, ubsan.supp, tsan.supp) name what is not
a bug, each with its reason.  Exit status 0: pytest passed and no finding.

The sanitized engine is built out of the tree (build/sanitize-<mode>/, with
its own object files) and loaded through a shadow of the package there
(build/sanitize-<mode>/pkg/uccl_collective/: links to the package's files,
the sanitized module in place of the ordinary one), put first on
PYTHONPATH.  The ordinary in-place engine is never rebuilt or replaced, so a
run stopped at any moment (Ctrl-C, a kill, a timeout) leaves the tree as it
was.  A test that starts python with PYTHONPATH set to the repository
alone runs the ordinary engine in that child (unsanitized, still working)."""
from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MODES = {"address": ("address,undefined", "libasan.so"), "thread": ("thread", "libtsan.so")}
ENGINE = re.compile(r"\bcsrc/\w+/\w+\.[ch]:\d+|_engine\.abi3\.so")


#: what CI runs (`run.py address ci`, .ci/run): the transfer paths, the
#: handshake with hostile and hand-made records, the threaded engine and the
#: stream-ordered groups: 126 tests, under 5 minutes on 2 cores (docs/testing.md)
CI = ["tests/test_transfers.py", "tests/test_handshake_security.py", "tests/test_hostile_peer.py",
      "tests/test_security.py", "tests/test_concurrency.py", "tests/test_stream_group.py",
      "tests/test_stream_p2p.py", "tests/test_errors.py"]


#: tests whose check means nothing under a sanitizer, each with the reason
DESELECT = {
    "address": [
        # looks for any 8 bytes a refused client got that is an address mapped
        # in the server: ASan maps terabytes of shadow memory, so random bytes
        # (a nonce, a proof) and small numbers read as addresses there
        "tests/test_handshake_security.py::test_refusal_tells_nothing",
    ],
    "thread": [],
}


def runtime_env(mode: str, logs: pathlib.Path) -> dict:
    """What a process needs to load the sanitized engine, and where its reports go."""
    cc = os.environ.get("CC", "gcc")
    lib = subprocess.run([cc, f"-print-file-name={MODES[mode][1]}"], capture_output=True,
                         text=True, check=True).stdout.strip()
    if not os.path.isabs(lib):
        raise SystemExit(f"{cc} has no {MODES[mode][1]}: install its sanitizer runtime")
    common = f"log_path={logs}/{mode}:print_suppressions=0"
    # UBSan (gcc's, beside ASan) ignores log_path and writes to stderr: pytest
    # runs with -s so that its reports reach pytest.out, and it stops the
    # process, so that one in a child whose stderr a test captures still fails
    # that test
    env = {"LD_PRELOAD": lib,
           "UBSAN_OPTIONS": f"print_stacktrace=1:halt_on_error=1:"
                            f"suppressions={HERE / 'ubsan.supp'}"}
    if mode == "address":
        # no leak check at exit: python leaves thousands of objects at exit
        # (7,657 reports for tests/test_api_local.py alone, none the engine's),
        # and the check takes seconds per process; the fuzz harnesses check
        # the engine's C code for leaks (tests/test_fuzz.py)
        env["ASAN_OPTIONS"] = (f"{common}:detect_leaks=0:suppressions={HERE / 'asan.supp'}:"
                               "allocator_may_return_null=1")
    else:
        env["TSAN_OPTIONS"] = f"{common}:suppressions={HERE / 'tsan.supp'}:halt_on_error=0"
    return env


def build(mode: str) -> pathlib.Path:
    """The engine built for `mode` under build/sanitize-<mode>/ (setup.py,
    UCCL_SANITIZE), and a shadow package there that loads it: the folder
    to put first on PYTHONPATH."""
    top = ROOT / "build" / f"sanitize-{mode}"
    env = {**os.environ, "UCCL_SANITIZE": MODES[mode][0]}
    p = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib",
                        str(top / "lib"), "--build-temp", str(top / "temp")], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise SystemExit(f"building the engine (UCCL_SANITIZE={MODES[mode][0]}) failed:\n"
                         f"{p.stdout[-3000:]}{p.stderr[-3000:]}")
    built = sorted((top / "lib" / "uccl_collective").glob("_engine*.so"))
    if len(built) != 1:
        raise SystemExit(f"expected one sanitized module in {top / 'lib'}, found {built}")
    pkg = top / "pkg" / "uccl_collective"
    if pkg.exists():
        shutil.rmtree(pkg)
    pkg.mkdir(parents=True)
    for entry in (ROOT / "uccl_collective").iterdir():
        if entry.name == "__pycache__" or entry.name.startswith("_engine"):
            continue
        (pkg / entry.name).symlink_to(entry)
    (pkg / built[0].name).symlink_to(built[0])
    return top / "pkg"


# python -m / -c put the working folder (the repository, with the ordinary
# engine) before PYTHONPATH: the runner drops it (ranks a test spawns with
# multiprocessing take the runner's path).
BOOT = ("import os, sys\n"
        "if sys.path and sys.path[0] in ('', os.getcwd()): del sys.path[0]\n")


def check_loaded(env: dict, pkg_root: pathlib.Path) -> None:
    """The python the tests run imports the sanitized module (not the
    in-place one: an editable install's path, say, coming first)."""
    p = subprocess.run([sys.executable, "-c", BOOT + "import uccl_collective._engine as e; "
                        "print(e.__file__)"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    where = p.stdout.strip()
    if p.returncode or not where.startswith(str(pkg_root)):
        raise SystemExit(f"the sanitized engine does not load (got {where!r}):\n"
                         f"{p.stderr[-3000:]}")


def reports(logs: pathlib.Path):
    """Every report in the folder: (kind, text)."""
    for f in sorted(logs.iterdir()):
        text = f.read_text(errors="replace")
        # UBSan: one "file:line:col: runtime error: ..." each, with its stack
        for m in re.finditer(r"^\S+:\d+:\d+: runtime error: .*(?:\n    #.*)*", text, re.M):
            yield "ubsan", m.group(0)
        # a leak report holds many leaks: each its own report
        for m in re.finditer(r"^(?:Direct|Indirect) leak of .*(?:\n    #.*)*", text, re.M):
            yield "leak", m.group(0)
        for m in re.finditer(r"^(==\d+==ERROR: AddressSanitizer|WARNING: ThreadSanitizer)"
                             r".*?(?:^SUMMARY: .*?$|\Z)", text, re.M | re.S):
            yield "asan" if "AddressSanitizer" in m.group(1) else "tsan", m.group(0)


def first_engine_frame(text: str) -> str | None:
    m = ENGINE.search(text)
    return m.group(0) if m else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=sorted(MODES))
    ap.add_argument("tests", nargs="+", help="test files (and pytest options); ci: CI's subset")
    ap.add_argument("--logs", help="keep the reports in this folder (default: a temporary one)")
    a, extra = ap.parse_known_args()  # the rest goes to pytest (-k, -x, -v ...)
    if a.tests == ["ci"]:
        a.tests = CI
    logs = pathlib.Path(a.logs or tempfile.mkdtemp(prefix=f"uccl-{a.mode}-"))
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    pkg_root = build(a.mode)
    path = os.pathsep.join(p for p in (str(pkg_root), str(ROOT), os.environ.get("PYTHONPATH"))
                           if p)
    env = {**os.environ, **runtime_env(a.mode, logs), "PYTHONPATH": path,
           "PYTHONUNBUFFERED": "1"}
    check_loaded(env, pkg_root)
    with open(logs / "pytest.out", "w") as out:
        skip = [f"--deselect={t}" for t in DESELECT[a.mode]]
        p = subprocess.Popen([sys.executable, "-c", BOOT + "import pytest; sys.exit(pytest.main())",
                              "-q", "-s", "-p", "no:cacheprovider", *skip, *a.tests, *extra],
                             cwd=ROOT,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace")
        for line in p.stdout:
            out.write(line)
            sys.stdout.write(line)
        p.wait()
    found, other = collections.OrderedDict(), collections.Counter()
    for kind, text in reports(logs):
        where = first_engine_frame(text)
        if where:
            found.setdefault((kind, where), text)
        else:
            other[kind] += 1
    print(f"\nsanitize.py {a.mode}: pytest exit {p.returncode}, {len(found)} finding(s) in the "
          f"engine, {sum(other.values())} report(s) outside it {dict(other)}, "
          f"{time.monotonic() - t0:.0f} s; reports in {logs}")
    for (kind, where), text in found.items():
        print(f"\n---- {kind} at {where}\n{text[:4000]}")
    return 0 if p.returncode == 0 and not found else 1


if __name__ == "__main__":
    sys.exit(main())
