"""Run upstream UCCL's own p2p tests and benchmarks against this package,
with only their import changed (``from uccl import p2p`` becomes ``from
uccl_collective import p2p``, and the same for ``collective``).

    python3 benchmarks/run_upstream.py --src ~/uccl            # a checkout (any commit)
    python3 benchmarks/run_upstream.py --fetch main            # downloads the files (a branch or commit)
    python3 benchmarks/run_upstream.py --src ~/uccl --only test_engine_send --markdown out.md

Nothing of upstream is kept in this repository: --fetch downloads the files
of one commit from GitHub into a temporary folder (it needs the network),
--src reads them from a folder you point to (a checkout, or a folder with the
files side by side).  Each file is copied into a temporary folder, its
imports rewritten, and run as upstream runs it (python, or torchrun with the
number of ranks it needs) under a timeout.  What a file needs that this
machine lacks (a GPU, several GPUs, a Python package) is checked first and the
file reported as "not run" with the reason; every other outcome is the
file's own exit status (and a traceback in its output, since upstream's
scripts often exit 0 when a child process failed).  A table (and --markdown/--json files) says which
passed, which failed and why (the last lines of their output).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def _entry(name, paths, launcher="python", args=(), gpus=0, modules=(), extras=()):
    """One run: a file (paths tried in order: HEAD's layout, then the older
    one), its launcher ("python", or "torchrun:N"), its arguments, what it
    needs that a machine may lack (GPUs, Python packages), and the sibling
    files it imports (copied beside it)."""
    return dict(name=name, paths=list(paths), launcher=launcher, args=list(args), gpus=gpus,
                modules=list(modules), extras=list(extras))


def _t(f):
    return [f"p2p/tests/{f}.py", f"p2p/{f}.py"]


def _b(f):
    return [f"p2p/benchmarks/{f}.py", f"p2p/{f}.py"]


SMALL = ["--sizes", "1024,65536,1048576", "--iters", "5"]
UTIL = ["p2p/benchmarks/util.py"]
BENCH_RW = _b("benchmark_uccl_readwrite")
# What each file needs was read off the file: GPU buffers ("cuda:0",
# pin_memory), one GPU per LOCAL_RANK (torch.cuda.set_device(local_rank)),
# and which ones start their own processes (python) or expect torchrun.
ENTRIES = [
    _entry("test_engine_send", _t("test_engine_send")),
    _entry("test_engine_metadata", _t("test_engine_metadata")),
    _entry("test_engine_read", _t("test_engine_read"), gpus=1),
    _entry("test_engine_write", _t("test_engine_write"), gpus=1),
    _entry("test_engine_onesided_ipc", _t("test_engine_onesided_ipc"), "torchrun:2", gpus=1),
    _entry("test_engine_nvlink", _t("test_engine_nvlink"), "torchrun:2", gpus=2),
    _entry("test_register_memory_cache", _t("test_register_memory_cache")),
    _entry("test_remove_remote_endpoint", _t("test_remove_remote_endpoint"), "torchrun:2"),
    _entry("test_ray_api", _t("test_ray_api"), gpus=1),
    # benchmark_uccl's --device cpu path is broken upstream (numpy's
    # itemsize read off the type): its GPU path is the one to run
    _entry("benchmark_uccl", _b("benchmark_uccl"), "torchrun:2", ["--device", "gpu", *SMALL],
           gpus=1),
    _entry("benchmark_uccl --async-transfer", _b("benchmark_uccl"), "torchrun:2",
           ["--device", "gpu", "--async-transfer", *SMALL], gpus=1),
    _entry("benchmark_uccl --num-kvblocks 4", _b("benchmark_uccl"), "torchrun:2",
           ["--device", "gpu", "--num-kvblocks", "4", *SMALL], gpus=1),
    # --device cpu pins its buffers (pin_memory), which needs CUDA too
    *[_entry(f"benchmark_uccl_readwrite {' '.join(extra)}", BENCH_RW, "torchrun:2",
             [*extra, *SMALL], gpus=1)
      for extra in (["--mode", "write"], ["--mode", "read"], ["--mode", "write", "--async-api"],
                    ["--mode", "read", "--num-iovs", "4"], ["--mode", "write", "--lazy"],
                    ["--mode", "write", "--device", "cpu"])],
    _entry("benchmark_uccl_collective", _b("benchmark_uccl_collective"), "torchrun:2",
           ["--sizes", "1024,65536", "--iters", "5"], gpus=2),
    _entry("benchmark_uccl_allgather", _b("benchmark_uccl_allgather"), "torchrun:2", [], gpus=2,
           extras=UTIL),
    _entry("benchmark_uccl_alltoall", _b("benchmark_uccl_alltoall"), "torchrun:2", [], gpus=2,
           modules=["nvtx"], extras=UTIL),
]

IMPORTS = [  # (pattern, replacement): upstream's import lines -> this package
    (re.compile(r"^(\s*)from uccl import (p2p|collective)\b", re.M), r"\1from uccl_collective import \2"),
    (re.compile(r"^(\s*)from uccl\.(p2p|collective) import\b", re.M),
     r"\1from uccl_collective.\2 import"),
    (re.compile(r"^(\s*)import uccl\.(p2p|collective) as\b", re.M), r"\1import uccl_collective.\2 as"),
    (re.compile(r"^(\s*)import uccl_p2p as\b", re.M), r"\1import uccl_collective.p2p as"),
    (re.compile(r"^(\s*)import uccl_p2p\b", re.M), r"\1from uccl_collective import p2p as uccl_p2p"),
    (re.compile(r"^(\s*)import p2p\b", re.M), r"\1from uccl_collective import p2p"),
]
LEFT = re.compile(r"^\s*(from uccl(\.\w+)? import|import uccl\b|import p2p\b)", re.M)


def rewrite(text: str) -> tuple[str, list[str]]:
    """text with upstream's imports replaced; the uccl imports left over."""
    for pat, rep in IMPORTS:
        text = pat.sub(rep, text)
    return text, [m.group(0).strip() for m in LEFT.finditer(text)]


