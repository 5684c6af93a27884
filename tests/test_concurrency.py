"""Many transfers in flight at once: 4 connections from one client to one
server, 2 messages per connection posted before any completes, all polled to
completion and checked byte for byte."""
from __future__ import annotations

import time

import pytest

from _harness import TRANSPORTS, addr, all_poison, peer_ip, poisoned, rand_bytes, run_pair, sha, MiB

NCONN, PER_CONN = 4, 2


def _size(c, m):
    return 1 * MiB + 4097 * (c * PER_CONN + m)  # all different, none page-aligned


def _seed(c, m):
    return 100 + c * PER_CONN + m


def _poll_until_done(ep, ids, bound=60.0):
    pending, rounds = set(ids), 0
    deadline = time.monotonic() + bound
    while pending:
        rounds += 1
        for t in list(pending):
            if ep.poll_async(t)[1]:
                pending.discard(t)
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(pending)} transfers not done within {bound} s")
        time.sleep(0.0005)
    return rounds


def _server(ch):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=60)
    ch.send("port", ep.address()[1])
    conns = []
    for c in range(NCONN):
        ch.recv(f"connected{c}")   # exactly one connection is pending: accept() returns it
        ok, ip, gpu, conn = ep.accept(timeout=20)
        conns.append(conn)
    assert len(set(conns)) == NCONN
    bufs = {(c, m): poisoned(_size(c, m)) for c in range(NCONN) for m in range(PER_CONN)}
    ids = {}
    for (c, m), b in bufs.items():  # post all 8 receives before any data flows
        mr = ep.reg(addr(b), b.nbytes)[1]
        ids[(c, m)] = ep.recv_async(conns[c], mr, addr(b), _size(c, m))[1]
    ch.send("posted")
    _poll_until_done(ep, ids.values())
    for t in ids.values():
        assert ep.poll_async(t) == (True, True)
        ep.release(t)
    return {"tp": [ep.conn_transport(c) for c in conns],
            "got": {k: sha(b[:_size(*k)]) for k, b in bufs.items()},
            "guard": all(all_poison(b[_size(*k):]) for k, b in bufs.items())}


def _client(ch):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=60)
    port = ch.recv("port")
    conns = []
    for c in range(NCONN):
        ok, conn = ep.connect(peer_ip(), -1, remote_port=port)
        assert ok is True
        conns.append(conn)
        ch.send(f"connected{c}")
    assert len(set(conns)) == NCONN, "connect() makes a new connection each time"
    srcs = {(c, m): rand_bytes(_size(c, m), _seed(c, m)) for c in range(NCONN) for m in range(PER_CONN)}
    ids = []
    ch.recv("posted")
    for (c, m), s in srcs.items():  # 8 sends in flight, 2 per connection, in message order
        mr = ep.reg(addr(s), s.nbytes)[1]
        ok, t = ep.send_async(conns[c], mr, addr(s), s.nbytes)
        assert ok is True
        ids.append(t)
    assert len(set(ids)) == len(ids)
    _poll_until_done(ep, ids)
    for t in ids:
        assert ep.wait(t, timeout=1) is True
        ep.release(t)
    return {"tp": [ep.conn_transport(c) for c in conns], "sent": {k: sha(s) for k, s in srcs.items()}}


@pytest.mark.parametrize("transport", ["tcp", "shm-cma", "shm-ring", "rdma"])
def test_eight_async_over_four_connections(transport):
    """4 connect() calls from one client give 4 distinct connections; 8
    send_async/recv_async (2 per connection, ~1 MiB each, all different sizes)
    in flight at once all complete under poll_async, every message lands in
    its own buffer intact and in order per connection, and nothing is written
    past any receive region."""
    env, expect_tp = TRANSPORTS[transport]
    s, c = run_pair(_server, _client, env=env, timeout=120)
    assert s["tp"] == c["tp"] == [expect_tp] * NCONN
    want = {(ci, m): sha(rand_bytes(_size(ci, m), _seed(ci, m)))
            for ci in range(NCONN) for m in range(PER_CONN)}
    assert c["sent"] == want
    assert s["got"] == want
    assert s["guard"]


def _stall_server(ch):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=30)
    ch.send("port", ep.address()[1])
    conns = []
    for c in range(2):
        ch.recv(f"connected{c}")
        conns.append(ep.accept(timeout=20)[3])
    stalled = poisoned(1 * MiB)
    mr = ep.reg(addr(stalled), stalled.nbytes)[1]
    stalled_id = ep.recv_async(conns[0], mr, addr(stalled), 1 * MiB)[1]  # its sender waits
    live = poisoned(4 * MiB + 1)
    mr2 = ep.reg(addr(live), live.nbytes)[1]
    t0 = time.monotonic()
    ep.recv(conns[1], mr2, addr(live), 4 * MiB + 1)
    live_s = time.monotonic() - t0
    still_pending = ep.poll_async(stalled_id) == (True, False)
    ch.send("live_done")
    assert ep.wait(stalled_id, timeout=20) is True
    ep.release(stalled_id)
    return {"live": sha(live[:4 * MiB + 1]), "stalled": sha(stalled[:1 * MiB]),
            "still_pending": still_pending, "live_s": live_s}


def _stall_client(ch):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=30)
    port = ch.recv("port")
    conns = []
    for c in range(2):
        conns.append(ep.connect(peer_ip(), 0, remote_port=port)[1])
        ch.send(f"connected{c}")
    live = rand_bytes(4 * MiB + 1, 7)
    ep.send(conns[1], ep.reg(addr(live), live.nbytes)[1], addr(live), live.nbytes)
    ch.recv("live_done")  # only now does the first connection's message go out
    stalled = rand_bytes(1 * MiB, 8)
    ep.send(conns[0], ep.reg(addr(stalled), stalled.nbytes)[1], addr(stalled), stalled.nbytes)
    return True


@pytest.mark.parametrize("tp", list(TRANSPORTS))
def test_a_stalled_connection_does_not_hold_up_another(tp):
    """A recv pending on one connection (its sender holds back) does not delay
    a transfer on another: connections progress independently, not through
    one serial thread.  The held-back message then arrives intact."""
    env, _ = TRANSPORTS[tp]
    server, _ = run_pair(_stall_server, _stall_client, env=env, timeout=60)
    assert server["still_pending"], "the stalled recv completed without a sender"
    assert server["live"] == sha(rand_bytes(4 * MiB + 1, 7))
    assert server["stalled"] == sha(rand_bytes(1 * MiB, 8))
    assert server["live_s"] < 5.0, f"the live transfer took {server['live_s']:.1f} s"
