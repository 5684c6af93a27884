"""Connection setup time: connect() + accept() between two processes on
loopback, one connection after another (each removed on both sides before
the next), per transport; prints the median and the 90th percentile.

    PYTHONPATH=$PWD python3 benchmarks/connect_time.py --transport shm tcp --count 300

Compare two trees by pointing PYTHONPATH at each in turn, back to back on one
machine."""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def _acceptor(count: int) -> None:
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=30)
    print(ep.address()[1], flush=True)
    for _ in range(count):
        conn = ep.accept(timeout=30)[3]
        ep.remove_remote_endpoint(conn)
    sys.stdin.readline()
    ep.close()


def _run(transport: str, count: int) -> list[float]:
    env = dict(os.environ, UCCL_P2P_TRANSPORT=transport)
    env.setdefault("UCCL_SOCKET_IFNAME", "lo")
    env.setdefault("UCCL_P2P_LOG_LEVEL", "ERROR")
    child = subprocess.Popen([sys.executable, __file__, "--acceptor", str(count)], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        os.environ.update({k: env[k] for k in ("UCCL_P2P_TRANSPORT", "UCCL_SOCKET_IFNAME",
                                               "UCCL_P2P_LOG_LEVEL")})
        from uccl_collective.p2p import Endpoint

        ep = Endpoint(port=0, timeout_s=30)
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            conn = ep.connect("127.0.0.1", -1, remote_port=port)[1]
            times.append(time.perf_counter() - t0)
            ep.remove_remote_endpoint(conn)
        ep.close()
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(30)
        return times
    finally:
        if child.poll() is None:
            child.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", nargs="+", default=["shm", "tcp"],
                    help="UCCL_P2P_TRANSPORT values to time (default: shm tcp)")
    ap.add_argument("--count", type=int, default=300, help="connections per transport")
    ap.add_argument("--acceptor", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.acceptor is not None:
        _acceptor(a.acceptor)
        return
    for tp in a.transport:  # the environment is read at each Endpoint's creation
        times = sorted(_run(tp, a.count))
        print(f"{tp}: connect+accept median {statistics.median(times) * 1e3:.3f} ms, "
              f"p90 {times[int(0.9 * len(times))] * 1e3:.3f} ms ({a.count} connections)")


if __name__ == "__main__":
    main()
