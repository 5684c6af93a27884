#!/usr/bin/env python3
"""Point-to-point benchmark of uccl_collective.p2p.Endpoint, with upstream's flags.

Launch with torchrun, two processes:

    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/benchmark_uccl.py \
        --sizes 64K,1M,16M,256M --iters 10 [--transport shm|tcp] [--latency]

Rank 0 is the client (it sends, writes or reads), rank 1 the server (it
receives or advertises its buffer).  torch.distributed with Gloo is used only
to bootstrap (endpoint metadata, fifo items, checksums, barriers between
phases) and for the comparison timed in the same run (--compare):

  gloo        dist.send/dist.recv of the same size, timed the same way (CPU
              memory on both sides; the default there)
  ipc-copy    GPU memory on both sides (the default there): the receiving rank
              maps the sender's CUDA tensor (torch.multiprocessing's CUDA IPC,
              handle passed through Gloo) and times dst.copy_(mapped) with
              CUDA events: what one cross-process copy-engine copy does
  torch-copy  GPU on one side, CPU on the other (the default there): torch's
              own dst.copy_(src) between host and device in one process, with
              the same host memory (pinned with --pinned, else pageable)
  engine-cpu  this engine over the same connections with pageable CPU
              buffers (e.g. GPU memory over TCP against CPU memory over TCP)

GPU memory: --device gpu (both sides), or --sender-device / --receiver-device
for rank 0's / rank 1's buffers; --pinned puts CPU-side buffers in
page-locked memory.  --host-id-per-rank gives each rank its own
UCCL_P2P_HOST_ID, so the two ranks of one machine talk as two hosts (TCP).
On GPU memory the engine follows the stream rules of NCCL (a blocking call
returns with the data in place for the current stream), so a timed region
that ends on a GPU buffer ends with a device synchronize.

Bandwidth is GB/s = 1e9 bytes/s (Gbps = 8x that); with --dual it is per
direction (both run at once, so the two together moved twice as much).
The "ratio" is always "times better than the comparison": uccl/ref for
bandwidth, ref/uccl for latency (medians of the per-round-trip times, which
the VM's hiccups move far less than the means; the ipc-copy/torch-copy
latency is one copy launched and synchronized from the host, per iteration).

Every size is first moved once with random bytes and checked on the receiving
side (CRC32 against the sender's, exchanged over Gloo; GPU buffers are copied
to the host for it); a mismatch aborts both ranks, so a transfer that moves
wrong bytes never gets a number.  When a GPU is involved the destination is
checked again after the timed transfers.
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

COMPARES = ["auto", "gloo", "ipc-copy", "torch-copy", "engine-cpu", "none"]

DEFAULT_SIZES = [1 << k for k in range(10, 29, 2)]  # 1K, 4K, ..., 256M
CTL_BYTES = 8  # ready / ack messages


# --------------------------------------------------------------- arguments --
def get_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # upstream's flags
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                   help="where both ranks' buffers live (see --sender-device/--receiver-device)")
    p.add_argument("--pinned", action="store_true",
                   help="CPU-side buffers in page-locked memory (needs CUDA; ignored without it)")
    p.add_argument("--sizes", type=parse_sizes, default=DEFAULT_SIZES,
                   help="comma list, e.g. 64K,1M,256M (default 1K..256M in powers of 4)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed messages per size (default 20; 1000 round trips with --latency)")
    p.add_argument("--num-iovs", type=int, default=1, help="split each message into N iovs (sendv/recvv)")
    p.add_argument("--async-api", action="store_true", help="*_async + poll_async instead of blocking calls")
    p.add_argument("--dual", action="store_true",
                   help="both directions at once (two connections, async API)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--ipc", action="store_true", help="send/recv through upstream's send_ipc/recv_ipc")
    mode.add_argument("--write-ipc", action="store_true",
                      help="one-sided write_ipc into the server's buffer (advertise_ipc)")
    mode.add_argument("--read-ipc", action="store_true",
                      help="one-sided read_ipc from the server's buffer (advertise_ipc)")
    p.add_argument("--sender-device", choices=["cpu", "gpu"], default=None,
                   help="rank 0's buffers (the client: it sends, writes or reads); default --device")
    p.add_argument("--receiver-device", choices=["cpu", "gpu"], default=None,
                   help="rank 1's buffers (the server: it receives or advertises); default --device")
    # ours
    p.add_argument("--transport", choices=["auto", "tcp", "shm"], default="auto",
                   help="sets UCCL_P2P_TRANSPORT before the endpoint is made")
    p.add_argument("--shm-mode", choices=["auto", "cma", "ring"], default="auto",
                   help="sets UCCL_P2P_SHM_MODE")
    p.add_argument("--compare", choices=COMPARES, default="auto",
                   help="what to time in the same run (module docstring); auto: gloo for CPU "
                        "memory, ipc-copy for GPU to GPU, torch-copy for CPU to/from GPU")
    p.add_argument("--host-id-per-rank", action="store_true",
                   help="UCCL_P2P_HOST_ID=uccl-bench-host-<rank>: the ranks treat each other as "
                        "other hosts (TCP, GPU memory staged through pinned buffers)")
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
    a.op = "write" if a.write_ipc else "read" if a.read_ipc else "send"
    a.ipc_names = a.ipc or a.write_ipc or a.read_ipc   # upstream's *_ipc method names
    # rank -> "gpu" or "cpu": rank 0 is the client, rank 1 the server.
    a.devs = {0: a.sender_device or a.device, 1: a.receiver_device or a.device}
    a.gpu = "gpu" in a.devs.values()
    # Checked before any process group exists, so both ranks stop the same way.
    if (a.gpu or a.compare in ("ipc-copy", "torch-copy")) and not torch.cuda.is_available():
        p.error("GPU buffers or a GPU comparison need CUDA: torch.cuda.is_available() is False")
    if a.pinned and not torch.cuda.is_available():
        a.pinned = False
        a.pinned_note = "--pinned ignored: no CUDA"
    else:
        a.pinned_note = ""
    a.compare = resolve_compare(p, a)
    return a


def data_flow(a) -> tuple[str, str]:
    """(source device, destination device) of the data: a read moves it from
    rank 1 to rank 0, everything else from rank 0 to rank 1."""
    src = 1 if a.op == "read" else 0
    return a.devs[src], a.devs[1 - src]


def resolve_compare(p, a) -> str:
    sdev, ddev = data_flow(a)
    if a.compare == "auto":
        if not a.gpu:
            return "gloo"
        if sdev == ddev == "gpu":
            return "ipc-copy"
        # A --dual run between CPU and GPU moves both ways at once: no one
        # torch copy is its counterpart.
        return "none" if a.dual else "torch-copy"
    if a.compare == "gloo" and a.gpu:
        p.error("--compare gloo needs CPU memory on both sides (Gloo cannot serve CUDA tensors "
                "of two processes on one GPU); use ipc-copy, torch-copy or engine-cpu")
    if a.compare == "ipc-copy" and not sdev == ddev == "gpu":
        p.error("--compare ipc-copy needs GPU memory on both sides")
    if a.compare == "torch-copy" and (sdev == ddev or a.dual):
        p.error("--compare torch-copy needs CPU memory on one side and GPU memory on the other, "
                "one direction (no --dual)")
    return a.compare


# ------------------------------------------------------------------ engine --
class Bench:
    """One rank's endpoint, its two connections and its buffers.

    Connections are one-way, so there are two: fwd (rank 0 -> rank 1) carries
    the data; bwd (rank 1 -> rank 0) carries the server's ready/ack messages,
    the pongs of --latency and the server's half of --dual.
    """

    def __init__(self, args, rank, p2p):
        self.args, self.rank, self.peer = args, rank, 1 - rank
        self.on_gpu = args.devs[rank] == "gpu"
        # Any rank of a GPU-involved run uses the GPU (references, pinned
        # memory): bind it before the endpoint is made.
        gpu_idx = None
        if args.gpu or args.pinned:
            gpu_idx = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
            torch.cuda.set_device(gpu_idx)
        # A per-run secret keeps the endpoints authenticated (no "unauthenticated"
        # warning) without the user having to set UCCL_P2P_SECRET.
        box = [secrets.token_hex(16) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        # port=0: both ranks share one host, so the well-known port would be
        # taken by whichever rank comes first anyway.
        self.ep = p2p.Endpoint(gpu_idx, args.num_cpus, timeout_s=args.timeout, secret=box[0], port=0)
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
        # the code uniform and costs memory only where pages are touched
        # (CPU; on a GPU both are allocated outright).
        self.src = self._buffer(big, self.on_gpu)
        self.dst = self._buffer(big, self.on_gpu)
        self.ctl_out = torch.zeros(CTL_BYTES, dtype=torch.uint8)
        self.ctl_in = torch.zeros(CTL_BYTES, dtype=torch.uint8)
        names = ["src", "dst", "ctl_out", "ctl_in"]
        if args.compare == "engine-cpu":
            # The same engine and connections on pageable CPU memory.
            self.csrc = torch.empty(big, dtype=torch.uint8)
            self.cdst = torch.empty(big, dtype=torch.uint8)
            names += ["csrc", "cdst"]
        self.mr = {name: self.ep.reg_tensor(getattr(self, name)) for name in names}
        # "src"/"dst" name the buffers the data moves between; the engine-cpu
        # comparison points them at csrc/cdst for its timing.
        self.alias = {"src": "src", "dst": "dst"}
        self.fifos = None  # fifo items of the server's window, for --write-ipc/--read-ipc

    def _buffer(self, n, on_gpu):
        if on_gpu:
            return torch.empty(n, dtype=torch.uint8, device="cuda")
        return torch.empty(n, dtype=torch.uint8, pin_memory=self.args.pinned)

    def buf(self, name):
        return getattr(self, self.alias.get(name, name))

    def gpu_sync(self):
        """Wait for this process's GPU work: a blocking call on GPU memory
        returns with the data in place for the current stream only, and a
        timed region (or an "it's here" message to the peer) must cover the
        copies themselves."""
        if self.args.gpu:
            torch.cuda.synchronize()

    def close(self):
        self.ep.close()

    # -- primitives: one message of `size` bytes, split into num_iovs --------
    def _iovs(self, name, size, n):
        name = self.alias.get(name, name)
        base = getattr(self, name).data_ptr()
        lens = [size // n + (1 if i < size % n else 0) for i in range(n)]
        ptrs = [base + sum(lens[:i]) for i in range(n)]
        return [self.mr[name]] * n, ptrs, lens

    def blocking(self, op, conn, name, size, n=1):
        """The upstream blocking calls: send/recv/write/read, or their v-forms."""
        mrs, ptrs, lens = self._iovs(name, size, n)
        ep = self.ep
        if n == 1:
            # --ipc/--write-ipc/--read-ipc: upstream's same-host names (the
            # same paths; the control messages on bwd keep the plain names).
            ipc = "_ipc" if self.args.ipc_names and conn == self.fwd else ""
            if op in ("send", "recv"):
                getattr(ep, op + ipc)(conn, mrs[0], ptrs[0], lens[0])
            else:
                getattr(ep, op + ipc)(conn, mrs[0], ptrs[0], lens[0], self.fifos[0])
        elif op == "send":
            ep.sendv(conn, mrs, ptrs, lens, n)
        elif op == "recv":
            ep.recvv(conn, mrs, ptrs, lens, n)
        elif op == "write":
            (ep.writev_ipc if self.args.ipc_names else ep.writev)(conn, mrs, ptrs, lens, self.fifos, n)
        else:
            (ep.readv_ipc if self.args.ipc_names else ep.readv)(conn, mrs, ptrs, lens, self.fifos, n)

    def post(self, op, conn, name, size, n=1):
        """The async calls; returns the transfer ids (one per iov)."""
        ipc = "_ipc" if self.args.ipc_names and conn == self.fwd else ""
        post = getattr(self.ep, f"{op}{ipc}_async")
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
            self.gpu_sync()
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
            self.gpu_sync()  # the ack says the bytes are in place, not just queued
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
            self.gpu_sync()
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
        self.gpu_sync()
        return time.perf_counter() - t0

    # -- ping-pong ------------------------------------------------------------
    def pingpong(self, size, count):
        """Per-round-trip times in seconds (rank 0); ping on fwd, pong on bwd.
        A receive into GPU memory is followed by a synchronize of the current
        stream: the data must be there, not only queued, before the pong goes
        or the clock stops (nothing to wait for on CPU memory)."""
        times = []
        settle = torch.cuda.current_stream().synchronize if self.buf("dst").is_cuda else None
        if not self.args.async_api and self.args.num_iovs == 1:
            # Plain blocking calls: resolve the arguments once, so the timed
            # loop is the public API calls themselves, as in ucx_perftest.
            ipc = "_ipc" if self.args.ipc_names else ""
            send, recv = getattr(self.ep, "send" + ipc), getattr(self.ep, "recv" + ipc)
            src, dst = self.alias["src"], self.alias["dst"]
            s = (self.mr[src], self.buf("src").data_ptr(), size)
            d = (self.mr[dst], self.buf("dst").data_ptr(), size)
            first, second = ((send, self.fwd, s), (recv, self.bwd, d)) if self.rank == 0 \
                else ((recv, self.fwd, d), (send, self.bwd, s))
            for _ in range(count):
                t0 = time.perf_counter()
                first[0](first[1], *first[2])
                if settle and self.rank == 1:
                    settle()
                second[0](second[1], *second[2])
                if settle and self.rank == 0:
                    settle()
                times.append(time.perf_counter() - t0)
            return times
        for _ in range(count):
            t0 = time.perf_counter()
            if self.rank == 0:
                self.xfer("send", self.fwd, "src", size)
                self.xfer("recv", self.bwd, "dst", size)
            else:
                self.xfer("recv", self.fwd, "dst", size)
                if settle:
                    settle()
                self.xfer("send", self.bwd, "src", size)
            if settle and self.rank == 0:
                settle()
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
            adv = self.ep.advertisev_ipc if self.args.ipc_names else self.ep.advertisev
            box[0] = adv(self.fwd, mrs, ptrs, lens, len(mrs))[1]
        dist.broadcast_object_list(box, src=1)
        self.fifos = box[0]

    def data_senders(self):
        """Ranks whose src feeds the peer's dst in this mode."""
        if self.args.dual:
            return (0, 1)
        return (1,) if self.args.op == "read" else (0,)

    @staticmethod
    def _host(t):
        """A numpy view of a CPU tensor, or a host copy of a GPU one."""
        return t.cpu().numpy() if t.is_cuda else t.numpy()

    @staticmethod
    def _digest(a):
        return (zlib.crc32(memoryview(a)), bytes(a[:8]), bytes(a[-8:]))

    def verify(self, size):
        """Move `size` random bytes once and compare CRC32s; abort everywhere on
        a mismatch.  Returns every rank's digest of what it sent (for check())."""
        sending = self.rank in self.data_senders()
        receiving = self.peer in self.data_senders()
        mine = None
        if sending:
            if self.src.is_cuda:
                self.src[:size].random_(0, 256)
                mine = self._digest(self._host(self.src[:size]))   # .cpu() waits for the fill
            else:
                rng = np.random.default_rng()
                src = self.src.numpy()[:size]
                src[:] = np.frombuffer(rng.bytes(size), dtype=np.uint8)
                mine = self._digest(src)
        if receiving:
            self.dst[:size].zero_()  # no stale bytes from an earlier size can pass
            self.gpu_sync()
        sums = [None, None]
        dist.all_gather_object(sums, mine)
        if self.args.latency:
            if self.rank == 0:
                self.xfer("send", self.fwd, "src", size)
            else:
                self.xfer("recv", self.fwd, "dst", size)
        else:
            self.batch(size, 1)
        self.check(size, sums, "first transfer")
        return sums

    def check(self, size, sums, when):
        """The receiving side's dst must hold what the peer sent (digest from
        verify); abort everywhere otherwise."""
        # A one-sided write's target learns nothing itself: it may only look
        # once the client's writes have completed (its batch returns at once).
        # Untimed, so Gloo is fine.
        self.gpu_sync()
        dist.barrier()
        problem = None
        if self.peer in self.data_senders():
            got = self._digest(self._host(self.dst[:size]))
            want = sums[self.peer]
            if got != want:
                problem = (f"rank {self.rank} received {pretty(size)} from rank {self.peer} "
                           f"({self.transport}, {self.describe()}, {when}): crc32 {got[0]:#010x} "
                           f"!= sent {want[0]:#010x}; first bytes {got[1].hex()} vs "
                           f"{want[1].hex()}, last {got[2].hex()} vs {want[2].hex()}")
        problems = [None, None]
        dist.all_gather_object(problems, problem)
        bad = [p for p in problems if p]
        if bad:
            raise RuntimeError("data integrity check failed, no number reported: " + "; ".join(bad))

    def describe(self):
        a = self.args
        # --dual always posts asynchronously, whatever --async-api says.
        op = "dual" if a.dual else a.op + ("_ipc" if a.ipc_names else "")
        parts = [op, "async" if a.async_api or a.dual else "blocking"]
        if a.num_iovs > 1:
            parts.append(f"{a.num_iovs} iovs")
        if a.gpu or a.pinned:
            cpu = "pinned" if a.pinned else "pageable"
            kinds = {r: "gpu" if d == "gpu" else cpu for r, d in a.devs.items()}
            parts.append(f"rank 0 {kinds[0]}, rank 1 {kinds[1]}")
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


