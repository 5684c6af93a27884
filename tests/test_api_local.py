"""Caller-side API contract checked inside the test process (no peer needed):
constructor validation, metadata, environment checks at Endpoint creation,
registration, unknown ids, a closed endpoint, passive accept, and the tensor
buffer checks.  Nothing here moves data between ranks; see test_transfers.py."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import uccl_collective
from uccl_collective import UcclError, UcclTimeoutError
from uccl_collective.p2p import Endpoint, buffer_of

from _harness import addr


def test_exceptions_hierarchy():
    """UcclError is a RuntimeError; UcclTimeoutError is both a UcclError and a
    TimeoutError, and the p2p module re-exports the same classes."""
    assert issubclass(UcclError, RuntimeError)
    assert issubclass(UcclTimeoutError, UcclError) and issubclass(UcclTimeoutError, TimeoutError)
    from uccl_collective import p2p
    assert p2p.UcclError is UcclError and p2p.UcclTimeoutError is UcclTimeoutError


def test_metadata_roundtrip(endpoints):
    """Without a secret, get_metadata() is upstream's 10 bytes (IPv4 address,
    port in network order, GPU index as a native int32: upstream's scripts
    parse it themselves); with one, 192 bytes that carry the secret.  Both
    parse back into the loopback address, listening port and gpu index (-1:
    CPU), and a peer connects with either."""
    import socket
    import struct
    ep = endpoints()
    meta = ep.get_metadata()
    ip, port = ep.address()
    assert ip == "127.0.0.1", "UCCL_SOCKET_IFNAME=lo must pick the loopback address"
    assert 0 < port < 65536
    assert isinstance(meta, bytes) and len(meta) == 10
    assert (socket.inet_ntop(socket.AF_INET, meta[:4]), struct.unpack("!H", meta[4:6])[0],
            struct.unpack("i", meta[6:10])[0]) == (ip, port, -1)
    assert Endpoint.parse_metadata(meta) == (ip, port, -1)
    assert ep.timeout_s == 5.0 and ep.closed is False
    gpu_ep = endpoints(local_gpu_idx=3)
    assert Endpoint.parse_metadata(gpu_ep.get_metadata())[2] == 3
    sec = endpoints(secret="s3cret")
    smeta = sec.get_metadata()
    assert len(smeta) == 192 and b"s3cret" in smeta
    assert Endpoint.parse_metadata(smeta) == ("127.0.0.1", sec.address()[1], -1)
    for target, m in ((ep, meta), (sec, smeta)):
        ok, conn = endpoints(secret="s3cret" if target is sec else None).add_remote_endpoint(m)
        assert ok and target.accept()[0] is True


def test_metadata_carries_the_longest_secret(endpoints):
    """A secret of 64 bytes (the most UCCL_P2P_SECRET takes) goes whole into
    the metadata, and a peer connects with it (the record once had room for
    62: the last two bytes were lost, and the peer was refused)."""
    secret = "".join(chr(ord("a") + i % 26) for i in range(64))
    srv = endpoints(secret=secret)
    meta = srv.get_metadata()
    assert len(meta) == 192 and secret.encode() in meta
    ok, conn = endpoints(secret=secret).add_remote_endpoint(meta)
    assert ok and srv.accept()[0] is True


def test_metadata_upstream_ipv6_form_is_refused_with_the_reason():
    """Upstream's 22-byte (IPv6) form parses to an error that says so."""
    with pytest.raises(ValueError, match="IPv6"):
        Endpoint.parse_metadata(bytes(22))


def test_parse_metadata_rejects_wrong_length():
    """Metadata of the wrong length raises ValueError naming both lengths."""
    with pytest.raises(ValueError, match=r"192.*7"):
        Endpoint.parse_metadata(b"garbage")


def test_parse_metadata_rejects_garbage_with_a_reason():
    """192 bytes of garbage raise ValueError whose message says what was wrong
    (the metadata's magic), not a bare 'invalid argument'."""
    with pytest.raises(ValueError) as ei:
        Endpoint.parse_metadata(b"x" * 192)
    assert "metadata" in str(ei.value)


@pytest.mark.parametrize("kw, words", [
    (dict(num_cpus=0), "num_cpus"),
    (dict(timeout_s=0), "timeout_s"),
    (dict(timeout_s=-1.0), "timeout_s"),
    (dict(local_gpu_idx=-1), "local_gpu_idx"),
    (dict(secret=b"s" * 65), "65"),
])
def test_constructor_rejects_bad_arguments(kw, words):
    """Bad constructor arguments raise ValueError naming the argument."""
    with pytest.raises(ValueError, match=words):
        Endpoint(port=0, **kw)


