"""Reductions for the "uccl" process group: the engine moves the bytes,
torch computes on the receiving rank.

all_reduce = ring reduce-scatter + allgather: each rank sends and receives
2(N-1)/N of the tensor.  The reduce-scatter is pipelined: every step's
chunk travels in pieces, and a piece is forwarded to the next rank as soon
as it has been reduced here, while the later pieces are still in flight.
Small tensors take one allgather of the whole tensor and a local reduction
instead (one round trip rather than 2(N-1)).

Every rank reduces a given chunk in the same order (the ring's), and the
owner's result is what the allgather hands out, so all ranks end bitwise
identical, as torch documents for all_reduce.
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist

from . import _engine

R = dist.ReduceOp.RedOpType
_SEND, _RECV = _engine.OP_SEND, _engine.OP_RECV


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer") from None
    if n < 0:
        raise ValueError(f"{name}={n} must be >= 0")
    return n


#: Tensors up to this many bytes are all-reduced by one allgather of the whole
#: tensor and a local reduction.
SMALL_BYTES = _env_int("UCCL_PG_SMALL_KB", 64) << 10
#: Upper bound of a reduce-scatter piece.
PIECE_BYTES = max(_env_int("UCCL_PG_PIECE_KB", 4096), 64) << 10


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
    if op in (R.MIN, R.MAX) and dtype.is_complex:
        raise ValueError(f"{what}: ReduceOp.{op.name} is not defined for complex {dtype}")


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


def finish_avg(t: torch.Tensor, n: int) -> None:
    """AVG = SUM / n (integers: truncated, as NCCL's ncclAvg)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.div_(n)
    elif t.dtype == torch.bool:
        raise ValueError("all_reduce: ReduceOp.AVG is not defined for bool tensors")
    else:
        t.copy_(torch.div(t, n, rounding_mode="trunc"))


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


def ring_reduce_scatter(ctx, flat: torch.Tensor, chunk: list[tuple[int, int]],
                        combine: Callable) -> None:
    """After it, flat[chunk[me]] holds the reduction of that chunk over all
    ranks (other chunks hold partial sums).  flat: contiguous, 1-D.

    Step s (0..N-2): send chunk (me-s-1) to the right, receive chunk
    (me-s-2) from the left into scratch and reduce it into flat.  A piece
    reduced at step s is the piece sent at step s+1, so it is submitted
    right after its reduction: the pieces behind it stay in flight."""
    n, me, ep = ctx.world_size, ctx.rank, ctx.ep
    if n == 1 or flat.numel() == 0:
        return
    right, left = (me + 1) % n, (me - 1) % n
    esz = flat.element_size()
    longest = max(e - s for s, e in chunk)
    piece = max(1, min(PIECE_BYTES // esz, -(-longest // 4)))  # >= 4 pieces in a chunk
    piece = max(piece, min(longest, (256 << 10) // esz))      # but not tiny ones
    scratch = torch.empty((2, longest), dtype=flat.dtype)
    base = flat.data_ptr()
    sbase = [scratch[i].data_ptr() for i in range(2)]
    timeout = ctx.timeout_s

    def submit(s: int, p: int) -> int | None:
        cs, cr = (me - s - 1) % n, (me - s - 2) % n
        sp, rp = _pieces(chunk[cs], piece), _pieces(chunk[cr], piece)
        entries = []
        if p < len(sp):
            a, b = sp[p]
            entries.append((_SEND, right, (base + a * esz, (b - a) * esz, 0)))
        if p < len(rp):
            a, b = rp[p]
            off = a - chunk[cr][0]
            entries.append((_RECV, left, (sbase[s % 2] + off * esz, (b - a) * esz, 0)))
        return ep._comm_p2p(entries) if entries else None

    npieces = [max(len(_pieces(chunk[(me - s - 1) % n], piece)),
                   len(_pieces(chunk[(me - s - 2) % n], piece))) for s in range(n - 1)]
    ops = {(0, p): submit(0, p) for p in range(npieces[0])}
    try:
        for s in range(n - 1):
            cr = (me - s - 2) % n
            rp = _pieces(chunk[cr], piece)
            more = s + 1 < n - 1
            for p in range(npieces[s]):
                op = ops.pop((s, p))
                if op is not None:
                    ep._comm_wait(op, timeout)
                if p < len(rp):
                    a, b = rp[p]
                    off = a - chunk[cr][0]
                    combine(flat[a:b], scratch[s % 2][off:off + b - a])
                if more and p < npieces[s + 1]:
                    ops[(s + 1, p)] = submit(s + 1, p)
            # every rank submits in (step, piece) order: posts match per connection
            for p in range(npieces[s], npieces[s + 1] if more else 0):
                ops[(s + 1, p)] = submit(s + 1, p)
    finally:
        for op in ops.values():  # after an error: nothing may land once we return
            if op is not None:
                try:
                    ep._comm_wait(op, timeout)
                except BaseException:
                    pass
