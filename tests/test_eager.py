"""Eager path: messages of at most 64 KiB travel with their RTS (TCP: right
behind it on the socket; same host: in a shared-memory slot).

Proves, on real random bytes with poisoned receive buffers:
- messages that arrive before their recv is posted are held and delivered
  intact once it is (the held-buffer path);
- a recv posted before its message is filled straight from the socket;
- more unanswered small messages than the eager cap (16) still all arrive:
  the sender falls back to rendezvous past the cap, in order (and, on shared
  memory, slots are reused only once their message was answered);
- an eager message larger than its recv fails both sides and writes nothing
  (a smaller one is taken: the recv size is a capacity).
"""
from __future__ import annotations

import time

import pytest

from _harness import TRANSPORTS, TRANSPORT_NAMES, addr, all_poison, poisoned, rand_bytes, run_pair, sha
SIZES = [0, 1, 4097, 65536] * 6      # 24 messages: past the 16-message eager cap
LATE_SIZES = [1, 65536, 777] * 11


def _server(ch):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=30)
    ch.send("meta", ep.get_metadata())
    conn = ep.accept(timeout=20)[3]
    out = {"tp": ep.conn_transport(conn)}

    # 1. Everything is sent before any recv is posted.
    ch.recv("all_sent")
    time.sleep(0.3)  # let the bytes reach this side and be held
    bufs = [poisoned(n) for n in SIZES]
    for b, n in zip(bufs, SIZES):
        mr = ep.reg(addr(b), b.nbytes)[1]
        assert ep.recv(conn, mr, addr(b), n) is True
    out["early"] = [sha(b[:n]) for b, n in zip(bufs, SIZES)]
    out["early_guard"] = all(all_poison(b[n:]) for b, n in zip(bufs, SIZES))

    # 2. Recvs posted first, data afterwards (twice round the 16 slots).
    late = [poisoned(n) for n in LATE_SIZES]
    ids = []
    for b, n in zip(late, LATE_SIZES):
        mr = ep.reg(addr(b), b.nbytes)[1]
        ids.append(ep.recv_async(conn, mr, addr(b), n)[1])
    ch.send("posted")
    for t in ids:
        assert ep.wait(t, timeout=20) is True
        ep.release(t)
    out["late"] = [sha(b[:n]) for b, n in zip(late, LATE_SIZES)]
    out["late_guard"] = all(all_poison(b[n:]) for b, n in zip(late, LATE_SIZES))

    # 3. Mismatch: 200 bytes sent, 100 posted (a recv's size is a capacity:
    #    only a larger message is refused); then a good message.
    b = poisoned(100)
    mr = ep.reg(addr(b), b.nbytes)[1]
    try:
        ep.recv(conn, mr, addr(b), 100)
        out["mismatch"] = "no error"
    except ValueError as e:
        out["mismatch"] = str(e)
    out["mismatch_untouched"] = all_poison(b)
    ok = poisoned(300)
    mr = ep.reg(addr(ok), ok.nbytes)[1]
    ep.recv(conn, mr, addr(ok), 300)
    out["after"] = sha(ok[:300])
    ch.recv("done")
    ep.close()
    return out


def _client(ch):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=30)
    conn = ep.add_remote_endpoint(ch.recv("meta"))[1]
    srcs = [rand_bytes(n, 10 + i) for i, n in enumerate(SIZES)]
    ids = [ep.send_async(conn, ep.reg(addr(s), max(s.nbytes, 1))[1], addr(s), s.nbytes)[1]
           if s.nbytes else ep.send_async(conn, ep.reg(0, 0)[1], 0, 0)[1] for s in srcs]
    ch.send("all_sent")
    for t in ids:
        assert ep.wait(t, timeout=20) is True
        ep.release(t)

    ch.recv("posted")
    late = [rand_bytes(n, 50 + i) for i, n in enumerate(LATE_SIZES)]
    for s in late:
        assert ep.send(conn, ep.reg(addr(s), s.nbytes)[1], addr(s), s.nbytes) is True

    bad = rand_bytes(200, 90)
    try:
        ep.send(conn, ep.reg(addr(bad), 200)[1], addr(bad), 200)
        mismatch = "no error"
    except ValueError as e:
        mismatch = str(e)
    good = rand_bytes(300, 91)
    ep.send(conn, ep.reg(addr(good), 300)[1], addr(good), 300)
    ch.send("done")
    ep.close()
    return {"mismatch": mismatch}


@pytest.mark.parametrize("tp", TRANSPORT_NAMES)
def test_eager_held_direct_and_past_the_cap(tp):
    env, expect = TRANSPORTS[tp]
    server, client = run_pair(_server, _client, env=env, timeout=90)
    assert server["tp"] == expect
    assert server["early"] == [sha(rand_bytes(n, 10 + i)) for i, n in enumerate(SIZES)]
    assert server["early_guard"], "a held eager message wrote past its recv"
    assert server["late"] == [sha(rand_bytes(n, 50 + i)) for i, n in enumerate(LATE_SIZES)]
    assert server["late_guard"], "a direct eager message wrote past its recv"
    assert "100" in server["mismatch"] and "200" in server["mismatch"], server["mismatch"]
    assert "100" in client["mismatch"] and "200" in client["mismatch"], client["mismatch"]
    assert server["mismatch_untouched"], "a mismatched eager message was written"
    assert server["after"] == sha(rand_bytes(300, 91))
