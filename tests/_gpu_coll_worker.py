"""One rank of a scenario of tests/test_gpu_collective.py, run as its own process:

    python -m _gpu_coll_worker SCENARIO RANK WORLD STORE_PORT OUT_JSON PARAMS_JSON

The parent starts WORLD of these with ``subprocess`` (as test_gpu.py starts
_gpu_worker); they meet through a TCPStore the parent hosts (STORE_PORT),
which every process group of the run is built on.  Scenarios:

  ctx      torch.distributed on Gloo (the bootstrap and the reference), one
           CollectiveContext(local_gpu_idx=0, use_copy_engine_for_intra=True): every
           method on CUDA tensors (see ctx_plan).
  backend  init_process_group("uccl") and a Gloo group over the same ranks:
           every dist.* op on CUDA tensors against Gloo on CPU copies, stream
           order, DDP and FSDP2 (see backend_plan).
  kill     CollectiveContexts and "uccl" groups (timeouts 20 s), one per
           step; after a good warm-up one rank dies (SIGKILL or os._exit)
           and the others' next operation on each must raise (kill_plan).

A scenario is a list of cases (name, kind, params) that every rank runs in
the same order.  Each case gives a verdict per rank: None (passed),
"SKIP: why", or what was wrong.  A case does all of its communication
before its checks, and the uccl operation's exception is raised only after
the case's Gloo operation ran, so a failing case leaves the ranks in step
and the run goes on.  The run stops early (every later case "not run") when
a peer posted "abort" in the store, when a case raised after more than
STUCK_S (a timed-out group is spoilt), or when the run's time is almost up.
The verdicts are written to OUT_JSON after every case, so a run that hangs
or crashes still reports the cases it finished.

Data: every input comes from a seed (the run's seed, the case, the rank),
so every rank can compute what every other rank sends; outputs are
poisoned (every byte POISON, plus a GUARD tail that must stay POISON).
Without CUDA (UCCL_GPU_TESTS_DRYRUN=1) the device is the CPU and the cases
that only mean something on a GPU (stream order)
report "SKIP: ...".

This module imports only the standard library (and _gpu_worker, which does
too) at import time: the parent imports it for the case lists.
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback
import zlib

import _gpu_worker as W   # Rank (store, device), Aborted, fmt: stdlib-only at import

MiB = W.MiB
POISON = W.POISON          # outputs are filled with this before every operation
STALE = W.STALE            # stream cases: what a buffer holds before the late producer kernel
GUARD = 256                # poisoned bytes after every output that must stay POISON
DTYPES = ("float32", "bfloat16", "float16", "int64", "uint8")
FLOATS = ("float32", "bfloat16", "float16")
EXACT_INT = {"float32": 1 << 24, "bfloat16": 1 << 8, "float16": 1 << 11}   # every integer to here
ESZ = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "uint8": 1}
SIZES = (0, 1, 4097)                 # elements
BIG = (2 * MiB, 64 * MiB)            # bytes of the "MiB" cases
DRY_BIG = (2 * MiB, 4 * MiB)         # the same cases in a dry run on a small CPU machine
ALGOS = ("direct", "ring", "auto")
AR_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
STREAM_N = MiB + 3                   # float32 elements of the stream-order cases (4 MiB)
PG_TIMEOUT_S = 30.0       # the uccl group and the CollectiveContext of the data scenarios
GLOO_TIMEOUT_S = 90.0     # longer: a Gloo op after a uccl op that timed out still meets its peers
KILL_TIMEOUT_S = 20.0     # the kill scenario's groups and contexts
KILL_BOUND_S = 40.0       # ... within which the survivors' operations must raise
STUCK_S = 20.0            # a case that raised after this long stops the run
SLEEP_CYCLES = W.SLEEP_CYCLES        # torch.cuda._sleep: ~0.1 s on an H100
NONBLOCK_SLEEP_S = 1.5    # the GPU spin queued before the operation whose wait() is timed
DDP_STEPS, FSDP_STEPS = 20, 5
#: kinds that need a GPU: skipped (with the reason) on CPU
GPU_ONLY = ("stream_ag", "stream_p2p", "stream_pg", "nonblocking_wait", "kill_stream")


# ---------------------------------------------------------------------------
# plans: (name, kind, params), the same in the parent and in every rank
def _adder(cases: list):
    def add(name: str, kind: str, /, **p) -> None:
        cases.append((name, kind, p))
    return add


def _big_name(nbytes: int, odd: int) -> str:
    return W.fmt(nbytes) + (f"+{odd}" if odd else "")


def _big_n(nbytes: int, dt: str, odd: int) -> int:
    return nbytes // ESZ[dt] + odd


PAT_NAME = {"star": "send-recv", "ring": "send-recv-ring", "pairs": "isend-irecv",
            "sendrecv": "sendrecv", "batch": "batch"}


def ctx_plan(ws: int, big) -> list:
    """CollectiveContext on CUDA tensors."""
    b1, b2 = big
    cases: list = []
    add = _adder(cases)
    add("setup", "setup")
    for algo in ALGOS:
        for dt in DTYPES:
            for n in SIZES:
                add(f"ag-{algo}-{dt}-{n}", "ag", api="allgather", algo=algo, dt=dt, n=n,
                    form="tensor")
            add(f"ag-{algo}-{dt}-4097-list", "ag", api="allgather", algo=algo, dt=dt, n=4097,
                form="list")
        add(f"iag-{algo}-int64-4097", "ag", api="iallgather", algo=algo, dt="int64", n=4097,
            form="tensor")
        add(f"iag-{algo}-float16-4097-list", "ag", api="iallgather", algo=algo, dt="float16",
            n=4097, form="list")
        for lens in ("zero", "mixed"):
            for dt in DTYPES:
                add(f"agv-{algo}-{dt}-{lens}", "agv", api="allgatherv", algo=algo, dt=dt,
                    lens=lens)
            add(f"iagv-{algo}-bfloat16-{lens}", "agv", api="iallgatherv", algo=algo,
                dt="bfloat16", lens=lens)
    for dt in DTYPES:
        for n in SIZES:
            for pat in ("star", "pairs", "sendrecv"):
                add(f"{PAT_NAME[pat]}-{dt}-{n}", "p2p", pat=pat, dt=dt, n=n)
        for style in ("str", "fn"):
            add(f"batch-{style}-{dt}-4097", "p2p", pat="batch", style=style, dt=dt, n=4097)
    add("register-deregister", "register")
    # MiB sizes
    add(f"ag-auto-uint8-{_big_name(b2, 0)}", "ag", api="allgather", algo="auto", dt="uint8",
        n=b2, form="tensor")
    add(f"ag-direct-float32-{_big_name(b1, 0)}", "ag", api="allgather", algo="direct",
        dt="float32", n=_big_n(b1, "float32", 0), form="tensor")   # aligned: one launch
    add(f"ag-ring-float32-{_big_name(b1, 3)}-list", "ag", api="allgather", algo="ring",
        dt="float32", n=_big_n(b1, "float32", 3), form="list")
    add(f"iag-direct-bfloat16-{_big_name(b1, 1)}", "ag", api="iallgather", algo="direct",
        dt="bfloat16", n=_big_n(b1, "bfloat16", 1), form="tensor")
    add(f"agv-ring-uint8-about-{W.fmt(b1)}-one-empty", "agv", api="allgatherv", algo="ring",
        dt="uint8", lens="big", big=b1)
    add(f"send-recv-uint8-{_big_name(b2, 1)}", "p2p", pat="star", dt="uint8", n=b2 + 1)
    add(f"sendrecv-float32-{_big_name(b1, 3)}", "p2p", pat="sendrecv", dt="float32",
        n=_big_n(b1, "float32", 3))
    # stream order (GPU only)
    for algo in ("direct", "ring"):
        add(f"stream-ag-{algo}", "stream_ag", api="allgather", algo=algo, side=False)
    add("stream-iag-auto-wait", "stream_ag", api="iallgather", algo="auto", side=False)
    add("stream-ag-ring-side-stream", "stream_ag", api="allgather", algo="ring", side=True)
    for pat in ("ring", "pairs", "sendrecv", "batch"):
        add(f"stream-{PAT_NAME[pat]}", "stream_p2p", pat=pat, side=False)
    add("stream-send-recv-ring-side-stream", "stream_p2p", pat="ring", side=True)
    add("end", "end")
    return cases


def _ar_kinds(op: str, dt: str) -> tuple:
    """'int': floats holding small integers (a sum or product is exact in any
    order); 'pos': random floats in [0.5, 1.5) (order matters from 3 ranks
    on); 'normal': random floats for MIN/MAX; 'bytes': random integers."""
    if dt not in FLOATS:
        return ("bytes",)
    if op in ("MIN", "MAX"):
        return ("normal",)
    return ("int", "pos") if op == "SUM" else ("int",)


def backend_plan(ws: int, big) -> list:
    """The "uccl" process group on CUDA tensors against Gloo on CPU copies."""
    b1, b2 = big
    cases: list = []
    add = _adder(cases)
    add("setup", "setup")
    for dt in DTYPES:
        for op in AR_OPS:
            for kind in _ar_kinds(op, dt):
                for n in SIZES:
                    add(f"ar-{op}-{dt}-{kind}-{n}", "ar", op=op, dt=dt, kind=kind, n=n)
    for dt in DTYPES:
        for op in ("SUM", "MAX", "AVG"):
            for n in SIZES:
                add(f"reduce-{op}-{dt}-{n}", "reduce", op=op, dt=dt, kind=_ar_kinds(op, dt)[0],
                    n=n)
    for form in ("list", "tensor"):
        for dt in DTYPES:
            for op in ("SUM", "AVG", "MIN", "PRODUCT"):
                for n in SIZES:
                    add(f"rs-{form}-{op}-{dt}-{n}", "rs", form=form, op=op, dt=dt,
                        kind=_ar_kinds(op, dt)[0], n=n)
    for dt in DTYPES:
        for n in SIZES:
            add(f"ag-list-{dt}-{n}", "ag", dt=dt, n=n)
            add(f"agit-{dt}-{n}", "agit", dt=dt, n=n)
            add(f"bcast-{dt}-{n}", "bcast", dt=dt, n=n)
            add(f"a2a-list-{dt}-{n}", "a2a", dt=dt, n=n, sizes="eq")
            add(f"a2as-{dt}-{n}", "a2as", dt=dt, n=n, sizes="eq")
            add(f"gather-{dt}-{n}", "gather", dt=dt, n=n)
            add(f"scatter-{dt}-{n}", "scatter", dt=dt, n=n)
            for pat in ("ring", "pairs", "batch"):
                add(f"{PAT_NAME[pat]}-{dt}-{n}", "p2p", pat=pat, dt=dt, n=n)
        add(f"a2a-list-uneven-{dt}", "a2a", dt=dt, n=0, sizes="uneven")
        add(f"a2as-splits-{dt}", "a2as", dt=dt, n=0, sizes="uneven")
    # MiB sizes
    for op, dt, kind, odd, nb in (("SUM", "float32", "int", 3, b1),
                                  ("SUM", "float32", "pos", 3, b1),
                                  ("AVG", "bfloat16", "int", 1, b1),
                                  ("MAX", "float16", "normal", 1, b1),
                                  ("SUM", "float32", "int", 1, b2)):
        add(f"ar-{op}-{dt}-{kind}-{_big_name(nb, odd)}", "ar", op=op, dt=dt, kind=kind,
            n=_big_n(nb, dt, odd))
    add(f"reduce-SUM-int64-{_big_name(b1, 3)}", "reduce", op="SUM", dt="int64", kind="bytes",
        n=_big_n(b1, "int64", 3))
    # in place and not 16-byte aligned on rank 0 only: that rank's one-launch
    # round takes the steps, its peers' the launch (the words must agree)
    add("ar-SUM-float32-int-1000-unaligned-on-rank-0", "ar", op="SUM", dt="float32", kind="int",
        n=1000, skew=True)
    add(f"rs-tensor-SUM-float32-in-{_big_name(b2, 0)}", "rs", form="tensor", op="SUM",
        dt="float32", kind="int", n=_big_n(b2, "float32", 0) // ws + 1)
    add(f"agit-uint8-{_big_name(b2, 1)}", "agit", dt="uint8", n=b2 + 1)
    # aligned, above UCCL_SG_FUSED_BYTES and below UCCL_SG_GATHER_LAUNCH_BYTES:
    # where the peers share this GPU, one launch, in place and not; then on a
    # group whose rank 0 has the launch off (its three steps beside the
    # peers' launch: the words must agree)
    for how in ("", "-in-place", "-in-place-launch-off-on-rank-0"):
        add(f"agit{how}-float32-{_big_name(b1, 0)}", "agit", dt="float32",
            n=_big_n(b1, "float32", 0), inplace=bool(how), mixed="off" in how)
    add(f"bcast-uint8-{_big_name(b2, 1)}", "bcast", dt="uint8", n=b2 + 1)
    add(f"ag-list-bfloat16-{_big_name(b1, 1)}", "ag", dt="bfloat16", n=_big_n(b1, "bfloat16", 1))
    add(f"a2as-float32-{_big_name(b1, 0)}-per-rank", "a2as", dt="float32",
        n=_big_n(b1, "float32", 0) // ws, sizes="eq")
    add(f"send-recv-ring-uint8-{_big_name(b1, 1)}", "p2p", pat="ring", dt="uint8", n=b1 + 1)
    # async works, barrier, objects
    add("async-wait-then-read", "async", futures_first=False)
    add("async-future-wait", "async", futures_first=True)
    add("barrier-waits-for-late-rank", "barrier")
    add("all_gather_object", "obj", api="all_gather_object")
    add("broadcast_object_list", "obj", api="broadcast_object_list")
    # stream order (GPU only)
    for op in ("ar", "agit"):
        for mode in ("blocking", "async", "async-side-stream", "blocking-side-stream"):
            add(f"stream-{op}-{mode}", "stream_pg", op=op, mode=mode)
    for op in ("ar", "agit", "rs", "p2p"):
        for mode in ("async", "blocking"):
            add(f"{op}-{mode}-wait-does-not-block-host", "nonblocking_wait", op=op, mode=mode)
    # training (last: they can spoil a group)
    add(f"ddp-{DDP_STEPS}-steps-vs-gloo", "ddp")
    add(f"fsdp2-{FSDP_STEPS}-steps-vs-local", "fsdp")
    add("end", "end")
    return cases


KILL_STEPS = ("killed-ctx-allgather-then-next-raises", "killed-ctx-recv-raises",
              "killed-async-all_reduce-future-then-next-raises", "killed-irecv-future-raises",
              "killed-all_reduce-then-barrier-raises")


def kill_plan(ws: int, big) -> list:
    cases = [("setup", "kill_setup", {})]
    cases += [(name, "kill_op", {"step": name}) for name in KILL_STEPS]
    cases.append(("cuda-stream-released-after-failures", "kill_stream", {}))
    return cases


PLANS = {"ctx": ctx_plan, "backend": backend_plan, "kill": kill_plan}


def plan(scenario: str, ws: int, params: dict) -> list:
    return PLANS[scenario](ws, tuple(params.get("big", BIG)))


def case_names(scenario: str, ws: int, params: dict) -> list[str]:
    return [c[0] for c in plan(scenario, ws, params)]


# ---------------------------------------------------------------------------
# the rank's view
class X:
    """What a case needs: torch, the ranks, the device, the Gloo reference
    group (None: the default group, which is Gloo in the ctx scenario), the
    CollectiveContext, and the two point-to-point APIs a p2p case compares."""

    def __init__(self, R, gloo=None, ctx=None):
        import torch
        import torch.distributed as dist
        self.R, self.torch, self.dist = R, torch, dist
        self.me, self.ws = R.rank, R.world
        self.left, self.right = (self.me - 1) % self.ws, (self.me + 1) % self.ws
        self.cuda, self.dev = R.cuda, R.dev
        self.gloo, self.ctx = gloo, ctx
        self.p2p_u = self.p2p_g = None
        self.kill_ctxs: dict = {}      # the kill scenario: step -> its context / uccl group
        self.kill_groups: dict = {}

    def sync(self) -> None:
        self.R.sync()

    def align(self) -> None:
        """Line the ranks up (to a few ms) through Gloo."""
        self.dist.barrier(group=self.gloo)


def sd(x: X, i: int, *parts) -> int:
    """A seed every rank computes alike (str hashes differ between processes)."""
    return (x.R.seed * 1_000_003 + zlib.crc32(repr((i,) + parts).encode())) % (1 << 62)


def dtype(name: str):
    import torch
    return getattr(torch, name)


def vals(x: X, seed: int, n: int, dt: str, kind: str = "bytes", dev=None):
    """n elements of dt on the device (dev: another one), reproducible from
    seed: 'bytes' random bytes (never POISON), see _ar_kinds for the rest."""
    torch = x.torch
    g = torch.Generator(device=x.dev)
    g.manual_seed(seed)
    if kind == "bytes":
        b = torch.randint(0, 256, (n * ESZ[dt],), dtype=torch.uint8, device=x.dev, generator=g)
        b[b == POISON] = 0x5A
        t = b.view(dtype(dt))
    elif kind == "int":
        t = torch.randint(-3, 4, (n,), device=x.dev, generator=g).to(dtype(dt))
    elif kind == "pos":
        t = (torch.rand(n, generator=g, dtype=torch.float64, device=x.dev) + 0.5).to(dtype(dt))
    elif kind == "normal":
        t = (torch.randn(n, generator=g, dtype=torch.float64, device=x.dev) * 100).to(dtype(dt))
    else:
        raise ValueError(kind)
    return t if dev is None or dev == x.dev else t.to(dev)


def poisoned(x: X, n: int, dt: str, dev=None):
    """(tensor of n elements, its backing bytes with a GUARD tail), all POISON."""
    torch = x.torch
    back = torch.full((n * ESZ[dt] + GUARD,), POISON, dtype=torch.uint8, device=dev or x.dev)
    return back[:n * ESZ[dt]].view(dtype(dt)), back


def cpu(t):
    """A CPU copy (never the same storage) for the Gloo reference."""
    return t.detach().to("cpu", copy=True)


def _bytes(t):
    import torch
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def same(got, exp, what: str) -> None:
    """Bitwise equality (devices may differ), with a useful message."""
    assert got.dtype == exp.dtype, f"{what}: dtype {got.dtype} != {exp.dtype}"
    assert got.numel() == exp.numel(), f"{what}: {got.numel()} elements != {exp.numel()}"
    a, b = _bytes(got), _bytes(exp)
    if not bool((a == b).all()):
        bad = (a != b).nonzero().reshape(-1)
        j = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} of {a.numel()} bytes differ (first at byte "
                             f"{j}: got {int(a[j]):#04x} want {int(b[j]):#04x}); "
                             f"{int((a == POISON).sum())} bytes POISON, "
                             f"{int((a == STALE).sum())} STALE")


def guard_ok(back, nbytes: int, what: str) -> None:
    tail = back[nbytes:].cpu()
    assert bool((tail == POISON).all()), f"{what}: bytes written past the end of the buffer"


def exact(dt: str, kind: str, op: str, ws: int) -> bool:
    """Is the reduction independent of its order (bitwise comparable)?
    Integers and small-integer floats always (a product of ws of them while
    it stays within the format's exact integers: 8 ranks' 3**8 is past
    bfloat16's 256 and float16's 2048, and was seen 1 ulp off); MIN/MAX always; two ranks
    always (a+b == b+a, each device rounding once, in IEEE).  Except a
    float AVG over a world size that is not a power of two: CUDA divides a
    tensor by a scalar as a multiplication by its reciprocal, the CPU (the
    Gloo reference) divides, and 1/3 is not exact (seen on the H100: 1 ulp)."""
    if op == "AVG" and dt in FLOATS and ws & (ws - 1):
        return False
    if op == "PRODUCT" and kind == "int" and dt in FLOATS and 3 ** ws > EXACT_INT[dt]:
        return False   # products of ws values in -3..3 past the format's exact integers
    return dt not in FLOATS or kind == "int" or op in ("MIN", "MAX") or ws == 2


def rtol(dt: str, ws: int) -> float:
    """Bound on the relative difference of two orders of reducing ws positive
    random floats ('pos'): each of the ws-1 roundings is within u = 2**-p of
    the result, so two orders differ by at most 2*ws*u (float32 p=24,
    bfloat16 p=8, float16 p=11), with a floor (1e-6, 1e-2, 1e-3)."""
    if dt not in FLOATS:
        return 0.0     # integers are compared bitwise (exact() is True)
    p, floor = {"float32": (24, 1e-6), "bfloat16": (8, 1e-2), "float16": (11, 1e-3)}[dt]
    return max(floor, 2 * ws * 2.0 ** -p)


def check(got, exp, is_exact: bool, tol: float, what: str) -> None:
    if is_exact:
        same(got, exp, what)
        return
    assert got.dtype == exp.dtype and got.shape == exp.shape, \
        f"{what}: {got.dtype}{tuple(got.shape)} vs {exp.dtype}{tuple(exp.shape)}"
    g, e = got.double().cpu().reshape(-1), exp.double().cpu().reshape(-1)
    ok = (g - e).abs() <= tol * e.abs()            # NaN compares False: flagged
    if not bool(ok.all()):
        bad = (~ok).nonzero().reshape(-1)
        j = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} of {g.numel()} elements differ by more "
                             f"than rtol={tol:.2e} (first at {j}: got {g[j].item()!r} want "
                             f"{e[j].item()!r})")


def rop(name: str):
    import torch.distributed as dist
    return getattr(dist.ReduceOp, name)


def avg(t, ws: int):
    """AVG from a SUM as the backend defines it: floats divided once,
    integers truncated."""
    import torch
    return t / ws if t.dtype.is_floating_point else torch.div(t, ws, rounding_mode="trunc")


class OpRaised(Exception):
    """The uccl operation of a case raised (re-raised after the Gloo side)."""


def attempt(fn):
    """Run a uccl operation; its exception is returned, to be raised by
    reraise() once the case's Gloo operation ran (the ranks stay in step)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def reraise(err, what: str = "the uccl operation") -> None:
    if err is not None:
        raise OpRaised(f"{what} raised {type(err).__name__}: {err}") from err


