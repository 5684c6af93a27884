"""How fast the GPUs of this host move bytes to each other, every GPU receiving at once.

    python3 benchmarks/gpu_copy_ceiling.py                     # every GPU, 256 MiB
    python3 benchmarks/gpu_copy_ceiling.py --gpus 0,1 --size 64M --json out.json

The ceiling the multi-GPU bandwidth target is measured against (busbw of
all_gather and all_reduce at 256 MiB a rank at least 0.9x the best rate
here), and the measurement behind the choice of who copies.  One process
drives every GPU named, with peer access on between every pair (torch turns
it on at a copy between two devices).  Each GPU r receives --size bytes from
every other GPU p into a slot of its own (all_gather's pattern: every GPU
receives N-1 chunks at once), three ways:

  pull   each copy issued on a stream of the receiver (its copy engines),
         one stream per peer (cuMemcpyDtoDAsync on that stream)
  push   each copy issued on a stream of the sender, one per peer
  sm     one kernel on each receiver whose blocks read the peers' sources
         (16-byte loads) and write its slots; no copy engine

and, the ring's pattern (every GPU receives from one neighbour only, the
same (N-1) x size bytes, one copy after another on one stream):

  ring-pull  each GPU copies from the GPU before it (index - 1), on its own stream
  ring-push  each GPU copies into the GPU after it, on its own stream

Each way runs --iters rounds after --warmup, all GPUs at once, timed on the
host from the first issue to the end of the last copy on every GPU.  The
sources hold random bytes and every slot is poisoned before the way runs and
compared with its source after.  busbw = (N-1) x size / round time, per GPU,
as nccl-tests' all_gather busbw.  Exit status 1 if a slot came out wrong, 2
if the probe could not run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import parse_size  # noqa: E402
from ipc_close_probe import _cuda  # noqa: E402

SM_SOURCE = r'''
extern "C" __global__ void uccl_pull_sm(const unsigned long long *srcs, unsigned long long words,
                                        int4 *dst)
{
    const int4 *s = (const int4 *)srcs[blockIdx.y];
    int4 *d = dst + (unsigned long long)blockIdx.y * words;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < words; i += (unsigned long long)gridDim.x * blockDim.x)
        d[i] = s[i];
}
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--gpus", help="comma-separated GPU indexes (default: every visible GPU)")
    ap.add_argument("--size", default="256M", help="bytes each GPU gets from each other (256M)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sm-blocks", type=int, default=64, help="blocks per peer of the sm way")
    ap.add_argument("--ways", default="pull,push,sm,ring-pull,ring-push")
    ap.add_argument("--json", help="write the result here too")
    a = ap.parse_args()
    import torch
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("this probe needs two GPUs or more", file=sys.stderr)
        return 2
    gpus = ([int(x) for x in a.gpus.split(",")] if a.gpus
            else list(range(torch.cuda.device_count())))
    n, size = len(gpus), parse_size(a.size)
    if n < 2 or size % 16:
        print(f"--gpus needs two or more GPUs and --size a multiple of 16 (got {gpus}, {size})",
              file=sys.stderr)
        return 2
    for p in gpus:
        for r in gpus:
            if p != r and not torch.cuda.can_device_access_peer(r, p):
                print(f"GPU {r} cannot access GPU {p}'s memory (no peer access)", file=sys.stderr)
                return 2
    src, dst, streams = {}, {}, {}
    for g in gpus:
        with torch.cuda.device(g):
            src[g] = torch.randint(0, 256, (size,), dtype=torch.uint8, device=g)
            dst[g] = torch.empty((n - 1) * size, dtype=torch.uint8, device=g)
            streams[g] = [torch.cuda.Stream(g) for _ in range(n - 1)]
    for p in gpus:          # peer access both ways: torch enables it at a copy
        for r in gpus:
            if p != r:
                dst[r][:16].copy_(src[p][:16])
    torch.cuda.synchronize()

    def slot(r: int, p: int) -> torch.Tensor:
        j = gpus.index(p) - (gpus.index(p) > gpus.index(r))
        return dst[r][j * size:(j + 1) * size]

    memcpy = _cuda().memcpy   # the copy engine of the stream's device does the copy
    kernels, ptrs = {}, {}

    def left(r: int) -> int:
        return gpus[gpus.index(r) - 1]

    def issue_ring(way: str) -> None:
        for r in gpus:
            issuer = r if way == "ring-pull" else left(r)
            torch.cuda.set_device(issuer)
            s = streams[issuer][0]
            for p in (q for q in gpus if q != r):   # every slot, from the neighbour
                rc = memcpy(slot(r, p).data_ptr(), src[left(r)].data_ptr(), size, s.cuda_stream)
                if rc:
                    raise RuntimeError(f"cuMemcpyDtoDAsync {left(r)} -> {r} on GPU {issuer}: "
                                       f"CUresult {rc}")

    def issue_ce(way: str) -> None:
        for r in gpus:
            for i, p in enumerate(q for q in gpus if q != r):
                issuer = r if way == "pull" else p
                s = streams[issuer][i if way == "pull" else
                                    [q for q in gpus if q != p].index(r)]
                torch.cuda.set_device(issuer)   # the issuer's context is current
                rc = memcpy(slot(r, p).data_ptr(), src[p].data_ptr(), size, s.cuda_stream)
                if rc:
                    raise RuntimeError(f"cuMemcpyDtoDAsync {p} -> {r} on GPU {issuer}: "
                                       f"CUresult {rc}")

    def issue_sm() -> None:
        import numpy as np
        for r in gpus:
            kernels[r].launch((a.sm_blocks, n - 1), 512,
                              (ptrs[r], np.uint64(size // 16), dst[r]), stream=streams[r][0])

    rows, bad = [], []
    for way in [w for w in a.ways.split(",") if w]:
        if way == "sm" and not kernels:
            from uccl_collective.gpu_ring import Kernel
            for r in gpus:
                kernels[r] = Kernel(SM_SOURCE, "uccl_pull_sm", device=r)
                ptrs[r] = torch.tensor([src[p].data_ptr() for p in gpus if p != r],
                                       dtype=torch.int64, device=r)
        go = (issue_sm if way == "sm" else (lambda w=way: issue_ring(w))
              if way.startswith("ring") else (lambda w=way: issue_ce(w)))
        for g in gpus:
            dst[g].fill_(0xA5)
        torch.cuda.synchronize()
        for _ in range(a.warmup):
            go()
        for g in gpus:
            torch.cuda.synchronize(g)
        t0 = time.perf_counter()
        for _ in range(a.iters):
            go()
        for g in gpus:
            torch.cuda.synchronize(g)
        sec = (time.perf_counter() - t0) / a.iters
        wrong = [(p, r) for r in gpus for p in gpus if p != r and not torch.equal(
            slot(r, p), src[left(r) if way.startswith("ring") else p].to(r))]
        bad += [f"{way}: GPU {r}'s slot for GPU {p}" for p, r in wrong]
        busbw = (n - 1) * size / sec / 1e9
        rows.append({"way": way, "ms": round(sec * 1e3, 3), "busbw_GBps": round(busbw, 1),
                     "right": not wrong})
        print(f"{way:5s} {n} GPUs, {size >> 20} MiB from each peer: {sec * 1e3:9.3f} ms a round, "
              f"busbw {busbw:7.1f} GB/s{'' if not wrong else '  WRONG BYTES'}", flush=True)
    out = {"gpus": gpus, "size": size, "iters": a.iters, "rows": rows,
           "device": torch.cuda.get_device_name(gpus[0]), "torch": torch.__version__}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    for b in bad:
        print("wrong bytes:", b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
