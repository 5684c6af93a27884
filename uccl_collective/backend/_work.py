"""Ordered execution of a process group's operations, and their Work objects.

Every rank must put the same operations on its connections in the same
order (messages on a connection match in posting order, as with NCCL).  So
a group runs its operations as *tasks* through one FIFO: a task runs only
after every task submitted before it has run.  A blocking call
(``asyncOp=False``) runs its task on the calling thread, after helping the
tasks ahead of it along: no thread handoff.  An ``async_op=True`` call
queues its task for the group's runner thread and returns at once.

A task is a Python function that posts engine operations and, for a
collective, waits for them (a ring reduce-scatter reduces between steps).
A point-to-point task only posts: ``batch_isend_irecv`` issues a send and
then a receive on both ranks, so a send that waited for its receiver would
deadlock both.  What a task leaves in flight (its ``pending`` handles) is
waited for by ``Work.wait()``.

``Work`` subclasses ``torch.distributed._Work``: torch's future-wrapping
Work does not raise from wait() when its future failed, and a failed
transfer must raise.
"""
from __future__ import annotations

import collections
import datetime
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import _engine
from ..core.stream_group import _raw_stream, failure
from . import _profiling
from ..p2p import UcclError, UcclTimeoutError

#: Runner.submit's run_now for point-to-point posts: run here only when
#: nothing is ahead (a post must not wait behind a long collective).
IF_IDLE = "if-idle"

#: Works kept alive for torch's C++ side (kept()): the last KEEP_WORKS of
#: those whose tensors hold at most KEEP_BYTES.
KEEP_WORKS, KEEP_BYTES = 128, 64 << 10
_KEPT: collections.deque = collections.deque(maxlen=KEEP_WORKS)


def _small(result: Any, budget: int) -> int:
    """budget less the bytes of the tensors in result (nested lists too;
    a sparse tensor counted as its dense form); negative once past it."""
    for t in result:
        budget = _small(t, budget) if isinstance(t, (list, tuple)) else \
            budget - (t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0)
        if budget < 0:
            break
    return budget


def kept(work: dist._Work, result: Any) -> None:
    """Keeps the Work of a small operation alive a while.  torch hands a
    Python group's Work to its C++ side as it is: DDP's reducer keeps the
    forward pass's all_reduce of the count of ranks not yet joined (Join)
    and waits for it, and reads its future, in the backward pass, after the
    Python side dropped it.  Once the Python object is gone, the C++ object
    answers wait() as torch's base Work does, which waits for ever, and
    get_future() with an error.  Groups torch makes in C++ wrap such Works in
    a holder of the Python object; a Python ProcessGroup's are not wrapped.
    So the Works of small operations (counts, flags: at most KEEP_BYTES of
    tensors) stay alive until KEEP_WORKS later ones are made; large ones are
    not kept (their tensors would stay with them)."""
    if _small(result, KEEP_BYTES) >= 0:
        _KEPT.append(work)


class Task:
    __slots__ = ("fn", "result", "ran", "error", "pending", "future", "lock", "device", "prof",
                 "source", "gpu_end", "stream", "check")

    def __init__(self, fn: Callable[[], list | None] | None, result: list,
                 device: int | None = None, prof: Any = None):
        self.fn, self.result = fn, result
        self.device = device          # CUDA device of its tensors, or None
        self.prof = prof              # its open profiler event (_profiling), or None
        self.source: Callable[[], int] | None = None   # recv from any source: the sender
        self.ran = False
        self.error: BaseException | None = None
        self.pending: list = []       # Handles the task left in flight
        self.future: torch.futures.Future | None = None
        self.lock = threading.Lock()  # one thread settles the pending handles
        # stream-ordered (the backend's _on_stream): the event its queued work
        # completes, the stream it ran on, and a check of the group's health
        self.gpu_end: Any = None
        self.stream: Any = None
        self.check: Callable[[], None] | None = None

    def settle_pending(self, deadline: float | None) -> bool:
        """After the task ran: wait for (deadline) or test (None) what it
        left in flight, then complete its future if it has one.  True when
        done, error or not."""
        if self.pending and not self._settle_handles(deadline):
            return False
        if self.prof is not None:
            with self.lock:
                prof, self.prof = self.prof, None
            _profiling.end(prof)
        self.finish_future()
        return True

    def _settle_handles(self, deadline: float | None) -> bool:
        if not self.lock.acquire(blocking=deadline is not None):
            return False
        try:
            while self.pending and self.error is None:
                h = self.pending[0]
                try:
                    if deadline is None:
                        if not h.test():
                            return False
                    else:
                        h.wait(max(deadline - time.monotonic(), 1e-3))
                except BaseException as e:
                    self.error = e
                    break
                self.pending.pop(0)
            self.pending = []
        finally:
            self.lock.release()
        return True

    def finish_future(self) -> None:
        fut = self.future
        if fut is not None and not fut.done():
            err = self.error
            if err is not None and not isinstance(err, Exception):
                err = UcclError(f"interrupted: {err!r}")  # a Future takes Exceptions only
            try:
                if err is not None:
                    fut.set_exception(err)
                elif self.stream is not None:
                    # a CUDA future records the current stream: the one the work is on
                    with torch.cuda.stream(self.stream):
                        fut.set_result(self.result)
                else:
                    fut.set_result(self.result)
            except RuntimeError:
                pass  # completed by another thread meanwhile


