"""What one peer can make an endpoint hold (floods of requests, dead or
unaccepted connections, idle handshakes), measured on whichever build is on
PYTHONPATH, so that two trees can be compared (the test helpers come from
this checkout's tests/):

  rts     a hand-written shm-cma connector sends N (300,000) RTS messages no
          recv matches: how many the endpoint took in, its RSS growth, and
          the growth left after remove_remote_endpoint
  dead    N (300) clients connect, send 4 KiB, are accepted, and go away (10
          SIGKILLed, the rest close politely), the server never calling
          remove_remote_endpoint: the server's descriptors and threads before
          and after
  unacc   one client completes N (1,100) handshakes that the server never
          accept()s: how many succeed, the server's descriptors at the peak
          and after that client has gone; then a legitimate client sends
          1 MiB, the server accept()ing until it finds it
  idle    N (330) sockets that connect and say nothing (then as many that send
          half a record): the time a legitimate connect takes meanwhile

  PYTHONPATH=<tree> python3 benchmarks/peer_bounds.py [--only rts dead ...]

Every wait is bounded; each case runs in its own processes.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from _harness import BASE_ENV as ENV, SENDING_CLIENT  # noqa: E402

CTX = mp.get_context("spawn")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _socks() -> int:
    """This process's sockets (the rest of _fds() includes the pipes of the
    harness's own queues and child processes)."""
    n = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{f}").startswith("socket:")
        except OSError:
            pass
    return n


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settle(pred, timeout):
    end = time.monotonic() + timeout
    while not pred() and time.monotonic() < end:
        time.sleep(0.05)


def _endpoint(timeout_s=10):
    from uccl_collective.p2p import Endpoint

    return Endpoint(port=0, timeout_s=timeout_s)


def _buf(n, v=0):
    import numpy as np

    return np.full(n, v, np.uint8)


# ---------------------------------------------------------------- rts
def case_rts(n, q):
    os.environ.update(ENV, UCCL_P2P_TRANSPORT="shm", UCCL_P2P_SHM_MODE="cma")
    import test_peer_bounds as tpb

    tpb.FLOOD = n
    t0 = time.monotonic()
    r = tpb._rts_flood(None)
    q.put(dict(case="rts", n=n, consumed=r["consumed"], rss_growth_kib=r["grew_kib"],
               rss_after_remove_kib=r["after_remove_kib"], peer_hung_up=r["eof"],
               recv_error=(r["err"] or {}).get("msg", "")[:160], s=round(time.monotonic() - t0, 1)))


# ---------------------------------------------------------------- dead
KILLED = 10


def _polite_clients(port, n):
    os.environ.update(ENV)
    b = _buf(4096, 7)
    for _ in range(n):
        ep = _endpoint()
        conn = ep.connect("127.0.0.1", -1, remote_port=port)[1]
        mr = ep.reg(b.ctypes.data, b.nbytes)[1]
        ep.send(conn, mr, b.ctypes.data, b.nbytes)
        ep.close()


def case_dead(n, q):
    os.environ.update(ENV)
    ep = _endpoint()
    port = ep.address()[1]
    b = _buf(4096)
    mr = ep.reg(b.ctypes.data, b.nbytes)[1]
    base_fds, base_socks, base_threads = _fds(), _socks(), _threads()
    killed = min(KILLED, n)
    t0 = time.monotonic()
    cl = CTX.Process(target=_polite_clients, args=(port, n - killed))
    cl.start()
    for _ in range(n - killed):
        conn = ep.accept(timeout=30)[3]
        ep.recv(conn, mr, b.ctypes.data, b.nbytes)
    cl.join(60)
    for _ in range(killed):                      # no BYE: the process dies
        p = subprocess.Popen([sys.executable, "-c", SENDING_CLIENT, str(port)], env={**os.environ},
                             stdout=subprocess.PIPE, start_new_session=True)
        conn = ep.accept(timeout=30)[3]
        ep.recv(conn, mr, b.ctypes.data, b.nbytes)
        p.stdout.readline()
        os.killpg(p.pid, 9)
        p.wait(timeout=30)
        p.stdout.close()
    _settle(lambda: _socks() <= base_socks, 5)
    q.put(dict(case="dead", n=n, killed=killed, fds_before=base_fds, fds_after=_fds(),
               sockets_before=base_socks, sockets_after=_socks(),
               threads_before=base_threads, threads_after=_threads(),
               s=round(time.monotonic() - t0, 1)))
    ep.close()


# ---------------------------------------------------------------- unacc
def _unacc_client(port, n, q, go):
    os.environ.update(ENV)
    from uccl_collective import UcclError

    ep = _endpoint()
    ok = refused = 0
    first_err = ""
    t0 = time.monotonic()
    for _ in range(n):
        try:
            ep.connect("127.0.0.1", -1, remote_port=port)
            ok += 1
        except UcclError as e:
            refused += 1
            first_err = first_err or str(e)
    q.put(dict(ok=ok, refused=refused, first_err=first_err[:200],
               s=round(time.monotonic() - t0, 1)))
    go.wait(120)
    ep.close()


