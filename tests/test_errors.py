"""Bad inputs between two real processes: each must raise the documented
exception on the right side, write nothing it should not, and leave the
connection usable where the contract says so."""
from __future__ import annotations

import pytest

from _harness import (GUARD, TRANSPORT_NAMES, TRANSPORTS, addr, all_poison, catch, poisoned,
                      rand_bytes, run_pair, sha)

N = 4097


def _accept(ch, timeout_s=20):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=timeout_s)
    ch.send("meta", ep.get_metadata())
    ok, ip, gpu, conn = ep.accept()
    return ep, conn


def _connect(ch, timeout_s=20):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=timeout_s)
    ok, conn = ep.add_remote_endpoint(ch.recv("meta"))
    return ep, conn


# --------------------------------------------------------------------------
# send/recv size mismatch
def _mismatch_server(ch):
    ep, conn = _accept(ch)
    buf = poisoned(N)  # recv region N bytes + guard, all registered
    mr = ep.reg(addr(buf), buf.nbytes)[1]
    out = {"tp": ep.conn_transport(conn)}
    # 1) the sender's message is bigger than the posted recv
    out["bigger"] = catch(ep.recv, conn, mr, addr(buf), N)
    out["bigger_untouched"] = all_poison(buf)
    ch.send("step")
    # 2) the sender's message is smaller than the posted recv: the recv's size
    #    is a capacity (upstream's rule), and received_bytes() tells how much came
    ok, t = ep.recv_async(conn, mr, addr(buf), N)
    out["smaller"] = catch(ep.wait, t)
    out["smaller_len"] = ep.received_bytes(t)
    out["smaller_got"], out["smaller_rest"] = sha(buf[:1000]), all_poison(buf[1000:])
    ep.release(t)
    ch.send("step")
    # 3) a following correct transfer works on the same connection
    assert ep.recv(conn, mr, addr(buf), N) is True
    out["after"], out["after_guard"] = sha(buf[:N]), all_poison(buf[N:])
    return out


def _mismatch_client(ch):
    ep, conn = _connect(ch)
    big = rand_bytes(N + 100, 1)
    mr = ep.reg(addr(big), big.nbytes)[1]
    out = {"bigger": catch(ep.send, conn, mr, addr(big), N + 100)}
    ch.recv("step")
    out["smaller"] = catch(ep.send, conn, mr, addr(big), 1000)
    ch.recv("step")
    good = rand_bytes(N, 2)
    assert ep.send(conn, ep.reg(addr(good), N)[1], addr(good), N) is True
    return out


@pytest.mark.parametrize("transport", TRANSPORT_NAMES)
def test_size_mismatch(transport):
    """A send of N+100 bytes against a recv of N=4097 bytes: the receiver
    raises ValueError naming both sizes, the sender raises ValueError too, and
    nothing at all is written into the receive buffer or past it.  A send of
    1000 bytes into the same recv is taken (the size is a capacity, as
    upstream's): its 1000 bytes land, nothing past them, and received_bytes()
    says 1000.  The next message on the same connection arrives intact."""
    env, tp = TRANSPORTS[transport]
    s, c = run_pair(_mismatch_server, _mismatch_client, env=env, timeout=60)
    assert s["tp"] == tp
    r, snd = s["bigger"], c["bigger"]
    assert r and r["value"], f"receiver: {r}"
    assert str(N) in r["msg"] and str(N + 100) in r["msg"], f"receiver message: {r['msg']}"
    assert snd and snd["value"], f"sender: {snd}"
    assert str(N) in snd["msg"] and str(N + 100) in snd["msg"], f"sender message: {snd['msg']}"
    assert s["bigger_untouched"], "bytes were written into the receive buffer"
    assert s["smaller"] is None and c["smaller"] is None, (s["smaller"], c["smaller"])
    assert s["smaller_len"] == 1000
    assert s["smaller_got"] == sha(rand_bytes(N + 100, 1)[:1000])
    assert s["smaller_rest"], "bytes were written past the 1000 that were sent"
    assert s["after"] == sha(rand_bytes(N, 2)) and s["after_guard"]


