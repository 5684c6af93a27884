"""GPU-initiated transfers against host-initiated ones of the same sizes.

Modes (one GPU unless --gpus names two):
  loopback  one process: our kernel (GpuRing.launch_puts) enqueues n puts of
            `size` bytes into a local window, drained by the proxy onto the
            copy engine; reference: the host issuing the same n copies with
            torch (copy_ on a stream, non_blocking), i.e. the copy engine
            driven from the host.
  pair      two processes (on one GPU, or on --gpus 0,1): rank 0's kernel
            enqueues n puts into rank 1's advertised window, drained onto the
            endpoint's connection (CUDA IPC on this host, or TCP with
            UCCL_P2P_TRANSPORT=tcp); reference: rank 0's host posting the same
            n one-sided writes (Endpoint.write_async) and waiting for them.

Each row: commands, time from launch to the host seeing every completion
(GPU-driven) and from the first post to the last completion (host), commands
per second, GB/s and the ratio (GPU-driven time / host time; < 1 is
faster).  The first and the last command's bytes are checked at the
destination every run.  Median of --iters runs after one warm-up.

  python3 benchmarks/benchmark_gpu_driven.py --mode loopback
  python3 benchmarks/benchmark_gpu_driven.py --mode pair [--gpus 0,1] [--json out.json]
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

WINDOW_CAP = 512 << 20
SIZES = [256, 4096, 65536, 1 << 20, 16 << 20]


def _n_for(size: int, commands: int) -> int:
    return max(1, min(commands, WINDOW_CAP // size))


def _rows_header() -> str:
    return (f"{'size':>10} {'cmds':>6} | {'gpu us':>10} {'Mcmd/s':>8} {'GB/s':>7} | "
            f"{'host us':>10} {'Mcmd/s':>8} {'GB/s':>7} | {'gpu/host':>8}")


def _row(size, n, tg, th) -> dict:
    r = {"size": size, "commands": n, "gpu_s": tg, "host_s": th,
         "gpu_cmds_per_s": n / tg, "host_cmds_per_s": n / th,
         "gpu_GBps": n * size / tg / 1e9, "host_GBps": n * size / th / 1e9, "ratio": tg / th}
    print(f"{size:>10} {n:>6} | {tg * 1e6:>10.1f} {n / tg / 1e6:>8.3f} {r['gpu_GBps']:>7.2f} | "
          f"{th * 1e6:>10.1f} {n / th / 1e6:>8.3f} {r['host_GBps']:>7.2f} | {tg / th:>8.2f}",
          flush=True)
    return r


def _check(got, want, what: str) -> None:
    import torch
    if not torch.equal(got, want):
        bad = int((got != want).sum())
        raise SystemExit(f"data check failed: {what}: {bad} bytes differ")


def _time_gpu_driven(ring, n: int, size: int, iters: int, reset) -> list[float]:
    """Seconds from launching our kernel (n puts of size bytes, no device
    wait) to the host seeing all n done, per run after one warm-up; reset()
    runs before each (the destination zeroed)."""
    import torch
    stream = torch.cuda.Stream()
    done, times = ring.done, []
    for it in range(iters + 1):
        reset()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            status = ring.launch_puts(n, size, wait=False)
        ring.wait(done + n)
        t1 = time.perf_counter()
        done += n
        stream.synchronize()
        st = status.tolist()
        if st != [0, done - 1]:
            raise SystemExit(f"the kernel reported {st} (first error code, last sequence "
                             f"number; expected [0, {done - 1}])")
        if it:
            times.append(t1 - t0)
    return times


def loopback(args) -> list[dict]:
    import torch
    from uccl_collective.gpu_ring import GpuRing
    from uccl_collective.p2p import Endpoint
    dev = args.gpus[0]
    torch.cuda.set_device(dev)
    ep = Endpoint(dev, 1)
    rows = []
    print(_rows_header())
    for size in args.sizes:
        n = _n_for(size, args.commands)
        src = torch.randint(0, 256, (size * 64,), dtype=torch.uint8, device="cuda")
        win = torch.zeros(n * size, dtype=torch.uint8, device="cuda")
        ring = GpuRing(ep, src, [win], slots=args.slots, inflight=args.inflight)
        def reset():
            win.zero_()
            torch.cuda.synchronize()

        tg, th = _time_gpu_driven(ring, n, size, args.iters, reset), []
        stream = torch.cuda.Stream()
        slots = src.numel() // size
        _check(win[:size], src[:size], "first command")
        k = (n - 1) % slots
        _check(win[(n - 1) * size:], src[k * size:(k + 1) * size], "last command")
        for it in range(args.iters + 1):  # the host issuing the same copies
            win.zero_()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                for i in range(n):
                    j = i % slots
                    win[i * size:(i + 1) * size].copy_(src[j * size:(j + 1) * size],
                                                       non_blocking=True)
            stream.synchronize()
            t1 = time.perf_counter()
            if it:
                th.append(t1 - t0)
        rows.append(_row(size, n, statistics.median(tg), statistics.median(th)))
        ring.close()
    ep.close()
    return rows


def _owner(conn, args):
    import torch
    from uccl_collective.p2p import Endpoint
    dev = args.gpus[1 % len(args.gpus)]
    torch.cuda.set_device(dev)
    ep = Endpoint(dev, 1)
    conn.send(bytes(ep.get_metadata()))
    _ok, _ip, _gpu, c = ep.accept()
    win = torch.zeros(WINDOW_CAP, dtype=torch.uint8, device="cuda")
    mr = ep.reg(win.data_ptr(), win.numel())[1]
    conn.send(bytes(ep.advertise(c, mr, win.data_ptr(), win.numel())[1]))

    def zero():
        win.zero_()
        torch.cuda.synchronize()
    serve_window(conn, zero, lambda off, ln: win[off:off + ln].cpu().numpy().tobytes())
    ep.close()


def pair(args) -> list[dict]:
    import numpy as np
    import torch
    from uccl_collective import _engine
    from uccl_collective.gpu_ring import GpuRing, Remote
    from uccl_collective.p2p import Endpoint
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(there, args), daemon=True)
    owner.start()
    dev = args.gpus[0]
    torch.cuda.set_device(dev)
    ep = Endpoint(dev, 1)
    _ok, conn = ep.add_remote_endpoint(here.recv())
    fifo = here.recv()
    window, token, waddr, wlen, base = _engine.fifo_fields(fifo)
    print(f"transport: {ep.conn_transport(conn)}")
    rows = []
    print(_rows_header())
    for size in args.sizes:
        n = _n_for(size, args.commands)
        src = torch.randint(0, 256, (size * 64,), dtype=torch.uint8, device="cuda")
        slots = src.numel() // size
        ring = GpuRing(ep, src, [Remote(conn, fifo)], slots=args.slots, inflight=args.inflight)
        mr = ep.reg(src.data_ptr(), src.numel())[1]
        fifos = [_engine.fifo_item(window, token, waddr + i * size, size, base or waddr)
                 for i in range(n)]
        def zero():
            here.send(("zero",))
            assert here.recv() == "zeroed"

        def check(what):
            for i in (0, n - 1):
                here.send(("get", i * size, size))
                got = np.frombuffer(here.recv(), np.uint8)
                j = i % slots
                want = src[j * size:(j + 1) * size].cpu().numpy()
                if not np.array_equal(got, want):
                    raise SystemExit(f"data check failed: {what}, command {i}")

        tg, th = _time_gpu_driven(ring, n, size, args.iters, zero), []
        check("GPU-driven")
        for it in range(args.iters + 1):
            zero()
            t0 = time.perf_counter()
            ids = [ep.write_async(conn, mr, src.data_ptr() + (i % slots) * size, size,
                                  fifos[i])[1] for i in range(n)]
            for x in ids:
                ep.wait(x)
                ep.release(x)
            t1 = time.perf_counter()
            if it:
                th.append(t1 - t0)
        check("host-initiated")
        rows.append(_row(size, n, statistics.median(tg), statistics.median(th)))
        ring.close()
        ep.dereg(mr)
    here.send(("stop",))
    owner.join(30)
    ep.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["loopback", "pair"], default="loopback")
    ap.add_argument("--gpus", default="0", help="GPU of rank 0[,rank 1] (pair: '0' shares one)")
    ap.add_argument("--sizes", type=parse_sizes, default=SIZES, help="e.g. 256,4K,1M")
    ap.add_argument("--commands", type=int, default=4096, help="puts per run (capped so the "
                    "window stays within 512 MiB)")
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--csv", help="write the rows here, as CSV")
    args = ap.parse_args()
    args.gpus = [int(g) for g in args.gpus.split(",")]
    import torch
    print(f"# {args.mode} on {torch.cuda.get_device_name(args.gpus[0])}, GPUs {args.gpus}, "
          f"slots {args.slots}, inflight {args.inflight}, {time.strftime('%Y-%m-%d %H:%M')}")
    rows = loopback(args) if args.mode == "loopback" else pair(args)
    device = torch.cuda.get_device_name(args.gpus[0])
    write_results([{**r, "mode": args.mode, "device": device} for r in rows], args)


if __name__ == "__main__":
    main()
