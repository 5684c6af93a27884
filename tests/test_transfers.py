"""Data-path tests: two real processes on loopback move random bytes and the
bytes that land are compared end to end (sha256 of full buffers, computed by
the sender, the receiver and the parent from the same seed).  Every receive
buffer is poisoned first and a guard tail past the receive region must stay
poisoned.  Each test runs over the three transports a same-host CPU pair can
use -- tcp, shared memory with CMA, and the shared-memory ring fallback -- and
checks conn_transport() reports the one asked for."""
from __future__ import annotations

import time

import numpy as np
import pytest

from _harness import (GUARD, MiB, TRANSPORT_NAMES, TRANSPORTS, addr, all_poison, catch, peer_ip,
                      poisoned, rand_bytes, run_pair, sha)

SIZES = [0, 1, 4097, 64 * MiB]
IOV_SIZES = [1, 4097, 0, 65536]
ASYNC_SIZES = [4097, 1 * MiB + 3, 1]
POLL_BOUND_S = 30.0


def iov_layout(gap=64):
    """Offsets of IOV_SIZES packed into one buffer with poisoned gaps, and its size."""
    offs, o = [], 0
    for n in IOV_SIZES:
        offs.append(o)
        o += n + gap
    return offs, o


def _seed(kind: str, i: int) -> int:
    return {"send": 1000, "sendv": 2000, "async": 3000, "write": 4000, "read": 5000,
            "writev": 6000, "readv": 7000, "wasync": 8000, "rasync": 9000, "part": 9900}[kind] + i


def _expect(kind: str, i: int, n: int) -> str:
    return sha(rand_bytes(n, _seed(kind, i)))


def _poll_all(ep, ids, bound=POLL_BOUND_S):
    """Poll every transfer id until all are done (bounded); returns poll counts."""
    pending = set(ids)
    deadline = time.monotonic() + bound
    while pending:
        for t in list(pending):
            ok, done = ep.poll_async(t)
            assert ok is True
            if done:
                pending.discard(t)
        if time.monotonic() > deadline:
            raise AssertionError(f"transfers {sorted(pending)} not done within {bound} s")
        time.sleep(0.001)


def _finish_ids(ep, ids):
    """A finished id keeps answering done until released; then it is unknown."""
    for t in ids:
        assert ep.poll_async(t) == (True, True)
        assert ep.wait(t) is True
        assert ep.release(t) is True
        err = catch(ep.poll_async, t)
        assert err and err["value"], f"poll_async of a released id: {err}"


def _server_setup(ch, timeout_s=30):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=timeout_s)
    ch.send("meta", ep.get_metadata())
    ok, ip, gpu, conn = ep.accept()
    # (the client's address: loopback, or its own host's in two-host runs)
    assert ok is True and ip == peer_ip() and gpu == -1, (ok, ip, gpu)
    return ep, conn


def _client_setup(ch, timeout_s=30):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=timeout_s)
    meta = ch.recv("meta")
    ok, conn = ep.add_remote_endpoint(meta)
    assert ok is True
    assert ep.add_remote_endpoint(meta) == (True, conn), "add_remote_endpoint is cached per peer"
    return ep, conn


# --------------------------------------------------------------------------
# two-sided: send/recv, sendv/recvv, send_async/recv_async + poll_async
def _two_sided_server(ch):
    ep, conn = _server_setup(ch)
    out = {"tp": ep.conn_transport(conn), "recv": {}, "guard": {}}
    for i, n in enumerate(SIZES):
        buf = poisoned(n)
        ok, mr = ep.reg(addr(buf), buf.nbytes)
        assert ok is True
        assert ep.recv(conn, mr, addr(buf), n) is True
        out["recv"][n], out["guard"][n] = sha(buf[:n]), all_poison(buf[n:])
        assert ep.dereg(mr) is True
        del buf

    # recvv: every iov lands at its offset of one registered buffer, gaps stay poisoned
    offs, total = iov_layout()
    big = poisoned(total)
    mr = ep.reg(addr(big), big.nbytes)[1]
    assert ep.recvv(conn, [mr] * len(IOV_SIZES), [addr(big) + x for x in offs], IOV_SIZES,
                    len(IOV_SIZES)) is True
    out["recvv"] = [sha(big[x:x + n]) for x, n in zip(offs, IOV_SIZES)]
    out["recvv_gaps"] = all(all_poison(big[x + n:x + n + 64]) for x, n in zip(offs, IOV_SIZES))

    # recv_async: all posted at once, polled to completion
    bufs = [poisoned(n) for n in ASYNC_SIZES]
    mrs = [ep.reg(addr(b), b.nbytes)[1] for b in bufs]
    ids = []
    for b, m, n in zip(bufs, mrs, ASYNC_SIZES):
        ok, t = ep.recv_async(conn, m, addr(b), n)
        assert ok is True
        ids.append(t)
    assert len(set(ids)) == len(ids), "transfer ids are distinct"
    _poll_all(ep, ids)
    _finish_ids(ep, ids)
    out["async"] = [sha(b[:n]) for b, n in zip(bufs, ASYNC_SIZES)]
    out["async_guard"] = all(all_poison(b[n:]) for b, n in zip(bufs, ASYNC_SIZES))
    ch.send("done")
    return out


