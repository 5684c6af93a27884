"""Where a small stream-ordered collective's time goes, on one GPU shared by
the ranks: for all_reduce, all_gather_into_tensor and all_to_all_single
through the "uccl" group, per call, after --warmup calls:

    torchrun --nproc_per_node 2 benchmarks/fused_probe.py [--sizes 4,1M] [--iters 1000]

  dist issue     host time of dist.* calls queued back to back (no synchronize)
  dist total     the same loop, up to the end of its last round on the GPU
  engine issue   the engine's C call alone (what the backend's fast path calls)
  engine total   ... up to the end of its last round on the GPU
  gpu span       one call between two CUDA events, host-synchronised each
                 call (the launch's own time on the GPU, peers waited for)
  torch launch   a torch kernel of the same size (t.add_(1)) queued back to
                 back: what one launch costs the host here

Then, --c-rounds times in turn, dist total with the backend's C call
(csrc/py/py_fastpath.c) and with it off (the Python fast path it replaces),
and the median of each: the two in one process, since the host's pace
moves between processes more than between these two.

Whether a round is one launch or two-sided follows UCCL_SG_FUSED_BYTES, as in
the backend.  Every figure is the slowest rank's.  Not a benchmark against a
reference: it says which part to cut (docs/benchmark-log.md keeps what it showed).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from bench_common import parse_sizes  # noqa: E402 (this folder is on sys.path)
from uccl_collective.backend import _reduce
from uccl_collective.core import stream_group as _stream_group


def loop_us(fn, iters: int, sync) -> tuple[float, float]:
    """(issue, total) us per call of iters calls of fn, back to back."""
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e6 / iters, (t2 - t0) * 1e6 / iters


def span_us(fn, iters: int) -> float:
    """Median GPU time of one call between two events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spans = []
    for _ in range(iters):
        a.record()
        fn()
        b.record()
        b.synchronize()
        spans.append(a.elapsed_time(b) * 1e3)
    return statistics.median(spans)


def backend_pieces(be, sg, upg, dev, iters: int) -> list[tuple[str, float]]:
    """Host time of each piece of ProcessGroupUCCL.allreduce's fast path, each
    in a loop of its own (the ones that communicate run on every rank)."""
    from uccl_collective.backend import _work
    t = torch.ones(1, device=dev)
    opts = dist.AllreduceOptions()
    opts.asyncOp = False   # as torch sets it for a blocking call: the fast path
    idx = dev.index
    raw = _stream_group._raw_stream
    d = be._d   # the group's dispatch (core/dispatch.py)

    def checks():   # row 2's checks (what the C call makes in C)
        got = d.fast(opts, t)
        return got, (d.kernel_codes(got, opts, t.dtype, "all_reduce") if got else ())
    fast = checks()
    if fast[0] is None or not fast[1]:
        raise SystemExit("the backend's fast path does not apply here")
    w = _work.StreamWork(sg, 1, [t], raw(idx))

    def host(fn) -> float:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        us = (time.perf_counter() - t0) * 1e6 / iters
        torch.cuda.synchronize()
        return us

    # all_to_all_single's path (row 2: a round through Dispatch.round), piece by piece
    world = sg.size
    x, y = torch.randn(world * 16, device=dev), torch.empty(world * 16, device=dev)
    xs, ys = list(x.chunk(world)), list(y.chunk(world))
    ao = dist.AllToAllOptions()
    ao.asyncOp = False
    spans = ([(t.data_ptr(), 64) for t in xs], [(t.data_ptr(), 64) for t in ys])
    if d.fast(ao, *ys, *xs) is None:
        raise SystemExit("all_to_all's fast path does not apply here")
    a2a = [
        ("a2a: d.fast(opts, *outs, *ins)", host(lambda: d.fast(ao, *ys, *xs))),
        ("a2a: engine round (C)", host(lambda: sg.c.all_to_all(raw(idx), True, 0, *spans))),
        ("a2a: d.round(...) (token, round, Work)", host(lambda: d.round(
            sg, [y], sg.c.all_to_all, *spans))),
        ("a2a: the C fast path (FastPath.all_to_all)", host(lambda: d.all_to_all_c(y, x, ao))),
        ("a2a: d.all_to_all(...)", host(lambda: d.all_to_all((y, x), *spans, [y], ao))),
        ("a2a: be.alltoall_base(y, x, [], [], opts)", host(lambda: be.alltoall_base(y, x, [], [],
                                                                                     ao))),
        ("a2a: dist.all_to_all_single(y, x)", host(lambda: dist.all_to_all_single(y, x,
                                                                                  group=upg))),
    ]
    return a2a + [
        ("python: an empty call", host(lambda: None)),
        ("torch.cuda.current_stream()", host(lambda: torch.cuda.current_stream(idx))),
        ("_raw_stream(dev)", host(lambda: raw(idx))),
        ("be._d.fast + kernel_codes(opts, ...)", host(checks)),
        ("be._runner.inline(no-op)", host(lambda: be._runner.inline(lambda: 0))),
        ("StreamWork(...) made", host(lambda: _work.StreamWork(sg, 1, [t], raw(idx)))),
        ("StreamWork.wait()", host(w.wait)),
        ("engine allreduce (C)", host(lambda: sg.c.allreduce(raw(idx), True, 0, t.data_ptr(), 1,
                                                              *fast[1]))),
        ("be.allreduce([t], opts) + wait()", host(lambda: be.allreduce([t], opts).wait())),
        ("dist.all_reduce(t)", host(lambda: dist.all_reduce(t, group=upg))),
    ]


