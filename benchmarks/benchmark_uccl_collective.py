"""Collective benchmark of uccl_collective.collective against torch.distributed.

Launch with torchrun, e.g.
    torchrun --nproc_per_node 4 benchmarks/benchmark_uccl_collective.py --op allgather \
        --sizes 1M,16M,64M --compare gloo --plot allgather.png
    torchrun --nproc_per_node 2 benchmarks/benchmark_uccl_collective.py --device gpu \
        --sizes 64K,16M,256M --compare ipc-copy

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
    a Gloo group: --op allreduce|allgather|reduce_scatter|broadcast|alltoall,
    and --op ring (batch_isend_irecv of a send to the right and a receive
    from the left, each Work waited for: on CUDA tensors the stream-ordered
    point to point, whose wait() does not block the host).
    Sizes are the tensor's bytes (allgather: per rank; reduce_scatter: per
    rank's output).  busbw as nccl-tests: allreduce algbw x 2(N-1)/N,
    allgather/reduce_scatter/alltoall algbw x (N-1)/N, broadcast algbw.
--device gpu: the tensors live on cuda:(LOCAL_RANK % device_count), so ranks
    share a GPU when there are fewer GPUs than ranks.  The data is made on the
    CPU with the same seeds as --device cpu, then moved.  Every timed loop
    starts and ends with torch.cuda.synchronize(): a time includes the work's
    completion on the GPU.
--compare, the reference timed in the same run on the same tensors:
  gloo      the same op on a Gloo group (the default).  With --device gpu,
            Gloo's CUDA forms that work on a shared GPU: all_reduce,
            broadcast, and for allgather the LIST all_gather into per-rank
            views of the output (never all_gather_into_tensor on CUDA
            tensors, which kills the process: "writev: Bad address").  The
            others (send/recv, reduce_scatter, alltoall) are host-staged:
            copied into pinned host buffers, run by Gloo there, copied back.
  nccl      the same op through an NCCL group (--device gpu only).  NCCL's
            2-rank communicator HANGS when the ranks share one GPU, so that
            is refused unless --nccl-shared-gpu; meant for multi-GPU hosts.
  ipc-copy  (--device gpu) the ceiling: only the cross-process copies the op
            needs, timed alone.  Every rank maps its peers' send buffers
            through CUDA IPC (torch.multiprocessing's reduce_tensor, handles
            exchanged through Gloo) and, after a barrier, all ranks copy at
            once: allgather, the N-1 peer chunks into the output (N(N-1)
            copies in all); ring (both modes), the left neighbour's chunk;
            sendrecv, the receiver's chunk.  --backend uccl: alltoall N-1 slices of size/N;
            broadcast, every non-root copies the root's tensor;
            reduce_scatter, N-1 slices of the output's size; allreduce,
            2(N-1) slices of size/N (the movement of reduce-scatter +
            allgather, without the arithmetic).  The target set for the
            allgather: uccl time <= 1.25x the copies' time at >= 16 MiB per rank.
            --ipc-own-copy adds to an allgather's copies the one of the
            rank's own chunk into the output, which an out-of-place
            allgather also makes: on one GPU shared by the ranks every copy
            draws on the same memory bandwidth, so that copy costs as much
            as a peer's (N/(N-1) of the cross-process copies' time).
  none      uccl alone.
"ratio" is uccl busbw / reference busbw (above 1: uccl is faster);
"time_ratio" is uccl time / reference time.
Every size is checked end to end on random data before it is timed (uccl's
result against Gloo's on identical inputs in --backend uccl mode; with
--device gpu, Gloo's result computed on CPU copies), outputs poisoned with
NaN before each check; the reference is checked the same way where its
result is the op's (ipc-copy of the context ops: the bytes it copied).
Each timing is the slowest rank's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from bench_common import parse_sizes, pretty, settle, timed, write_results  # noqa: E402 (this folder is on sys.path)
from tqdm import tqdm

DEFAULT_SIZES = [1 << k for k in range(10, 27, 2)]  # 1K ... 64M per rank
IPC_TARGET = 1.25          # ipc-copy: uccl time <= 1.25x the copies' time ...
IPC_TARGET_FROM = 16 << 20  # ... at >= 16 MiB per rank
NCCL_SHARED_NOTE = ("NCCL's 2-rank communicator hangs when the ranks share one GPU "
                    "(DESIGN.md section 3)")


def local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def get_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--backend", choices=["context", "uccl"], default="context",
                   help="context: CollectiveContext calls; uccl: dist.* through the \"uccl\" "
                        "process group")
    p.add_argument("--op", choices=["allgather", "sendrecv", "ring", "allreduce",
                                    "reduce_scatter", "broadcast", "alltoall", "all"],
                   default="allgather", help="all (--backend uccl): every op of the uccl "
                   "group in turn in one run, then one table of them all (--table)")
    p.add_argument("--table", metavar="FILE.md", help="the results as a Markdown table (rank 0)")
    p.add_argument("--ring", action="store_true", help="upstream's flag: same as --op ring")
    p.add_argument("--algorithm", choices=["auto", "direct", "ring"], default="auto",
                   help="allgather algorithm")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                   help="where the tensors live (gpu: cuda:(LOCAL_RANK %% device_count))")
    p.add_argument("--sizes", type=parse_sizes, default=DEFAULT_SIZES,
                   help="comma-separated bytes per rank, e.g. 1K,64K,1M,16M")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per size "
                   "(default: 20 up to 16 MB, then 10)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of --iters calls, uccl's "
                   "and the reference's in turn; each figure is the median, the spread "
                   "(fastest-slowest round) beside it (default 5)")
    p.add_argument("--async-api", action="store_true",
                   help="iallgather/isend/irecv + wait instead of the blocking calls")
    p.add_argument("--dual", action="store_true", help="sendrecv: both ranks of a pair send")
    p.add_argument("--intra", choices=["engine", "torch"], default="engine",
                   help="same-host peers through this engine (use_copy_engine_for_intra=True, "
                        "the default here) or through torch.distributed (upstream's default)")
    p.add_argument("--compare", choices=["gloo", "nccl", "ipc-copy", "none"], default="gloo",
                   help="the reference timed in the same run (see below)")
    p.add_argument("--ipc-own-copy", action="store_true",
                   help="ipc-copy of allgather (both modes): add the copy of this rank's own "
                        "chunk into the output, which an out-of-place allgather also makes "
                        "(the 1.25x target counts only the N(N-1) cross-process chunks)")
    p.add_argument("--in-place", action="store_true",
                   help="allgather of the context: the send tensor is this rank's own chunk of "
                        "the output (nccl-tests' in-place form): no copy of it is needed, and "
                        "ipc-copy's N(N-1) cross-process chunks are all the bytes that move")
    p.add_argument("--nccl-shared-gpu", action="store_true",
                   help="--compare nccl even when ranks share a GPU (where it hangs)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds, for every blocking call")
    p.add_argument("--json", metavar="FILE", help="write results as JSON (rank 0)")
    p.add_argument("--csv", metavar="FILE", help="write results as CSV (rank 0)")
    p.add_argument("--plot", metavar="FILE.png", help="PNG of busbw against size (rank 0)")
    args = p.parse_args()
    if args.ring:
        args.op = "ring"
    pg_ops = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "ring")
    if args.backend == "uccl" and args.op not in pg_ops + ("all",):
        p.error(f"--backend uccl runs {', '.join(pg_ops)}, or all of them (--op all)")
    if args.op == "all" and args.backend != "uccl":
        p.error("--op all needs --backend uccl")
    args.ops = list(pg_ops) if args.op == "all" else [args.op]
    args.op = args.ops[0]
    if args.rounds < 1:
        p.error(f"--rounds must be 1 or more, got {args.rounds}")
    if args.backend == "context" and args.op not in ("allgather", "sendrecv", "ring"):
        p.error(f"--op {args.op} needs --backend uccl")
    if args.device == "gpu" and not torch.cuda.is_available():
        p.error(f"--device gpu needs CUDA, and torch.cuda.is_available() is False here (torch "
                f"{torch.__version__}); run on a machine with a GPU, or use --device cpu")
    if args.compare == "nccl" and args.device != "gpu":
        p.error("--compare nccl needs --device gpu (NCCL moves CUDA tensors); "
                "use --compare gloo on CPU tensors")
    if args.in_place and (args.backend != "context" or args.op != "allgather"):
        p.error("--in-place is the context's allgather (--backend context --op allgather)")
    if args.compare == "ipc-copy" and args.device != "gpu":
        p.error("--compare ipc-copy needs --device gpu (it times CUDA IPC copies)")
    if args.compare == "nccl" and local_world() > torch.cuda.device_count() \
            and not args.nccl_shared_gpu:
        p.error(f"--compare nccl: {local_world()} ranks on {torch.cuda.device_count()} GPU(s) "
                f"share a GPU, and {NCCL_SHARED_NOTE}.  Use --compare ipc-copy or gloo here, "
                f"or add --nccl-shared-gpu to try anyway")
    for s in args.sizes:
        if s % 4:
            p.error(f"size {s}: use multiples of 4 bytes (the data is float32)")
    return args


def pick_device(args) -> torch.device:
    if args.device != "gpu":
        return torch.device("cpu")
    idx = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(idx)
    return torch.device("cuda", idx)


def mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if torch.equal(got, want):
        return None
    bad = (got != want).nonzero()
    return f"at {bad.numel()} elements (first {bad[:4].flatten().tolist()})"


def p2p_step(group, send=None, recv=None) -> None:
    """One dist.batch_isend_irecv of a send and a receive, each (tensor,
    peer) or None, every Work waited for."""
    ops = ([dist.P2POp(dist.isend, *send, group=group)] if send else []) + \
          ([dist.P2POp(dist.irecv, *recv, group=group)] if recv else [])
    for w in dist.batch_isend_irecv(ops):
        w.wait()


class IpcCopies:
    """The ipc-copy reference for one size: every rank maps the send buffer
    (x) of each peer its plan reads from, through CUDA IPC, and run() makes
    the plan's copies on the current stream.  plan: (peer, src_offset, n,
    dst) with dst a view of this rank's output or scratch memory."""

    def __init__(self, x: torch.Tensor, plan, group, world: int):
        from torch.multiprocessing.reductions import reduce_tensor
        self.group = group
        handles = [None] * world
        dist.all_gather_object(handles, reduce_tensor(x), group=group)
        me = dist.get_rank(group)
        remote = {}
        for peer in sorted({e[0] for e in plan}):
            if peer == me:   # this rank's own chunk (--ipc-own-copy): a local copy
                remote[peer] = x
                continue
            rebuild, rebuild_args = handles[peer]
            remote[peer] = rebuild(*rebuild_args)
        self.copies = [(dst, remote[peer][off:off + n]) for peer, off, n, dst in plan]
        torch.cuda.synchronize()
        dist.barrier(group=group)

    def run(self) -> None:
        for dst, src in self.copies:
            dst.copy_(src)

    def close(self) -> None:
        self.copies = []
        torch.cuda.synchronize()
        dist.barrier(group=self.group)  # every mapping is closed before its owner moves on


