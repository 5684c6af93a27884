"""Point-to-point messages of the process group, with receive from any
source (``dist.recv(t)`` without ``src``, as Gloo has it).

The group's send/recv travel on connections of their own (a second
CollectiveContext), which carry nothing else, and each message is a
16-byte header (magic, payload bytes) followed by the payload.  A receive
from a named rank posts the header's receive and the payload's together.  A
receive from any source posts a header receive on every other rank's
connection (a *lookahead*; at most one per rank), takes the first header
that arrives, and only then posts the payload's receive on that rank's
connection.  The lookaheads that lost stay posted: each holds the next
message of its rank, which the next receive from that rank (named or any)
then takes, so nothing is lost and every rank's messages are taken in the
order it sent them.  Receives from any source are decided in the order they
were posted, and a receive from a named rank waits until those posted
before it are decided (they may take that rank's next message).

A receive whose header is taken before its payload is posted is the only
thing that changes the order of posting: it posts under the channel's
lock, as every post here does.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any

import torch

from ..p2p import UcclMismatchError, UcclTimeoutError

MAGIC = 0x75636370_32700001   # "uccp2p" v1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Recv:
    """A receive in flight (a Task's pending entry: test() and wait())."""

    def __init__(self, chan: "Channel", t: torch.Tensor, src: int | None):
        self.chan, self.t, self.src = chan, t, src
        self.hdr: torch.Tensor | None = None
        self.handles: list = []        # what must finish (header's, payload's)
        self.decided = src is not None

    def _check(self, cause: BaseException | None = None) -> None:
        """The header against the receive (after the payload's receive
        failed with cause: the header arrived before it, and says why)."""
        magic, n = self.hdr.tolist()
        if magic != MAGIC:
            if cause is not None:
                return   # (no header came: the engine's message stands)
            raise ValueError(f"recv from rank {self.src}: the message has no uccl header "
                             f"(magic {magic:#x}): the ranks' send/recv calls do not match")
        if n != _nbytes(self.t):
            raise UcclMismatchError(
                f"recv from rank {self.src}: size mismatch: rank {self.src} sent {n} bytes, the "
                f"receive tensor holds {_nbytes(self.t)} ({tuple(self.t.shape)} {self.t.dtype}); "
                "nothing was written") from cause

    def test(self) -> bool:
        if not self.decided:
            self.chan.progress()
            if not self.decided:
                return False
        try:
            if not all(h.test() for h in self.handles):
                return False
        except UcclMismatchError as e:
            self._check(e)
            raise
        self._check()
        return True

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if not self.decided:
            self.chan.progress(self, deadline)
        try:
            for h in self.handles:
                h.wait(max(deadline - time.monotonic(), 1e-3))
        except UcclMismatchError as e:   # the payload's size: the header says what came
            self._check(e)
            raise
        self._check()


class Channel:
    """Send/recv of one process group over ctx (a context of its own)."""

    def __init__(self, ctx: Any, rank: int, size: int):
        self.ctx, self.rank, self.size = ctx, rank, size
        self._lock = threading.Lock()
        self._lookahead: dict[int, tuple[torch.Tensor, Any]] = {}   # rank -> (header, handle)
        self._undecided: collections.deque[_Recv] = collections.deque()

    def _post(self, entries: list, what: str) -> Any:
        """Under the lock; CUDA payloads in a call of their own (the headers
        are CPU tensors)."""
        if any(t.is_cuda for _, t, _ in entries):
            return [self.ctx._p2p([e], what) for e in entries]
        return [self.ctx._p2p(entries, what)]

    def send(self, t: torch.Tensor, dst: int) -> list:
        hdr = torch.tensor([MAGIC, _nbytes(t)], dtype=torch.int64)
        with self._lock:
            return self._post([("send", hdr, dst), ("send", t, dst)], "send")

    def recv(self, t: torch.Tensor, src: int, deadline: float) -> list:
        """Posts a receive from src (after the receives from any source
        posted before it are decided)."""
        if self._undecided:
            self.progress(self._undecided[-1], deadline)
        r = _Recv(self, t, src)
        with self._lock:
            la = self._lookahead.pop(src, None)
            if la is None:
                r.hdr = torch.empty(2, dtype=torch.int64)
                r.handles = self._post([("recv", r.hdr, src), ("recv", t, src)], "recv")
            else:
                r.hdr, h = la
                r.handles = [h] + self._post([("recv", t, src)], "recv")
        return [r]

    def recv_any(self, t: torch.Tensor) -> _Recv:
        """Posts a receive from whichever rank's message comes first."""
        if self.size < 2:
            raise ValueError("recv from any source: the group has no other rank")
        r = _Recv(self, t, None)
        with self._lock:
            for p in range(self.size):
                if p != self.rank and p not in self._lookahead:
                    hdr = torch.empty(2, dtype=torch.int64)
                    self._lookahead[p] = (hdr, self.ctx._p2p([("recv", hdr, p)], "recv"))
            self._undecided.append(r)
        self._decide()
        return r

    def _decide(self) -> None:
        """Decides the receives from any source whose turn it is and whose
        header has come (lowest rank first when several have)."""
        with self._lock:
            while self._undecided:
                src = next((p for p, (_, h) in sorted(self._lookahead.items()) if h.test()),
                           None)
                if src is None:
                    return
                r = self._undecided.popleft()
                r.hdr, h = self._lookahead.pop(src)
                r.src = src
                r.handles = [h] + self._post([("recv", r.t, src)], "recv")
                r.decided = True

    def progress(self, until: _Recv | None = None, deadline: float | None = None) -> None:
        """Decides what can be decided; with until, polls until that
        receive is decided (UcclTimeoutError past deadline)."""
        pause = 2e-5
        while True:
            self._decide()
            if until is None or until.decided:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise UcclTimeoutError(
                    f"recv from any source (rank {self.rank}): no message from ranks "
                    f"{sorted(self._lookahead)} before the timeout")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
