"""A small two-rank harness: real processes on loopback, every wait bounded.

Each rank is a process started with multiprocessing's 'spawn' context.  A rank
function has the signature ``fn(ch, **kwargs)``; ``ch`` (a :class:`Chan`) lets
it exchange picklable values (metadata, fifo items, digests) with its peer and
report progress events to the parent test.  Whatever the function returns is
sent back to the parent; an exception in a rank becomes a test failure that
carries the rank's traceback.

The parent never waits without a deadline: a rank that does not finish in time
is SIGKILLed and the test fails (``pytest.fail``) saying which rank hung.

Data helpers: :func:`rand_bytes` (numpy ``default_rng`` with a seed, so both
ranks and the parent can produce the same bytes), :func:`poisoned` (a receive
buffer filled with :data:`POISON` plus a guard tail), :func:`sha` (sha256 hex).
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable

import numpy as np
import pytest

CTX = mp.get_context("spawn")

#: Environment every rank gets: loopback only, quiet engine logs.
BASE_ENV = {"UCCL_SOCKET_IFNAME": "lo", "UCCL_P2P_LOG_LEVEL": "ERROR"}

#: name -> (environment, the transport conn_transport() must report)
TRANSPORTS = {
    "tcp": ({"UCCL_P2P_TRANSPORT": "tcp"}, "tcp"),
    "shm-cma": ({"UCCL_P2P_TRANSPORT": "shm", "UCCL_P2P_SHM_MODE": "cma"}, "shm-cma"),
    "shm-ring": ({"UCCL_P2P_TRANSPORT": "shm", "UCCL_P2P_SHM_MODE": "ring"}, "shm-ring"),
}
TRANSPORT_NAMES = list(TRANSPORTS)

POISON = 0xA5          # receive buffers are filled with this before a transfer
GUARD = 4096           # bytes past every receive region that must stay POISON
MiB = 1 << 20
CHAN_TIMEOUT = 30.0    # default bound of a rank waiting for its peer


# --------------------------------------------------------------------------
# data helpers
def rand_bytes(n: int, seed: int) -> np.ndarray:
    """n reproducible random bytes (writable uint8 array) from ``seed``."""
    rng = np.random.default_rng(seed)
    return np.frombuffer(rng.bytes(n), dtype=np.uint8).copy() if n else np.zeros(0, np.uint8)


def poisoned(n: int, guard: int = GUARD) -> np.ndarray:
    """A buffer of n + guard bytes, all POISON."""
    return np.full(n + guard, POISON, dtype=np.uint8)


def sha(buf) -> str:
    """sha256 hex digest of a buffer (numpy array, bytes, memoryview)."""
    if isinstance(buf, np.ndarray):
        buf = np.ascontiguousarray(buf).view(np.uint8).reshape(-1)
    return hashlib.sha256(memoryview(buf)).hexdigest()


def all_poison(buf: np.ndarray) -> bool:
    return bool(np.all(buf.view(np.uint8) == POISON))


def addr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def catch(fn: Callable, *args, **kwargs):
    """Run fn; return (exception type name, message, is_value_error,
    is_uccl_error, is_timeout_error, elapsed_s), or None if it did not raise."""
    import uccl_collective

    t0 = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported back to the parent
        return dict(type=type(e).__name__, msg=str(e), value=isinstance(e, ValueError),
                    uccl=isinstance(e, uccl_collective.UcclError),
                    timeout=isinstance(e, uccl_collective.UcclTimeoutError),
                    elapsed=time.monotonic() - t0)
    return None


# --------------------------------------------------------------------------
# the channel a rank sees
class Chan:
    """A rank's view: ``send``/``recv`` tagged values to/from the peer,
    ``event`` to tell the parent something happened."""

    def __init__(self, name: str, to_peer, from_peer, events):
        self.name = name
        self._out, self._in, self._events = to_peer, from_peer, events

    def send(self, tag: str, value: Any = None) -> None:
        self._out.put((tag, value))

    def recv(self, tag: str, timeout: float = CHAN_TIMEOUT) -> Any:
        try:
            got_tag, value = self._in.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.name}: no {tag!r} from the peer within {timeout} s") from None
        if got_tag != tag:
            raise AssertionError(f"{self.name}: expected {tag!r} from the peer, got {got_tag!r}")
        return value

    def event(self, tag: str, value: Any = None) -> None:
        self._events.put((self.name, "event", (tag, value)))


def _rank_main(name, fn, env, to_peer, from_peer, events, kwargs):
    os.environ.update(env)  # before the engine reads it (at Endpoint creation)
    ch = Chan(name, to_peer, from_peer, events)
    try:
        res = fn(ch, **kwargs)
    except BaseException as e:  # noqa: BLE001
        events.put((name, "err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    else:
        events.put((name, "ok", res))


# --------------------------------------------------------------------------
# the parent's side
class Pair:
    """Two ranks, 'server' and 'client', with queues both ways.

    env applies to both ranks (on top of BASE_ENV); server_env / client_env
    to one.  Use as a context manager: on exit every rank still alive is
    killed and joined (bounded)."""

    def __init__(self, server: Callable, client: Callable, *, env: dict | None = None,
                 server_env: dict | None = None, client_env: dict | None = None,
                 server_kwargs: dict | None = None, client_kwargs: dict | None = None):
        self.events = CTX.Queue()
        # keep the queues referenced: a child unpickles them after start() returns
        self._queues = s2c, c2s = CTX.Queue(), CTX.Queue()
        common = {**BASE_ENV, **(env or {})}
        self.procs = {
            "server": CTX.Process(target=_rank_main, name="uccl-test-server", daemon=True,
                                  args=("server", server, {**common, **(server_env or {})},
                                        s2c, c2s, self.events, server_kwargs or {})),
            "client": CTX.Process(target=_rank_main, name="uccl-test-client", daemon=True,
                                  args=("client", client, {**common, **(client_env or {})},
                                        c2s, s2c, self.events, client_kwargs or {})),
        }
        self._results: dict[str, tuple[str, Any]] = {}
        self._events: list[tuple[str, str, Any]] = []

    def __enter__(self) -> "Pair":
        for p in self.procs.values():
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        for p in self.procs.values():
            p.join(10)

    def _pump(self, deadline: float) -> bool:
        """Move one message from the event queue into our buffers; False once
        the deadline passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            name, kind, value = self.events.get(timeout=min(left, 0.2))
        except queue.Empty:
            return True
        if kind == "event":
            self._events.append((name, value[0], value[1]))
        else:
            self._results[name] = (kind, value)
        return True

    def _fail(self, why: str) -> None:
        self.close()
        errs = "\n".join(f"--- {n} failed:\n{v}" for n, (k, v) in self._results.items() if k == "err")
        pytest.fail(f"{why}\n{errs}", pytrace=False)

    def wait_event(self, name: str, tag: str, timeout: float = CHAN_TIMEOUT) -> Any:
        """Wait (bounded) for rank `name` to report event `tag`; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            for i, (n, t, v) in enumerate(self._events):
                if n == name and t == tag:
                    del self._events[i]
                    return v
            if name in self._results:
                kind, val = self._results[name]
                self._fail(f"{name} finished ({kind}) before reporting {tag!r}")
            if not self._pump(deadline):
                self._fail(f"{name} did not report {tag!r} within {timeout} s")

    def tell(self, name: str, tag: str, value: Any = None) -> None:
        """Put a message where rank `name` reads its peer's messages (use
        once the peer is gone, or for a rank that expects the parent)."""
        s2c, c2s = self._queues
        (c2s if name == "server" else s2c).put((tag, value))

    def kill(self, name: str) -> None:
        """SIGKILL one rank and reap it."""
        p = self.procs[name]
        p.kill()
        p.join(10)
        assert not p.is_alive(), f"{name} survived SIGKILL"

    def result(self, name: str, timeout: float = 60.0) -> Any:
        """The return value of rank `name` (bounded wait); its exception fails the test."""
        deadline = time.monotonic() + timeout
        while name not in self._results:
            if not self.procs[name].is_alive() and self.procs[name].exitcode is not None:
                # drain what it may have queued right before exiting
                end = time.monotonic() + 2
                while name not in self._results and self._pump(end):
                    pass
                if name not in self._results:
                    self._fail(f"{name} died (exit code {self.procs[name].exitcode}) without a result")
                break
            if not self._pump(deadline):
                self._fail(f"{name} hung: no result within {timeout} s (killed)")
        kind, value = self._results[name]
        if kind == "err":
            self._fail(f"{name} raised")
        self.procs[name].join(10)
        return value

    def results(self, timeout: float = 60.0) -> tuple[Any, Any]:
        """(server result, client result), both within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        s = self.result("server", timeout)
        c = self.result("client", max(0.1, deadline - time.monotonic()))
        return s, c


def run_pair(server: Callable, client: Callable, *, timeout: float = 60.0, **kw) -> tuple[Any, Any]:
    """Run server and client ranks to completion; returns their results."""
    with Pair(server, client, **kw) as pair:
        return pair.results(timeout)


def run_one(fn: Callable, *, env: dict | None = None, timeout: float = 30.0, **kwargs) -> Any:
    """Run a single rank (no peer) in its own process; returns its result."""
    events = CTX.Queue()
    q1, q2 = CTX.Queue(), CTX.Queue()
    p = CTX.Process(target=_rank_main, daemon=True,
                    args=("solo", fn, {**BASE_ENV, **(env or {})}, q1, q2, events, kwargs))
    p.start()
    try:
        _name, kind, value = events.get(timeout=timeout)
    except queue.Empty:
        p.kill()
        p.join(10)
        pytest.fail(f"the rank hung: no result within {timeout} s (killed)", pytrace=False)
    p.join(10)
    if p.is_alive():
        p.kill()
        p.join(10)
    if kind == "err":
        pytest.fail(f"the rank raised:\n{value}", pytrace=False)
    return value
