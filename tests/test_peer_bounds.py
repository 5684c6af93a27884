"""What one peer can make a process hold is bounded, and freed when it goes.

Each test replays a way a peer (hostile, or honest but never served) used to
grow what an endpoint holds without end:

1. Completed handshakes that accept() never returns: the queue of them is
   bounded (UCCL_P2P_ACCEPT_QUEUE); past the bound a connection is refused in
   its handshake, so connect() raises at once naming the bound (it used to
   succeed, keep its descriptors and threads, and, past 1024, never be
   returned by accept(): the client's first send timed out).  Once accept()
   takes one, the next connect() succeeds.
2. A flood of RTS messages that no recv matches (a hand-written shm-cma
   connector): the connection fails once the peer has
   UCCL_PEER_REQS_MAX requests open, the failure names the bound, and the
   process's memory does not grow with the flood (300,000 RTSs grew it by
   about 18 MiB); its recv raises instead of hanging.
3. Dead accepted connections of a server that never calls
   remove_remote_endpoint (upstream's style): their descriptors, threads and
   transport state are given back within a second of the peer going away
   (polite close or SIGKILL), while each conn_id keeps answering: a recv on
   it raises an error saying what happened to that connection.
4. An honest sender far ahead of its receiver (5,000 async sends and 3,000
   async reads on one connection before anything is answered) is never
   refused by those bounds: everything completes byte-exactly.

Everything runs in child processes of the harness, every wait bounded.
"""
from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from _harness import (BASE_ENV, SENDING_CLIENT, MiB, TRANSPORTS, Pair, addr, catch, kill_group,
                      rand_bytes, run_one)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CMA_ENV = TRANSPORTS["shm-cma"][0]

PEER_REQS_MAX = 2048    # csrc/conn/conn.h: UCCL_PEER_REQS_MAX
REQ_WINDOW = 1024       # csrc/conn/conn.h: UCCL_REQ_WINDOW


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _hung_up(ep, conn, sock):
    """(whether the endpoint hung up on the peer's socket within 3 s, what a
    recv on that connection raises now)."""
    sock.settimeout(3)
    try:
        eof = sock.recv(1) == b""
    except (ConnectionError, socket.timeout) as e:
        eof = isinstance(e, ConnectionError)
    buf = np.zeros(16, np.uint8)
    mr = ep.reg(addr(buf), 16)[1]
    err = catch(ep.recv, conn, mr, addr(buf), 16)
    ep.dereg(mr)
    return eof, err

def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _endpoint(timeout_s, **kw):
    from uccl_collective.p2p import Endpoint

    return Endpoint(port=0, timeout_s=timeout_s, **kw)


