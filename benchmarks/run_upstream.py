"""Run upstream UCCL's own p2p tests and benchmarks against this package,
with only their import changed (``from uccl import p2p`` becomes ``from
uccl_collective import p2p``, and the same for ``collective``).

    python3 benchmarks/run_upstream.py --src ~/uccl            # a checkout (any commit)
    python3 benchmarks/run_upstream.py --fetch main            # downloads the files (a branch or commit)
    python3 benchmarks/run_upstream.py --src ~/uccl --only test_engine_send --markdown out.md
    python3 benchmarks/run_upstream.py --src ~/uccl --multi-gpu --ranks 4   # one GPU per rank, 4 ranks

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

--multi-gpu runs only the entries that need one GPU per rank (the collective
benchmarks in each mode, the allgather and alltoall benchmarks, the NVLink
test) and upstream's own NCCL baselines for allgather and alltoall, with
--ranks ranks (2 or 4; default 2).  Where upstream's script accepts exactly
2 ranks (benchmark_uccl_collective's default, --async-api and --dual modes,
test_engine_nvlink) it is reported "not run" at other rank counts.  Where an
upstream benchmark run on this package and its NCCL baseline both ran, their printed
figures are parsed and set side by side per size (the "ours vs NCCL" table).
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

def _entry(name, paths, launcher="python", args=(), gpus=0, modules=(), extras=(),
           multi=False, only_ranks=None):
    """One run: a file (paths tried in order: HEAD's layout, then the older
    one), its launcher ("python", or "torchrun:N"), its arguments, what it
    needs that a machine may lack (GPUs, Python packages), the sibling
    files it imports (copied beside it), whether it is one of the entries
    that need one GPU per rank (multi), and the only rank count the script
    accepts, if it accepts one only (only_ranks)."""
    return dict(name=name, paths=list(paths), launcher=launcher, args=list(args), gpus=gpus,
                modules=list(modules), extras=list(extras), multi=multi, only_ranks=only_ranks)


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
SINGLE = [
    _entry("test_engine_send", _t("test_engine_send")),
    _entry("test_engine_metadata", _t("test_engine_metadata")),
    _entry("test_engine_read", _t("test_engine_read"), gpus=1),
    _entry("test_engine_write", _t("test_engine_write"), gpus=1),
    _entry("test_engine_onesided_ipc", _t("test_engine_onesided_ipc"), "torchrun:2", gpus=1),
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
]

# Entries that need one GPU per rank, with the ranks as a parameter.  Sizes
# reach 64 MiB with few iterations, so that the whole set runs in minutes.
MULTI_SIZES = "4096,1048576,16777216,67108864"
AG = ["--sizes", "65536,1048576,16777216", "--num-iters", "20"]    # per rank; recv is ranks x
# the alltoall scripts time a ring send/recv of one KV block of
# block x 2 x (32/4) x 128 halves: 1024 -> 4 MiB, 16384 -> 64 MiB
A2A = ["--block-sizes", "1024", "4096", "16384", "--num-iters", "20"]
NCCL = ["p2p/benchmarks/util.py", "p2p/benchmarks/pynccl.py"]


def multi_entries(ranks: int = 2) -> list[dict]:
    tr = f"torchrun:{ranks}"
    coll = ["--sizes", MULTI_SIZES, "--iters", "10"]
    return [
        # upstream asserts exactly 2 ranks in these four
        _entry("benchmark_uccl_collective", _b("benchmark_uccl_collective"), "torchrun:2", coll,
               gpus=2, multi=True, only_ranks=2),
        _entry("benchmark_uccl_collective --async-api", _b("benchmark_uccl_collective"),
               "torchrun:2", [*coll, "--async-api"], gpus=2, multi=True, only_ranks=2),
        _entry("benchmark_uccl_collective --dual", _b("benchmark_uccl_collective"), "torchrun:2",
               [*coll, "--dual"], gpus=2, multi=True, only_ranks=2),
        _entry("benchmark_uccl_collective --ring", _b("benchmark_uccl_collective"), tr,
               [*coll, "--ring"], gpus=ranks, multi=True),
        _entry("benchmark_uccl_allgather", _b("benchmark_uccl_allgather"), tr, AG, gpus=ranks,
               extras=UTIL, multi=True),
        _entry("benchmark_nccl_allgather", _b("benchmark_nccl_allgather"), tr, AG, gpus=ranks,
               extras=NCCL, multi=True),
        _entry("benchmark_uccl_alltoall", _b("benchmark_uccl_alltoall"), tr, A2A, gpus=ranks,
               modules=["nvtx"], extras=UTIL, multi=True),
        _entry("benchmark_nccl_alltoall", _b("benchmark_nccl_alltoall"), tr, A2A, gpus=ranks,
               modules=["nvtx"], extras=NCCL, multi=True),
        _entry("test_engine_nvlink", _t("test_engine_nvlink"), "torchrun:2", gpus=2, multi=True,
               only_ranks=2),
    ]


def entries(ranks: int = 2) -> list[dict]:
    return SINGLE + multi_entries(ranks)


ENTRIES = entries(2)

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


NVTX_STUB = """import contextlib