# --------------------------------------------------------------------------
# unregistered memory, deregistered mr, unknown ids, wrong direction
def _badmem_server(ch):
    import numpy as np

    ep, conn = _accept(ch)
    out = {}
    buf = poisoned(N)
    other = poisoned(N)                         # never registered
    mr = ep.reg(addr(buf), N)[1]                # only the first N bytes registered
    out["recv_unreg"] = catch(ep.recv, conn, mr, addr(other), N)
    # (a recv running past its region is a capacity the region bounds:
    # test_upstream_api; one that starts outside it is refused)
    out["recv_overhang"] = catch(ep.recv, conn, mr, addr(buf) - 1, N)
    out["adv_unreg"] = catch(ep.advertise, conn, mr, addr(other), N)
    out["adv_overhang"] = catch(ep.advertise, conn, mr, addr(buf), N + 1)
    out["recv_unknown_mr"] = catch(ep.recv, conn, 999999, addr(buf), N)
    out["server_send"] = catch(ep.send, conn, mr, addr(buf), N)         # acceptor cannot send
    out["server_write"] = catch(ep.write, conn, mr, addr(buf), N, bytes(64))
    out["untouched"] = all_poison(buf) and all_poison(other)
    ch.send("go")
    assert ep.recv(conn, mr, addr(buf), N) is True     # the connection still works
    out["after"], out["after_guard"] = sha(buf[:N]), all_poison(buf[N:])
    win = np.full(N, 0xA5, np.uint8)
    wmr = ep.reg(addr(win), N)[1]
    ch.send("fifo", ep.advertise(conn, wmr, addr(win), N)[1])
    ch.recv("written")
    out["written"] = sha(win)
    return out


def _badmem_client(ch):
    ep, conn = _connect(ch)
    out = {}
    data = rand_bytes(N, 3)
    elsewhere = rand_bytes(N, 4)                # never registered
    mr = ep.reg(addr(data), N)[1]
    gone = ep.reg(addr(elsewhere), N)[1]
    ep.dereg(gone)
    out["send_unreg"] = catch(ep.send, conn, mr, addr(elsewhere), N)
    out["send_overhang"] = catch(ep.send, conn, mr, addr(data) + 1, N)
    out["send_dereg"] = catch(ep.send, conn, gone, addr(elsewhere), N)
    out["send_async_dereg"] = catch(ep.send_async, conn, gone, addr(elsewhere), N)
    out["send_unknown_mr"] = catch(ep.send, conn, 999999, addr(data), N)
    out["send_unknown_conn"] = catch(ep.send, 999999, mr, addr(data), N)
    out["client_recv"] = catch(ep.recv, conn, mr, addr(data), N)        # connector cannot recv
    out["client_advertise"] = catch(ep.advertise, conn, mr, addr(data), N)
    out["poll_unknown"] = catch(ep.poll_async, 777777)
    out["wait_unknown"] = catch(ep.wait, 777777)
    out["release_unknown"] = catch(ep.release, 777777)
    ch.recv("go")
    assert ep.send(conn, mr, addr(data), N) is True
    fifo = ch.recv("fifo")
    src = rand_bytes(N, 5)
    out["write_unreg"] = catch(ep.write, conn, mr, addr(src), N, fifo)
    out["write_dereg"] = catch(ep.write, conn, gone, addr(elsewhere), N, fifo)
    smr = ep.reg(addr(src), N)[1]
    assert ep.write(conn, smr, addr(src), N, fifo) is True
    ch.send("written")
    return out