@pytest.mark.parametrize("transport", ["rdma", "ipc"])
def test_forced_unavailable_transport_raises(monkeypatch, transport, tmp_path):
    """UCCL_P2P_TRANSPORT forcing a transport this machine cannot use (rdma:
    no libibverbs or no device here; ipc: CUDA IPC, without a CUDA driver here) makes Endpoint()
    raise UcclError naming the transport (never a silent fallback)."""
    monkeypatch.setenv("UCCL_P2P_TRANSPORT", transport)
    if transport == "ipc":  # a GPU machine has a driver: take it away
        env = dict(os.environ, UCCL_CUDA_LIBRARY=str(tmp_path / "missing.so"))
        p = subprocess.run([sys.executable, "-c", "from uccl_collective.p2p import Endpoint\n"
                            "try:\n    Endpoint(port=0)\nexcept Exception as e:\n"
                            "    print(type(e).__name__, e)"], env=env, capture_output=True,
                           text=True, timeout=60)
        assert p.stdout.startswith("UcclError") and "ipc" in p.stdout \
            and "missing.so" in p.stdout, p.stdout + p.stderr
        return
    with pytest.raises(UcclError, match=transport):
        Endpoint(port=0)


@pytest.mark.parametrize("var, value", [
    ("UCCL_P2P_TRANSPORT", "bogus"),
    ("UCCL_P2P_SHM_MODE", "bogus"),
    ("UCCL_P2P_TCP_STREAMS", "0"),
    ("UCCL_P2P_TCP_CHUNK_KB", "1"),
])
def test_bad_environment_raises(monkeypatch, var, value):
    """A malformed engine environment variable makes Endpoint() raise
    ValueError naming the variable."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        Endpoint(port=0)


def test_reg_dereg(endpoints):
    """reg returns (True, mr_id), distinct per call; dereg returns True once,
    then the mr_id is unknown (ValueError)."""
    ep = endpoints()
    buf = np.zeros(1 << 16, np.uint8)
    ok, mr1 = ep.reg(addr(buf), buf.nbytes)
    ok2, mr2 = ep.reg(addr(buf) + 4096, 4096)
    assert ok is True and ok2 is True and mr1 != mr2
    assert ep.dereg(mr1) is True
    with pytest.raises(ValueError, match=str(mr1)):
        ep.dereg(mr1)
    assert ep.dereg(mr2) is True
    assert ep.reg_tensor(buf) > 0


def test_unknown_ids_raise_value_error(endpoints):
    """Unknown conn_id, mr_id and transfer_id raise ValueError naming the id,
    on every method that takes one."""
    ep = endpoints()
    buf = np.zeros(64, np.uint8)
    mr = ep.reg(addr(buf), 64)[1]
    fifo = bytes(64)
    for call in (lambda: ep.conn_transport(4242),
                 lambda: ep.send(4242, mr, addr(buf), 64),
                 lambda: ep.recv(4242, mr, addr(buf), 64),
                 lambda: ep.send_async(4242, mr, addr(buf), 64),
                 lambda: ep.recv_async(4242, mr, addr(buf), 64),
                 lambda: ep.advertise(4242, mr, addr(buf), 64),
                 lambda: ep.write(4242, mr, addr(buf), 64, fifo),
                 lambda: ep.read(4242, mr, addr(buf), 64, fifo)):
        with pytest.raises(ValueError):
            call()
    for call in (ep.poll_async, ep.wait, ep.release):
        with pytest.raises(ValueError, match="4243"):
            call(4243)
    with pytest.raises(ValueError, match="4244"):
        ep.dereg(4244)
    with pytest.raises(ValueError, match="4242"):
        ep.conn_transport(4242)
    with pytest.raises(ValueError):
        ep.poll_async(-1)


def test_closed_endpoint_raises_value_error(endpoints):
    """After close() (idempotent, also via the context manager) closed is True
    and every method raises ValueError saying the endpoint is closed."""
    ep = endpoints()
    buf = np.zeros(64, np.uint8)
    mr = ep.reg(addr(buf), 64)[1]
    ep.close()
    ep.close()
    assert ep.closed is True
    calls = [ep.get_metadata, ep.address, ep.start_passive_accept, ep.accept,
             lambda: ep.connect("127.0.0.1", 0, 12345),
             lambda: ep.add_remote_endpoint(bytes(192)),
             lambda: ep.reg(addr(buf), 64), lambda: ep.dereg(mr),
             lambda: ep.conn_transport(1),
             lambda: ep.send(1, mr, addr(buf), 64), lambda: ep.recv_async(1, mr, addr(buf), 64),
             lambda: ep.advertise(1, mr, addr(buf), 64),
             lambda: ep.write(1, mr, addr(buf), 64, bytes(64)),
             lambda: ep.poll_async(1), lambda: ep.wait(1), lambda: ep.release(1),
             lambda: ep.reg_tensor(buf), lambda: ep.timeout_s]
    for call in calls:
        with pytest.raises(ValueError, match="closed"):
            call()
    with Endpoint(port=0) as ep2:
        assert ep2.closed is False
    assert ep2.closed is True


def test_passive_accept_disables_accept(endpoints):
    """start_passive_accept() returns True; accept() then raises ValueError at
    once (connections are taken in the background)."""
    ep = endpoints()
    assert ep.start_passive_accept() is True
    with pytest.raises(ValueError, match="passive"):
        ep.accept(timeout=1)


def test_accept_timeout_without_peer_short():
    """accept(timeout=0.05) with nobody connecting raises UcclTimeoutError
    (a timeout shorter than the engine's 100 ms wait slice)."""
    with Endpoint(port=0, timeout_s=5) as ep:
        with pytest.raises(UcclTimeoutError, match="accept"):
            ep.accept(timeout=0.05)


def test_buffer_checks():
    """Non-contiguous torch tensors and numpy arrays, read-only arrays and
    other objects are refused (ValueError / TypeError) before the engine sees
    a pointer; contiguous ones give (data pointer, byte size)."""
    torch = pytest.importorskip("torch")
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    assert buffer_of(t) == (t.data_ptr(), 256)
    with pytest.raises(ValueError, match="contiguous"):
        buffer_of(t.t())
    with pytest.raises(ValueError, match="contiguous"):
        buffer_of(t[:, ::2])
    a = np.arange(64, dtype=np.int16).reshape(8, 8)
    assert buffer_of(a) == (addr(a), 128)
    with pytest.raises(ValueError, match="contiguous"):
        buffer_of(a[:, 1])
    ro = np.zeros(8, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        buffer_of(ro)
    with pytest.raises(TypeError):
        buffer_of(b"bytes")
    with Endpoint(port=0) as ep:
        with pytest.raises(ValueError, match="contiguous"):
            ep.reg_tensor(t.t())
        with pytest.raises(ValueError, match="contiguous"):
            ep.send_tensor(1, 1, a.T)
        with pytest.raises(ValueError, match="contiguous"):
            ep.advertise_tensor(1, 1, t.t())


def _free_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_connect_bad_arguments(endpoints):
    """connect() with an unparsable IP or an out-of-range port raises
    ValueError at once; vector calls with lists of the wrong length raise
    ValueError naming num_iovs."""
    ep = endpoints()
    with pytest.raises(ValueError, match="256.1.1.1"):
        ep.connect("256.1.1.1", -1, remote_port=1234)
    with pytest.raises(ValueError, match="70000"):
        ep.connect("127.0.0.1", -1, remote_port=70000)
    with pytest.raises(ValueError, match="num_iovs"):
        ep.sendv(1, [1], [0], [0, 1], 1)
    with pytest.raises(ValueError, match="num_iovs"):
        ep.readv(1, [1, 2], [0, 0], [1, 1], [bytes(64)], 2)
    with pytest.raises(ValueError, match="num_iovs"):
        ep.advertisev(1, [1], [0], [1], -1)


def test_connect_to_closed_port_raises(endpoints):
    """connect() to a port nobody listens on raises UcclError (connection
    refused) within the endpoint's timeout, never hangs."""
    import time

    ep = endpoints(timeout_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(UcclError, match="refused"):
        ep.connect("127.0.0.1", -1, remote_port=_free_port())
    assert time.monotonic() - t0 < 1.5 + 1.0


def _silent_listener_connect(endpoints):
    import socket
    import time

    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(4)  # accepts at the TCP level, never answers the handshake
    try:
        ep = endpoints(timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(UcclTimeoutError) as ei:
            ep.connect("127.0.0.1", -1, remote_port=lst.getsockname()[1])
        return ei.value, time.monotonic() - t0
    finally:
        lst.close()


def test_connect_to_silent_listener_times_out(endpoints):
    """connect() to a socket that accepts but never answers the handshake
    raises UcclTimeoutError after about timeout_s (1 s)."""
    err, elapsed = _silent_listener_connect(endpoints)
    assert 0.9 <= elapsed < 2.5, elapsed


def test_handshake_timeout_message_is_clean(endpoints):
    """The handshake-timeout message names the peer once and says what
    happened; it carries no stale text from an earlier error."""
    import socket

    ep = endpoints(timeout_s=1.0)
    with pytest.raises(UcclError, match="refused"):   # leaves 'Connection refused' behind
        ep.connect("127.0.0.1", -1, remote_port=_free_port())
    err, _ = _silent_listener_connect(endpoints)
    msg = str(err)
    assert msg.count("handshake with") == 1 and "refused" not in msg, msg
