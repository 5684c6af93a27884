"""Regression tests for races and hostile peers that once broke the engine.

Each test replays a scenario that used to crash the process, hang, leak bytes
into a buffer its owner had been told was free, or lose track of a transfer:

1. close() from another thread while a blocking shm-cma recv of 512 MiB is
   being pulled: the process survives (exit code 0) and the recv raises,
   saying the endpoint was closed.
2. A hand-written TCP peer that announces an eager 64 KiB message, sends 100
   payload bytes and hangs up: wait()/poll_async() fail within 2 s (not after
   the 10 s timeout) and nothing past those 100 bytes is touched.  A peer that
   sends a garbage control message fails only that connection: the pending recv
   raises a protocol error, the process lives on, and the same endpoint then
   serves a normal client byte-exactly.
3. A one-sided shm-cma read (1 GiB) whose initiator times out: once read() raised,
   nothing lands in the destination any more.
4. dereg() on the target while a peer's one-sided write into that window is in
   flight (shm-cma, shm-ring, tcp): once dereg() returned, no byte of the window
   changes; the write completes (and then every byte had landed) or raises.
5. Transfer ids: a finished async transfer is still answered done after 70,000
   later transfers, until release(); release() of a transfer still in flight is
   refused and the transfer completes normally.
6. sendv/recvv with one iov of a different size on each side: both calls raise,
   every other iov is either exactly right or untouched, and nothing lands
   after the calls return.

Every scenario runs in child processes of the harness (a crash or hang there
fails the test instead of killing pytest), on real random or patterned data,
with poisoned receive buffers, and every wait is bounded.
"""
from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

import _wire

from _harness import (MiB, POISON, TRANSPORTS, Pair, addr, all_poison, catch, poisoned,
                      rand_bytes, run_pair)

SENTINEL = 0x3C    # written over a buffer once the engine must have let go of it
BIG = 512 * MiB    # large enough that the race window is real on CMA, ring and TCP


def pattern(n: int, seed: int) -> np.ndarray:
    """n bytes of a random block of 1 MiB + 7 bytes repeated: cheap to make at
    512 MiB, yet a chunk written at a wrong offset does not match."""
    return np.resize(rand_bytes(MiB + 7, seed), n)


def _endpoint(timeout_s):
    from uccl_collective.p2p import Endpoint

    return Endpoint(port=0, timeout_s=timeout_s)


def _accept(ch, timeout_s=30):
    ep = _endpoint(timeout_s)
    ch.send("meta", ep.get_metadata())
    conn = ep.accept(timeout=20)[3]
    return ep, conn


def _connect(ch, timeout_s=30):
    ep = _endpoint(timeout_s)
    conn = ep.add_remote_endpoint(ch.recv("meta"))[1]
    return ep, conn


def _sample_written(buf: np.ndarray, fresh: int) -> float:
    """Fraction of sampled bytes (one per 64 KiB) that no longer hold `fresh`."""
    s = buf[::65536]
    return float(np.count_nonzero(s != fresh)) / max(1, s.size)


def _snap(bufs):
    """One byte per 4 KiB page of each buffer, copied."""
    return [b[::4096].copy() for b in bufs]


def _late_bytes(bufs, settle: float, snaps=None) -> tuple[int, int]:
    """Check that nothing lands in `bufs` any more, twice over.

    First one byte per 4 KiB page is snapshotted at once (microseconds, so a
    copy still running right after the call returned is caught even if it
    would finish before a full refill could), and compared after `settle`
    seconds (pass `snaps` taken earlier with :func:`_snap`); then every byte
    is refilled with SENTINEL and checked after `settle` seconds more.
    Returns (sampled bytes changed, bytes changed)."""
    snaps = snaps if snaps is not None else _snap(bufs)
    time.sleep(settle)
    sampled = sum(int(np.count_nonzero(b[::4096] != s)) for b, s in zip(bufs, snaps))
    for b in bufs:
        b.fill(SENTINEL)
    time.sleep(settle)
    return sampled, sum(int(np.count_nonzero(b != SENTINEL)) for b in bufs)