def digests(x: X, t) -> list[str]:
    """sha256 of t's bytes on every rank (gathered through Gloo)."""
    torch = x.torch
    h = hashlib.sha256(_bytes(t).numpy().tobytes()).digest()
    out = torch.empty(32 * x.ws, dtype=torch.uint8)
    x.dist.all_gather_into_tensor(out, torch.frombuffer(bytearray(h), dtype=torch.uint8),
                                  group=x.gloo)
    return [bytes(out[32 * r:32 * (r + 1)].tolist()).hex() for r in range(x.ws)]


def same_everywhere(x: X, t, what: str) -> None:
    d = digests(x, t)
    assert len(set(d)) == 1, f"{what}: the ranks hold different results ({d})"


def side_stream(x: X, side: bool):
    """`with` this: a fresh non-default stream made current, or nothing."""
    return x.torch.cuda.stream(x.torch.cuda.Stream()) if side else contextlib.nullcontext()


def late(x: X, t, data=None) -> None:
    """Queue a ~0.1 s GPU spin, then a kernel writing t (data, or POISON) on
    the current stream, with no synchronize: an operation called next that
    does not wait for the stream sees t's STALE bytes, or has its output
    overwritten by the POISON."""
    x.torch.cuda._sleep(SLEEP_CYCLES)
    if data is None:
        t.fill_(POISON)
    else:
        t.copy_(data)


