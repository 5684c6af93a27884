"""What the process group's tasks do once the dispatch has chosen their plane
(core/dispatch.py, rows 3-5): the reductions, the rooted and personalised
exchanges, on contiguous tensors, through the exchanges of the plane the
task runs on (Dispatch.xctx: the group's CollectiveContext, or within a
stream-ordered task its StreamCtx), with the group's reused buffers.  On the
CPU the engine moves the bytes and torch reduces (split over threads,
_reduce.py); on CUDA torch reduces on the GPU (_reduce_gpu.py), or the
engine's kernel does where the stream-ordered group has it."""
from __future__ import annotations

import struct
from typing import Any, Callable, Sequence

import torch

from ..core.stream_group import StreamCtx
from . import _check, _reduce, _reduce_gpu
from ._reduce import R

#: a call as the group's header check sees it: (operation, call number, root)
Call = tuple


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
    the running task is on), par the CPU reductions' threads, chk the
    group's call headers (_check.py).

    On CPU tensors every collective compares its call with every rank's
    before any byte of it moves (`call`: its operation, number and root;
    None for a part of a call already checked): its first exchange
    carries the header, with the data behind it where that exchange is an
    allgather of few bytes (chk.fold), else alone (chk.check).  CUDA
    tensors are compared by the stream-ordered rounds (csrc/sg/sg_round.c)."""

    def __init__(self, ctx: Any, d: Any, rank: int, size: int, par: "_reduce.Parallel",
                 chk: "_check.Checker"):
        self._ctx, self._d, self.rank, self.size, self._par = ctx, d, rank, size, par
        self.chk = chk
        # [0]: the algorithms' scratch; [1]: working copies of inputs
        self._scratch_bufs: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._combiners: dict = {}   # (operator, dtype, device type) -> its combine (_combine)

    def close(self) -> None:
        self._par.close()
        self.chk.close()

    def folds(self, nbytes: int) -> bool:
        """Whether nbytes per rank go through the header's slots (all_gather):
        every rank's slot together at most _check.FOLD_BYTES."""
        return self.size * (_check.H + nbytes) <= _check.FOLD_BYTES

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
    def allreduce_flat(self, flat: torch.Tensor, op: R, call: Call | None = None) -> None:
        """flat (contiguous 1-D) <- its reduction over the group; call: see
        the class (on CPU tensors)."""
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
            nbytes = flat.numel() * flat.element_size()
            if nbytes <= _reduce.SMALL_BYTES or flat.numel() < n:
                if call is not None:   # every rank's flat behind its header
                    got = self.chk.fold(call[0], call[1], flat, op, call[2])
                else:
                    got = self.scratch(n * nbytes).view(flat.dtype).view(n, flat.numel())
                    ctx.allgather(flat, got.reshape(-1))
                flat.copy_(got[0])
                for r in range(1, n):   # rank order: the same on every rank
                    combine(flat, got[r])
            else:
                if call is not None:
                    self.chk.check(call[0], call[1], flat.dtype, flat.numel(), op, call[2])
                chunk = _reduce.bounds(flat.numel(), n)
                scratch = lambda nb: self.scratch(nb, 0, flat.device)  # noqa: E731
                _reduce.reduce_scatter(ctx, flat, chunk, combine, scratch, allgather=True)
        if op == R.AVG:
            _reduce.finish_avg(flat, n)

    def reduce(self, t: torch.Tensor, op: R, root: int, call: Call | None = None) -> None:
        """The root's t <- the reduction of t over the group (only the
        root's tensor changes)."""
        work = self.work_copy([t], t.dtype)
        xctx = self._d.xctx
        # the fast path's round where the kernel applies (a stream-ordered task)
        if not (isinstance(xctx, StreamCtx) and
                xctx.reduce(work, op, root, lambda nb: self.scratch(nb, 0, work.device))):
            self.allreduce_flat(work, op, call)
        if self.rank == root:
            t.copy_(work.view(t.shape))

    def check(self, call: Call | None, t: torch.Tensor | None, dtype: Any = None,
              count: int = 0, op: Any = None, extra: bytes = b"") -> Any:
        """The header of a call whose first exchange carries no data of it
        (chk.check), on the CPU path; nothing for CUDA tensors (t) or a
        call already checked (None)."""
        if call is None or (t is not None and t.is_cuda):
            return None
        return self.chk.check(call[0], call[1], dtype, count, op, call[2], extra)

    def check_pairs(self, call: Call | None, t: torch.Tensor, counts: list[int]) -> None:
        """all_to_all's header, with its split sizes (counts: the elements
        this rank sends each rank, then those it expects from each), every
        rank's compared with every other's (on the CPU path)."""
        if call is None or t.is_cuda:
            return
        extra = struct.pack(f"<{len(counts)}q", *counts)
        mv = self.chk.check(call[0], call[1], t.dtype, 0, None, call[2], extra)
        if mv is not None:
            self.chk.pairs(call[0], mv, len(extra))

    def allgather(self, inp: torch.Tensor, out: Any, call: Call | None) -> None:
        """Every rank's inp (contiguous) into out: one flat tensor of size x
        inp's elements, or a list of size flat tensors; through the
        header's slots where they are small (chk.fold, then copied out)."""
        xctx = self._d.xctx
        if call is None or inp.is_cuda:
            xctx.allgather(inp, out)
            return
        k = inp.numel()
        if not self.folds(k * inp.element_size()):
            self.chk.check(call[0], call[1], inp.dtype, k, None, call[2])
            xctx.allgather(inp, out)
            return
        rows = self.chk.fold(call[0], call[1], inp.reshape(-1))
        if isinstance(out, torch.Tensor):
            out.view(self.size, k).copy_(rows)
        else:
            for r, o in enumerate(out):
                o.copy_(rows[r])

    def rs_input(self, parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """A reduce-scatter's input as one flat tensor: on CUDA a lone
        contiguous input is used as it is (the GPU reduction only reads it);
        otherwise a working copy (the CPU reduction overwrites it)."""
        if len(parts) == 1 and parts[0].is_cuda and parts[0].is_contiguous():
            return parts[0].reshape(-1)
        return self.work_copy(parts, dtype)

    def reduce_scatter_flat(self, out: torch.Tensor, flat: torch.Tensor, op: R,
                            what: str = "reduce_scatter", call: Call | None = None) -> None:
        """out <- this rank's chunk of the reduction of flat (n equal chunks;
        on the CPU flat is scratch and is overwritten, on CUDA only read:
        see rs_input)."""
        self.check(call, flat, out.dtype, out.numel(), op)
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

    def reduce_scatter_v(self, out: torch.Tensor, ins: list[torch.Tensor], op: R, what: str,
                         call: Call | None) -> None:
        """out <- the reduction over the group of every rank's ins[rank],
        where the ranks' outputs differ in size (ins[r]: rank r's share):
        every rank's ins[me] gathered here (a personalised exchange, its
        split sizes compared across the ranks first), then combined in rank
        order, the same on every rank."""
        n, k = self.size, out.numel()
        self.check_pairs(call, ins[0], [i.numel() for i in ins] + [k] * n)
        got = self.scratch(n * k * out.element_size(), 0, out.device).view(out.dtype).view(n, k)
        self.exchange([i.contiguous().reshape(-1) for i in ins], list(got), what)
        acc = got[0]
        combine = self._combine(op, out.dtype, out.device)
        for r in range(1, n):
            combine(acc, got[r])
        if op == R.AVG:
            _reduce.finish_avg(acc, n)
        out.copy_(acc.view(out.shape))

    # -- rooted and personalised ----------------------------------------------
    def broadcast(self, t: torch.Tensor, root: int, what: str, call: Call | None = None) -> None:
        """t <- the root's t."""
        s = _Staged(t, copy_in=self.rank == root)
        xctx = self._d.xctx
        if isinstance(xctx, StreamCtx):   # the fast path's round
            xctx.broadcast(s.t, root)
        elif call is not None and not t.is_cuda and \
                t.numel() * t.element_size() <= _check.ROOT_FOLD_BYTES:
            # the root's t behind its header, the others' headers alone
            flat = s.t.reshape(-1)
            got = self.chk.fold_root(call[0], call[1], flat, root)
            if self.rank != root:
                flat.copy_(got)
        else:
            self.check(call, t, t.dtype, t.numel())
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
        (all contiguous); this rank's own piece is copied.  On the
        stream-ordered plane, all_to_all's round (the one a blocking call
        posts from its thread)."""
        xctx = self._d.xctx
        if isinstance(xctx, StreamCtx):
            xctx.all_to_all(sends, recvs)
            return
        me, n = self.rank, self.size
        recvs[me].copy_(sends[me].view(recvs[me].shape))
        entries = [("recv", recvs[r], r) for r in range(n) if r != me]
        entries += [("send", sends[r], r) for r in range(n) if r != me]
        if entries:
            xctx._p2p(entries, what, blocking=True)