# --------------------------------------------------------------------------
# 1. close() while the caller's own thread is pulling a large CMA recv
def _close_receiver(ch):
    ep, conn = _accept(ch)
    tp = ep.conn_transport(conn)
    dst = poisoned(BIG)
    mr = ep.reg(addr(dst), dst.nbytes)[1]
    ch.recv("posted")
    time.sleep(0.3)                       # the RTS is queued here before the recv is posted
    res = {}

    def rx():
        res["err"] = catch(ep.recv, conn, mr, addr(dst), BIG)

    th = threading.Thread(target=rx)
    th.start()
    deadline = time.monotonic() + 5
    while not np.any(dst[:BIG:MiB] != POISON) and time.monotonic() < deadline:
        time.sleep(0.0005)                # close as soon as the pull is under way
    t0 = time.monotonic()
    ep.close()
    close_s = time.monotonic() - t0
    th.join(20)
    alive = th.is_alive()
    ch.send("closed")
    src = pattern(BIG, 11)
    body = dst[:BIG]
    landed = body == src
    # Every byte is either what the sender sent or still the poison, never garbage.
    garbage = int(np.count_nonzero(~landed & (body != POISON)))
    return dict(tp=tp, err=res.get("err", "thread hung"), close_s=close_s, thread_alive=alive,
                garbage=garbage, written=float(np.count_nonzero(landed)) / BIG,
                guard=all_poison(dst[BIG:]))


def _close_sender(ch):
    ep, conn = _connect(ch)
    src = pattern(BIG, 11)
    mr = ep.reg(addr(src), BIG)[1]
    t = ep.send_async(conn, mr, addr(src), BIG)[1]
    ch.send("posted")
    err = catch(ep.wait, t, timeout=20)   # the receiver closed: an error (or done), never a hang
    ch.recv("closed", timeout=30)
    return err


def test_close_during_blocking_cma_recv():
    """close() from another thread while a blocking shm-cma recv of 512 MiB is
    being pulled by the caller's thread (close() runs as soon as the first
    pulled bytes land): the receiving process does not crash (before the fix
    it died of SIGSEGV: the FIN went through an unmapped control queue) and
    exits 0 after reporting; close() and the recv both return promptly;
    the recv raises ValueError/UcclError saying the endpoint was closed; and
    the receive buffer holds only sent bytes or poison (no garbage)."""
    with Pair(_close_receiver, _close_sender, env=TRANSPORTS["shm-cma"][0]) as p:
        r = p.result("server", timeout=60)
        p.result("client", timeout=30)
        p.procs["server"].join(10)
        code = p.procs["server"].exitcode
    assert code == 0, f"the receiving process exited with {code} after close() during a recv"
    assert r["tp"] == "shm-cma", r["tp"]
    assert not r["thread_alive"], "the recv thread still hung 20 s after close()"
    err = r["err"]
    assert err is not None, (f"the recv returned True although close() ran during the pull "
                             f"(written {r['written']:.0%}; the race was not hit)")
    assert err["value"] or err["uccl"], err
    assert "closed" in err["msg"], err
    assert r["close_s"] < 5, f"close() took {r['close_s']:.1f} s"
    assert r["garbage"] == 0, f"{r['garbage']} bytes of the receive buffer hold garbage"
    assert r["guard"], "bytes past the posted recv were written"


# --------------------------------------------------------------------------
# 2. hostile TCP peers, speaking the wire format by hand
WIRE_MAGIC = 0x4C434355
MSG_RTS, MSG_CTS = 1, 2
FLAG_EAGER = 1
EAGER_N = 65536


def _recvn(s, n):
    out = b""
    while len(out) < n:
        d = s.recv(n - len(out))
        if not d:
            raise EOFError(f"closed after {len(out)} bytes")
        out += d
    return out


def _msg(typ, seq=0, ln=0, addr_=0, window=0, token=0, offset=0, aux=0):
    """A 64-byte control message."""
    return struct.pack("<IHHQQQQQQQ", WIRE_MAGIC, 1, typ, seq, ln, addr_, window, token, offset,
                       aux)