def annotate(*args, **kwargs):  # a no-op profiler range
    return contextlib.nullcontext()
"""
RANK_PREFIX = re.compile(r"^\[(default)?rank\d+\]:\s?")


# What the benchmarks print, per size (rank 0), read off upstream's scripts:
#   allgather (ours and NCCL's):  "   Send:    64.0 KB | Recv:   128.0 KB | Time: 0.012 ms |
#                                  AlgBW: 10.92 GB/s | BusBW: 5.46 GB/s"
#   our alltoall's summary:       "Block=1K | Msg=4.00MB | BW=12.34GB/s"
#   NCCL's alltoall's summary:    "          1K |         4.00 |        12.34"
AG_LINE = re.compile(r"Send:\s*([\d.]+ [KMG]?B)\s*\|\s*Recv:.*?AlgBW:\s*([\d.]+) GB/s")
A2A_OURS = re.compile(r"Block=(\d+)K \| Msg=([\d.]+)MB \| BW=([\d.]+)GB/s")
A2A_NCCL = re.compile(r"^\s*(\d+)K\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*$", re.M)
# (operation, our entry, NCCL's entry, parser, what the figure is)
COMPARE = [
    ("allgather", "benchmark_uccl_allgather", "benchmark_nccl_allgather", "allgather",
     "AlgBW GB/s (ranks x size received / time)"),
    ("alltoall", "benchmark_uccl_alltoall", "benchmark_nccl_alltoall", "alltoall",
     "GB/s (MiB of one block / ms, ring send/recv)"),
]


def parse_figures(kind: str, out: str, ours: bool) -> dict[str, float]:
    """{size label: GB/s} from a benchmark's output (kind "allgather" or
    "alltoall"; ours tells which alltoall format)."""
    out = "\n".join(RANK_PREFIX.sub("", ln) for ln in out.splitlines())
    if kind == "allgather":
        return {size: float(bw) for size, bw in AG_LINE.findall(out)}
    pat = A2A_OURS if ours else A2A_NCCL
    return {f"{float(mb):.2f} MiB (block {k}K)": float(bw) for k, mb, bw in pat.findall(out)}


def compare(results: list[dict]) -> list[dict]:
    """Ours against NCCL's per size, where both ran and printed figures."""
    by = {r["name"]: r for r in results}
    rows = []
    for op, mine, theirs, kind, unit in COMPARE:
        a, b = by.get(mine), by.get(theirs)
        if not a or not b or not {a["result"], b["result"]} & {"pass", "fail"}:
            continue   # neither ran: nothing to set side by side
        fa = parse_figures(kind, a.get("output", ""), True) if a["result"] == "pass" else {}
        fb = parse_figures(kind, b.get("output", ""), False) if b["result"] == "pass" else {}
        if not fa or not fb:
            missing = [n for n, f in ((mine, fa), (theirs, fb)) if not f]
            rows.append(dict(op=op, size="", unit=unit, ours=None, nccl=None, ratio=None,
                             note="no figures from " + ", ".join(missing)))
            continue
        for size in list(fa) + [k for k in fb if k not in fa]:
            x, y = fa.get(size), fb.get(size)
            rows.append(dict(op=op, size=size, unit=unit, ours=x, nccl=y,
                             ratio=round(x / y, 3) if x is not None and y else None, note=""))
    return rows


