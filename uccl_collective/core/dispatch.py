"""One route per collective: the only place that chooses how a call moves.

A collective can move on four planes: the C fast path (the blocking
all_reduce / all_gather_into_tensor on CUDA tensors in one C call,
csrc/py/py_fastpath.c), a stream-ordered round (one engine call queues the
whole operation on the caller's CUDA stream; stream_group.py), a task of the
host-driven engine (the engine's threads move the bytes, ordered after the
caller's stream; torch computes on the GPU), or the Gloo-style CPU path (a
task: the engine moves the bytes, torch reduces on the CPU).  This module
reads the facts of a call (its kind, the tensors' device, layout and
contiguity, blocking or not, a CUDA graph capturing, the profiler, the
group's state, the dtype and the operator) and picks the route; the callers
adapt their API (the backend's argument checks, shapes and Works; the
context's checks and handles) and hand the call here.

The process group's calls (backend/process_group.py); the first row whose
facts hold is the route:

 row  facts                                     route
 ---  ----------------------------------------  -------------------------------------------
 1    all_reduce of one tensor,                 the C fast path (FastPath.allreduce,
      all_gather_into_tensor, or                allgather, all_to_all; bound as
      all_to_all_single with no split sizes;    Dispatch.allreduce_c, allgather_c,
      blocking; no profiler; group open;        all_to_all_c): the token, one round on
      dense contiguous CUDA tensors on the      the caller's stream, a StreamWork.  Set
      device of the group's stream group; no    up only where hash(ReduceOp) is the
      capture; the token free; all_reduce:      operator's number (HASH_IS_OP).
      the (operator, dtype) kernel codes
      already cached; all_gather: dtypes
      equal, output = size x input;
      all_to_all: dtypes and sizes equal,
      dim 0 of both divisible by the size
 2    all_reduce (one tensor),                  a stream-ordered round, inline
      all_gather_into_tensor,                   (Dispatch.allreduce, allgather,
      reduce_scatter_tensor, reduce,            reduce_scatter, reduce, broadcast,
      broadcast, all_to_all(_single) of         all_to_all): one engine call under the
      contiguous chunks; blocking; no           token, a StreamWork; captured where the
      profiler; group open; dense contiguous    stream captures a graph; a bad operator raises
      CUDA tensors of one device; the group     (check_op); the token not free: rows 3-5,
      has a stream group there (made at the     queued behind what holds it (all_to_all's
      first such call: every peer on this       task runs the same round: a rank may take
      host over shared memory with CUDA IPC,    either)
      UCCL_STREAM_ORDERED not 0, more than
      one rank); the token free; reductions:
      a kernel for (operator, dtype); shapes
      match (all_gather: output = size x
      input; reduce_scatter: input = size x
      output)
 3    any other call on CUDA tensors (any       a stream-ordered task (task, _on_stream):
      layout), not a send/recv; the group has   a Task whose exchanges are rounds through
      a stream group on their device            StreamCtx (xctx) on the group's stream,
                                                after an event of the caller's; its
                                                reductions by the engine's kernel where
                                                it has the (operator, dtype), else torch
                                                ops on that stream (_reduce_gpu).  A
                                                capture raises
 4    CUDA tensors and no stream group (peers   a task of the host-driven engine (task,
      on other hosts, UCCL_STREAM_ORDERED=0),   _on_gpu): the engine's operations ordered
      or a send/recv that is not row 6          after the current stream; torch's kernels
                                                on the caller's stream when run inline
                                                and blocking, else on the group's stream
                                                for the device
 5    CPU tensors                               the Gloo-style CPU task: the engine moves
                                                the bytes, torch reduces (split over
                                                threads); the backend's Runner runs it on
                                                the calling thread when blocking and the
                                                token is free, else queues it
 6    send / recv of a CUDA tensor; the group   a stream-ordered message (p2p): posted on
      has a stream group on its device          the pair's stream, a P2PWork; captured
                                                where the stream captures a graph (the
                                                pair's stream joins it).  (Else a task of
                                                the p2p channel: row 4 or 5)

Rows 1 and 2 take the same facts; row 1 is their common case made in C
(csrc/py/py_fastpath.c: its checks mirror fast() and kernel_codes();
tests/test_fast_path.py holds them to it), and it declines (None) wherever
anything differs, the first call included: row 2 makes the stream group
and caches the codes.  The group shut down: every row raises UcclError
(row 1 declines, row 2 declines and the task raises).

CollectiveContext's allgather and iallgather (core/collective.py), for a
context whose every peer is reached through this engine (allgather()):

 7    the output one flat tensor; CUDA          a stream-ordered round: blocking, on the
      tensors; the context's stream group on    caller's stream; iallgather, recorded in
      their device                              an event, a StreamHandle.  A capture
                                                raises
 8    otherwise                                 the engine (host-driven; CUDA ordered
                                                after the current stream)

(A context with peers through torch.distributed, use_copy_engine_for_intra
=False, composes its own allgather from point-to-point calls.)

Imports: the engine, torch, and core's stream_group and handles; never the
backend (whose Work type for row 2 is handed to Dispatch)."""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import _engine
from .._engine import UcclError
from . import stream_group
from .handles import StreamHandle
from .stream_group import StreamCtx, refuse_capture, stream_args