def _execute(task: Task) -> None:
    """Run a task's function, keeping its error for wait() (KeyboardInterrupt
    included) and what it left in flight."""
    try:
        task.pending = list(task.fn() or ())
    except BaseException as e:
        task.error = e
    task.fn = None


class Runner(_engine.Token):
    """The FIFO of one process group, and its execution *token*: a thread
    holding the token runs the head task (the caller of a blocking
    operation, a waiter, or the group's runner thread, which takes queued
    tasks nobody is waiting for), or an inline call.

    The token is this object's C part (_engine.Token, csrc/py/py_token.c),
    so that the backend's one-call routes take it in C as a task takes it
    here (core/dispatch.py, rows 1 and 2): whoever holds it runs the
    group's next call, in issue order.  It keeps whether it is taken
    (busy) and why the group refuses new tasks (closed, poisoned: a reason,
    or None), which this class reads and sets under its lock, as it
    changes its queue; it is given the Condition and the queue, and takes
    the lock, gives the token back and wakes the waiters through them.

    Futures are completed on separate delivery threads, never on the runner
    thread nor under the lock: a future's callbacks run on the thread that
    completes it, and a callback may issue and wait for another operation
    (DDP's PowerSGD hook does), which only the runner thread may be free to
    run."""

    DELIVERY_THREADS = 8

    def __init__(self, name: str, timeout_s: float):
        self._name, self.timeout_s = name, timeout_s
        self._q: collections.deque[Task] = collections.deque()
        self._cv = threading.Condition(threading.RLock())
        super().__init__(self._cv, self._q)
        self._thread: threading.Thread | None = None
        self._delivery: ThreadPoolExecutor | None = None

    #: inline(fn, *args) -> (True, fn(*args)) run on this thread holding the
    #: token, as a task at the head of the queue would run; or (False, None)
    #: without running it when a task is queued or running, or the group is
    #: closed or poisoned (the caller then takes the general path, which
    #: queues or raises).  For calls that go straight to the engine: nothing
    #: else of the group's can start while fn runs.  (The token's own call,
    #: in C: Token.run.)
    inline = _engine.Token.run

    @property
    def _busy(self) -> bool:
        """Whether the token is taken (a task or an inline call runs)."""
        return self.busy

    def submit(self, task: Task, run_now: bool | str, deadline: float) -> None:
        """run_now True: run it on this thread (after those ahead of it);
        "if-idle": only when nothing is ahead of it; False: the runner
        thread runs it."""
        with self._cv:
            why = self.refused   # closed, else poisoned, else None
            if why:
                raise UcclError(f"process group {self._name}: {why}")
            if run_now == IF_IDLE:
                run_now = not self.busy and not self._q
            self._q.append(task)
            if not run_now:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, daemon=True,
                                                    name=f"uccl-pg-{self._name}")
                    self._thread.start()
                self._cv.notify_all()
                return
        self.drive(task, deadline, give_up=True)

    def poison(self, why: str) -> None:
        """Refuse new tasks from now on (the ranks' orders no longer agree)."""
        with self._cv:
            self.poisoned = self.poisoned or why

    def run_here(self, task: Task) -> bool:
        """A blocking call's task run on this thread at once, holding the
        token (inline), when nothing of the group's is queued or running:
        no queue and no hand-off, which on the GPU machine's host is most
        of a small CPU collective's Python.  False: not run (submit it)."""
        ran, _ = self.inline(_execute, task)
        if ran:
            task.ran = True   # (nobody else holds the task yet: no lock needed)
        return ran

    def _run_head(self) -> None:
        """Under the lock, token free, queue not empty: run the head task
        without the lock."""
        task = self._q.popleft()
        self.busy = True
        self._cv.release()
        try:
            _execute(task)
        finally:
            self._cv.acquire()
            task.ran = True
            self.busy = False
            self._cv.notify_all()
        if task.future is not None:  # someone holds its future: complete it
            self._deliver(task)

    def _deliver(self, task: Task) -> None:
        """Under the lock: complete task's future (after what it left in
        flight) on a delivery thread."""
        def settle() -> None:
            task.settle_pending(time.monotonic() + self.timeout_s)
        if self._delivery is None and not self.closed:
            self._delivery = ThreadPoolExecutor(self.DELIVERY_THREADS,
                                                thread_name_prefix=f"uccl-pg-{self._name}-fut")
        try:
            if self._delivery is not None:
                self._delivery.submit(settle)
                return
        except RuntimeError:
            pass  # shut down
        # closed: the endpoint is gone, so this ends at once
        threading.Thread(target=settle, daemon=True).start()

    def future_of(self, task: Task) -> torch.futures.Future:
        with self._cv:
            if task.future is None:
                # A future holding CUDA tensors must be told their device:
                # one made for the CPU refuses them when completed.
                task.future = torch.futures.Future() if task.device is None else \
                    torch.futures.Future(devices=[torch.device("cuda", task.device)])
                # A fresh future has no callbacks yet: when the task is over
                # it completes right here, so value() works at once after
                # wait(), as torch documents.
                if task.ran and not task.settle_pending(None):
                    self._deliver(task)   # still in flight
                # not run yet: whoever runs it delivers the future (_run_head)
            return task.future

    def drive(self, task: Task, deadline: float, run_here: bool = True,
              give_up: bool = False) -> None:
        """Return once task has run (running it and those ahead of it here
        when the token is free and run_here); UcclTimeoutError past
        deadline.  A task runs to its end under the group's timeout, so a
        waiter with a shorter deadline of its own must leave it to the
        runner thread.  give_up (the group's own timeout): a task that has
        not started by then is taken off the queue, and the group refuses
        what comes after (its ranks no longer agree on the order: NCCL
        aborts the communicator)."""
        with self._cv:
            while not task.ran:
                if run_here and not self.busy and self._q:
                    self._run_head()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    err = UcclTimeoutError(f"process group {self._name}: operation not started "
                                           "or not finished within the timeout")
                    if give_up and task in self._q:
                        self._q.remove(task)
                        task.ran, task.error, task.fn = True, err, None
                        self.poisoned = (f"an operation did not start within the group's "
                                         f"timeout ({self.timeout_s:g} s), so the ranks no "
                                         "longer agree on what comes next")
                        if task.future is not None:
                            self._deliver(task)
                    raise err
                self._cv.wait(min(left, 1.0))

    def _loop(self) -> None:
        with self._cv:
            while True:
                if self.closed and not self._q:
                    return
                if not self.busy and self._q:
                    self._run_head()
                else:
                    self._cv.wait()

    def close(self, why: str) -> None:
        """No new tasks; those queued still run (their transfers fail once
        the endpoint is closed) so every Work settles."""
        with self._cv:
            self.closed = self.closed or why
            self._cv.notify_all()
            thread, ex = self._thread, self._delivery
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        if ex is not None:
            ex.shutdown(wait=False)