def fetch(commit: str, rel: str, dest: str) -> bool:
    url = f"https://raw.githubusercontent.com/uccl-project/uccl/{commit}/{rel}"
    try:
        with urllib.request.urlopen(url, timeout=30) as r, open(dest, "wb") as f:
            f.write(r.read())
        return True
    except OSError:
        return False


def find(src: str, rels: list[str]) -> str | None:
    for rel in rels:
        for cand in (os.path.join(src, rel), os.path.join(src, os.path.basename(rel))):
            if os.path.isfile(cand):
                return cand
    return None


def machine() -> dict:
    gpus = 0
    try:
        import torch
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        pass
    # recorded with the results (no entry needs a NIC: this package runs
    # upstream's files over TCP, shared memory and CUDA IPC)
    rdma = os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))
    return dict(gpus=gpus, rdma=rdma)


RANK_PREFIX = re.compile(r"^\[(default)?rank\d+\]:\s?")


def run_one(path: str, launcher: str, args: list[str], timeout: float, workdir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p), PYTHONUNBUFFERED="1")
    if launcher == "python":
        cmd = [sys.executable, path, *args]
    else:
        n = launcher.split(":")[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", n,
               "--master_port", str(29500 + os.getpid() % 1000), path, *args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True,
                           timeout=timeout, start_new_session=True)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else \
            (e.stdout or "")
    # torchrun prefixes its children's lines with "[rankN]: " and ends with
    # its own summary (ChildFailedError): the children's errors are the why
    lines = [RANK_PREFIX.sub("", ln) for ln in out.splitlines()
             if ln.strip() and not ln.startswith("W1")]
    trace = [ln for ln in lines if re.match(r"\w*(Error|Exception)\b.*:", ln.strip())
             and "ChildFailedError" not in ln]
    return dict(rc=rc, seconds=round(time.monotonic() - t0, 1), tail=trace[-2:] or lines[-6:],
                traceback="Traceback (most recent call last)" in out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--src", help="a checkout of uccl-project/uccl, or a folder with its files")
    g.add_argument("--fetch", metavar="COMMIT", help="download the files of this commit (or branch) of uccl-project/uccl")
    p.add_argument("--only", nargs="*", help="run only these entries (names as in the table)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per file")
    p.add_argument("--markdown", help="write the table as Markdown to this file")
    p.add_argument("--json", help="write the results as JSON to this file")
    a = p.parse_args()
    have = machine()
    tmp = tempfile.mkdtemp(prefix="uccl-upstream-")
    results = []
    try:
        for e in ENTRIES:
            name = e["name"]
            if a.only and name not in a.only and name.split()[0] not in a.only:
                continue
            folder = tempfile.mkdtemp(dir=tmp)   # each run alone with its siblings
            dest = os.path.join(folder, os.path.basename(e["paths"][0]))
            if a.fetch:
                got = any(fetch(a.fetch, rel, dest) for rel in e["paths"])
                origin = f"{a.fetch}:{e['paths'][0]}" if got else None
                for rel in e["extras"] if got else ():
                    fetch(a.fetch, rel, os.path.join(folder, os.path.basename(rel)))
            else:
                found = find(a.src, e["paths"])
                got = found is not None
                if got:
                    shutil.copy(found, dest)
                    for rel in e["extras"]:   # beside the file, or where the layout has it
                        sib = os.path.join(os.path.dirname(found), os.path.basename(rel))
                        sib = sib if os.path.isfile(sib) else find(a.src, [rel])
                        if sib:
                            shutil.copy(sib, folder)
                origin = found
            row = dict(name=name, origin=origin)
            missing = [m for m in e["modules"] if importlib.util.find_spec(m) is None]
            if not got:
                row.update(result="absent", why="no such file at this commit / in this folder")
            elif e["gpus"] > have["gpus"]:
                row.update(result="not run", why=f"needs {e['gpus']} GPU(s); this machine "
                                                 f"has {have['gpus']}")
            elif missing:
                row.update(result="not run", why="needs the Python package(s) "
                                                 f"{', '.join(missing)}, not installed here")
            else:
                with open(dest) as f:
                    text, left = rewrite(f.read())
                with open(dest, "w") as f:
                    f.write(text)
                r = run_one(dest, e["launcher"], e["args"], a.timeout, folder)
                # upstream's scripts often exit 0 when a child process failed:
                # a traceback in the output is a failure too
                ok = r["rc"] == 0 and not r["traceback"]
                row.update(result="pass" if ok else "fail", rc=r["rc"], seconds=r["seconds"],
                           why="" if ok else " / ".join(r["tail"][-3:])[:400],
                           imports_left=left)
            results.append(row)
            print(f"{name:<30} {row['result']:<8} {row.get('why', '')[:150]}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("| file | result | why |\n| --- | --- | --- |\n")
            for r in results:
                why = r.get("why", "").replace("|", "\\|")
                f.write(f"| {r['name']} | {r['result']} | {why} |\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(machine=have, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
