"""Reductions for the "uccl" process group: the engine moves the bytes,
torch computes on the receiving rank (on the GPU for CUDA tensors: each
post then waits for the current stream's reductions, not the host).

all_reduce = reduce-scatter + allgather: each rank sends and receives
2(N-1)/N of the tensor.  Across hosts the reduce-scatter is a pipelined
ring: every step's chunk travels in pieces, and a piece is forwarded to the
next rank as soon as it has been reduced here, while the later pieces are
still in flight.  Within a host it is one direct exchange, also in pieces,
and each reduced piece is sent to every rank at once (the allgather fused
into the same pipeline).
Small tensors take one allgather of the whole tensor and a local reduction
instead (one round trip rather than 2(N-1)).

Every rank reduces a given chunk in the same order (the ring's), and the
owner's result is what the allgather hands out, so all ranks end bitwise
identical, as torch documents for all_reduce.
"""
from __future__ import annotations

import collections
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.distributed as dist

from .. import _engine
from ..core import config
from ..core.dispatch import HASH_IS_OP
from ..core.stream_group import stream_args

R = dist.ReduceOp.RedOpType
_REDUCE_OP = dist.ReduceOp
_SEND, _RECV = _engine.OP_SEND, _engine.OP_RECV


#: Tensors up to this many bytes are all-reduced by one allgather of the whole
#: tensor and a local reduction.
SMALL_BYTES = config.get("UCCL_PG_SMALL_KB")
#: Upper bound of a reduce-scatter piece.
PIECE_BYTES = max(config.get("UCCL_PG_PIECE_KB"), 64 << 10)
#: Reduce-scatter pieces in flight at once.
WINDOW = max(config.get("UCCL_PG_WINDOW"), 1)
#: Reduce-scatter algorithm: auto (all_reduce of CPU tensors on nodes alike:
#: by node; else the allgather's choice: direct within a host, the ring
#: across hosts with many ranks), ring, direct, or hier (by node where it
#: applies, else auto).
ALGO = config.get("UCCL_PG_ALGO")


def allgather_chunks(ctx, flat: torch.Tensor, chunk: list[tuple[int, int]]) -> None:
    """In place: every rank's flat[chunk[me]] to every rank (the allgather
    half of all_reduce), straight to the engine: the chunks are known to be
    views of one checked tensor."""
    esz, base = flat.element_size(), flat.data_ptr()
    bufs = [(base + s * esz, (e - s) * esz, 0) for s, e in chunk]
    ctx._cm().allgather(bufs[ctx.rank], bufs, _engine.AG_AUTO, False, ctx.timeout_s,
                        *stream_args((flat,)))


def reduce_scatter(ctx, flat: torch.Tensor, chunk: list[tuple[int, int]], combine: Callable,
                   scratch_of: Callable[[int], torch.Tensor], allgather: bool = False) -> None:
    """flat[chunk[me]] <- the reduction of that chunk over all ranks; with
    allgather, every chunk of flat (all_reduce)."""
    algo = ALGO
    # all_reduce of CPU tensors on nodes alike: by node (hier_allreduce; ahead
    # of the flat algorithms on two nodes of two ranks whether the link
    # between them is slow or not: docs/benchmarks.md)
    if allgather and algo in ("auto", "hier") and not flat.is_cuda:
        groups = node_groups(ctx)
        if groups is not None:
            hier_allreduce(ctx, flat, groups, combine, scratch_of)
            return
    if algo == "hier":   # not an all_reduce of CPU tensors, or nodes unlike: as auto
        algo = "auto"
    if algo == "auto":
        longest = max(e - s for s, e in chunk) * flat.element_size()
        ring = ctx._cm().pick_algo(_engine.AG_AUTO, longest) == _engine.AG_RING
        algo = "ring" if ring else "direct"
    if algo == "direct":
        direct_reduce_scatter(ctx, flat, chunk, combine, scratch_of, allgather)
        return
    ring_reduce_scatter(ctx, flat, chunk, combine, scratch_of)
    if allgather:
        allgather_chunks(ctx, flat, chunk)


