"""Every rank's call compared with every other rank's before any byte of the
call moves (issue 35, failure 7): calls that disagree (the operation, the
root, the size, the dtype, the reduce op, or how many calls a rank has
made on the group) raise UcclMismatchError on every rank, naming the
operation, the ranks and their values, instead of moving the wrong bytes,
returning on some ranks and timing out on others.

How: every collective of the group's CPU path starts with one exchange
in which each rank sends every other a fixed 32-byte header of its call
(HDR), in a slot of its own; each rank then compares every header with
its own, so that all of them reach the same verdict from the same bytes.
Where the algorithm's first exchange is an allgather of data small enough
to go through the slots (all_reduce up to UCCL_PG_SMALL_KB, all_gather and
broadcast up to FOLD_BYTES in all), the data rides behind the header in
the same slot: no extra round, and nothing reaches the caller's tensors
before the headers agree.  Otherwise the header goes alone, and the data
follows once it has been checked (one small allgather more).

Calls whose slots differ in size (a 4-byte all_reduce against a 1 MiB
one) fail the engine's allgather on every rank (each rank receives from
every rank as many bytes as it sends, so a rank whose slot differs fails
every rank's receive from it: csrc/coll, a size mismatch finishes every
transfer and fails the operation without breaking the connections); every
rank then sends every other its header alone, in slots of one size, and
names what differs from those.

After a mismatch the group can still be used: every rank raised in the
same exchange, nothing else was posted, so the ranks still agree on what
comes next (unlike a timeout, after which the group refuses new calls).
"""
from __future__ import annotations

import struct
from typing import Any, Sequence

import torch

from .. import _engine
from ..p2p import UcclMismatchError
from . import _reduce

MAGIC = 0x31636375   # b"ucc1"
#: magic, operation, dtype, reduce op, flags, root, extra bytes, call number, count
HDR = struct.Struct("<IBBBBiIQQ")
H = HDR.size          # 32: the payload behind it stays 16-byte aligned
NONE = 255            # no dtype, no reduce op
#: all_gather and broadcast through the slots up to this many bytes in all
#: (every rank's slot): above it, a copy out of the slots costs more than a
#: round of headers alone
FOLD_BYTES = 64 << 10

#: operation codes (the index); the same on every rank of one version
OPS = ("barrier", "all_reduce", "all_reduce_coalesced", "all_reduce (sparse)", "reduce",
       "broadcast", "all_gather", "all_gather_into_tensor",
       "all_gather_into_tensor (coalesced)", "all_gather_coalesced", "reduce_scatter",
       "reduce_scatter_tensor", "reduce_scatter_tensor (coalesced)", "gather", "scatter",
       "all_to_all", "all_to_all_single")
_CODE = {name: i for i, name in enumerate(OPS)}
_DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)},
                       key=str))
_DT = {dt: i for i, dt in enumerate(_DTYPES)}
#: torch's name for the root of each rooted operation
_ROOT = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}
#: what the count of each operation counts
_COUNT = {"all_gather": "input elements", "all_gather_into_tensor": "input elements",
          "all_gather_into_tensor (coalesced)": "input elements",
          "all_gather_coalesced": "input bytes", "reduce_scatter": "output elements",
          "reduce_scatter_tensor": "output elements",
          "reduce_scatter_tensor (coalesced)": "output elements", "all_to_all": "elements",
          "all_to_all_single": "elements", "all_reduce (sparse)": "dims"}


def _pad(n: int) -> int:
    return (n + 15) & ~15


def header(what: str, seq: int, dtype: Any = None, count: int = 0, redop: Any = None,
           root: int = -1, extra: int = 0) -> bytes:
    """The call's header (count: elements, as _COUNT says; extra: the bytes
    that follow it in its slot)."""
    return HDR.pack(MAGIC, _CODE[what], NONE if dtype is None else _DT[dtype],
                    NONE if redop is None else int(redop), 0, root, extra, seq, count)


