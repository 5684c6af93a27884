"""One rank of a GPU test scenario (tests/test_gpu.py), run as its own process:

    python -m _gpu_worker SCENARIO RANK WORLD STORE_PORT OUT_JSON PARAMS_JSON

The parent (test_gpu.py) starts WORLD of these with ``subprocess`` so that
every variable torch reads when it initialises CUDA (PYTORCH_CUDA_ALLOC_CONF)
and every UCCL_* variable is in the environment from the first instruction.
The ranks meet through a torch.distributed TCPStore the parent hosts
(STORE_PORT): endpoint metadata, fifo items and "done" flags travel through it.

A scenario is a list of named cases that every rank runs in the same order.
Each case gives a verdict per rank: None (passed), "SKIP: why", or a message
saying what was wrong (which size, which bytes).  Wrong data is recorded and
the scenario goes on (both ranks stay in step); an exception (a transfer that
raised, a hang cut by a deadline) ends the scenario on that rank: it posts
"abort" in the store, closes its endpoint (which fails its peer's pending
transfers at once) and reports the remaining cases as not run.  The verdicts
go to OUT_JSON; the parent turns each case into one pytest test.

This module imports only the standard library at import time: the parent
imports it for the case lists (the plans) without touching torch or CUDA.

Without CUDA (the dev machine) the tests skip.  ``UCCL_GPU_TESTS_DRYRUN=1``
runs the matrix/tcp/ring scenarios anyway with every memory kind mapped to
pageable CPU memory and small sizes: it checks this harness, not the GPU path.
"""
from __future__ import annotations

import faulthandler
import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import zlib

MiB = 1 << 20
GiB = 1 << 30
POISON = 0xA5          # every receive buffer is filled with this first
STALE = 0x11           # stream tests: what a source holds before the delayed fill
GUARD = 4096           # poisoned bytes before and after every target range
SRC_GAP, DST_GAP = 192, 64   # poisoned bytes between iovs (different on the two
                             # sides, so sender and receiver offsets differ)
KINDS = ("gpu", "pinned", "pageable")
CELLS = [(s, d) for s in KINDS for d in KINDS]
SIZES = [0, 1, 4097, 64 * MiB]
SLEEP_CYCLES = int(2e8)   # torch.cuda._sleep: ~0.1 s of GPU spin on an H100
EP_TIMEOUT_S = 60.0       # every blocking engine call of the data scenarios
ERR_TIMEOUT_S = 10.0      # the error scenario: a send that wrongly blocks gives up soon
STORE_TIMEOUT_S = 90.0    # a rank waiting for its peer's key in the store

TWO_SIDED = ("send", "send_ipc", "sendv", "send_async", "send_tensor")
WRITES = ("write", "write_ipc", "write_async", "writev", "write_tensor")
READS = ("read", "read_ipc", "read_async", "readv", "read_tensor")
MATRIX_OPS = TWO_SIDED + WRITES + READS
TCP_OPS = ("send", "send_async", "sendv", "write", "read")
TCP_CELLS = [("gpu", "gpu"), ("gpu", "pinned"), ("gpu", "pageable"), ("pinned", "gpu"),
             ("pageable", "gpu")]
# vector ops whose iovs live in memory of different kinds (one tensor per iov)
MIXED_SRC, MIXED_DST = ["gpu", "pinned", "pageable"], ["pageable", "gpu", "pinned"]


