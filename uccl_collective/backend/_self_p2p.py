"""Sends to and receives from this rank itself, as NCCL takes them (a
`batch_isend_irecv` where a rank names itself, e.g. every rank exchanging
with every rank including itself): no engine connection is involved, sends
and receives are matched in the order they are posted (the tag is not
used, as for the group's other messages), and the bytes are copied in this
process.

A send posted before its receive is buffered (a copy of the tensor, taken
on the current stream), so it completes at once, as a small NCCL send
does; a receive posted first completes when the send comes.  On CUDA
tensors the copies are queued on the current stream of the call that makes
the match, and a receive's wait() orders the caller's current stream after
them (no host wait), as ProcessGroupNCCL's do.  A receive no send comes
for raises from wait() at the group's timeout."""
from __future__ import annotations

import collections
import datetime
import threading
from typing import Any

import torch

from .._engine import UcclTimeoutError
from ._work import ResultWork, kept


class SelfWork(ResultWork):
    """The Work of a send to, or receive from, this rank."""

    def __init__(self, result: list, what: str, timeout_s: float):
        super().__init__()
        self._result, self._what, self._timeout_s = result, what, timeout_s
        self._done = threading.Event()
        self._event: torch.cuda.Event | None = None   # after the copy, on CUDA
        self._futures: list[torch.futures.Future] = []
        self._lock = threading.Lock()
        kept(self, result)

    def complete(self, event: torch.cuda.Event | None = None) -> None:
        with self._lock:
            self._event = event
            self._done.set()
            futs, self._futures = self._futures, []
        for f in futs:
            f.set_result(self._result)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        limit = secs if secs and secs > 0 else self._timeout_s
        if not self._done.wait(limit):
            raise UcclTimeoutError(f"{self._what}: no matching send to this rank was posted "
                               f"within {limit:.1f} s")
        if self._event is not None:
            torch.cuda.current_stream(self._event.device).wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return self._done.is_set() and (self._event is None or self._event.query())

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> Any:
        return None

    def get_future(self) -> torch.futures.Future:
        fut = torch.futures.Future()
        with self._lock:
            if not self._done.is_set():
                self._futures.append(fut)
                return fut
        fut.set_result(self._result)
        return fut


def _copy(dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
    """dst <- src (same element count) on the current stream; on CUDA the
    event after the copy."""
    dst.view(-1).copy_(src.reshape(-1))
    if dst.is_cuda:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dst.device))
        return ev
    return None


class SelfBox:
    """One group's posted, unmatched self sends (buffered copies) and
    receives (their tensors and Works), in posting order."""

    def __init__(self, rank: int, timeout_s: float):
        self._rank, self._timeout_s = rank, timeout_s
        self._sends: collections.deque = collections.deque()
        self._recvs: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def _check(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.numel() != b.numel() or a.dtype != b.dtype:
            raise ValueError(f"send/recv to this rank ({self._rank}): the send has "
                             f"{a.numel()} elements of {a.dtype}, the receive {b.numel()} of "
                             f"{b.dtype}")

    def send(self, t: torch.Tensor, tensors: list) -> SelfWork:
        work = SelfWork(tensors, f"send to this rank ({self._rank})", self._timeout_s)
        with self._lock:
            waiting = self._recvs
            if waiting:
                dst, rwork = waiting[0]
                self._check(t, dst)
                waiting.popleft()
            else:
                self._sends.append(t.detach().clone(memory_format=torch.contiguous_format))
                dst = None
        if dst is not None:
            ev = _copy(dst, t)
            rwork.complete(ev)
            work.complete(ev)
        else:
            work.complete(None)
        return work

    def recv(self, t: torch.Tensor, tensors: list) -> SelfWork:
        work = SelfWork(tensors, f"recv from this rank ({self._rank})", self._timeout_s)
        with self._lock:
            queued = self._sends
            if queued:
                self._check(queued[0], t)
                src = queued.popleft()
            else:
                self._recvs.append((t, work))
                return work
        work.complete(_copy(t, src))
        return work
