"""The ring's proxy, per command: puts drained onto a peer's window, with
batching and without, against the host posting the same writes itself.

Two processes on this host (no GPU needed): rank 1 advertises a window;
rank 0 fills a host ring (gpu_ring.HostRing, the proxy of a GPU's ring,
csrc/ring/ring.c) with n puts of `size` bytes in one call (HostRing.puts,
as a kernel's threads would) and waits for the last completion.  Two
patterns: "runs", every put following on from the one before (source and
destination: the proxy writes them as one, up to UCCL_RING_BATCH_BYTES),
and "scattered", no two consecutive puts adjacent (a write each).  Each
with batching on (UCCL_RING_BATCH_BYTES=1M) and off (0); reference: rank
0's host posting the same n one-sided writes (Endpoint.write_async) and
waiting for them, in the same run.  The first and last put's bytes are
checked at the destination every run; median of --iters after a warm-up.

  python3 benchmarks/ring_proxy.py [--sizes 256,4K,64K] [--json out.json]
  UCCL_P2P_TRANSPORT=tcp python3 benchmarks/ring_proxy.py
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import parse_sizes, serve_window, write_results  # noqa: E402 (this folder is on sys.path)

WINDOW = 64 << 20


def _owner(conn):
    import torch
    from uccl_collective.p2p import Endpoint
    ep = Endpoint(0, 1)
    conn.send(bytes(ep.get_metadata()))
    _ok, _ip, _gpu, c = ep.accept()
    win = torch.zeros(WINDOW, dtype=torch.uint8)
    mr = ep.reg(win.data_ptr(), WINDOW)[1]
    conn.send(bytes(ep.advertise(c, mr, win.data_ptr(), WINDOW)[1]))
    serve_window(conn, win.zero_, lambda off, ln: win[off:off + ln].numpy().tobytes())
    ep.close()


def _table(size: int, n: int, pattern: str):
    """n rows (src_off, dst_off, length): slot i of the source to slot
    perm[i] of the window (runs: perm = i; scattered: every second slot,
    odd ones after the even ones, so that no two consecutive puts meet)."""
    import numpy as np
    i = np.arange(n, dtype=np.uint64)
    if pattern == "runs":
        dst = i
    else:
        dst = np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)]).astype(np.uint64)
    return np.stack([i * size, dst * size, np.full(n, size, np.uint64)], axis=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=parse_sizes, default=[256, 4096, 65536])
    ap.add_argument("--commands", type=int, default=8192,
                    help="puts per run (fewer where n x size passes 64 MiB)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--inflight", type=int, default=64, help="commands the proxy keeps in flight")
    ap.add_argument("--json")
    ap.add_argument("--csv")
    args = ap.parse_args()
    import numpy as np
    import torch
    from uccl_collective import _engine
    from uccl_collective.gpu_ring import HostRing, Remote
    from uccl_collective.p2p import Endpoint
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(there,), daemon=True)
    owner.start()
    ep = Endpoint(0, 1)
    _ok, conn = ep.add_remote_endpoint(here.recv())
    fifo = here.recv()
    window, token, waddr, _wlen, base = _engine.fifo_fields(fifo)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, transport {ep.conn_transport(conn)}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'size':>7} {'pattern':>9} {'puts':>6}  {'ring, batched':>22}  "
          f"{'ring, a write each':>22}  {'host writes':>12}  ring/host")

    def zero():
        here.send(("zero",))
        assert here.recv() == "zeroed"

    def check(src, table, what):
        for k in (0, len(table) - 1):
            s, d, ln = (int(v) for v in table[k])
            here.send(("get", d, ln))
            got = np.frombuffer(here.recv(), np.uint8)
            if not np.array_equal(got, src[s:s + ln].numpy()):
                raise SystemExit(f"data check failed: {what}, put {k}")

    rows = []
    for size in args.sizes:
        n = max(1, min(args.commands, WINDOW // size))
        src = torch.randint(0, 256, (n * size,), dtype=torch.uint8)
        mr = ep.reg(src.data_ptr(), src.numel())[1]
        for pattern in ("runs", "scattered"):
            table = _table(size, n, pattern)
            row = {"size": size, "pattern": pattern, "puts": n}
            for label, batch in (("batched", "1M"), ("each", "0")):
                os.environ["UCCL_RING_BATCH_BYTES"] = batch   # read when the ring is made
                ring = HostRing(ep, src, [Remote(conn, fifo)], slots=args.slots,
                                inflight=args.inflight)
                times, done = [], 0
                for it in range(args.iters + 1):
                    zero()
                    t0 = time.perf_counter()
                    ring.puts(0, table)
                    done += n
                    ring.wait(done, timeout=120)
                    if it:
                        times.append(time.perf_counter() - t0)
                check(src, table, f"ring, {label}")
                row[f"{label}_s"] = statistics.median(times)
                row[f"{label}_writes"] = ring.stats().posts // (args.iters + 1)
                ring.close()
            os.environ.pop("UCCL_RING_BATCH_BYTES")
            fifos = [_engine.fifo_item(window, token, waddr + int(d), size, base or waddr)
                     for d in table[:, 1]]
            times = []
            for it in range(args.iters + 1):
                zero()
                t0 = time.perf_counter()
                ids = [ep.write_async(conn, mr, src.data_ptr() + int(s), size, fifos[k])[1]
                       for k, s in enumerate(table[:, 0])]
                for x in ids:
                    ep.wait(x)
                    ep.release(x)
                if it:
                    times.append(time.perf_counter() - t0)
            check(src, table, "host writes")
            row["host_s"] = statistics.median(times)
            row["ratio"] = row["batched_s"] / row["host_s"]
            rows.append(row)

            def rate(t):
                return f"{n / t / 1e6:6.3f} Mcmd/s {n * size / t / 1e9:6.2f} GB/s"
            print(f"{size:>7} {pattern:>9} {n:>6}  {rate(row['batched_s']):>22}  "
                  f"{rate(row['each_s']):>22}  {n / row['host_s'] / 1e6:6.3f} Mcmd/s  "
                  f"{row['ratio']:.2f} ({row['batched_writes']} writes)", flush=True)
        ep.dereg(mr)
    here.send(("stop",))
    owner.join(30)
    ep.close()
    write_results(rows, args)


if __name__ == "__main__":
    main()
