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
to go through the slots (all_reduce up to UCCL_PG_SMALL_KB, all_gather up
to FOLD_BYTES in all), the data rides behind the header in the same slot:
no extra round, and nothing reaches the caller's tensors before the
headers agree.  A broadcast up to ROOT_FOLD_BYTES sends the root's data
behind its header and every other rank's header alone (fold_root: slots of
two sizes).  Otherwise the header goes alone, and the data follows once it
has been checked (one small allgather more).

Calls whose slots differ in size (a 4-byte all_reduce against a 1 MiB
one) fail the engine's allgather of some ranks or all (csrc/coll: a size
mismatch finishes every transfer and fails the operation, without breaking
the connections); a rank whose exchange went through holds every rank's
header and sees the difference.  So where calls disagree every rank
raises, whether at the exchange or at the comparison, and every rank then
sends every other its header alone, in slots of one size (_diagnose): the
message names what differs, and every rank made the same exchanges.

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
#: the exchanges' algorithm: direct (a size mismatch then fails both sides of
#: a pair and nothing else), without the engine's own exchange of sizes
#: after a mismatch (this module's follows instead: see Checker._diagnose)
_AG = _engine.AG_DIRECT | _engine.AG_NO_DIAGNOSIS
#: magic, operation, dtype, reduce op, flags, root, extra bytes, call number, count
HDR = struct.Struct("<IBBBBiIQQ")
H = HDR.size          # 32: the payload behind it stays 16-byte aligned
NONE = 255            # no dtype, no reduce op
#: all_gather through the slots up to this many bytes in all (every rank's
#: slot): above it, the copies into and out of the slots cost more than a
#: round of headers alone (about 30 us on the 2-core machine)
FOLD_BYTES = 64 << 10
#: broadcast through the root's slot up to this many bytes (the others send
#: their header alone, and copy the data out of the root's slot)
ROOT_FOLD_BYTES = 256 << 10

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
        self._roots: dict[tuple, tuple] = {}  # fold_root's layouts

    def close(self) -> None:
        self._buf = self._mv = None
        self._forget()

    def _forget(self) -> None:
        """The layouts over the buffer (it is replaced)."""
        self._lay.clear()
        self._views.clear()
        self._roots.clear()

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
        self._forget()
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
             root: int = -1) -> torch.Tensor:
        """The call's header and flat (a contiguous CPU tensor) in one slot
        per rank, exchanged; once every header agrees, every rank's flat as
        the rows of an (n, numel) view of the slots (the caller copies or
        reduces out of it)."""
        n, numel, dtype = self.size, flat.numel(), flat.dtype
        nbytes = numel * flat.element_size()
        stride = H + _pad(nbytes)
        own, bufs = self._slots(stride)
        key = (stride, dtype, numel)
        views = self._views.get(key)
        if views is None:
            rows = self._buf[:n * stride].view(n, stride)[:, H:H + nbytes].view(dtype)
            views = self._views[key] = (rows, rows[self.rank])
        views[1].copy_(flat)
        hdr = header(what, seq, dtype, numel, redop, root, nbytes)
        mv, off = self._mv, self.rank * stride
        mv[off:off + H] = hdr
        if n > 1:
            self._exchange(what, hdr, stride, own, bufs)
        return views[0]

    def fold_root(self, what: str, seq: int, flat: torch.Tensor, root: int) -> torch.Tensor:
        """broadcast's header with the root's flat (a contiguous CPU tensor)
        behind it in the root's slot, every other rank's header alone (an
        allgather of chunks of two sizes); once every header agrees, the
        root's flat as a view of its slot (the others copy it out).

        Each rank expects the larger slot where its own call says the root
        is, so calls that disagree fail the exchange of some ranks and not
        of others; those whose exchange went through hold every header, and
        see the difference.  Every rank raises either way, and then (always,
        so that all of them do) sends every other its header alone, which
        names what differs."""
        n, me = self.size, self.rank
        if n == 1:
            return flat
        numel, dtype = flat.numel(), flat.dtype
        nbytes = numel * flat.element_size()
        big = H + _pad(nbytes)
        key = (root, big, dtype, numel)
        lay = self._roots.get(key)
        if lay is None:
            need = (n - 1) * H + big
            if self._buf is None or self._buf.numel() < need:
                self._grow(need)
            offs = [r * H + (big - H if r > root else 0) for r in range(n)]
            base, mr = self._buf.data_ptr(), self._mr
            bufs = [(base + offs[r], big if r == root else H, mr) for r in range(n)]
            pay = self._buf[offs[root] + H:offs[root] + H + nbytes].view(dtype)
            lay = self._roots[key] = (offs, bufs, pay)
        offs, bufs, pay = lay
        if me == root:
            pay.copy_(flat)
        hdr = header(what, seq, dtype, numel, None, root, nbytes)
        mv = self._mv
        mv[offs[me]:offs[me] + H] = hdr
        ctx = self._ctx
        err = None
        try:
            ctx._cm().allgather(bufs[me], bufs, _AG, False, ctx.timeout_s, -1, 0)
        except UcclMismatchError as e:
            err = e
        if err is None and all(mv[o:o + H] == hdr for o in offs):
            return pay
        self._diagnose(what, hdr, err)
        raise AssertionError("unreachable")   # (_diagnose raises)

    def _exchange(self, what: str, hdr: bytes, stride: int, own: tuple, bufs: list) -> None:
        ctx = self._ctx
        cm = ctx._cm()
        try:
            cm.allgather(own, bufs, _AG, False, ctx.timeout_s, -1, 0)
        except UcclMismatchError as e:
            # the slots differ in size, so the calls do
            self._diagnose(what, hdr, e)
        mv, me = self._mv, self.rank
        for r in range(self.size):
            if r != me and mv[r * stride:r * stride + H] != hdr:
                self._diagnose(what, hdr, None)

    def _diagnose(self, what: str, hdr: bytes, cause: BaseException | None) -> None:
        """After the exchange failed (cause: the engine's size mismatch) or
        the headers it brought differ (None): every rank's header alone,
        exchanged, and the difference raised (the engine's own message
        where even that exchange fails: the ranks are not all here).  Every
        rank comes here after any exchange in which the calls disagree (the
        module's doc says why), so all of them make this exchange."""
        own, bufs = self._slots(H)
        mv, n = self._mv, self.size
        mv[self.rank * H:(self.rank + 1) * H] = hdr
        try:
            self._ctx._cm().allgather(own, bufs, _AG, False, self._ctx.timeout_s, -1, 0)
        except Exception as e:   # noqa: BLE001 - the first error says more
            raise (cause or e) from None
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