def _settle(pred, timeout=5.0, step=0.05):
    """Poll pred() until true or timeout; returns its last value."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= end:
            return v
        time.sleep(step)


# --------------------------------------------------------------------------
# 1. connections nobody accept()s
AQ_BOUND = 8
AQ_TOTAL = 20


def _capture_stderr():
    """fd 2 into a temporary file (the engine logs there); returns a function
    that reads what was logged so far."""
    import tempfile

    f = tempfile.TemporaryFile()
    os.dup2(f.fileno(), 2)

    def read():
        f.seek(0)
        return f.read().decode(errors="replace")
    return read


def _aq_server(ch):
    log = _capture_stderr()
    ep = _endpoint(10)
    ch.send("port", ep.address()[1])
    base_fds, base_threads = _fds(), _threads()
    ch.recv("connected", timeout=90)
    time.sleep(0.3)
    fds, threads = _fds(), _threads()
    ok, _ip, _gpu, first = ep.accept(timeout=5)      # room for one more now
    ch.send("accepted")
    ch.recv("again", timeout=30)
    accepted = [first]
    for _ in range(AQ_TOTAL + 5):                       # every queued one, then nothing
        e = catch(ep.accept, timeout=0.5)
        if e is not None:
            break
        accepted.append(None)
    ep.close()
    refusals = [ln for ln in log().splitlines() if "refused connection" in ln]
    return dict(base_fds=base_fds, fds=fds, base_threads=base_threads, threads=threads,
                accepted=len(accepted), refusals=refusals)


def _aq_client(ch):
    ep = _endpoint(10)
    port = ch.recv("port")
    res = []
    for _ in range(AQ_TOTAL):
        t0 = time.monotonic()
        err = catch(ep.connect, "127.0.0.1", -1, remote_port=port)
        res.append(dict(err=err, s=time.monotonic() - t0))
    ch.send("connected")
    ch.recv("accepted", timeout=30)
    again = catch(ep.connect, "127.0.0.1", -1, remote_port=port)
    ch.send("again")
    time.sleep(0.5)
    ep.close()
    return dict(res=res, again=again)


@pytest.mark.parametrize("transport", ["shm-cma", "tcp"])
def test_unaccepted_connections_are_bounded(transport):
    """A client makes 20 connections to a server that accept()s none, with
    UCCL_P2P_ACCEPT_QUEUE=8.  The first 8 succeed; the other 12 are refused
    in their handshake, each connect() raising within 2 s a UcclError that
    names the queue's variable, and the server logging each refusal once
    with the peer and the numbers; the server holds descriptors and threads
    for 8 connections only.  Once the server accept()s one, the next
    connect() succeeds, and accept() then returns exactly the 8 that waited
    (before the fix all 20 succeeded and were held)."""
    env = {**TRANSPORTS[transport][0], "UCCL_P2P_ACCEPT_QUEUE": str(AQ_BOUND)}
    with Pair(_aq_server, _aq_client, env=env,
              server_env={"UCCL_P2P_LOG_LEVEL": "WARNING"}) as pair:
        s, c = pair.results(timeout=120)
    ok = [r for r in c["res"] if r["err"] is None]
    bad = [r for r in c["res"] if r["err"] is not None]
    assert len(ok) == AQ_BOUND, f"{len(ok)} of {AQ_TOTAL} connections succeeded: {c['res']}"
    for r in bad:
        assert r["err"]["uccl"], r
        assert "accept()" in r["err"]["msg"] and "UCCL_P2P_ACCEPT_QUEUE" in r["err"]["msg"], r
        assert r["s"] < 2, r
    assert len(s["refusals"]) == len(bad), s["refusals"]
    for ln in s["refusals"]:
        assert "127.0.0.1" in ln and f"{AQ_BOUND} connections wait for accept()" in ln, ln
        assert f"UCCL_P2P_ACCEPT_QUEUE={AQ_BOUND}" in ln, ln
    # a connection's descriptors (control, 2 TCP streams) and threads (service,
    # worker, a sender and a receiver per TCP stream), for 8 of them, not 20
    assert s["fds"] - s["base_fds"] <= AQ_BOUND * 3 + 2, s
    assert s["threads"] - s["base_threads"] <= AQ_BOUND * 6 + 2, s
    assert c["again"] is None, f"connect() after accept() made room failed: {c['again']}"
    assert s["accepted"] == AQ_BOUND + 1, s


# --------------------------------------------------------------------------
# 2. a flood of unmatched RTS messages (hand-written shm-cma connector)
FLOOD = 300_000


def _flood_rts(q, sock, n):
    """Write n RTS messages (seq 1..n, 16 bytes each, never matched) into the
    connector's queue, waiting for room; stops early if the endpoint stops
    reading.  Returns how many the endpoint consumed."""
    from test_hostile_peer import MAGIC, MSG_RTS

    ring = 4096
    hdr = np.zeros(1, dtype=[("magic", "<u4"), ("ver", "<u2"), ("type", "<u2")])
    hdr["magic"], hdr["ver"], hdr["type"] = MAGIC, 1, MSG_RTS
    head_off = q.out + 64
    tail = struct.unpack_from("<I", q.mm, q.out)[0]
    sent = 0
    stalled = time.monotonic()
    last_head = None
    while sent < n:
        head = struct.unpack_from("<I", q.mm, head_off)[0]
        if head != last_head:
            last_head, stalled = head, time.monotonic()
        elif time.monotonic() - stalled > 2.0:
            break                                     # the endpoint stopped reading
        room = ring - ((tail - head) & 0xFFFFFFFF)
        k = min(room, n - sent, 1024)
        if k <= 0:
            time.sleep(0.0005)
            continue
        msgs = np.zeros((k, 64), np.uint8)
        msgs[:, 0:8] = np.frombuffer(hdr.tobytes(), np.uint8)
        msgs[:, 8:16] = np.arange(sent + 1, sent + k + 1, dtype="<u8").view(np.uint8).reshape(k, 8)
        msgs[:, 16:24] = np.array([16], dtype="<u8").view(np.uint8)
        msgs[:, 24:32] = np.array([0x10], dtype="<u8").view(np.uint8)
        for i in range(k):
            off = q.out + 128 + ((tail + i) % ring) * 64
            q.mm[off:off + 64] = msgs[i].tobytes()
        tail = (tail + k) & 0xFFFFFFFF
        struct.pack_into("<I", q.mm, q.out, tail)
        sent += k
    _settle(lambda: struct.unpack_from("<I", q.mm, head_off)[0] == tail, timeout=3)
    head = struct.unpack_from("<I", q.mm, head_off)[0]
    return sent - ((tail - head) & 0xFFFFFFFF)


def _rts_flood(ch):
    from test_hostile_peer import _accept_shm

    ep = _endpoint(5)
    conn, sock, q = _accept_shm(ep)
    time.sleep(0.2)
    rss0 = _rss_kib()
    consumed = _flood_rts(q, sock, FLOOD)
    time.sleep(0.5)
    rss1 = _rss_kib()
    eof, err = _hung_up(ep, conn, sock)
    removed = ep.remove_remote_endpoint(conn)
    time.sleep(0.3)
    rss2 = _rss_kib()
    # the process serves an honest client afterwards
    other = _endpoint(5)
    other.connect("127.0.0.1", -1, remote_port=ep.address()[1])
    c2 = ep.accept(timeout=5)[3]
    sock.close()
    ep.close()
    other.close()
    return dict(consumed=consumed, grew_kib=rss1 - rss0, after_remove_kib=rss2 - rss0, eof=eof,
                err=err, removed=removed, c2=c2)


def test_unmatched_rts_flood_is_bounded():
    """A hand-written shm-cma connector sends 300,000 RTS messages that no
    recv matches.  The endpoint reads at most UCCL_PEER_REQS_MAX (2048) of
    them (plus what was in the queue when it stopped) and fails the
    connection: the peer's control socket is hung up, a recv on the
    connection raises a UcclError naming the bound, and the process's RSS
    grows by less than 4 MiB (before the fix all 300,000 were queued: about
    18 MiB, never given back).  The endpoint then serves an honest client."""
    r = run_one(_rts_flood, env=CMA_ENV, timeout=120)
    assert r["consumed"] <= PEER_REQS_MAX + 4096 + 1, r
    assert r["grew_kib"] < 4096, f"RSS grew by {r['grew_kib']} KiB: {r}"
    assert r["eof"], f"the flooding peer's connection was not hung up: {r}"
    err = r["err"]
    assert err is not None and err["uccl"], r
    assert str(PEER_REQS_MAX) in err["msg"] and "UCCL_PEER_REQS_MAX" in err["msg"], r
    assert r["c2"], r


# --------------------------------------------------------------------------
# 3. dead accepted connections, never removed
POLITE = 24
KILLED = 6


def _reap_server(ch):
    ep = _endpoint(10)
    port = ep.address()[1]
    ch.send("port", port)
    buf = np.zeros(4096, np.uint8)
    mr = ep.reg(addr(buf), buf.nbytes)[1]
    base_fds, base_threads = _fds(), _threads()
    conns, bad = [], []
    for i in range(POLITE + KILLED):
        conn = ep.accept(timeout=30)[3]
        buf[:] = 0
        ep.recv(conn, mr, addr(buf), buf.nbytes)
        if not np.all(buf == 7):
            bad.append(i)
        conns.append(conn)
        ch.send("got", i)
    ch.recv("gone", timeout=60)
    settled = _settle(lambda: _fds() - base_fds <= 2 and _threads() - base_threads <= 1,
                      timeout=3)
    fds, threads = _fds(), _threads()
    errs = [catch(ep.recv, c, mr, addr(buf), buf.nbytes) for c in conns]
    tps = [catch(ep.conn_transport, c) for c in conns]
    # a live client is still served
    ch.send("more")
    conn = ep.accept(timeout=30)[3]
    buf[:] = 0
    ep.recv(conn, mr, addr(buf), buf.nbytes)
    served = bool(np.all(buf == 7))
    ch.recv("done", timeout=30)
    ep.close()
    return dict(base_fds=base_fds, fds=fds, base_threads=base_threads, threads=threads,
                settled=settled, errs=errs, tps=tps, bad=bad, served=served)


def _reap_client(ch):
    port = ch.recv("port")
    b = np.full(4096, 7, np.uint8)
    for i in range(POLITE):
        ep = _endpoint(10)
        ok, conn = ep.connect("127.0.0.1", -1, remote_port=port)
        mr = ep.reg(addr(b), b.nbytes)[1]
        ep.send(conn, mr, addr(b), b.nbytes)
        ch.recv("got")
        if i % 2:
            ep.close()                                  # a polite close: BYE
        else:
            ep.remove_remote_endpoint(conn)             # ... of one connection
            ep.close()
    env = {**os.environ, "PYTHONPATH": ROOT}
    for i in range(KILLED):                             # no BYE: the process dies
        p = subprocess.Popen([sys.executable, "-c", SENDING_CLIENT, str(port)], env=env,
                             stdout=subprocess.PIPE, start_new_session=True)
        try:
            line = p.stdout.readline()
            assert line.strip() == b"sent", line
            ch.recv("got")
        finally:
            kill_group(p)
            p.stdout.close()
    ch.send("gone")
    ch.recv("more")
    ep = _endpoint(10)
    ok, conn = ep.connect("127.0.0.1", -1, remote_port=port)
    mr = ep.reg(addr(b), b.nbytes)[1]
    ep.send(conn, mr, addr(b), b.nbytes)
    ch.send("done")
    ep.close()
    return True


@pytest.mark.parametrize("transport", ["shm-cma", "tcp"])
def test_dead_accepted_connections_are_reaped(transport):
    """A server accepts 30 clients one after another and receives 4 KiB from
    each (byte-exact); 24 then close politely, 6 are SIGKILLed; the server
    never calls remove_remote_endpoint.  Within 3 s its descriptors and
    threads are back to where they were before the first client (before the
    fix each dead connection kept a descriptor, and its threads), a recv on
    each dead conn_id raises a UcclError that names the connection and why it
    failed (never a crash or a hang), conn_transport() still answers, and a
    new client is served."""
    with Pair(_reap_server, _reap_client, env=TRANSPORTS[transport][0]) as pair:
        s, c = pair.results(timeout=180)
    assert not s["bad"], s
    assert s["settled"], (f"descriptors {s['base_fds']} -> {s['fds']}, threads "
                          f"{s['base_threads']} -> {s['threads']} after "
                          f"{POLITE + KILLED} dead connections")
    for e in s["errs"]:
        assert e is not None and e["uccl"], s["errs"]
        assert "connection" in e["msg"] and "failed" in e["msg"], e
        assert e["elapsed"] < 1, e
    assert all(t is None for t in s["tps"]), s["tps"]
    assert s["served"], s


# --------------------------------------------------------------------------
# 4. an honest sender far ahead of its receiver
AHEAD_SENDS = 5000
AHEAD_READS = 3000
AHEAD_N = 256


def _ahead_receiver(ch):
    ep = _endpoint(60)
    ch.send("port", ep.address()[1])
    conn = ep.accept(timeout=30)[3]
    win = rand_bytes(AHEAD_READS * AHEAD_N, 5)
    wmr = ep.reg(addr(win), win.nbytes)[1]
    ch.send("fifo", ep.advertise(conn, wmr, addr(win), win.nbytes)[1])
    ch.recv("posted", timeout=60)
    time.sleep(1.0)                     # everything the sender posted has arrived or waits
    dst = np.zeros(AHEAD_SENDS * AHEAD_N, np.uint8)
    mr = ep.reg(addr(dst), dst.nbytes)[1]
    xs = [ep.recv_async(conn, mr, addr(dst) + i * AHEAD_N, AHEAD_N)[1]
          for i in range(AHEAD_SENDS)]
    end = time.monotonic() + 60
    for x in xs:
        while not ep.poll_async(x)[1]:
            assert time.monotonic() < end, "recvs did not finish"
            time.sleep(0.0002)
    ch.recv("done", timeout=60)
    ep.close()
    return bool(np.array_equal(dst, rand_bytes(AHEAD_SENDS * AHEAD_N, 4)))


def _ahead_sender(ch):
    ep = _endpoint(60)
    ok, conn = ep.connect("127.0.0.1", -1, remote_port=ch.recv("port"))
    fifo = ch.recv("fifo")
    src = rand_bytes(AHEAD_SENDS * AHEAD_N, 4)
    mr = ep.reg(addr(src), src.nbytes)[1]
    dst = np.zeros(AHEAD_READS * AHEAD_N, np.uint8)
    dmr = ep.reg(addr(dst), dst.nbytes)[1]
    sends = [ep.send_async(conn, mr, addr(src) + i * AHEAD_N, AHEAD_N)[1]
             for i in range(AHEAD_SENDS)]
    # one-sided reads of the window, one fifo item per slice
    reads = []
    for i in range(AHEAD_READS):
        f = _slice_fifo(fifo, i * AHEAD_N, AHEAD_N)
        reads.append(ep.read_async(conn, dmr, addr(dst) + i * AHEAD_N, AHEAD_N, f)[1])
    ch.send("posted")
    end = time.monotonic() + 60
    for x in sends + reads:
        while not ep.poll_async(x)[1]:
            assert time.monotonic() < end, "sends/reads did not finish"
            time.sleep(0.0002)
    ch.send("done")
    ok_reads = bool(np.array_equal(dst, rand_bytes(AHEAD_READS * AHEAD_N, 5)))
    ep.close()
    return ok_reads


def _slice_fifo(fifo: bytes, off: int, n: int) -> bytes:
    """The fifo item of [off, off + n) of an advertised window (same window
    and token, its address moved on): see csrc/net/wire.h."""
    b = bytearray(fifo)
    window, token, start, _ln, base = struct.unpack_from("<QQQQQ", b, 8)
    struct.pack_into("<QQQQQ", b, 8, window, token, start + off, n, base or start)
    return bytes(b)


@pytest.mark.parametrize("transport", ["shm-cma", "tcp"])
def test_honest_sender_far_ahead_is_never_refused(transport):
    """An honest sender posts 5,000 async sends of 256 bytes and 3,000 async
    reads of 256 bytes on one connection before the receiver posts a single
    recv (the receiver's side then holds far more announced requests than
    UCCL_PEER_REQS_MAX would allow at once): the sender keeps at most
    UCCL_REQ_WINDOW of them announced and the rest wait on its side, so
    nothing is refused and every byte arrives in order."""
    with Pair(_ahead_receiver, _ahead_sender, env=TRANSPORTS[transport][0]) as pair:
        s, c = pair.results(timeout=150)
    assert s is True, "the received messages differ from what was sent"
    assert c is True, "the bytes read differ from the window"


# --------------------------------------------------------------------------
# 5. the sender's window, seen by a hand-written TCP receiver
WIN_POSTED = REQ_WINDOW + 76


def _window_sender(ch):
    from test_hostile_peer import MSG_FIN, TcpAcceptor, _connect_to, msg

    ep = _endpoint(10)
    acc = TcpAcceptor()
    conn = _connect_to(ep, acc)
    src = np.arange(16, dtype=np.uint8)
    mr = ep.reg(addr(src), 16)[1]
    xs = [ep.send_async(conn, mr, addr(src), 16)[1] for _ in range(WIN_POSTED)]

    def read_rts(timeout):
        """The RTSs that arrive within `timeout` s (eager payloads skipped)."""
        seqs = []
        acc.ctrl.settimeout(timeout)
        try:
            while True:
                m = acc.read_msg()
                seqs.append(m["seq"])
                if m["aux"] & 1:
                    acc.ctrl.recv(m["len"], socket.MSG_WAITALL)
        except (socket.timeout, EOFError, OSError):
            pass
        return seqs

    first = read_rts(1.0)                          # the window, and no more
    acc.ctrl.sendall(msg(MSG_FIN, seq=1, ln=16))   # one finishes: one more goes out
    second = read_rts(1.0)
    done1 = catch(ep.wait, xs[0], timeout=5)
    # a FIN for a message not announced yet: a protocol error, not a success
    acc.ctrl.sendall(msg(MSG_FIN, seq=WIN_POSTED, ln=16))
    err = catch(ep.wait, xs[-1], timeout=5)
    acc.close()
    ep.close()
    return dict(first=first, second=second, done1=done1, err=err)


def test_sender_keeps_its_window():
    """The process under test connects to a hand-written TCP receiver and
    posts 1,100 async sends of 16 bytes.  Exactly UCCL_REQ_WINDOW (1024)
    RTSs arrive (sequence numbers 1..1024), and no more while none is
    answered; a FIN for message 1 finishes that send and lets exactly one
    more RTS out (1025).  A FIN for message 1100, which was never announced,
    fails the connection (a protocol error naming the message), instead of
    finishing a send whose bytes never left."""
    r = run_one(_window_sender, env=TRANSPORTS["tcp"][0], timeout=60)
    assert r["first"] == list(range(1, REQ_WINDOW + 1)), (len(r["first"]), r["first"][-3:])
    assert r["second"] == [REQ_WINDOW + 1], r["second"]
    assert r["done1"] is None, r
    err = r["err"]
    assert err is not None and err["uccl"], r
    assert "FIN" in err["msg"] and str(WIN_POSTED) in err["msg"], err


# --------------------------------------------------------------------------
# 6. reads a peer asks for and never finishes
RREQ_FLOOD = 3000


def _rreq_flood(ch):
    from test_hostile_peer import MSG_GO, MSG_RREQ, _accept_shm, msg, window_token

    ep = _endpoint(5)
    conn, sock, q = _accept_shm(ep)
    n = 4096
    win = np.zeros(n, np.uint8)
    mr = ep.reg(addr(win), n)[1]
    window, token = window_token(ep.advertise(conn, mr, addr(win), n)[1])
    gos = 0
    for base in range(0, RREQ_FLOOD, 1000):     # the queue holds 4096: in batches
        q.send_many([msg(MSG_RREQ, seq=base + i + 1, ln=n, window=window, token=token)
                     for i in range(1000)])
        try:
            while True:
                if q.recv(0.5)["type"] == MSG_GO:
                    gos += 1
        except TimeoutError:
            pass
    eof, err = _hung_up(ep, conn, sock)
    t0 = time.monotonic()
    derr = catch(ep.dereg, mr)                 # no read holds the region any more
    dereg_s = time.monotonic() - t0
    sock.close()
    ep.close()
    return dict(gos=gos, eof=eof, err=err, derr=derr, dereg_s=dereg_s)


def test_unfinished_reads_are_bounded():
    """A hand-written shm-cma connector asks for 3,000 reads of an advertised
    window and finishes none (a GO each, never an RDONE): each would hold the
    region and a request until the connection ends.  The endpoint serves at
    most UCCL_PEER_REQS_MAX (2048) of them, then fails the connection (hung
    up; a recv on it raises naming the bound), and dereg() of the region
    returns at once: nothing holds it any more."""
    r = run_one(_rreq_flood, env=CMA_ENV, timeout=60)
    assert r["gos"] <= PEER_REQS_MAX, r
    assert r["eof"], r
    err = r["err"]
    assert err is not None and err["uccl"], r
    assert str(PEER_REQS_MAX) in err["msg"] and "reads and writes" in err["msg"], r
    assert r["derr"] is None and r["dereg_s"] < 1.0, r


# --------------------------------------------------------------------------
# 7. failed connections are remembered up to a bound
DEAD_KEPT = 1024        # csrc/ep/engine.h: UCCL_DEAD_CONNS_KEPT
DEAD_MADE = DEAD_KEPT + 60


def _dead_server(ch):
    ep = _endpoint(10)
    ep.start_passive_accept()
    ch.send("port", ep.address()[1])
    base_fds, base_threads = _fds(), _threads()
    ch.recv("made", timeout=120)
    settled = _settle(lambda: _fds() - base_fds <= 2 and _threads() - base_threads <= 1,
                      timeout=5)
    fds, threads = _fds(), _threads()
    buf = np.zeros(16, np.uint8)
    mr = ep.reg(addr(buf), 16)[1]
    # ids are given in order from 1: the oldest are forgotten, the rest answer
    old = [catch(ep.recv, c, mr, addr(buf), 16) for c in (1, 30)]
    new = [catch(ep.recv, c, mr, addr(buf), 16) for c in (DEAD_MADE - DEAD_KEPT + 10, DEAD_MADE)]
    ep.close()
    return dict(base_fds=base_fds, fds=fds, base_threads=base_threads, threads=threads,
                settled=settled, old=old, new=new)


def _dead_client(ch):
    port = ch.recv("port")
    ep = _endpoint(10)
    for _ in range(DEAD_MADE):
        ok, conn = ep.connect("127.0.0.1", -1, remote_port=port)
        ep.remove_remote_endpoint(conn)
    ch.send("made")
    ep.close()
    return True


def test_failed_connections_are_forgotten_past_a_bound():
    """1,084 clients connect to a server (passive accept) one after another
    and close politely.  The server gives back every one's descriptors and
    threads; the last UCCL_DEAD_CONNS_KEPT (1024) ids still raise the
    connection's own failure (UcclError, "the peer closed its endpoint"),
    the oldest raise "no such connection" (UcclUnknownIdError), so a
    long-lived server's memory for dead connections is bounded too."""
    with Pair(_dead_server, _dead_client, env=CMA_ENV) as pair:
        s, c = pair.results(timeout=240)
    assert s["settled"], s
    for e in s["old"]:
        assert e is not None and e["type"] == "UcclUnknownIdError", s["old"]
        assert "no such connection" in e["msg"] and str(DEAD_KEPT) in e["msg"], e
    for e in s["new"]:
        assert e is not None and e["uccl"] and e["type"] != "UcclUnknownIdError", s["new"]
        assert "peer closed" in e["msg"], e