class _Bench:
    """What both modes share: the reference (--compare) and its ipc-copy plan."""

    def __init__(self, args, rank: int, world: int, dev: torch.device, obj_group, nccl_group):
        self.args, self.rank, self.world, self.dev = args, rank, world, dev
        self.gpu = dev.type == "cuda"
        self.obj_group, self.nccl_group = obj_group, nccl_group
        self.ipc: IpcCopies | None = None
        self.scratch = None
        self.right, self.left = (rank + 1) % world, (rank - 1) % world   # ring neighbours

    def ref_label(self) -> str:
        c = self.args.compare
        if c == "gloo" and self.gpu:
            return "gloo-" + self.gloo_cuda_form()
        return c

    def ref_open(self, size: int) -> None:
        if self.args.compare == "ipc-copy":
            plan, self.ipc_ranges = [], []
            for peer, off, n, where, dst_off in self.ipc_plan(size):
                buf = self.y if where == "y" else self.scratch
                plan.append((peer, off, n, buf[dst_off:dst_off + n]))
                if where == "y":   # what verify() can check against the op's result
                    self.ipc_ranges.append((dst_off, n))
            self.ipc = IpcCopies(self.x, plan, self.obj_group, self.world)

    def ref_close(self) -> None:
        if self.ipc is not None:
            self.ipc.close()
            self.ipc = None

    def ref(self) -> None:
        c = self.args.compare
        if c == "gloo":
            self.gloo()
        elif c == "nccl":
            self.nccl()
        elif c == "ipc-copy":
            self.ipc.run()