def stale(x: X, n: int, dt: str):
    """A buffer of n elements (with a GUARD tail), every byte STALE, synchronized."""
    torch = x.torch
    back = torch.full((n * ESZ[dt] + GUARD,), STALE, dtype=torch.uint8, device=x.dev)
    x.sync()
    return back[:n * ESZ[dt]].view(dtype(dt)), back


# ---------------------------------------------------------------------------
# point to point: one pattern, run through the API under test and through Gloo
class DistP2P:
    """torch.distributed point-to-point on one group (uccl or Gloo)."""

    def __init__(self, group):
        import torch.distributed as dist
        self.dist, self.g = dist, group

    def send(self, t, dst):
        self.dist.send(t, dst=dst, group=self.g)

    def recv(self, t, src):
        self.dist.recv(t, src=src, group=self.g)

    def isend(self, t, dst):
        return self.dist.isend(t, dst=dst, group=self.g)

    def irecv(self, t, src):
        return self.dist.irecv(t, src=src, group=self.g)

    test = None   # Gloo's p2p works report completion only once waited for

    def wait(self, h):
        return h.wait()

    def wait_all(self, hs):
        return all([h.wait() for h in hs])

    def batch(self, ops, style="str"):
        d = self.dist
        return d.batch_isend_irecv([d.P2POp(d.isend if k == "send" else d.irecv, t, peer, self.g)
                                    for k, t, peer in ops])

    def sendrecv(self, send_tensor, dst, recv_tensor, src):
        self.wait_all(self.batch([("send", send_tensor, dst), ("recv", recv_tensor, src)]))


class CtxP2P:
    """The CollectiveContext's point-to-point methods."""

    def __init__(self, ctx):
        from uccl_collective import collective
        self.ctx, self.C = ctx, collective
        for name in ("isend", "irecv", "test", "wait", "wait_all", "sendrecv"):
            setattr(self, name, getattr(ctx, name))

    def send(self, t, dst):
        assert self.ctx.send(t, dst=dst) is None

    def recv(self, t, src):
        assert self.ctx.recv(t, src=src) is None

    def batch(self, ops, style="str"):
        fn = {"send": "send", "recv": "recv"} if style == "str" else \
            {"send": self.C.isend, "recv": self.C.irecv}
        hs = self.ctx.batch_isend_irecv([self.C.P2POp(fn[k], t, peer) for k, t, peer in ops])
        assert len(hs) == len(ops), f"{len(hs)} handles for {len(ops)} ops"
        return hs


class Msgs:
    """The buffers of one run of a p2p pattern: send(src, dst, tag) gives a
    buffer holding the message's data, recv(src, dst, tag) a poisoned one;
    with late=True (GPU) the data and the poison are written by kernels
    queued behind a GPU spin right before the operation (stream order)."""

    def __init__(self, x: X, i: int, n: int, dt: str, dev: str, late_fill: bool = False):
        self.x, self.i, self.n, self.dt, self.dev, self.late = x, i, n, dt, dev, late_fill
        self.sent: list = []
        self.recvd: dict = {}
        self.seen: dict = {}

    def data(self, src, dst, tag):
        return vals(self.x, sd(self.x, self.i, src, dst, tag), self.n, self.dt, dev=self.dev)

    def send(self, src, dst, tag=0):
        d = self.data(src, dst, tag)
        if self.late:
            t, _ = stale(self.x, self.n, self.dt)
            late(self.x, t, d)
        else:
            t = d.clone()
            self.x.sync()
        self.sent.append((t, d))
        return t

    def recv(self, src, dst, tag=0):
        if self.late:
            t, back = stale(self.x, self.n, self.dt)
            late(self.x, back)
        else:
            t, back = poisoned(self.x, self.n, self.dt, self.dev)
            self.x.sync()
        self.recvd[(src, dst, tag)] = (t, back)
        return t

    def snap(self) -> None:
        """Clone every received buffer now, on the current stream (the consumer kernel)."""
        self.seen = {k: back.clone() for k, (_, back) in self.recvd.items()}

    def check(self, ref: "Msgs | None") -> None:
        nb = self.n * ESZ[self.dt]
        for (src, dst, tag), back in sorted(self.seen.items()):
            what = f"message from rank {src} (tag {tag})"
            got = back[:nb].view(dtype(self.dt))
            same(got, self.data(src, dst, tag), f"{what} vs what rank {src} sent")
            if ref is not None:
                same(got, ref.recvd[(src, dst, tag)][0], f"{what}: uccl vs Gloo")
            guard_ok(back, nb, what)
        for k, (t, d) in enumerate(self.sent):
            same(t, d, f"send buffer {k} (must not change)")


def pat_star(api, x: X, m: Msgs, p) -> None:
    """Blocking send/recv: rank 0 to every rank in turn, then back."""
    if x.me == 0:
        for r in range(1, x.ws):
            api.send(m.send(0, r), r)
        for r in range(1, x.ws):
            api.recv(m.recv(r, 0), r)
    else:
        api.recv(m.recv(0, x.me), 0)
        api.send(m.send(x.me, 0), 0)


def pat_ring(api, x: X, m: Msgs, p) -> None:
    """Blocking send to the right and recv from the left; even ranks send first."""
    s, r = m.send(x.me, x.right), m.recv(x.left, x.me)
    if x.me % 2 == 0:
        api.send(s, x.right)
        api.recv(r, x.left)
    else:
        api.recv(r, x.left)
        api.send(s, x.right)


