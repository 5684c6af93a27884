"""Upstream's API names and argument forms (issue 12) that this package
accepts so that upstream code runs with only its import changed: so far
p2p.FloatType with reg(ptr, size, floatType=...) and keyword arguments, and
regv.  Data moves between two endpoints of this process over loopback;
bytes are random, receive buffers poisoned, and compared end to end."""
from __future__ import annotations

import numpy as np
import pytest

from uccl_collective import p2p
from uccl_collective.p2p import FloatType

from _harness import GUARD, addr, all_poison, poisoned, rand_bytes


def _pair(endpoints):
    """(sender, receiver, send conn, recv conn) over loopback."""
    rx, tx = endpoints(), endpoints()
    ip, port = rx.address()
    ok, conn = tx.connect(ip, -1, port)
    assert ok
    ok, _ip, _gpu, rconn = rx.accept()
    assert ok
    return tx, rx, conn, rconn


def _exchange(tx, rx, conn, rconn, src, dst, smr, rmr, n):
    """send_async of n bytes of src (region smr) into dst (region rmr), the
    recv blocking; the bytes must land and nothing past them."""
    ok, tid = tx.send_async(conn, smr, addr(src), n)
    assert ok
    assert rx.recv(rconn, rmr, addr(dst), n) is True
    assert tx.wait(tid) is True
    assert np.array_equal(dst[:n], src[:n]) and all_poison(dst[n:n + GUARD])


def test_float_type_names_and_values():
    """The names upstream's scripts use (HEAD added the two fp8 kinds)."""
    assert p2p.FloatType is FloatType
    assert {m.name: int(m) for m in FloatType} == {
        "kUndefined": 0, "kFloat16": 1, "kBFloat16": 2, "kFloat32": 3, "kFloat8E4M3FN": 4,
        "kFloat8E5M2": 5}


@pytest.mark.parametrize("ft", list(FloatType) + [0, 3])
def test_reg_with_float_type_moves_the_bytes(endpoints, ft):
    """reg(ptr, size, floatType) in every form registers as reg(ptr, size):
    a transfer of random bytes from and into such regions lands intact,
    uncompressed, with the guard past the receive region untouched."""
    tx, rx, conn, rconn = _pair(endpoints)
    n = 4097
    src = rand_bytes(n, 71)
    dst = poisoned(n)
    ok, smr = tx.reg(addr(src), n, ft)
    assert ok
    ok, rmr = rx.reg(ptr=addr(dst), size=n, floatType=ft)
    assert ok
    _exchange(tx, rx, conn, rconn, src, dst, smr, rmr, n)


@pytest.mark.parametrize("bad,exc,words", [
    (7, ValueError, ["floatType 7", "kFloat32=3"]),
    (-1, ValueError, ["floatType -1"]),
    ("kFloat32", TypeError, ["floatType", "str"]),
    (True, TypeError, ["floatType", "bool"]),
    (1.0, TypeError, ["floatType", "float"]),
])
def test_reg_rejects_a_bad_float_type(endpoints, bad, exc, words):
    """An unknown floatType raises, naming the value (and the known ones);
    nothing is registered."""
    ep = endpoints()
    buf = np.zeros(64, np.uint8)
    with pytest.raises(exc) as e:
        ep.reg(addr(buf), 64, floatType=bad)
    for w in words:
        assert w in str(e.value)
    ok, mr = ep.reg(addr(buf), 64)     # the next registration is the first one made
    assert ok and mr == 1


def test_regv_registers_each_region(endpoints):
    """regv(ptrs, sizes) -> (True, [mr_id per region]); each id carries a
    transfer of its own region's bytes."""
    tx, rx, conn, rconn = _pair(endpoints)
    sizes = [1, 4097, 65536]
    srcs = [rand_bytes(n, 80 + i) for i, n in enumerate(sizes)]
    dsts = [poisoned(n) for n in sizes]
    ok, smrs = tx.regv([addr(s) for s in srcs], sizes)
    assert ok is True and len(smrs) == 3 and len(set(smrs)) == 3
    ok, rmrs = rx.regv(ptrs=[addr(d) for d in dsts], sizes=sizes)
    assert ok is True and len(rmrs) == 3
    for src, dst, smr, rmr, n in zip(srcs, dsts, smrs, rmrs, sizes):
        _exchange(tx, rx, conn, rconn, src, dst, smr, rmr, n)


