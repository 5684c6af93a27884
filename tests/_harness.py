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

import faulthandler
import hashlib
import multiprocessing as mp
from multiprocessing import connection as mp_connection
import os
import signal
import socket
import subprocess
import time
import traceback
from typing import Any, Callable

import numpy as np
import pytest

import _ibv_emu

CTX = mp.get_context("spawn")

#: Environment every rank gets: loopback only, quiet engine logs.
BASE_ENV = {"UCCL_SOCKET_IFNAME": "lo", "UCCL_P2P_LOG_LEVEL": "ERROR"}

#: `python -c` of a client that connects to 127.0.0.1:argv[1], sends 4 KiB,
#: prints "sent" and waits to be killed (a peer that dies without a BYE).
SENDING_CLIENT = r"""
import os, sys, time
import numpy as np
from uccl_collective.p2p import Endpoint
ep = Endpoint(port=0, timeout_s=10)
ok, conn = ep.connect("127.0.0.1", -1, remote_port=int(sys.argv[1]))
b = np.full(4096, 7, np.uint8)
mr = ep.reg(b.ctypes.data, b.nbytes)[1]
ep.send(conn, mr, b.ctypes.data, b.nbytes)
print("sent", flush=True)
time.sleep(60)
"""

#: name -> (environment, the transport conn_transport() must report).  "rdma"
#: runs over the verbs emulator (tests/ibv_emu, built by conftest.py).
TRANSPORTS = {
    "tcp": ({"UCCL_P2P_TRANSPORT": "tcp"}, "tcp"),
    "shm-cma": ({"UCCL_P2P_TRANSPORT": "shm", "UCCL_P2P_SHM_MODE": "cma"}, "shm-cma"),
    "shm-ring": ({"UCCL_P2P_TRANSPORT": "shm", "UCCL_P2P_SHM_MODE": "ring"}, "shm-ring"),
    "rdma": ({"UCCL_P2P_TRANSPORT": "rdma", "UCCL_IBVERBS_LIB": str(_ibv_emu.OUT)}, "rdma"),
}
TRANSPORT_NAMES = list(TRANSPORTS)

POISON = 0xA5          # receive buffers are filled with this before a transfer
GUARD = 4096           # bytes past every receive region that must stay POISON
MiB = 1 << 20
CHAN_TIMEOUT = 30.0    # default bound of a rank waiting for its peer


def free_port() -> int:
    """A TCP port free on every local address right now (the OS picks it),
    for programs that listen on a port they are given: parallel runs never
    share one.  Another process may take it before it is used: a caller
    that can tell ("couldn't listen") asks again."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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


def have_cuda() -> bool:
    """torch is importable and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def kill_group(p) -> None:
    """SIGKILL the process group a subprocess.Popen(start_new_session=True)
    leads (the child and whatever it started), then reap it, bounded."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


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
#
# Every message travels over a one-way multiprocessing Pipe with exactly one
# writing process (peer -> rank, parent -> rank, rank -> parent).  Unlike
# mp.Queue there is no lock shared between processes, so SIGKILLing one rank
# can never leave a lock held that the survivor or the parent then waits on.
class Chan:
    """A rank's view: ``send``/``recv`` tagged values to/from the peer (the
    parent may also send to a rank, see :meth:`Pair.tell`), ``event`` to tell
    the parent something happened.  ``recv(tag)`` returns the first message
    with that tag, keeping others for later."""

    def __init__(self, name: str, to_peer, from_peer, from_parent, to_parent):
        self.name = name
        self._out, self._to_parent = to_peer, to_parent
        self._sources = [c for c in (from_peer, from_parent) if c is not None]
        self._buf: list[tuple[str, Any]] = []

    def send(self, tag: str, value: Any = None) -> None:
        self._out.send((tag, value))

    def recv(self, tag: str, timeout: float = CHAN_TIMEOUT) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            for i, (t, v) in enumerate(self._buf):
                if t == tag:
                    del self._buf[i]
                    return v
            left = deadline - time.monotonic()
            if left <= 0 or not self._sources:
                raise TimeoutError(f"{self.name}: no {tag!r} within {timeout} s "
                                   f"(have {[t for t, _ in self._buf]})")
            for c in mp_connection.wait(self._sources, timeout=left):
                try:
                    self._buf.append(c.recv())
                except (EOFError, OSError):
                    self._sources.remove(c)

    def event(self, tag: str, value: Any = None) -> None:
        self._to_parent.send(("event", (tag, value)))


#: Two hosts (tests/test_rdma_netns.py): "<netns>:<veth>:<ip>,<netns>:<veth>:<ip>" puts rank
#: "server" in the first network namespace and "client" in the second, each with its own host
#: id, its veth as the engine's interface and the verbs emulator's port on its address.
NETNS_ENV = "UCCL_TEST_NETNS"
CLONE_NEWNET = 0x40000000


def _enter_netns(name: str, env: dict) -> dict:
    """Move this rank into its network namespace (before the engine starts a
    thread: later threads inherit it); returns env with that host's settings."""
    import ctypes

    nodes = [n.split(":") for n in os.environ[NETNS_ENV].split(",")]
    me = 0 if name == "server" else 1
    ns, veth, ip = nodes[me]
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {ns}")
    finally:
        os.close(fd)
    return {**env, "UCCL_SOCKET_IFNAME": veth, "UCCL_P2P_HOST_ID": f"host-{ns}",
            "UCCL_IBV_EMU_IPV4": ip, "UCCL_TEST_PEER_IP": nodes[1 - me][2]}