def test_unregistered_memory_and_unknown_ids():
    """Posting with memory outside the given mr (wholly or by one byte), with
    a deregistered or unknown mr_id, on an unknown conn_id, in the wrong
    direction (acceptor send/write, connector recv/advertise), and
    poll/wait/release of an unknown transfer_id all raise ValueError before
    anything moves; no receive buffer is touched and the connection then
    carries a correct send and a correct one-sided write intact."""
    s, c = run_pair(_badmem_server, _badmem_client, env=TRANSPORTS["tcp"][0], timeout=60)
    for side, res in (("server", s), ("client", c)):
        for k, v in res.items():
            if k in ("untouched", "after", "after_guard", "written"):
                continue
            assert v and v["value"], f"{side} {k}: expected ValueError, got {v}"
    assert "777777" in c["poll_unknown"]["msg"]
    assert "999999" in c["send_unknown_conn"]["msg"] and "999999" in c["send_unknown_mr"]["msg"]
    assert s["untouched"]
    assert s["after"] == sha(rand_bytes(N, 3)) and s["after_guard"]
    assert s["written"] == sha(rand_bytes(N, 5))


# --------------------------------------------------------------------------
# one-sided: larger than advertised, tampered fifo items
def _onesided_server(ch):
    import numpy as np

    ep, conn = _accept(ch)
    win = poisoned(N)                          # window = first N bytes, guard registered too
    mr = ep.reg(addr(win), win.nbytes)[1]
    ch.send("fifo", ep.advertise(conn, mr, addr(win), N)[1])
    src = rand_bytes(N, 6)
    smr = ep.reg(addr(src), N + 0)[1]
    ch.send("read_fifo", ep.advertise(conn, smr, addr(src), N)[1])
    ch.recv("bad_done")
    out = {"untouched": all_poison(win), "src_same": sha(src) == sha(rand_bytes(N, 6))}
    ch.send("continue")
    ch.recv("good_done")
    out["written"], out["guard"] = sha(win[:N]), all_poison(win[N:])
    return out


def _tamper(fifo: bytes, lo: int, hi: int) -> bytes:
    b = bytearray(fifo)
    for i in range(lo, hi):
        b[i] ^= 0xFF
    return bytes(b)


def _onesided_client(ch, tamper):
    import struct

    ep, conn = _connect(ch)
    fifo = ch.recv("fifo")
    rfifo = ch.recv("read_fifo")
    src = rand_bytes(N + 100, 7)
    mr = ep.reg(addr(src), src.nbytes)[1]
    dst = poisoned(N + 100)
    dmr = ep.reg(addr(dst), dst.nbytes)[1]
    out = {}
    if not tamper:
        out["write_big"] = catch(ep.write, conn, mr, addr(src), N + 1, fifo)
        out["write_async_big"] = catch(ep.write_async, conn, mr, addr(src), N + 100, fifo)
        out["read_big"] = catch(ep.read, conn, dmr, addr(dst), N + 1, rfifo)
        out["short_fifo"] = catch(ep.write, conn, mr, addr(src), N, fifo[:32])
    else:
        # flip the token (bytes 16..24): the target must refuse
        out["write_token"] = catch(ep.write, conn, mr, addr(src), N, _tamper(fifo, 16, 24))
        out["read_token"] = catch(ep.read, conn, dmr, addr(dst), N, _tamper(rfifo, 16, 24))
        # enlarge the advertised length (bytes 32..40): the local check passes,
        # the target must still refuse bytes past its window
        big = bytearray(fifo)
        big[32:40] = struct.pack("<Q", N + 100)
        out["write_len"] = catch(ep.write, conn, mr, addr(src), N + 100, bytes(big))
    out["dst_untouched"] = all_poison(dst)
    ch.send("bad_done")
    ch.recv("continue")
    if not tamper:  # the genuine descriptor still works after the refusals
        assert ep.write(conn, mr, addr(src), N, fifo) is True
    ch.send("good_done")
    return out


