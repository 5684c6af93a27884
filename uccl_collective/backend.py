"""The torch.distributed backend "uccl": a ProcessGroup whose bytes move
through this package's C engine (shared memory within a host, TCP across).

``import uccl_collective`` registers it; then ``init_process_group("uccl")``
works under torchrun and every ``dist.*`` collective returns what Gloo
returns.  Each group (the world, every ``new_group``) has two
CollectiveContexts, bootstrapped through the store torch hands the creator:
one for collectives, one for send/recv (_anysource.py: receive from any
source).  Ordering follows NCCL: on every rank the group's operations reach
a peer in the order they were issued, and are matched in that order (``tag``
is not used for matching).  Reductions are computed with torch on the
receiving rank (_reduce.py).
"""
from __future__ import annotations

import datetime
import threading
import time
import types
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from . import _anysource, _barrier, _engine, _profiling, _reduce, _reduce_gpu, _sparse, \
    _stream_group
from ._reduce import R
from ._work import IF_IDLE, P2PWork, Runner, StreamWork, Task, Work
from .collective import CollectiveContext
from .p2p import UcclError, UcclTimeoutError

BACKEND_NAME = "uccl"
_SYNC = types.SimpleNamespace(asyncOp=False)   # options of a blocking call
_STRIDED = torch.strided
_REDUCE_OP = dist.ReduceOp
_profiler_enabled = torch.autograd._profiler_enabled
# c10d defines hash(ReduceOp) as its operator's number.  The fast path keys
# its codes on that: reading reduceOp.op.value instead makes an enum object,
# 1.8-2.1 us a call on the GPU machine's host (BENCHMARKS.md, session 11),
# a fifth of a 1 MiB all_reduce.  Checked here, in case a torch changes it.
_HASH_IS_OP = all(hash(dist.ReduceOp(o)) == int(o.value)
                  for o in (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR))
# The common case of the blocking all_reduce and all_gather_into_tensor on
# CUDA tensors in one C call (csrc/py_fastpath.c: the checks of _fast and
# _fast_red, the token, the round, the Work; None whenever the Python path
# must decide).  It reads _red_codes by hash(reduceOp), so only where that
# is the key.
_FAST_HOOKS = (torch.Tensor, _STRIDED, _profiler_enabled, _stream_group.capturing,
               _stream_group._raw_stream, StreamWork)
if _HASH_IS_OP:
    _engine.fast_setup(*_FAST_HOOKS)
_fast_allreduce, _fast_allgather = _engine.fast_allreduce, _engine.fast_allgather


def _timeout_s(timeout: Any) -> float:
    if isinstance(timeout, datetime.timedelta):
        secs = timeout.total_seconds()
    else:
        secs = float(timeout) if timeout is not None else 0.0
    return secs if secs > 0 else 1800.0   # torch's default process-group timeout


def _alias(t: torch.Tensor) -> torch.Tensor:
    """The same memory, outside autograd: torch's own backends write a
    tensor without recording history or bumping its version counter, so
    all_reduce works on a Parameter, under no_grad on the runner thread, and
    on inference tensors, and the gradient of what the caller computed
    before it is unchanged."""
    with torch.no_grad():
        a = torch.empty(0, dtype=t.dtype, device=t.device)
        a.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    return a


def _tensor(t: Any, what: str) -> torch.Tensor:
    """Checked; returns an alias (_alias) for the operation to work on."""
    return _alias(_checked(t, what))