def fmt(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def iov_lens(op: str, n: int) -> list[int]:
    """How a message of n bytes is cut: v-forms into 3 iovs (odd lengths at
    odd offsets), async forms into 2 transfers in flight at once, else one."""
    if op.endswith("v"):
        return [n // 3, n // 3, n - 2 * (n // 3)]
    if op.endswith("_async"):
        return [n // 2, n - n // 2]
    return [n]


# ---------------------------------------------------------------------------
# plans: (case name, ...) lists, the same in the parent and in every rank
def matrix_plan(cells=None, ops=None, sizes=None, big=True, mixed=True):
    """(name, op, src kind(s), dst kind(s), sizes).  src/dst follow the data:
    for reads the source is the advertising rank (1) and the destination the
    reading rank (0)."""
    cells = [tuple(c) for c in (cells or CELLS)]
    plan = []
    for op in ops or MATRIX_OPS:
        for s, d in cells:
            plan.append((f"{op}:{s}->{d}", op, s, d, list(sizes or SIZES)))
    if mixed:
        for op in ("sendv", "writev", "readv"):
            plan.append((f"{op}:mixed", op, MIXED_SRC, MIXED_DST, list(sizes or SIZES)))
    if big:
        plan.append(("send:gpu->gpu:1GiB", "send", "gpu", "gpu", [GiB]))
        plan.append(("write:gpu->gpu:1GiB", "write", "gpu", "gpu", [GiB]))
    return plan


RING_PHASES = ("ring:async", "ring:threads", "ring:one-sided")


def stream_plan():
    """(name, path, op, src kind, dst kind, size, delay).  delay: which side
    queues a ~0.1 s GPU spin and then a kernel touching the buffer right
    before calling the engine: 'src' (sender fills its source late), 'dst'
    (receiver poisons its destination late), 'both', or 'side' (both, on a
    non-default torch stream made current with torch.cuda.stream)."""
    plan = []
    two = [("gpu", "gpu", ("src", "dst", "both")), ("gpu", "pinned", ("src",)),
           ("gpu", "pageable", ("src",)), ("pinned", "gpu", ("dst",)), ("pageable", "gpu", ("dst",))]
    for path in ("same", "tcp"):
        for op, sizes in (("send", (4097, 64 * MiB)), ("send_async", (64 * MiB,))):
            for n in sizes:
                for s, d, delays in two:
                    for dl in delays:
                        plan.append((f"{op}:{path}:{s}->{d}:{dl}:{fmt(n)}", path, op, s, d, n, dl))
        n = 64 * MiB
        for d in KINDS:
            plan.append((f"write:{path}:gpu->{d}:src:{fmt(n)}", path, "write", "gpu", d, n, "src"))
        for s in KINDS:
            plan.append((f"read:{path}:{s}->gpu:dst:{fmt(n)}", path, "read", s, "gpu", n, "dst"))
        plan.append((f"send:{path}:gpu->gpu:side:{fmt(n)}", path, "send", "gpu", "gpu", n, "side"))
    return plan


ERROR_STEPS = ("reg_nonsense_ptr", "reg_past_end", "reg_span_two_allocations", "freed_send",
               "freed_recv", "reuse_send_after_dereg", "reuse_send_stale_region_kept",
               "reuse_recv", "reuse_write", "stale_fifo_refused", "reuse_read",
               "stale_region_send_refused", "still_usable")


def case_names(scenario: str, params: dict) -> list[str]:
    """Every verdict key a scenario produces, in order ('setup' first)."""
    if scenario == "matrix":
        names = [c[0] for c in matrix_plan(**params.get("plan", {}))]
    elif scenario == "ring":
        names = list(RING_PHASES)
    elif scenario == "stream":
        names = [c[0] for c in stream_plan()]
    elif scenario == "errors":
        names = list(ERROR_STEPS)
    elif scenario == "upstream":
        from _gpu_upstream import upstream_plan
        names = [c[0] for c in upstream_plan()]
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    return ["setup"] + names


# ---------------------------------------------------------------------------
# the rank's context: store, endpoint helpers, memory
class Aborted(Exception):
    """The peer gave up (posted 'abort' in the store)."""


class Rank:
    def __init__(self, rank, world, store_port, params):
        import datetime

        import torch
        import torch.distributed as dist

        self.torch = torch
        self.rank, self.world, self.params = rank, world, params
        self.seed = int(params["seed"])
        self.cuda = torch.cuda.is_available()
        self.dev = "cuda" if self.cuda else "cpu"   # the current device: self.gpu
        # params["gpus"]: spread the ranks over that many GPUs (rank r on GPU
        # r % gpus); else every rank on GPU 0
        self.gpu = rank % int(params.get("gpus", 1))
        self.store = dist.TCPStore("127.0.0.1", store_port, world, False,
                                   timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        self.info: dict = {"pid": os.getpid(), "torch": torch.__version__}
        if self.cuda:
            torch.cuda.set_device(self.gpu)
            torch.cuda.init()
            self.info["device"] = f"{torch.cuda.get_device_name(self.gpu)} (GPU {self.gpu})"
        torch.set_num_threads(4)

    # -- store ---------------------------------------------------------------
    def put(self, key, value) -> None:
        self.store.set(key, pickle.dumps(value))

    def get(self, key, timeout: float = STORE_TIMEOUT_S):
        """The value of key once a peer has set it; Aborted if a peer gave up."""
        deadline = time.monotonic() + timeout
        while True:
            if self.store.check([key]):
                return pickle.loads(self.store.get(key))
            if self.store.check(["abort"]):
                raise Aborted(self.store.get("abort").decode(errors="replace"))
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: no {key!r} in the store within {timeout} s")
            time.sleep(0.0005)

    def barrier(self, name: str) -> None:
        self.put(f"barrier/{name}/{self.rank}", True)
        for r in range(self.world):
            self.get(f"barrier/{name}/{r}")

    def abort(self, why: str) -> None:
        if not self.store.check(["abort"]):
            self.store.set("abort", why.encode())

    # -- memory ----------------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def alloc(self, kind: str, nbytes: int):
        """A uint8 tensor of nbytes of the given kind, all POISON, synchronized."""
        torch = self.torch
        if not self.cuda:      # dry run: every kind is pageable memory
            kind = "pageable"
        if kind == "gpu":
            t = torch.full((nbytes,), POISON, dtype=torch.uint8, device="cuda")
        elif kind == "pinned":
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            assert t.is_pinned(), "pin_memory=True gave pageable memory"
            t.fill_(POISON)
        elif kind == "pageable":
            t = torch.full((nbytes,), POISON, dtype=torch.uint8)
        else:
            raise ValueError(f"unknown memory kind {kind!r}")
        self.sync()
        return t

    def gen(self, seed: int, n: int, out=None):
        """n reproducible random bytes on the device (the same in every rank:
        both ends of a transfer generate them from the case's seed); into
        `out` (a contiguous uint8 tensor of n bytes on the device) if given."""
        torch = self.torch
        g = torch.Generator(device=self.dev)
        g.manual_seed(seed)
        if out is not None:
            return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g, out=out)
        return torch.randint(0, 256, (n,), dtype=torch.uint8, device=self.dev, generator=g)


class Bufs:
    """One side's memory for one transfer: iov i lives at byte offset off_i of
    tensor t[b_i]; every other byte of the tensors is POISON (a GUARD before
    the first iov, a gap between iovs, a GUARD after the last one).

    kinds: one kind (str) -> one tensor holding all iovs; a list -> one tensor
    of that kind per iov (mixed-kind vectors)."""

    def __init__(self, R: Rank, kinds, lens, gap):
        self.R, self.lens = R, list(lens)
        if isinstance(kinds, str):
            offs, o = [], GUARD
            for n in self.lens:
                offs.append(o)
                o += n + gap
            self.t = [R.alloc(kinds, o - gap + GUARD)]
            self.where = [(0, off, n) for off, n in zip(offs, self.lens)]
        else:
            assert len(kinds) == len(self.lens)
            self.t = [R.alloc(k, GUARD + n + GUARD) for k, n in zip(kinds, self.lens)]
            self.where = [(i, GUARD, n) for i, n in enumerate(self.lens)]
        self._mrs: list[int] = []

    def ptrs(self) -> list[int]:
        return [self.t[b].data_ptr() + off for b, off, _ in self.where]

    def views(self):
        return [self.t[b][off:off + n] for b, off, n in self.where]

    def reg(self, ep) -> list[int]:
        """Register every tensor whole (guards included: the engine must use
        sub-ranges of a region correctly); returns one mr_id per iov."""
        self._mrs = []
        for t in self.t:
            ret = ep.reg(t.data_ptr(), t.numel())
            assert isinstance(ret, tuple) and ret[0] is True, f"reg returned {ret!r}"
            self._mrs.append(ret[1])
        return [self._mrs[b] for b, _, _ in self.where]

    def reg_tensors(self, ep) -> list[int]:
        """Same through the tensor helper reg_tensor."""
        self._mrs = [ep.reg_tensor(t) for t in self.t]
        return [self._mrs[b] for b, _, _ in self.where]

    def dereg(self, ep) -> None:
        for m in self._mrs:
            ep.dereg(m)
        self._mrs = []

    def fill(self, seeds, fill_value=None) -> None:
        """Random bytes (seeds[i] for iov i) into every iov, then synchronize:
        data-path cases test data movement, not stream order."""
        for v, s in zip(self.views(), seeds):
            if v.numel():
                if fill_value is None:
                    v.copy_(self.R.gen(s, v.numel()))
                else:
                    v.fill_(fill_value)
        self.R.sync()

    def check(self, seeds, what: str, tensors=None) -> list[str]:
        """Problems (empty: fine): every iov must hold its seed's bytes and
        every other byte must still be POISON.  tensors: check these (same
        shapes, e.g. clones taken right after a recv) instead of self.t."""
        R, torch = self.R, self.R.torch
        out = []
        for ti, t in enumerate(tensors if tensors is not None else self.t):
            got = t if t.device.type == R.dev else t.to(R.dev)
            exp = torch.full_like(got, POISON)
            for (b, off, n), s in zip(self.where, seeds):
                if b == ti and n:
                    exp[off:off + n] = R.gen(s, n)
            if not torch.equal(got, exp):
                out.append(f"{what}: {self._diff(got, exp, ti, seeds)}")
        return out

    def _diff(self, got, exp, ti, seeds) -> str:
        bad = got != exp
        total_bad = int(bad.sum())
        parts, in_data = [], 0
        for j, ((b, off, n), s) in enumerate(zip(self.where, seeds)):
            if b != ti or not n:
                continue
            seg = bad[off:off + n]
            k = int(seg.sum())
            in_data += k
            if k:
                first = int(seg.nonzero()[0])
                g, e = int(got[off + first]), int(exp[off + first])
                stale = ""
                body = got[off:off + n]
                if bool((body == POISON).all()):
                    stale = " (all still POISON: nothing arrived)"
                elif bool((body == STALE).all()):
                    stale = " (all the source's earlier STALE bytes)"
                parts.append(f"iov {j} ({n} bytes, seed {s}): {k} bytes wrong, first at byte "
                             f"{first}: got {g:#04x} want {e:#04x}{stale}")
        outside = total_bad - in_data
        if outside:
            first = None
            mask = bad.clone()
            for (b, off, n) in self.where:
                if b == ti:
                    mask[off:off + n] = False
            idx = mask.nonzero()
            if idx.numel():
                first = int(idx[0])
            parts.append(f"{outside} guard/gap bytes overwritten (first at tensor byte {first} "
                         f"of {got.numel()}; iovs at {[(o, n) for b, o, n in self.where if b == ti]})")
        return "; ".join(parts) or "tensors differ"


def catch(fn, *args, **kwargs):
    """Run fn; None if it returned, else a dict describing what it raised."""
    import uccl_collective

    t0 = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - described to the parent
        return dict(type=type(e).__name__, msg=str(e), value=isinstance(e, ValueError),
                    uccl=isinstance(e, uccl_collective.UcclError),
                    timeout=isinstance(e, uccl_collective.UcclTimeoutError),
                    elapsed=time.monotonic() - t0)
    return None


def must_raise(err, ptr, what: str) -> list[str]:
    """The contract for refused memory: ValueError or UcclError (not a
    timeout: that means the engine accepted the memory and then waited),
    with the pointer in hex in the message (ptr: an int, or a tuple of
    pointers of which the message must name one)."""
    ptrs = ptr if isinstance(ptr, tuple) else (ptr,)
    if err is None:
        return [f"{what}: did not raise"]
    if err["timeout"]:
        return [f"{what}: timed out after {err['elapsed']:.1f} s instead of refusing the memory "
                f"({err['type']}: {err['msg']})"]
    out = []
    if not (err["value"] or err["uccl"]):
        out.append(f"{what}: raised {err['type']} (want ValueError or UcclError): {err['msg']}")
    if not any(f"{p:x}" in err["msg"].lower() for p in ptrs):
        out.append(f"{what}: message names none of {[hex(p) for p in ptrs]}: {err['msg']!r}")
    return out


def finish(ep, ids, bound: float = EP_TIMEOUT_S) -> None:
    """Poll every transfer id until all are done (bounded), then wait() (which
    raises a failed transfer's error) and release() each."""
    pending = list(ids)
    deadline = time.monotonic() + bound
    while pending:
        for t in list(pending):
            ret = ep.poll_async(t)
            assert isinstance(ret, tuple) and ret[0] is True, f"poll_async returned {ret!r}"
            if ret[1]:
                pending.remove(t)
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"transfers {pending} not done within {bound} s")
            time.sleep(0.0002)
    for t in ids:
        assert ep.wait(t) is True
        assert ep.release(t) is True


def _ok(ret, what: str) -> None:
    assert ret is True, f"{what} returned {ret!r}, want True"


def _posted(ret, what: str) -> int:
    assert isinstance(ret, tuple) and len(ret) == 2 and ret[0] is True, \
        f"{what} returned {ret!r}, want (True, id)"
    return ret[1]


def make_endpoint(R: Rank, **kw):
    from uccl_collective.p2p import Endpoint

    kw.setdefault("port", 0)
    kw.setdefault("timeout_s", EP_TIMEOUT_S)
    return Endpoint(0 if R.cuda else None, 4, **kw)


def pair_connect(R: Rank, ep, tag: str = "main"):
    """Rank 1 accepts, rank 0 connects (connections are one-way: rank 0
    sends, writes and reads; rank 1 receives and advertises)."""
    if R.rank == 1:
        R.put(f"meta/{tag}", ep.get_metadata())
        ok, _ip, _gpu, conn = ep.accept(timeout=60)
        assert ok is True
    else:
        ok, conn = ep.add_remote_endpoint(R.get(f"meta/{tag}"))
        assert ok is True
    return conn


def allocator_problems(R: Rank) -> list[str]:
    """'setup': the allocator setting asked for is the one in effect."""
    if not R.cuda:
        return []
    torch = R.torch
    want = R.params.get("alloc", "default") == "expandable"
    probe = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    segs = torch.cuda.memory_snapshot()
    expandable = any(s.get("is_expandable", False) for s in segs)
    del probe
    R.info["expandable_segments"] = expandable
    if "is_expandable" not in (segs[0] if segs else {}):
        return []   # this torch does not say; nothing to check
    if want != expandable:
        return [f"allocator: expandable segments {'off' if want else 'on'} although "
                f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r}"]
    return []


# ---------------------------------------------------------------------------
# running cases: verdicts, stop at the first exception
class Runner:
    def __init__(self, R: Rank, names: list[str]):
        self.R, self.names = R, names
        self.verdicts: dict[str, str | None] = {}
        self.times: dict[str, float] = {}
        self.stopped: str | None = None

    def run(self, name: str, fn, *args) -> None:
        if self.stopped:
            self.verdicts[name] = f"not run: the scenario stopped earlier ({self.stopped})"
            return
        print(f"[rank {self.R.rank}] case {name}", flush=True)
        t0 = time.monotonic()
        try:
            problems = fn(*args)
            if problems and isinstance(problems, str):     # "SKIP: ..."
                self.verdicts[name] = problems
            else:
                self.verdicts[name] = "; ".join(problems) if problems else None
        except Aborted as e:
            self.stopped = f"a peer gave up: {e}"
            self.verdicts[name] = f"not finished: {self.stopped}"
        except Exception as e:  # noqa: BLE001 - becomes this case's verdict
            self.stopped = f"rank {self.R.rank}, case {name}: {type(e).__name__}: {e}"
            self.verdicts[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-6)}"
            self.R.abort(self.stopped)
        self.times[name] = round(time.monotonic() - t0, 3)

    def end(self) -> None:
        """The last barrier (nobody closes an endpoint a peer still uses);
        skipped once stopped, and a peer that gave up meanwhile is no error."""
        if self.stopped:
            return
        try:
            self.R.barrier("end")
        except (Aborted, TimeoutError) as e:
            self.R.info["end_barrier"] = f"{type(e).__name__}: {e}"

    def result(self) -> dict:
        for n in self.names:
            self.verdicts.setdefault(n, f"not run ({self.stopped or 'never reached'})")
        return {"verdicts": self.verdicts, "times": self.times, "info": self.R.info}


# ---------------------------------------------------------------------------
# scenario: the data matrix (same host or TCP, by the environment)
# two-sided op -> (the sender's call, the receiver's call)
_TWO_SIDED = {"send": ("send", "recv"), "send_ipc": ("send_ipc", "recv_ipc"),
              "sendv": ("sendv", "recvv"), "send_async": ("send_async", "recv_async"),
              "send_tensor": ("send_tensor", "recv_tensor")}


def _two_sided_call(ep, conn, op, name, bufs, mrs, ptrs, lens) -> None:
    """One side of a two-sided op, through Endpoint method `name`."""
    fn = getattr(ep, name)
    if op == "sendv":
        _ok(fn(conn, mrs, ptrs, lens, len(lens)), name)
    elif op == "send_async":
        finish(ep, [_posted(fn(conn, m, p, n), name) for m, p, n in zip(mrs, ptrs, lens)])
    elif op == "send_tensor":
        _ok(fn(conn, mrs[0], bufs.views()[0]), name)
    else:
        _ok(fn(conn, mrs[0], ptrs[0], lens[0]), name)


def _two_sided(R, ep, conn, op, key, skind, dkind, lens, seeds) -> list[str]:
    sender = R.rank == 0
    bufs = Bufs(R, skind, lens, SRC_GAP) if sender else Bufs(R, dkind, lens, DST_GAP)
    if sender:
        bufs.fill(seeds)
    mrs = bufs.reg_tensors(ep) if op == "send_tensor" else bufs.reg(ep)
    _two_sided_call(ep, conn, op, _TWO_SIDED[op][0 if sender else 1], bufs, mrs, bufs.ptrs(), lens)
    probs = bufs.check(seeds, "sender's source changed" if sender else "received")
    bufs.dereg(ep)
    return probs


def _advertise(ep, conn, op, bufs, mrs) -> list[bytes]:
    ptrs, lens, k = bufs.ptrs(), bufs.lens, len(bufs.lens)
    if op.endswith("v"):
        ok, fifos = ep.advertisev(conn, mrs, ptrs, lens, k)
        assert ok is True and len(fifos) == k
    elif op.endswith("_ipc"):
        fifos = [ep.advertise_ipc(conn, mrs[0], ptrs[0], lens[0])[1]]
    elif op.endswith("_tensor"):
        fifos = [ep.advertise_tensor(conn, mrs[0], bufs.views()[0])]
    else:
        fifos = [ep.advertise(conn, m, p, n)[1] for m, p, n in zip(mrs, ptrs, lens)]
    return [bytes(f) for f in fifos]


def _one_sided_initiate(ep, conn, op, bufs, mrs, fifos) -> None:
    """write*/read* from rank 0: src (writes) or dst (reads) are bufs."""
    ptrs, lens, k = bufs.ptrs(), bufs.lens, len(bufs.lens)
    base = op.split("_")[0].rstrip("v")            # "write" or "read"
    if op in ("write", "read"):
        _ok(getattr(ep, base)(conn, mrs[0], ptrs[0], lens[0], fifos[0]), op)
    elif op.endswith("_ipc"):
        _ok(getattr(ep, f"{base}_ipc")(conn, mrs[0], ptrs[0], lens[0], fifos[0]), op)
    elif op.endswith("_async"):
        post = getattr(ep, f"{base}_async")
        finish(ep, [_posted(post(conn, m, p, n, f), op)
                    for m, p, n, f in zip(mrs, ptrs, lens, fifos)])
    elif op.endswith("v"):
        _ok(getattr(ep, f"{base}v")(conn, mrs, ptrs, lens, fifos, k), op)
    elif op.endswith("_tensor"):
        _ok(getattr(ep, f"{base}_tensor")(conn, mrs[0], bufs.views()[0], fifos[0]), op)
    else:
        raise ValueError(op)


def _write(R, ep, conn, op, key, skind, dkind, lens, seeds) -> list[str]:
    tensor_reg = op.endswith("_tensor")
    if R.rank == 1:      # the target: advertise a poisoned window, check it once written
        dst = Bufs(R, dkind, lens, DST_GAP)
        mrs = dst.reg_tensors(ep) if tensor_reg else dst.reg(ep)
        R.put(f"{key}/fifo", _advertise(ep, conn, op, dst, mrs))
        R.get(f"{key}/written")
        probs = dst.check(seeds, "written window")
        dst.dereg(ep)
        return probs
    fifos = R.get(f"{key}/fifo")
    src = Bufs(R, skind, lens, SRC_GAP)
    src.fill(seeds)
    mrs = src.reg_tensors(ep) if tensor_reg else src.reg(ep)
    _one_sided_initiate(ep, conn, op, src, mrs, fifos)
    # The target looks with its own kernels: whatever this process still has
    # queued for the write must be finished first (stream semantics).
    R.sync()
    R.put(f"{key}/written", True)
    probs = src.check(seeds, "writer's source changed")
    src.dereg(ep)
    return probs


def _read(R, ep, conn, op, key, skind, dkind, lens, seeds) -> list[str]:
    tensor_reg = op.endswith("_tensor")
    if R.rank == 1:      # the target: advertise random bytes, check they are unchanged
        src = Bufs(R, skind, lens, SRC_GAP)
        src.fill(seeds)   # synchronized: the reader cannot order itself after our stream
        mrs = src.reg_tensors(ep) if tensor_reg else src.reg(ep)
        R.put(f"{key}/fifo", _advertise(ep, conn, op, src, mrs))
        R.get(f"{key}/read")
        probs = src.check(seeds, "read target's source changed")
        src.dereg(ep)
        return probs
    fifos = R.get(f"{key}/fifo")
    dst = Bufs(R, dkind, lens, DST_GAP)
    mrs = dst.reg_tensors(ep) if tensor_reg else dst.reg(ep)
    _one_sided_initiate(ep, conn, op, dst, mrs, fifos)
    probs = dst.check(seeds, "read into")
    R.put(f"{key}/read", True)
    dst.dereg(ep)
    return probs


def _matrix_case(R, ep, conn, i, case) -> list[str]:
    name, op, skind, dkind, sizes = case
    fn = _two_sided if op in TWO_SIDED else _write if op in WRITES else _read
    problems = []
    for si, n in enumerate(sizes):
        if n == 0 and op.endswith("_tensor"):
            # torch gives an empty tensor data_ptr() 0, which no region holds
            # (buffer_of passes it on); size 0 is covered by the pointer ops.
            continue
        lens = iov_lens(op, n)
        seed = R.seed + i * 1000 + si * 10
        seeds = [seed + j for j in range(len(lens))]
        for p in fn(R, ep, conn, op, f"{name}/{n}", skind, dkind, lens, seeds):
            problems.append(f"{fmt(n)} (seed {seed}): {p}")
    return problems


def scenario_matrix(R: Rank, names: list[str]) -> dict:
    plan = matrix_plan(**R.params.get("plan", {}))
    run = Runner(R, names)
    ep = make_endpoint(R)
    conn = pair_connect(R, ep)
    tp = ep.conn_transport(conn)
    R.info["transport"] = tp

    def setup():
        probs = allocator_problems(R)
        want = R.params.get("expect_transport", "same-host")
        if want == "tcp" and tp != "tcp":
            probs.append(f"conn_transport() is {tp!r}, want 'tcp' (the ranks are on different "
                         "'hosts' or UCCL_P2P_TRANSPORT=tcp)")
        if want == "same-host" and tp == "tcp":
            probs.append("conn_transport() is 'tcp' between two processes of one host")
        if want not in ("tcp", "same-host") and tp != want:
            probs.append(f"conn_transport() is {tp!r}, want {want!r}")
        return probs

    run.run("setup", setup)
    for i, case in enumerate(plan):
        run.run(case[0], _matrix_case, R, ep, conn, i, case)
    run.end()
    ep.close()
    return run.result()


# ---------------------------------------------------------------------------
# scenario: 2-4 ranks on the one GPU, all connected, transfers in flight at once
RING_MSGS = [  # (source kind, destination kind, size): each ring direction carries all
    ("gpu", "gpu", 64 * MiB + 3), ("gpu", "pinned", 4 * MiB + 1), ("pinned", "gpu", 4097),
    ("pageable", "gpu", 1 * MiB), ("gpu", "pageable", 3 * MiB), ("gpu", "gpu", 1),
    ("gpu", "gpu", 0), ("pinned", "pageable", 2 * MiB + 5)]


def _rseed(R, src_rank, *parts) -> int:
    """A seed every rank computes alike (str hashes differ between processes)."""
    return (R.seed + zlib.crc32(repr((src_rank,) + parts).encode())) % (1 << 62)


def scenario_ring(R: Rank, names: list[str]) -> dict:
    import uccl_collective.p2p as p2p

    n, r = R.world, R.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    cap = int(R.params.get("max_size", 1 << 62))
    run = Runner(R, names)
    ep = make_endpoint(R, rank=r)
    R.put(f"meta/{r}", ep.get_metadata())
    acc: dict[int, int] = {}   # peer rank -> connection it opened to us (we receive on it)
    acc_err: list[BaseException] = []

    def acceptor():
        try:
            for _ in range(n - 1):
                ok, _ip, _gpu, c = ep.accept(timeout=60)
                acc[ep.conn_peer_rank(c)] = c
        except BaseException as e:  # noqa: BLE001 - re-raised by the main thread
            acc_err.append(e)

    th = threading.Thread(target=acceptor, daemon=True)
    th.start()
    out: dict[int, int] = {}   # peer rank -> our connection to it (we send, write, read on it)
    for s in range(n):
        if s != r:
            ip, port, gpu = p2p.Endpoint.parse_metadata(R.get(f"meta/{s}"))
            out[s] = ep.connect(ip, gpu, remote_port=port, rank=s)[1]
    th.join(90)
    if acc_err:
        raise acc_err[0]
    assert not th.is_alive() and sorted(acc) == sorted(out), f"accepted {sorted(acc)}"
    tps = {s: ep.conn_transport(c) for s, c in list(out.items()) + list(acc.items())}
    R.info["transports"] = sorted(set(tps.values()))

    def setup():
        probs = allocator_problems(R)
        if "tcp" in tps.values():
            probs.append(f"same-host connections report {tps}")
        return probs

    def both_ways():
        # Every rank sends RING_MSGS to its next and to its previous rank and
        # receives them from both, all posted at once (4 connections busy per
        # rank from 3 ranks on).  Messages on one connection match in posting
        # order: direction +1 first, then -1, on every rank.
        ids, rx = [], []
        for d in (1, -1):
            frm = (r - d) % n
            for i, (sk, dk, size) in enumerate(RING_MSGS):
                size = min(size, cap)
                b = Bufs(R, dk, [size], DST_GAP)
                m = b.reg(ep)
                ids.append(_posted(ep.recv_async(acc[frm], m[0], b.ptrs()[0], size), "recv_async"))
                rx.append((b, [_rseed(R, frm, "ring", d, i)], f"from rank {frm} dir {d:+d} msg {i} "
                           f"({sk}->{dk}, {size} bytes)"))
        tx = []
        for d in (1, -1):
            to = (r + d) % n
            for i, (sk, dk, size) in enumerate(RING_MSGS):
                size = min(size, cap)
                b = Bufs(R, sk, [size], SRC_GAP)
                seeds = [_rseed(R, r, "ring", d, i)]
                b.fill(seeds)
                m = b.reg(ep)
                ids.append(_posted(ep.send_async(out[to], m[0], b.ptrs()[0], size), "send_async"))
                tx.append((b, seeds, f"to rank {to} dir {d:+d} msg {i}"))
        finish(ep, ids)
        probs = []
        for b, seeds, what in rx:
            probs += b.check(seeds, f"received {what}")
        for b, seeds, what in tx:
            probs += b.check(seeds, f"source changed sending {what}")
        for b, _, _ in rx + tx:
            b.dereg(ep)
        return probs

    def threads():
        # Blocking send (to next) and blocking recv (from previous) from two
        # Python threads at once: the engine must release the GIL and let both run.
        probs: list[str] = []
        errs: list[str] = []
        size = min(16 * MiB, cap)

        def sender():
            try:
                for k in range(4):
                    b = Bufs(R, "gpu", [size + k], SRC_GAP)
                    b.fill([_rseed(R, r, "thr", k)])
                    m = b.reg(ep)
                    _ok(ep.send(out[nxt], m[0], b.ptrs()[0], size + k), "send")
                    b.dereg(ep)
            except Exception as e:  # noqa: BLE001
                errs.append(f"sender thread: {type(e).__name__}: {e}")

        def receiver():
            try:
                for k in range(4):
                    b = Bufs(R, "gpu", [size + k], DST_GAP)
                    m = b.reg(ep)
                    _ok(ep.recv(acc[prv], m[0], b.ptrs()[0], size + k), "recv")
                    probs.extend(b.check([_rseed(R, prv, "thr", k)], f"thread recv {k} from {prv}"))
                    b.dereg(ep)
            except Exception as e:  # noqa: BLE001
                errs.append(f"receiver thread: {type(e).__name__}: {e}")

        ts = [threading.Thread(target=f, daemon=True) for f in (sender, receiver)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(EP_TIMEOUT_S + 10)
        if any(t.is_alive() for t in ts):
            raise TimeoutError("a transfer thread did not finish")
        if errs:
            raise RuntimeError("; ".join(errs))
        return probs

    def one_sided():
        # Each rank exposes a poisoned GPU window W and a pinned source S to its
        # previous rank; every rank writes into its next rank's W and reads its
        # next rank's S, both in flight at once.
        wsz, ssz = min(8 * MiB + 5, cap), min(8 * MiB + 7, cap)
        W = Bufs(R, "gpu", [wsz], DST_GAP)
        S = Bufs(R, "pinned", [ssz], SRC_GAP)
        s_seeds = [_rseed(R, r, "S")]
        S.fill(s_seeds)
        wm, sm = W.reg(ep), S.reg(ep)
        R.put(f"r3/fifo/{r}", (ep.advertise(acc[prv], wm[0], W.ptrs()[0], wsz)[1],
                               ep.advertise(acc[prv], sm[0], S.ptrs()[0], ssz)[1]))
        fw, fs = R.get(f"r3/fifo/{nxt}")
        src = Bufs(R, "gpu", [wsz], SRC_GAP)
        w_seeds = [_rseed(R, r, "W")]
        src.fill(w_seeds)
        dst = Bufs(R, "pageable", [ssz], DST_GAP)
        src_m, dst_m = src.reg(ep), dst.reg(ep)
        ids = [_posted(ep.write_async(out[nxt], src_m[0], src.ptrs()[0], wsz, fw), "write_async"),
               _posted(ep.read_async(out[nxt], dst_m[0], dst.ptrs()[0], ssz, fs), "read_async")]
        finish(ep, ids)
        probs = dst.check([_rseed(R, nxt, "S")], f"read from rank {nxt}")
        R.sync()
        R.put(f"r3/written/{r}", True)
        R.get(f"r3/written/{prv}")
        probs += W.check([_rseed(R, prv, "W")], f"window written by rank {prv}")
        probs += S.check(s_seeds, "source read by the previous rank changed")
        R.barrier("r3")   # nobody frees a window a peer may still touch
        for b in (W, S, src, dst):
            b.dereg(ep)
        return probs

    run.run("setup", setup)
    run.run("ring:async", both_ways)
    run.run("ring:threads", threads)
    run.run("ring:one-sided", one_sided)
    run.end()
    ep.close()
    return run.result()


# ---------------------------------------------------------------------------
# scenario: stream order (NCCL's rule: the engine's copy waits for the work
# queued before the call on torch's current stream, and a blocking call
# returns with the data in place for that stream)
def _delayed_fill(R, bufs, seeds) -> None:
    """Source side: STALE bytes (synchronized), then a ~0.1 s GPU spin and the
    random fill queued behind it, NOT synchronized: a transfer that does not
    wait for the current stream carries STALE bytes."""
    bufs.fill(seeds, fill_value=STALE)
    R.torch.cuda._sleep(SLEEP_CYCLES)
    for v, s in zip(bufs.views(), seeds):
        if v.numel():
            v.copy_(R.gen(s, v.numel()))


def _delayed_poison(R, bufs) -> None:
    """Destination side: a spin, then a kernel writing the whole buffer,
    queued before the receive: the received bytes must land after it."""
    R.torch.cuda._sleep(SLEEP_CYCLES)
    for t in bufs.t:
        t.fill_(POISON)


def _stream_case(R, eps, conns, i, case) -> list[str]:
    import contextlib

    torch = R.torch
    name, path, op, sk, dk, n, delay = case
    ep, conn = eps[path], conns[path]
    key = name
    seeds = [R.seed + 7 * i]
    src_late = delay in ("src", "both", "side")
    dst_late = delay in ("dst", "both", "side")
    # 'side': everything, engine call included, on a non-default stream
    ctx = torch.cuda.stream(torch.cuda.Stream()) if delay == "side" else contextlib.nullcontext()
    if op in ("send", "send_async"):
        if R.rank == 0:
            src = Bufs(R, sk, [n], SRC_GAP)
            mrs = src.reg(ep)
            with ctx:
                if src_late:
                    _delayed_fill(R, src, seeds)
                else:
                    src.fill(seeds)
                if op == "send":
                    _ok(ep.send(conn, mrs[0], src.ptrs()[0], n), "send")
                else:
                    finish(ep, [_posted(ep.send_async(conn, mrs[0], src.ptrs()[0], n), "send_async")])
            R.sync()
            src.dereg(ep)
            return []
        dst = Bufs(R, dk, [n], DST_GAP)
        mrs = dst.reg(ep)
        with ctx:
            if dst_late:
                _delayed_poison(R, dst)
            if op == "send":
                _ok(ep.recv(conn, mrs[0], dst.ptrs()[0], n), "recv")
            else:
                finish(ep, [_posted(ep.recv_async(conn, mrs[0], dst.ptrs()[0], n), "recv_async")])
            seen = [t.clone() for t in dst.t]   # read at once, by a kernel on the current stream
        R.sync()   # the check below runs on the default stream; the clones are already queued
        probs = dst.check(seeds, "read right after the receive returned", tensors=seen)
        dst.dereg(ep)
        return probs
    if op == "write":     # the writer's source is filled late
        if R.rank == 1:
            dst = Bufs(R, dk, [n], DST_GAP)
            mrs = dst.reg(ep)
            R.put(f"{key}/fifo", ep.advertise(conn, mrs[0], dst.ptrs()[0], n)[1])
            R.get(f"{key}/written")
            probs = dst.check(seeds, "written window")
            dst.dereg(ep)
            return probs
        fifo = R.get(f"{key}/fifo")
        src = Bufs(R, sk, [n], SRC_GAP)
        mrs = src.reg(ep)
        _delayed_fill(R, src, seeds)
        _ok(ep.write(conn, mrs[0], src.ptrs()[0], n, fifo), "write")
        R.sync()
        R.put(f"{key}/written", True)
        src.dereg(ep)
        return []
    # read: the reader's destination is poisoned late
    if R.rank == 1:
        src = Bufs(R, sk, [n], SRC_GAP)
        src.fill(seeds)
        mrs = src.reg(ep)
        R.put(f"{key}/fifo", ep.advertise(conn, mrs[0], src.ptrs()[0], n)[1])
        R.get(f"{key}/read")
        src.dereg(ep)
        return []
    fifo = R.get(f"{key}/fifo")
    dst = Bufs(R, dk, [n], DST_GAP)
    mrs = dst.reg(ep)
    _delayed_poison(R, dst)
    _ok(ep.read(conn, mrs[0], dst.ptrs()[0], n, fifo), "read")
    seen = [t.clone() for t in dst.t]
    R.sync()
    probs = dst.check(seeds, "read right after read() returned", tensors=seen)
    R.put(f"{key}/read", True)
    dst.dereg(ep)
    return probs


def scenario_stream(R: Rank, names: list[str]) -> dict:
    run = Runner(R, names)
    # Two endpoints per rank: one same-host, one told (host_id=) that the peer
    # is another host, so the same cases run over shared memory/CUDA IPC and TCP.
    eps = {"same": make_endpoint(R),
           "tcp": make_endpoint(R, host_id=f"uccl-gpu-stream-{R.seed}-rank{R.rank}")}
    conns = {k: pair_connect(R, e, k) for k, e in eps.items()}
    tps = {k: eps[k].conn_transport(c) for k, c in conns.items()}
    R.info["transports"] = tps

    def setup():
        probs = allocator_problems(R)
        if tps["tcp"] != "tcp":
            probs.append(f"host_id differing: conn_transport() is {tps['tcp']!r}, want 'tcp'")
        if tps["same"] == "tcp":
            probs.append("same host: conn_transport() is 'tcp'")
        return probs

    run.run("setup", setup)
    for i, case in enumerate(stream_plan()):
        run.run(case[0], _stream_case, R, eps, conns, i, case)
    run.end()
    for e in eps.values():
        e.close()
    return run.result()


def _scenario(name: str):
    if name == "errors":
        from _gpu_errors import scenario_errors   # its own file: long, and GPU-only
        return scenario_errors
    if name == "upstream":
        from _gpu_upstream import scenario_upstream   # its own file, as errors
        return scenario_upstream
    return {"matrix": scenario_matrix, "ring": scenario_ring, "stream": scenario_stream}[name]


# ---------------------------------------------------------------------------
def _watch_parent(parent: int) -> None:
    """Exit if the parent test process goes away (nobody would read our result)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def main(argv: list[str]) -> int:
    scenario, rank, world, port, out_path, params_json = argv
    rank, world, port = int(rank), int(world), int(port)
    params = json.loads(params_json)
    # Hard limit: dump every thread's stack and exit, even if the parent is gone.
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.dump_traceback_later(float(params.get("hard_timeout", 240)), exit=True)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()

    result: dict = {"rank": rank}
    rc = 0
    R = None
    try:
        R = Rank(rank, world, port, params)
        result.update(_scenario(scenario)(R, case_names(scenario, params)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result["fatal"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        rc = 1
        if R is not None:
            try:
                R.abort(f"rank {rank}: {type(e).__name__}: {e}")
            except Exception:  # noqa: BLE001 - the store may be gone too
                pass
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: nothing at exit may wait on a peer that is gone.
    os._exit(rc)


if __name__ == "__main__":
    # Run from the importable module, not from __main__: _gpu_errors imports
    # _gpu_worker, and two copies of it would mean two Aborted classes.
    import _gpu_worker
    _gpu_worker.main(sys.argv[1:])