# ----------------------------------------------------- GPU-side references --
def _time_copies(dst, src, count, warmup, latency):
    """`count` dst.copy_(src) on the current stream, after `warmup` untimed
    ones.  Bandwidth: seconds for all of them, between two CUDA events.
    Latency: per-copy seconds, each copy launched and synchronized from the
    host (what a blocking one-way transfer costs at least)."""
    for _ in range(warmup):
        dst.copy_(src)
    torch.cuda.synchronize()
    if latency:
        stream, times = torch.cuda.current_stream(), []
        for _ in range(count):
            t0 = time.perf_counter()
            dst.copy_(src)
            stream.synchronize()
            times.append(time.perf_counter() - t0)
        return times
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def ipc_copy(b, size, count, latency=False):
    """The gpu->gpu reference: every rank that receives data in this mode
    maps its peer's src through CUDA IPC (torch.multiprocessing's
    reduce_tensor, the handle sent over Gloo) and times copies from the
    mapping into its dst; with --dual both directions run at once.  Returns
    rank 0's figure when it copied, else rank 1's (on every rank)."""
    from torch.multiprocessing.reductions import reduce_tensor

    senders = b.data_senders()
    handles = [None, None]
    dist.all_gather_object(handles, reduce_tensor(b.src[:size]) if b.rank in senders else None)
    remote = None
    if b.peer in senders:
        rebuild, rebuild_args = handles[b.peer]
        remote = rebuild(*rebuild_args)
        torch.cuda.synchronize()
    dist.barrier()   # both directions of --dual start together
    res = None
    if remote is not None:
        res = _time_copies(b.dst[:size], remote, count, b.args.warmup, latency)
    out = [None, None]
    dist.all_gather_object(out, res)
    del remote
    torch.cuda.synchronize()
    dist.barrier()   # every mapping is closed before its owner moves on
    return out[0] if out[0] is not None else out[1]