def _checked(t: Any, what: str) -> torch.Tensor:
    """t, checked: a dense CPU or CUDA tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{what}: {t.layout} tensors are not supported (dense tensors only)")
    if not (t.is_cuda or t.device.type == "cpu"):
        raise ValueError(f"{what}: tensor on {t.device}; the uccl backend moves CPU and CUDA "
                         "tensors")
    return t


def _tensors(*groups: Any):
    """The tensors among groups (nested in lists and tuples)."""
    stack = list(groups)
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            stack.extend(x)


def _cuda_device(*groups: Any) -> int | None:
    """The CUDA device of an operation's tensors (nested in lists), or None
    when all are on the CPU.  One device per operation, as with NCCL (and
    no mixing of CPU and CUDA tensors)."""
    dev, cpu = None, False
    for x in _tensors(*groups):
        if not x.is_cuda:
            cpu = True
        elif dev is not None and x.device.index != dev:
            raise ValueError(f"the CUDA tensors of one operation must be on one device, "
                             f"got cuda:{dev} and cuda:{x.device.index}")
        else:
            dev = x.device.index
    if dev is not None and cpu:
        raise ValueError(f"one operation mixes CPU tensors and CUDA tensors (cuda:{dev}); put "
                         "them all on one device")
    return dev


def _dense_cuda(*ts: Any) -> int | None:
    """The device of contiguous dense CUDA tensors all on one device, else
    None.  On every blocking call's fast path: one call per check (the
    index through get_device(), which makes no torch.device)."""
    dev = None
    for t in ts:
        if not isinstance(t, torch.Tensor) or not t.is_cuda or t.layout != _STRIDED or \
                not t.is_contiguous():
            return None
        d = t.get_device()
        if dev is not None and d != dev:
            return None
        dev = d
    return dev


def _one(tensors: Any, what: str) -> torch.Tensor:
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
        n = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise ValueError(f"{what}: expected a list of exactly one tensor, got {n}")
    return _tensor(tensors[0], what)


def _same_dtype(ts: Sequence[torch.Tensor], dtype: torch.dtype, what: str) -> None:
    for i, t in enumerate(ts):
        if t.dtype != dtype:
            raise ValueError(f"{what}: tensor {i} has dtype {t.dtype}, expected {dtype}")


def _per_rank(ts: Any, like: torch.Tensor, n: int, what: str, side: str) -> list[torch.Tensor]:
    """A list of n tensors, one per rank, each with like's element count and
    dtype (all_gather's outputs, gather's, scatter's inputs...)."""
    ts = list(ts)
    if len(ts) != n:
        raise ValueError(f"{what}: {len(ts)} {side} tensors for a group of {n}")
    ts = [_tensor(t, f"{what} {side} {r}") for r, t in enumerate(ts)]
    for r, t in enumerate(ts):
        if t.numel() != like.numel():
            raise ValueError(f"{what}: {side} {r} has {t.numel()} elements, expected "
                             f"{like.numel()}")
    _same_dtype(ts, like.dtype, f"{what} {side}s")
    return ts


def _root_side(lists: Any, like: torch.Tensor, n: int, root: int, me: int, what: str,
               side: str) -> list[torch.Tensor]:
    """gather's outputs / scatter's inputs: the root's one list of n, checked;
    nothing on the other ranks."""
    if me == root:
        if not isinstance(lists, (list, tuple)) or len(lists) != 1:
            raise ValueError(f"{what}: the root needs one list of {n} {side} tensors")
        return _per_rank(lists[0], like, n, what, side)
    if lists and any(len(x) for x in lists):
        raise ValueError(f"{what}: only the root (rank {root}) takes {side} tensors")
    return []


class _Staged:
    """A contiguous stand-in for a tensor (the tensor itself when it is
    contiguous); back() copies the result into the original."""

    __slots__ = ("orig", "t")

    def __init__(self, t: torch.Tensor, copy_in: bool = True):
        self.orig = t
        if t.is_contiguous():
            self.t = t
        else:
            self.t = t.contiguous() if copy_in else torch.empty(t.shape, dtype=t.dtype,
                                                                device=t.device)

    def back(self) -> None:
        if self.t is not self.orig:
            self.orig.copy_(self.t)


class ProcessGroupUCCL(dist.ProcessGroup):
    """One torch.distributed group over the uccl engine (see module doc)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: Any):
        super().__init__(rank, size)
        self._timeout = _timeout_s(timeout)
        # A generation per incarnation of this group on this store (a job may
        # destroy and re-create its groups on one store): all members arrive.
        gen = (store.add("uccl_pg/arrivals", 1) - 1) // size
        self._ctx = CollectiveContext(use_copy_engine_for_intra=True, store=store, rank=rank,
                                      world_size=size, timeout_s=self._timeout,
                                      key_prefix=f"uccl_pg/gen{gen}/")
        self._ctx.init()
        try:   # send/recv on connections of their own (receive from any source)
            self._chan = _anysource.Channel(CollectiveContext(
                use_copy_engine_for_intra=True, store=store, rank=rank, world_size=size,
                timeout_s=self._timeout, key_prefix=f"uccl_pg/gen{gen}/p2p/").init(), rank, size)
        except BaseException:
            self._ctx.finalize()
            raise
        self._runner = Runner(f"rank{rank}of{size}", self._timeout)
        self._closed = False
        # [0]: the algorithms' scratch; [1]: working copies of inputs
        self._scratch_bufs: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._streams: dict[int, Any] = {}   # per CUDA device: where tasks' kernels run
        # stream-ordered exchanges (_stream_group.py): made at the first
        # operation on CUDA tensors where every peer is on this host
        self._sg: _stream_group.StreamGroup | None = None
        self._sg_off = not _stream_group.enabled() or size == 1
        self._run_ctx: Any = None   # a task's StreamCtx while it runs
        self._red_codes: dict = {}  # (operator, dtype) -> the engine kernel's codes, or ()
        self._ops_checked: dict = {}  # (hash(reduceOp), dtype) -> its RedOpType (_reduce_fn)
        self._combiners: dict = {}   # (operator, dtype, device type) -> its combine (_combine)
        self._p2p_live: list = []   # stream-ordered messages not in place yet: (codes, tensors)
        self._par = _reduce.Parallel(_reduce.default_width(self._ctx.local_world_size))

    # -- identity --------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    # torch keeps a group's name on its per-device C++ backends, which a
    # Python group has none of; DeviceMesh (FSDP2) reads it from Python.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        name = getattr(self, "_group_name", None)
        if name is None:
            raise RuntimeError("ProcessGroup name not set")
        return name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "undefined")

    @property
    def supports_splitting(self) -> bool:
        return False

    def eager_connect_single_device(self, device: Any) -> None:
        pass  # connections are made when the group is created

    def _get_backend(self, device: Any) -> "ProcessGroupUCCL":
        return self

    @property
    def context(self) -> CollectiveContext:
        """The CollectiveContext this group runs on."""
        return self._ctx

    # -- task plumbing ----------------------------------------------------------
    def _submit(self, fn: Callable[[], list | None], result: list, opts: Any = None,
                p2p: bool = False, uses: Sequence = (), prof: tuple = ("", ())) -> Work:
        """Queue fn (the runner runs it in issue order).  A blocking call
        (opts.asyncOp False) runs it here and raises its error at once.
        result and uses hold the operation's tensors (lists of them too):
        on CUDA tensors it runs stream-ordered (_on_gpu).  prof: the
        operation's profiler name and input tensors (_profiling)."""
        if self._closed:
            raise UcclError(f"uccl process group (rank {self.rank()}) is shut down")
        sync = opts is not None and getattr(opts, "asyncOp", True) is False
        dev = _cuda_device(result, uses)
        sg = None if dev is None or p2p else self._stream_group(dev)
        end = None
        if sg is not None:
            fn, end = self._on_stream(fn, dev, sg, (result, uses))
        elif dev is not None:
            fn = self._on_gpu(fn, dev, sync)
        task = Task(fn, result, dev, _profiling.begin(*prof) if prof[0] else None)
        if end is not None:
            task.gpu_end, task.stream, task.check = end, sg.torch_stream, sg.check
        deadline = time.monotonic() + self._timeout
        if not (sync and dev is None and self._runner.run_here(task)):   # a CPU call: inline
            self._runner.submit(task, True if sync else (IF_IDLE if p2p else False), deadline)
        if sync:
            task.settle_pending(deadline)
            if task.error is not None:
                raise task.error
            if end is not None:   # as ProcessGroupNCCL: the caller's stream waits, not the host
                torch.cuda.current_stream(dev).wait_event(end)
        return Work(self._runner, task)

    def _stream_group(self, dev: int) -> "_stream_group.StreamGroup | None":
        """The group's stream-ordered exchanges: its context's (made on first
        use, at the same operation on every rank; ValueError for a second
        device), or None where they do not apply (CollectiveContext.stream_group)."""
        sg = self._sg
        if sg is not None and sg.dev == dev:   # every blocking CUDA call asks: the common case
            return sg
        if self._sg_off:
            return None
        sg = self._ctx.stream_group(dev, self._timeout)
        if sg is None:
            self._sg_off = True
        elif sg is not self._sg:
            self._sg, self._sctx = sg, _stream_group.StreamCtx(self._ctx, sg)
        return sg

    def _fast(self, opts: Any, *ts: Any) -> "_stream_group.StreamGroup | None":
        """The stream-ordered group for a blocking call on contiguous CUDA
        tensors of one device that may go straight to the engine (one C
        call on this thread, under the runner's token: _streamed), or None:
        the general path (another kind of call, a profiler running).  Every
        blocking collective on CUDA tensors comes through here, so it makes
        as few Python calls as it can (benchmarks/fused_probe.py --pieces)."""
        if opts is None or getattr(opts, "asyncOp", True) is not False or self._closed or \
                _profiler_enabled():
            return None
        dev = _dense_cuda(*ts)
        if dev is None:
            return None
        sg = self._stream_group(dev)
        if sg is not None and _stream_group.capturing():
            _stream_group.refuse_capture(dev, "uccl")
        return sg

    def _fast_red(self, opts: Any, what: str, t: Any, *more: Any) -> tuple | None:
        """(group, dtype code, operator code) for a blocking reduction that
        goes straight to the engine (_fast, and a dtype and operator its
        kernel takes), or None.  The operator's check is made once per
        (operator, dtype): a bad one raises here as on the general path."""
        sg = self._fast(opts, t, *more)
        if sg is None:
            return None
        ro = opts.reduceOp
        key = (hash(ro) if _HASH_IS_OP else ro.op.value, t.dtype)
        codes = self._red_codes.get(key)
        if codes is None:
            rop = self._reduce_fn(opts, t.dtype, what)   # checked (a bad one raises)
            codes = self._red_codes[key] = sg.reduce_codes(t.dtype, rop) or ()
        return (sg, *codes) if codes else None

    def _streamed(self, sg: Any, result: list, call: Callable[..., int],
                  *args: Any) -> StreamWork | None:
        """call(caller's stream, True, 0, *args) -> round (an engine call that
        queues the operation on the caller's stream), run here under the
        runner's token (nothing of the group's queued or running: else
        None, and the caller takes the general path, which keeps the order)."""
        caller = _stream_group._raw_stream(sg.dev)
        ran, k = self._runner.inline(call, caller, True, 0, *args)
        return StreamWork(sg, k, result, caller) if ran else None

    def _on_stream(self, fn: Callable, dev: int, sg: Any, tensors: tuple) -> tuple:
        """fn as a task of stream-ordered exchanges, as ProcessGroupNCCL runs
        its kernels: on the group's stream for the device, after the work
        queued on the caller's current stream before the call; the task
        only queues (the host never waits for the GPU), and the returned
        event completes with it.  The tensors are recorded as used on the
        group's stream, so memory the caller frees meanwhile is not handed
        out again before that stream is past the operation."""
        _stream_group.refuse_capture(dev, "uccl")
        caller = torch.cuda.current_stream(dev)
        own = sg.torch_stream   # the stream its rounds run on: no event between them
        ready = torch.cuda.Event()
        ready.record(caller)
        for t in _tensors(*tensors):
            if t.is_cuda:
                t.record_stream(own)
        end = torch.cuda.Event()
        sctx = self._sctx

        def run():
            with torch.cuda.stream(own):
                own.wait_event(ready)
                self._run_ctx = sctx
                try:
                    return fn()
                finally:
                    self._run_ctx = None
                    end.record(own)
        return run, end

    @property
    def _xctx(self) -> Any:
        """What a running task's algorithms call: its stream-ordered
        exchanges, or the context."""
        return self._run_ctx if self._run_ctx is not None else self._ctx

    def _stream(self, dev: int) -> Any:
        own = self._streams.get(dev)
        if own is None:
            own = self._streams[dev] = torch.cuda.Stream(dev)
        return own

    def _on_gpu(self, fn: Callable, dev: int, sync: bool) -> Callable:
        """fn as a task on CUDA tensors, ordered as ProcessGroupNCCL orders
        its kernels: it starts after the work queued on the caller's current
        stream before the call.  The task ends only once its kernels
        (copies, reductions) have finished, so its outputs are in place when
        it counts as done.

        A blocking call that runs its task on the calling thread (the usual
        case: nothing queued ahead of it) runs the kernels on the caller's
        current stream itself: no event, no stream switch, and the engine's
        start condition is that stream's own progress.  Otherwise (async_op,
        or run by another thread) they run on the group's stream for the
        device, after an event of the caller's: work the caller queues after
        an async call is not held up behind the operation (DDP overlaps its
        backward pass with the all_reduces this way)."""
        caller = torch.cuda.current_stream(dev)
        tid = threading.get_ident() if sync else None
        ready = None
        if tid is None and not caller.query():   # work queued there: the task starts after it
            ready = torch.cuda.Event()
            ready.record(caller)
        own = self._stream(dev)

        def run():
            if threading.get_ident() == tid:
                try:
                    return fn()
                finally:
                    caller.synchronize()
            with torch.cuda.stream(own):
                if ready is not None:
                    own.wait_event(ready)
                elif tid is not None and not caller.query():   # a blocking call run elsewhere
                    own.wait_stream(caller)
                try:
                    return fn()
                finally:
                    own.synchronize()
        return run

    # -- allgather ----------------------------------------------------------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        what = "all_gather"
        inp = _one(input_tensors, what)
        if not isinstance(output_tensors, (list, tuple)) or len(output_tensors) != 1:
            raise ValueError(f"{what}: expected one list of output tensors")
        outs = _per_rank(output_tensors[0], inp, self.size(), what, "output")

        def run():
            staged = [_Staged(o, copy_in=False) for o in outs]
            self._xctx.allgather(inp.contiguous(), [s.t.reshape(-1) for s in staged])
            for s in staged:
                s.back()
        return self._submit(run, output_tensors, opts, uses=[inp], prof=("all_gather", [inp]))

    def _gather_flat(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> Callable:
        out, inp = _checked(out, f"{what} output"), _checked(inp, f"{what} input")
        n = self.size()
        if out.dtype != inp.dtype:
            raise ValueError(f"{what}: output dtype {out.dtype} != input dtype {inp.dtype}")
        if out.numel() != n * inp.numel():
            raise ValueError(f"{what}: output has {out.numel()} elements; group size {n} x "
                             f"input's {inp.numel()} = {n * inp.numel()} expected")
        if not out.is_cuda and out.is_contiguous() and inp.is_contiguous():
            # The engine writes the output's bytes itself (no torch op on it),
            # so no alias is needed: two of them were ~20 us of a 4-byte
            # all_gather_into_tensor on the GPU machine's host.
            return lambda: self._xctx.allgather(inp, out.reshape(-1))
        out, inp = _alias(out), _alias(inp)

        def run():
            s = _Staged(out, copy_in=False)
            self._xctx.allgather(inp.contiguous(), s.t.reshape(-1))
            s.back()
        return run

    def _allgather_base(self, output_tensor, input_tensor, opts=None):
        w = _fast_allgather(self, output_tensor, input_tensor, opts)
        if w is not None:
            return w
        sg = self._fast(opts, output_tensor, input_tensor)
        if sg is not None and output_tensor.dtype == input_tensor.dtype and \
                output_tensor.numel() == self.size() * input_tensor.numel():
            src, dst = input_tensor.data_ptr(), output_tensor.data_ptr()
            nb = input_tensor.numel() * input_tensor.element_size()
            w = self._streamed(sg, [output_tensor], sg.c.allgather, src, nb, dst)
            if w is not None:
                return w
        run = self._gather_flat(output_tensor, input_tensor, "all_gather_into_tensor")
        return self._submit(run, [output_tensor], opts, uses=[input_tensor],
                            prof=("all_gather_into_tensor", [input_tensor]))

    def all_gather_single(self, output_tensor, input_tensor, opts=None):
        return self._allgather_base(output_tensor, input_tensor, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        what = "all_gather_into_tensor (coalesced)"
        if len(outputs) != len(inputs):
            raise ValueError(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs")
        runs = [self._gather_flat(o, i, what) for o, i in zip(outputs, inputs)]

        def run():
            for r in runs:
                r()
        return self._submit(run, list(outputs), opts, uses=list(inputs),
                            prof=("all_gather_into_tensor_coalesced", list(inputs)))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        what = "all_gather_coalesced"
        ins = [_tensor(t, what) for t in input_list]
        n = self.size()
        if len(output_lists) != n:
            raise ValueError(f"{what}: {len(output_lists)} output lists for a group of {n}")
        out_lists = [[_tensor(o, what) for o in outs] for outs in output_lists]
        for r, outs in enumerate(out_lists):
            if len(outs) != len(ins):
                raise ValueError(f"{what}: output list {r} has {len(outs)} tensors, the input "
                                 f"list {len(ins)}")
            for o, i in zip(outs, ins):
                if o.numel() != i.numel() or o.dtype != i.dtype:
                    raise ValueError(f"{what}: output {tuple(o.shape)} {o.dtype} does not match "
                                     f"input {tuple(i.shape)} {i.dtype}")

        def run():
            # bytes of every input, back to back (dtypes may differ)
            flat = torch.cat([i.contiguous().reshape(-1).view(torch.uint8) for i in ins]) \
                if ins else torch.empty(0, dtype=torch.uint8)
            got = torch.empty(n * flat.numel(), dtype=torch.uint8, device=flat.device)
            self._xctx.allgather(flat, got)
            for r, outs in enumerate(out_lists):
                off = r * flat.numel()
                for o in outs:
                    nb = o.numel() * o.element_size()
                    # cloned: a view as o's dtype needs an aligned offset
                    o.copy_(got[off:off + nb].clone().view(o.dtype).reshape(o.shape))
                    off += nb
        return self._submit(run, output_lists, opts, uses=ins, prof=("all_gather", ins))

    # -- reductions ---------------------------------------------------------------
    def _reduce_fn(self, opts: Any, dtype: torch.dtype, what: str):
        """The operator (a RedOpType), checked for dtype: once per
        (operator, dtype), keyed as _fast_red keys.  Its checks compare
        pybind enums (about 1 us each on the GPU machine's host: 12 us a CPU
        all_reduce, BENCHMARKS.md session 11); a bad one raises each time."""
        ro = opts.reduceOp if opts is not None else None
        key = (hash(ro), dtype) if type(ro) is _REDUCE_OP and _HASH_IS_OP else None
        op = self._ops_checked.get(key) if key is not None else None
        if op is None:
            op = _reduce.op_type(ro if ro is not None else R.SUM)
            _reduce.check_op(op, dtype, what)
            if key is not None:
                self._ops_checked[key] = op
        return op

    def _scratch(self, nbytes: int, slot: int = 0, device: Any = "cpu") -> torch.Tensor:
        """A uint8 buffer of nbytes, reused across operations (one task runs
        at a time): fresh memory would page-fault as the engine fills it.
        Slot 0 is the algorithms'; slot 1 holds _work_copy's."""
        key = (slot, torch.device(device))
        buf = self._scratch_bufs.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self._scratch_bufs[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def _work_copy(self, parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """parts back to back in a reused 1-D buffer the reduction may
        overwrite (the inputs stay as they are)."""
        numel = sum(p.numel() for p in parts)
        flat = self._scratch(numel * dtype.itemsize, 1, parts[0].device).view(dtype)
        off = 0
        for p in parts:
            flat[off:off + p.numel()].view(p.shape).copy_(p)
            off += p.numel()
        return flat

    def _combine(self, op: R, dtype: torch.dtype, device: torch.device) -> Callable:
        key = (int(op), dtype, device.type)
        fn = self._combiners.get(key)
        if fn is None:   # (made once: _reduce.combiner compares pybind enums)
            fn = _reduce.combiner(op, dtype)
            fn = self._combiners[key] = fn if device.type == "cuda" else self._par.wrap(fn)
        return fn   # on the CPU split over threads

    def _allreduce_flat(self, flat: torch.Tensor, op: R) -> None:
        """flat (contiguous 1-D) <- its reduction over the group."""
        if flat.is_cuda:
            scratch = lambda nb: self._scratch(nb, 0, flat.device)  # noqa: E731
            xctx = self._xctx
            if isinstance(xctx, _stream_group.StreamCtx):   # the engine's kernel where it applies
                xctx.allreduce(flat, op, scratch)
            else:
                _reduce_gpu.allreduce(xctx, flat, op, scratch)
            return
        ctx, n = self._ctx, self.size()
        if n > 1:
            combine = self._combine(op, flat.dtype, flat.device)
            scratch = lambda nb: self._scratch(nb, 0, flat.device)  # noqa: E731
            nbytes = flat.numel() * flat.element_size()
            if nbytes <= _reduce.SMALL_BYTES or flat.numel() < n:
                got = scratch(n * nbytes).view(flat.dtype).view(n, flat.numel())
                ctx.allgather(flat, got.reshape(-1))
                flat.copy_(got[0])
                for r in range(1, n):   # rank order: the same on every rank
                    combine(flat, got[r])
            else:
                chunk = _reduce.bounds(flat.numel(), n)
                _reduce.reduce_scatter(ctx, flat, chunk, combine, scratch, allgather=True)
        if op == R.AVG:
            _reduce.finish_avg(flat, n)

    def allreduce(self, tensors, opts=None):
        w = _fast_allreduce(self, tensors, opts)
        if w is not None:
            return w
        what = "all_reduce"
        fast = self._fast_red(opts, what, tensors[0]) if len(tensors) == 1 else None
        if fast is not None:   # (never a sparse tensor: _fast takes strided ones only)
            t = tensors[0]
            w = self._streamed(fast[0], [t], fast[0].c.allreduce, t.data_ptr(), t.numel(),
                               *fast[1:])
            if w is not None:
                return w
        if _sparse.is_sparse(tensors):   # as Gloo (_sparse.py)
            sp = _sparse.check(tensors, opts)
            return self._submit(lambda: _sparse.allreduce(self._ctx, sp, self.rank(), self.size()),
                                list(tensors), opts, prof=("sparse_all_reduce", tensors))
        t = _one(tensors, what)
        op = self._reduce_fn(opts, t.dtype, what)

        def run():
            s = _Staged(t)
            self._allreduce_flat(s.t.reshape(-1), op)
            s.back()
        return self._submit(run, list(tensors), opts, prof=("all_reduce", tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        what = "all_reduce_coalesced"
        ts = [_tensor(t, what) for t in tensors]
        if not ts:
            return self._submit(lambda: None, [], opts, prof=("all_reduce_coalesced", []))
        _same_dtype(ts, ts[0].dtype, what)
        op = self._reduce_fn(opts, ts[0].dtype, what)

        def run():
            flat = self._work_copy(ts, ts[0].dtype)
            self._allreduce_flat(flat, op)
            off = 0
            for t in ts:
                t.copy_(flat[off:off + t.numel()].view(t.shape))
                off += t.numel()
        return self._submit(run, list(tensors), opts, prof=("all_reduce_coalesced", tensors))

    def reduce(self, tensors, opts=None):
        what = "reduce"
        t = _one(tensors, what)
        op = self._reduce_fn(opts, t.dtype, what)
        root = self._root(opts, what)
        fast = self._fast_red(opts, what, tensors[0])
        if fast is not None:
            w = self._streamed(fast[0], list(tensors), fast[0].c.reduce, t.data_ptr(),
                               t.numel(), *fast[1:], root)
            if w is not None:
                return w

        def run():
            work = self._work_copy([t], t.dtype)  # only the root's tensor changes
            xctx = self._xctx
            if isinstance(xctx, _stream_group.StreamCtx):   # the fast path's round
                xctx.reduce(work, op, root, lambda nb: self._scratch(nb, 0, work.device))
            else:
                self._allreduce_flat(work, op)
            if self.rank() == root:
                t.copy_(work.view(t.shape))
        return self._submit(run, list(tensors), opts, prof=("reduce", tensors))

    def _rs_input(self, parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """A reduce-scatter's input as one flat tensor: on CUDA a lone
        contiguous input is used as it is (the GPU reduction only reads it);
        otherwise a working copy (the CPU reduction overwrites it)."""
        if len(parts) == 1 and parts[0].is_cuda and parts[0].is_contiguous():
            return parts[0].reshape(-1)
        return self._work_copy(parts, dtype)

    def _reduce_scatter_flat(self, out: torch.Tensor, flat: torch.Tensor, op: R,
                             what: str = "reduce_scatter") -> None:
        """out <- this rank's chunk of the reduction of flat (n equal chunks;
        on the CPU flat is scratch and is overwritten, on CUDA only read:
        see _rs_input)."""
        ctx, n, me = self._ctx, self.size(), self.rank()
        if flat.is_cuda:
            s = _Staged(out, copy_in=False)
            scratch = lambda nb: self._scratch(nb, 0, flat.device)  # noqa: E731
            xctx = self._xctx
            if isinstance(xctx, _stream_group.StreamCtx):
                xctx.reduce_scatter(s.t.view(-1), flat, op, scratch, what)
            else:
                _reduce_gpu.reduce_scatter(xctx, s.t, flat, op, scratch, what)
            s.back()
            return
        k = out.numel()
        chunk = [(r * k, (r + 1) * k) for r in range(n)]
        if n > 1:
            _reduce.reduce_scatter(ctx, flat, chunk, self._combine(op, flat.dtype, flat.device),
                                   lambda nb: self._scratch(nb, 0, flat.device))
        mine = flat[me * k:(me + 1) * k]
        if op == R.AVG:
            _reduce.finish_avg(mine, n)
        out.copy_(mine.view(out.shape))

    def _scatter_check(self, out, inp, what: str, op_opts):
        """(out, inp, op), checked (aliases of the tensors)."""
        out, inp = _tensor(out, f"{what} output"), _tensor(inp, f"{what} input")
        n = self.size()
        if out.dtype != inp.dtype:
            raise ValueError(f"{what}: output dtype {out.dtype} != input dtype {inp.dtype}")
        if inp.numel() != n * out.numel():
            raise ValueError(f"{what}: input has {inp.numel()} elements; group size {n} x "
                             f"output's {out.numel()} = {n * out.numel()} expected")
        return out, inp, self._reduce_fn(op_opts, out.dtype, what)

    def _reduce_scatter_base(self, output_tensor, input_tensor, opts=None):
        what = "reduce_scatter_tensor"
        fast = self._fast_red(opts, what, output_tensor, input_tensor)
        if fast is not None and output_tensor.dtype == input_tensor.dtype and \
                input_tensor.numel() == self.size() * output_tensor.numel():
            w = self._streamed(fast[0], [output_tensor], fast[0].c.reduce_scatter,
                               output_tensor.data_ptr(), input_tensor.data_ptr(),
                               output_tensor.numel(), *fast[1:])
            if w is not None:
                return w
        out, inp, op = self._scatter_check(output_tensor, input_tensor, what, opts)
        return self._submit(
            lambda: self._reduce_scatter_flat(out, self._rs_input([inp], inp.dtype), op, what),
            [output_tensor], opts, uses=[input_tensor],
            prof=("reduce_scatter_tensor", [output_tensor]))

    def reduce_scatter_single(self, output_tensor, input_tensor, opts=None):
        return self._reduce_scatter_base(output_tensor, input_tensor, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        what = "reduce_scatter_tensor (coalesced)"
        if len(outputs) != len(inputs):
            raise ValueError(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs")
        checked = [self._scatter_check(o, i, what, opts) for o, i in zip(outputs, inputs)]

        def run():
            for o, i, op in checked:
                self._reduce_scatter_flat(o, self._rs_input([i], i.dtype), op, what)
        return self._submit(run, list(outputs), opts, uses=list(inputs),
                            prof=("reduce_scatter_tensor_coalesced", list(outputs)))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        what = "reduce_scatter"
        out = _one(output_tensors, what)
        if not isinstance(input_tensors, (list, tuple)) or len(input_tensors) != 1:
            raise ValueError(f"{what}: expected one list of input tensors")
        ins = _per_rank(input_tensors[0], out, self.size(), what, "input")
        op = self._reduce_fn(opts, out.dtype, what)
        return self._submit(
            lambda: self._reduce_scatter_flat(out, self._rs_input(ins, out.dtype), op, what),
            list(output_tensors), opts, uses=ins, prof=("reduce_scatter", input_tensors))

    # -- rooted and personalised ----------------------------------------------
    def _root(self, opts: Any, what: str) -> int:
        """opts.rootRank (0 without options), checked."""
        root = opts.rootRank if opts is not None else 0
        n = self.size()
        if not 0 <= root < n:
            raise ValueError(f"{what}: root rank {root} is not in 0..{n - 1}")
        return root

    def broadcast(self, tensors, opts=None):
        what = "broadcast"
        t = _one(tensors, what)
        root = self._root(opts, what)
        if opts is not None and opts.rootTensor != 0:
            raise ValueError(f"{what}: rootTensor {opts.rootTensor} (one tensor per rank)")
        me, n = self.rank(), self.size()
        sg = self._fast(opts, tensors[0])
        if sg is not None:
            w = self._streamed(sg, list(tensors), sg.c.broadcast, t.data_ptr(),
                               t.numel() * t.element_size(), root)
            if w is not None:
                return w

        def run():
            s = _Staged(t, copy_in=me == root)
            xctx = self._xctx
            if isinstance(xctx, _stream_group.StreamCtx):   # the fast path's round
                xctx.broadcast(s.t, root)
            else:
                self._star(what, root, [s.t] * n, s.t, to_root=False)
            if me != root:
                s.back()
        return self._submit(run, list(tensors), opts, prof=("broadcast", tensors))

    def gather(self, output_tensors, input_tensors, opts=None):
        what = "gather"
        inp = _one(input_tensors, what)
        me, n = self.rank(), self.size()
        root = self._root(opts, what)
        outs = _root_side(output_tensors, inp, n, root, me, what, "output")

        def run():
            staged = [_Staged(o, copy_in=False) for o in outs]
            self._star(what, root, [s.t for s in staged], inp.contiguous(), to_root=True)
            for s in staged:
                s.back()
        return self._submit(run, output_tensors, opts, uses=[inp], prof=("gather", [inp]))

    def scatter(self, output_tensors, input_tensors, opts=None):
        what = "scatter"
        out = _one(output_tensors, what)
        me, n = self.rank(), self.size()
        root = self._root(opts, what)
        ins = _root_side(input_tensors, out, n, root, me, what, "input")

        def run():
            s = _Staged(out, copy_in=False)
            self._star(what, root, [i.contiguous() for i in ins], s.t, to_root=False)
            s.back()
        return self._submit(run, list(output_tensors), opts, uses=ins, prof=("scatter", ins))

    def _star(self, what: str, root: int, at_root: list[torch.Tensor], mine: torch.Tensor,
              to_root: bool) -> None:
        """The rooted exchanges (contiguous tensors): the root and rank r
        exchange at_root[r] (the root's side; empty elsewhere) and mine (rank
        r's side), toward the root (gather) or from it (scatter, broadcast);
        the root's own piece is copied."""
        me, n = self.rank(), self.size()
        if me != root:
            self._xctx._p2p([("send" if to_root else "recv", mine, root)], what, blocking=True)
            return
        own = at_root[me]
        if own is not mine:
            dst, src = (own, mine) if to_root else (mine, own)
            dst.copy_(src.view(dst.shape))
        entries = [("recv" if to_root else "send", at_root[r], r) for r in range(n) if r != me]
        if entries:
            self._xctx._p2p(entries, what, blocking=True)

    def _exchange(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], what: str) -> None:
        """Personalised exchange: sends[r] to rank r, recvs[r] from rank r
        (all contiguous); this rank's own piece is copied."""
        me, n = self.rank(), self.size()
        recvs[me].copy_(sends[me].view(recvs[me].shape))
        entries = [("recv", recvs[r], r) for r in range(n) if r != me]
        entries += [("send", sends[r], r) for r in range(n) if r != me]
        if entries:
            self._xctx._p2p(entries, what, blocking=True)

    def alltoall_base(self, output_tensor, input_tensor, output_split_sizes,
                      input_split_sizes, opts=None):
        what = "all_to_all_single"
        out, inp = _tensor(output_tensor, f"{what} output"), _tensor(input_tensor, f"{what} input")
        if out.dtype != inp.dtype:
            raise ValueError(f"{what}: output dtype {out.dtype} != input dtype {inp.dtype}")
        n = self.size()

        def rows(t: torch.Tensor, splits: Sequence[int], side: str) -> list[tuple[int, int]]:
            dim0 = t.shape[0] if t.dim() else 1
            per = t.numel() // dim0 if dim0 else 0
            splits = list(splits)
            if not splits:
                if dim0 % n:
                    raise ValueError(f"{what}: {side} dim 0 ({dim0}) is not divisible by the "
                                     f"group size {n}; give split sizes")
                splits = [dim0 // n] * n
            if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != dim0:
                raise ValueError(f"{what}: {side} split sizes {splits} must be {n} non-negative "
                                 f"sizes summing to dim 0 ({dim0})")
            out_b, s0 = [], 0
            for s in splits:
                out_b.append((s0 * per, (s0 + s) * per))
                s0 += s
            return out_b

        ob, ib = rows(out, output_split_sizes, "output"), rows(inp, input_split_sizes, "input")
        me = self.rank()
        if ob[me][1] - ob[me][0] != ib[me][1] - ib[me][0]:
            raise ValueError(f"{what}: this rank sends itself {ib[me][1] - ib[me][0]} elements "
                             f"but expects {ob[me][1] - ob[me][0]}")

        def run():
            s = _Staged(out, copy_in=False)
            fo, fi = s.t.reshape(-1), inp.contiguous().reshape(-1)
            self._exchange([fi[a:b] for a, b in ib], [fo[a:b] for a, b in ob], what)
            s.back()
        return self._submit(run, [output_tensor], opts, uses=[inp],
                            prof=("all_to_all", [input_tensor]))

    def all_to_all_single(self, output_tensor, input_tensor, output_split_sizes,
                          input_split_sizes, opts=None):
        return self.alltoall_base(output_tensor, input_tensor, output_split_sizes,
                                  input_split_sizes, opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        what = "all_to_all"
        n = self.size()
        outs = [_tensor(t, f"{what} output") for t in output_tensors]
        ins = [_tensor(t, f"{what} input") for t in input_tensors]
        if len(outs) != n or len(ins) != n:
            raise ValueError(f"{what}: {len(outs)} outputs and {len(ins)} inputs for a group "
                             f"of {n}")
        dtype = ins[0].dtype
        _same_dtype(ins + outs, dtype, what)
        me = self.rank()
        if outs[me].numel() != ins[me].numel():
            raise ValueError(f"{what}: this rank sends itself {ins[me].numel()} elements but "
                             f"expects {outs[me].numel()}")

        def run():
            staged = [_Staged(o, copy_in=False) for o in outs]
            self._exchange([i.contiguous() for i in ins], [s.t for s in staged], what)
            for s in staged:
                s.back()
        return self._submit(run, list(output_tensors), opts, uses=ins,
                            prof=("all_to_all", input_tensors))

    # -- point to point -------------------------------------------------------
    def _peer(self, peer: int, what: str) -> int:
        n, me = self.size(), self.rank()
        if not 0 <= peer < n or peer == me:
            raise ValueError(f"{what}: peer {peer} is not another rank of this group "
                             f"(0..{n - 1}, this is {me})")
        return peer

    def _streamed_p2p(self, t: torch.Tensor, peer: int, send: bool, tensors: Any,
                      what: str) -> P2PWork | None:
        """A send or receive of a CUDA tensor where the group's ranks share
        this host: one message of the stream-ordered group (csrc/sg_p2p.c),
        posted here with no host wait, after the work queued on the current
        stream, and matched in order with the peer's receive or send, as
        NCCL's are; None elsewhere (CPU tensors, peers on other hosts: the
        engine's messages, _anysource.Channel).  Both sides of a message
        must take the same path: a CUDA tensor is matched with a CUDA tensor.
        The tensors are kept until the message is in place, so that memory
        freed meanwhile is not handed out while a peer still copies."""
        if self._closed:
            raise UcclError(f"uccl process group (rank {self.rank()}) is shut down")
        if not t.is_cuda:
            return None
        dev = t.device.index
        sg = self._stream_group(dev)
        if sg is None:
            return None
        _stream_group.refuse_capture(dev, f"uccl {what}")
        prof = _profiling.begin(what, tensors)
        try:
            codes = sg.p2p(_stream_group._raw_stream(dev),
                           [(peer, send, t.data_ptr(), t.numel() * t.element_size())])
        finally:
            _profiling.end(prof)
        self._keep_unfinished_p2p()
        self._p2p_live.append((codes, (t, tensors)))
        return P2PWork(sg, codes, list(tensors))

    def _keep_unfinished_p2p(self) -> None:
        """Drop the tensors of messages in place; once the group failed (the
        words say nothing then, and released streams still run the copies
        they had queued) or is closing, keep the rest for good."""
        sg = self._sg
        if not self._p2p_live or sg is None or sg.c is None:
            return
        if sg.error() is None:
            self._p2p_live = [e for e in self._p2p_live if not all(map(sg.c.p2p_passed, e[0]))]
        if sg.error() is not None or self._closed:
            _stream_group._KEPT.append(self._p2p_live)
            self._p2p_live = []

    def send(self, tensors, dstRank, tag=0):
        what = "send"
        t = _one(tensors, what)
        dst = self._peer(dstRank, what)
        src = t.contiguous()
        work = self._streamed_p2p(src, dst, True, tensors, what)
        if work is not None:
            return work
        return self._submit(lambda: self._chan.send(src, dst), list(tensors), p2p=True,
                            prof=("send", tensors))

    def _recv_tensor(self, tensors, what: str) -> torch.Tensor:
        t = _one(tensors, what)
        if not t.is_contiguous():
            raise ValueError(f"{what}: the receive tensor must be contiguous "
                             f"(shape={tuple(t.shape)}, stride={tuple(t.stride())})")
        return t

    def recv(self, tensors, srcRank, tag=0):
        what = "recv"
        t = self._recv_tensor(tensors, what)
        src = self._peer(srcRank, what)
        work = self._streamed_p2p(t, src, False, tensors, what)
        if work is not None:
            return work
        return self._submit(lambda: self._chan.recv(t, src, time.monotonic() + self._timeout),
                            list(tensors), p2p=True, prof=("recv", tensors))

    def recv_anysource(self, tensors, tag=0):
        """Receives the first message any rank sends (_anysource.py);
        work._source_rank() (dist.recv's return value) is its sender."""
        what = "recv (from any source)"
        t = self._recv_tensor(tensors, what)
        if self.size() < 2:
            raise ValueError(f"{what}: the group has no other rank (size {self.size()})")
        if t.is_cuda and self._stream_group(t.device.index) is not None:
            raise ValueError(f"{what}: a CUDA tensor's messages go stream-ordered on this group "
                             "(its ranks share a host), and those are matched by sender, as "
                             "NCCL's are, which has no receive from any source either; name "
                             "the source (dist.recv(t, src=...)), or receive into a CPU tensor "
                             "(UCCL_STREAM_ORDERED=0 turns the stream-ordered path off)")
        got: list = []

        def run():
            got.append(self._chan.recv_any(t))
            return got
        work = self._submit(run, list(tensors), p2p=True, prof=("recvAnySource", tensors))
        work._task.source = lambda: got[0].src
        return work

    # -- synchronisation and life cycle -----------------------------------------
    def barrier(self, opts=None):
        ctx, n = self._ctx, self.size()

        def run():
            if n > 1:
                one = torch.zeros(1, dtype=torch.uint8)
                ctx.allgather(one, torch.empty(n, dtype=torch.uint8))
        return self._submit(run, [], opts, prof=("barrier", []))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """As Gloo's (_barrier.py): names the ranks that did not arrive."""
        secs = _barrier.timeout_s(timeout, self._timeout)

        def run():
            try:
                _barrier.run(self._ctx, self.rank(), self.size(), secs, wait_all_ranks)
            except UcclTimeoutError as e:   # receives left posted: the order is lost
                self._runner.poison(f"monitored_barrier failed ({e})")
                raise
        self._submit(run, [], _SYNC, prof=("monitored_barrier", []))

    def _shutdown(self, why: str) -> None:
        if self._closed:
            return
        self._closed = True
        self._keep_unfinished_p2p()
        self._ctx.finalize()   # fails what is in flight: every Work settles
        self._chan.ctx.finalize()
        self._runner.close(why)   # the context's finalize() closed the stream group
        self._par.close()

    def shutdown(self) -> None:
        self._shutdown("shut down (destroy_process_group)")

    def abort(self) -> None:
        self._shutdown("aborted")

    def __del__(self):
        try:
            self._shutdown("garbage collected")
        except Exception:
            pass


def _create(store, rank, size, timeout) -> ProcessGroupUCCL:
    return ProcessGroupUCCL(store, rank, size, timeout)


def register() -> None:
    """Register "uccl" with torch.distributed for cpu and cuda (idempotent)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
