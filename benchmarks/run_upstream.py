"""Run upstream UCCL's own p2p tests and benchmarks against this package,
with only their import changed (``from uccl import p2p`` becomes ``from
uccl_collective import p2p``, and the same for ``collective``).

    python3 benchmarks/run_upstream.py --src ~/uccl            # a checkout (any commit)
    python3 benchmarks/run_upstream.py --fetch 681068e4        # downloads the files
    python3 benchmarks/run_upstream.py --src ~/uccl --only test_engine_send --markdown out.md

Nothing of upstream is kept in this repository: --fetch downloads the files
of one commit from GitHub into a temporary folder (it needs the network),
--src reads them from a folder you point to (a checkout, or a folder with the
files side by side).  Each file is copied into a temporary folder, its
imports rewritten, and run as upstream runs it (python, or torchrun with the
number of ranks it needs) under a timeout.  What a file needs that this
machine lacks (a GPU, several GPUs, an RDMA NIC) is checked first and the
file reported as "not run" with the reason; every other outcome is the
file's own exit status (and a traceback in its output, since upstream's
scripts often exit 0 when a child process failed).  A table (and --markdown/--json files) says which
passed, which failed and why (the last lines of their output).
"""
from __future__ import annotations

import argparse
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

# name, paths tried (HEAD's layout first, then the older one), launcher
# ("python" or "torchrun:N"), arguments, what it needs (gpus: how many,
# rdma: an RDMA NIC)
ENTRIES = [
    ("test_engine_send", ["p2p/tests/test_engine_send.py", "p2p/test_engine_send.py"],
     "python", [], dict(gpus=0)),
    ("test_engine_metadata", ["p2p/tests/test_engine_metadata.py",
                              "p2p/test_engine_metadata.py"], "python", [], dict(gpus=0)),
    ("test_engine_read", ["p2p/tests/test_engine_read.py", "p2p/test_engine_read.py"],
     "torchrun:2", [], dict(gpus=0)),
    ("test_engine_write", ["p2p/tests/test_engine_write.py", "p2p/test_engine_write.py"],
     "torchrun:2", [], dict(gpus=0)),
    ("test_engine_onesided_ipc", ["p2p/tests/test_engine_onesided_ipc.py"], "torchrun:2", [],
     dict(gpus=1)),
    ("test_engine_nvlink", ["p2p/tests/test_engine_nvlink.py", "p2p/test_engine_nvlink.py"],
     "torchrun:2", [], dict(gpus=2)),
    ("test_register_memory_cache", ["p2p/tests/test_register_memory_cache.py"], "torchrun:2",
     [], dict(gpus=0)),
    ("test_remove_remote_endpoint", ["p2p/tests/test_remove_remote_endpoint.py"],
     "torchrun:2", [], dict(gpus=0)),
    ("test_ray_api", ["p2p/tests/test_ray_api.py"], "torchrun:2", [], dict(gpus=0)),
    ("benchmark_uccl", ["p2p/benchmarks/benchmark_uccl.py", "p2p/benchmark_uccl.py"],
     "torchrun:2", ["--device", "cpu", "--sizes", "1024,65536,1048576", "--iters", "5"],
     dict(gpus=0)),
    ("benchmark_uccl_readwrite", ["p2p/benchmarks/benchmark_uccl_readwrite.py"], "torchrun:2",
     ["--device", "cpu", "--sizes", "1024,65536", "--iters", "5"], dict(gpus=0)),
    ("benchmark_uccl_collective", ["p2p/benchmarks/benchmark_uccl_collective.py"],
     "torchrun:2", ["--sizes", "1024,65536", "--iters", "5"], dict(gpus=0)),
    ("benchmark_uccl_allgather", ["p2p/benchmarks/benchmark_uccl_allgather.py"], "torchrun:2",
     [], dict(gpus=0)),
    ("benchmark_uccl_alltoall", ["p2p/benchmarks/benchmark_uccl_alltoall.py"], "torchrun:2",
     [], dict(gpus=0)),
]

IMPORTS = [  # (pattern, replacement): upstream's import lines -> this package
    (re.compile(r"^(\s*)from uccl import (p2p|collective)\b", re.M), r"\1from uccl_collective import \2"),
    (re.compile(r"^(\s*)from uccl\.(p2p|collective) import\b", re.M),
     r"\1from uccl_collective.\2 import"),
    (re.compile(r"^(\s*)import uccl\.(p2p|collective) as\b", re.M), r"\1import uccl_collective.\2 as"),
    (re.compile(r"^(\s*)import uccl_p2p as\b", re.M), r"\1import uccl_collective.p2p as"),
    (re.compile(r"^(\s*)import uccl_p2p\b", re.M), r"\1from uccl_collective import p2p as uccl_p2p"),
]
LEFT = re.compile(r"^\s*(from uccl(\.\w+)? import|import uccl\b)", re.M)


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
    rdma = os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))
    return dict(gpus=gpus, rdma=rdma)


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
    lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("W1")]
    trace = [ln for ln in lines if re.match(r"\w*(Error|Exception)\b.*:", ln.strip())]
    return dict(rc=rc, seconds=round(time.monotonic() - t0, 1), tail=trace[-2:] or lines[-6:],
                traceback="Traceback (most recent call last)" in out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--src", help="a checkout of uccl-project/uccl, or a folder with its files")
    g.add_argument("--fetch", metavar="COMMIT", help="download the files of this commit")
    p.add_argument("--only", nargs="*", help="run only these entries (names as in the table)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per file")
    p.add_argument("--markdown", help="write the table as Markdown to this file")
    p.add_argument("--json", help="write the results as JSON to this file")
    a = p.parse_args()
    have = machine()
    tmp = tempfile.mkdtemp(prefix="uccl-upstream-")
    results = []
    try:
        for name, rels, launcher, args, needs in ENTRIES:
            if a.only and name not in a.only:
                continue
            dest = os.path.join(tmp, os.path.basename(rels[0]))
            if a.fetch:
                got = any(fetch(a.fetch, rel, dest) for rel in rels)
                origin = f"{a.fetch}:{rels[0]}" if got else None
            else:
                found = find(a.src, rels)
                got = found is not None
                if got:
                    shutil.copy(found, dest)
                origin = found
            row = dict(name=name, origin=origin)
            if not got:
                row.update(result="absent", why="no such file at this commit / in this folder")
            elif needs.get("gpus", 0) > have["gpus"]:
                row.update(result="not run", why=f"needs {needs['gpus']} GPU(s); this machine "
                                                 f"has {have['gpus']}")
            elif needs.get("rdma") and not have["rdma"]:
                row.update(result="not run", why="needs an RDMA NIC; this machine has none")
            else:
                with open(dest) as f:
                    text, left = rewrite(f.read())
                with open(dest, "w") as f:
                    f.write(text)
                r = run_one(dest, launcher, args, a.timeout, tmp)
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
