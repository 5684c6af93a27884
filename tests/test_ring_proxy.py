"""The ring's proxy without a GPU (csrc/ring/ring.c, uccl_collective.gpu_ring
.HostRing): host threads fill the ring as a kernel would, and the proxy
takes, checks, batches, issues and retires the commands exactly as for a
GPU's ring.  Every put's bytes are random, the peer's window is poisoned
and checked byte for byte (with the guard past it), and the order is
checked through the proxy's trace.

  peer            puts to a peer's advertised window over each transport:
                  runs of consecutive puts (which the proxy writes as one,
                  UCCL_RING_BATCH_BYTES) among scattered and overlapping
                  ones (the later bytes stay); batching off: a write each
  bad_in_a_run    a bad command in the middle of a run: the ones before it
                  complete (done stops right there), the ring fails naming it
  full            a paused ring of 8 slots: 8 puts go in, the 9th waits for
                  a slot until the proxy resumes
  peer_killed     the window's owner is SIGKILLed with a batch of puts to
                  come: the host's wait raises within the timeout, naming
                  the ring's failure, and later puts raise rather than hang
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from _harness import GUARD, POISON, TRANSPORTS, Pair, rand_bytes, run_pair

TIMEOUT_S = 30.0
WINDOW = 1 << 20


def _plan(seed: int, n: int) -> list[tuple[int, int, int]]:
    """n puts (src_off, dst_off, length) into a WINDOW-byte window from a
    source of the same size: runs of 1-24 puts that follow on (source and
    destination), each of 1-3000 bytes, starting anywhere; runs may
    overlap earlier ones."""
    rng = np.random.default_rng(seed)
    puts: list[tuple[int, int, int]] = []
    while len(puts) < n:
        lens = rng.integers(1, 3000, size=int(rng.integers(1, 25)))
        total = int(lens.sum())
        s0 = int(rng.integers(0, WINDOW - total))
        d0 = int(rng.integers(0, WINDOW - total))
        for ln in lens[: n - len(puts)]:
            puts.append((s0, d0, int(ln)))
            s0, d0 = s0 + int(ln), d0 + int(ln)
    return puts


def _expected(src: np.ndarray, puts) -> np.ndarray:
    want = np.full(WINDOW + GUARD, POISON, np.uint8)
    for s, d, ln in puts:   # in sequence: the later bytes stay
        want[d:d + ln] = src[s:s + ln]
    return want


def _mismatch(got: np.ndarray, want: np.ndarray, what: str) -> None:
    bad = np.flatnonzero(got != want)
    assert not len(bad), (f"{what}: {len(bad)} bytes differ, the first at {bad[0]}: got "
                          f"{got[bad[:8]].tolist()}, want {want[bad[:8]].tolist()}")


def _owner(ch):
    """The window's owner: advertises WINDOW poisoned bytes (and a guard),
    then checks them against what the writer says they must be."""
    import torch
    from uccl_collective.p2p import Endpoint
    ep = Endpoint(0, 1, timeout_s=TIMEOUT_S)
    ch.send("meta", bytes(ep.get_metadata()))
    _ok, _ip, _gpu, conn = ep.accept()
    win = torch.full((WINDOW + GUARD,), POISON, dtype=torch.uint8)
    mr = ep.reg(win.data_ptr(), WINDOW)[1]
    ch.send("fifo", bytes(ep.advertise(conn, mr, win.data_ptr(), WINDOW)[1]))
    want = np.frombuffer(ch.recv("want", timeout=120), np.uint8)
    _mismatch(win.numpy(), want, "the peer's window")
    ch.send("checked")
    ch.recv("bye", timeout=60)
    ep.close()
    return True


def _writer(ch, seed, n, bad_at=-1):
    """Puts the plan through a HostRing to the owner's window, waits for
    them, and reports (counters, stats, trace, the error where bad_at)."""
    import torch
    from uccl_collective.gpu_ring import HostRing, Remote
    from uccl_collective.p2p import Endpoint, UcclError
    ep = Endpoint(0, 1, timeout_s=TIMEOUT_S)
    _ok, conn = ep.add_remote_endpoint(ch.recv("meta"))
    src_np = rand_bytes(WINDOW, seed)
    src = torch.from_numpy(src_np)
    puts = _plan(seed, n)
    if bad_at >= 0:   # past the window's end, in the middle of a run
        s, d, ln = puts[bad_at]
        puts[bad_at] = (s, WINDOW - ln + 1, ln)
    ring = HostRing(ep, src, [Remote(conn, ch.recv("fifo"))], slots=64, inflight=16, trace=n)
    err = None
    try:   # (after a failure, a put that waits for its slot raises)
        for i, (s, d, ln) in enumerate(puts):
            assert ring.put(0, s, d, ln) == i
        ring.wait(n, timeout=TIMEOUT_S)
    except UcclError as e:
        err = str(e)
    if bad_at >= 0:   # the ring failed there: those before it still finish
        ring.wait(bad_at, timeout=TIMEOUT_S)
    good = puts if bad_at < 0 else puts[:bad_at]
    ch.send("want", _expected(src_np, good).tobytes())
    ch.recv("checked", timeout=60)
    out = (tuple(ring.counters()), tuple(ring.stats()), ring.trace(), err)
    ring.close()
    ch.send("bye")
    ep.close()
    return out


def _runs(seed: int, n: int) -> int:
    """How many runs of puts that follow on the plan has (the fewest
    writes a batching proxy makes, bytes per write permitting)."""
    puts, runs = _plan(seed, n), 1
    for (s0, d0, l0), (s1, d1, _l1) in zip(puts, puts[1:]):
        runs += not (s1 == s0 + l0 and d1 == d0 + l0)
    return runs


@pytest.mark.parametrize("transport", ["tcp", "shm-cma", "rdma"])
@pytest.mark.parametrize("batch", ["1M", "0"])
def test_puts_reach_a_peer_exactly_once_in_order(transport, batch):
    env = {"UCCL_RING_BATCH_BYTES": batch}
    env.update(TRANSPORTS[transport][0])
    n, seed = 3000, 11 + len(transport)
    _own, (ctr, stats, trace, err) = run_pair(_owner, _writer, timeout=180, env=env,
                                              client_kwargs={"seed": seed, "n": n})
    assert err is None, err
    assert ctr == (n, n, n, 0), ctr
    assert trace == list(range(n))
    assert stats[0] == n
    if batch == "0":
        assert stats[1] == n, stats          # a write per put
    else:
        assert stats[1] >= _runs(seed, n), stats   # never across a run's end
        assert stats[1] < n // 4, stats       # runs average ~12 puts: written as one each


def test_a_bad_put_in_a_run_fails_the_ring_there_and_those_before_it_complete():
    n, seed, bad = 400, 5, 123
    _own, (ctr, _stats, _trace, err) = run_pair(
        _owner, _writer, timeout=120, env=TRANSPORTS["tcp"][0],
        client_kwargs={"seed": seed, "n": n, "bad_at": bad})
    assert ctr[2] == bad and ctr[3] == bad + 1, ctr   # done stops at it; error = 1 + its seq
    assert err and f"command {bad}:" in err and "outside the destination's window" in err, err


def test_host_put_arguments_are_checked_before_they_take_a_ticket():
    import torch
    from uccl_collective.gpu_ring import HostRing
    from uccl_collective.p2p import Endpoint
    ep = Endpoint(0, 1, timeout_s=TIMEOUT_S)
    src = torch.from_numpy(rand_bytes(4096, 4))
    dst = torch.zeros(4096, dtype=torch.uint8)
    ring = HostRing(ep, src, [dst], slots=8, inflight=2)
    try:
        for args, what in (((1, 0, 0, 16), "destination 1 of 1"),
                           ((0, 4000, 0, 200), "200 bytes at source offset 4000 of a 4096-byte"),
                           ((0, 0, 0, 5000), "5000 bytes at source offset 0")):
            with pytest.raises(ValueError, match=what):
                ring.put(*args)
        assert ring.counters().tickets == 0
        assert ring.put(0, 0, 0, 4096) == 0
        ring.wait(1, timeout=TIMEOUT_S)
        assert torch.equal(dst, src)
    finally:
        ring.close()
        ep.close()


def test_a_full_ring_holds_the_next_put_until_the_proxy_takes_one():
    import torch
    from uccl_collective.gpu_ring import HostRing
    from uccl_collective.p2p import Endpoint
    ep = Endpoint(0, 1, timeout_s=TIMEOUT_S)
    src = torch.from_numpy(rand_bytes(1 << 16, 3))
    dst = torch.full((1 << 16,), POISON, dtype=torch.uint8)
    ring = HostRing(ep, src, [dst], slots=8, inflight=4, paused=True)
    try:
        for i in range(8):
            assert ring.put(0, 1024 * i, 1024 * i, 1024) == i
        got = []
        t = threading.Thread(target=lambda: got.append(ring.put(0, 8192, 8192, 1024)))
        t.start()
        time.sleep(0.3)
        assert t.is_alive() and not got, "the 9th put went in while every slot was taken"
        assert ring.counters().taken == 0
        ring.resume()
        t.join(TIMEOUT_S)
        assert got == [8]
        ring.wait(9, timeout=TIMEOUT_S)
        assert torch.equal(dst[:9216], src[:9216])
        assert (dst[9216:].numpy() == POISON).all()
    finally:
        ring.close()
        ep.close()


def _doomed_owner(ch):
    """An owner that advertises its window, then waits to be killed."""
    import torch
    from uccl_collective.p2p import Endpoint
    ep = Endpoint(0, 1, timeout_s=10)
    ch.send("meta", bytes(ep.get_metadata()))
    _ok, _ip, _gpu, conn = ep.accept()
    win = torch.zeros(WINDOW, dtype=torch.uint8)
    mr = ep.reg(win.data_ptr(), WINDOW)[1]
    ch.send("fifo", bytes(ep.advertise(conn, mr, win.data_ptr(), WINDOW)[1]))
    ch.recv("never", timeout=120)


def _writer_to_the_dying(ch):
    """One put done, the owner killed, then 2,000 puts that follow on (a
    batch to a dead peer): the wait raises, and so does a later put."""
    import torch
    from uccl_collective.gpu_ring import HostRing, Remote
    from uccl_collective.p2p import Endpoint, UcclError
    ep = Endpoint(0, 1, timeout_s=10)
    _ok, conn = ep.add_remote_endpoint(ch.recv("meta"))
    src = torch.from_numpy(rand_bytes(WINDOW, 9))
    ring = HostRing(ep, src, [Remote(conn, ch.recv("fifo"))], slots=64, inflight=8)
    ring.put(0, 0, 0, 4096)
    ring.wait(1, timeout=TIMEOUT_S)
    ch.event("kill_owner")
    ch.recv("killed", timeout=60)
    t0 = time.monotonic()
    msgs = []
    try:
        ring.puts(0, [(4096 + 256 * i, 4096 + 256 * i, 256) for i in range(2000)])
        ring.wait(2001, timeout=60)
    except UcclError as e:
        msgs.append(str(e))
    took = time.monotonic() - t0
    try:   # the ring has failed: a put raises (at once, or once its slot would be needed)
        for _ in range(200):
            ring.put(0, 0, 0, 256)
    except UcclError as e:
        msgs.append(str(e))
    done = ring.counters().done
    ring.close()
    ep.close()
    return {"seconds": took, "msgs": msgs, "done": done}


def test_a_killed_peer_fails_the_ring_and_nothing_hangs():
    with Pair(_writer_to_the_dying, _doomed_owner, env=TRANSPORTS["tcp"][0]) as pair:
        pair.wait_event("server", "kill_owner", timeout=120)
        pair.kill("client")
        pair.tell("server", "killed")
        res = pair.result("server", timeout=120)
    assert len(res["msgs"]) == 2, res
    assert all("ring failed" in m for m in res["msgs"]), res
    assert "written as one" in res["msgs"][0], res   # the batch it failed in, named
    assert res["seconds"] < 40, res
    assert 1 <= res["done"] < 2001, res