def _raw_connect(port, token=0x1234567890):
    """Handshake by hand (tests/_wire.py, no secret), transport TCP with one
    data stream, from another host id (so the acceptor must use TCP):
    control socket plus the data stream; returns both."""
    c = socket.create_connection(("127.0.0.1", port), timeout=10)
    r = _wire.connect(c, b"", token=token, host=b"hostile-peer", pid=4242,
                      transport=_wire.TP_TCP, nstreams=1, chunk=1 << 20)
    assert r["ack"]["status"] == 0, r["ack"]
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    _wire.connect(s, typ=_wire.STREAM, token=token, key=r["key"], host=b"hostile-peer",
                  transport=_wire.TP_TCP, nstreams=1, sidx=0, chunk=1 << 20)
    return c, s


def _victim_eager(ch, first):
    ep = _endpoint(10)                    # a missed EOF would show up as ~10 s
    ch.send("port", ep.address()[1])
    conn = ep.accept(timeout=20)[3]
    tp = ep.conn_transport(conn)
    buf = poisoned(EAGER_N)
    mr = ep.reg(addr(buf), buf.nbytes)[1]
    tid = ep.recv_async(conn, mr, addr(buf), EAGER_N)[1]
    ch.send("posted")
    polls = []
    if first == "wait":                   # blocked in wait() while the peer sends and hangs up
        werr = catch(ep.wait, tid)
        ch.recv("closed")
        perr = catch(ep.poll_async, tid)
    else:                                 # poll only, after the peer hung up
        ch.recv("closed")
        t0 = time.monotonic()
        while True:
            t1 = time.monotonic()
            perr = catch(ep.poll_async, tid)
            polls.append(time.monotonic() - t1)
            if perr is not None or time.monotonic() - t0 > 5:
                break
            time.sleep(0.01)
        perr = perr and dict(perr, elapsed=time.monotonic() - t0)
        werr = catch(ep.wait, tid)
    later = catch(ep.recv, conn, mr, addr(buf), 16)
    return dict(tp=tp, werr=werr, perr=perr, max_poll=max(polls, default=0.0), later=later,
                head=bytes(buf[:100]), tail_poison=all_poison(buf[100:]))


def _raw_eager_peer(ch):
    c, s = _raw_connect(ch.recv("port"))
    ch.recv("posted")
    payload = rand_bytes(100, 21).tobytes()
    # RTS for an eager 64 KiB message, then only 100 of its bytes, then EOF.
    c.sendall(_msg(MSG_RTS, seq=1, ln=EAGER_N, addr_=0x1000, aux=FLAG_EAGER) + payload)
    time.sleep(0.2)
    c.close()
    s.close()
    ch.send("closed")
    return True


@pytest.mark.parametrize("first", ["wait", "poll"])
def test_truncated_eager_message_fails_fast(first):
    """A raw TCP peer announces an eager 64 KiB message into a posted recv,
    sends only 100 payload bytes and closes its sockets.  The receiver
    (timeout_s=10) must see the EOF: wait() (or, in the 'poll' variant,
    poll_async() called repeatedly, each call returning at once) raises
    UcclError -- not UcclTimeoutError -- within 2 s, and the other call then
    raises too.  The transfer is never reported done; the 100 bytes that
    arrived may sit in the buffer, but nothing past them is written; later
    recvs on that connection fail at once."""
    with Pair(_victim_eager, _raw_eager_peer, env=TRANSPORTS["tcp"][0],
              server_kwargs={"first": first}) as p:
        r = p.result("server", timeout=30)
        p.result("client", timeout=10)
    assert r["tp"] == "tcp", r["tp"]
    payload = rand_bytes(100, 21)
    for what, err in (("wait", r["werr"]), ("poll_async", r["perr"])):
        assert err is not None, f"{what}() reported a 64 KiB transfer of which 100 bytes arrived"
        assert err["uccl"] and not err["timeout"], f"{what}: {err}"
        assert err["elapsed"] < 2.0, f"{what}() took {err['elapsed']:.2f} s to notice the EOF"
    assert r["max_poll"] < 0.5, f"one poll_async() call blocked for {r['max_poll']:.2f} s"
    head = np.frombuffer(r["head"], np.uint8)
    assert np.all((head == payload) | (head == POISON)), "the first 100 bytes hold garbage"
    assert r["tail_poison"], "bytes beyond the 100 that arrived were written"
    later = r["later"]
    assert later is not None and later["elapsed"] < 2, f"recv on the dead connection: {later}"