class _Sub:
    """Some ranks of ctx (its global ranks, in one order on every member)
    as a group of their own for the algorithms here: its own size and
    rank, its posts sent to the global ranks.  The engine's connections are
    the whole group's; the sub-groups of one operation use disjoint pairs,
    or run one after the other, so the posts still match per connection."""

    def __init__(self, ctx, ranks: list[int]):
        self.ranks, self.world_size, self.rank = ranks, len(ranks), ranks.index(ctx.rank)
        self.timeout_s, self._real = ctx.timeout_s, ctx._cm()

    def _cm(self) -> "_Sub":
        return self

    def p2p(self, entries: list, *rest):
        return self._real.p2p([(op, self.ranks[r], buf) for op, r, buf in entries], *rest)

    def wait(self, op: int, timeout: float) -> None:
        self._real.wait(op, timeout)


def node_groups(ctx) -> list[list[int]] | None:
    """The ranks of each node in rank order (nodes ordered by their lowest
    rank) where the group spans 2 nodes or more, each with the same number
    of ranks, 2 or more; else None.  The same on every rank (every rank
    knows every rank's node)."""
    nodes = getattr(ctx, "nodes", None)
    if not nodes:
        return None
    groups: dict = {}
    for r, node in enumerate(nodes):
        groups.setdefault(node, []).append(r)
    sizes = {len(g) for g in groups.values()}
    if len(groups) < 2 or len(sizes) != 1 or sizes.pop() < 2:
        return None
    return list(groups.values())


def hier_allreduce(ctx, flat: torch.Tensor, groups: list[list[int]], combine: Callable,
                   scratch_of: Callable[[int], torch.Tensor]) -> None:
    """all_reduce of flat (contiguous, 1-D, CPU) by node: within each node a
    reduce-scatter (rank i of the node holds the node's sum of chunk i),
    across the nodes an all_reduce of chunk i among the ranks i of every
    node, then within each node an allgather of the chunks.  Between nodes
    each rank moves 2 (M-1)/M of its chunk (M nodes), 1/L of the tensor (L
    ranks a node): the network carries 2 (M-1)/M of the tensor per node
    where a ring over every rank carries 2 (N-1)/N of it over each link
    between nodes.  Every chunk's result is made by one rank and copied
    from it, so the ranks end bitwise alike (its reduction order is not
    the flat algorithms')."""
    me = ctx.rank
    mine = next(g for g in groups if me in g)
    li = mine.index(me)
    intra = _Sub(ctx, mine)
    chunk = bounds(flat.numel(), len(mine))
    direct_reduce_scatter(intra, flat, chunk, combine, scratch_of)
    a, b = chunk[li]
    if b > a:   # every node's rank li holds the same bounds
        part = flat[a:b]
        direct_reduce_scatter(_Sub(ctx, [g[li] for g in groups]), part,
                              bounds(b - a, len(groups)), combine, scratch_of, allgather=True)
    esz, base = flat.element_size(), flat.data_ptr()
    entries = [(_SEND, r, _span(base, esz, a, b)) for r in range(len(mine))
               if r != li and b > a]
    entries += [(_RECV, r, _span(base, esz, *chunk[r])) for r in range(len(mine))
                if r != li and chunk[r][1] > chunk[r][0]]
    _wait(intra, _post(intra, entries, stream_args((flat,))), ctx.timeout_s)


def op_type(op) -> R:
    """The RedOpType of a ReduceOp (or RedOpType)."""
    return op.op if hasattr(op, "op") else op


def check_op(op: R, dtype: torch.dtype, what: str) -> None:
    """Refuse what cannot be computed, before anything is posted."""
    if op == R.PREMUL_SUM:
        raise ValueError(f"{what}: ReduceOp.PREMUL_SUM is not supported by the uccl backend "
                         "(nor by Gloo); scale the tensor and use SUM")
    if op not in (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR):
        raise ValueError(f"{what}: unknown reduce op {op}")
    if op in (R.BAND, R.BOR, R.BXOR) and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{what}: ReduceOp.{op.name} needs an integer or bool tensor, got "
                         f"{dtype}")
    if op == R.AVG and dtype == torch.bool:
        raise ValueError(f"{what}: ReduceOp.AVG is not defined for bool tensors")
    if op in (R.MIN, R.MAX) and dtype.is_complex:
        raise ValueError(f"{what}: ReduceOp.{op.name} is not defined for complex {dtype}")