def torch_copy(b, size, count, latency=False):
    """The cpu<->gpu reference: torch's own host<->device dst.copy_(src) in
    rank 0 alone, in the direction the data moves here, with the same host
    memory (pinned with --pinned, else pageable).  Returns the figure on
    every rank."""
    res = None
    if b.rank == 0:
        a = b.args
        if getattr(b, "copy_bufs", None) is None:
            big = max(a.sizes)
            b.copy_bufs = (torch.empty(big, dtype=torch.uint8, pin_memory=a.pinned),
                           torch.empty(big, dtype=torch.uint8, device="cuda"))
        host, dev = (t[:size] for t in b.copy_bufs)
        src, dst = (host, dev) if data_flow(a)[0] == "cpu" else (dev, host)
        res = _time_copies(dst, src, count, a.warmup, latency)
    out = [res]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def engine_cpu(b, size, latency=False):
    """This engine over the same connections, on pageable CPU buffers: the
    same batch (or ping-pong) as the run's own, timed the same way.  Returns
    batch seconds (rank 0) or round-trip times."""
    b.alias = {"src": "csrc", "dst": "cdst"}
    try:
        if b.args.op in ("write", "read"):
            b.advertise(size)
        dist.barrier()
        if latency:
            b.pingpong(size, b.args.warmup)
            dist.barrier()
            return b.pingpong(size, b.args.iters)
        if b.args.warmup:
            b.batch(size, b.args.warmup)
        dist.barrier()
        return b.batch(size, b.args.iters)
    finally:
        b.alias = {"src": "src", "dst": "dst"}


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
    if args.host_id_per_rank:
        # Read by the engine when the endpoint is made: the two ranks then
        # count as two hosts and connect over TCP.
        os.environ["UCCL_P2P_HOST_ID"] = f"uccl-bench-host-{rank}"
    b = Bench(args, rank, p2p)
    lead = rank == 0

    def say(msg):
        if lead:
            tqdm.write(msg, file=sys.stdout)
            sys.stdout.flush()

    what = "latency (ping-pong)" if args.latency else "bandwidth"
    say(f"[Client] uccl p2p {what}: transport {b.transport} (fwd) / {b.ep.conn_transport(b.bwd)} (bwd), "
        f"{b.describe()}, iters {args.iters}, warmup {args.warmup}, compare {args.compare}, "
        f"torch {torch.__version__}" + (f", {args.pinned_note}" if args.pinned_note else ""))

    rows = []
    sizes = tqdm(args.sizes, desc="sizes", unit="size", leave=False,
                 disable=not lead or not sys.stderr.isatty())
    for size in sizes:
        if args.op in ("write", "read"):
            b.advertise(size)
        dist.barrier()
        sums = b.verify(size)
        row = {"size": size, "size_str": pretty(size), "transport": b.transport,
               "mode": b.describe(), "iters": args.iters, "warmup": args.warmup}
        src, dst = b.src[:size], b.dst[:size]
        ref = args.compare if args.compare not in ("gloo", "none") else None

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
            elif ref:
                if ref == "engine-cpu":
                    one_way = [t / 2 for t in engine_cpu(b, size, latency=True)]
                else:
                    dist.barrier()
                    one_way = (ipc_copy if ref == "ipc-copy" else torch_copy)(
                        b, size, args.iters, latency=True)
                rus, rp50 = sum(one_way) / len(one_way) * 1e6, statistics.median(one_way) * 1e6
                row.update(ref=ref, ref_us=rus, ref_p50_us=rp50, ratio=rp50 / p50)
                say(f"  {ref} {rus:8.2f} us | p50 {rp50:8.2f} us  ratio {rp50 / p50:5.2f}x (p50)")
        else:
            if args.warmup:
                b.batch(size, args.warmup)
            dist.barrier()
            dt = b.batch(size, args.iters)
            if lead:
                gbs = size * args.iters / dt / 1e9  # each direction, with --dual
                row.update(uccl_seconds=dt, uccl_GBps=gbs, uccl_gbps=gbs * 8)
                say(f"[Client] {pretty(size):>9} : {gbs * 8:6.2f} Gbps | {gbs:6.2f} GB/s")
            if args.gpu:
                # The timed transfers moved the same bytes again: they must
                # still be what arrived, stream order and all.
                b.check(size, sums, "after the timed transfers")
            if args.compare == "gloo":
                dist.barrier()
                if args.warmup:
                    gloo_batch(rank, src, dst, args.warmup, args.dual)
                gdt = gloo_batch(rank, src, dst, args.iters, args.dual)
                if lead:
                    ggbs = size * args.iters / gdt / 1e9
                    row.update(gloo_seconds=gdt, gloo_GBps=ggbs, ratio=gbs / ggbs)
                    say(f"  gloo {ggbs:6.2f} GB/s  ratio {gbs / ggbs:5.2f}x")
            elif ref:
                dist.barrier()
                if ref == "engine-cpu":
                    rdt = engine_cpu(b, size)
                else:
                    rdt = (ipc_copy if ref == "ipc-copy" else torch_copy)(b, size, args.iters)
                if lead:
                    rgbs = size * args.iters / rdt / 1e9
                    row.update(ref=ref, ref_seconds=rdt, ref_GBps=rgbs, ratio=gbs / rgbs)
                    say(f"  {ref} {rgbs:6.2f} GB/s  ratio {gbs / rgbs:5.2f}x")
        rows.append(row)
        dist.barrier()  # phases of consecutive sizes never overlap

    if lead:
        write_results(rows, args)
    dist.barrier()  # the peer must not close its endpoint while a transfer is pending here
    b.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
