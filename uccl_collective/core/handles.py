"""What CollectiveContext's non-blocking calls return: Handle (engine
operations and torch.distributed works in flight, and upstream's transfer
ids), StreamHandle (a stream-ordered operation: its wait() orders the
current stream), and the helpers that take handles back from a caller."""
from __future__ import annotations

import itertools
import numbers
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Sequence

from .. import _engine
from .._engine import UcclError, UcclTimeoutError
from . import stream_group

_handle_ids = itertools.count(1)


class Handle(int):
    """An operation in flight: engine operations and/or torch.distributed works
    (watched through Futures).

    A handle is also an int, as upstream's isend/irecv return transfer ids:
    a number unique in this process, or -1 for an operation with nothing to
    move (to or from the caller's own rank), as upstream's dummy id.

    test() never blocks; wait() blocks (timeout in seconds, default the
    context's) and raises the operation's error.  Both may be called again
    after completion.  A wait() that times out gives the operation up, as
    NCCL aborts a communicator: its ranks no longer agree on what comes next,
    so the context refuses later operations; poll with test() instead.  A
    torch.distributed part that times out cannot be cancelled (torch offers
    no way): its Gloo timeout still bounds it.  A handle dropped before its
    operation finished hands it (and its tensors) to the context, which
    keeps them until the operation is over.  On CUDA tensors wait() returns
    once the bytes are in place, so any work queued after it (on any stream)
    sees them; the operation itself started only after the work queued on
    the caller's current stream before the call.  (A stream-ordered
    iallgather returns a StreamHandle instead: its wait() orders the
    current stream only.)"""

    def __new__(cls, cm: _engine.Communicator | None, ops: Sequence[int] = (),
                works: Sequence = (), keep: Any = None, orphans: list | None = None):
        self = super().__new__(cls, next(_handle_ids) if (ops or works) else -1)
        self._cm, self._ops, self._works = cm, list(ops), list(works)
        self._done, self._error, self._keep = not (ops or works), None, keep
        self._orphans = orphans
        self._lock = threading.Lock()  # one thread advances it at a time
        return self

    def __repr__(self) -> str:
        return f"<Handle {int(self)} {'done' if self._done else 'in flight'}>"

    def __iter__(self):
        """A handle is also the one-element list of handles that upstream's
        iallgather returns, so `for h in ctx.iallgather(...)` works."""
        yield self

    def __del__(self):
        if not self._done and (self._ops or self._works) and self._orphans is not None:
            self._orphans.append(Handle(self._cm, self._ops, self._works, self._keep))

    def _finish(self, error: BaseException | None) -> None:
        self._done, self._error, self._keep = True, error, None
        self._ops, self._works = [], []

    def _settle(self, op_done: Callable, work_done: Callable) -> bool:
        """Advance through the parts in order; False at the first unfinished
        one.  The first error finishes the handle (after the rest is waited
        out) and is raised now and by every later call."""
        if self._done:
            if self._error:
                raise self._error
            return True
        try:
            while self._ops:
                if not op_done(self._ops[0]):
                    return False
                self._ops.pop(0)
            while self._works:
                if not work_done(self._works[0]):
                    return False
                self._works.pop(0)
        except BaseException as e:
            self._drain(works=not isinstance(e, UcclTimeoutError))
            self._finish(e)
            raise
        self._finish(None)
        return True

    def _drain(self, works: bool = True) -> None:
        """After an error: wait out the rest, so nothing lands after we return
        (torch.distributed works are left alone after a timeout: they cannot be
        cancelled, and waiting would defeat the timeout)."""
        for op in self._ops:
            try:
                self._cm.wait(op)
            except BaseException:
                pass
        for w in self._works if works else ():
            try:
                w.result()
            except BaseException:
                pass

    def test(self) -> bool:
        if not self._lock.acquire(blocking=False):
            return False  # another thread is waiting for it: not known to be done yet
        try:
            return self._settle(lambda op: self._cm.test(op),
                                lambda w: w.done() and w.result() is not False)
        finally:
            self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        def work_done(w: Future) -> bool:
            try:
                w.result(timeout)
            except FutureTimeout:
                raise UcclTimeoutError(f"torch.distributed transfer not done after {timeout} s "
                                       "(it stays posted until Gloo's own timeout)") from None
            return True
        with self._lock:
            return self._settle(lambda op: self._cm.wait(op, timeout), work_done)

    def is_completed(self) -> bool:
        return self.test()


class StreamHandle(Handle):
    """A stream-ordered operation (CUDA tensors, every peer on this host):
    wait() makes the caller's current stream wait for it and returns at
    once (the host never waits for the GPU), after which the handle is
    done (test() True, as after upstream's wait); before that, test() tells
    whether the GPU is past it.  A failed group makes both raise."""

    def __new__(cls, sg: Any, event: int, keep: Any):
        self = super().__new__(cls, None, (), (object(),))   # an id of its own
        self._works = []
        self._sg, self._event, self._keep = sg, event, keep
        return self

    def __del__(self):
        sg, ev = getattr(self, "_sg", None), getattr(self, "_event", 0)
        if sg is not None and ev and sg.c is not None:
            sg.c.event_free(ev)   # the driver frees it once its record has run

    def _check(self) -> None:
        if self._sg.c is None:
            raise UcclError("the context was finalized with this operation in flight")
        self._sg.check()

    def test(self) -> bool:
        self._check()
        return self._done or self._sg.c.event_query(self._event)

    def wait(self, timeout: float | None = None) -> bool:
        self._check()
        self._sg.c.event_wait(stream_group._raw_stream(self._sg.dev), self._event)
        self._done = True
        return True

    def is_completed(self) -> bool:
        return self.test()


_DONE = Handle(None)  # what upstream's dummy id -1 stands for


def _handle(h: Any, what: str) -> Handle:
    """h as a Handle: upstream's dummy id -1 (a plain int kept by the
    caller) is an operation already done; any other plain value is not ours."""
    if isinstance(h, Handle):
        return h
    if isinstance(h, numbers.Integral) and not isinstance(h, bool) and h == -1:
        return _DONE
    raise TypeError(f"{what}: {h!r} ({type(h).__name__}) is not a handle of this context "
                    "(isend, irecv, batch_isend_irecv and iallgather return them)")


def _flatten_handles(handles: Any) -> list:
    """Handles out of a Handle or (nested) lists of them, in order."""
    if isinstance(handles, numbers.Integral):
        return [_handle(handles, "wait_all")]
    out = []
    for h in handles:
        out.extend(_flatten_handles(h) if isinstance(h, (list, tuple)) else
                   [_handle(h, "wait_all")])
    return out
