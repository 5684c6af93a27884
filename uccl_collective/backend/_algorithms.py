"""What the process group's tasks do once the dispatch has chosen their plane
(core/dispatch.py, rows 3-5): the reductions, the rooted and personalised
exchanges, on contiguous tensors, through the exchanges of the plane the
task runs on (Dispatch.xctx: the group's CollectiveContext, or within a
stream-ordered task its StreamCtx), with the group's reused buffers.  On the
CPU the engine moves the bytes and torch reduces (split over threads,
_reduce.py); on CUDA torch reduces on the GPU (_reduce_gpu.py), or the
engine's kernel does where the stream-ordered group has it."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..core.stream_group import StreamCtx
from . import _reduce, _reduce_gpu
from ._reduce import R


class _Staged:
    """A contiguous stand-in for a tensor (the tensor itself when it is
    contiguous); back() copies the result into the original."""

    __slots__ = ("orig", "t")

    def __init__(self, t: torch.Tensor, copy_in: bool = True):
        self.orig = t
        if t.is_contiguous():
            self.t = t
        else:
            self.t = t.contiguous() if copy_in else torch.empty(t.shape, dtype=t.dtype,
                                                                device=t.device)

    def back(self) -> None:
        if self.t is not self.orig:
            self.orig.copy_(self.t)


class Algorithms:
    """The algorithms of one group's tasks (rank `rank` of `size`): ctx its
    CollectiveContext, d its Dispatch (d.xctx: the exchanges of the plane
    the running task is on), par the CPU reductions' threads."""

    def __init__(self, ctx: Any, d: Any, rank: int, size: int, par: "_reduce.Parallel"):
        self._ctx, self._d, self.rank, self.size, self._par = ctx, d, rank, size, par
        # [0]: the algorithms' scratch; [1]: working copies of inputs
        self._scratch_bufs: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._combiners: dict = {}   # (operator, dtype, device type) -> its combine (_combine)

    def close(self) -> None:
        self._par.close()

    def scratch(self, nbytes: int, slot: int = 0, device: Any = "cpu") -> torch.Tensor:
        """A uint8 buffer of nbytes, reused across operations (one task runs
        at a time): fresh memory would page-fault as the engine fills it.
        Slot 0 is the algorithms'; slot 1 holds work_copy's."""
        key = (slot, torch.device(device))
        buf = self._scratch_bufs.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self._scratch_bufs[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def work_copy(self, parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """parts back to back in a reused 1-D buffer the reduction may
        overwrite (the inputs stay as they are)."""
        numel = sum(p.numel() for p in parts)
        flat = self.scratch(numel * dtype.itemsize, 1, parts[0].device).view(dtype)
        off = 0
        for p in parts:
            flat[off:off + p.numel()].view(p.shape).copy_(p)
            off += p.numel()
        return flat

    def _combine(self, op: R, dtype: torch.dtype, device: torch.device) -> Callable:
        key = (int(op), dtype, device.type)
        fn = self._combiners.get(key)
        if fn is None:   # (made once: _reduce.combiner compares pybind enums)
            fn = _reduce.combiner(op, dtype)
            fn = self._combiners[key] = fn if device.type == "cuda" else self._par.wrap(fn)
        return fn   # on the CPU split over threads

    # -- reductions ---------------------------------------------------------------
    def allreduce_flat(self, flat: torch.Tensor, op: R) -> None:
        """flat (contiguous 1-D) <- its reduction over the group."""
        if flat.is_cuda:
            scratch = lambda nb: self.scratch(nb, 0, flat.device)  # noqa: E731
            xctx = self._d.xctx
            # the engine's kernel where it applies (a stream-ordered task)
            if not (isinstance(xctx, StreamCtx) and xctx.allreduce(flat, op, scratch)):
                _reduce_gpu.allreduce(xctx, flat, op, scratch)
            return
        ctx, n = self._ctx, self.size
        if n > 1:
            combine = self._combine(op, flat.dtype, flat.device)
            scratch = lambda nb: self.scratch(nb, 0, flat.device)  # noqa: E731
            nbytes = flat.numel() * flat.element_size()
            if nbytes <= _reduce.SMALL_BYTES or flat.numel() < n:
                got = scratch(n * nbytes).view(flat.dtype).view(n, flat.numel())
                ctx.allgather(flat, got.reshape(-1))
                flat.copy_(got[0])
                for r in range(1, n):   # rank order: the same on every rank
                    combine(flat, got[r])
            else:
                chunk = _reduce.bounds(flat.numel(), n)
                _reduce.reduce_scatter(ctx, flat, chunk, combine, scratch, allgather=True)
        if op == R.AVG:
            _reduce.finish_avg(flat, n)

    def reduce(self, t: torch.Tensor, op: R, root: int) -> None:
        """The root's t <- the reduction of t over the group (only the
        root's tensor changes)."""
        work = self.work_copy([t], t.dtype)
        xctx = self._d.xctx
        # the fast path's round where the kernel applies (a stream-ordered task)
        if not (isinstance(xctx, StreamCtx) and
                xctx.reduce(work, op, root, lambda nb: self.scratch(nb, 0, work.device))):
            self.allreduce_flat(work, op)
        if self.rank == root:
            t.copy_(work.view(t.shape))

    def rs_input(self, parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """A reduce-scatter's input as one flat tensor: on CUDA a lone
        contiguous input is used as it is (the GPU reduction only reads it);
        otherwise a working copy (the CPU reduction overwrites it)."""
        if len(parts) == 1 and parts[0].is_cuda and parts[0].is_contiguous():
            return parts[0].reshape(-1)
        return self.work_copy(parts, dtype)

    def reduce_scatter_flat(self, out: torch.Tensor, flat: torch.Tensor, op: R,
                            what: str = "reduce_scatter") -> None:
        """out <- this rank's chunk of the reduction of flat (n equal chunks;
        on the CPU flat is scratch and is overwritten, on CUDA only read:
        see rs_input)."""
        ctx, n, me = self._ctx, self.size, self.rank
        if flat.is_cuda:
            s = _Staged(out, copy_in=False)
            scratch = lambda nb: self.scratch(nb, 0, flat.device)  # noqa: E731
            xctx = self._d.xctx
            if not (isinstance(xctx, StreamCtx) and
                    xctx.reduce_scatter(s.t.view(-1), flat, op, scratch, what)):
                _reduce_gpu.reduce_scatter(xctx, s.t, flat, op, scratch, what)
            s.back()
            return
        k = out.numel()
        chunk = [(r * k, (r + 1) * k) for r in range(n)]
        if n > 1:
            _reduce.reduce_scatter(ctx, flat, chunk, self._combine(op, flat.dtype, flat.device),
                                   lambda nb: self.scratch(nb, 0, flat.device))
        mine = flat[me * k:(me + 1) * k]
        if op == R.AVG:
            _reduce.finish_avg(mine, n)
        out.copy_(mine.view(out.shape))

    # -- rooted and personalised ----------------------------------------------
    def broadcast(self, t: torch.Tensor, root: int, what: str) -> None:
        """t <- the root's t."""
        s = _Staged(t, copy_in=self.rank == root)
        xctx = self._d.xctx
        if isinstance(xctx, StreamCtx):   # the fast path's round
            xctx.broadcast(s.t, root)
        else:
            self.star(what, root, [s.t] * self.size, s.t, to_root=False)
        if self.rank != root:
            s.back()

    def star(self, what: str, root: int, at_root: list[torch.Tensor], mine: torch.Tensor,
             to_root: bool) -> None:
        """The rooted exchanges (contiguous tensors): the root and rank r
        exchange at_root[r] (the root's side; empty elsewhere) and mine (rank
        r's side), toward the root (gather) or from it (scatter, broadcast);
        the root's own piece is copied."""
        me, n = self.rank, self.size
        if me != root:
            self._d.xctx._p2p([("send" if to_root else "recv", mine, root)], what, blocking=True)
            return
        own = at_root[me]
        if own is not mine:
            dst, src = (own, mine) if to_root else (mine, own)
            dst.copy_(src.view(dst.shape))
        entries = [("recv" if to_root else "send", at_root[r], r) for r in range(n) if r != me]
        if entries:
            self._d.xctx._p2p(entries, what, blocking=True)

    def exchange(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], what: str) -> None:
        """Personalised exchange: sends[r] to rank r, recvs[r] from rank r
        (all contiguous); this rank's own piece is copied."""
        me, n = self.rank, self.size
        recvs[me].copy_(sends[me].view(recvs[me].shape))
        entries = [("recv", recvs[r], r) for r in range(n) if r != me]
        entries += [("send", sends[r], r) for r in range(n) if r != me]
        if entries:
            self._d.xctx._p2p(entries, what, blocking=True)