class Runner(_Bench):
    """The timed operation for one size, through this engine or the reference."""

    def __init__(self, args, ctx, rank: int, world: int, dev, obj_group=None, nccl_group=None):
        super().__init__(args, rank, world, dev, obj_group, nccl_group)
        self.ctx = ctx
        self.partner = rank ^ 1

    def gloo_cuda_form(self) -> str:
        return "list-allgather" if self.args.op == "allgather" else "host-staged"

    def buffers(self, size: int):
        n = size // 4
        g = torch.Generator().manual_seed(1234 + self.rank)
        self.x = torch.rand(n, generator=g).to(self.dev)
        self.y = torch.empty(n * self.world if self.args.op == "allgather" else n, device=self.dev)
        self.x_init = None
        if self.args.in_place and self.args.op == "allgather":
            self.x_init = self.x
            self.x = self.y[self.rank * n:(self.rank + 1) * n]
            self.x.copy_(self.x_init)
        self.y_views = list(self.y.chunk(self.world)) if self.args.op == "allgather" else None
        if self.gpu and self.args.compare == "gloo" and self.args.op != "allgather":
            # Gloo's send/recv take host memory: stage through pinned buffers
            self.xh = torch.empty(n, pin_memory=True)
            self.yh = torch.empty(n, pin_memory=True)

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

    def ipc_plan(self, size: int):
        """(peer, src offset, elements, "y", dst offset) of every copy this rank makes."""
        n, a = size // 4, self.args
        if a.op == "allgather":
            return [(p, 0, n, "y", p * n) for p in range(self.world)
                    if p != self.rank or a.ipc_own_copy]
        if a.op == "ring":
            return [(self.left, 0, n, "y", 0)]
        if self.partner < self.world and (a.dual or self.rank % 2):
            return [(self.partner, 0, n, "y", 0)]
        return []

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

    def _p2p(self, x, y, group) -> None:
        """The ring step or the pair's send/recv as batch_isend_irecv."""
        a = self.args
        if a.op == "ring":
            p2p_step(group, (x, self.right), (y, self.left))
        elif self.partner < self.world:
            p2p_step(group, (x, self.partner) if a.dual or self.rank % 2 == 0 else None,
                     (y, self.partner) if a.dual or self.rank % 2 == 1 else None)

    def gloo(self) -> None:
        a = self.args
        if a.op == "allgather":
            if self.gpu:
                # the list form: all_gather_into_tensor on CUDA tensors kills the process
                dist.all_gather(self.y_views, self.x)
            else:
                # torch 2.13 renames all_gather_into_tensor (and warns on the old name)
                ag = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
                ag(self.y, self.x)
        elif self.gpu:   # host-staged: Gloo's send/recv move host memory
            sends = a.op == "ring" or a.dual or self.rank % 2 == 0
            recvs = a.op == "ring" or a.dual or self.rank % 2 == 1
            if self.partner >= self.world and a.op != "ring":
                return
            if sends:
                self.xh.copy_(self.x)
            self._p2p(self.xh, self.yh, None)
            if recvs:
                self.y.copy_(self.yh)
        else:
            self._p2p(self.x, self.y, None)

    def nccl(self) -> None:
        if self.args.op == "allgather":
            ag = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
            ag(self.y, self.x, group=self.nccl_group)
        else:
            self._p2p(self.x, self.y, self.nccl_group)

    def check(self, size: int, fn, who: str, ranges=None) -> None:
        self.y.fill_(float("nan"))  # poison
        if self.x_init is not None:   # in place: the send tensor is a chunk of y
            self.x.copy_(self.x_init)
            settle(self.dev)   # every rank's x restored before anyone reads a peer's
            dist.barrier(group=self.obj_group)
        fn()
        settle(self.dev)
        want = self.expected(size)
        if want is None:
            return
        got = self.y.cpu()
        parts = [(0, got.numel())] if ranges is None else ranges
        for off, n in parts:
            bad = mismatch(got[off:off + n], want[off:off + n])
            if bad:
                raise SystemExit(f"[Rank {self.rank}] {who} {self.args.op} of {pretty(size)} "
                                 f"on {self.dev}: wrong data {bad}, elements {off}..{off + n}")

    def verify(self, size: int) -> None:
        self.check(size, self.uccl, "uccl")
        if self.args.compare == "ipc-copy":
            self.check(size, self.ref, "ipc-copy", self.ipc_ranges)
        elif self.args.compare != "none":
            self.check(size, self.ref, self.ref_label())