def test_regv_failure_registers_nothing(endpoints):
    """A region that cannot be registered raises with its reason, and the
    regions registered before it in the same call are deregistered."""
    ep = endpoints()
    a = np.zeros(32, np.uint8)
    with pytest.raises(ValueError) as e:
        ep.regv([addr(a), 0], [32, 8])
    assert "address 0" in str(e.value)
    with pytest.raises(ValueError):
        ep.dereg(1)                    # the first region's id was given back
    with pytest.raises(ValueError) as e:
        ep.regv([addr(a)], [32, 8])
    assert "1 pointers but 2 sizes" in str(e.value)


def _send_recv(tx, rx, conn, rconn, n, seed):
    src, dst = rand_bytes(n, seed), poisoned(n)
    _exchange(tx, rx, conn, rconn, src, dst, tx.reg(addr(src), n)[1], rx.reg(addr(dst), n)[1], n)


def test_remove_remote_endpoint(endpoints):
    """add_remote_endpoint then remove_remote_endpoint: True once, then False
    (as upstream: nothing left to remove; an id never made is False too);
    the removed connection refuses transfers with a ValueError naming it, the
    peer's side of it fails, and adding the same peer again connects afresh
    (a new conn_id) and moves data."""
    tx, rx = endpoints(), endpoints()
    assert tx.remove_remote_endpoint(999999) is False
    meta = rx.get_metadata()
    ok, conn = tx.add_remote_endpoint(meta)
    assert ok
    assert tx.add_remote_endpoint(meta) == (True, conn)     # cached per peer
    ok, _ip, _gpu, rconn = rx.accept()
    _send_recv(tx, rx, conn, rconn, 4097, 91)
    assert tx.remove_remote_endpoint(conn) is True
    assert tx.remove_remote_endpoint(conn) is False
    buf = rand_bytes(64, 92)
    mr = tx.reg(addr(buf), 64)[1]
    with pytest.raises(ValueError) as e:
        tx.send(conn, mr, addr(buf), 64)
    assert str(conn) in str(e.value)
    dst = poisoned(64)
    rmr = rx.reg(addr(dst), 64)[1]
    with pytest.raises(p2p.UcclError):
        rx.recv(rconn, rmr, addr(dst), 64)                 # the peer closed it
    assert all_poison(dst)
    ok, conn2 = tx.add_remote_endpoint(meta)
    assert ok and conn2 != conn
    ok, _ip, _gpu, rconn2 = rx.accept()
    _send_recv(tx, rx, conn2, rconn2, 65536, 93)


def test_get_oob_ip(endpoints):
    """get_oob_ip() is the address endpoints advertise (UCCL_SOCKET_IFNAME=lo
    in the tests)."""
    assert p2p.get_oob_ip() == "127.0.0.1" == endpoints().address()[0]


def _post_and_poll(tx, rx, conn, rconn, smr, rmr, src_at, dst_at, n, what):
    """One async pair in upstream's style: post both, poll each until done,
    never release.  Returns (send id, recv id)."""
    rid = rx.recv_async(rconn, rmr, dst_at, n)[1]
    sid = tx.send_async(conn, smr, src_at, n)[1]
    for ep, t in ((tx, sid), (rx, rid)):
        for _ in range(10_000_000):
            if ep.poll_async(t) == (True, True):
                break
        else:
            raise AssertionError(f"transfer {t} ({what}) not done")
    return sid, rid


def _loop_never_released(tx, rx, conn, rconn, n_xfers, seed):
    """Upstream's style: post, poll until done, never release.  Returns
    every id each side got, and the most ids either table held."""
    src, dst = rand_bytes(8 * n_xfers, seed), poisoned(8 * n_xfers)
    smr, rmr = tx.reg(addr(src), src.size)[1], rx.reg(addr(dst), dst.size)[1]
    sids, rids, most = [], [], 0
    for k in range(n_xfers):
        sid, rid = _post_and_poll(tx, rx, conn, rconn, smr, rmr, addr(src) + 8 * k,
                                  addr(dst) + 8 * k, 8, f"number {k}")
        sids.append(sid)
        rids.append(rid)
        most = max(most, tx._ids_held(), rx._ids_held())
    assert np.array_equal(dst[:src.size], src), "the bytes of the loop did not all land"
    return sids, rids, most