def _garbage(kind: str) -> bytes:
    if kind == "random":
        return rand_bytes(64, 22).tobytes()          # bad magic
    if kind == "unknown-type":
        return _msg(99, seq=1, ln=64)                # good header, no such message
    return _msg(MSG_CTS, seq=1, ln=EAGER_N)          # a receiver's message from the sender


def _victim_garbage(ch):
    ep = _endpoint(10)
    ch.send("port", ep.address()[1])
    conn = ep.accept(timeout=20)[3]
    buf = poisoned(EAGER_N)
    mr = ep.reg(addr(buf), buf.nbytes)[1]
    tid = ep.recv_async(conn, mr, addr(buf), EAGER_N)[1]
    ch.send("posted")
    err = catch(ep.wait, tid)
    untouched = all_poison(buf)
    # The same endpoint now serves a well-behaved client.
    ch.send("next")
    conn2 = ep.accept(timeout=20)[3]
    sizes = [3 * MiB + 5, EAGER_N, 0]
    bufs = [poisoned(n) for n in sizes]
    for b, n in zip(bufs, sizes):
        ep.recv(conn2, ep.reg(addr(b), b.nbytes)[1], addr(b), n)
    good = all(np.array_equal(b[:n], rand_bytes(n, 30 + i)) and all_poison(b[n:])
               for i, (b, n) in enumerate(zip(bufs, sizes)))
    return dict(err=err, untouched=untouched, tp2=ep.conn_transport(conn2), good=good)


def _raw_garbage_then_client(ch, kind):
    port = ch.recv("port")
    c, s = _raw_connect(port)
    ch.recv("posted")
    c.sendall(_garbage(kind))
    c.settimeout(5)
    t0 = time.monotonic()
    try:                                  # the endpoint must drop this connection
        dropped = c.recv(1) == b""
    except (ConnectionError, socket.timeout) as e:
        dropped = not isinstance(e, socket.timeout)
    dropped_s = time.monotonic() - t0
    c.close()
    s.close()
    ch.recv("next")
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=30)
    conn = ep.connect("127.0.0.1", -1, remote_port=port)[1]
    for i, n in enumerate([3 * MiB + 5, EAGER_N, 0]):
        data = rand_bytes(n, 30 + i)
        ptr = addr(data) if n else 0
        ep.send(conn, ep.reg(ptr, n)[1], ptr, n)
    return dict(dropped=dropped, dropped_s=dropped_s)


@pytest.mark.parametrize("kind", ["random", "unknown-type", "wrong-direction"])
def test_garbage_control_message_fails_only_that_connection(kind):
    """A raw TCP peer completes the handshake, the receiver posts a recv, and
    the peer sends a garbage 64-byte control message (random bytes, an unknown
    type, or a CTS that only a receiver may send).  The pending recv raises
    UcclError (not a timeout) within 2 s naming the protocol problem, the
    buffer stays untouched, the endpoint drops that socket, the process
    survives, and the same endpoint then accepts a normal client and receives
    3 MiB+5, 64 KiB and 0-byte messages byte-exactly."""
    with Pair(_victim_garbage, _raw_garbage_then_client, env=TRANSPORTS["tcp"][0],
              client_kwargs={"kind": kind}) as p:
        r = p.result("server", timeout=40)
        c = p.result("client", timeout=10)
        p.procs["server"].join(10)
        code = p.procs["server"].exitcode
    err = r["err"]
    assert err is not None, "a recv completed although the peer only sent garbage"
    assert err["uccl"] and not err["timeout"], err
    assert err["elapsed"] < 2.0, err
    assert "control message" in err["msg"] or "protocol" in err["msg"], err["msg"]
    assert r["untouched"], "garbage from a hostile peer landed in the receive buffer"
    assert c["dropped"] and c["dropped_s"] < 2.0, f"the hostile connection was not closed: {c}"
    assert r["tp2"] == "tcp"
    assert r["good"], "the endpoint served the next, well-behaved client wrongly"
    assert code == 0, f"the endpoint's process exited with {code}"