class GroupRunner(_Bench):
    """--backend uccl: one torch.distributed call, through the "uccl" group
    (the default group) or through a Gloo group, on the same tensors."""

    def __init__(self, args, gloo_group, rank: int, world: int, dev, nccl_group=None):
        super().__init__(args, rank, world, dev, gloo_group, nccl_group)
        self.gloo_group = gloo_group

    def gloo_cuda_form(self) -> str:
        op = self.args.op
        if op == "allgather":
            return "list-allgather"
        return "host-staged" if op in ("reduce_scatter", "alltoall", "ring") else "cuda"

    def sizes(self, size: int):
        n, w, op = size // 4, self.world, self.args.op
        if op == "alltoall":   # a chunk per rank: a multiple of the ranks, at least one each
            n = max(w, n - n % w)
        n_in = n * w if op == "reduce_scatter" else n
        n_out = {"allgather": n * w, "reduce_scatter": n, "alltoall": n, "ring": n}.get(op, 0)
        return n, n_in, n_out

    def buffers(self, size: int):
        n, n_in, n_out = self.sizes(size)
        g = torch.Generator().manual_seed(1234 + self.rank)
        # small integers: every summation order gives the same floats, so
        # uccl's result must equal Gloo's bit for bit
        self.x_init = torch.randint(0, 64, (n_in,), generator=g).float()
        self.x = self.x_init.to(self.dev, copy=True)
        self.y = torch.empty(n_out, device=self.dev)
        self.y_views = list(self.y.chunk(self.world)) if self.args.op == "allgather" else None
        self.staged = (self.gpu and self.args.compare == "gloo"
                       and self.gloo_cuda_form() == "host-staged")
        if self.staged:
            self.xh = torch.empty(n_in, pin_memory=True)
            self.yh = torch.empty(n_out, pin_memory=True)
        if self.gpu and self.args.compare == "ipc-copy":
            c = n // self.world
            need = {"reduce_scatter": (self.world - 1) * n, "broadcast": n,
                    "allreduce": 2 * (self.world - 1) * c}.get(self.args.op, 0)
            self.scratch = torch.empty(need, device=self.dev)

    def ipc_plan(self, size: int):
        """(peer, src offset, elements, "y"|"scratch", dst offset): the
        cross-process copies the op moves, without its arithmetic."""
        n, _, _ = self.sizes(size)
        w, r, op = self.world, self.rank, self.args.op
        peers = [p for p in range(w) if p != r]
        c = n // w
        if op == "allgather":
            return [(p, 0, n, "y", p * n) for p in (range(w) if self.args.ipc_own_copy else peers)]
        if op == "alltoall":
            return [(p, r * c, c, "y", p * c) for p in peers]
        if op == "ring":
            return [((r - 1) % w, 0, n, "y", 0)]
        if op == "reduce_scatter":
            return [(p, r * n, n, "scratch", k * n) for k, p in enumerate(peers)]
        if op == "broadcast":
            return [] if r == 0 else [(0, 0, n, "scratch", 0)]
        # allreduce: reduce-scatter phase (our slice of every peer), then
        # allgather phase (every peer's slice)
        return ([(p, r * c, c, "scratch", k * c) for k, p in enumerate(peers)] +
                [(p, p * c, c, "scratch", (w - 1 + k) * c) for k, p in enumerate(peers)])

    def run(self, group, x=None, y=None, list_allgather=False) -> None:
        op = self.args.op
        x = self.x if x is None else x
        y = self.y if y is None else y
        if op == "allreduce":
            dist.all_reduce(x, group=group)
        elif op == "allgather":
            if list_allgather:
                dist.all_gather(self.y_views, x, group=group)
            else:
                getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(y, x, group=group)
        elif op == "reduce_scatter":
            getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(y, x, group=group)
        elif op == "broadcast":
            dist.broadcast(x, 0, group=group)
        elif op == "ring":
            p2p_step(group, (x, self.right), (y, self.left))   # groups of every rank
        else:
            dist.all_to_all_single(y, x, group=group)

    def uccl(self) -> None:
        self.run(None)

    def gloo(self) -> None:
        if not self.gpu:
            self.run(self.gloo_group)
        elif self.staged:
            self.xh.copy_(self.x)
            self.run(self.gloo_group, self.xh, self.yh)
            self.y.copy_(self.yh)
        else:  # Gloo's CUDA forms that work on a shared GPU
            self.run(self.gloo_group, list_allgather=self.args.op == "allgather")

    def nccl(self) -> None:
        self.run(self.nccl_group)

    def _result(self, fn) -> tuple[torch.Tensor, torch.Tensor]:
        self.x.copy_(self.x_init)
        self.y.fill_(float("nan"))  # poison
        fn()
        settle(self.dev)
        return self.x.to("cpu", copy=True), self.y.to("cpu", copy=True)

    def verify(self, size: int) -> None:
        if self.gpu:
            # Gloo on CPU copies: the result the CUDA runs must match
            xc = self.x_init.clone()
            yc = torch.full((self.y.numel(),), float("nan"))
            self.run(self.gloo_group, xc, yc)
            want = (xc, yc)
        else:
            want = self._result(self.gloo)
        checks = [("uccl", self.uccl)]
        if self.gpu and self.args.compare in ("gloo", "nccl"):
            checks.append((self.ref_label(), self.ref))
        for who, fn in checks:
            got = self._result(fn)
            for name, g, w in zip(("in/out tensor", "output"), got, want):
                bad = mismatch(g, w)
                if bad:
                    raise SystemExit(f"[Rank {self.rank}] {who} {self.args.op} of {pretty(size)} "
                                     f"on {self.dev}: {name} differs from Gloo's "
                                     f"{'(on CPU copies) ' if self.gpu else ''}{bad}")
        self.x.copy_(self.x_init)


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