def test_unreleased_ids_stay_bounded(endpoints, monkeypatch):
    """A loop of async transfers that never calls release() keeps at most
    UCCL_P2P_DONE_IDS finished ids per endpoint (here 64, over 3000
    transfers), every id ever returned still answers done (a second poll is
    never a use after free), and release() of a recent id still forgets it."""
    monkeypatch.setenv("UCCL_P2P_DONE_IDS", "64")
    tx, rx, conn, rconn = _pair(endpoints)
    sids, rids, most = _loop_never_released(tx, rx, conn, rconn, 3000, 95)
    assert most <= 64 + 2, f"the id tables grew to {most} entries (bound 64)"
    for ep, ids in ((tx, sids), (rx, rids)):
        for t in ids[:5] + ids[1500:1505] + ids[-5:]:
            assert ep.poll_async(t) == (True, True)
            assert ep.wait(t) is True
        assert ep.release(ids[-1]) is True
        with pytest.raises(ValueError) as e:
            ep.poll_async(ids[-1])
        assert str(ids[-1]) in str(e.value)


def test_an_id_never_polled_or_still_in_flight_does_not_stop_the_bound(endpoints, monkeypatch):
    """Under the same bound, a send that finished but is never polled, a
    receive still in flight (on a second connection) and one that fails (a
    third, closed by its peer) posted first: the id tables stay bounded past
    them, and each still answers for itself."""
    monkeypatch.setenv("UCCL_P2P_DONE_IDS", "64")
    tx, rx, conn, rconn = _pair(endpoints)
    ip, port = rx.address()
    ok, conn2 = tx.connect(ip, -1, port)
    assert ok
    ok, _ip, _gpu, rconn2 = rx.accept()
    assert ok
    ok, conn3 = tx.connect(ip, -1, port)
    assert ok
    ok, _ip, _gpu, rconn3 = rx.accept()
    assert ok
    early_src, early_dst = rand_bytes(16, 98), poisoned(16)
    late_src, late_dst = rand_bytes(24, 99), poisoned(24)
    smr = tx.reg(addr(early_src), 16)[1]
    rmr = rx.reg(addr(early_dst), 16)[1]
    lsmr, lrmr = tx.reg(addr(late_src), 24)[1], rx.reg(addr(late_dst), 24)[1]
    rid = rx.recv_async(rconn, rmr, addr(early_dst), 16)[1]
    unpolled = tx.send_async(conn, smr, addr(early_src), 16)[1]
    assert rx.wait(rid) is True and np.array_equal(early_dst[:16], early_src)
    in_flight = rx.recv_async(rconn2, lrmr, addr(late_dst), 24)[1]
    doomed_dst = poisoned(8)
    doomed = rx.recv_async(rconn3, rx.reg(addr(doomed_dst), 8)[1], addr(doomed_dst), 8)[1]
    _sids, _rids, most = _loop_never_released(tx, rx, conn, rconn, 3000, 100)
    assert most <= 64 + 4, f"the id tables grew to {most} entries (bound 64)"
    assert tx.remove_remote_endpoint(conn3) is True
    for _ in range(2):   # its error, as often as asked, until release
        with pytest.raises(p2p.UcclError):
            rx.wait(doomed)
    assert all_poison(doomed_dst)
    assert rx.poll_async(in_flight) == (True, False) and all_poison(late_dst)
    assert tx.send(conn2, lsmr, addr(late_src), 24) is True
    assert rx.wait(in_flight) is True and np.array_equal(late_dst[:24], late_src) and \
        all_poison(late_dst[24:])
    assert tx.poll_async(unpolled) == (True, True) and rx.poll_async(in_flight) == (True, True)


def test_unreleased_ids_are_held_up_to_the_bound(endpoints):
    """The same loop under the default bound (65,536) holds every id it got,
    each answering done: the bound above is what kept those tables small."""
    tx, rx, conn, rconn = _pair(endpoints)
    sids, rids, most = _loop_never_released(tx, rx, conn, rconn, 500, 96)
    assert most >= 500 and tx._ids_held() >= 500 and rx._ids_held() >= 500
    assert tx.poll_async(sids[0]) == (True, True) and rx.poll_async(rids[0]) == (True, True)


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 // 1024