# --------------------------------------------------------------------------
# 3. a one-sided CMA read whose initiator times out
READ_TIMEOUT = 0.02   # seconds: the initiator's timeout_s
READ_BIG = 1024 * MiB  # the copy must outlast the 20 ms deadline by far
READ_ATTEMPTS = 10


def _read_target(ch):
    ep, conn = _accept(ch)
    win = pattern(READ_BIG, 41)
    mr = ep.reg(addr(win), READ_BIG)[1]
    ch.send("fifo", ep.advertise(conn, mr, addr(win), READ_BIG)[1])
    ch.recv("done", timeout=30)           # stay alive (and able to push) until checked
    return ep.conn_transport(conn)


def _read_initiator(ch):
    from uccl_collective.p2p import Endpoint, UcclTimeoutError

    ep = Endpoint(port=0, timeout_s=READ_TIMEOUT)
    meta = ch.recv("meta")
    for attempt in range(20):             # the handshake itself has this tiny deadline
        try:
            conn = ep.add_remote_endpoint(meta)[1]
            break
        except UcclTimeoutError:
            time.sleep(0.05)
    else:
        raise RuntimeError(f"could not connect within a {READ_TIMEOUT} s deadline 20 times")
    fifo = ch.recv("fifo")
    dst = poisoned(READ_BIG)
    mr = ep.reg(addr(dst), dst.nbytes)[1]
    want = None
    # A read that completed is rightly reported done: repeat (the connection
    # is still good) until one is caught by its deadline.
    for attempt in range(1, READ_ATTEMPTS + 1):
        err = catch(ep.read, conn, mr, addr(dst), READ_BIG, fifo)
        if err is not None:
            break
        want = pattern(READ_BIG, 41) if want is None else want
        if not (np.array_equal(dst[:READ_BIG], want) and all_poison(dst[READ_BIG:])):
            raise AssertionError(f"read attempt {attempt} reported success with wrong bytes")
        dst.fill(POISON)
    written = _sample_written(dst[:READ_BIG], POISON)
    sampled, changed = _late_bytes([dst], 0.5)
    ch.send("done")
    return dict(tp=ep.conn_transport(conn), err=err, attempts=attempt, written=written,
                sampled=sampled, changed=changed)


# The initiator does not spin: a blocked caller that drives its connection runs
# the CMA pull itself, inline, and only checks its deadline once the copy is
# over; with UCCL_P2P_SPIN_US=0 the GO reaches the service thread and the pull
# runs on the worker, so the deadline fires mid-copy -- the path of the old bug.
READ_ENV = {"UCCL_P2P_SPIN_US": "0"}


def test_timed_out_cma_read_stops_writing():
    """A one-sided shm-cma read of a 1 GiB window with a 20 ms deadline on
    the initiator, whose copy runs on its worker thread (repeated, up to 10
    times, while the read still wins the race -- each success must carry the
    exact bytes).  Once read() raises UcclTimeoutError, with the target still
    alive, nothing lands in the destination any more: one byte per page,
    snapshotted at once, is unchanged 0.5 s later, and a full sentinel refill
    is unchanged 0.5 s after that.  (Before the fix the copy ran on after
    read() returned.)"""
    with Pair(_read_target, _read_initiator, env=TRANSPORTS["shm-cma"][0],
              client_env=READ_ENV) as p:
        r = p.result("client", timeout=40)
        assert p.result("server", timeout=10) == "shm-cma"
    assert r["tp"] == "shm-cma"
    err = r["err"]
    assert err is not None, (f"all {READ_ATTEMPTS} reads of 1 GiB beat a 20 ms deadline: "
                             "the race was not exercised")
    assert err["timeout"], f"expected UcclTimeoutError, got {err}"
    assert err["elapsed"] < 5, err
    assert r["sampled"] == 0 and r["changed"] == 0, (
        f"bytes landed in the destination after read() raised ({r['sampled']} sampled bytes "
        f"changed in the first 0.5 s, {r['changed']} bytes of the sentinel refill after it; "
        f"raised on attempt {r['attempts']}, {r['written']:.0%} written when it raised)")


