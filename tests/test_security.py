"""Authentication and hostile clients: a listening endpoint refuses clients
with a wrong or missing secret and drops raw-socket garbage, and in every case
keeps serving the well-behaved client that comes next (checked with real data)."""
from __future__ import annotations

import socket
import struct
import time

import numpy as np

from _harness import addr, all_poison, catch, poisoned, rand_bytes, run_pair, sha

SECRET = "the-right-secret"
N = 65536


def _serve_good_clients(ep, ch, count):
    """Accept `count` connections and receive one N-byte message on each."""
    got = []
    for i in range(count):
        ok, ip, gpu, conn = ep.accept(timeout=20)
        buf = poisoned(N)
        mr = ep.reg(addr(buf), buf.nbytes)[1]
        assert ep.recv(conn, mr, addr(buf), N) is True
        got.append((sha(buf[:N]), all_poison(buf[N:])))
    return got


def _send_one(ep, conn, seed):
    data = rand_bytes(N, seed)
    assert ep.send(conn, ep.reg(addr(data), N)[1], addr(data), N) is True


# --------------------------------------------------------------------------
def _secret_server(ch):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=20)  # secret from UCCL_P2P_SECRET (server_env)
    ch.send("where", (ep.address()[1], ep.get_metadata()))
    return {"got": _serve_good_clients(ep, ch, 2)}


def _secret_client(ch):
    from uccl_collective.p2p import Endpoint

    port, meta = ch.recv("where")
    out = {}
    with Endpoint(port=0, timeout_s=5, secret=b"a-wrong-secret") as bad:
        out["wrong"] = catch(bad.connect, "127.0.0.1", -1, remote_port=port)
        out["wrong_kw"] = catch(bad.connect, "127.0.0.1", -1, remote_port=port, secret="nope")
    with Endpoint(port=0, timeout_s=5) as anon:
        out["none"] = catch(anon.connect, "127.0.0.1", -1, remote_port=port)
        # metadata whose secret was tampered with (same length, one byte flipped)
        m = bytearray(meta)
        i = m.index(SECRET.encode())
        m[i] ^= 0x01
        out["tampered_meta"] = catch(anon.add_remote_endpoint, bytes(m))
    # well-behaved clients: the secret from the metadata, or given explicitly
    good = Endpoint(port=0, timeout_s=10)
    ok, c1 = good.add_remote_endpoint(meta)
    _send_one(good, c1, 41)
    good2 = Endpoint(port=0, timeout_s=10, secret=SECRET)
    ok, c2 = good2.connect("127.0.0.1", -1, remote_port=port)
    _send_one(good2, c2, 42)
    return out


def test_wrong_or_missing_secret_is_refused():
    """An endpoint with a secret (UCCL_P2P_SECRET) refuses a client with a
    wrong secret (set on its Endpoint or passed to connect()), a client with
    none, and a client whose metadata's secret was altered: each connect raises
    UcclError mentioning the secret.  None of them shows up in accept(): the
    next two clients (secret taken from the metadata / given explicitly) are
    the ones accepted and their data arrives intact."""
    s, c = run_pair(_secret_server, _secret_client, server_env={"UCCL_P2P_SECRET": SECRET},
                    timeout=90)
    for k in ("wrong", "wrong_kw", "none", "tampered_meta"):
        e = c[k]
        assert e is not None, f"{k}: connect succeeded without the right secret"
        assert e["uccl"] and not e["value"], f"{k}: expected UcclError, got {e}"
        assert "secret" in e["msg"].lower(), f"{k}: message does not mention the secret: {e['msg']}"
        assert e["elapsed"] < 5, f"{k}: refusal took {e['elapsed']:.1f} s"
    assert s["got"] == [(sha(rand_bytes(N, 41)), True), (sha(rand_bytes(N, 42)), True)]


# --------------------------------------------------------------------------
def _hostile_server(ch):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=20)
    ch.send("port", ep.address()[1])
    return {"got": _serve_good_clients(ep, ch, 1)}


def _dropped_within(sock, seconds):
    """True if the peer closes (EOF or reset) within `seconds`; never blocks longer."""
    sock.settimeout(0.2)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if sock.recv(4096) == b"":
                return True
        except socket.timeout:
            continue
        except OSError:
            return True
    return False


def _raw(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 0, 0))
    return s


def _hostile_client(ch):
    from uccl_collective.p2p import Endpoint

    port = ch.recv("port")
    rng = np.random.default_rng(99)
    out = {}
    silent = _raw(port)          # connects and says nothing, kept open throughout
    s = _raw(port)               # 256 random bytes
    s.sendall(rng.bytes(256))
    out["garbage_dropped"] = _dropped_within(s, 5)
    s.close()
    s = _raw(port)               # the right magic and version, garbage after it
    s.sendall(struct.pack("<IHH", 0x4C434355, 1, 1) + rng.bytes(248))
    out["bad_hello_dropped"] = _dropped_within(s, 5)
    s.close()
    s = _raw(port)               # a huge claimed secret length
    hello = bytearray(rng.bytes(256))
    hello[0:8] = struct.pack("<IHH", 0x4C434355, 1, 1)
    hello[8:12] = struct.pack("<I", 0xFFFFFFFF)
    s.sendall(bytes(hello))
    out["huge_len_dropped"] = _dropped_within(s, 5)
    s.close()
    for n in (10, 0):            # a short write then close; connect then close
        s = _raw(port)
        if n:
            s.sendall(rng.bytes(n))
        s.close()
    # the endpoint still serves a real client while the silent socket is open
    with Endpoint(port=0, timeout_s=10) as ep:
        t0 = time.monotonic()
        ok, conn = ep.connect("127.0.0.1", -1, remote_port=port)
        out["connect_s"] = time.monotonic() - t0
        _send_one(ep, conn, 43)
    silent.close()
    return out


def test_garbage_clients_are_dropped():
    """Raw sockets sending 256 random bytes, a handshake with the right magic
    but garbage fields, or an absurd secret length are closed by the endpoint
    within 5 s; a short write then close and a bare connect/close are
    harmless; with an idle socket still open a real client connects promptly
    and its data arrives intact (the listener is neither crashed nor blocked)."""
    s, c = run_pair(_hostile_server, _hostile_client, timeout=90)
    assert c["garbage_dropped"], "random bytes: the endpoint kept the socket open"
    assert c["bad_hello_dropped"], "a bad handshake: the endpoint kept the socket open"
    assert c["huge_len_dropped"], "a huge secret length: the endpoint kept the socket open"
    assert c["connect_s"] < 5, f"connect took {c['connect_s']:.1f} s with an idle socket open"
    assert s["got"] == [(sha(rand_bytes(N, 43)), True)]