def pat_pairs(api, x: X, m: Msgs, p) -> None:
    """irecv from and isend to every rank, all in flight; the first handle
    polled with test() (where the API has it), the second wait(), the rest
    wait_all()."""
    hs = [api.irecv(m.recv(s, x.me), s) for s in range(x.ws) if s != x.me]
    hs += [api.isend(m.send(x.me, d), d) for d in range(x.ws) if d != x.me]
    if api.test is not None:
        end = time.monotonic() + PG_TIMEOUT_S
        while not api.test(hs[0]):
            assert time.monotonic() < end, f"test() still False after {PG_TIMEOUT_S} s"
            time.sleep(0.0005)
    assert api.wait(hs[0]) is True and api.wait(hs[1]) is True
    assert api.wait_all(hs[2:]) is True
    if api.test is not None:
        assert all(api.test(h) is True for h in hs), "test() after completion must stay True"


def pat_sendrecv(api, x: X, m: Msgs, p) -> None:
    """sendrecv to the right / from the left, then (keywords) the other way."""
    api.sendrecv(m.send(x.me, x.right, 0), x.right, m.recv(x.left, x.me, 0), x.left)
    api.sendrecv(send_tensor=m.send(x.me, x.left, 1), dst=x.left,
                 recv_tensor=m.recv(x.right, x.me, 1), src=x.right)


def pat_batch(api, x: X, m: Msgs, p) -> None:
    """batch_isend_irecv: send right and left, receive from left and right."""
    ops = [("send", m.send(x.me, x.right, 0), x.right), ("recv", m.recv(x.left, x.me, 0), x.left),
           ("send", m.send(x.me, x.left, 1), x.left), ("recv", m.recv(x.right, x.me, 1), x.right)]
    assert api.wait_all(api.batch(ops, p.get("style", "str"))) is True


PATTERNS = {"star": pat_star, "ring": pat_ring, "pairs": pat_pairs, "sendrecv": pat_sendrecv,
            "batch": pat_batch}


def _case_p2p(x: X, i, p):
    pat, n, dt = PATTERNS[p["pat"]], p["n"], p["dt"]
    u, g = Msgs(x, i, n, dt, x.dev), Msgs(x, i, n, dt, "cpu")
    err = attempt(lambda: (pat(x.p2p_u, x, u, p), u.snap()))
    pat(x.p2p_g, x, g, p)
    reraise(err)
    u.check(g)


def _case_stream_p2p(x: X, i, p):
    """A p2p pattern whose sources are filled and destinations poisoned by
    kernels queued behind a GPU spin right before each call, the received
    buffers cloned right after the pattern returned; no synchronize."""
    pat = PATTERNS[p["pat"]]
    m = Msgs(x, i, STREAM_N, "float32", x.dev, late_fill=True)
    with side_stream(x, p["side"]):
        pat(x.p2p_u, x, m, p)
        m.snap()
    x.sync()
    m.check(None)


# ---------------------------------------------------------------------------
# CollectiveContext cases
def _gloo_allgather(x: X, t) -> list:
    outs = [x.torch.empty_like(t) for _ in range(x.ws)]
    x.dist.all_gather(outs, t, group=x.gloo)
    return outs


def _ctx_call(x: X, api: str, send, recv, algo) -> None:
    ctx = x.ctx
    if api.startswith("i"):
        h = getattr(ctx, api)(send, recv, algo)
        assert ctx.wait(h) is True
        assert ctx.test(h) is True
    else:
        assert getattr(ctx, api)(send, recv, algorithm=algo) is None


def _case_ctx_setup(x: X, i, p):
    ctx = x.ctx
    assert (ctx.rank, ctx.world_size) == (x.me, x.ws), (ctx.rank, ctx.world_size)
    assert ctx.local_gpu_idx == 0, ctx.local_gpu_idx
    tps = {r: ctx.transport_to(r) for r in range(x.ws) if r != x.me}
    x.R.info["transports"] = tps
    bad = {r: t for r, t in tps.items() if t in ("torch.distributed", "tcp")}
    assert not bad, f"same-host peers not through the engine's same-host transport: {bad}"
    if x.cuda:
        x.R.info["device"] = x.torch.cuda.get_device_name(0)


def _case_ctx_ag(x: X, i, p):
    me, ws, n, dt, form = x.me, x.ws, p["n"], p["dt"], p["form"]
    exps = [vals(x, sd(x, i, r), n, dt) for r in range(ws)]
    send = exps[me].clone()
    if form == "tensor":
        recv, back = poisoned(x, ws * n, dt)
        chunks, backs, arg = [recv[r * n:(r + 1) * n] for r in range(ws)], [back], recv
    else:
        made = [poisoned(x, n, dt) for _ in range(ws)]
        chunks, backs = [m[0] for m in made], [m[1] for m in made]
        arg = chunks
    x.sync()
    err = attempt(lambda: _ctx_call(x, p["api"], send, arg, p["algo"]))
    ref = _gloo_allgather(x, cpu(send))
    reraise(err)
    for r in range(ws):
        same(chunks[r], exps[r], f"chunk {r} vs what rank {r} sent")
        same(chunks[r], ref[r], f"chunk {r} vs Gloo")
    for k, b in enumerate(backs):
        guard_ok(b, (n if form == "list" else ws * n) * ESZ[dt], f"recv {k}")
    same(send, exps[me], "send tensor (must not change)")


def _agv_lens(p: dict, ws: int) -> list[int]:
    if p["lens"] == "big":   # around the given size, odd lengths, one rank empty
        return [0 if r == 1 else p["big"] + 4097 * r - 1 for r in range(ws)]
    if p["lens"] == "zero":
        return [0 if r == 1 else 4097 + 61 * r for r in range(ws)]
    return [(r * r * 37) % 11 for r in range(ws)]   # 0, 4, 5, 3


def _case_ctx_agv(x: X, i, p):
    torch, me, ws, dt = x.torch, x.me, x.ws, p["dt"]
    lens = _agv_lens(p, ws)
    exps = [vals(x, sd(x, i, r), lens[r], dt) for r in range(ws)]
    send = exps[me].clone()
    made = [poisoned(x, lens[r], dt) for r in range(ws)]
    recv = [m[0] for m in made]
    x.sync()
    err = attempt(lambda: _ctx_call(x, p["api"], send, recv, p["algo"]))
    padded = torch.zeros(max(max(lens), 1), dtype=dtype(dt))   # Gloo: equal lengths only
    padded[:lens[me]] = cpu(send)
    ref = _gloo_allgather(x, padded)
    reraise(err)
    for r in range(ws):
        same(recv[r], exps[r], f"recv[{r}] ({lens[r]} elements) vs what rank {r} sent")
        same(recv[r], ref[r][:lens[r]], f"recv[{r}] vs Gloo")
        guard_ok(made[r][1], lens[r] * ESZ[dt], f"recv[{r}]")


def _case_register(x: X, i, p):
    """register_tensor/deregister_tensor of device memory; an allgather and a
    ring step into sub-ranges of a registered region; deregistered buffers
    still work."""
    torch, ctx, me, ws, n = x.torch, x.ctx, x.me, x.ws, 4097
    exps = [vals(x, sd(x, i, r), n, "float32") for r in range(ws)]
    big = torch.full(((ws + 2) * n * 4 + GUARD,), POISON, dtype=torch.uint8, device=x.dev)
    send = exps[me].clone()
    x.sync()
    mr = ctx.register_tensor(big)
    assert isinstance(mr, int) and not isinstance(mr, bool), repr(mr)
    assert ctx.register_tensor(big) == mr, "registering the same tensor again must reuse it"
    smr = ctx.register_tensor(send)
    assert isinstance(smr, int) and smr != mr, (smr, mr)
    recv = big[:ws * n * 4].view(torch.float32)
    ctx.allgather(send, recv, algorithm="ring")
    ref = _gloo_allgather(x, cpu(send))
    for r in range(ws):
        same(recv[r * n:(r + 1) * n], exps[r], f"registered recv, chunk {r}")
        same(recv[r * n:(r + 1) * n], ref[r], f"registered recv, chunk {r} vs Gloo")
    s2 = big[ws * n * 4:(ws + 1) * n * 4].view(torch.float32)
    s2.copy_(vals(x, sd(x, i, me, 7), n, "float32"))
    r2 = big[(ws + 1) * n * 4:(ws + 2) * n * 4].view(torch.float32)
    x.sync()
    ctx.sendrecv(s2, x.right, r2, x.left)
    same(r2, vals(x, sd(x, i, x.left, 7), n, "float32"), "sendrecv in registered memory")
    guard_ok(big, (ws + 2) * n * 4, "registered region")
    assert ctx.deregister_tensor(big) is True
    assert ctx.deregister_tensor(big) is False, "deregistering twice must return False"
    assert ctx.deregister_tensor(send) is True
    assert ctx.deregister_tensor(torch.zeros(3, device=x.dev)) is False
    big[:ws * n * 4].fill_(POISON)
    x.sync()
    ctx.allgather(send, recv, algorithm="direct")
    for r in range(ws):
        same(recv[r * n:(r + 1) * n], exps[r], f"after deregister, chunk {r}")


def _case_stream_ag(x: X, i, p):
    """allgather / iallgather+wait right after a late fill of the source and
    a late poison of the output; the output cloned right after the call."""
    me, ws, n = x.me, x.ws, STREAM_N
    exps = [vals(x, sd(x, i, r), n, "float32") for r in range(ws)]
    send, _ = stale(x, n, "float32")
    recv, back = stale(x, ws * n, "float32")
    with side_stream(x, p["side"]):
        late(x, send, exps[me])
        late(x, back)
        _ctx_call(x, p["api"], send, recv, p["algo"])
        seen = back.clone()
    x.sync()
    for r in range(ws):
        same(seen[r * n * 4:(r + 1) * n * 4].view(dtype("float32")), exps[r],
             f"chunk {r} read right after the call")
    guard_ok(seen, ws * n * 4, "recv")


def _case_ctx_end(x: X, i, p):
    x.dist.barrier()
    x.ctx.finalize()