# --------------------------------------------------------------------------
# 4. dereg() on the target while a one-sided write into its window is in flight
def _dereg_target(ch):
    ep, conn = _accept(ch)
    win = np.full(BIG, POISON, np.uint8)
    mr = ep.reg(addr(win), BIG)[1]
    ch.send("fifo", ep.advertise(conn, mr, addr(win), BIG)[1])
    ch.recv("started", timeout=30)
    deadline = time.monotonic() + 10
    while not np.any(win[::MiB] != POISON) and time.monotonic() < deadline:
        time.sleep(0.0005)                # dereg as soon as the first bytes land
    before = _sample_written(win, POISON)
    t0 = time.monotonic()
    ep.dereg(mr)
    dereg_s = time.monotonic() - t0
    after = _sample_written(win, POISON)
    snap = win[::4096].copy()
    time.sleep(0.5)
    sampled = int(np.count_nonzero(win[::4096] != snap))
    complete = bool(np.array_equal(win, pattern(BIG, 51)))  # all there when dereg returned?
    win.fill(SENTINEL)
    time.sleep(0.5)
    changed = int(np.count_nonzero(win != SENTINEL))
    ch.send("checked")
    return dict(tp=ep.conn_transport(conn), before=before, after=after, complete=complete,
                sampled=sampled, changed=changed, dereg_s=dereg_s)


def _dereg_initiator(ch):
    ep, conn = _connect(ch, timeout_s=20)
    fifo = ch.recv("fifo")
    src = pattern(BIG, 51)
    mr = ep.reg(addr(src), BIG)[1]
    t = ep.write_async(conn, mr, addr(src), BIG, fifo)[1]
    ch.send("started")
    err = catch(ep.wait, t, timeout=20)
    ch.recv("checked", timeout=30)
    return err


@pytest.mark.parametrize("transport", ["shm-cma", "shm-ring", "tcp"])
def test_dereg_during_one_sided_write(transport):
    """The target advertises a 512 MiB window; the initiator starts a write of
    patterned data into it; as soon as the first bytes land the target
    dereg()s the region.  Once dereg() returns nothing lands in the window
    any more: one byte per page, snapshotted at once, is unchanged 0.5 s
    later, and a full sentinel refill is unchanged 0.5 s after that.  The
    write either completes -- and then every byte had landed by then -- or
    raises UcclError/ValueError (never a timeout: no hang).  (Before the fix
    dereg() returned while the copy into the window went on.)"""
    env, _ = TRANSPORTS[transport]
    with Pair(_dereg_target, _dereg_initiator, env=env) as p:
        r = p.result("server", timeout=60)
        err = p.result("client", timeout=30)
    assert r["tp"] == transport
    info = (f"{transport}: {r['before']:.0%} of the window written when dereg() began, "
            f"{r['after']:.0%} when it returned after {r['dereg_s']:.2f} s")
    assert r["sampled"] == 0 and r["changed"] == 0, (
        f"bytes landed after dereg() returned: {r['sampled']} sampled bytes changed in the "
        f"first 0.5 s, {r['changed']} bytes of the sentinel refill after it ({info})")
    if err is None:
        assert r["complete"], f"the write reported success but the window was incomplete ({info})"
    else:
        assert (err["uccl"] or err["value"]) and not err["timeout"], f"{err} ({info})"


# --------------------------------------------------------------------------
# 5. transfer ids are kept until release(), and only a finished one is released
LATER = 70_000