def compare_markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    text = ("\n## ours vs NCCL\n\n| operation | size | figure | ours | NCCL | ours / NCCL |\n"
            "| --- | --- | --- | --- | --- | --- |\n")
    for r in rows:
        if r["note"]:
            text += f"| {r['op']} | | {r['unit']} | | | {r['note']} |\n"
            continue
        cell = lambda v: "" if v is None else f"{v:.2f}"
        text += (f"| {r['op']} | {r['size']} | {r['unit']} | {cell(r['ours'])} | "
                 f"{cell(r['nccl'])} | {cell(r['ratio'])} |\n")
    return text


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
                traceback="Traceback (most recent call last)" in out, output=out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--src", help="a checkout of uccl-project/uccl, or a folder with its files")
    g.add_argument("--fetch", metavar="COMMIT", help="download the files of this commit (or branch) of uccl-project/uccl")
    p.add_argument("--only", nargs="*", help="run only these entries (names as in the table)")
    p.add_argument("--multi-gpu", action="store_true",
                   help="run only the entries that need one GPU per rank, and the NCCL baselines")
    p.add_argument("--ranks", type=int, choices=(2, 4), default=2,
                   help="ranks (one GPU each) for the entries that need one GPU per rank")
    p.add_argument("--nvtx-stub", action="store_true",
                   help="where the package nvtx is missing, put a no-op nvtx module (profiler "
                        "ranges only) beside the scripts that import it, and run them")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per file")
    p.add_argument("--markdown", help="write the table as Markdown to this file")
    p.add_argument("--json", help="write the results as JSON to this file")
    a = p.parse_args()
    have = machine()
    tmp = tempfile.mkdtemp(prefix="uccl-upstream-")
    results = []
    try:
        for e in entries(a.ranks):
            name = e["name"]
            if a.only and name not in a.only and name.split()[0] not in a.only:
                continue
            if a.multi_gpu and not e["multi"]:
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
            if a.nvtx_stub and "nvtx" in missing:   # upstream uses it for annotate() only
                with open(os.path.join(folder, "nvtx.py"), "w") as f:
                    f.write(NVTX_STUB)
                missing.remove("nvtx")
                row["nvtx_stub"] = True
            if not got:
                row.update(result="absent", why="no such file at this commit / in this folder")
            elif e["only_ranks"] and e["only_ranks"] != a.ranks:
                row.update(result="not run", why=f"upstream's script accepts {e['only_ranks']} "
                                                 f"ranks only (run with --ranks {e['only_ranks']})")
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
                           imports_left=left, output=r["output"][-20000:])
            results.append(row)
            print(f"{name:<30} {row['result']:<8} {row.get('why', '')[:150]}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = compare(results)
    if rows:
        print(compare_markdown(rows), flush=True)
    for r in results:   # the figures are in the comparison; the output is too long to keep
        r.pop("output", None)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("| file | result | why |\n| --- | --- | --- |\n")
            for r in results:
                why = r.get("why", "").replace("|", "\\|")
                f.write(f"| {r['name']} | {r['result']} | {why} |\n")
            f.write(compare_markdown(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(machine=have, ranks=a.ranks, results=results, comparison=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