# ---------------------------------------------------------------------------
# backend cases: reductions
def _case_pg_setup(x: X, i, p):
    dist = x.dist
    assert dist.get_backend() == "uccl", dist.get_backend()
    assert dist.get_backend(x.gloo) == "gloo", dist.get_backend(x.gloo)
    nodes = x.R.params.get("nodes")
    if nodes:   # the "nodes" are apart: TCP (or RDMA) between them, shared memory inside one
        ctx, mine = dist.group.WORLD.context, x.me * nodes // x.ws
        between = "rdma" if x.R.params.get("verbs") else "tcp"
        for q in range(x.ws):
            if q != x.me:
                t = ctx.transport_to(q)
                want = "shm" if q * nodes // x.ws == mine else between
                assert t.startswith(want), f"rank {q} (node {q * nodes // x.ws}) via {t}"
    if x.cuda:
        assert x.torch.cuda.current_device() == x.R.gpu, (x.torch.cuda.current_device(), x.R.gpu)
        x.R.info["device"] = x.torch.cuda.get_device_name(x.R.gpu)


SKEW_BOUND_S = 5.0   # far below the group's timeout (a stuck round ends only there)


def _case_ar(x: X, i, p):
    dist, op, dt, kind, n = x.dist, p["op"], p["dt"], p["kind"], p["n"]
    inp = vals(x, sd(x, i, x.me), n, dt, kind)
    a = inp.clone()
    if p.get("skew") and x.me == 0:   # one element into a buffer: not 16-byte aligned
        a = x.torch.empty(n + 1, dtype=inp.dtype, device=inp.device)[1:]
        a.copy_(inp)
        assert a.data_ptr() % 16, "the skewed tensor is aligned after all"
    x.sync()
    err = attempt(lambda: dist.all_reduce(a, op=rop(op)))
    b = cpu(inp)
    dist.all_reduce(b, op=rop("SUM" if op == "AVG" else op), group=x.gloo)
    if op == "AVG":
        b = avg(b, x.ws)
    d = digests(x, a)
    reraise(err)
    check(a, b, exact(dt, kind, op, x.ws), rtol(dt, x.ws),
          "uccl vs Gloo" + (" SUM / world size" if op == "AVG" else ""))
    assert len(set(d)) == 1, f"the ranks hold different results: {d}"
    if p.get("skew"):   # and the round ended on every rank on its own: the group still works
        t0 = time.monotonic()
        c = x.torch.ones(4, device=a.device)
        dist.all_reduce(c)
        x.sync()
        took = time.monotonic() - t0
        assert took < SKEW_BOUND_S and c.eq(x.ws).all(), \
            f"the next all_reduce took {took:.1f} s (bound {SKEW_BOUND_S} s) and gave {c.tolist()}"


def _case_reduce(x: X, i, p):
    dist, op, dt, kind, n = x.dist, p["op"], p["dt"], p["kind"], p["n"]
    root = i % x.ws
    inp = vals(x, sd(x, i, x.me), n, dt, kind)
    a = inp.clone()
    x.sync()
    err = attempt(lambda: dist.reduce(a, dst=root, op=rop(op)))
    b = cpu(inp)
    dist.reduce(b, dst=root, op=rop("SUM" if op == "AVG" else op), group=x.gloo)
    reraise(err)
    if x.me == root:
        b = avg(b, x.ws) if op == "AVG" else b
        check(a, b, exact(dt, kind, op, x.ws), rtol(dt, x.ws), f"root {root}: uccl vs Gloo")


def _case_rs(x: X, i, p):
    dist, op, dt, kind, n, ws = x.dist, p["op"], p["dt"], p["kind"], p["n"], x.ws
    inp = vals(x, sd(x, i, x.me), ws * n, dt, kind)
    a = inp.clone()
    out, back = poisoned(x, n, dt)
    out_g, _ = poisoned(x, n, dt, "cpu")
    gop = rop("SUM" if op == "AVG" else op)
    x.sync()
    if p["form"] == "list":
        ins_g = cpu(inp)
        err = attempt(lambda: dist.reduce_scatter(out, [a[r * n:(r + 1) * n] for r in range(ws)],
                                                  op=rop(op)))
        dist.reduce_scatter(out_g, [ins_g[r * n:(r + 1) * n] for r in range(ws)], op=gop,
                            group=x.gloo)
    else:
        err = attempt(lambda: dist.reduce_scatter_tensor(out, a, op=rop(op)))
        dist.reduce_scatter_tensor(out_g, cpu(inp), op=gop, group=x.gloo)
    reraise(err)
    if op == "AVG":
        out_g = avg(out_g, ws)
    check(out, out_g, exact(dt, kind, op, ws), rtol(dt, ws), "uccl vs Gloo")
    guard_ok(back, n * ESZ[dt], "output")
    same(a, inp, "input (must not change)")


# ---------------------------------------------------------------------------
# backend cases: data movement
def _case_ag(x: X, i, p):
    dist, dt, n, ws = x.dist, p["dt"], p["n"], x.ws
    exps = [vals(x, sd(x, i, r), n, dt) for r in range(ws)]
    inp = exps[x.me].clone()
    made = [poisoned(x, n, dt) for _ in range(ws)]
    x.sync()
    err = attempt(lambda: dist.all_gather([m[0] for m in made], inp))
    ref = _gloo_allgather(x, cpu(inp))
    reraise(err)
    for r in range(ws):
        same(made[r][0], exps[r], f"output {r} vs rank {r}'s input")
        same(made[r][0], ref[r], f"output {r} vs Gloo")
        guard_ok(made[r][1], n * ESZ[dt], f"output {r}")
    same(inp, exps[x.me], "input (must not change)")


