"""Per-call overhead of the smallest collectives: a 4-byte allgather and a
4-byte all_reduce, through uccl_collective and through Gloo in the same run.

    torchrun --nproc_per_node 2 benchmarks/overhead.py [--device gpu] \
        [--iters 2000] [--profile prof.txt] [--json overhead.json]

Paths, each timed call by call (--iters after --warmup), in --rounds rounds
that take turns, so that a slow spell of the machine hits every path alike:
  uccl ctx.allgather                 CollectiveContext.allgather (use_copy_engine_for_intra=True)
  uccl dist.all_gather_into_tensor   through the "uccl" process group
  uccl dist.all_reduce               through the "uccl" process group
  gloo dist.all_gather_into_tensor   CPU tensors (on CUDA tensors: the LIST
                                     dist.all_gather into per-rank views, since
                                     Gloo's all_gather_into_tensor kills the
                                     process there)
  gloo dist.all_reduce
CPU tensors always; CUDA tensors too with --device gpu (cuda:(LOCAL_RANK %
device_count)), where every timed call ends with the current stream's
synchronize, so the time includes the completion on the GPU (the cost of a
synchronize on an idle stream is printed too).  Each figure is the slowest
rank's p50 / mean / p90 in microseconds; "uccl/gloo" is uccl's p50 / Gloo's p50
for the same op.  --profile FILE: afterwards rank 0 runs each uccl path again
under cProfile (--profile-iters calls; the other ranks run them unprofiled)
and writes the top 25 functions by cumulative time, one section per path.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def get_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                   help="gpu: CUDA tensors as well as CPU tensors")
    p.add_argument("--iters", type=int, default=2000, help="timed calls per path")
    p.add_argument("--warmup", type=int, default=200, help="untimed calls per path first")
    p.add_argument("--rounds", type=int, default=4, help="the paths take turns this many times")
    p.add_argument("--profile", metavar="FILE", help="cProfile the uccl paths on rank 0 into FILE")
    p.add_argument("--profile-iters", type=int, default=1000)
    p.add_argument("--pipelined", type=int, default=0, metavar="N",
                   help="also time N calls back to back per CUDA path, one synchronize at "
                        "the end (as nccl-tests): host time to issue them, and in all, per call")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON (rank 0)")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args()
    if args.device == "gpu" and not torch.cuda.is_available():
        p.error(f"--device gpu needs CUDA, and torch.cuda.is_available() is False here (torch "
                f"{torch.__version__}); run on a machine with a GPU, or leave --device cpu")
    if args.iters < 1 or args.rounds < 1:
        p.error("--iters and --rounds must be >= 1")
    return args


class Path:
    """One timed call: name, op (for the Gloo ratio), fn, and whether it is ours."""

    def __init__(self, device: str, impl: str, what: str, op: str, fn):
        self.device, self.impl, self.what, self.op, self.fn = device, impl, what, op, fn
        self.name = f"{impl} {what}"
        self.times: list[float] = []


def make_paths(dev: torch.device, ctx, uccl_pg, gloo_pg, world: int, rank: int) -> list[Path]:
    """The five paths on `dev`, each checked once before it is timed."""
    cuda = dev.type == "cuda"
    # allgather: 1 float32 per rank; all_reduce: zeros (so that 2000 in-place
    # sums stay finite)
    x = torch.full((1,), float(rank + 1), device=dev)
    out = torch.empty(world, device=dev)
    views = list(out.chunk(world))
    z = torch.zeros(1, device=dev)
    ag = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    want_ag = torch.arange(1, world + 1, dtype=torch.float32)
    kind = "cuda" if cuda else "cpu"

    def gloo_ag():
        if cuda:   # all_gather_into_tensor on CUDA tensors kills the process
            dist.all_gather(views, x, group=gloo_pg)
        else:
            ag(out, x, group=gloo_pg)

    paths = [
        Path(kind, "uccl", "ctx.allgather", "allgather", lambda: ctx.allgather(x, out)),
        Path(kind, "uccl", "dist.all_gather_into_tensor", "allgather",
             lambda: ag(out, x, group=uccl_pg)),
        Path(kind, "uccl", "dist.all_reduce", "all_reduce",
             lambda: dist.all_reduce(z, group=uccl_pg)),
        Path(kind, "gloo", "dist.all_gather" if cuda else "dist.all_gather_into_tensor",
             "allgather", gloo_ag),
        Path(kind, "gloo", "dist.all_reduce", "all_reduce",
             lambda: dist.all_reduce(z, group=gloo_pg)),
    ]
    for p in paths:   # each path's result, once
        out.fill_(float("nan"))
        z.fill_(float(rank + 1))
        p.fn()
        if cuda:
            torch.cuda.synchronize(dev)
        if p.op == "allgather":
            got, want = out.cpu(), want_ag
        else:
            got, want = z.cpu(), torch.tensor([world * (world + 1) / 2])
        if not torch.equal(got, want):
            raise SystemExit(f"[Rank {rank}] {p.name} on {kind}: got {got.tolist()}, "
                             f"want {want.tolist()}")
    z.zero_()
    return paths


def run_calls(p: Path, n: int, dev: torch.device, record: bool) -> None:
    fn, clock = p.fn, time.perf_counter
    if dev.type == "cuda":
        stream = torch.cuda.current_stream(dev)
        for _ in range(n):
            t0 = clock()
            fn()
            stream.synchronize()
            if record:
                p.times.append(clock() - t0)
    else:
        for _ in range(n):
            t0 = clock()
            fn()
            if record:
                p.times.append(clock() - t0)


def pipelined_us(p: Path, n: int, dev: torch.device, gloo_pg) -> tuple[float, float]:
    """(issue, total) microseconds per call over n calls queued back to
    back and one synchronize at the end, every rank starting together."""
    stream = torch.cuda.current_stream(dev)
    stream.synchronize()
    dist.barrier(group=gloo_pg)
    fn, clock = p.fn, time.perf_counter
    t0 = clock()
    for _ in range(n):
        fn()
    t1 = clock()
    stream.synchronize()
    t2 = clock()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def idle_sync_us(dev: torch.device, n: int) -> float:
    stream, ts = torch.cuda.current_stream(dev), []
    for _ in range(n):
        t0 = time.perf_counter()
        stream.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def stats_us(times: list[float]) -> tuple[float, float, float]:
    s = sorted(times)
    return (statistics.median(s) * 1e6, statistics.fmean(s) * 1e6,
            s[min(len(s) - 1, int(0.9 * len(s)))] * 1e6)


def profile(paths: list[Path], dev: torch.device, n: int, lead: bool, gloo_pg) -> str:
    """Each uccl path again, under cProfile on rank 0: its top 25 by
    cumulative time, then by own time."""
    text = []
    for p in paths:
        if p.impl != "uccl":
            continue
        dist.barrier(group=gloo_pg)
        prof = cProfile.Profile() if lead else None
        if prof:
            prof.enable()
        run_calls(p, n, dev, record=False)
        if prof:
            prof.disable()
            buf = io.StringIO()
            st = pstats.Stats(prof, stream=buf)
            st.sort_stats("cumulative").print_stats(25)
            st.sort_stats("tottime").print_stats(25)
            text.append(f"===== {p.name} on {p.device}, {n} calls (rank 0, cProfile) =====\n"
                        + buf.getvalue())
    return "\n".join(text)


def main() -> None:
    args = get_args()
    os.environ.setdefault("UCCL_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    devs = [torch.device("cpu")]
    if args.device == "gpu":
        idx = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(idx)
        devs.append(torch.device("cuda", idx))
    import uccl_collective  # noqa: F401  registers the "uccl" backend
    from uccl_collective.collective import CollectiveContext

    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise SystemExit("run at least 2 processes (torchrun --nproc_per_node N)")
    lead = rank == 0
    gloo_pg = dist.group.WORLD
    uccl_pg = dist.new_group(backend="uccl", timeout=timeout)
    kw = {"local_gpu_idx": devs[-1].index} if len(devs) > 1 else {}
    ctx = CollectiveContext(use_copy_engine_for_intra=True, timeout_s=args.timeout, **kw).init()
    peers = sorted({ctx.transport_to(p) for p in range(world) if p != rank})

    def say(msg: str) -> None:
        if lead:
            print(msg, flush=True)

    gpu_note = ""
    if len(devs) > 1:
        gpu_note = f", {devs[1]} ({torch.cuda.get_device_name(devs[1])})"
    say(f"[Rank 0] per-call overhead, 4 B per rank, {world} ranks, peers via {'/'.join(peers)}, "
        f"{args.iters} calls per path after {args.warmup} warmup, {args.rounds} rounds, "
        f"torch {torch.__version__}{gpu_note}")
    all_paths, sync_us = [], None
    pipe: dict[str, tuple[float, float]] = {}
    for dev in devs:
        paths = make_paths(dev, ctx, uccl_pg, gloo_pg, world, rank)
        for p in paths:
            dist.barrier(group=gloo_pg)
            run_calls(p, args.warmup, dev, record=False)
        per_round = -(-args.iters // args.rounds)
        for rnd in range(args.rounds):
            n = min(per_round, args.iters - rnd * per_round)
            for p in paths:
                dist.barrier(group=gloo_pg)
                run_calls(p, n, dev, record=True)
        if dev.type == "cuda":
            sync_us = idle_sync_us(dev, 1000)
            if args.pipelined:
                for p in paths:
                    pipe[p.name] = pipelined_us(p, args.pipelined, dev, gloo_pg)
        all_paths += [(dev, p) for p in paths]

    # every rank's stats; the figure is the slowest rank's
    mine = torch.tensor([stats_us(p.times) for _, p in all_paths], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=gloo_pg)
    worst = torch.stack(every).amax(dim=0)
    rows = []
    for i, (_, p) in enumerate(all_paths):
        p50, mean, p90 = worst[i].tolist()
        rows.append({"device": p.device, "impl": p.impl, "path": p.name, "op": p.op,
                     "iters": len(p.times), "p50_us": p50, "mean_us": mean, "p90_us": p90,
                     "rank_p50_us": [e[i][0].item() for e in every]})
    gloo_p50 = {(r["device"], r["op"]): r["p50_us"] for r in rows if r["impl"] == "gloo"}
    for r in rows:
        if r["impl"] == "uccl":
            r["x_gloo_p50"] = r["p50_us"] / gloo_p50[(r["device"], r["op"])]
    say(f"{'device':<6} {'path':<34} {'p50 us':>9} {'mean us':>9} {'p90 us':>9}  uccl/gloo (p50)")
    for r in rows:
        ratio = f"{r['x_gloo_p50']:.2f}x" if "x_gloo_p50" in r else "-"
        say(f"{r['device']:<6} {r['path']:<34} {r['p50_us']:9.1f} {r['mean_us']:9.1f} "
            f"{r['p90_us']:9.1f}  {ratio}")
    if sync_us is not None:
        say(f"(cuda: each call above includes a stream synchronize; one on an idle stream "
            f"takes {sync_us:.1f} us p50 on rank 0)")

    if pipe:
        names = list(pipe)
        mine = torch.tensor([pipe[k] for k in names], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine, group=gloo_pg)
        worst = torch.stack(every).amax(dim=0)
        say(f"cuda, {args.pipelined} calls back to back, one synchronize at the end "
            f"(slowest rank), us per call:")
        say(f"  {'path':<34} {'issue':>9} {'total':>9}")
        for i, k in enumerate(names):
            say(f"  {k:<34} {worst[i][0]:9.1f} {worst[i][1]:9.1f}")
            for r in rows:
                if r["device"] == "cuda" and r["path"] == k:
                    r["pipelined_issue_us"], r["pipelined_total_us"] = worst[i].tolist()

    if args.profile:
        text = []
        for dev in devs:
            paths = make_paths(dev, ctx, uccl_pg, gloo_pg, world, rank)
            text.append(profile(paths, dev, args.profile_iters, lead, gloo_pg))
        if lead:
            with open(args.profile, "w") as f:
                f.write("\n".join(text))
            say(f"[Rank 0] profile written to {args.profile}")
    if lead and args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "world": world,
                       "peers": peers, "idle_sync_us": sync_us, "results": rows}, f, indent=2)
    dist.barrier(group=gloo_pg)
    ctx.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
