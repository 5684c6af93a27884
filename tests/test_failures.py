"""Failures in time: a peer SIGKILLed (or closing) while the survivor waits
must make the survivor raise UcclError promptly -- well inside its timeout,
never a hang -- and a wait with nobody on the other side must raise
UcclTimeoutError after about timeout_s."""
from __future__ import annotations

import time

import pytest

from _harness import (MiB, TRANSPORT_NAMES, TRANSPORTS, Pair, addr, all_poison, catch, peer_ip,
                      poisoned, rand_bytes, run_one, run_pair)

BIG = 64 * MiB
SURVIVOR_TIMEOUT = 10.0   # the survivor's timeout_s; peer death must be noticed well before


def _accept(ch, timeout_s):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=timeout_s)
    ch.send("meta", ep.get_metadata())
    ok, ip, gpu, conn = ep.accept()
    return ep, conn


def _connect(ch, timeout_s):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=timeout_s)
    ok, conn = ep.add_remote_endpoint(ch.recv("meta"))
    return ep, conn


def _check_prompt_failure(err, what):
    assert err is not None, f"{what}: the survivor's call returned normally"
    assert err["uccl"], f"{what}: expected UcclError, got {err['type']}: {err['msg']}"
    assert not err["timeout"], (f"{what}: the dead peer was only noticed by the "
                                f"{SURVIVOR_TIMEOUT:.0f} s timeout ({err['msg']})")
    assert err["elapsed"] < SURVIVOR_TIMEOUT, f"{what}: took {err['elapsed']:.1f} s"


# --------------------------------------------------------------------------
# the sender dies while the receiver waits in a 64 MiB recv
def _recv_survivor(ch, wait_for_parent):
    import numpy as np

    ep, conn = _accept(ch, SURVIVOR_TIMEOUT)
    buf = np.empty(BIG, np.uint8)
    mr = ep.reg(addr(buf), BIG)[1]
    if wait_for_parent:
        ch.recv("go", timeout=30)   # sent by the parent once the sender is dead
    ch.event("waiting")
    return catch(ep.recv, conn, mr, addr(buf), BIG)


def _doomed_sender(ch, post):
    ep, conn = _connect(ch, 60)
    if post:  # the 64 MiB message is announced, then the process dies before it is pulled
        data = rand_bytes(BIG, 1)
        mr = ep.reg(addr(data), BIG)[1]
        ep.send_async(conn, mr, addr(data), BIG)
    ch.event("ready")
    time.sleep(120)  # SIGKILLed long before this ends


@pytest.mark.parametrize("transport", TRANSPORT_NAMES)
def test_sender_killed_while_receiver_waits(transport):
    """The receiver blocks in recv() of 64 MiB that the sender never sends;
    the sender is SIGKILLed: recv raises UcclError well inside the receiver's
    10 s timeout (not a timeout, not a hang)."""
    env, _ = TRANSPORTS[transport]
    with Pair(_recv_survivor, _doomed_sender, env=env,
              server_kwargs={"wait_for_parent": False}, client_kwargs={"post": False}) as p:
        p.wait_event("client", "ready")
        p.wait_event("server", "waiting")
        time.sleep(0.3)       # let the receiver settle into its wait
        p.kill("client")
        err = p.result("server", timeout=SURVIVOR_TIMEOUT + 10)
    _check_prompt_failure(err, "recv with the sender killed")


@pytest.mark.parametrize("transport", TRANSPORT_NAMES)
def test_sender_killed_after_posting(transport):
    """The sender posts a 64 MiB send_async and is SIGKILLed before the
    receiver posts its recv; the receiver's recv then raises UcclError promptly
    (the announced message can no longer be pulled) instead of hanging or
    returning garbage."""
    env, _ = TRANSPORTS[transport]
    with Pair(_recv_survivor, _doomed_sender, env=env,
              server_kwargs={"wait_for_parent": True}, client_kwargs={"post": True}) as p:
        p.wait_event("client", "ready", timeout=60)
        p.kill("client")
        p.tell("server", "go")
        err = p.result("server", timeout=SURVIVOR_TIMEOUT + 10)
    _check_prompt_failure(err, "recv of a message whose sender was killed")


# --------------------------------------------------------------------------
# the receiver dies while the sender waits; the target dies before a write
def _doomed_receiver(ch):
    ep, conn = _accept(ch, 60)  # keep ep referenced: the process must die with it open
    ch.event("ready")
    time.sleep(120)


def _send_survivor(ch):
    ep, conn = _connect(ch, SURVIVOR_TIMEOUT)
    data = rand_bytes(BIG, 2)
    mr = ep.reg(addr(data), BIG)[1]
    ok, t = ep.send_async(conn, mr, addr(data), BIG)
    ch.event("waiting")
    return catch(ep.wait, t)


@pytest.mark.parametrize("transport", ["tcp", "shm-ring", "rdma"])
def test_receiver_killed_while_sender_waits(transport):
    """The sender waits on a 64 MiB send_async that the receiver never
    receives; the receiver is SIGKILLed: wait() raises UcclError promptly."""
    env, _ = TRANSPORTS[transport]
    with Pair(_doomed_receiver, _send_survivor, env=env) as p:
        p.wait_event("server", "ready")
        p.wait_event("client", "waiting", timeout=60)
        time.sleep(0.3)
        p.kill("server")
        err = p.result("client", timeout=SURVIVOR_TIMEOUT + 10)
    _check_prompt_failure(err, "send with the receiver killed")


def _doomed_target(ch):
    import numpy as np

    ep, conn = _accept(ch, 60)
    win = np.zeros(BIG, np.uint8)
    mr = ep.reg(addr(win), BIG)[1]
    ch.send("fifo", ep.advertise(conn, mr, addr(win), BIG)[1])
    ch.event("ready")
    time.sleep(120)


