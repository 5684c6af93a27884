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
a bug, each with its reason.  The ordinary engine is built
again at the end.  Exit status 0: pytest passed and no finding."""
from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MODES = {"address": ("address,undefined", "libasan.so"), "thread": ("thread", "libtsan.so")}
ENGINE = re.compile(r"\bcsrc/\w+/\w+\.[ch]:\d+|_engine\.abi3\.so")


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


def build(sanitize: str) -> None:
    env = {**os.environ, "UCCL_SANITIZE": sanitize}
    if not sanitize:
        env.pop("UCCL_SANITIZE")
    p = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise SystemExit(f"building the engine (UCCL_SANITIZE={sanitize!r}) failed:\n"
                         f"{p.stdout[-3000:]}{p.stderr[-3000:]}")


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
    ap.add_argument("tests", nargs="+", help="test files (and pytest options)")
    ap.add_argument("--logs", help="keep the reports in this folder (default: a temporary one)")
    ap.add_argument("--keep-build", action="store_true",
                    help="leave the sanitized engine in place (then LD_PRELOAD is needed)")
    a, extra = ap.parse_known_args()  # the rest goes to pytest (-k, -x, -v ...)
    logs = pathlib.Path(a.logs or tempfile.mkdtemp(prefix=f"uccl-{a.mode}-"))
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    build(MODES[a.mode][0])
    try:
        env = {**os.environ, **runtime_env(a.mode, logs), "PYTHONPATH": str(ROOT)}
        with open(logs / "pytest.out", "w") as out:
            p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p",
                                  "no:cacheprovider", *a.tests, *extra], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 errors="replace")
            for line in p.stdout:
                out.write(line)
                sys.stdout.write(line)
            p.wait()
    finally:
        if not a.keep_build:
            build("")
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