def c_path_ab(upg, dev, world: int, sizes, iters: int, warmup: int, rounds: int, sync):
    """[(op, bytes, us with the C call, us with the Python fast path)], the
    medians of rounds taken in turn (the C call switched off on the group's
    backend, which binds the dispatch's first row per group)."""
    be = upg._get_backend(dev)
    on = (be._fast_allreduce, be._fast_allgather)
    off = (lambda *a: None, lambda *a: None)
    rows = []
    try:
        for size in sizes:
            n = max(size // 4, 1)
            t = torch.randn(n, device=dev)
            out = torch.empty(world * n, device=dev)
            for op, fn in (("all_reduce", lambda: dist.all_reduce(t, group=upg)),
                           ("all_gather", lambda: dist.all_gather_into_tensor(out, t, group=upg))):
                got = ([], [])
                for _ in range(rounds):
                    for i, fns in enumerate((on, off)):
                        be._fast_allreduce, be._fast_allgather = fns
                        for _ in range(warmup):
                            fn()
                        sync()
                        dist.barrier()
                        got[i].append(loop_us(fn, iters, sync)[1])
                rows.append((op, size, statistics.median(got[0]), statistics.median(got[1])))
    finally:
        be._fast_allreduce, be._fast_allgather = on
    return rows


def slowest(rows: list[tuple], world: int) -> list[list[float]]:
    """Each row's figures (from its third on), the slowest rank's."""
    mine = torch.tensor([r[2:] for r in rows], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return torch.stack(every).amax(dim=0).tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="4,1M")
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--c-rounds", type=int, default=3, help="rounds of the C call against the "
                   "Python fast path (0: none)")
    p.add_argument("--pieces", action="store_true", help="also time the backend's fast path "
                   "piece by piece")
    args = p.parse_args()
    os.environ.setdefault("UCCL_SOCKET_IFNAME", "lo")

    idx = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(idx)
    dev = torch.device("cuda", idx)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    upg = dist.new_group(backend="uccl", timeout=timedelta(seconds=60))
    be = upg._get_backend(dev)
    sg = be._d.stream_group(idx)
    sync = torch.cuda.synchronize
    raw = _stream_group._raw_stream
    rows = []
    for size in parse_sizes(args.sizes):
        n = max(size // 4, 1)
        t = torch.randn(n, device=dev)
        out = torch.empty(world * n, device=dev)
        codes = sg.reduce_codes(t.dtype, _reduce.op_type(dist.ReduceOp.SUM))
        ptr, optr = t.data_ptr(), out.data_ptr()
        na = max(world, n - n % world)   # all_to_all: a chunk per rank
        a_in, a_out = torch.randn(na, device=dev), torch.empty(na, device=dev)
        c = na // world * 4

        def chunks(t):
            return [(t.data_ptr() + r * c, c) for r in range(world)]
        a2a_spans = (chunks(a_in), chunks(a_out))
        paths = {
            "all_reduce": (lambda: dist.all_reduce(t, group=upg),
                           lambda: sg.c.allreduce(raw(idx), True, 0, ptr, n, *codes)),
            "all_gather": (lambda: dist.all_gather_into_tensor(out, t, group=upg),
                           lambda: sg.c.allgather(raw(idx), True, 0, ptr, n * 4, optr)),
            "all_to_all": (lambda: dist.all_to_all_single(a_out, a_in, group=upg),
                           lambda: sg.c.all_to_all(raw(idx), True, 0, *a2a_spans)),
        }
        for op, (dfn, efn) in paths.items():
            res = {}
            for name, fn in (("dist", dfn), ("engine", efn)):
                for _ in range(args.warmup):
                    fn()
                sync()
                dist.barrier()
                res[name] = loop_us(fn, args.iters, sync)
            dist.barrier()
            res["span"] = span_us(dfn, min(args.iters, 300))
            rows.append((op, size, res["dist"][0], res["dist"][1], res["engine"][0],
                         res["engine"][1], res["span"]))
        dist.barrier()
        rows.append(("torch add_", size, *loop_us(lambda: t.add_(1), args.iters, sync),
                     float("nan"), float("nan"), span_us(lambda: t.add_(1), 100)))
    pieces = backend_pieces(be, sg, upg, dev, args.iters) if args.pieces else []
    ab = c_path_ab(upg, dev, world, parse_sizes(args.sizes), args.iters, args.warmup,
                   args.c_rounds, sync) if args.c_rounds else []
    if ab:
        ab = [r[:2] + tuple(w) for r, w in zip(ab, slowest(ab, world))]
    worst = slowest(rows, world)
    if rank == 0:
        print(f"[Rank 0] {world} ranks, {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
              f"UCCL_SG_FUSED_BYTES={os.environ.get('UCCL_SG_FUSED_BYTES', 'default')}, "
              f"{args.iters} calls, us per call (slowest rank)")
        print(f"{'op':<12} {'bytes':>8} {'dist issue':>11} {'dist total':>11} {'eng issue':>10} "
              f"{'eng total':>10} {'gpu span':>9}")
        for r, w in zip(rows, worst):
            print(f"{r[0]:<12} {r[1]:>8} " + " ".join(f"{v:>10.1f}" for v in w))
        if pieces:
            print("the backend's fast path for a 64-byte all_to_all_single and a 4-byte "
                  "all_reduce, piece by piece (rank 0, host us per call):")
        for name, us in pieces:
            print(f"  {name:<44} {us:8.2f}")
        if ab:
            print(f"dist total, us per call, median of {args.c_rounds} rounds each (slowest rank):")
            print(f"{'op':<12} {'bytes':>8} {'C call':>8} {'Python':>8}")
        for op, size, c_us, py_us in ab:
            print(f"{op:<12} {size:>8} {c_us:>8.1f} {py_us:>8.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