def _by_op(rows) -> dict:
    ops: dict = {}
    for r in rows:
        ops.setdefault(r["op"], []).append(r)
    return ops


def table(rows) -> str:
    """A Markdown table: one row per op, one column per size, each cell
    "uccl us / reference us (uccl's time over the reference's)", the
    ratio in bold where uccl is behind."""
    sizes = list(dict.fromkeys(r["size_str"] for r in rows))
    out = ["| op | " + " | ".join(sizes) + " |", "| --- |" + " --- |" * len(sizes)]
    for op, rs in _by_op(rows).items():
        cells = {r["size_str"]: r for r in rs}

        def cell(r):
            if r is None:
                return "-"
            if "ref_us" not in r:
                return f"{r['uccl_us']:.1f}"
            q = f"{r['time_ratio']:.2f}"
            q = f"**{q}**" if r["time_ratio"] > 1 else q
            return f"{r['uccl_us']:.1f} / {r['ref_us']:.1f} ({q})"
        out.append(f"| {op} | " + " | ".join(cell(cells.get(z)) for z in sizes) + " |")
    return "\n".join(out)


def plot(rows, args, world: int) -> None:
    """busbw against size: one panel per op, uccl and the reference."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops = _by_op(rows)
    cols = min(3, len(ops))
    nrows = (len(ops) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4 * nrows), squeeze=False)
    for ax in axes.flat[len(ops):]:
        ax.set_visible(False)
    for ax, (op, rs) in zip(axes.flat, ops.items()):
        xs = [r["size"] for r in rs]
        ax.plot(xs, [r["uccl_busbw_GBps"] for r in rs], "o-", label="uccl_collective")
        if args.compare != "none":
            ax.plot(xs, [r["ref_busbw_GBps"] for r in rs], "s--", label=rs[0]["ref"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{op}, {world} ranks")
        ax.set_xticks(xs, [pretty(x) for x in xs], rotation=45)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{args.device}, torch {torch.__version__}")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


def describe_device(dev: torch.device, world: int) -> str:
    if dev.type != "cuda":
        return "device cpu"
    n = torch.cuda.device_count()
    share = f", {local_world()} ranks share {n} GPU(s)" if local_world() > n else ""
    return f"device {dev} ({torch.cuda.get_device_name(dev)}{share})"


def setup(args, dev: torch.device):
    """(runner, group for the bookkeeping, header line, finalize)."""
    timeout = timedelta(seconds=args.timeout)
    if args.backend == "uccl":
        import uccl_collective  # noqa: F401  registers the backend
        t0 = time.perf_counter()
        dist.init_process_group("uccl", timeout=timeout)
        setup_s = time.perf_counter() - t0
        rank, world = dist.get_rank(), dist.get_world_size()
        gloo = dist.new_group(backend="gloo", timeout=timeout)
        nccl = dist.new_group(backend="nccl", timeout=timeout) if args.compare == "nccl" else None
        r = GroupRunner(args, gloo, rank, world, dev, nccl)
        ctx = dist.group.WORLD.context
        peers = sorted(set(ctx.transport_to(p) for p in range(world) if p != rank))
        head = (f"[Rank 0] dist.{'/'.join(args.ops)} through the uccl process group, "
                f"{world} ranks, "
                f"peers via {'/'.join(peers)}, init_process_group {setup_s * 1e3:.1f} ms, "
                f"torch {torch.__version__}, {describe_device(dev, world)}, "
                f"compare {r.ref_label()}")
        return r, gloo, head, lambda: None
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    nccl = dist.new_group(backend="nccl", timeout=timeout) if args.compare == "nccl" else None
    from uccl_collective import collective
    kw = {"local_gpu_idx": dev.index} if dev.type == "cuda" else {}
    ctx = collective.init_collective(use_copy_engine_for_intra=args.intra == "engine",
                                     timeout_s=args.timeout, **kw)
    setup_s = torch.tensor([ctx.setup_seconds], dtype=torch.float64)
    dist.all_reduce(setup_s, op=dist.ReduceOp.MAX)
    peers = sorted(set(ctx.transport_to(p) for p in range(world) if p != rank))
    r = Runner(args, ctx, rank, world, dev, None, nccl)
    head = (f"[Rank 0] uccl {args.op} ({args.algorithm if args.op == 'allgather' else '-'}), "
            f"{world} ranks, peers via {'/'.join(peers)}, setup {setup_s.item() * 1e3:.1f} ms, "
            f"torch {torch.__version__}, {describe_device(dev, world)}, compare {r.ref_label()}")
    return r, None, head, collective.finalize_collective


def run_op(r, args, sync, dev, say, lead: bool) -> list[dict]:
    """Every size of args.op through r (a runner for that op): verified,
    then --rounds rounds timed against the reference; its rows."""
    world = r.world
    label = {"allgather": "Allgather", "ring": "Ring", "sendrecv": "SendRecv",
             "allreduce": "Allreduce", "reduce_scatter": "ReduceScatter",
             "broadcast": "Broadcast", "alltoall": "AllToAll"}[args.op]
    label += " Async" if args.async_api else ""
    ref_name = r.ref_label()
    key = args.compare.replace("-", "_")
    rows = []
    for size in tqdm(args.sizes, desc="sizes", unit="size", leave=False,
                     disable=not lead or not sys.stderr.isatty()):
        iters = args.iters or (20 if size <= 16 << 20 else 10)
        r.buffers(size)
        r.ref_open(size)
        r.verify(size)
        # --rounds rounds of iters calls, uccl's and the reference's taken in
        # turn (a drift of the machine's pace touches both); the medians
        ref = args.compare != "none"
        for fn in (r.uccl, r.ref) if ref else (r.uccl,):
            for _ in range(args.warmup):
                fn()
        ts, gs = [], []
        for _ in range(args.rounds):
            ts.append(timed(r.uccl, iters, sync, dev))
            if ref:
                gs.append(timed(r.ref, iters, sync, dev))
        t = statistics.median(ts)
        algbw, busbw = bandwidths(args.op, size, world, t, args.dual)
        row = {"op": args.op, "backend": args.backend, "device": args.device, "world": world,
               "size": size, "size_str": pretty(size), "iters": iters, "rounds": args.rounds,
               "uccl_us": t * 1e6, "uccl_us_min": min(ts) * 1e6, "uccl_us_max": max(ts) * 1e6,
               "uccl_algbw_GBps": algbw, "uccl_busbw_GBps": busbw}
        say(f"[Rank 0] {label} {pretty(size)} : {algbw * 8:.2f} Gbps | {algbw:.2f} GB/s "
            f"(algbw), busbw {busbw:.2f} GB/s, {t * 1e6:.1f} us "
            f"({min(ts) * 1e6:.1f}-{max(ts) * 1e6:.1f})")
        if ref:
            g = statistics.median(gs)
            galg, gbus = bandwidths(args.op, size, world, g, args.dual)
            row.update({"ref": ref_name, "ref_us": g * 1e6, "ref_us_min": min(gs) * 1e6,
                        "ref_us_max": max(gs) * 1e6, "ref_algbw_GBps": galg,
                        "ref_busbw_GBps": gbus,
                        f"{key}_us": g * 1e6, f"{key}_algbw_GBps": galg,
                        f"{key}_busbw_GBps": gbus, "ratio": busbw / gbus, "time_ratio": t / g})
            verdict = ""
            if args.compare == "ipc-copy" and size >= IPC_TARGET_FROM:
                met = t / g <= IPC_TARGET
                row.update(target_time_ratio=IPC_TARGET, target_met=met)
                verdict = f", target <= {IPC_TARGET:.2f}x: {'met' if met else 'missed'}"
            say(f"         {ref_name:>5} busbw {gbus:.2f} GB/s, {g * 1e6:.1f} us "
                f"({min(gs) * 1e6:.1f}-{max(gs) * 1e6:.1f})  "
                f"ratio {busbw / gbus:.2f}x (time uccl/{args.compare} {t / g:.2f}x{verdict})")
        r.ref_close()
        rows.append(row)
    return rows


def main() -> None:
    args = get_args()
    os.environ.setdefault("UCCL_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # the ranks share the host's cores with the engine's threads
    if args.backend == "uccl" and args.compare == "none" and args.device == "cpu":
        args.compare = "gloo"   # the check compares with Gloo's result
    dev = pick_device(args)
    r, sync, head, finalize = setup(args, dev)
    rank, world = r.rank, r.world
    if world < 2:
        raise SystemExit("run at least 2 processes (torchrun --nproc_per_node N)")
    lead = rank == 0

    def say(msg):
        if lead:
            tqdm.write(msg, file=sys.stdout)
            sys.stdout.flush()

    say(head)
    if args.compare == "nccl":
        say(f"[Rank 0] note: {NCCL_SHARED_NOTE}; --compare nccl is for hosts with a GPU per rank")
    rows = []
    for i, op in enumerate(args.ops):
        if i:   # the next op on the same groups (the runner reads args.op)
            args.op = op
            r = type(r)(args, r.obj_group, rank, world, dev, r.nccl_group)
        rows += run_op(r, args, sync, dev, say, lead)
    if lead:
        write_results(rows, args)
        if len(args.ops) > 1 or args.table:
            say(table(rows))
        if args.table:
            with open(args.table, "w") as f:
                f.write(table(rows) + "\n")
        if args.plot:
            try:
                plot(rows, args, world)
                say(f"[Rank 0] plot written to {args.plot}")
            except ImportError as e:   # the results above stand; only the picture is missing
                say(f"[Rank 0] no plot: {e}")
    dist.barrier(group=sync)  # nobody closes its endpoint while a peer still transfers
    finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
