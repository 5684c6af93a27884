#!/usr/bin/env python3
"""Point-to-point benchmark of uccl_collective.p2p.Endpoint, with upstream's flags.

Launch with torchrun, two processes:

    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/benchmark_uccl.py \
        --sizes 64K,1M,16M,256M --iters 10 [--transport shm|tcp] [--latency]

Rank 0 is the client (it sends, writes or reads), rank 1 the server (it
receives or advertises its buffer).  torch.distributed with Gloo is used only
to bootstrap (endpoint metadata, fifo items, checksums, barriers between
phases) and, unless --compare none, as the baseline: dist.send/dist.recv of the
same size, timed the same way in the same run.

Bandwidth is GB/s = 1e9 bytes/s (Gbps = 8x that); with --dual it is per
direction (both run at once, so the two together moved twice as much).
The "ratio" is always "times better than Gloo": uccl/gloo for bandwidth,
gloo/uccl for latency (medians of the per-round-trip times, which the VM's
hiccups move far less than the means).

Every size is first moved once with random bytes and checked on the receiving
side (CRC32 against the sender's, exchanged over Gloo); a mismatch aborts both
ranks, so a transfer that moves wrong bytes never gets a number.
"""
from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist

from bench_common import parse_sizes, pretty, write_results  # noqa: E402 (this folder is on sys.path)
from gloo_ops import gloo_pingpong  # noqa: E402
from tqdm import tqdm

GPU_TODO = "GPU transport lands with the CUDA IPC issue"
DEFAULT_SIZES = [1 << k for k in range(10, 29, 2)]  # 1K, 4K, ..., 256M
CTL_BYTES = 8  # ready / ack messages


# --------------------------------------------------------------- arguments --
def get_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # upstream's flags
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--pinned", action="store_true", help="accepted for upstream; no effect on CPU")
    p.add_argument("--sizes", type=parse_sizes, default=DEFAULT_SIZES,
                   help="comma list, e.g. 64K,1M,256M (default 1K..256M in powers of 4)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed messages per size (default 20; 1000 round trips with --latency)")
    p.add_argument("--num-iovs", type=int, default=1, help="split each message into N iovs (sendv/recvv)")
    p.add_argument("--async-api", action="store_true", help="*_async + poll_async instead of blocking calls")
    p.add_argument("--dual", action="store_true",
                   help="both directions at once (two connections, async API)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--ipc", action="store_true", help="same-host send/recv (the default path)")
    mode.add_argument("--write-ipc", action="store_true", help="one-sided write into the server's buffer")
    mode.add_argument("--read-ipc", action="store_true", help="one-sided read from the server's buffer")
    p.add_argument("--sender-device", choices=["cpu", "gpu"], default=None)
    p.add_argument("--receiver-device", choices=["cpu", "gpu"], default=None)
    # ours
    p.add_argument("--transport", choices=["auto", "tcp", "shm"], default="auto",
                   help="sets UCCL_P2P_TRANSPORT before the endpoint is made")
    p.add_argument("--shm-mode", choices=["auto", "cma", "ring"], default="auto",
                   help="sets UCCL_P2P_SHM_MODE")
    p.add_argument("--compare", choices=["gloo", "none"], default="gloo")
    p.add_argument("--latency", action="store_true",
                   help="ping-pong one-way latency (round trip / 2) instead of bandwidth")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed messages per size before timing (default 3; 50 with --latency)")
    p.add_argument("--num-cpus", type=int, default=4, help="engine worker threads (Endpoint num_cpus)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds before a stuck transfer or Gloo call fails instead of hanging")
    p.add_argument("--json", metavar="FILE", help="write results as JSON (rank 0)")
    p.add_argument("--csv", metavar="FILE", help="write results as CSV (rank 0)")
    a = p.parse_args()

    if a.iters is None:
        a.iters = 1000 if a.latency else 20
    if a.warmup is None:
        a.warmup = 50 if a.latency else 3
    if a.iters < 1 or a.warmup < 0 or a.num_iovs < 1:
        p.error("--iters and --num-iovs must be >= 1, --warmup >= 0")
    if a.dual and (a.write_ipc or a.read_ipc):
        p.error("--dual times send/recv both ways; it does not combine with --write-ipc/--read-ipc")
    if a.latency and (a.dual or a.write_ipc or a.read_ipc):
        p.error("--latency is a send/recv ping-pong; drop --dual/--write-ipc/--read-ipc")
    small = [s for s in a.sizes if s < a.num_iovs]
    if small:
        p.error(f"sizes {small} are smaller than --num-iovs {a.num_iovs}: every iov needs a byte")
    # Raised before any process group exists, so both ranks stop the same way.
    if "gpu" in (a.device, a.sender_device, a.receiver_device):
        raise NotImplementedError(f"--device/--sender-device/--receiver-device gpu: {GPU_TODO}")
    a.op = "write" if a.write_ipc else "read" if a.read_ipc else "send"
    return a