class Checker:
    """The call headers of one process group (rank `rank` of `size`), over
    its CollectiveContext ctx: the slots they travel in (one reused,
    registered CPU buffer) and the comparison.  Used by the group's tasks,
    which run one at a time.  calls: the group's collective calls so far
    (the process group numbers each call as it is made, so a rank that
    skipped or repeated one shows)."""

    def __init__(self, ctx: Any, rank: int, size: int):
        self._ctx, self.rank, self.size = ctx, rank, size
        self.calls = 0
        self._buf: torch.Tensor | None = None
        self._mv: memoryview | None = None
        self._mr = 0
        self._lay: dict[int, tuple] = {}     # slot bytes -> (own buffer, every rank's)
        self._views: dict[tuple, tuple] = {}  # (slot bytes, dtype, elements) -> payload views

    def close(self) -> None:
        self._buf = self._mv = None
        self._lay.clear()
        self._views.clear()

    # -- the slots -------------------------------------------------------------------
    def _slots(self, stride: int) -> tuple:
        """Every rank's slot of `stride` bytes: (this rank's engine buffer,
        every rank's), in the reused buffer (made larger as needed)."""
        lay = self._lay.get(stride)
        if lay is not None:
            return lay
        need = self.size * stride
        if self._buf is None or self._buf.numel() < need:
            self._grow(need)
        base, mr = self._buf.data_ptr(), self._mr
        bufs = [(base + r * stride, stride, mr) for r in range(self.size)]
        lay = self._lay[stride] = (bufs[self.rank], bufs)
        return lay

    def _grow(self, need: int) -> None:
        ep = self._ctx._ep()
        if self._mr:
            ep.dereg(self._mr)
            self._mr = 0
        self._lay.clear()
        self._views.clear()
        self._buf = torch.zeros(max(need, 4096), dtype=torch.uint8)
        self._mv = memoryview(self._buf.numpy())
        # registered once (otherwise the engine registers it at every call),
        # with the endpoint itself: the context's own table would make every
        # lookup of its buffers longer; the endpoint's close releases it
        self._mr = ep.reg(self._buf.data_ptr(), self._buf.numel())[1]

    # -- the exchanges -----------------------------------------------------------------
    def check(self, what: str, seq: int, dtype: Any = None, count: int = 0, redop: Any = None,
              root: int = -1, extra: bytes = b"") -> memoryview | None:
        """The call's header (and extra bytes: split sizes) exchanged alone
        and compared; UcclMismatchError where any rank's differs.  Returns
        the slots (memoryview) when extra was given, for pairs(), else None."""
        if self.size == 1:
            return None
        xl = len(extra)
        stride = H + _pad(xl)
        hdr = header(what, seq, dtype, count, redop, root, xl)
        own, bufs = self._slots(stride)
        mv, off = self._mv, self.rank * stride
        mv[off:off + H] = hdr
        if xl:
            mv[off + H:off + H + xl] = extra
        self._exchange(what, hdr, stride, own, bufs)
        return mv if xl else None

    def fold(self, what: str, seq: int, flat: torch.Tensor, redop: Any = None,
             root: int = -1, payload: bool = True) -> torch.Tensor:
        """The call's header and flat (a contiguous CPU tensor) in one slot
        per rank, exchanged; once every header agrees, every rank's flat as
        the rows of an (n, numel) view of the slots (the caller copies or
        reduces out of it).  payload False: this rank's data is not needed
        (broadcast's other ranks): the slot goes as it is."""
        n, numel, dtype = self.size, flat.numel(), flat.dtype
        nbytes = numel * flat.element_size()
        stride = H + _pad(nbytes)
        own, bufs = self._slots(stride)
        key = (stride, dtype, numel)
        views = self._views.get(key)
        if views is None:
            rows = self._buf[:n * stride].view(n, stride)[:, H:H + nbytes].view(dtype)
            views = self._views[key] = (rows, rows[self.rank])
        if payload:
            views[1].copy_(flat)
        hdr = header(what, seq, dtype, numel, redop, root, nbytes)
        mv, off = self._mv, self.rank * stride
        mv[off:off + H] = hdr
        if n > 1:
            self._exchange(what, hdr, stride, own, bufs)
        return views[0]

    def _exchange(self, what: str, hdr: bytes, stride: int, own: tuple, bufs: list) -> None:
        ctx = self._ctx
        cm = ctx._cm()
        try:
            cm.allgather(own, bufs, _engine.AG_DIRECT, False, ctx.timeout_s, -1, 0)
        except UcclMismatchError as e:
            # the slots differ in size, so the calls do: every rank failed
            # here; each sends every other its header alone to say how
            self._diagnose(what, hdr, e)
        mv, me = self._mv, self.rank
        for r in range(self.size):
            if r != me and mv[r * stride:r * stride + H] != hdr:
                self._raise(what, [mv[q * stride:q * stride + H] for q in range(self.size)])

    def _diagnose(self, what: str, hdr: bytes, cause: BaseException) -> None:
        """After the slots' sizes disagreed: the headers alone, exchanged,
        and the difference raised (the engine's own message where even
        that exchange fails: the ranks are not all here)."""
        own, bufs = self._slots(H)
        mv, n = self._mv, self.size
        mv[self.rank * H:(self.rank + 1) * H] = hdr
        try:
            self._ctx._cm().allgather(own, bufs, _engine.AG_DIRECT, False, self._ctx.timeout_s,
                                      -1, 0)
        except Exception:   # noqa: BLE001 - the first error says more
            raise cause from None
        self._raise(what, [mv[q * H:(q + 1) * H] for q in range(n)], cause)

    def _raise(self, what: str, slots: Sequence, cause: BaseException | None = None) -> None:
        hdrs = [HDR.unpack(bytes(s)) for s in slots]
        raise UcclMismatchError(message(what, self.rank, hdrs)) from cause

    def pairs(self, what: str, mv: memoryview, xl: int) -> None:
        """After check() with extra (xl bytes) = sends + recvs (int64 each,
        one per rank: what this rank sends each rank, and expects from
        each): UcclMismatchError where a rank sends another a count it does
        not expect (every rank reads every rank's sizes: the same verdict)."""
        n = self.size
        stride = H + _pad(xl)
        got = [struct.unpack_from(f"<{2 * n}q", mv, r * stride + H) for r in range(n)]
        bad = [(i, j, got[i][j], got[j][n + i]) for i in range(n) for j in range(n)
               if i != j and got[i][j] != got[j][n + i]]
        if bad:
            shown = "; ".join(f"rank {i} sends rank {j} {s} elements, rank {j} expects {x} from "
                              f"rank {i}" for i, j, s, x in bad[:8])
            more = f" (and {len(bad) - 8} more pairs)" if len(bad) > 8 else ""
            raise UcclMismatchError(f"{what}: the ranks' split sizes disagree (this is rank "
                                    f"{self.rank}): {shown}{more}. {_AFTER}")