_STRIDED = torch.strided
_profiler_enabled = torch.autograd._profiler_enabled
_R = dist.ReduceOp.RedOpType
# c10d defines hash(ReduceOp) as its operator's number.  The fast path keys
# its codes on that: reading reduceOp.op.value instead makes an enum object,
# 1.8-2.1 us a call on the GPU machine's host (docs/benchmark-log.md, session 11),
# a fifth of a 1 MiB all_reduce.  Checked here, in case a torch changes it.
HASH_IS_OP = all(hash(dist.ReduceOp(o)) == int(o.value)
                 for o in (_R.SUM, _R.AVG, _R.PRODUCT, _R.MIN, _R.MAX, _R.BAND, _R.BOR,
                           _R.BXOR))


def _tensors(*groups: Any):
    """The tensors among groups (nested in lists and tuples)."""
    stack = list(groups)
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            stack.extend(x)


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


class Dispatch:
    """The routes of one process group (a ProcessGroupUCCL): the state they
    depend on (the C fast path and the runner's token, the stream group and
    its StreamCtx, the cached kernel codes, open or shut down) and the calls
    that choose them (rows 1-6 of the module's table).

    ctx: the group's CollectiveContext; token: its _engine.Token (the
    backend's Runner, a subclass); work: the Work of a round (the backend's
    StreamWork(group, round, result, caller stream)); check_op(opts, dtype,
    what): the operator, checked (raises for a bad one), as the backend's
    general path checks it."""

    def __init__(self, ctx: Any, token: Any, rank: int, size: int, timeout: float,
                 work: Callable, check_op: Callable):
        self.ctx, self.token, self.rank, self.size, self.timeout = ctx, token, rank, size, timeout
        #: what a running task's algorithms call: the context, or within a
        #: stream-ordered task (row 3) its StreamCtx
        self.xctx = ctx
        self.closed = False
        # row 1, in C: it reads its own state (the token, the stream group,
        # the codes, closed), which this object keeps up to date
        self.fp = _engine.FastPath(token, size)
        self.allreduce_c, self.allgather_c = self.fp.allreduce, self.fp.allgather
        self.all_to_all_c = self.fp.all_to_all
        self.codes = self.fp.codes   # (hash(operator), dtype) -> the kernel's codes, or ()
        self._work, self._check_op = work, check_op
        # the stream-ordered exchanges (stream_group.py): made at the first
        # operation on CUDA tensors where every peer is on this host
        self.sg: stream_group.StreamGroup | None = None
        self.sg_off = not stream_group.enabled() or size == 1
        self.sctx: StreamCtx | None = None
        self._streams: dict[int, Any] = {}   # per CUDA device: where row-4 tasks' kernels run

    def close(self) -> None:
        """The group is shut down: every route refuses from now on."""
        self.closed = True
        self.fp.closed = True

    # -- the group's state -----------------------------------------------------------
    def stream_group(self, dev: int) -> "stream_group.StreamGroup | None":
        """The group's stream-ordered exchanges: its context's (made on first
        use, at the same operation on every rank; ValueError for a second
        device), or None where they do not apply (CollectiveContext.stream_group)."""
        sg = self.sg
        if sg is not None and sg.dev == dev:   # every blocking CUDA call asks: the common case
            return sg
        if self.sg_off:
            return None
        sg = self.ctx.stream_group(dev, self.timeout)
        if sg is None:
            self.sg_off = True
        elif sg is not self.sg:
            self.sg, self.sctx = sg, StreamCtx(self.ctx, sg)
            self.fp.set_group(sg, sg.c, sg.dev)
        return sg

    # -- rows 1 and 2: one call -------------------------------------------------------
    def fast(self, opts: Any, *ts: Any) -> "stream_group.StreamGroup | None":
        """The stream-ordered group for a blocking call on contiguous CUDA
        tensors of one device that may go straight to the engine (one C
        call on this thread, under the runner's token: round), or None:
        another route (another kind of call, a profiler running).  Every
        blocking collective on CUDA tensors comes through here, so it makes
        as few Python calls as it can (benchmarks/fused_probe.py --pieces)."""
        if opts is None or self.closed or _profiler_enabled():
            return None
        blocking = getattr(opts, "asyncOp", True) is False
        dev = _dense_cuda(*ts)
        if dev is None:
            return None
        # a capture takes this route (sg_graph.c), async_op=True too: its
        # round then runs on the capturing stream, as a blocking call's, and
        # its Work's wait() has nothing more to order there
        if not blocking and not stream_group.capturing(dev):
            return None
        return self.stream_group(dev)

    def kernel_codes(self, sg: Any, opts: Any, dtype: Any, what: str) -> tuple:
        """The (dtype, operator) codes of the engine's reduction kernel for a
        blocking reduction that fast() sent here, or () where the kernel
        does not take them.  Cached per (operator, dtype) in the C path's
        own table (row 1 reads it); the operator's check is made once per
        (operator, dtype): a bad one raises here as on the general path."""
        ro = opts.reduceOp
        key = (hash(ro) if HASH_IS_OP else ro.op.value, dtype)
        codes = self.codes.get(key)
        if codes is None:
            rop = self._check_op(opts, dtype, what)   # checked (a bad one raises)
            codes = self.codes[key] = sg.reduce_codes(dtype, rop) or ()
        return codes

    def round(self, sg: Any, result: list, call: Callable[..., int], *args: Any) -> Any:
        """call(caller's stream, True, 0, *args) -> round (an engine call that
        queues the operation on the caller's stream), run here holding the
        runner's token (nothing of the group's queued or running: else None,
        and the caller takes a task, which keeps the order); its Work."""
        caller = stream_group._raw_stream(sg.dev)
        ran, k = self.token.run(call, caller, True, 0, *args)
        return self._work(sg, k, result, caller) if ran else None

    def allreduce(self, tensors: Any, opts: Any) -> Any:
        """Row 2 of all_reduce (row 1 declined): its Work, or None."""
        sg = self.fast(opts, tensors[0]) if len(tensors) == 1 else None
        if sg is None:   # (never a sparse tensor: fast takes strided ones only)
            return None
        t = tensors[0]
        codes = self.kernel_codes(sg, opts, t.dtype, "all_reduce")
        return self.round(sg, [t], sg.c.allreduce, t.data_ptr(), t.numel(), *codes) \
            if codes else None

    def allgather(self, out: Any, inp: Any, opts: Any) -> Any:
        """Row 2 of all_gather_into_tensor (row 1 declined): its Work, or None."""
        sg = self.fast(opts, out, inp)
        if sg is None or out.dtype != inp.dtype or out.numel() != self.size * inp.numel():
            return None
        nb = inp.numel() * inp.element_size()
        return self.round(sg, [out], sg.c.allgather, inp.data_ptr(), nb, out.data_ptr())

    def reduce_scatter(self, out: Any, inp: Any, opts: Any) -> Any:
        """Row 2 of reduce_scatter_tensor: its Work, or None."""
        sg = self.fast(opts, out, inp)
        if sg is None:
            return None
        codes = self.kernel_codes(sg, opts, out.dtype, "reduce_scatter_tensor")
        if not codes or out.dtype != inp.dtype or inp.numel() != self.size * out.numel():
            return None
        return self.round(sg, [out], sg.c.reduce_scatter, out.data_ptr(), inp.data_ptr(),
                          out.numel(), *codes)

    def reduce(self, tensors: Any, t: Any, root: int, opts: Any) -> Any:
        """Row 2 of reduce (t: tensors[0], checked): its Work, or None."""
        sg = self.fast(opts, tensors[0])
        if sg is None:
            return None
        codes = self.kernel_codes(sg, opts, tensors[0].dtype, "reduce")
        return self.round(sg, list(tensors), sg.c.reduce, t.data_ptr(), t.numel(), *codes,
                          root) if codes else None

    def broadcast(self, tensors: Any, t: Any, root: int, opts: Any) -> Any:
        """Row 2 of broadcast (t: tensors[0], checked): its Work, or None."""
        sg = self.fast(opts, tensors[0])
        if sg is None:
            return None
        return self.round(sg, list(tensors), sg.c.broadcast, t.data_ptr(),
                          t.numel() * t.element_size(), root)

    def all_to_all(self, tensors: list, sends: list, recvs: list, result: list,
                   opts: Any) -> Any:
        """Row 2 of all_to_all and all_to_all_single: sends[r] and recvs[r],
        (address, bytes), the chunks to and from rank r inside tensors
        (contiguous, checked here; this rank's own pair of one size, checked
        by the caller): one round (the engine's all_to_all), the same one
        its task runs; its Work, or None."""
        sg = self.fast(opts, *tensors)
        if sg is None:
            return None
        return self.round(sg, result, sg.c.all_to_all, sends, recvs)

    # -- rows 3-5: a task ----------------------------------------------------------------
    def task(self, fn: Callable, result: Any, uses: Any, p2p: bool, sync: bool) -> tuple:
        """The plane a task runs on, from its tensors (result and uses, lists
        of them too): (fn as it runs there, its CUDA device or None, the event
        its stream-ordered work completes or None, its stream group or None).
        UcclError where the group is shut down."""
        if self.closed:
            raise UcclError(f"uccl process group (rank {self.rank}) is shut down")
        # The CUDA device of the tensors, or None when all are on the CPU.
        # One device per operation, as with NCCL (and no mixing of CPU and
        # CUDA tensors).
        dev, cpu = None, False
        for x in _tensors(result, uses):
            if not x.is_cuda:
                cpu = True
            elif dev is not None and x.device.index != dev:
                raise ValueError(f"the CUDA tensors of one operation must be on one device, "
                                 f"got cuda:{dev} and cuda:{x.device.index}")
            else:
                dev = x.device.index
        if dev is not None and cpu:
            raise ValueError(f"one operation mixes CPU tensors and CUDA tensors (cuda:{dev}); "
                             "put them all on one device")
        sg = None if dev is None or p2p else self.stream_group(dev)
        end = None
        if sg is not None:
            fn, end = self._on_stream(fn, dev, sg, (result, uses))
        elif dev is not None:
            fn = self._on_gpu(fn, dev, sync)
        return fn, dev, end, sg

    def _on_stream(self, fn: Callable, dev: int, sg: Any, tensors: tuple) -> tuple:
        """Row 3: fn as a task of stream-ordered exchanges, as
        ProcessGroupNCCL runs its kernels: on the group's stream for the
        device, after the work queued on the caller's current stream before
        the call; the task only queues (the host never waits for the GPU),
        and the returned event completes with it.  The group holds the
        tensors until the stream is past the operation (StreamGroup.hold,
        not record_stream), so memory the caller frees meanwhile is not
        handed out again before then."""
        refuse_capture(dev, "uccl")
        caller = torch.cuda.current_stream(dev)
        own = sg.torch_stream   # the stream its rounds run on: no event between them
        ready = torch.cuda.Event()
        ready.record(caller)
        used = [t for t in _tensors(*tensors) if t.is_cuda]
        end = torch.cuda.Event()
        sctx, ctx = self.sctx, self.ctx

        def run():
            with torch.cuda.stream(own):
                own.wait_event(ready)
                self.xctx = sctx
                try:
                    return fn()
                finally:
                    self.xctx = ctx
                    end.record(own)
                    sg.hold(end, used)   # recorded: until then the task held them
        return run, end

    def _stream(self, dev: int) -> Any:
        own = self._streams.get(dev)
        if own is None:
            own = self._streams[dev] = torch.cuda.Stream(dev)
        return own

    def _on_gpu(self, fn: Callable, dev: int, sync: bool) -> Callable:
        """Row 4: fn as a task on CUDA tensors, ordered as ProcessGroupNCCL
        orders its kernels: it starts after the work queued on the caller's
        current stream before the call.  The task ends only once its
        kernels (copies, reductions) have finished, so its outputs are in
        place when it counts as done.

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

    # -- row 6: send and receive --------------------------------------------------------
    def p2p(self, t: Any, what: str) -> "stream_group.StreamGroup | None":
        """The stream group a send or receive of t is posted on (a CUDA
        tensor where the group's ranks share this host), or None: a task on
        the p2p channel.  Both sides of a message must take the same route:
        a CUDA tensor is matched with a CUDA tensor."""
        if self.closed:
            raise UcclError(f"uccl process group (rank {self.rank}) is shut down")
        if not t.is_cuda:
            return None
        return self.stream_group(t.device.index)


# -- CollectiveContext: rows 7 and 8 ------------------------------------------------------
def allgather(ctx: Any, cm: Any, tensors: Any, send: tuple, bufs: list, algo: int,
              async_op: bool, flat: bool, what: str) -> tuple:
    """CollectiveContext's allgather through this engine, its arguments
    checked: tensors are the send tensor and the output (one flat tensor
    when flat, else the chunks), send and bufs the engine's buffers.
    Returns (engine operation id, None), or (None, handle or None)."""
    gpu = stream_args(tensors)
    sg = ctx.stream_group(gpu[0]) if flat and gpu[0] >= 0 else None
    if sg is None:
        return cm.allgather(send, bufs, algo, async_op, ctx.timeout_s, *gpu), None
    # row 7: stream-ordered, the host never waits for the GPU; a blocking
    # one is captured where the stream captures a CUDA graph
    if async_op:
        refuse_capture(gpu[0], what)
    if not async_op:
        sg.c.allgather(gpu[1], True, 0, send[0], send[1], bufs[0][0])
        return None, None
    ev = sg.c.event_new()
    try:
        sg.c.allgather(gpu[1], False, ev, send[0], send[1], bufs[0][0])
    except BaseException:
        sg.c.event_free(ev)
        raise
    # used on the group's stream: held until that stream is past them, so
    # freed memory is not handed out again before (the handle may be dropped)
    held = torch.cuda.Event()
    held.record(sg.torch_stream)
    sg.hold(held, tensors)
    return None, StreamHandle(sg, ev, tuple(tensors))