# ------------------------------------------------------------------ engine --
class Bench:
    """One rank's endpoint, its two connections and its buffers.

    Connections are one-way, so there are two: fwd (rank 0 -> rank 1) carries
    the data; bwd (rank 1 -> rank 0) carries the server's ready/ack messages,
    the pongs of --latency and the server's half of --dual.
    """

    def __init__(self, args, rank, p2p):
        self.args, self.rank, self.peer = args, rank, 1 - rank
        # A per-run secret keeps the endpoints authenticated (no "unauthenticated"
        # warning) without the user having to set UCCL_P2P_SECRET.
        box = [secrets.token_hex(16) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        # port=0: both ranks share one host, so the well-known port would be
        # taken by whichever rank comes first anyway.
        self.ep = p2p.Endpoint(None, args.num_cpus, timeout_s=args.timeout, secret=box[0], port=0)
        metas = [None, None]
        dist.all_gather_object(metas, self.ep.get_metadata())
        # Connect and accept in a fixed order, so neither rank can wait on the other.
        if rank == 0:
            self.fwd = self.ep.add_remote_endpoint(metas[1])[1]
            self.bwd = self.ep.accept()[3]
        else:
            self.fwd = self.ep.accept()[3]
            self.bwd = self.ep.add_remote_endpoint(metas[0])[1]
        self.transport = self.ep.conn_transport(self.fwd)

        big = max(args.sizes)
        # src is what this rank sends (or, for --read-ipc on the server, what it
        # exposes); dst is where data lands.  Both exist on both ranks: it keeps
        # the code uniform and costs memory only where pages are touched.
        self.src = torch.empty(big, dtype=torch.uint8)
        self.dst = torch.empty(big, dtype=torch.uint8)
        self.ctl_out = torch.zeros(CTL_BYTES, dtype=torch.uint8)
        self.ctl_in = torch.zeros(CTL_BYTES, dtype=torch.uint8)
        self.mr = {name: self.ep.reg_tensor(getattr(self, name))
                   for name in ("src", "dst", "ctl_out", "ctl_in")}
        self.fifos = None  # fifo items of the server's window, for --write-ipc/--read-ipc

    def close(self):
        self.ep.close()

    # -- primitives: one message of `size` bytes, split into num_iovs --------
    def _iovs(self, name, size, n):
        base = getattr(self, name).data_ptr()
        lens = [size // n + (1 if i < size % n else 0) for i in range(n)]
        ptrs = [base + sum(lens[:i]) for i in range(n)]
        return [self.mr[name]] * n, ptrs, lens

    def blocking(self, op, conn, name, size, n=1):
        """The upstream blocking calls: send/recv/write/read, or their v-forms."""
        mrs, ptrs, lens = self._iovs(name, size, n)
        ep = self.ep
        if n == 1:
            if op == "send":
                ep.send(conn, mrs[0], ptrs[0], lens[0])
            elif op == "recv":
                ep.recv(conn, mrs[0], ptrs[0], lens[0])
            elif op == "write":
                ep.write(conn, mrs[0], ptrs[0], lens[0], self.fifos[0])
            else:
                ep.read(conn, mrs[0], ptrs[0], lens[0], self.fifos[0])
        elif op == "send":
            ep.sendv(conn, mrs, ptrs, lens, n)
        elif op == "recv":
            ep.recvv(conn, mrs, ptrs, lens, n)
        elif op == "write":
            ep.writev(conn, mrs, ptrs, lens, self.fifos, n)
        else:
            ep.readv(conn, mrs, ptrs, lens, self.fifos, n)

    def post(self, op, conn, name, size, n=1):
        """The async calls; returns the transfer ids (one per iov)."""
        post = {"send": self.ep.send_async, "recv": self.ep.recv_async,
                "write": self.ep.write_async, "read": self.ep.read_async}[op]
        ids = []
        for i, (mr, ptr, ln) in enumerate(zip(*self._iovs(name, size, n))):
            extra = (self.fifos[i],) if op in ("write", "read") else ()
            ids.append(post(conn, mr, ptr, ln, *extra)[1])
        return ids

    def wait(self, ids):
        deadline = time.monotonic() + self.args.timeout
        for tid in ids:
            while not self.ep.poll_async(tid)[1]:
                # Two ranks, each with a Python thread and engine workers, share
                # two cores here: a hot spin would starve the engine doing the copy.
                os.sched_yield()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.rank}: transfer {tid} not done after "
                                       f"{self.args.timeout} s")
            self.ep.release(tid)

    def xfer(self, op, conn, name, size):
        """One message the way the flags ask: blocking or async + poll."""
        n = self.args.num_iovs
        if self.args.async_api:
            self.wait(self.post(op, conn, name, size, n))
        else:
            self.blocking(op, conn, name, size, n)

    def ctl_send(self):
        self.blocking("send", self.bwd, "ctl_out", CTL_BYTES)

    def ctl_recv(self):
        self.blocking("recv", self.bwd, "ctl_in", CTL_BYTES)

    # -- one timed batch of `count` messages; returns seconds on rank 0 ------
    def batch(self, size, count):
        # Timing runs on rank 0 from the server's "ready" until the server's
        # "ack" that all `count` messages arrived, both 8-byte messages on bwd.
        # We use these rather than a Gloo barrier because a Gloo barrier costs
        # ~100s of us, which would swamp small sizes; the ready also means the
        # server is already inside its receive loop when the clock starts.
        a = self.args
        if a.dual:
            return self._batch_dual(size, count)
        if a.op in ("write", "read"):
            # One-sided: the server is passive, and the client's completion
            # already means the target finished (it reports OPDONE only after
            # the bytes are in place), so no ready/ack is needed.
            if self.rank == 1:
                return None
            t0 = time.perf_counter()
            if a.async_api:  # all in flight at once: that is what the async API is for
                ids = []
                for _ in range(count):
                    ids += self.post(a.op, self.fwd, "src" if a.op == "write" else "dst", size, a.num_iovs)
                self.wait(ids)
            else:
                for _ in range(count):
                    self.blocking(a.op, self.fwd, "src" if a.op == "write" else "dst", size, a.num_iovs)
            return time.perf_counter() - t0

        if self.rank == 1:
            if a.async_api:
                ids = []
                for _ in range(count):  # pre-posted before "ready": the receiver is never late
                    ids += self.post("recv", self.fwd, "dst", size, a.num_iovs)
                self.ctl_send()
                self.wait(ids)
            else:
                self.ctl_send()
                for _ in range(count):
                    self.blocking("recv", self.fwd, "dst", size, a.num_iovs)
            self.ctl_send()
            return None
        self.ctl_recv()
        t0 = time.perf_counter()
        if a.async_api:
            ids = []
            for _ in range(count):
                ids += self.post("send", self.fwd, "src", size, a.num_iovs)
            self.wait(ids)
        else:
            for _ in range(count):
                self.blocking("send", self.fwd, "src", size, a.num_iovs)
        self.ctl_recv()
        return time.perf_counter() - t0

    def _batch_dual(self, size, count):
        # Each rank sends `count` messages on its outgoing connection and
        # receives `count` on its incoming one, all posted at once.  bwd also
        # carries ready and ack, and matching is in posting order, so rank 0
        # posts its receives in exactly the order rank 1 sends: ready, data, ack.
        n = self.args.num_iovs
        if self.rank == 1:
            rx = []
            for _ in range(count):
                rx += self.post("recv", self.fwd, "dst", size, n)
            tx = self.post("send", self.bwd, "ctl_out", CTL_BYTES)
            for _ in range(count):
                tx += self.post("send", self.bwd, "src", size, n)
            self.wait(rx)
            tx += self.post("send", self.bwd, "ctl_out", CTL_BYTES)  # ack: all of rank 0's data is here
            self.wait(tx)
            return None
        ready = self.post("recv", self.bwd, "ctl_in", CTL_BYTES)
        rx = []
        for _ in range(count):
            rx += self.post("recv", self.bwd, "dst", size, n)
        rx += self.post("recv", self.bwd, "ctl_in", CTL_BYTES)
        self.wait(ready)
        t0 = time.perf_counter()
        tx = []
        for _ in range(count):
            tx += self.post("send", self.fwd, "src", size, n)
        self.wait(tx + rx)
        return time.perf_counter() - t0

    # -- ping-pong ------------------------------------------------------------
    def pingpong(self, size, count):
        """Per-round-trip times in seconds (rank 0); ping on fwd, pong on bwd."""
        times = []
        if not self.args.async_api and self.args.num_iovs == 1:
            # Plain blocking calls: resolve the arguments once, so the timed
            # loop is the public API calls themselves, as in ucx_perftest.
            send, recv = self.ep.send, self.ep.recv
            s = (self.mr["src"], self.src.data_ptr(), size)
            d = (self.mr["dst"], self.dst.data_ptr(), size)
            first, second = ((send, self.fwd, s), (recv, self.bwd, d)) if self.rank == 0 \
                else ((recv, self.fwd, d), (send, self.bwd, s))
            for _ in range(count):
                t0 = time.perf_counter()
                first[0](first[1], *first[2])
                second[0](second[1], *second[2])
                times.append(time.perf_counter() - t0)
            return times
        for _ in range(count):
            t0 = time.perf_counter()
            if self.rank == 0:
                self.xfer("send", self.fwd, "src", size)
                self.xfer("recv", self.bwd, "dst", size)
            else:
                self.xfer("recv", self.fwd, "dst", size)
                self.xfer("send", self.bwd, "src", size)
            times.append(time.perf_counter() - t0)
        return times

    # -- per-size setup and the integrity check -------------------------------
    def advertise(self, size):
        """--write-ipc/--read-ipc: the server exposes its buffer; the client gets the fifo items."""
        box = [None]
        if self.rank == 1:
            # A write lands in dst; a read takes the server's src (its random bytes).
            name = "dst" if self.args.op == "write" else "src"
            mrs, ptrs, lens = self._iovs(name, size, self.args.num_iovs)
            box[0] = self.ep.advertisev(self.fwd, mrs, ptrs, lens, len(mrs))[1]
        dist.broadcast_object_list(box, src=1)
        self.fifos = box[0]

    def data_senders(self):
        """Ranks whose src feeds the peer's dst in this mode."""
        if self.args.dual:
            return (0, 1)
        return (1,) if self.args.op == "read" else (0,)

    def verify(self, size):
        """Move `size` random bytes once and compare CRC32s; abort everywhere on a mismatch."""
        sending = self.rank in self.data_senders()
        receiving = self.peer in self.data_senders()
        mine = None
        if sending:
            rng = np.random.default_rng()
            src = self.src.numpy()[:size]
            src[:] = np.frombuffer(rng.bytes(size), dtype=np.uint8)
            mine = (zlib.crc32(memoryview(src)), bytes(src[:8]), bytes(src[-8:]))
        if receiving:
            self.dst.numpy()[:size] = 0  # no stale bytes from an earlier size can pass
        sums = [None, None]
        dist.all_gather_object(sums, mine)
        if self.args.latency:
            if self.rank == 0:
                self.xfer("send", self.fwd, "src", size)
            else:
                self.xfer("recv", self.fwd, "dst", size)
        else:
            self.batch(size, 1)
        # A one-sided write's target learns nothing itself: it may only look
        # once the client's write has completed.  Untimed, so Gloo is fine.
        dist.barrier()
        problem = None
        if receiving:
            dst = self.dst.numpy()[:size]
            got = (zlib.crc32(memoryview(dst)), bytes(dst[:8]), bytes(dst[-8:]))
            want = sums[self.peer]
            if got != want:
                problem = (f"rank {self.rank} received {pretty(size)} from rank {self.peer} "
                           f"({self.transport}, {self.describe()}): crc32 {got[0]:#010x} != sent "
                           f"{want[0]:#010x}; first bytes {got[1].hex()} vs {want[1].hex()}, "
                           f"last {got[2].hex()} vs {want[2].hex()}")
        problems = [None, None]
        dist.all_gather_object(problems, problem)
        bad = [p for p in problems if p]
        if bad:
            raise RuntimeError("data integrity check failed, no number reported: " + "; ".join(bad))

    def describe(self):
        a = self.args
        # --dual always posts asynchronously, whatever --async-api says.
        parts = ["dual" if a.dual else a.op, "async" if a.async_api or a.dual else "blocking"]
        if a.num_iovs > 1:
            parts.append(f"{a.num_iovs} iovs")
        return ", ".join(parts)


