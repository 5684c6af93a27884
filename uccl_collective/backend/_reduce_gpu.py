"""Reductions of the "uccl" process group on CUDA tensors.

A task on CUDA tensors runs on the group's stream (backend._on_gpu): every
engine operation starts once that stream has reached it (its mark), and
torch computes the reduction there.  A reduction is a short fixed sequence:
exchange, one reduction kernel, exchange.

all_reduce: up to GPU_SMALL_BYTES, one allgather of the whole tensor and a
reduction of the n rows (one round of copies); above, a direct
reduce-scatter (rank r receives chunk r from every rank, n-1 copies in
flight, and reduces the n rows in one kernel) then an allgather of the
reduced chunks in place: each rank moves 2(n-1)/n of the tensor.  Only the
owner of a chunk reduces it, from the rows in rank order, and the others
receive its result, so every rank ends bitwise identical.

A chunk moves in one piece, unlike the CPU path's pipeline (_reduce.py):
each piece costs a round of posts and waits (tens of microseconds on a
GPU), and on one GPU shared by the ranks the copies and the reduction
compete for the same memory bandwidth, so pieces would overlap nothing.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..core import config
from ._reduce import allgather_chunks, bounds, finish_avg, node_groups

R = dist.ReduceOp.RedOpType

#: CUDA tensors up to this many bytes are all-reduced by one allgather of the
#: whole tensor and a local reduction.
GPU_SMALL_BYTES = config.get("UCCL_PG_GPU_SMALL_KB")

_BITWISE = {R.BAND: torch.Tensor.bitwise_and_, R.BOR: torch.Tensor.bitwise_or_,
            R.BXOR: torch.Tensor.bitwise_xor_}


def reduce_rows(rows: torch.Tensor, out: torch.Tensor, op: R) -> None:
    """out (1-D, rows.shape[1] elements) <- rows[0] op rows[1] op ... (rows:
    contiguous, one per rank in rank order), one kernel where torch has
    one.  AVG is SUM here (finish_avg divides)."""
    dtype = rows.dtype
    if op in (R.SUM, R.AVG):
        if dtype == torch.bool:
            torch.any(rows, 0, out=out)
        else:
            torch.sum(rows, 0, dtype=dtype, out=out)
    elif op == R.PRODUCT:
        if dtype == torch.bool:
            torch.all(rows, 0, out=out)
        else:
            torch.prod(rows, 0, dtype=dtype, out=out)
    elif op == R.MIN:
        torch.amin(rows, 0, out=out)
    elif op == R.MAX:
        torch.amax(rows, 0, out=out)
    else:
        fn = _BITWISE[op]
        out.copy_(rows[0])
        for r in range(1, rows.shape[0]):
            fn(out, rows[r])


def _exchange_chunks(ctx, src: torch.Tensor, chunk: list[tuple[int, int]],
                     rows: torch.Tensor, what: str) -> None:
    """Rank r's rows[r] <- every rank's src[chunk[me]] (rows[me] copied
    here): the reduce-scatter exchange, one enqueued batch."""
    me, n = ctx.rank, ctx.world_size
    a, b = chunk[me]
    rows[me].copy_(src[a:b])
    entries = [("send", src[s:e], r) for r, (s, e) in enumerate(chunk) if r != me]
    entries += [("recv", rows[r], r) for r in range(n) if r != me]
    ctx._p2p(entries, what, blocking=True)


def allreduce(ctx, flat: torch.Tensor, op: R, scratch: Callable[[int], torch.Tensor],
              what: str = "all_reduce") -> None:
    """flat (contiguous, 1-D, on the current stream's device) <- its
    reduction over the group, enqueued on the current stream."""
    n, me = ctx.world_size, ctx.rank
    numel, esz = flat.numel(), flat.element_size()
    groups = node_groups(ctx) if numel * esz > GPU_SMALL_BYTES else None
    if groups is not None and config.get("UCCL_PG_ALGO") in ("auto", "hier"):
        _by_node(ctx, flat, groups, op, scratch, what)
    elif n > 1 and numel:
        if numel * esz <= GPU_SMALL_BYTES or numel < n:
            rows = scratch(n * numel * esz).view(flat.dtype).view(n, numel)
            ctx.allgather(flat, rows.reshape(-1))
            reduce_rows(rows, flat, op)
        else:
            chunk = bounds(numel, n)
            a, b = chunk[me]
            rows = scratch(n * (b - a) * esz).view(flat.dtype).view(n, b - a)
            _exchange_chunks(ctx, flat, chunk, rows, what)
            reduce_rows(rows, flat[a:b], op)
            if hasattr(ctx, "allgather_chunks"):   # stream-ordered (_stream_group.StreamCtx)
                ctx.allgather_chunks(flat, chunk)
            else:
                allgather_chunks(ctx, flat, chunk)
    if op == R.AVG:
        finish_avg(flat, n)


class _Sub:
    """Some ranks of ctx (global ranks, one order on every member) as a
    context of their own for allreduce() above: its size and rank, its
    messages sent to the global ranks, and the allgathers it takes made of
    them.  The sub-contexts of one operation use disjoint pairs of ranks or
    run one after the other, so the messages still match per pair."""

    def __init__(self, ctx, ranks: list[int]):
        self._ctx, self.ranks = ctx, ranks
        self.world_size, self.rank = len(ranks), ranks.index(ctx.rank)

    def _p2p(self, entries: list, what: str, blocking: bool = False):
        return self._ctx._p2p([(k, t, self.ranks[r]) for k, t, r in entries], what, blocking)

    def allgather_chunks(self, flat: torch.Tensor, chunk: list[tuple[int, int]]) -> None:
        a, b = chunk[self.rank]
        entries = [("send", flat[a:b], r) for r in range(self.world_size)
                   if r != self.rank and b > a]
        entries += [("recv", flat[s:e], r) for r, (s, e) in enumerate(chunk)
                    if r != self.rank and e > s]
        self._p2p(entries, "all_reduce", blocking=True)

    def allgather(self, src: torch.Tensor, out: torch.Tensor) -> None:
        k = src.numel()
        out[self.rank * k:(self.rank + 1) * k].copy_(src)
        self.allgather_chunks(out, [(r * k, (r + 1) * k) for r in range(self.world_size)])


def _by_node(ctx, flat: torch.Tensor, groups: list[list[int]], op: R,
             scratch: Callable[[int], torch.Tensor], what: str) -> None:
    """allreduce() where the group spans nodes alike (_reduce.node_groups):
    within each node a reduce-scatter (the node's GPUs over their links),
    across the nodes an all_reduce of each rank's chunk with the ranks of
    its place on the other nodes (the network, a rank's own share), then
    within each node an allgather, as the CPU path's hier_allreduce."""
    me = ctx.rank
    mine = next(g for g in groups if me in g)
    li = mine.index(me)
    intra = _Sub(ctx, mine)
    chunk = bounds(flat.numel(), len(mine))
    a, b = chunk[li]
    rows = scratch(len(mine) * (b - a) * flat.element_size()).view(flat.dtype).view(
        len(mine), b - a)
    _exchange_chunks(intra, flat, chunk, rows, what)
    reduce_rows(rows, flat[a:b], op)
    if b > a:   # AVG divides once, at the end, by the whole group's size
        allreduce(_Sub(ctx, [g[li] for g in groups]), flat[a:b],
                  R.SUM if op == R.AVG else op, scratch, what)
    intra.allgather_chunks(flat, chunk)


def reduce_scatter(ctx, out: torch.Tensor, flat: torch.Tensor, op: R,
                   scratch: Callable[[int], torch.Tensor], what: str) -> None:
    """out (contiguous, k elements) <- this rank's chunk of the reduction of
    flat (n chunks of k, read only), enqueued on the current stream."""
    n, me, k = ctx.world_size, ctx.rank, out.numel()
    esz = flat.element_size()
    chunk = [(r * k, (r + 1) * k) for r in range(n)]
    if n > 1 and k:
        rows = scratch(n * k * esz).view(flat.dtype).view(n, k)
        _exchange_chunks(ctx, flat, chunk, rows, what)
        reduce_rows(rows, out.view(-1), op)
    else:
        out.view(-1).copy_(flat[me * k:(me + 1) * k])
    if op == R.AVG:
        finish_avg(out, n)