def _group_launch_off_on_rank_0(x: X):
    """A new uccl group whose rank 0 made its CUDA device with
    UCCL_SG_GATHER_LAUNCH_BYTES=0 (read when the group's first CUDA call
    makes it), its peers with the default."""
    import datetime
    grp = x.dist.new_group(backend="uccl", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    if x.me == 0:
        os.environ["UCCL_SG_GATHER_LAUNCH_BYTES"] = "0"
    try:
        t = x.torch.zeros(x.ws * 1024, device=x.dev)
        x.dist.all_gather_into_tensor(t, t[x.me * 1024:(x.me + 1) * 1024], group=grp)
    finally:
        os.environ.pop("UCCL_SG_GATHER_LAUNCH_BYTES", None)
    return grp


def _case_agit(x: X, i, p):
    torch, dist, dt, n, ws = x.torch, x.dist, p["dt"], p["n"], x.ws
    grp = _group_launch_off_on_rank_0(x) if p.get("mixed") else None
    exps = [vals(x, sd(x, i, r), n, dt) for r in range(ws)]
    out, back = poisoned(x, ws * n, dt)
    if p.get("inplace"):   # this rank's chunk of the output is the input
        inp = out[x.me * n:(x.me + 1) * n]
        inp.copy_(exps[x.me])
    else:
        inp = exps[x.me].clone()
    x.sync()
    err = attempt(lambda: dist.all_gather_into_tensor(out, inp, group=grp))
    ref, _ = poisoned(x, ws * n, dt, "cpu")
    dist.all_gather_into_tensor(ref, cpu(exps[x.me]), group=x.gloo)
    if grp is not None:
        dist.destroy_process_group(grp)
    reraise(err)
    same(out, torch.cat(exps), "output vs the ranks' inputs")
    same(out, ref, "output vs Gloo")
    guard_ok(back, ws * n * ESZ[dt], "output")


def _case_bcast(x: X, i, p):
    dist, dt, n = x.dist, p["dt"], p["n"]
    root = i % x.ws
    exp = vals(x, sd(x, i, root), n, dt)
    t, back = poisoned(x, n, dt)
    g, _ = poisoned(x, n, dt, "cpu")
    if x.me == root:
        t.copy_(exp)
        g.copy_(exp.cpu())
    x.sync()
    err = attempt(lambda: dist.broadcast(t, src=root))
    dist.broadcast(g, src=root, group=x.gloo)
    reraise(err)
    same(t, exp, f"tensor vs root {root}'s")
    same(t, g, "uccl vs Gloo")
    guard_ok(back, n * ESZ[dt], "tensor")


def _pair_size(i: int, src: int, dst: int, p: dict) -> int:
    if p["sizes"] == "eq":
        return p["n"]
    return ((src * 7 + dst * 3 + i) % 5) * 1000 + (src + dst) % 3   # zeros among them


def _a2a_io(x: X, i, p):
    """(this rank's pieces for each rank, the pieces it must receive)."""
    dt, me, ws = p["dt"], x.me, x.ws
    ins = [vals(x, sd(x, i, me, d), _pair_size(i, me, d, p), dt) for d in range(ws)]
    exps = [vals(x, sd(x, i, s, me), _pair_size(i, s, me, p), dt) for s in range(ws)]
    return ins, exps


def _gloo_a2a(x: X, ins, out_sizes, dt):
    """Gloo's reference (its list all_to_all takes equal sizes only): CPU
    all_to_all_single with split sizes."""
    torch = x.torch
    flat = torch.empty(sum(out_sizes), dtype=dtype(dt))
    x.dist.all_to_all_single(flat, torch.cat([cpu(t) for t in ins]), out_sizes,
                             [t.numel() for t in ins], group=x.gloo)
    return list(flat.split(out_sizes))


def _case_a2a(x: X, i, p):
    dt, ws = p["dt"], x.ws
    ins, exps = _a2a_io(x, i, p)
    ins_u = [t.clone() for t in ins]
    made = [poisoned(x, e.numel(), dt) for e in exps]
    x.sync()
    err = attempt(lambda: x.dist.all_to_all([m[0] for m in made], ins_u))
    ref = _gloo_a2a(x, ins, [e.numel() for e in exps], dt)
    reraise(err)
    for s in range(ws):
        same(made[s][0], exps[s], f"output {s} vs what rank {s} sent")
        same(made[s][0], ref[s], f"output {s} vs Gloo")
        guard_ok(made[s][1], exps[s].numel() * ESZ[dt], f"output {s}")
    for d in range(ws):
        same(ins_u[d], ins[d], f"input {d} (must not change)")


def _case_a2as(x: X, i, p):
    torch, dt = x.torch, p["dt"]
    ins, exps = _a2a_io(x, i, p)
    inp, exp = torch.cat(ins), torch.cat(exps)
    out, back = poisoned(x, exp.numel(), dt)
    splits = (None, None) if p["sizes"] == "eq" else \
        ([e.numel() for e in exps], [t.numel() for t in ins])
    x.sync()
    err = attempt(lambda: x.dist.all_to_all_single(out, inp, *splits))
    ref = torch.cat(_gloo_a2a(x, ins, [e.numel() for e in exps], dt))
    reraise(err)
    same(out, exp, "output vs what the ranks sent")
    same(out, ref, "output vs Gloo")
    guard_ok(back, exp.numel() * ESZ[dt], "output")
    same(inp, torch.cat(ins), "input (must not change)")


def _case_gather(x: X, i, p):
    dist, dt, n, ws = x.dist, p["dt"], p["n"], x.ws
    root = i % ws
    exps = [vals(x, sd(x, i, r), n, dt) for r in range(ws)]
    mine = x.me == root
    made = [poisoned(x, n, dt) for _ in range(ws)] if mine else None
    refs = [poisoned(x, n, dt, "cpu")[0] for _ in range(ws)] if mine else None
    x.sync()
    err = attempt(lambda: dist.gather(exps[x.me], [m[0] for m in made] if mine else None,
                                      dst=root))
    dist.gather(cpu(exps[x.me]), refs, dst=root, group=x.gloo)
    reraise(err)
    for r in range(ws if mine else 0):
        same(made[r][0], exps[r], f"root {root}: output {r} vs rank {r}'s input")
        same(made[r][0], refs[r], f"root {root}: output {r} vs Gloo")
        guard_ok(made[r][1], n * ESZ[dt], f"output {r}")


def _case_scatter(x: X, i, p):
    dist, dt, n, ws = x.dist, p["dt"], p["n"], x.ws
    root = i % ws
    pieces = [vals(x, sd(x, i, root, d), n, dt) for d in range(ws)]
    mine = x.me == root
    out, back = poisoned(x, n, dt)
    ref, _ = poisoned(x, n, dt, "cpu")
    x.sync()
    err = attempt(lambda: dist.scatter(out, pieces if mine else None, src=root))
    dist.scatter(ref, [cpu(t) for t in pieces] if mine else None, src=root, group=x.gloo)
    reraise(err)
    same(out, pieces[x.me], f"output vs root {root}'s piece for this rank")
    same(out, ref, "output vs Gloo")
    guard_ok(back, n * ESZ[dt], "output")


# ---------------------------------------------------------------------------
# backend cases: async works, barrier, objects
def _async_ops(x: X, i):
    """all_reduce, all_gather_into_tensor, broadcast, reduce_scatter_tensor,
    all_to_all_single, isend/irecv, all issued with async_op=True before any
    wait: {name: (work, outputs, expected)}."""
    torch, dist, ws, me = x.torch, x.dist, x.ws, x.me
    n = 4097
    xs = [vals(x, sd(x, i, r, 1), n, "float32", "int") for r in range(ws)]
    gs = [vals(x, sd(x, i, r, 2), n, "bfloat16") for r in range(ws)]
    rs = [vals(x, sd(x, i, r, 3), ws * n, "int64") for r in range(ws)]
    a2 = [vals(x, sd(x, i, r, 4), ws * 99, "uint8") for r in range(ws)]
    bc = vals(x, sd(x, i, 0, 5), 513, "float16")
    sent = vals(x, sd(x, i, me, 6), 300, "float32")
    ar = xs[me].clone()
    ag, _ = poisoned(x, ws * n, "bfloat16")
    b = bc.clone() if me == 0 else poisoned(x, 513, "float16")[0]
    rst, _ = poisoned(x, n, "int64")
    a2o, _ = poisoned(x, ws * 99, "uint8")
    rv, _ = poisoned(x, 300, "float32")
    x.sync()
    sumr = sum(t.cpu() for t in rs)
    return {
        "all_reduce": (dist.all_reduce(ar, async_op=True), [ar], sum(t.cpu() for t in xs)),
        "all_gather_into_tensor": (dist.all_gather_into_tensor(ag, gs[me], async_op=True), [ag],
                                   torch.cat([t.cpu() for t in gs])),
        "broadcast": (dist.broadcast(b, src=0, async_op=True), [b], bc.cpu()),
        "reduce_scatter_tensor": (dist.reduce_scatter_tensor(rst, rs[me], async_op=True), [rst],
                                  sumr[me * n:(me + 1) * n]),
        "all_to_all_single": (dist.all_to_all_single(a2o, a2[me], async_op=True), [a2o],
                              torch.cat([a2[s][me * 99:(me + 1) * 99].cpu() for s in range(ws)])),
        "isend": (dist.isend(sent, dst=x.right), [sent], sent.cpu()),
        "irecv": (dist.irecv(rv, src=x.left), [rv], vals(x, sd(x, i, x.left, 6), 300, "float32")),
    }


def _case_async(x: X, i, p):
    """wait() then read on the current stream; or (futures_first) the
    futures taken at once and get_future().wait() first."""
    works = _async_ops(x, i)
    futs = {k: w.get_future() for k, (w, _, _) in works.items()} if p["futures_first"] else {}
    for k, (w, outs, exp) in works.items():
        if p["futures_first"]:
            val = futs[k].wait()
            assert isinstance(val, list) and len(val) == len(outs), f"{k}: future value {val!r}"
            for got, t in zip(val, outs):
                assert got.data_ptr() == t.data_ptr(), f"{k}: the future's value is not the output"
            assert w.wait() is True, f"{k}: wait() after the future did not return True"
            # a CUDA future's wait() orders the current stream and returns (torch's
            # documentation), as NCCL's: the GPU may still run the operation, so
            # is_completed() is asked once this stream is past it
            x.sync()
            assert w.is_completed(), f"{k}: not is_completed() once the stream is past it"
        else:
            assert w.wait() is True, f"{k}: wait() did not return True"
        same(outs[0], exp, f"{k}: result")
    x.align()


def _case_barrier(x: X, i, p):
    late_rank = x.ws - 1
    x.align()
    if x.me == late_rank:
        time.sleep(1.0)
    t0 = time.monotonic()
    x.dist.barrier()
    took = time.monotonic() - t0
    if x.me != late_rank:
        assert took >= 0.6, \
            f"barrier returned after {took:.3f} s; rank {late_rank} came 1 s late"


def _obj(i: int, r: int):
    import torch
    return {"rank": r, "text": "rang-é-🙂" * (r + 1), "ints": list(range(r * 5)),
            "nested": {"t": (r, None, True), "f": 1.5 * r}, "blob": bytes(range(256)) * (r + 1),
            "big": "x" * (200_000 if r == 1 else 3), "tensor": torch.arange(r + 3) * (r + 1)}


def _obj_eq(a, b) -> bool:
    import torch
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_obj_eq(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    return type(a) is type(b) and a == b


def _case_obj(x: X, i, p):
    dist, ws, me = x.dist, x.ws, x.me
    root = i % ws

    def run(group):
        if p["api"] == "all_gather_object":
            got = [None] * ws
            dist.all_gather_object(got, _obj(i, me), group=group)
        else:
            got = [_obj(i, root), "second", [1, (2, 3)]] if me == root else [None] * 3
            dist.broadcast_object_list(got, src=root, group=group)
        return got

    res = {}
    err = attempt(lambda: res.update(u=run(None)))
    ref = run(x.gloo)
    reraise(err)
    exp = [_obj(i, r) for r in range(ws)] if p["api"] == "all_gather_object" else \
        [_obj(i, root), "second", [1, (2, 3)]]
    for j, (u, g, e) in enumerate(zip(res["u"], ref, exp)):
        assert _obj_eq(u, e), f"object {j}: got {str(u)[:200]!r}"
        assert _obj_eq(u, g), f"object {j}: uccl and Gloo differ"


# ---------------------------------------------------------------------------
# backend cases: stream order
def _case_stream_pg(x: X, i, p):
    """all_reduce (in place) / all_gather_into_tensor right after a late fill
    of the input (and a late poison of the output), blocking or async with
    work.wait(), on the current or a fresh side stream; the output cloned
    right after; no synchronize before the final check."""
    torch, dist, ws, n = x.torch, x.dist, x.ws, STREAM_N
    xs = [vals(x, sd(x, i, r), n, "float32", "int") for r in range(ws)]
    blocking = p["mode"].startswith("blocking")
    inp, _ = stale(x, n, "float32")
    if p["op"] == "agit":
        out, back = stale(x, ws * n, "float32")
        exp = torch.cat(xs)
    else:
        out, back = inp, None
        exp = sum(xs)      # small integers: exact in any order
    works = []
    with side_stream(x, p["mode"].endswith("side-stream")):
        late(x, inp, xs[x.me])
        if back is not None:
            late(x, back)
        if p["op"] == "ar":
            w = dist.all_reduce(inp, async_op=not blocking)
        else:
            w = dist.all_gather_into_tensor(out, inp, async_op=not blocking)
        if not blocking:
            works.append(w)
            assert w.wait() is True, "wait() did not return True"
        seen = (back if back is not None else out).clone()
    x.sync()
    for w in works:
        w.get_future().wait()
    nb = exp.numel() * 4
    got = seen if back is None else seen[:nb].view(torch.float32)
    same(got, exp, "output read right after the call" + ("" if blocking else " and wait()"))
    if back is not None:
        guard_ok(seen, nb, "output")


def _case_nonblocking_wait(x: X, i, p):
    """A ~1.5 s GPU spin, then a fill of the input, then the operation
    (async_op=True and work.wait(), or the blocking call), then a clone of
    the output: issue and wait() together must take a small part of the
    spin (the stream waits, not the host: as ProcessGroupNCCL), and the
    clone must hold the result; is_completed() is False while the spin runs."""
    torch, dist, ws, me = x.torch, x.dist, x.ws, x.me
    if x.R.params.get("nodes"):
        # between hosts the engine's transfers are driven by host threads:
        # wait() returns once the bytes are in place (backend/_work.py's
        # Work); a stream wait released by those threads deadlocked against
        # a caller blocked in a synchronous CUDA copy (docs/gpu.md).  And a
        # blocking send there is done once its receiver has the bytes, as
        # Gloo's, so a ring of blocking sends waits for receives not posted
        return ("SKIP: across hosts wait() and blocking calls wait on the host for the "
                "transfers (host-driven, as Gloo's; docs/gpu.md)")
    t0 = time.monotonic()
    torch.cuda._sleep(SLEEP_CYCLES)
    x.sync()
    cycles = int(SLEEP_CYCLES * NONBLOCK_SLEEP_S / max(time.monotonic() - t0, 1e-3))
    n = 4097
    inp = torch.zeros(n * ws if p["op"] == "rs" else n, device=x.dev)
    out = {"ar": lambda: inp, "agit": lambda: torch.zeros(n * ws, device=x.dev),
           "rs": lambda: torch.zeros(n, device=x.dev),
           "p2p": lambda: torch.zeros(n, device=x.dev)}[p["op"]]()
    # made before the timed part: an allocation while the GPU spins may wait for it
    src = torch.arange(inp.numel(), device=x.dev, dtype=torch.float32) % 97 + me + 1
    x.sync()
    x.align()
    t0 = time.monotonic()
    torch.cuda._sleep(cycles)
    inp.copy_(src)

    def p2p(a):
        # send right and receive from the left, every rank in the same order:
        # a blocking send returns before its receiver has even posted
        if not a:
            dist.send(inp, x.right)
            dist.recv(out, x.left)
            return None
        return [dist.isend(inp, x.right), dist.irecv(out, x.left)]
    call = {"ar": lambda a: dist.all_reduce(inp, async_op=a),
            "agit": lambda a: dist.all_gather_into_tensor(out, inp, async_op=a),
            "rs": lambda a: dist.reduce_scatter_tensor(out, inp, async_op=a), "p2p": p2p}[p["op"]]
    w = call(p["mode"] == "async")
    issued = time.monotonic() - t0
    busy = None
    for w in (w if isinstance(w, list) else [w] if w is not None else []):
        busy = busy or w.is_completed()
        assert w.wait() is True
    host = time.monotonic() - t0
    seen = out.clone()
    x.sync()
    spin = time.monotonic() - t0
    x.R.info[f"nonblocking_wait-{p['op']}-{p['mode']}"] = dict(
        issue_s=round(issued, 4), issue_and_wait_s=round(host, 4), spin_s=round(spin, 3))
    assert spin >= 0.5, f"the GPU spin lasted only {spin:.2f} s: the timing says nothing"
    assert host < spin / 4, (f"{p['op']} ({p['mode']}) + wait() took {host:.3f} s of the "
                             f"{spin:.2f} s GPU spin queued before it (issue {issued:.3f} s): "
                             "the host waited for the GPU")
    assert busy is not True, "is_completed() was True while the GPU spin queued before it ran"
    base = torch.arange(n * (ws if p["op"] != "ar" else 1), dtype=torch.float32) % 97
    if p["op"] == "ar":
        exp = base * ws + ws * (ws + 1) // 2
    elif p["op"] == "agit":
        exp = torch.cat([base[:n] + r + 1 for r in range(ws)])
    elif p["op"] == "p2p":
        exp = base[:n] + x.left + 1
    else:
        full = torch.arange(n * ws, dtype=torch.float32) % 97
        exp = (full * ws + ws * (ws + 1) // 2)[me * n:(me + 1) * n]
    same(seen, exp, "the clone queued after wait()")


# ---------------------------------------------------------------------------
# backend cases: DDP and FSDP2
def _train_ddp(x: X, group, dev: str):
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(1234 + x.me)   # ranks differ: DDP's first broadcast makes them rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).to(dev)
    ddp = DDP(model, process_group=group,
              device_ids=[x.torch.cuda.current_device()] if dev == "cuda" else None)
    start = [cpu(q) for q in model.parameters()]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(4321 + x.me)
    for _ in range(DDP_STEPS):
        inp, tgt = torch.randn(8, 16, generator=g).to(dev), torch.randn(8, 4, generator=g).to(dev)
        opt.zero_grad()
        F.mse_loss(ddp(inp), tgt).backward()
        opt.step()
    return start, [cpu(q) for q in model.parameters()]


def _case_ddp(x: X, i, p):
    """DDP on the device over uccl vs DDP on the CPU over Gloo, same seeds.
    Tolerance on a GPU: 1e-5 of the largest parameter.  The forward and
    backward run in cuBLAS there and in the CPU's BLAS here, whose float32
    sums round differently by a few ulps (~1e-7 relative) per operation,
    which moves the parameters by about a tenth of that over 20 steps of
    lr 0.1; an error of 1e-4 in the averaged gradients already moves them by
    1.1e-5 (measured by scaling them), and a missing or doubled average by
    ~1e-2.  On the CPU (dry run): bitwise at 2 ranks, 1e-6 from 3 on (the
    order of the gradient sums differs)."""
    torch = x.torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    res = {}
    err = attempt(lambda: res.update(u=_train_ddp(x, None, x.dev)))
    start_g, end_g = _train_ddp(x, x.gloo, "cpu")
    reraise(err)
    start_u, end_u = res["u"]
    same_everywhere(x, torch.cat([q.reshape(-1) for q in end_u]), "DDP parameters")
    torch.manual_seed(1234)
    rank0 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for j, q in enumerate(rank0.parameters()):
        same(start_u[j], q.detach(), f"param {j} after DDP's broadcast (uccl) vs rank 0's")
        same(start_g[j], q.detach(), f"param {j} after DDP's broadcast (Gloo) vs rank 0's")
    tol = 1e-5 if x.cuda else (0.0 if x.ws == 2 else 1e-6)
    worst = 0.0
    for j, (s, u, g) in enumerate(zip(start_u, end_u, end_g)):
        assert not torch.equal(s, u), f"param {j} did not change in {DDP_STEPS} steps"
        scale = float(g.abs().max())
        diff = float((u - g).abs().max())
        worst = max(worst, diff / scale)
        assert diff <= tol * scale, (f"param {j}: max |uccl - Gloo| = {diff:.3e} > {tol:g} x "
                                     f"max|param| ({scale:.3e})")
    x.R.info["ddp_max_rel_diff"] = worst


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _case_fsdp(x: X, i, p):
    """FSDP2 (fully_shard per Linear and the whole model) over the uccl
    group on the device, FSDP_STEPS of SGD, each rank its own batch; the
    reference trains a copy in this process on every rank's batch (the mean
    of the ranks' losses, computed per rank-batch on the same device so each
    forward is the same computation).  Tolerance rtol 1e-5, atol 1e-6: FSDP
    reduce-scatters the ranks' gradients (summing in another order, dividing
    at another point) where the reference's autograd accumulates them."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    fully_shard = _fully_shard()
    ws, dev = x.ws, x.dev
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 7),
                                torch.nn.Tanh(), torch.nn.Linear(7, 3))
    initial = [cpu(q) for q in model.parameters()]
    ref = copy.deepcopy(model).to(dev)
    model.to(dev)
    mesh = init_device_mesh(dev, (ws,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    gens = [torch.Generator().manual_seed(100 + r) for r in range(ws)]
    for _ in range(FSDP_STEPS):
        batches = [torch.randn(16, 24, generator=g).to(dev) for g in gens]
        model(batches[x.me]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        (sum(ref(b).pow(2).mean() for b in batches) / ws).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    final = [cpu(q.full_tensor()) for q in model.parameters()]
    same_everywhere(x, torch.cat([q.reshape(-1) for q in final]), "FSDP2 parameters")
    worst = 0.0
    for j, (f, r, s) in enumerate(zip(final, ref.parameters(), initial)):
        r = cpu(r)
        assert not torch.equal(f, s), f"param {j} did not change in {FSDP_STEPS} steps"
        worst = max(worst, float((f - r).abs().max()))
        if not torch.allclose(f, r, rtol=1e-5, atol=1e-6):
            raise AssertionError(f"param {j}: FSDP2 over uccl vs the local reference: max diff "
                                 f"{float((f - r).abs().max()):.3e}")
    x.R.info["fsdp_max_abs_diff"] = worst


def _case_pg_end(x: X, i, p):
    x.dist.barrier(group=x.gloo)
    x.dist.destroy_process_group()


# ---------------------------------------------------------------------------
# the kill scenario: every step has a context or a uccl group of its own,
# so each one meets the death itself (not an earlier step's failure)
def _case_kill_setup(x: X, i, p):
    """Warm-up on the device: an all_reduce through every group and an
    allgather through every context must work before anyone dies."""
    torch, ws = x.torch, x.ws
    for step, g in x.kill_groups.items():
        t = torch.full((4097,), float(x.me + 1), device=x.dev)
        x.dist.all_reduce(t, group=g)
        same(t, torch.full((4097,), float(ws * (ws + 1) // 2)), f"{step}: warm-up all_reduce")
    for step, ctx in x.kill_ctxs.items():
        out, _ = poisoned(x, 4097 * ws, "int64")
        ctx.allgather(torch.full((4097,), x.me, dtype=torch.int64, device=x.dev), out)
        same(out, torch.arange(ws).repeat_interleave(4097), f"{step}: warm-up allgather")


def _kill_step(x: X, step: str, victim: int):
    torch, dist, dev, ws = x.torch, x.dist, x.dev, x.ws
    n = 1 << 16
    ctx, g = x.kill_ctxs.get(step), x.kill_groups.get(step)
    if step == "killed-ctx-allgather-then-next-raises":
        # stream-ordered: a one-launch allgather (up to UCCL_SG_FUSED_BYTES)
        # waits on the GPU, not the host, and may return at once; the next
        # call compares the last one's with the peers' on the host
        for _ in range(2):
            ctx.allgather(torch.ones(n, device=dev), torch.empty(ws * n, device=dev))
    elif step == "killed-ctx-recv-raises":
        ctx.recv(torch.empty(n, device=dev), src=victim)
    elif step == "killed-async-all_reduce-future-then-next-raises":
        # as torch documents for NCCL, the future's wait() orders the current
        # stream and does not wait for the GPU: a one-launch round (up to
        # UCCL_SG_FUSED_BYTES) then returns, and the next call raises
        for _ in range(2):
            dist.all_reduce(torch.ones(n, device=dev), async_op=True, group=g).get_future().wait()
    elif step == "killed-irecv-future-raises":
        dist.irecv(torch.empty(n, device=dev), src=victim, group=g).get_future().wait()
    elif step == "killed-all_reduce-then-barrier-raises":
        # the blocking form may return at once (the stream waits): the
        # barrier that follows blocks the host
        dist.all_reduce(torch.ones(n, device=dev), group=g)
        dist.barrier(group=g)
    else:
        raise ValueError(step)


def _case_kill_op(x: X, i, p):
    t0 = time.monotonic()
    try:
        _kill_step(x, p["step"], x.R.params["victim"])
    except Exception as e:  # noqa: BLE001 - what we want
        took = time.monotonic() - t0
        x.R.info.setdefault("kill", {})[p["step"]] = f"{took:.2f} s: {type(e).__name__}: {e}"[:300]
        assert took <= KILL_BOUND_S, \
            f"raised only after {took:.1f} s (bound {KILL_BOUND_S} s): {e!r}"
        return None
    raise AssertionError(f"returned normally after {time.monotonic() - t0:.1f} s with rank "
                         f"{x.R.params['victim']} dead")


def _case_kill_stream(x: X, i, p):
    """After the failures the CUDA stream must not stay blocked on them."""
    t = x.torch.ones(16, device=x.dev)
    t.add_(1)
    th = threading.Thread(target=x.sync, daemon=True)
    th.start()
    th.join(KILL_BOUND_S)
    assert not th.is_alive(), (f"torch.cuda.synchronize() still blocked {KILL_BOUND_S} s after "
                               "the failed operations")


CASES = {
    "setup": _case_ctx_setup, "ag": _case_ctx_ag, "agv": _case_ctx_agv, "p2p": _case_p2p,
    "register": _case_register, "stream_ag": _case_stream_ag, "stream_p2p": _case_stream_p2p,
    "end": _case_ctx_end,
}
PG_CASES = {
    "setup": _case_pg_setup, "ar": _case_ar, "reduce": _case_reduce, "rs": _case_rs,
    "ag": _case_ag, "agit": _case_agit, "bcast": _case_bcast, "a2a": _case_a2a,
    "a2as": _case_a2as, "gather": _case_gather, "scatter": _case_scatter, "p2p": _case_p2p,
    "async": _case_async, "barrier": _case_barrier, "obj": _case_obj,
    "stream_pg": _case_stream_pg, "nonblocking_wait": _case_nonblocking_wait, "ddp": _case_ddp,
    "fsdp": _case_fsdp, "end": _case_pg_end,
}
KILL_CASES = {"kill_setup": _case_kill_setup, "kill_op": _case_kill_op,
              "kill_stream": _case_kill_stream}


# ---------------------------------------------------------------------------
# running a plan
class Runner:
    """Runs cases, records verdicts and times, writes them after every case."""

    def __init__(self, x: X, out_path: str, deadline: float):
        self.x, self.out_path, self.deadline = x, out_path, deadline
        self.verdicts: dict = {}
        self.times: dict = {}
        self.stopped: str | None = None

    def run(self, name: str, fn, i: int, p: dict, kind: str) -> None:
        R = self.x.R
        if not self.stopped:
            if R.store.check(["abort"]):
                self.stopped = "a peer gave up: " + R.store.get("abort").decode(errors="replace")
            elif time.monotonic() > self.deadline:
                self.stopped = "the run's time was almost up"
        if self.stopped:
            self.verdicts[name] = f"not run: the run stopped earlier ({self.stopped})"
            return
        if kind in GPU_ONLY and not self.x.cuda:
            self.verdicts[name] = ("SKIP: no CUDA device (dry run on CPU tensors): stream order "
                                   "and host blocking only mean something on a GPU")
            self.flush()
            return
        print(f"[rank {R.rank}] case {name}", flush=True)
        t0 = time.monotonic()
        try:
            v = fn(self.x, i, p)
            self.verdicts[name] = v if isinstance(v, str) and v.startswith("SKIP:") else None
        except Exception as e:  # noqa: BLE001 - becomes this case's verdict
            self.verdicts[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"
            took = time.monotonic() - t0
            if not isinstance(e, AssertionError) and took > STUCK_S:
                self.stopped = (f"rank {R.rank}, case {name} raised after {took:.0f} s "
                                f"({type(e).__name__}: {e})")
                R.abort(self.stopped)
        self.times[name] = round(time.monotonic() - t0, 3)
        self.flush()

    def flush(self) -> None:
        res = {"verdicts": self.verdicts, "times": self.times, "info": self.x.R.info}
        tmp = self.out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f)
        os.replace(tmp, self.out_path)

    def run_plan(self, cases: list, table: dict) -> None:
        for i, (name, kind, p) in enumerate(cases):
            self.run(name, table[kind], i, p, kind)
        self.flush()   # the "not run" verdicts of a run that stopped


def _init_pg(R, backend: str, timeout_s: float) -> None:
    import torch.distributed as dist
    dist.init_process_group(backend, store=R.store, rank=R.rank, world_size=R.world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _context(timeout_s: float):
    from uccl_collective.collective import CollectiveContext
    return CollectiveContext(local_gpu_idx=0, use_copy_engine_for_intra=True, timeout_s=timeout_s).init()


def scenario_ctx(R, run_args) -> None:
    _init_pg(R, "gloo", GLOO_TIMEOUT_S)     # the bootstrap, and (default group) the reference
    x = X(R, gloo=None, ctx=_context(PG_TIMEOUT_S))
    x.p2p_u, x.p2p_g = CtxP2P(x.ctx), DistP2P(None)
    run = Runner(x, *run_args)
    run.run_plan(plan("ctx", R.world, R.params), CASES)


def scenario_backend(R, run_args) -> None:
    import torch.distributed as dist

    import uccl_collective  # noqa: F401  registers "uccl"
    _init_pg(R, "uccl", PG_TIMEOUT_S)
    gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    x = X(R, gloo=gloo)
    x.p2p_u, x.p2p_g = DistP2P(None), DistP2P(gloo)
    run = Runner(x, *run_args)
    run.run_plan(plan("backend", R.world, R.params), PG_CASES)


def scenario_kill(R, run_args) -> None:
    import torch.distributed as dist

    import uccl_collective  # noqa: F401
    _init_pg(R, "uccl", KILL_TIMEOUT_S)
    x = X(R)
    x.kill_ctxs = {s: _context(KILL_TIMEOUT_S) for s in KILL_STEPS if "-ctx-" in s}
    x.kill_groups = {s: dist.new_group(backend="uccl",
                                       timeout=datetime.timedelta(seconds=KILL_TIMEOUT_S))
                     for s in KILL_STEPS if "-ctx-" not in s}
    run = Runner(x, *run_args)
    cases = plan("kill", R.world, R.params)
    run.run_plan(cases[:1], KILL_CASES)
    R.barrier("armed")
    if R.rank == R.params["victim"]:   # mid-run, before the next collective
        sys.stdout.flush()
        if R.params["how"] == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)
    run.run_plan(cases[1:], KILL_CASES)


SCENARIOS = {"ctx": scenario_ctx, "backend": scenario_backend, "kill": scenario_kill}


def main(argv: list[str]) -> int:
    scenario, rank, world, port, out_path, params_json = argv
    rank, world, port = int(rank), int(world), int(port)
    params = json.loads(params_json)
    hard = float(params.get("hard_timeout", 240))
    # Hard limit: dump every thread's stack and exit, even if the parent is gone.
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.dump_traceback_later(hard, exit=True)
    threading.Thread(target=W._watch_parent, args=(os.getppid(),), daemon=True).start()
    deadline = time.monotonic() + hard - 25
    rc = 0
    R = None
    try:
        R = W.Rank(rank, world, port, params)
        if not R.cuda:
            R.torch.set_num_threads(1)   # the dry run: many ranks on a few cores
        SCENARIOS[scenario](R, (out_path, deadline))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        rc = 1
        fatal = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        try:
            with open(out_path) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {"verdicts": {}, "times": {}, "info": R.info if R else {}}
        res["fatal"] = fatal
        with open(out_path + ".tmp", "w") as f:
            json.dump(res, f)
        os.replace(out_path + ".tmp", out_path)
        if R is not None:
            try:
                R.abort(f"rank {rank}: {type(e).__name__}: {e}")
            except Exception:  # noqa: BLE001 - the store may be gone too
                pass
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: nothing at exit may wait on a peer that is gone.
    os._exit(rc)


if __name__ == "__main__":
    # Run from the importable module, not from __main__ (one copy of its classes).
    import _gpu_coll_worker
    _gpu_coll_worker.main(sys.argv[1:])