class Ops:
    """A group's operators, checked: check(opts, dtype, what) is the
    operator (a RedOpType) of opts.reduceOp (SUM without options), checked
    for dtype (a bad one raises each time), once per (operator, dtype),
    keyed as the dispatch keys its codes (hash(reduceOp)).  Its checks
    compare pybind enums (about 1 us each on the GPU machine's host: 12 us
    a CPU all_reduce, docs/benchmark-log.md, session 11)."""

    __slots__ = ("_checked",)

    def __init__(self):
        self._checked: dict = {}   # (hash(reduceOp), dtype) -> its RedOpType

    def check(self, opts, dtype: torch.dtype, what: str) -> R:
        ro = opts.reduceOp if opts is not None else None
        key = (hash(ro), dtype) if type(ro) is _REDUCE_OP and HASH_IS_OP else None
        op = self._checked.get(key) if key is not None else None
        if op is None:
            op = op_type(ro if ro is not None else R.SUM)
            check_op(op, dtype, what)
            if key is not None:
                self._checked[key] = op
        return op


def combiner(op: R, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """acc <- acc (op) x, in place."""
    boolean = dtype == torch.bool
    if op in (R.SUM, R.AVG):
        return torch.Tensor.logical_or_ if boolean else torch.Tensor.add_
    if op == R.PRODUCT:
        return torch.Tensor.logical_and_ if boolean else torch.Tensor.mul_
    if op == R.MIN:
        return lambda a, x: torch.minimum(a, x, out=a)
    if op == R.MAX:
        return lambda a, x: torch.maximum(a, x, out=a)
    return {R.BAND: torch.Tensor.bitwise_and_, R.BOR: torch.Tensor.bitwise_or_,
            R.BXOR: torch.Tensor.bitwise_xor_}[op]


class Parallel:
    """Splits one large elementwise reduction over `width` threads (torch
    releases the GIL inside the op): on a many-core host a single thread's
    add is what the reduce-scatter waits for.  width 1: inline."""

    MIN_BYTES = 1 << 20   # below this a thread hand-off costs more than it saves

    def __init__(self, width: int):
        self.width = max(1, width)
        self._pool = ThreadPoolExecutor(self.width - 1, thread_name_prefix="uccl-reduce") \
            if self.width > 1 else None

    def wrap(self, fn: Callable) -> Callable[[torch.Tensor, torch.Tensor], None]:
        if self._pool is None:
            return fn

        def run(acc: torch.Tensor, x: torch.Tensor) -> None:
            n = acc.numel()
            k = min(self.width, n * acc.element_size() // self.MIN_BYTES)
            if k <= 1:
                fn(acc, x)
                return
            step = (-(-n // k) + 63) // 64 * 64   # whole cache lines
            futs = [self._pool.submit(fn, acc[a:a + step], x[a:a + step])
                    for a in range(step, n, step)]
            fn(acc[:step], x[:step])
            for f in futs:
                f.result()
        return run

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def default_width(local_ranks: int) -> int:
    """Reduction threads per rank: UCCL_PG_REDUCE_THREADS, else this node's
    cores shared among its ranks (at most 8)."""
    explicit = config.get("UCCL_PG_REDUCE_THREADS")
    if explicit:
        return explicit
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // max(1, local_ranks)))


def finish_avg(t: torch.Tensor, n: int) -> None:
    """AVG = SUM / n (integers: truncated, as NCCL's ncclAvg; bool is
    refused up front by check_op)."""
    exact = t.dtype.is_floating_point or t.dtype.is_complex
    t.div_(n, rounding_mode=None if exact else "trunc")


def bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """Chunk r of a numel-element tensor split n ways (the first numel % n
    chunks one element longer): the same on every rank."""
    q, rem = divmod(numel, n)
    out, s = [], 0
    for r in range(n):
        e = s + q + (1 if r < rem else 0)
        out.append((s, e))
        s = e
    return out


def _pieces(b: tuple[int, int], piece: int) -> list[tuple[int, int]]:
    return [(a, min(a + piece, b[1])) for a in range(b[0], b[1], piece)]


def _piece_elems(longest: int, esz: int) -> int:
    """Elements per piece: at least 4 pieces in the longest chunk (so the
    transfers of later pieces overlap the reduction of earlier ones), but
    none under 1 MiB (each costs a round of posts: measured, 4 ranks on 2
    cores, 4 MiB all_reduce 3.7-4.0 ms in one piece per chunk, 5.6-6.7 ms
    in four; UCCL_PG_PIECE_KB can lower it) nor over PIECE_BYTES."""
    piece = max(1, min(PIECE_BYTES // esz, -(-longest // 4)))
    return max(piece, min(longest, min(1 << 20, PIECE_BYTES) // esz))


def _wait(cm, op: int | None, timeout: float) -> None:
    if op is not None:   # None: nothing was posted (empty pieces on both sides)
        cm.wait(op, timeout)


def _post(cm, entries: list, gpu: tuple[int, int]) -> int | None:
    """Post entries; on a GPU (gpu = stream_args) they go out once the
    current stream has done what is queued on it (the reductions whose
    results they send, or that read the scratch they receive into)."""
    return cm.p2p(entries, False, None, *gpu) if entries else None


def _span(base: int, esz: int, a: int, b: int) -> tuple[int, int, int]:
    """The engine buffer of elements [a, b) from base (registered per call)."""
    return base + a * esz, (b - a) * esz, 0


def _drain(cm, ops, timeout: float) -> None:
    """After an error: wait out what is still posted, so nothing lands in
    the caller's buffers once it has raised."""
    for op in ops:
        try:
            _wait(cm, op, timeout)
        except BaseException:
            pass


def ring_reduce_scatter(ctx, flat: torch.Tensor, chunk: list[tuple[int, int]],
                        combine: Callable, scratch_of: Callable[[int], torch.Tensor]) -> None:
    """After it, flat[chunk[me]] holds the reduction of that chunk over all
    ranks (other chunks hold partial sums).  flat: contiguous, 1-D.

    Step s (0..N-2): send chunk (me-s-1) to the right, receive chunk
    (me-s-2) from the left into scratch and reduce it into flat.
    scratch_of(nbytes) gives a reused uint8 buffer: a fresh one per call
    would page-fault on every byte the engine writes into it.  A piece
    reduced at step s is the piece sent at step s+1, so it is submitted
    right after its reduction: the pieces behind it stay in flight."""
    n, me, cm = ctx.world_size, ctx.rank, ctx._cm()
    if n == 1 or flat.numel() == 0:
        return
    right, left = (me + 1) % n, (me - 1) % n
    esz = flat.element_size()
    longest = max(e - s for s, e in chunk)
    piece = _piece_elems(longest, esz)
    scratch = scratch_of(2 * longest * esz).view(flat.dtype).view(2, longest)
    base = flat.data_ptr()
    sbase = [scratch[i].data_ptr() for i in range(2)]
    timeout = ctx.timeout_s
    gpu = stream_args((flat,))

    # pieces of what step s sends (chunk me-s-1) and receives (chunk me-s-2)
    send_pieces = [_pieces(chunk[(me - s - 1) % n], piece) for s in range(n - 1)]
    recv_pieces = [_pieces(chunk[(me - s - 2) % n], piece) for s in range(n - 1)]

    def submit(s: int, p: int) -> int | None:
        entries = []
        if p < len(send_pieces[s]):
            entries.append((_SEND, right, _span(base, esz, *send_pieces[s][p])))
        if p < len(recv_pieces[s]):
            a, b = recv_pieces[s][p]
            off = a - chunk[(me - s - 2) % n][0]
            entries.append((_RECV, left, _span(sbase[s % 2], esz, off, off + b - a)))
        return _post(cm, entries, gpu)

    # Every rank submits the (step, piece) operations in this one order, so
    # posts match on every connection; at most WINDOW are in flight (a deep
    # queue of small posts costs more per operation than it overlaps).
    seq = [(s, p) for s in range(n - 1)
           for p in range(max(len(send_pieces[s]), len(recv_pieces[s])))]
    reduced: set[tuple[int, int]] = set()

    def ready(s: int, p: int) -> bool:
        # what step s sends is what step s-1 received and reduced
        return s == 0 or p >= len(recv_pieces[s - 1]) or (s - 1, p) in reduced

    ops: dict[tuple[int, int], int | None] = {}
    k = 0
    try:
        for j, (s, p) in enumerate(seq):
            while k < len(seq) and k < j + WINDOW and ready(*seq[k]):
                ops[seq[k]] = submit(*seq[k])
                k += 1
            _wait(cm, ops.pop((s, p)), timeout)
            rp = recv_pieces[s]
            if p < len(rp):
                a, b = rp[p]
                off = a - chunk[(me - s - 2) % n][0]
                combine(flat[a:b], scratch[s % 2][off:off + b - a])
                reduced.add((s, p))
    finally:
        _drain(cm, ops.values(), timeout)


def direct_reduce_scatter(ctx, flat: torch.Tensor, chunk: list[tuple[int, int]],
                          combine: Callable, scratch_of: Callable[[int], torch.Tensor],
                          allgather: bool = False) -> None:
    """The same result as ring_reduce_scatter, in one exchange: every
    rank sends chunk r to rank r and receives its own chunk from all the
    others at once (N-1 copies in flight rather than one), piece by piece,
    reducing each piece as it lands.  Chosen within a host, where the copies
    run in parallel; the ring is for links between hosts.  Only the owner
    reduces a chunk (from its own values, then the others' in ring order),
    so ranks stay identical.

    allgather=True (all_reduce): each reduced piece goes out to every rank
    at once, while the later pieces are still being reduced, and every
    rank's pieces land in place.  A piece of chunk r is overwritten only
    after its reduce-scatter exchange completed (its send was pulled)."""
    n, me, cm = ctx.world_size, ctx.rank, ctx._cm()
    if n == 1 or flat.numel() == 0:
        return
    esz = flat.element_size()
    longest = max(e - s for s, e in chunk)
    piece = _piece_elems(longest, esz)
    mine = chunk[me]
    peers = [(me + i) % n for i in range(1, n)]          # slot i-1: rank me+i
    slot = max(1, mine[1] - mine[0])
    scratch = scratch_of((n - 1) * slot * esz).view(flat.dtype).view(n - 1, slot)
    sbase = [scratch[i].data_ptr() for i in range(n - 1)]
    base = flat.data_ptr()
    pieces = [_pieces(c, piece) for c in chunk]
    timeout = ctx.timeout_s
    gpu = stream_args((flat,))

    def submit(p: int) -> int | None:
        entries = [(_SEND, r, _span(base, esz, *pieces[r][p])) for r in peers
                   if p < len(pieces[r])]
        if p < len(pieces[me]):
            a, b = pieces[me][p]
            entries += [(_RECV, r, _span(sbase[i], esz, a - mine[0], b - mine[0]))
                        for i, r in enumerate(peers)]
        return _post(cm, entries, gpu)

    def submit_gather(p: int) -> int | None:
        entries = []
        if p < len(pieces[me]):   # this rank's reduced piece p to everyone
            entries += [(_SEND, r, _span(base, esz, *pieces[me][p])) for r in peers]
        entries += [(_RECV, r, _span(base, esz, *pieces[r][p])) for r in peers  # theirs, in place
                    if p < len(pieces[r])]
        return _post(cm, entries, gpu)

    # Every rank submits in this one order: RS(0..W-1), then per piece p:
    # [AG(p)], RS(p+W).  Posts match per connection.
    total = max(len(ps) for ps in pieces)
    ops: dict[int, int | None] = {}
    gathers: collections.deque = collections.deque()
    k = 0
    try:
        for p in range(total):
            while k < total and k < p + WINDOW:
                ops[k] = submit(k)
                k += 1
            _wait(cm, ops.pop(p), timeout)
            if p < len(pieces[me]):
                a, b = pieces[me][p]
                off = a - mine[0]
                for i in range(n - 1):
                    combine(flat[a:b], scratch[i][off:off + b - a])
            if allgather:
                gathers.append(submit_gather(p))
                while len(gathers) > WINDOW:
                    _wait(cm, gathers.popleft(), timeout)
        while gathers:
            _wait(cm, gathers.popleft(), timeout)
    finally:
        _drain(cm, list(ops.values()) + list(gathers), timeout)
