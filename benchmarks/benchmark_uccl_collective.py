"""Collective benchmark of uccl_collective.collective against torch.distributed.

Launch with torchrun, e.g.
    torchrun --nproc_per_node 4 benchmarks/benchmark_uccl_collective.py --op allgather \
        --sizes 1M,16M,64M --compare gloo --plot allgather.png

--op allgather: every rank contributes --sizes bytes (per rank); the comparison
    is all_gather_into_tensor (all_gather_single where torch renamed it).  As nccl-tests: algbw = world x size / time,
    busbw = algbw x (N-1)/N.
--op ring (or --ring): one ring step per iteration, each rank sends to the
    right and receives from the left (upstream's ring benchmark); the
    comparison is batch_isend_irecv of the same two operations.
--op sendrecv: ranks pair up (0-1, 2-3, ...); the even rank sends, or with
    --dual both send at once.
--backend uccl: the ops run as torch.distributed calls through the "uccl"
    process group (init_process_group("uccl")), timed against the same call on
    a Gloo group: --op allreduce|allgather|reduce_scatter|broadcast|alltoall.
    Sizes are the tensor's bytes (allgather: per rank; reduce_scatter: per
    rank's output).  busbw as nccl-tests: allreduce algbw x 2(N-1)/N,
    allgather/reduce_scatter/alltoall algbw x (N-1)/N, broadcast algbw.
Every size is checked end to end on random data before it is timed (uccl's
result against Gloo's on identical inputs in --backend uccl mode); each
timing is the slowest rank's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from bench_common import parse_sizes, pretty, write_results  # noqa: E402 (this folder is on sys.path)
from tqdm import tqdm

DEFAULT_SIZES = [1 << k for k in range(10, 27, 2)]  # 1K ... 64M per rank


def get_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--backend", choices=["context", "uccl"], default="context",
                   help="context: CollectiveContext calls; uccl: dist.* through the \"uccl\" "
                        "process group")
    p.add_argument("--op", choices=["allgather", "sendrecv", "ring", "allreduce",
                                    "reduce_scatter", "broadcast", "alltoall"],
                   default="allgather")
    p.add_argument("--ring", action="store_true", help="upstream's flag: same as --op ring")
    p.add_argument("--algorithm", choices=["auto", "direct", "ring"], default="auto",
                   help="allgather algorithm")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--sizes", type=parse_sizes, default=DEFAULT_SIZES,
                   help="comma-separated bytes per rank, e.g. 1K,64K,1M,16M")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per size "
                   "(default: 20 up to 16 MB, then 10)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--async-api", action="store_true",
                   help="iallgather/isend/irecv + wait instead of the blocking calls")
    p.add_argument("--dual", action="store_true", help="sendrecv: both ranks of a pair send")
    p.add_argument("--intra", choices=["engine", "torch"], default="engine",
                   help="same-host peers through this engine (use_copy_engine_for_intra=True, "
                        "the default here) or through torch.distributed (upstream's default)")
    p.add_argument("--compare", choices=["gloo", "nccl", "none"], default="gloo")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds, for every blocking call")
    p.add_argument("--json", metavar="FILE", help="write results as JSON (rank 0)")
    p.add_argument("--csv", metavar="FILE", help="write results as CSV (rank 0)")
    p.add_argument("--plot", metavar="FILE.png", help="PNG of busbw against size (rank 0)")
    args = p.parse_args()
    if args.ring:
        args.op = "ring"
    pg_ops = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall")
    if args.backend == "uccl" and args.op not in pg_ops:
        p.error(f"--backend uccl runs {', '.join(pg_ops)}")
    if args.backend == "context" and args.op not in ("allgather", "sendrecv", "ring"):
        p.error(f"--op {args.op} needs --backend uccl")
    if args.device == "gpu":
        p.error("--device gpu: the GPU transport lands with the CUDA IPC issue; CPU only for now")
    if args.compare == "nccl":
        p.error("--compare nccl needs --device gpu (not available yet); use --compare gloo")
    for s in args.sizes:
        if s % 4:
            p.error(f"size {s}: use multiples of 4 bytes (the data is float32)")
    return args


class Runner:
    """The timed operation for one size, through this engine or through Gloo."""

    def __init__(self, args, ctx, rank: int, world: int):
        self.args, self.ctx, self.rank, self.world = args, ctx, rank, world
        self.right, self.left = (rank + 1) % world, (rank - 1) % world
        self.partner = rank ^ 1

    def buffers(self, size: int):
        n = size // 4
        g = torch.Generator().manual_seed(1234 + self.rank)
        self.x = torch.rand(n, generator=g)
        self.y = torch.empty(n * self.world if self.args.op == "allgather" else n)

    def expected(self, size: int) -> torch.Tensor | None:
        n = size // 4

        def of(r):
            return torch.rand(n, generator=torch.Generator().manual_seed(1234 + r))
        if self.args.op == "allgather":
            return torch.cat([of(r) for r in range(self.world)])
        if self.args.op == "ring":
            return of(self.left)
        if self.partner >= self.world:
            return None
        if self.args.dual or self.rank % 2:
            return of(self.partner)
        return None

    def uccl(self) -> None:
        a, c = self.args, self.ctx
        if a.op == "allgather":
            if a.async_api:
                c.wait(c.iallgather(self.x, self.y, algorithm=a.algorithm))
            else:
                c.allgather(self.x, self.y, algorithm=a.algorithm)
        elif a.op == "ring":
            if a.async_api:
                c.wait_all([c.isend(self.x, self.right), c.irecv(self.y, self.left)])
            else:
                c.sendrecv(self.x, self.right, self.y, self.left)
        elif self.partner < self.world:
            sends = a.dual or self.rank % 2 == 0
            recvs = a.dual or self.rank % 2 == 1
            hs = ([c.isend(self.x, self.partner)] if sends else []) + \
                 ([c.irecv(self.y, self.partner)] if recvs else [])
            c.wait_all(hs)

    def gloo(self) -> None:
        a = self.args
        if a.op == "allgather":
            # torch 2.13 renames all_gather_into_tensor (and warns on the old name)
            ag = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
            ag(self.y, self.x)
        elif a.op == "ring":
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, self.x, self.right),
                                              dist.P2POp(dist.irecv, self.y, self.left)]):
                w.wait()
        elif self.partner < self.world:
            ops = []
            if a.dual or self.rank % 2 == 0:
                ops.append(dist.P2POp(dist.isend, self.x, self.partner))
            if a.dual or self.rank % 2 == 1:
                ops.append(dist.P2POp(dist.irecv, self.y, self.partner))
            for w in dist.batch_isend_irecv(ops):
                w.wait()

    def check(self, size: int, fn, who: str) -> None:
        self.y.fill_(float("nan"))  # poison
        fn()
        want = self.expected(size)
        if want is not None and not torch.equal(self.y, want):
            bad = (self.y != want).nonzero()
            raise SystemExit(f"[Rank {self.rank}] {who} {self.args.op} of {pretty(size)}: wrong "
                             f"data at {bad.numel()} elements (first {bad[:4].flatten().tolist()})")

    def verify(self, size: int) -> None:
        self.check(size, self.uccl, "uccl")
        if self.args.compare != "none":
            self.check(size, self.gloo, self.args.compare)


class GroupRunner:
    """--backend uccl: one torch.distributed call, through the "uccl" group
    (the default group) or through a Gloo group, on the same tensors."""

    def __init__(self, args, gloo_group, rank: int, world: int):
        self.args, self.gloo_group, self.rank, self.world = args, gloo_group, rank, world

    def buffers(self, size: int):
        n, w, op = size // 4, self.world, self.args.op
        n_in = n * w if op == "reduce_scatter" else n
        n_out = {"allgather": n * w, "reduce_scatter": n, "alltoall": n}.get(op, 0)
        g = torch.Generator().manual_seed(1234 + self.rank)
        # small integers: every summation order gives the same floats, so
        # uccl's result must equal Gloo's bit for bit
        self.x = torch.randint(0, 64, (n_in,), generator=g).float()
        self.y = torch.empty(n_out)

    def run(self, group) -> None:
        op, x, y = self.args.op, self.x, self.y
        if op == "allreduce":
            dist.all_reduce(x, group=group)
        elif op == "allgather":
            getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(y, x, group=group)
        elif op == "reduce_scatter":
            getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(y, x, group=group)
        elif op == "broadcast":
            dist.broadcast(x, 0, group=group)
        else:
            dist.all_to_all_single(y, x, group=group)

    def uccl(self) -> None:
        self.run(None)

    def gloo(self) -> None:
        self.run(self.gloo_group)

    def verify(self, size: int) -> None:
        x0 = self.x.clone()
        results = []
        for group in (None, self.gloo_group):
            self.x.copy_(x0)
            self.y.fill_(float("nan"))  # poison
            self.run(group)
            results.append((self.x.clone(), self.y.clone()))
        self.x.copy_(x0)
        for name, got, want in zip(("in/out tensor", "output"), results[0], results[1]):
            if not torch.equal(got, want):
                bad = (got != want).nonzero()
                raise SystemExit(f"[Rank {self.rank}] uccl {self.args.op} of {pretty(size)}: "
                                 f"{name} differs from Gloo's at {bad.numel()} elements (first "
                                 f"{bad[:4].flatten().tolist()})")


def timed(fn, iters: int, group=None) -> float:
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's time
    return float(dt) / iters


def bandwidths(op: str, size: int, world: int, seconds: float, dual: bool):
    """(algbw, busbw) in GB/s, as nccl-tests: an allgather's algbw counts the
    bytes each rank ends up with (world x size), its busbw the (N-1)/N of
    them that crossed a link."""
    if op == "allgather":
        algbw = size * world / seconds / 1e9
        return algbw, algbw * (world - 1) / world
    if op in ("reduce_scatter", "alltoall"):
        algbw = size * (world if op == "reduce_scatter" else 1) / seconds / 1e9
        return algbw, algbw * (world - 1) / world
    algbw = size / seconds / 1e9
    if op == "allreduce":
        return algbw, algbw * 2 * (world - 1) / world
    if op == "sendrecv" and dual:
        return algbw, algbw * 2  # both directions of each pair
    return algbw, algbw


def plot(rows, args, world: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["size"] for r in rows]
    ax.plot(xs, [r["uccl_busbw_GBps"] for r in rows], "o-", label="uccl_collective")
    if args.compare != "none":
        ax.plot(xs, [r[f"{args.compare}_busbw_GBps"] for r in rows], "s--", label=args.compare)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"{args.op}, {world} ranks, {args.device}, torch {torch.__version__}")
    ax.set_xticks(xs, [pretty(x) for x in xs], rotation=45)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


def setup(args):
    """(runner, group for the bookkeeping, header line, finalize)."""
    timeout = timedelta(seconds=args.timeout)
    if args.backend == "uccl":
        import uccl_collective  # noqa: F401  registers the backend
        t0 = time.perf_counter()
        dist.init_process_group("uccl", timeout=timeout)
        setup_s = time.perf_counter() - t0
        rank, world = dist.get_rank(), dist.get_world_size()
        gloo = dist.new_group(backend="gloo", timeout=timeout)
        ctx = dist.group.WORLD.context
        peers = sorted(set(ctx.transport_to(p) for p in range(world) if p != rank))
        head = (f"[Rank 0] dist.{args.op} through the uccl process group, {world} ranks, "
                f"peers via {'/'.join(peers)}, init_process_group {setup_s * 1e3:.1f} ms, "
                f"torch {torch.__version__}, compare gloo")
        return GroupRunner(args, gloo, rank, world), gloo, head, lambda: None
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    from uccl_collective import collective
    ctx = collective.init_collective(use_copy_engine_for_intra=args.intra == "engine",
                                     timeout_s=args.timeout)
    setup_s = torch.tensor([ctx.setup_seconds], dtype=torch.float64)
    dist.all_reduce(setup_s, op=dist.ReduceOp.MAX)
    peers = sorted(set(ctx.transport_to(p) for p in range(world) if p != rank))
    head = (f"[Rank 0] uccl {args.op} ({args.algorithm if args.op == 'allgather' else '-'}), "
            f"{world} ranks, peers via {'/'.join(peers)}, setup {setup_s.item() * 1e3:.1f} ms, "
            f"torch {torch.__version__}, compare {args.compare}")
    return Runner(args, ctx, rank, world), None, head, collective.finalize_collective


def main() -> None:
    args = get_args()
    os.environ.setdefault("UCCL_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # the ranks share the host's cores with the engine's threads
    if args.backend == "uccl" and args.compare == "none":
        args.compare = "gloo"   # the check compares with Gloo's result
    r, sync, head, finalize = setup(args)
    rank, world = r.rank, r.world
    if world < 2:
        raise SystemExit("run at least 2 processes (torchrun --nproc_per_node N)")
    lead = rank == 0

    def say(msg):
        if lead:
            tqdm.write(msg, file=sys.stdout)
            sys.stdout.flush()

    say(head)
    label = {"allgather": "Allgather", "ring": "Ring", "sendrecv": "SendRecv",
             "allreduce": "Allreduce", "reduce_scatter": "ReduceScatter",
             "broadcast": "Broadcast", "alltoall": "AllToAll"}[args.op]
    label += " Async" if args.async_api else ""
    rows = []
    for size in tqdm(args.sizes, desc="sizes", unit="size", leave=False,
                     disable=not lead or not sys.stderr.isatty()):
        iters = args.iters or (20 if size <= 16 << 20 else 10)
        r.buffers(size)
        r.verify(size)
        for _ in range(args.warmup):
            r.uccl()
        t = timed(r.uccl, iters, sync)
        algbw, busbw = bandwidths(args.op, size, world, t, args.dual)
        row = {"op": args.op, "backend": args.backend, "world": world, "size": size,
               "size_str": pretty(size), "iters": iters, "uccl_us": t * 1e6,
               "uccl_algbw_GBps": algbw, "uccl_busbw_GBps": busbw}
        say(f"[Rank 0] {label} {pretty(size)} : {algbw * 8:.2f} Gbps | {algbw:.2f} GB/s "
            f"(algbw), busbw {busbw:.2f} GB/s, {t * 1e6:.1f} us")
        if args.compare != "none":
            for _ in range(args.warmup):
                r.gloo()
            g = timed(r.gloo, iters, sync)
            galg, gbus = bandwidths(args.op, size, world, g, args.dual)
            row.update({f"{args.compare}_us": g * 1e6, f"{args.compare}_algbw_GBps": galg,
                        f"{args.compare}_busbw_GBps": gbus, "ratio": busbw / gbus})
            say(f"         {args.compare:>5} busbw {gbus:.2f} GB/s, {g * 1e6:.1f} us  "
                f"ratio {busbw / gbus:.2f}x")
        rows.append(row)
    if lead:
        write_results(rows, args)
        if args.plot:
            plot(rows, args, world)
            say(f"[Rank 0] plot written to {args.plot}")
    dist.barrier(group=sync)  # nobody closes its endpoint while a peer still transfers
    finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
