"""Upstream's newer one-sided API (issue 12): register_memory,
get_serialized_descs / deserialize_descs, transfer and deregister_memory
with XferDesc; advertise(mr_id, ptr, size) without a connection; one id for
several transfers (transfer() of several descriptors, sendv_async and the
other vectored async calls).  Two endpoints of this process over loopback;
random bytes, poisoned destinations, compared end to end."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from uccl_collective import p2p
from uccl_collective.p2p import XferDesc

from _harness import GUARD, addr, all_poison, poisoned, rand_bytes

# Set by test_this_module_over_rdma for the process it runs this module in
# (conftest clears UCCL_P2P_TRANSPORT, so the choice is made here).
OVER_RDMA = os.environ.get("UCCL_TEST_XFER_OVER_RDMA") == "1"
if OVER_RDMA:
    import _ibv_emu
    os.environ.update(_ibv_emu.env())


def _pair(endpoints):
    """(initiator, target, initiator's conn, target's conn)."""
    tgt, ini = endpoints(), endpoints()
    ok, conn = ini.add_remote_endpoint(tgt.get_metadata())
    ok2, _ip, _gpu, tconn = tgt.accept()
    assert ok and ok2
    if OVER_RDMA:   # the run of test_this_module_over_rdma
        assert ini.conn_transport(conn) == "rdma", ini.conn_transport(conn)
    return ini, tgt, conn, tconn


def _wait(ep, tid, bound=200000):
    for _ in range(bound):
        if ep.poll_async(tid) == (True, True):
            return
    raise AssertionError(f"transfer {tid} not done")


SIZES = [1, 4097, 65536, 1 << 20]


def test_register_serialize_transfer_write_and_read(endpoints):
    """register_memory on both sides, the target's descriptors serialized and
    deserialized on the initiator, then transfer("write") of four buffers in
    one call (one id) and transfer("read") back into fresh buffers: every
    byte lands, nothing past any range; deregister_memory revokes the
    target's descriptors (a later write fails, writing nothing)."""
    ini, tgt, conn, _ = _pair(endpoints)
    srcs = [rand_bytes(n, 300 + i) for i, n in enumerate(SIZES)]
    dsts = [poisoned(n) for n in SIZES]
    tdescs = tgt.register_memory([d[:n] for d, n in zip(dsts, SIZES)])
    assert [(d.addr, d.size) for d in tdescs] == [(addr(d), n) for d, n in zip(dsts, SIZES)]
    assert all(d["addr"] == d.addr and "rkeys" in d for d in tdescs)
    wire = tgt.get_serialized_descs(tdescs)
    assert isinstance(wire, bytes)
    remote = ini.deserialize_descs(wire)
    assert remote == tdescs and all(r.mr_id == 0 for r in remote)
    local = ini.register_memory(srcs)
    ok, tid = ini.transfer(conn, "write", local, remote)
    assert ok
    _wait(ini, tid)
    assert ini.wait(tid) is True
    for s, d, n in zip(srcs, dsts, SIZES):
        assert np.array_equal(d[:n], s) and all_poison(d[n:n + GUARD])
    assert ini.release(tid) is True
    with pytest.raises(ValueError):
        ini.poll_async(tid)
    # read back into fresh buffers
    backs = [poisoned(n) for n in SIZES]
    bl = ini.register_memory([b[:n] for b, n in zip(backs, SIZES)])
    ok, tid = ini.transfer(conn, "read", bl, remote)
    assert ini.wait(tid) is True
    for s, b, n in zip(srcs, backs, SIZES):
        assert np.array_equal(b[:n], s) and all_poison(b[n:n + GUARD])
    # revoked
    assert tgt.deregister_memory(tdescs) is True
    for d in dsts:
        d[:] = d[-1]
    with pytest.raises((ValueError, p2p.UcclError)):
        ok, tid = ini.transfer(conn, "write", local[:1], remote[:1])
        ini.wait(tid)
    assert all(all_poison(d) for d in dsts)