class Work(dist._Work):
    """A process-group operation: wait() raises its error; get_future()'s
    value is the list of output tensors (what DDP communication hooks
    expect).

    On CUDA tensors of a group whose ranks share a host (stream-ordered
    exchanges, core/stream_group.py) wait() orders the caller's current stream
    after the operation and returns without waiting for the GPU, as
    ProcessGroupNCCL's does; is_completed() tells whether the GPU is past
    it; get_future()'s value is ready on the host once the operation is
    queued, and its CUDA events order whoever waits on it after the
    operation, as NCCL's.  Elsewhere (peers on other hosts) wait() returns
    once the bytes are in place: the engine's transfers are driven by host
    threads there.  synchronize() is wait(), as with NCCL."""

    def __init__(self, runner: Runner, task: Task):
        super().__init__()
        self._runner, self._task = runner, task
        kept(self, task.result)

    def _done(self) -> bool:
        t = self._task
        return t.ran and t.settle_pending(None) and (t.gpu_end is None or t.gpu_end.query())

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        own = bool(secs) and 0 < secs < self._runner.timeout_s
        deadline = time.monotonic() + (secs if own else self._runner.timeout_s)
        t = self._task
        self._runner.drive(t, deadline, run_here=not own, give_up=not own)
        t.settle_pending(deadline)
        if t.error is not None:
            raise t.error
        if t.gpu_end is not None:
            t.check()   # the group failed since (a peer died): the bytes are not to be trusted
            torch.cuda.current_stream(t.device).wait_event(t.gpu_end)
        return True

    def synchronize(self) -> None:
        self.wait()   # as WorkNCCL::synchronize: on CUDA the current stream waits

    def is_completed(self) -> bool:
        return self._done()

    def is_success(self) -> bool:
        return self._done() and self._task.error is None

    def exception(self) -> Any:
        self._done()
        return self._task.error

    def result(self) -> list:
        self.wait()
        return self._task.result

    def source_rank(self) -> int:
        """The rank a receive from any source took its message from (as
        Gloo's; torch's dist.recv(src=None) returns it)."""
        if self._task.source is None:
            raise ValueError("source_rank: this Work is not a receive from any source")
        self.wait()
        return self._task.source()

    _source_rank = source_rank

    def get_future(self) -> torch.futures.Future:
        return self._runner.future_of(self._task)