def _retention(ch):
    from uccl_collective.p2p import Endpoint

    a = Endpoint(port=0, timeout_s=20)    # receives
    b = Endpoint(port=0, timeout_s=20)    # sends
    cb = b.connect("127.0.0.1", -1, remote_port=a.address()[1])[1]
    ca = a.accept(timeout=10)[3]
    out = {"tp": a.conn_transport(ca)}
    n = 64
    src = rand_bytes(n, 61)
    dst = poisoned(n, guard=64)
    mb = b.reg(addr(src), n)[1]
    ma = a.reg(addr(dst), dst.nbytes)[1]

    # (a) Two finished async ids, one per side, polled done and then left alone.
    keep_r = a.recv_async(ca, ma, addr(dst), n)[1]
    keep_s = b.send_async(cb, mb, addr(src), n)[1]
    deadline = time.monotonic() + 10
    while not (a.poll_async(keep_r)[1] and b.poll_async(keep_s)[1]):
        assert time.monotonic() < deadline, "the kept transfers did not finish"
    out["keep_data"] = bool(np.array_equal(dst[:n], src)) and all_poison(dst[n:])

    # 70,000 later transfers on the same connection: blocking recvs on a,
    # async sends (waited and released) on b, so both sides burn through ids.
    tiny = np.zeros(8, np.uint8)
    small = poisoned(8, guard=0)
    mt, ms = b.reg(addr(tiny), 8)[1], a.reg(addr(small), 8)[1]
    t0 = time.monotonic()
    for i in range(LATER):
        if i % 10_000 == 0:
            tiny[:] = rand_bytes(8, i)
            small.fill(POISON)
        t = b.send_async(cb, mt, addr(tiny), 8)[1]
        a.recv(ca, ms, addr(small), 8)
        b.wait(t)
        b.release(t)
        if i % 10_000 == 0 and not np.array_equal(small, tiny):
            raise AssertionError(f"transfer {i} delivered wrong bytes")
    out["loop_s"] = time.monotonic() - t0
    out["ids"] = (keep_s, t)

    pairs = ((a, keep_r), (b, keep_s))
    out["kept"] = [catch(ep.poll_async, k) or ep.poll_async(k) for ep, k in pairs]
    out["kept_wait"] = [catch(ep.wait, k, timeout=1) or True for ep, k in pairs]
    out["kept_release"] = [catch(ep.release, k) for ep, k in pairs]
    out["after"] = [catch(f, k) for ep, k in pairs for f in (ep.poll_async, ep.wait, ep.release)]

    # (b) release() of a recv still in flight is refused; the transfer goes on.
    dst.fill(POISON)
    rid = a.recv_async(ca, ma, addr(dst), n)[1]
    out["early_release"] = catch(a.release, rid)
    out["pending_poll"] = catch(a.poll_async, rid) or a.poll_async(rid)
    src2 = rand_bytes(n, 62)
    b.send(cb, b.reg(addr(src2), n)[1], addr(src2), n)
    out["late_wait"] = catch(a.wait, rid, timeout=10)
    out["late_data"] = bool(np.array_equal(dst[:n], src2)) and all_poison(dst[n:])
    a.close()
    b.close()
    return out


@pytest.mark.parametrize("transport", ["tcp", "shm-cma", "shm-ring"])
def test_transfer_ids_retained_until_release(transport):
    """A finished async recv and a finished async send, polled done and
    never released, are still answered done by poll_async() and wait() after
    70,000 later transfers on the same connection (more ids than a 16-bit
    table holds), until release(); after that poll_async, wait and release
    raise ValueError.  release() of a recv that is still pending raises
    ValueError ('in flight'), leaves it pending, and the recv then completes
    with the right bytes (before the fix release() was accepted and the bytes
    landed anyway in a buffer the caller had been told was free)."""
    env, _ = TRANSPORTS[transport]
    with Pair(_retention, None, env=env) as p:
        r = p.result("server", timeout=50)
    assert r["tp"] == transport
    assert r["keep_data"]
    keep, last = r["ids"]
    assert last - keep >= LATER, r["ids"]
    assert r["kept"] == [(True, True), (True, True)], (
        f"finished ids polled after {LATER} later transfers: {r['kept']}")
    assert r["kept_wait"] == [True, True], r["kept_wait"]
    assert r["kept_release"] == [None, None], r["kept_release"]
    for err in r["after"]:
        assert err is not None and err["value"], f"a released id is still answered: {err}"
    er = r["early_release"]
    assert er is not None and er["value"] and "in flight" in er["msg"], (
        f"release() of a pending recv: {er}")
    assert r["pending_poll"] == (True, False), r["pending_poll"]
    assert r["late_wait"] is None and r["late_data"], (
        f"the recv whose release was refused: {r['late_wait']}")


# --------------------------------------------------------------------------
# 6. sendv/recvv with one iov's size different on the two sides
# The iov right after the mismatched one is large, so that it is still in
# flight when the mismatch is reported (before the fix recvv returned then
# and the rest of the iovs landed afterwards).
SEND_SIZES = [8 * MiB + 5, 4 * MiB + 4096, 128 * MiB + 3, 60_000, 4097]
RECV_SIZES = [8 * MiB + 5, 4 * MiB, 128 * MiB + 3, 60_000, 4097]   # iov 1: too small
BAD = 1