def test_a_million_unreleased_transfers_stay_bounded(endpoints):
    """Upstream's style for a million async send/recv pairs under the
    default bound: post, poll until done, never release.  The id tables stay
    under UCCL_P2P_DONE_IDS (65,536), resident memory grows by less than the
    ~80 bytes an id cost before (72 MB over the last 900,000), every id
    polled again at the end still answers done, and the bytes all land."""
    tx, rx, conn, rconn = _pair(endpoints)
    slots = 1024
    src, dst = rand_bytes(8 * slots, 97), poisoned(8 * slots)
    smr, rmr = tx.reg(addr(src), src.size)[1], rx.reg(addr(dst), dst.size)[1]
    early, base, most = [], None, 0
    for k in range(1_000_000):
        off = 8 * (k % slots)
        sid, rid = _post_and_poll(tx, rx, conn, rconn, smr, rmr, addr(src) + off,
                                  addr(dst) + off, 8, f"number {k}")
        if k < 10:
            early.append((sid, rid))
        if k == 100_000:
            base = _rss_kib()
        if k % 50_000 == 0:
            most = max(most, tx._ids_held(), rx._ids_held())
    grown = _rss_kib() - base
    assert most <= 65_536 + 2, f"the id tables grew to {most} entries"
    assert grown < 16 * 1024, f"resident memory grew {grown} KiB over 900,000 transfers"
    for sid, rid in early:
        assert tx.poll_async(sid) == (True, True) and rx.poll_async(rid) == (True, True)
    assert np.array_equal(dst[:src.size], src) and all_poison(dst[src.size:])


def test_connect_names_the_gpu_by_index_or_bus_id(endpoints):
    """connect(remote_gpu_bdf=...) as upstream's newer API spells it: an index
    or a PCI bus id string (with the port, which a bus id cannot give); a bus
    id without a port, or a GPU of another type, is refused up front."""
    rx = endpoints()
    ip, port = rx.address()
    for kw in (dict(remote_gpu_bdf=0), dict(remote_gpu_bdf="0000:3b:00.0"),
               dict(remote_gpu_idx=0)):
        ok, conn = endpoints().connect(remote_ip_addr=ip, remote_port=port, **kw)
        assert ok and conn >= 0 and rx.accept()[0] is True
    with pytest.raises(ValueError) as e:
        endpoints().connect(ip, remote_gpu_bdf="0000:3b:00.0")
    assert "0000:3b:00.0" in str(e.value) and "remote_port" in str(e.value)
    with pytest.raises(TypeError):
        endpoints().connect(ip, 1.5, port)
    # HEAD's keyword (remote_gpu), by bus id or index; a non-bus-id string
    for gpu in ("0000:3B:00.0", "3b:00.0", 0):
        ok, conn = endpoints().connect(ip, remote_gpu=gpu, remote_port=port)
        assert ok and rx.accept()[0] is True
    with pytest.raises(ValueError) as e:
        endpoints().connect(ip, remote_gpu="gpu0", remote_port=port)
    assert "'gpu0'" in str(e.value) and "PCI bus id" in str(e.value)
    with pytest.raises(TypeError, match="once"):
        endpoints().connect(ip, remote_gpu=0, remote_gpu_bdf=0, remote_port=port)


def _head_meta(ip: str, port: int, bdf: str) -> bytes:
    """Upstream HEAD's get_metadata() layout, built independently here:
    address, port (network order), a length byte, the bus id."""
    import ipaddress
    import struct
    return (ipaddress.ip_address(ip).packed + struct.pack("!H", port) + bytes([len(bdf)])
            + bdf.encode())


@pytest.mark.parametrize("ip,port,bdf", [
    ("10.1.2.3", 4242, "0000:3b:00.0"), ("192.168.0.7", 1, ""), ("fe80::1", 65535, "3b:00.0"),
    ("2001:db8::17", 30000, ""), ("127.0.0.1", 29517, "0000:E1:00.7")])
def test_parse_metadata_reads_heads_form(ip, port, bdf):
    """HEAD's metadata parses to (ip, port, bus id string), IPv4 and IPv6."""
    assert p2p.Endpoint.parse_metadata(_head_meta(ip, port, bdf)) == (ip, port, bdf)