class ResultWork(dist._Work):
    """What a Work that holds its result (`_result`) and is no receive from
    any source answers from its wait()."""

    def synchronize(self) -> None:
        self.wait()

    def result(self) -> list:
        self.wait()
        return self._result

    def source_rank(self) -> int:
        raise ValueError("source_rank: this Work is not a receive from any source")

    _source_rank = source_rank


class _GroupWork(ResultWork):
    """What the Works of a stream-ordered group share: the group (`_sg`),
    the result, and the calls that follow from wait() and is_completed()."""

    def _c(self) -> Any:
        """The group's engine object, checked (read once: close() may clear
        it); raises where the group was shut down or failed since (a peer
        died: the bytes are not to be trusted)."""
        c = self._sg.c
        if c is None:
            raise UcclError("the process group was shut down")
        err = c.error()
        if err is not None:
            raise UcclError(failure(self._sg.rank, err))
        return c

    def _error(self) -> str | None:
        c = self._sg.c
        return c.error() if c is not None else None

    def is_success(self) -> bool:
        return self.is_completed() and self._error() is None

    def exception(self) -> Any:
        err = self._error()
        return UcclError(f"stream-ordered group: {err}") if err else None


class StreamWork(_GroupWork):
    """A blocking call's Work on the stream-ordered path (the engine queued
    the operation on the group's stream in one call, and the caller's stream
    waits for its end, as ProcessGroupNCCL's does): wait() raises if the
    group failed since, and makes the current stream wait too where it is
    not the caller's; is_completed() tells whether the GPU is past it."""

    def __init__(self, sg: Any, k: int, result: list, caller: int):
        super().__init__()
        self._sg, self._k, self._result, self._caller = sg, k, result, caller
        kept(self, result)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        c = self._c()
        cur = _raw_stream(self._sg.dev)
        if cur != self._caller:
            c.wait_last(cur)
        return True

    def is_completed(self) -> bool:
        c = self._sg.c
        return c is None or c.passed(self._k)

    def get_future(self) -> torch.futures.Future:
        """Complete: its value is ready on the host, and torch's CUDA future
        orders whoever waits on it after the caller's stream, which waits
        for the operation."""
        fut = torch.futures.Future(devices=[torch.device("cuda", self._sg.dev)])
        fut.set_result(self._result)
        return fut


class P2PWork(_GroupWork):
    """A send or receive of CUDA tensors on the stream-ordered path
    (csrc/sg/sg_p2p.c: posted without any host wait): wait() makes the current
    stream wait for the message to be in place, whichever side copies it,
    and returns at once, as ProcessGroupNCCL's does; is_completed() tells
    whether it is; the group's failure (a peer gone, sizes that differ, a
    message not in place within the timeout) raises from wait() and is
    exception()."""

    def __init__(self, sg: Any, codes: list[int], result: list):
        super().__init__()
        self._sg, self._codes, self._result = sg, codes, result
        kept(self, result)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        c = self._c()
        cur = _raw_stream(self._sg.dev)
        for code in self._codes:
            c.p2p_wait(code, cur)
        return True

    def is_completed(self) -> bool:
        c = self._sg.c
        return c is None or all(c.p2p_passed(code) for code in self._codes)

    def get_future(self) -> torch.futures.Future:
        """Completes once the message is in place (at once if it is), or
        with the group's error: a receive whose sender died raises from the
        future's wait() within the group's timeout.  Its CUDA events are
        recorded on a stream of the group's that waited for the message."""
        fut = torch.futures.Future(devices=[torch.device("cuda", self._sg.dev)])
        if self.is_completed():
            self._complete(fut)
        else:
            threading.Thread(target=self._deliver, args=(fut,), daemon=True,
                             name="uccl-p2p-future").start()
        return fut

    def _complete(self, fut: torch.futures.Future) -> None:
        try:
            with torch.cuda.stream(self._sg.future_stream()):
                self.wait()
                fut.set_result(self._result)
        except Exception as e:   # noqa: BLE001 - the future carries it
            fut.set_exception(e)

    def _deliver(self, fut: torch.futures.Future) -> None:
        """Polls (bounded: the group's watchdog fails a message not in
        place within the timeout, which is_completed() then sees)."""
        pause = 2e-5
        while self._error() is None and not self.is_completed():
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        self._complete(fut)