def _two_sided_client(ch):
    ep, conn = _client_setup(ch)
    out = {"tp": ep.conn_transport(conn), "sent": {}}
    for i, n in enumerate(SIZES):
        data = rand_bytes(n, _seed("send", i))
        ok, mr = ep.reg(addr(data), n)
        assert ok is True
        assert ep.send(conn, mr, addr(data), n) is True
        out["sent"][n] = sha(data)
        ep.dereg(mr)
    srcs = [rand_bytes(n, _seed("sendv", i)) for i, n in enumerate(IOV_SIZES)]
    mrs = [ep.reg(addr(s), s.nbytes)[1] for s in srcs]
    assert ep.sendv(conn, mrs, [addr(s) for s in srcs], IOV_SIZES, len(IOV_SIZES)) is True
    srcs = [rand_bytes(n, _seed("async", i)) for i, n in enumerate(ASYNC_SIZES)]
    mrs = [ep.reg(addr(s), s.nbytes)[1] for s in srcs]
    ids = [ep.send_async(conn, m, addr(s), s.nbytes)[1] for m, s in zip(mrs, srcs)]
    _poll_all(ep, ids)
    _finish_ids(ep, ids)
    ch.recv("done")
    ep.close()
    assert ep.closed is True
    return out


@pytest.mark.parametrize("transport", TRANSPORT_NAMES)
def test_two_sided_all_sizes(transport):
    """send/recv of 0, 1, 4097 and 64 MiB bytes, sendv/recvv (4 iovs, one of
    them empty) and 3 send_async/recv_async polled to completion deliver
    exactly the sender's bytes, write nothing past the receive regions, report
    the forced transport on both sides, and keep answering poll_async 'done'
    until release(), after which the id is unknown (ValueError)."""
    env, expect_tp = TRANSPORTS[transport]
    s, c = run_pair(_two_sided_server, _two_sided_client, env=env, timeout=120)
    assert s["tp"] == c["tp"] == expect_tp
    for i, n in enumerate(SIZES):
        want = _expect("send", i, n)
        assert c["sent"][n] == want, f"sender buffer changed ({n} bytes)"
        assert s["recv"][n] == want, f"{n}-byte message corrupted"
        assert s["guard"][n], f"{n}-byte recv wrote past its region"
    assert s["recvv"] == [_expect("sendv", i, n) for i, n in enumerate(IOV_SIZES)]
    assert s["recvv_gaps"], "recvv wrote outside its iovs"
    assert s["async"] == [_expect("async", i, n) for i, n in enumerate(ASYNC_SIZES)]
    assert s["async_guard"], "recv_async wrote past its region"