def test_parse_metadata_keeps_the_older_forms(endpoints):
    """681068e4's 10 bytes (with any GPU index, including ones whose first
    byte would be a HEAD length byte) and this engine's secret form still
    parse to an index; a HEAD form naming no bus id, or cut short, raises."""
    import socket
    import struct
    for gpu in (0, 1, 3, 7, 12, 255, 1023):
        meta = socket.inet_aton("10.9.8.7") + struct.pack("!H", 29600 + gpu) + struct.pack(
            "=i", gpu)
        assert p2p.Endpoint.parse_metadata(meta) == ("10.9.8.7", 29600 + gpu, gpu)
    ep = endpoints(secret=b"s" * 16)
    meta = ep.get_metadata()
    assert len(meta) == 192 and p2p.Endpoint.parse_metadata(meta)[1:] == (ep.address()[1], -1)
    for bad in (_head_meta("10.1.2.3", 5, "not-a-bdf"), _head_meta("10.1.2.3", 5, "0000:3b:00.0")[:-1],
                b"", b"\x01" * 9):
        with pytest.raises((ValueError, p2p.UcclError)):
            p2p.Endpoint.parse_metadata(bad)


def test_gpu_bdf_is_empty_without_a_gpu(endpoints):
    """A CPU-only endpoint names no GPU; nor does one whose index the CUDA
    driver does not have (or where there is no driver: this CI machine)."""
    assert endpoints().gpu_bdf == ""
    ep = p2p.Endpoint(local_gpu_idx=1000, port=0)
    try:
        assert ep.gpu_bdf == ""
    finally:
        ep.close()


def test_xfer_handle_is_read_only():
    h = p2p.XferHandle(3, "write", 77)
    assert (h.conn_id, h.op_name, h.transfer_id) == (3, "write", 77)
    with pytest.raises(AttributeError, match="read-only"):
        h.transfer_id = 1


def test_recv_may_post_more_than_its_region(endpoints):
    """Upstream's scripts post a recv of twice the registered size: the
    region bounds what it takes (the size is a capacity), so a message that
    fits the region lands and nothing past the region is written, and one
    larger than the region fails both sides without writing."""
    tx, rx, conn, rconn = _pair(endpoints)
    n = 4096
    dst = poisoned(n)                      # n bytes registered, a guard after them
    rmr = rx.reg(addr(dst), n)[1]
    src = rand_bytes(n + 512, 97)
    smr = tx.reg(addr(src), src.size)[1]
    ok, tid = tx.send_async(conn, smr, addr(src), n)
    ok, rid = rx.recv_async(rconn, rmr, addr(dst), 2 * n)
    assert rx.wait(rid) is True and tx.wait(tid) is True
    assert rx.received_bytes(rid) == n
    assert np.array_equal(dst[:n], src[:n]) and all_poison(dst[n:])
    dst[:n] = dst[n]                       # poison again
    ok, tid = tx.send_async(conn, smr, addr(src), n + 512)
    with pytest.raises(ValueError) as e:
        rx.recv(rconn, rmr, addr(dst), 2 * n)
    assert str(n + 512) in str(e.value)
    with pytest.raises(ValueError):
        tx.wait(tid)
    assert all_poison(dst)


def test_get_endpoint_metadata_is_get_metadata(endpoints):
    ep = endpoints()
    assert ep.get_endpoint_metadata() == ep.get_metadata()


def test_collective_context_takes_upstreams_argument_order():
    """CollectiveContext(num_cpus, local_gpu_idx, use_copy_engine_for_intra)
    and init_collective(...) in upstream's order; disable_uccl_intra (its
    older name, inverted); a GPU index where num_cpus goes is refused."""
    from uccl_collective.collective import CollectiveContext
    ctx = CollectiveContext(2, 1, True)
    assert (ctx.num_cpus, ctx.local_gpu_idx, ctx.use_copy_engine_for_intra) == (2, 1, True)
    assert CollectiveContext(disable_uccl_intra=False).use_copy_engine_for_intra is True
    assert CollectiveContext(4, 0, disable_uccl_intra=True).use_copy_engine_for_intra is False
    with pytest.raises(ValueError, match="contradict"):
        CollectiveContext(4, 0, True, disable_uccl_intra=True)
    with pytest.raises(ValueError, match="num_cpus must be >= 1, got 0"):
        CollectiveContext(0)
    with pytest.raises(TypeError, match="num_cpus, local_gpu_idx"):
        CollectiveContext(4, "cuda:0")