def test_connectionless_advertise(endpoints):
    """advertise(mr_id, ptr, size) (upstream's newer form) gives a descriptor
    any connected peer may use: two initiators write into the same window
    through their own connections; the range still bounds each access."""
    tgt = endpoints()
    n = 8192
    dst = poisoned(n)
    mr = tgt.reg(addr(dst), n)[1]
    ok, fifo = tgt.advertise(mr, addr(dst), n)
    assert ok and len(fifo) == p2p._engine.FIFO_ITEM_SIZE
    for k in range(2):
        ini = endpoints()
        ok, conn = ini.add_remote_endpoint(tgt.get_metadata())
        assert tgt.accept()[0] is True
        src = rand_bytes(n // 2, 400 + k)
        smr = ini.reg(addr(src), src.size)[1]
        assert ini.write(conn, smr, addr(src), n // 2, fifo) is True
        assert np.array_equal(dst[:n // 2], src)
        big = rand_bytes(n + 1, 410 + k)
        bmr = ini.reg(addr(big), big.size)[1]
        with pytest.raises(ValueError) as e:
            ini.write(conn, bmr, addr(big), n + 1, fifo)
        assert str(n + 1) in str(e.value)
    assert all_poison(dst[n:])


def test_vectored_async_calls_have_one_id(endpoints):
    """sendv_async/recvv_async and writev_async/readv_async return one id for
    all their iovs; it answers poll_async and wait like any other, and
    release() forgets all of it."""
    ini, tgt, conn, tconn = _pair(endpoints)
    sizes = [3, 4097, 70000]
    srcs = [rand_bytes(n, 500 + i) for i, n in enumerate(sizes)]
    dsts = [poisoned(n) for n in sizes]
    smrs = ini.regv([addr(s) for s in srcs], sizes)[1]
    dmrs = tgt.regv([addr(d) for d in dsts], sizes)[1]
    ok, rid = tgt.recvv_async(tconn, dmrs, [addr(d) for d in dsts], sizes, 3)
    ok, sid = ini.sendv_async(conn, smrs, [addr(s) for s in srcs], sizes, 3)
    _wait(ini, sid)
    _wait(tgt, rid)
    for s, d, n in zip(srcs, dsts, sizes):
        assert np.array_equal(d[:n], s) and all_poison(d[n:n + GUARD])
    assert ini.release(sid) and tgt.release(rid)
    fifos = tgt.advertisev(dmrs, [addr(d) for d in dsts], sizes, 3)[1]
    news = [rand_bytes(n, 600 + i) for i, n in enumerate(sizes)]
    nmrs = ini.regv([addr(s) for s in news], sizes)[1]
    ok, wid = ini.writev_async(conn, nmrs, [addr(s) for s in news], sizes, fifos, 3)
    assert ini.wait(wid) is True
    for s, d, n in zip(news, dsts, sizes):
        assert np.array_equal(d[:n], s) and all_poison(d[n:n + GUARD])
    backs = [poisoned(n) for n in sizes]
    bmrs = ini.regv([addr(b) for b in backs], sizes)[1]
    ok, rdid = ini.readv_async(conn, bmrs, [addr(b) for b in backs], sizes, fifos, 3)
    assert ini.wait(rdid) is True
    for s, b, n in zip(news, backs, sizes):
        assert np.array_equal(b[:n], s) and all_poison(b[n:n + GUARD])


def test_xfer_api_rejects_bad_input(endpoints):
    """Bad entries raise naming the problem, before anything is registered or
    posted."""
    ep = endpoints()
    for bad in ([123], [np.zeros(4, np.uint8), "not a tensor"]):
        with pytest.raises(TypeError) as e:
            ep.register_memory(bad)
        assert isinstance(e.value, RuntimeError), "upstream's tests catch RuntimeError here"
        assert f"entry {len(bad) - 1}" in str(e.value)
    assert ep.register_memory([]) == []
    assert ep.deserialize_descs(ep.get_serialized_descs([])) == []
    with pytest.raises(ValueError, match="header"):
        ep.deserialize_descs(b"nonsense")
    with pytest.raises(TypeError, match="XferDesc"):
        ep.get_serialized_descs(["x"])
    d = XferDesc(1, 8, 1, [1], [0] * 3)
    with pytest.raises(ValueError, match="rkeys"):
        ep.get_serialized_descs([d])
    with pytest.raises(ValueError, match="op_name"):
        ep.transfer(1, "copy", [], [])
    with pytest.raises(ValueError, match="2 local"):
        ep.transfer(1, "write", [d, d], [d])


def test_ipc_calls_without_mr_id(endpoints):
    """Upstream's IPC forms without an mr_id: send_ipc/recv_ipc (and _async),
    advertise_ipc + write_ipc/read_ipc (and _async), advertisev_ipc +
    writev_ipc/readv_ipc (and _async): each buffer is registered on first use
    (once: a second call reuses it), the bytes land, nothing past them; a
    dereg() of such a registration is honoured (the next call registers
    afresh); the mr_id forms still work beside them."""
    ini, tgt, conn, tconn = _pair(endpoints)
    n = 4097
    src, dst = rand_bytes(n, 700), poisoned(n)
    ok, tid = ini.send_ipc_async(conn, addr(src), n)
    assert tgt.recv_ipc(tconn, addr(dst), n) is True and ini.wait(tid) is True
    assert np.array_equal(dst[:n], src) and all_poison(dst[n:n + GUARD])
    held = dict(tgt._ipc_regs)
    src2 = rand_bytes(n, 701)
    ok, rid = tgt.recv_ipc_async(tconn, addr(dst), n)
    assert ini.send_ipc(conn, addr(src2), n) is True and tgt.wait(rid) is True
    assert np.array_equal(dst[:n], src2) and tgt._ipc_regs == held    # reused
    # one-sided, single
    ok, info = tgt.advertise_ipc(tconn, addr(dst), n)
    src3 = rand_bytes(n, 702)
    assert ini.write_ipc(conn, addr(src3), n, info) is True
    assert np.array_equal(dst[:n], src3) and all_poison(dst[n:n + GUARD])
    back = poisoned(n)
    ok, tid = ini.read_ipc_async(conn, addr(back), n, info)
    assert ini.wait(tid) is True and np.array_equal(back[:n], src3)
    # one-sided, vectored
    sizes = [1, 4097, 65536]
    dsts = [poisoned(k) for k in sizes]
    ok, infos = tgt.advertisev_ipc(tconn, [addr(d) for d in dsts], sizes)
    srcs = [rand_bytes(k, 710 + i) for i, k in enumerate(sizes)]
    assert ini.writev_ipc(conn, [addr(s) for s in srcs], sizes, infos) is True
    for s, d, k in zip(srcs, dsts, sizes):
        assert np.array_equal(d[:k], s) and all_poison(d[k:k + GUARD])
    backs = [poisoned(k) for k in sizes]
    ok, tid = ini.readv_ipc_async(conn, [addr(b) for b in backs], sizes, infos)
    assert ini.wait(tid) is True
    for s, b, k in zip(srcs, backs, sizes):
        assert np.array_equal(b[:k], s) and all_poison(b[k:k + GUARD])
    # dereg of an automatic registration, then the same buffer again
    mr = tgt._ipc_regs[addr(dst)][1]
    assert tgt.dereg(mr) is True and addr(dst) not in tgt._ipc_regs
    ok, tid = ini.send_ipc_async(conn, addr(src), n)
    assert tgt.recv_ipc(tconn, addr(dst), n) is True and ini.wait(tid) is True
    assert np.array_equal(dst[:n], src)
    # the mr_id form beside them
    smr = ini.reg(addr(src2), n)[1]
    rmr = tgt.reg(addr(dst), n)[1]
    ok, tid = ini.send_ipc_async(conn, smr, addr(src2), n)
    assert tgt.recv_ipc(tconn, rmr, addr(dst), n) is True and ini.wait(tid) is True
    assert np.array_equal(dst[:n], src2)
    with pytest.raises(TypeError, match="send_ipc takes"):
        ini.send_ipc(conn, addr(src))


def test_registrations_inside_one_share_its_keys(endpoints):
    """Upstream's registration cache: the same buffer registered again, and
    a range inside it, get their own mr_id but the same lkeys and rkeys
    (len(lkeys) == len(rkeys) > 0); a peer's transfer through a sub-range's
    descriptor lands exactly in that range; the keys keep working while any
    descriptor sharing them is registered, and stop after the last."""
    ini, tgt, conn, _ = _pair(endpoints)
    n = 1 << 16
    back = poisoned(n)
    whole = back[:n]
    d_whole, d_again = tgt.register_memory([whole]), tgt.register_memory([whole])
    d_sub = tgt.register_memory([whole[1000:5097]])
    ids = {d_whole[0].mr_id, d_again[0].mr_id, d_sub[0].mr_id}
    assert len(ids) == 3
    for d in (d_again[0], d_sub[0]):
        assert d.lkeys == d.rkeys == d_whole[0].rkeys and len(d.rkeys) > 0
    assert (d_sub[0].addr, d_sub[0].size) == (addr(back) + 1000, 4097)
    remote_sub = ini.deserialize_descs(tgt.get_serialized_descs(d_sub))
    assert remote_sub[0].lkeys == d_sub[0].lkeys and remote_sub == d_sub
    src = rand_bytes(4097, 501)
    local = ini.register_memory([src])
    # the whole registration's own descriptors go first: the sub-range's keys live on
    tgt.deregister_memory(d_whole + d_again)
    ok, tid = ini.transfer(conn, "write", local, remote_sub)
    assert ini.wait(tid) is True
    assert np.array_equal(back[1000:5097], src)
    assert all_poison(back[:1000]) and all_poison(back[5097:])
    # a descriptor naming a range past the window its keys name is refused
    # before anything moves, and a forged one by the owner (ACCESS)
    wide = XferDesc(remote_sub[0].addr, n, 0, remote_sub[0].rkeys, remote_sub[0].rkeys)
    with pytest.raises(ValueError, match="outside the registration"):
        ini.transfer(conn, "write", ini.register_memory([rand_bytes(n, 502)]), [wide])
    # the last one goes: the keys stop working, nothing lands
    tgt.deregister_memory(d_sub)
    back[:] = back[-1]
    with pytest.raises((ValueError, p2p.UcclError)):
        ok, tid = ini.transfer(conn, "write", local, remote_sub)
        ini.wait(tid)
    assert all_poison(back)


def test_advertising_a_range_again_gives_its_window_again(endpoints):
    """A window lives until its region is deregistered: a loop advertising
    the same range at every step gets the same window (so the owner's table
    does not grow by one a step), another range its own, and writes through
    it land; after dereg the old descriptor is refused and a new
    registration's window is another."""
    from uccl_collective import _engine
    ini, tgt, conn, tconn = _pair(endpoints)
    n = 4096
    dst = poisoned(2 * n)
    mr = tgt.reg(addr(dst), 2 * n)[1]
    first = tgt.advertise(tconn, mr, addr(dst), n)[1]
    other = tgt.advertise(tconn, mr, addr(dst) + n, n)[1]
    anyone = tgt.advertise(mr, addr(dst), n)[1]   # no connection: another window
    ids = {_engine.fifo_fields(f)[0] for f in (first, other, anyone)}
    assert len(ids) == 3, ids
    for step in range(2000):
        f = tgt.advertise(tconn, mr, addr(dst), n)[1]
        assert f == first, f"step {step}: a new window for the same range"
    assert tgt.advertise(tconn, mr, addr(dst) + n, n)[1] == other
    for k, f in enumerate((first, tgt.advertise(tconn, mr, addr(dst), n)[1])):
        src = rand_bytes(n, 520 + k)
        smr = ini.reg(addr(src), n)[1]
        assert ini.write(conn, smr, addr(src), n, f) is True
        assert np.array_equal(dst[:n], src) and all_poison(dst[n:])
    assert tgt.dereg(mr) is True
    src = rand_bytes(n, 530)
    smr = ini.reg(addr(src), n)[1]
    with pytest.raises(p2p.UcclError, match="the peer refused the write"):
        ini.write(conn, smr, addr(src), n, first)
    assert np.array_equal(dst[:n], rand_bytes(n, 521)) and all_poison(dst[n:])
    mr2 = tgt.reg(addr(dst), 2 * n)[1]
    again = tgt.advertise(tconn, mr2, addr(dst), n)[1]
    assert _engine.fifo_fields(again)[0] not in ids


def test_a_forged_range_past_its_window_is_refused_by_the_owner(endpoints):
    """A one-sided descriptor whose start lies inside a window but whose
    length runs past it (built by hand, as a hostile peer would) is refused
    by the window's owner: the transfer fails and writes nothing."""
    from uccl_collective import _engine
    ini, tgt, conn, _ = _pair(endpoints)
    back = poisoned(4096)
    d = tgt.register_memory([back[:4096]])[0]
    window, token = _engine.fifo_fields(d.fifo())[:2]
    forged = _engine.fifo_item(window, token, d.addr + 4000, 200, d.addr)
    src = rand_bytes(200, 503)
    _, mr = ini.reg(addr(src), src.size)
    with pytest.raises(p2p.UcclError) as e:
        ini.write(conn, mr, addr(src), 200, forged)
    assert "outside" in str(e.value)
    assert all_poison(back)
    with pytest.raises(ValueError, match="window"):
        _engine.fifo_fields(_engine.fifo_item(window, token, d.addr - 1, 8, d.addr))


@pytest.mark.skipif(OVER_RDMA, reason="this is the run over RDMA already")
def test_this_module_over_rdma():
    """Every test above again, in a process whose endpoints use the RDMA
    transport through the verbs emulator (tests/ibv_emu): registrations
    sharing keys and ranges inside a window go through its READ/WRITE."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, UCCL_TEST_XFER_OVER_RDMA="1", PYTHONPATH=os.pathsep.join(
        p for p in (repo, os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-o", "faulthandler_timeout=120",
                        os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=repo)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "1 skipped" in r.stdout, r.stdout[-2000:]