# --------------------------------------------------------------------------
# one-sided: advertise + write/read, advertisev + writev/readv, *_async
def _one_sided_server(ch):
    ep, conn = _server_setup(ch)
    out = {"tp": ep.conn_transport(conn)}

    # write targets: poisoned windows, advertised with their exact size
    wins = [poisoned(n) for n in SIZES]
    mrs = [ep.reg(addr(w), w.nbytes)[1] for w in wins]
    fifos = []
    for w, m, n in zip(wins, mrs, SIZES):
        ok, f = ep.advertise(conn, m, addr(w), n)
        assert ok is True and isinstance(f, bytes) and len(f) == 64
        fifos.append(f)
    ch.send("write_fifos", fifos)
    ch.recv("written")
    out["written"] = [sha(w[:n]) for w, n in zip(wins, SIZES)]
    out["written_guard"] = all(all_poison(w[n:]) for w, n in zip(wins, SIZES))
    del wins

    # read sources: random windows that must be unchanged by the reads
    srcs = [rand_bytes(n, _seed("read", i)) for i, n in enumerate(SIZES)]
    mrs = [ep.reg(addr(s), s.nbytes)[1] for s in srcs]
    ch.send("read_fifos", [ep.advertise(conn, m, addr(s), s.nbytes)[1] for m, s in zip(mrs, srcs)])
    ch.recv("read")
    out["read_src"] = [sha(s) for s in srcs]
    del srcs

    # advertisev: three windows inside one registered buffer, gaps poisoned
    offs, total = iov_layout()
    big = poisoned(total)
    mr = ep.reg(addr(big), big.nbytes)[1]
    k = len(IOV_SIZES)
    ok, vf = ep.advertisev(conn, [mr] * k, [addr(big) + x for x in offs], IOV_SIZES, k)
    assert ok is True and len(vf) == k
    ch.send("writev_fifos", vf)
    ch.recv("writtenv")
    out["writev"] = [sha(big[x:x + n]) for x, n in zip(offs, IOV_SIZES)]
    out["writev_gaps"] = all(all_poison(big[x + n:x + n + 64]) for x, n in zip(offs, IOV_SIZES))
    vsrc = [rand_bytes(n, _seed("readv", i)) for i, n in enumerate(IOV_SIZES)]
    vmr = [ep.reg(addr(s), s.nbytes)[1] for s in vsrc]
    ch.send("readv_fifos", ep.advertisev(conn, vmr, [addr(s) for s in vsrc], IOV_SIZES, k)[1])

    # async: write_async into 3 windows, read_async from 3 windows
    aw = [poisoned(n) for n in ASYNC_SIZES]
    amr = [ep.reg(addr(w), w.nbytes)[1] for w in aw]
    ar = [rand_bytes(n, _seed("rasync", i)) for i, n in enumerate(ASYNC_SIZES)]
    arm = [ep.reg(addr(s), s.nbytes)[1] for s in ar]
    ch.send("async_fifos", ([ep.advertise(conn, m, addr(w), n)[1] for m, w, n in zip(amr, aw, ASYNC_SIZES)],
                            [ep.advertise(conn, m, addr(s), s.nbytes)[1] for m, s in zip(arm, ar)]))

    # a write smaller than the advertised window fills only its prefix
    part = poisoned(8192, guard=0)
    pm = ep.reg(addr(part), part.nbytes)[1]
    ch.send("part_fifo", ep.advertise(conn, pm, addr(part), part.nbytes)[1])
    ch.recv("async_done")
    out["wasync"] = [sha(w[:n]) for w, n in zip(aw, ASYNC_SIZES)]
    out["wasync_guard"] = all(all_poison(w[n:]) for w, n in zip(aw, ASYNC_SIZES))
    out["part"] = sha(part[:4097])
    out["part_rest"] = all_poison(part[4097:])
    return out


def _one_sided_client(ch):
    ep, conn = _client_setup(ch)
    out = {"tp": ep.conn_transport(conn)}
    fifos = ch.recv("write_fifos")
    for i, (n, f) in enumerate(zip(SIZES, fifos)):
        data = rand_bytes(n, _seed("write", i))
        mr = ep.reg(addr(data), n)[1]
        assert ep.write(conn, mr, addr(data), n, f) is True
        ep.dereg(mr)
    ch.send("written")

    fifos = ch.recv("read_fifos")
    out["read"], out["read_guard"] = [], True
    for n, f in zip(SIZES, fifos):
        dst = poisoned(n)
        mr = ep.reg(addr(dst), dst.nbytes)[1]
        assert ep.read(conn, mr, addr(dst), n, f) is True
        out["read"].append(sha(dst[:n]))
        out["read_guard"] &= all_poison(dst[n:])
        ep.dereg(mr)
    ch.send("read")

    k = len(IOV_SIZES)
    vf = ch.recv("writev_fifos")
    srcs = [rand_bytes(n, _seed("writev", i)) for i, n in enumerate(IOV_SIZES)]
    mrs = [ep.reg(addr(s), s.nbytes)[1] for s in srcs]
    assert ep.writev(conn, mrs, [addr(s) for s in srcs], IOV_SIZES, vf, k) is True
    ch.send("writtenv")
    rf = ch.recv("readv_fifos")
    dsts = [poisoned(n) for n in IOV_SIZES]
    dmr = [ep.reg(addr(d), d.nbytes)[1] for d in dsts]
    assert ep.readv(conn, dmr, [addr(d) for d in dsts], IOV_SIZES, rf, k) is True
    out["readv"] = [sha(d[:n]) for d, n in zip(dsts, IOV_SIZES)]
    out["readv_guard"] = all(all_poison(d[n:]) for d, n in zip(dsts, IOV_SIZES))

    wf, rf = ch.recv("async_fifos")
    srcs = [rand_bytes(n, _seed("wasync", i)) for i, n in enumerate(ASYNC_SIZES)]
    smr = [ep.reg(addr(s), s.nbytes)[1] for s in srcs]
    dsts = [poisoned(n) for n in ASYNC_SIZES]
    dmr = [ep.reg(addr(d), d.nbytes)[1] for d in dsts]
    ids = [ep.write_async(conn, m, addr(s), s.nbytes, f)[1] for m, s, f in zip(smr, srcs, wf)]
    ids += [ep.read_async(conn, m, addr(d), n, f)[1] for m, d, n, f in zip(dmr, dsts, ASYNC_SIZES, rf)]
    assert len(set(ids)) == len(ids)
    _poll_all(ep, ids)
    _finish_ids(ep, ids)
    out["rasync"] = [sha(d[:n]) for d, n in zip(dsts, ASYNC_SIZES)]
    out["rasync_guard"] = all(all_poison(d[n:]) for d, n in zip(dsts, ASYNC_SIZES))

    pf = ch.recv("part_fifo")
    data = rand_bytes(4097, _seed("part", 0))
    pm = ep.reg(addr(data), data.nbytes)[1]
    assert ep.write(conn, pm, addr(data), 4097, pf) is True
    ch.send("async_done")
    return out