_AFTER = "Nothing was sent or received; the group can still be used."


def _ranks(rs: list[int]) -> str:
    shown = ", ".join(map(str, rs[:8])) + (f" and {len(rs) - 8} more" if len(rs) > 8 else "")
    return f"{'ranks' if len(rs) > 1 else 'rank'} {shown}"


def _groups(vals: list, verb: tuple[str, str] = ("say", "says")) -> str:
    """'ranks 0, 2 say 0, rank 1 says 1': the ranks grouped by value, in the
    order of their first rank."""
    order: dict = {}
    for r, v in enumerate(vals):
        order.setdefault(v, []).append(r)
    return ", ".join(f"{_ranks(rs)} {verb[len(rs) == 1]} {v}" for v, rs in order.items())


def _dtype(code: int) -> str:
    return "none" if code == NONE else str(_DTYPES[code]) if code < len(_DTYPES) else f"#{code}"


def _redop(code: int) -> str:
    if code == NONE:
        return "none"
    try:
        return _reduce.R(code).name
    except ValueError:
        return f"#{code}"


def _op(code: int) -> str:
    return OPS[code] if code < len(OPS) else f"operation #{code}"


def describe(h: tuple) -> str:
    """One rank's call, from its header: 'broadcast(src=1, 4 elements of
    torch.float32)'."""
    _, op, dt, ro, _, root, _, seq, count = h
    name = _op(op)
    parts = []
    if name in _ROOT:
        parts.append(f"{_ROOT[name]}={root}")
    if ro != NONE:
        parts.append(_redop(ro))
    if name != "barrier":
        parts.append(f"{count} {_COUNT.get(name, 'elements')}" +
                     (f" of {_dtype(dt)}" if dt != NONE else ""))
    return f"{name}({', '.join(parts)}) as call {seq}"


def message(what: str, me: int, hdrs: list[tuple]) -> str:
    """What differs between the ranks' headers (every rank builds the same
    text from the same headers, but for the rank it names as itself)."""
    head = f"{what}: the ranks' calls disagree (this is rank {me})"
    alien = [r for r, h in enumerate(hdrs) if h[0] != MAGIC]
    if alien:
        return (f"{head}: {_ranks(alien)} sent no uccl call header (a collective of another "
                f"kind, or another version of uccl_collective); {_AFTER}")
    col = lambda i: [h[i] for h in hdrs]   # noqa: E731
    skipped = (f"on the call number of this group: "
               f"{_groups(col(7), ('are at call', 'is at call'))} (a rank skipped a call, or "
               f"raised before its exchange)")
    if len(set(col(1))) > 1:
        calls = "; ".join(f"rank {r}: {describe(h)}" for r, h in enumerate(hdrs[:8]))
        also = f"; and {skipped}" if len(set(col(7))) > 1 else ""
        return (f"{head} on the operation: {_groups([_op(c) for c in col(1)], ('call', 'calls'))}"
                f" ({calls}){also}. {_AFTER}")
    diffs = []
    if len(set(col(7))) > 1:
        diffs.append(skipped)
    if len(set(col(5))) > 1:
        diffs.append(f"on {_ROOT.get(what, 'the root')}: {_groups(col(5))}")
    if len(set(col(8))) > 1:
        diffs.append(f"on the size ({_COUNT.get(_op(hdrs[me][1]), 'elements')}): "
                     f"{_groups(col(8))}")
    if len(set(col(2))) > 1:
        diffs.append(f"on the dtype: {_groups([_dtype(c) for c in col(2)])}")
    if len(set(col(3))) > 1:
        diffs.append(f"on the reduce op: {_groups([_redop(c) for c in col(3)])}")
    if not diffs:   # (the extra bytes: only a different build would disagree there alone)
        diffs.append(f"on the bytes that follow the header: {_groups(col(6))}")
    return f"{head} {'; '.join(diffs)}. {_AFTER}"