def _write_survivor(ch):
    ep, conn = _connect(ch, SURVIVOR_TIMEOUT)
    fifo = ch.recv("fifo")
    data = rand_bytes(BIG, 3)
    mr = ep.reg(addr(data), BIG)[1]
    ch.event("armed")   # connected: the target may die now, not during the handshake
    ch.recv("go", timeout=30)   # from the parent, once the target is dead
    return catch(ep.write, conn, mr, addr(data), BIG, fifo)


@pytest.mark.parametrize("transport", ["tcp", "shm-cma", "rdma"])
def test_target_killed_before_one_sided_write(transport):
    """The target advertises a 64 MiB window and is SIGKILLed; the
    initiator's write() with that fifo_item raises UcclError promptly."""
    env, _ = TRANSPORTS[transport]
    with Pair(_doomed_target, _write_survivor, env=env) as p:
        p.wait_event("server", "ready")
        # the acceptor's accept() may return before the connector's connect
        # does (its CMA check of the acceptor comes last): a kill before
        # then fails the connect, not the write this test is about
        p.wait_event("client", "armed", timeout=60)
        p.kill("server")
        p.tell("client", "go")
        err = p.result("client", timeout=SURVIVOR_TIMEOUT + 10)
    _check_prompt_failure(err, "write to a killed target")


# --------------------------------------------------------------------------
# the peer closes its endpoint (no crash) while a recv is pending
def _closing_sender(ch):
    ep, conn = _connect(ch, 60)
    ch.recv("posted")
    time.sleep(0.2)
    ep.close()
    return True


def _recv_after_close(ch):
    import numpy as np

    ep, conn = _accept(ch, SURVIVOR_TIMEOUT)
    buf = np.empty(4097, np.uint8)
    mr = ep.reg(addr(buf), 4097)[1]
    ok, t = ep.recv_async(conn, mr, addr(buf), 4097)
    ch.send("posted")
    err = catch(ep.wait, t)
    later = catch(ep.recv, conn, mr, addr(buf), 4097)
    return err, later


def test_peer_close_fails_pending_recv():
    """The sender close()s its endpoint while the receiver waits on a
    recv_async: wait() raises UcclError promptly, and a later recv on that
    connection fails at once too."""
    (err, later), ok = run_pair(_recv_after_close, _closing_sender, timeout=40)
    assert ok is True
    _check_prompt_failure(err, "recv with the sender closed")
    assert later is not None and later["elapsed"] < 2, f"recv on a dead connection: {later}"


# --------------------------------------------------------------------------
# deadlines with a live, silent peer
def _silent_peer(ch):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=5)
    port = ch.recv("port")
    conns = [ep.connect(peer_ip(), -1, remote_port=port)[1] for _ in range(2)]
    ch.recv("timed_out", timeout=30)
    # too late: the receiver gave up on connection 2, so this must not land
    data = rand_bytes(4097, 9)
    late = catch(ep.send, conns[1], ep.reg(addr(data), 4097)[1], addr(data), 4097)
    ch.send("late_sent")
    return len(set(conns)), late


def _timeout_receiver(ch):
    import numpy as np

    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=2)
    ch.send("port", ep.address()[1])
    c1 = ep.accept()[3]
    c2 = ep.accept()[3]
    buf = np.empty(BIG, np.uint8)
    mr = ep.reg(addr(buf), BIG)[1]
    blocking = catch(ep.recv, c1, mr, addr(buf), BIG)           # endpoint timeout_s = 2
    small = poisoned(4097)
    smr = ep.reg(addr(small), small.nbytes)[1]
    ok, t = ep.recv_async(c2, smr, addr(small), 4097)
    waited = catch(ep.wait, t, timeout=0.5)                       # explicit timeout
    ch.send("timed_out")
    ch.recv("late_sent")
    time.sleep(0.3)
    return blocking, waited, all_poison(small)


def test_recv_with_nobody_sending_times_out():
    """With the peer alive but sending nothing, a blocking recv raises
    UcclTimeoutError after about the endpoint's timeout_s (2 s), and
    wait(id, timeout=0.5) on a recv_async raises UcclTimeoutError after about
    0.5 s; neither hangs.  The timed-out connection is failed: a message the
    peer sends afterwards raises UcclError on the sender and never lands in
    the receiver's (poisoned) buffer."""
    (blocking, waited, untouched), (nconn, late) = run_pair(_timeout_receiver, _silent_peer,
                                                            timeout=40)
    assert nconn == 2
    for err, t in ((blocking, 2.0), (waited, 0.5)):
        assert err is not None and err["timeout"], f"expected UcclTimeoutError, got {err}"
        assert err["uccl"] and isinstance(err["msg"], str)
        assert t - 0.05 <= err["elapsed"] < t + 1.5, f"timed out after {err['elapsed']:.2f} s, not ~{t} s"
    assert untouched, "bytes sent after the receiver's wait timed out landed in its buffer"
    assert late is not None and late["uccl"], f"a send on the timed-out connection: {late}"


def _accept_nobody(ch, t):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=30)
    return catch(ep.accept, timeout=t)


@pytest.mark.parametrize("timeout", [0.25, 1.0])
def test_accept_with_nobody_connecting_times_out(timeout):
    """accept(timeout=t) with nobody connecting raises UcclTimeoutError after
    about t seconds (run in a child process, killed if it hangs)."""
    err = run_one(_accept_nobody, timeout=timeout + 5, t=timeout)
    assert err is not None and err["timeout"], err
    assert timeout - 0.05 <= err["elapsed"] < timeout + 1.0, err