@pytest.mark.parametrize("transport", TRANSPORT_NAMES)
def test_one_sided_all_sizes(transport):
    """advertise + write and advertise + read of 0, 1, 4097 and 64 MiB bytes,
    advertisev + writev/readv of 4 windows inside one buffer, 3 write_async and
    3 read_async polled to completion, and a write smaller than its window:
    the target (write) or initiator (read) buffer holds exactly the source
    bytes, nothing lands past a window or between windows, read sources are
    unchanged, and conn_transport() reports the forced transport."""
    env, expect_tp = TRANSPORTS[transport]
    s, c = run_pair(_one_sided_server, _one_sided_client, env=env, timeout=120)
    assert s["tp"] == c["tp"] == expect_tp
    assert s["written"] == [_expect("write", i, n) for i, n in enumerate(SIZES)]
    assert s["written_guard"], "write landed past its window"
    want_read = [_expect("read", i, n) for i, n in enumerate(SIZES)]
    assert c["read"] == want_read
    assert c["read_guard"], "read wrote past the destination region"
    assert s["read_src"] == want_read, "read changed the target's memory"
    assert s["writev"] == [_expect("writev", i, n) for i, n in enumerate(IOV_SIZES)]
    assert s["writev_gaps"], "writev landed between windows"
    assert c["readv"] == [_expect("readv", i, n) for i, n in enumerate(IOV_SIZES)]
    assert c["readv_guard"]
    assert s["wasync"] == [_expect("wasync", i, n) for i, n in enumerate(ASYNC_SIZES)]
    assert s["wasync_guard"]
    assert c["rasync"] == [_expect("rasync", i, n) for i, n in enumerate(ASYNC_SIZES)]
    assert c["rasync_guard"]
    assert s["part"] == _expect("part", 0, 4097)
    assert s["part_rest"], "a 4097-byte write into an 8192-byte window touched bytes past 4097"


# --------------------------------------------------------------------------
# passive accept: the handshake is served without accept()
def _passive_server(ch):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=10)
    assert ep.start_passive_accept() is True
    ch.send("meta", ep.get_metadata())
    ch.recv("connected")
    err = catch(ep.accept, timeout=1)
    return err


def _passive_client(ch):
    from uccl_collective.p2p import Endpoint

    meta = ch.recv("meta")
    ip, port, gpu = Endpoint.parse_metadata(meta)
    out = []
    for _ in range(2):
        with Endpoint(port=0, timeout_s=5) as ep:
            t0 = time.monotonic()
            ok, conn = ep.connect(ip, gpu, remote_port=port)
            out.append((ok, ep.conn_transport(conn), time.monotonic() - t0))
    ch.send("connected")
    return out


def test_passive_accept_serves_connections():
    """After start_passive_accept() an endpoint completes handshakes in the
    background: two clients connect() promptly although the server never calls
    accept(), and accept() on it raises ValueError (not a hang)."""
    err, conns = run_pair(_passive_server, _passive_client, timeout=40)
    assert [(ok, tp) for ok, tp, _ in conns] == [(True, "shm-cma")] * 2
    assert all(dt < 3 for _, _, dt in conns), conns
    assert err and err["value"] and "passive" in err["msg"], err