def peer_ip() -> str:
    """In a rank: the address its peer's endpoint is on (loopback, or the other
    host's in two-host runs)."""
    return os.environ.get("UCCL_TEST_PEER_IP", "127.0.0.1")


def _rank_main(name, fn, env, to_peer, from_peer, from_parent, to_parent, kwargs):
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent dumps a hung rank's stacks
    if os.environ.get(NETNS_ENV):
        env = _enter_netns(name, env)
    os.environ.update(env)  # before the engine reads it (at Endpoint creation)
    ch = Chan(name, to_peer, from_peer, from_parent, to_parent)
    try:
        res = fn(ch, **kwargs)
    except BaseException as e:  # noqa: BLE001
        to_parent.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    else:
        to_parent.send(("ok", res))


def _pipe():
    return CTX.Pipe(duplex=False)  # (reader, writer)


# --------------------------------------------------------------------------
# the parent's side
class Pair:
    """Ranks 'server' and 'client' (or a single rank, see run_one), with
    pipes both ways between them and to/from the parent.

    env applies to both ranks (on top of BASE_ENV); server_env / client_env
    to one.  Use as a context manager: on exit every rank still alive is
    killed and joined (bounded)."""

    def __init__(self, server: Callable, client: Callable | None, *, env: dict | None = None,
                 server_env: dict | None = None, client_env: dict | None = None,
                 server_kwargs: dict | None = None, client_kwargs: dict | None = None):
        common = {**BASE_ENV, **(env or {})}
        names = ["server"] + (["client"] if client is not None else [])
        peer = {n: _pipe() for n in names}          # peer[n]: messages *to* rank n from its peer
        self._from_parent = {n: _pipe() for n in names}
        self._to_parent = {n: _pipe() for n in names}
        fns = {"server": server, "client": client}
        envs = {"server": server_env, "client": client_env}
        kws = {"server": server_kwargs, "client": client_kwargs}
        other = {"server": "client", "client": "server"}
        self.procs = {}
        for n in names:
            to_peer = peer[other[n]][1] if other[n] in peer else _pipe()[1]
            self.procs[n] = CTX.Process(
                target=_rank_main, name=f"uccl-test-{n}", daemon=True,
                args=(n, fns[n], {**common, **(envs[n] or {})}, to_peer, peer[n][0],
                      self._from_parent[n][0], self._to_parent[n][1], kws[n] or {}))
        self._keep = peer  # referenced until the children have unpickled them
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
        """Take what the ranks have sent the parent (waiting at most 0.2 s);
        False once the deadline passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        readers = {self._to_parent[n][0]: n for n in self.procs}
        for c in mp_connection.wait(list(readers), timeout=min(left, 0.2)):
            try:
                kind, value = c.recv()
            except (EOFError, OSError):
                continue
            n = readers[c]
            if kind == "event":
                self._events.append((n, value[0], value[1]))
            else:
                self._results[n] = (kind, value)
        return True

    def _dump_stacks(self) -> None:
        """Ask every live rank to print its Python stacks (to the captured stderr)."""
        alive = [p for p in self.procs.values() if p.is_alive()]
        for p in alive:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except OSError:
                pass
        if alive:
            time.sleep(0.5)

    def _fail(self, why: str) -> None:
        if "hung" in why or "did not report" in why:
            self._dump_stacks()
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
        """Send rank `name` a message it reads with ch.recv(tag)."""
        self._from_parent[name][1].send((tag, value))

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
            p = self.procs[name]
            if not p.is_alive():
                end = time.monotonic() + 1  # take what it sent right before exiting
                while name not in self._results and self._pump(end):
                    pass
                if name not in self._results:
                    self._fail(f"{name} died (exit code {p.exitcode}) without a result")
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


def run_ranks(target: Callable, ws: int, args: tuple = (), timeout: float = 120.0) -> dict:
    """target(rank, ws, *args, queue) in ws spawned processes, each putting
    (rank, result) on the queue, or (rank, "Error: ...") where it failed;
    returns {rank: result}, having failed the test naming any rank's error.
    Processes still alive at the end are killed."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=target, args=(r, ws, *args, q)) for r in range(ws)]
    for p in ps:
        p.start()
    try:
        got = dict(q.get(timeout=timeout) for _ in ps)
    finally:
        for p in ps:
            p.join(20)
            if p.is_alive():
                p.kill()
    for r in range(ws):
        assert not isinstance(got[r], str), f"rank {r}: {got[r]}"
    return got


def run_pair(server: Callable, client: Callable, *, timeout: float = 60.0, **kw) -> tuple[Any, Any]:
    """Run server and client ranks to completion; returns their results."""
    with Pair(server, client, **kw) as pair:
        return pair.results(timeout)


def run_one(fn: Callable, *, env: dict | None = None, timeout: float = 30.0, **kwargs) -> Any:
    """Run a single rank (no peer) in its own process; returns its result."""
    with Pair(fn, None, env=env, server_kwargs=kwargs) as pair:
        return pair.result("server", timeout)