# -------------------------------------------------------------------- gloo --
def _gloo_moves(peer, src, dst, count, dual, sender):
    """count messages to peer (or from it); with dual, both directions at once."""
    if dual:
        works = [dist.isend(src, dst=peer) for _ in range(count)]
        works += [dist.irecv(dst, src=peer) for _ in range(count)]
        for w in works:
            w.wait()
    elif sender:
        for _ in range(count):
            dist.send(src, dst=peer)
    else:
        for _ in range(count):
            dist.recv(dst, src=peer)


def gloo_batch(rank, src, dst, count, dual):
    """Gloo dist.send/recv timed like Bench.batch (ready/ack over Gloo itself)."""
    ctl = torch.zeros(1, dtype=torch.int64)
    peer = 1 - rank
    if rank == 1:
        dist.send(ctl, dst=peer)
        _gloo_moves(peer, src, dst, count, dual, sender=False)
        dist.send(ctl, dst=peer)
        return None
    dist.recv(ctl, src=peer)
    t0 = time.perf_counter()
    _gloo_moves(peer, src, dst, count, dual, sender=True)
    dist.recv(ctl, src=peer)
    return time.perf_counter() - t0


# -------------------------------------------------------------------- main --
def main():
    args = get_args()
    # Set before the engine reads them (at Endpoint creation); this machine's
    # tests use loopback only, so lo unless the caller chose an interface.
    os.environ.setdefault("UCCL_SOCKET_IFNAME", "lo")
    os.environ["UCCL_P2P_TRANSPORT"] = args.transport
    os.environ["UCCL_P2P_SHM_MODE"] = args.shm_mode
    from uccl_collective import p2p

    # The two ranks share the host's cores with the engine's threads; extra
    # torch intra-op threads would only steal from them.
    torch.set_num_threads(1)
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    if dist.get_world_size() != 2:
        raise SystemExit("benchmark_uccl.py needs exactly 2 processes (torchrun --nproc_per_node 2)")
    rank = dist.get_rank()
    b = Bench(args, rank, p2p)
    lead = rank == 0

    def say(msg):
        if lead:
            tqdm.write(msg, file=sys.stdout)
            sys.stdout.flush()

    what = "latency (ping-pong)" if args.latency else "bandwidth"
    say(f"[Client] uccl p2p {what}: transport {b.transport} (fwd) / {b.ep.conn_transport(b.bwd)} (bwd), "
        f"{b.describe()}, iters {args.iters}, warmup {args.warmup}, torch {torch.__version__}"
        + (", --pinned ignored on CPU" if args.pinned else ""))

    rows = []
    sizes = tqdm(args.sizes, desc="sizes", unit="size", leave=False,
                 disable=not lead or not sys.stderr.isatty())
    for size in sizes:
        if args.op in ("write", "read"):
            b.advertise(size)
        dist.barrier()
        b.verify(size)
        row = {"size": size, "size_str": pretty(size), "transport": b.transport,
               "mode": b.describe(), "iters": args.iters, "warmup": args.warmup}
        src, dst = b.src[:size], b.dst[:size]

        if args.latency:
            b.pingpong(size, args.warmup)
            dist.barrier()  # untimed: the per-round-trip clocks below do the timing
            rtts = b.pingpong(size, args.iters)
            us, p50 = sum(rtts) / len(rtts) / 2 * 1e6, statistics.median(rtts) / 2 * 1e6
            row.update(uccl_us=us, uccl_p50_us=p50)
            say(f"[Client] {pretty(size):>9} : one-way {us:8.2f} us | p50 {p50:8.2f} us")
            if args.compare == "gloo":
                gloo_pingpong(rank, src, dst, args.warmup)
                dist.barrier()
                g = gloo_pingpong(rank, src, dst, args.iters)
                gus, gp50 = sum(g) / len(g) / 2 * 1e6, statistics.median(g) / 2 * 1e6
                # The ratio uses medians: on this kind of VM a few scheduling
                # hiccups of a millisecond move the means by 2-10x.
                row.update(gloo_us=gus, gloo_p50_us=gp50, ratio=gp50 / p50)
                say(f"  gloo {gus:8.2f} us | p50 {gp50:8.2f} us  ratio {gp50 / p50:5.2f}x (p50)")
        else:
            if args.warmup:
                b.batch(size, args.warmup)
            dist.barrier()
            dt = b.batch(size, args.iters)
            if lead:
                gbs = size * args.iters / dt / 1e9  # each direction, with --dual
                row.update(uccl_seconds=dt, uccl_GBps=gbs, uccl_gbps=gbs * 8)
                say(f"[Client] {pretty(size):>9} : {gbs * 8:6.2f} Gbps | {gbs:6.2f} GB/s")
            if args.compare == "gloo":
                dist.barrier()
                if args.warmup:
                    gloo_batch(rank, src, dst, args.warmup, args.dual)
                gdt = gloo_batch(rank, src, dst, args.iters, args.dual)
                if lead:
                    ggbs = size * args.iters / gdt / 1e9
                    row.update(gloo_seconds=gdt, gloo_GBps=ggbs, ratio=gbs / ggbs)
                    say(f"  gloo {ggbs:6.2f} GB/s  ratio {gbs / ggbs:5.2f}x")
        rows.append(row)
        dist.barrier()  # phases of consecutive sizes never overlap

    if lead:
        write_results(rows, args)
    dist.barrier()  # the peer must not close its endpoint while a transfer is pending here
    b.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