def test_one_sided_larger_than_advertised():
    """write/write_async/read of more bytes than the fifo_item advertises, or
    with a truncated fifo_item, raise ValueError on the initiator; the
    target's window and guard and the initiator's destination stay untouched,
    and the same descriptor then serves a correct write."""
    s, c = run_pair(_onesided_server, _onesided_client, env=TRANSPORTS["tcp"][0],
                    client_kwargs={"tamper": False}, timeout=60)
    for k in ("write_big", "write_async_big", "read_big", "short_fifo"):
        assert c[k] and c[k]["value"], f"{k}: {c[k]}"
    assert str(N) in c["write_big"]["msg"], c["write_big"]["msg"]
    assert s["untouched"] and s["src_same"] and c["dst_untouched"]
    assert s["written"] == sha(rand_bytes(N + 100, 7)[:N]) and s["guard"]


@pytest.mark.parametrize("transport", ["tcp", "shm-cma", "shm-ring", "rdma"])
def test_tampered_fifo_item(transport):
    """A fifo_item whose token (bytes 16..24) is flipped is refused by the
    target: write and read raise on the initiator, and neither the target
    window nor the initiator's buffer changes.  A fifo_item whose length field
    was enlarged passes the initiator's own check but the target refuses to
    touch bytes past its advertised window (UcclError)."""
    env, _ = TRANSPORTS[transport]
    s, c = run_pair(_onesided_server, _onesided_client, env=env,
                    client_kwargs={"tamper": True}, timeout=60)
    assert s["untouched"], "a tampered descriptor changed the target's memory"
    assert s["src_same"] and c["dst_untouched"]
    assert c["write_len"] and c["write_len"]["uccl"], f"enlarged length: {c['write_len']}"
    for k in ("write_token", "read_token"):
        assert c[k] is not None, f"{k}: the tampered descriptor was accepted"


def test_tampered_fifo_token_raises_uccl_error():
    """The initiator's error for a token the target refuses is a UcclError
    (a transfer refused by the peer, not a local caller mistake), for both
    write and read."""
    s, c = run_pair(_onesided_server, _onesided_client, env=TRANSPORTS["tcp"][0],
                    client_kwargs={"tamper": True}, timeout=60)
    for k in ("write_token", "read_token"):
        assert c[k] and c[k]["uccl"], f"{k}: expected UcclError, got {c[k]['type']}: {c[k]['msg']}"


# --------------------------------------------------------------------------
# a descriptor dies with the registration behind it
def _dereg_target(ch):
    ep, conn = _accept(ch)
    win = poisoned(N, guard=0)
    mr = ep.reg(addr(win), N)[1]
    ch.send("fifo", ep.advertise(conn, mr, addr(win), N)[1])
    ch.recv("have_fifo")
    assert ep.dereg(mr) is True
    ch.send("deregistered")
    ch.recv("tried")
    return all_poison(win)


def _dereg_initiator(ch):
    ep, conn = _connect(ch)
    fifo = ch.recv("fifo")
    ch.send("have_fifo")
    src = rand_bytes(N, 8)
    dst = poisoned(N)
    smr, dmr = ep.reg(addr(src), N)[1], ep.reg(addr(dst), dst.nbytes)[1]
    ch.recv("deregistered")
    out = {"write": catch(ep.write, conn, smr, addr(src), N, fifo),
           "read": catch(ep.read, conn, dmr, addr(dst), N, fifo)}
    out["dst_untouched"] = all_poison(dst)
    ch.send("tried")
    return out


@pytest.mark.parametrize("transport", ["tcp", "shm-cma", "rdma"])
def test_fifo_item_dies_with_dereg(transport):
    """Once the target deregisters the mr behind an advertised window, write
    and read through the old fifo_item both raise on the initiator and touch
    neither the target's (poisoned) window nor the initiator's buffer."""
    env, _ = TRANSPORTS[transport]
    untouched, c = run_pair(_dereg_target, _dereg_initiator, env=env, timeout=60)
    assert c["write"] is not None and c["read"] is not None, c
    assert untouched, "a write through a stale descriptor landed in deregistered memory"
    assert c["dst_untouched"]