def _recvv_side(ch):
    ep, conn = _accept(ch)
    bufs = [poisoned(n) for n in RECV_SIZES]
    mrs = [ep.reg(addr(b), b.nbytes)[1] for b in bufs]
    ch.send("posting")
    err = catch(ep.recvv, conn, mrs, [addr(b) for b in bufs], RECV_SIZES, len(bufs))
    snaps = _snap(bufs)                   # at once: a copy still running is caught
    states = []
    for i, (b, n) in enumerate(zip(bufs, RECV_SIZES)):
        if all_poison(b):
            states.append("untouched")
        elif i != BAD and np.array_equal(b[:n], rand_bytes(n, 70 + i)) and all_poison(b[n:]):
            states.append("ok")
        else:
            states.append("garbage")
    sampled, changed = _late_bytes(bufs, 0.3, snaps)
    # A size mismatch leaves the connection usable.
    nxt = poisoned(MiB + 1)
    follow = catch(ep.recv, conn, ep.reg(addr(nxt), nxt.nbytes)[1], addr(nxt), MiB + 1)
    follow_ok = follow is None and np.array_equal(nxt[:MiB + 1], rand_bytes(MiB + 1, 79)) \
        and all_poison(nxt[MiB + 1:])
    return dict(tp=ep.conn_transport(conn), err=err, states=states, late=(sampled, changed),
                follow=follow, follow_ok=follow_ok)


def _sendv_side(ch):
    ep, conn = _connect(ch)
    srcs = [rand_bytes(n, 70 + i) for i, n in enumerate(SEND_SIZES)]
    mrs = [ep.reg(addr(s), s.nbytes)[1] for s in srcs]
    ch.recv("posting")
    err = catch(ep.sendv, conn, mrs, [addr(s) for s in srcs], SEND_SIZES, len(srcs))
    data = rand_bytes(MiB + 1, 79)
    follow = catch(ep.send, conn, ep.reg(addr(data), data.nbytes)[1], addr(data), MiB + 1)
    return err, follow


@pytest.mark.parametrize("transport", ["tcp", "shm-cma", "shm-ring"])
def test_vector_size_mismatch_leaves_no_partial_iov(transport):
    """sendv/recvv of five iovs (8 MiB+5, 4 MiB+4096, 128 MiB+3, 60,000 B eager, 4097 B)
    where the second is sent as 4 MiB+4096 into a recv of 4 MiB (a recv's
    size is a capacity, so only a larger send is a mismatch): both calls raise (a
    mismatch naming both sizes, not a timeout); the mismatched iov's buffer
    is untouched; every other iov is either byte-exact (guard intact) or
    untouched -- never partially written; once recvv returned nothing lands
    in any of its buffers (sampled snapshot, then a sentinel refill, 0.3 s
    each); and the connection still carries a following 1 MiB+1 message
    byte-exactly."""
    env, _ = TRANSPORTS[transport]
    r, (serr, sfollow) = run_pair(_recvv_side, _sendv_side, env=env, timeout=40)
    assert r["tp"] == transport
    for side, err in (("recvv", r["err"]), ("sendv", serr)):
        assert err is not None, f"{side} returned True although iov {BAD}'s sizes differ"
        assert (err["value"] or err["uccl"]) and not err["timeout"], f"{side}: {err}"
    for side, err in (("recvv", r["err"]), ("sendv", serr)):
        sizes = (str(SEND_SIZES[BAD]), str(RECV_SIZES[BAD]))
        assert all(x in err["msg"] for x in sizes), f"{side}'s error lacks both sizes: {err['msg']}"
    assert r["states"][BAD] == "untouched", r["states"]
    assert "garbage" not in r["states"], f"an iov was partially written: {r['states']}"
    assert r["late"] == (0, 0), f"bytes landed after recvv() returned (sampled, all): {r['late']}"
    assert sfollow is None and r["follow_ok"], (
        f"the connection was unusable after the mismatch: send {sfollow}, recv {r['follow']}")