def _legit_client(port, q):
    os.environ.update(ENV)
    from uccl_collective import UcclError

    ep = _endpoint(5)
    b = _buf(1 << 20, 9)
    t0 = time.monotonic()
    try:
        conn = ep.connect("127.0.0.1", -1, remote_port=port)[1]
        mr = ep.reg(b.ctypes.data, b.nbytes)[1]
        ep.send(conn, mr, b.ctypes.data, b.nbytes)
        q.put(dict(err=None, s=round(time.monotonic() - t0, 2)))
    except UcclError as e:
        q.put(dict(err=str(e)[:200], s=round(time.monotonic() - t0, 2)))
    ep.close()


def case_unacc(n, q):
    os.environ.update(ENV)
    from uccl_collective import UcclError

    ep = _endpoint(5)
    port = ep.address()[1]
    base, base_socks = _fds(), _socks()
    cq, go = CTX.Queue(), CTX.Event()
    cl = CTX.Process(target=_unacc_client, args=(port, n, cq, go))
    cl.start()
    c = cq.get(timeout=300)
    time.sleep(0.5)
    peak, peak_socks = _fds(), _socks()
    # a legitimate client while they are queued (nobody accepts it either)
    lq = CTX.Queue()
    lg = CTX.Process(target=_legit_client, args=(port, lq))
    lg.start()
    during = lq.get(timeout=60)
    lg.join(30)
    go.set()                                   # the flooding client goes away
    cl.join(60)
    _settle(lambda: _socks() <= base_socks, 5)
    after, after_socks = _fds(), _socks()
    # a legitimate client once it has gone; the server accept()s until it
    # finds a connection whose 1 MiB arrives
    lg = CTX.Process(target=_legit_client, args=(port, lq))
    lg.start()
    b = _buf(1 << 20)
    mr = ep.reg(b.ctypes.data, b.nbytes)[1]
    accepts, served, t0 = 0, False, time.monotonic()
    while not served and time.monotonic() - t0 < 30:
        try:
            conn = ep.accept(timeout=2)[3]
        except UcclError:
            break
        accepts += 1
        try:
            ep.recv_async(conn, mr, b.ctypes.data, b.nbytes)
        except UcclError:
            continue
        served = bool(_settle(lambda: b[-1] == 9, 0.05) or b[-1] == 9)
    if not served:
        _settle(lambda: b[-1] == 9, 5)
        served = bool(b[-1] == 9)
    after_legit = lq.get(timeout=60)
    lg.join(30)
    q.put(dict(case="unacc", n=n, client=c, fds_before=base, fds_peak=peak,
               fds_after_client_gone=after, sockets_before=base_socks,
               sockets_peak=peak_socks, sockets_after_client_gone=after_socks, legit_while_queued=during,
               legit_after=dict(served=served, accepts=accepts, sender=after_legit)))
    ep.close()


# ---------------------------------------------------------------- idle
def _connect_time(port):
    from uccl_collective import UcclError

    ep = _endpoint(30)
    t0 = time.monotonic()
    try:
        ep.connect("127.0.0.1", -1, remote_port=port)
        err = None
    except UcclError as e:
        err = str(e)[:160]
    dt = round(time.monotonic() - t0, 3)
    ep.close()
    return dict(s=dt, err=err)


def case_idle(n, q):
    os.environ.update(ENV)
    ep = _endpoint(30)
    ep.start_passive_accept()
    port = ep.address()[1]
    out = dict(case="idle", n=n, alone=_connect_time(port))
    for what, payload in (("idle", b""), ("half_record", b"\x55" * 40)):
        socks = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if payload:
                s.sendall(payload)
            socks.append(s)
        time.sleep(0.2)
        out[what] = _connect_time(port)
        for s in socks:
            s.close()
        time.sleep(0.5)
    q.put(out)
    ep.close()


CASES = {"rts": (case_rts, 300_000), "dead": (case_dead, 300), "unacc": (case_unacc, 1100),
         "idle": (case_idle, 330)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--n", type=int, default=None, help="override the case's count")
    a = ap.parse_args()
    import uccl_collective

    print(f"# engine: {os.path.dirname(uccl_collective.__file__)}", flush=True)
    for name in a.only:
        fn, n = CASES[name]
        q = CTX.Queue()
        p = CTX.Process(target=fn, args=(a.n or n, q))
        p.start()
        try:
            print(q.get(timeout=600), flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(dict(case=name, error=repr(e)), flush=True)
        p.join(30)
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    main()
