"""all_reduce of sparse COO tensors, as Gloo does it: each rank coalesces
its tensor, the ranks exchange their shapes (checked to agree), then their
indices and values (allgatherv: each rank has its own number of nonzeros),
and every rank sums the N sparse tensors in rank order, coalesces the sum
and copies it into its tensor (so every rank ends with the same indices and
values).  SUM only, as with Gloo.  DDP uses it for sparse gradients
(``nn.Embedding(sparse=True)``).
"""
from __future__ import annotations

from typing import Any

import torch

from ._reduce import R, op_type

_HEAD = 4   # [number of dims, sparse dims, dense dims, nonzeros]


def is_sparse(tensors: Any) -> bool:
    return (isinstance(tensors, (list, tuple)) and len(tensors) == 1
            and isinstance(tensors[0], torch.Tensor) and tensors[0].layout == torch.sparse_coo)


def check(tensors: Any, opts: Any) -> torch.Tensor:
    """The one sparse tensor of an all_reduce, its options checked."""
    op = op_type(opts.reduceOp if opts is not None else R.SUM)
    if op != R.SUM:
        raise ValueError(f"all_reduce of a sparse tensor: reduce op {op.name} is not supported "
                         "(SUM only, as with Gloo)")
    t = tensors[0]
    if not (t.is_cuda or t.device.type == "cpu"):
        raise ValueError(f"all_reduce: sparse tensor on {t.device}; the uccl backend moves CPU "
                         "and CUDA tensors")
    return t


def _gather_ints(ctx: Any, mine: list[int], n: int, device: torch.device) -> torch.Tensor:
    """An (n, len(mine)) int64 tensor of every rank's list (same length)."""
    got = torch.empty(n * len(mine), dtype=torch.int64, device=device)
    ctx.allgather(torch.tensor(mine, dtype=torch.int64, device=device), got)
    return got.view(n, len(mine)).cpu()


def allreduce(ctx: Any, t: torch.Tensor, rank: int, n: int) -> None:
    """t (sparse COO) <- the sum of every rank's t.  Runs as a task of the
    group (every rank calls it in the same place of its order)."""
    with torch.no_grad():
        x = t.coalesce()
        dev = x.device
        head = _gather_ints(ctx, [x.dim(), x.sparse_dim(), x.dense_dim(), x._nnz()], n, dev)
        for r in range(n):
            if head[r, :3].tolist() != head[rank, :3].tolist():
                raise ValueError(
                    f"all_reduce of sparse tensors: rank {r} has {head[r, 0]} dims "
                    f"({head[r, 1]} sparse, {head[r, 2]} dense), rank {rank} has "
                    f"{x.dim()} ({x.sparse_dim()} sparse, {x.dense_dim()} dense)")
        sizes = _gather_ints(ctx, list(x.shape), n, dev)
        for r in range(n):
            if sizes[r].tolist() != list(x.shape):
                raise ValueError(f"all_reduce of sparse tensors: rank {r} has shape "
                                 f"{tuple(sizes[r].tolist())}, rank {rank} has {tuple(x.shape)}")
        nnz = head[:, 3].tolist()
        sd = x.sparse_dim()
        dense = tuple(x.shape[sd:])
        per = 1
        for d in dense:
            per *= d
        idx = [torch.empty(sd * k, dtype=torch.int64, device=dev) for k in nnz]
        val = [torch.empty(k * per, dtype=x.dtype, device=dev) for k in nnz]
        ctx.allgatherv(x._indices().contiguous().reshape(-1), idx)
        ctx.allgatherv(x._values().contiguous().reshape(-1), val)
        out = None
        for r in range(n):   # rank order: the same sum on every rank
            part = torch.sparse_coo_tensor(idx[r].view(sd, nnz[r]),
                                           val[r].view((nnz[r],) + dense), x.shape,
                                           dtype=x.dtype, device=dev)
            out = part if out is None else out + part
        t.copy_(out.coalesce())
