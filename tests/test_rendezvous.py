"""Upstream's group rendezvous (join_group, create_and_join, conn_id_of_rank)
through tcp:// and file:// discovery, with 3 ranks in 3 processes: every
lower rank sends seeded random bytes to every higher one over the
connection conn_id_of_rank names, checked end to end in poisoned buffers."""
from __future__ import annotations

import multiprocessing as mp
import socket
import traceback

import numpy as np
import pytest

from uccl_collective import p2p
from uccl_collective.p2p._rendezvous import NO_CONN

from _harness import addr, all_poison, poisoned, rand_bytes

N = 3
NBYTES = 100_003


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _member(uri: str, group: str, rank: int, how: str, out) -> None:
    try:
        if how == "create":
            ep = p2p.Endpoint.create_and_join(uri, group, N, rank, None, 2)
        else:
            ep = p2p.Endpoint(port=0, timeout_s=30)
            assert ep.join_group(uri, group, N, rank) is True
        conns = {r: ep.conn_id_of_rank(r) for r in range(N)}
        assert conns[rank] == NO_CONN and ep.conn_id_of_rank(N + 5) == NO_CONN
        assert len({conns[r] for r in range(N) if r != rank}) == N - 1
        got = {}
        for peer in range(N):
            if peer < rank:      # the lower rank connected: it sends to us
                buf = poisoned(NBYTES)
                _, mr = ep.reg(addr(buf), buf.nbytes)
                ep.recv(conns[peer], mr, addr(buf), NBYTES)
                ok = bool((buf[:NBYTES] == rand_bytes(NBYTES, 1000 * peer + rank)).all())
                got[peer] = ok and all_poison(buf[NBYTES:])
            elif peer > rank:    # we connected: we send
                src = rand_bytes(NBYTES, 1000 * rank + peer)
                _, mr = ep.reg(addr(src), src.nbytes)
                ep.send(conns[peer], mr, addr(src), NBYTES)
        ep.close()
        out.put((rank, got))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def _run_group(uri: str, how: str = "join", group: str = "g") -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(uri, group, r, how, out)) for r in range(N)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(N):
            rank, res = out.get(timeout=90)
            results[rank] = res
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return results


@pytest.mark.parametrize("scheme,how", [("tcp", "join"), ("file", "create")])
def test_group_connects_every_pair(tmp_path, scheme, how):
    uri = (f"tcp://127.0.0.1:{_free_port()}" if scheme == "tcp"
           else f"file://{tmp_path / 'rendezvous'}")
    results = _run_group(uri, how)
    for r in range(N):
        assert isinstance(results[r], dict), f"rank {r} failed:\n{results[r]}"
        assert results[r] == {p: True for p in range(r)}, f"rank {r}: {results[r]}"


@pytest.mark.parametrize("args,words", [
    (("ftp://x", "g", 2, 0), ["ftp://x", "tcp://"]),
    (("tcp://127.0.0.1", "g", 2, 0), ["host and a port"]),
    (("tcp://127.0.0.1:1", "g", 2, 2), ["my_rank 2", "0..1"]),
    (("tcp://127.0.0.1:1", "g", 0, 0), ["world_size", "0"]),
    (("tcp://127.0.0.1:1", "a:b", 2, 0), ["'a:b'"]),
    (("redis://127.0.0.1:1", "g", 2, 0), ["redis"]),
])
def test_join_group_refuses_bad_arguments(endpoints, args, words):
    try:
        import redis  # noqa: F401
        if args[0].startswith("redis"):
            pytest.skip("the redis package is installed here: the missing-package error "
                        "cannot happen")
    except ImportError:
        pass
    ep = endpoints()
    with pytest.raises((ValueError, RuntimeError)) as e:
        ep.join_group(*args)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert ep.conn_id_of_rank(0) == NO_CONN


@pytest.mark.parametrize("hello,words", [
    ((0, 5, "g"), ["rank 0 of 5"]),
    ((0, 2, "other"), ["in another group"]),
    ((1, 2, "g"), ["rank 1 of 2"]),
])
def test_a_mismatched_peer_is_refused(tmp_path, endpoints, hello, words):
    """A peer that reaches a joining rank saying another world size, another
    group or an impossible rank makes join_group raise, naming it, and
    leaves no connection behind."""
    import hashlib
    import struct
    import threading
    import torch.distributed as dist
    uri = f"file://{tmp_path / 'store'}"
    joiner = endpoints(timeout_s=10)
    err = []

    def join():
        try:
            joiner.join_group(uri, "g", 2, 1)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            err.append(e)
    t = threading.Thread(target=join)
    t.start()
    store = dist.FileStore(str(tmp_path / "store"), 2)
    impostor = endpoints()
    store.set("g:0", "127.0.0.1,-1,{}".format(impostor.address()[1]))
    store.wait(["g:1"])
    ip, _gpu, port = store.get("g:1").decode().split(",")
    _, cid = impostor.connect(ip, 0, int(port))
    rank, size, group = hello
    msg = np.frombuffer(bytearray(struct.pack(
        "<qq16s", rank, size, hashlib.blake2b(group.encode(), digest_size=16).digest())),
        np.uint8)
    _, mr = impostor.reg(addr(msg), msg.nbytes)
    impostor.send(cid, mr, addr(msg), msg.nbytes)
    t.join(30)
    assert not t.is_alive() and err, "join_group accepted a mismatched peer"
    assert isinstance(err[0], ValueError)
    for w in words:
        assert w in str(err[0]), (w, str(err[0]))
    assert joiner.conn_id_of_rank(0) == NO_CONN
