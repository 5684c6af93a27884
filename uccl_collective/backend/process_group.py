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
receiving rank (_reduce.py), or by the engine's kernel.

ProcessGroupUCCL adapts torch's API: each method checks its arguments,
shapes the tensors and makes the Work; the route a call takes is its
Dispatch's (core/dispatch.py: the table of facts and routes), and what a
task does is _algorithms.py's.
"""
from __future__ import annotations

import datetime
import time
import types
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .. import _engine
from ..core import stream_group
from ..core.collective import CollectiveContext
from ..core.dispatch import HASH_IS_OP, Dispatch
from ..p2p import UcclTimeoutError
from . import _anysource, _barrier, _check, _profiling, _reduce, _sparse
from ._algorithms import Algorithms, _Staged
from ._self_p2p import SelfBox
from ._work import IF_IDLE, P2PWork, Runner, StreamWork, Task, Work

BACKEND_NAME = "uccl"
_SYNC = types.SimpleNamespace(asyncOp=False)   # options of a blocking call
# The C fast path (core/dispatch.py, row 1: csrc/py/py_fastpath.c) reaches
# torch only through these, given once; it keys its codes by hash(reduceOp),
# so it is set up only where that is the operator's number.
_FAST_HOOKS = (torch.Tensor, torch.strided, torch.autograd._profiler_enabled,
               torch.cuda.is_current_stream_capturing,   # (a capture declines: Dispatch.fast)
               stream_group._raw_stream, StreamWork)
if HASH_IS_OP:
    _engine.fast_setup(*_FAST_HOOKS)


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


def _overload(tensors: Any, opts: Any, options: type, **fields: Any) -> tuple[list, Any]:
    """The arguments of ProcessGroup's other overloads, which a Python
    group's method receives as they are (torch's own code calls them: DDP's
    `process_group.allreduce(tensor)`): a lone tensor becomes a list of one,
    and positional values in the options' place (`fields`, the first of
    them being opts itself) an options object of type `options`; the usual
    form comes back as it is."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    if opts is not None and not hasattr(opts, next(iter(fields))):
        o = options()
        for f, v in fields.items():
            if v is not None:
                setattr(o, f, v)
        opts = o
    return tensors, opts


def _uneven(ts: Any, like: torch.Tensor, n: int) -> bool:
    """Whether a list of n per-rank tensors holds sizes other than like's
    (all_gather_v / reduce_scatter_v, which NCCL takes)."""
    return (isinstance(ts, (list, tuple)) and len(ts) == n and
            all(isinstance(t, torch.Tensor) for t in ts) and
            any(t.numel() != like.numel() for t in ts))


def _per_rank_v(ts: Any, like: torch.Tensor, me: int, what: str, side: str,
                other: str) -> list[torch.Tensor]:
    """An _uneven list, checked: like's dtype, and this rank's own entry of
    like's size (the peers' sizes are compared by the exchange)."""
    ts = [_tensor(t, f"{what} {side} {r}") for r, t in enumerate(ts)]
    _same_dtype(ts, like.dtype, f"{what} {side}s")
    if ts[me].numel() != like.numel():
        raise ValueError(f"{what}: {side} {me} (this rank's own) has {ts[me].numel()} "
                         f"elements, its {other} {like.numel()}")
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


class ProcessGroupUCCL(dist.ProcessGroup):
    """One torch.distributed group over the uccl engine (see module doc).
    Its methods adapt torch's API: they check the arguments, shape the
    tensors, and make the Works; which route each call takes (one C call,
    a stream-ordered round, a task of the host-driven engine, the CPU path)
    is the group's Dispatch's choice (core/dispatch.py), and what a task
    does is _algorithms.py's."""

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
        self._p2p_live: list = []   # stream-ordered messages not in place yet: (codes, tensors)
        self._self_box = SelfBox(rank, self._timeout)   # sends to and receives from this rank
        try:
            self._setup(rank, size)
        except BaseException:   # (a bad UCCL_PG_REDUCE_THREADS, say): the contexts go too
            self._chan.ctx.finalize()
            self._ctx.finalize()
            raise

    def _setup(self, rank: int, size: int) -> None:
        """The group's runner, routes and algorithms, over its two contexts."""
        self._runner = Runner(f"rank{rank}of{size}", self._timeout)
        #: the operator of a reduction, checked for its dtype (_reduce.Ops)
        self._reduce_fn = _reduce.Ops().check
        #: the routes: every call is handed to it
        self._d = Dispatch(self._ctx, self._runner, rank, size, self._timeout, StreamWork,
                           self._reduce_fn)
        # allreduce and _allgather_base, the calls of a GPU training step's
        # hot path, hand theirs to the dispatch's first two rows, bound here
        # once: one C call (a StreamWork, or None), then a stream-ordered
        # round (a StreamWork, or None)
        d = self._d
        self._fast_allreduce, self._fast_allgather = d.allreduce_c, d.allgather_c
        self._fast_all_to_all = d.all_to_all_c
        self._round_allreduce, self._round_allgather = d.allreduce, d.allgather
        #: every call's header, compared across the ranks (_check.py); its
        #: count numbers the group's collective calls as they are made
        self._chk = _check.Checker(self._ctx, rank, size)
        self._alg = Algorithms(self._ctx, self._d, rank, size,
                               _reduce.Parallel(_reduce.default_width(self._ctx.local_world_size)),
                               self._chk)

    def _call(self, what: str, root: int = -1) -> tuple:
        """A collective call made: its number on this group (every rank
        numbers its calls alike, so a rank that skipped one, or raised
        before its exchange, shows at the next), as the header check takes
        it (_algorithms.Call)."""
        chk = self._chk
        chk.calls += 1
        return what, chk.calls, root

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

    # -- a call that is a task --------------------------------------------------
    def _submit(self, fn: Callable[[], list | None], result: list, opts: Any = None,
                p2p: bool = False, uses: Sequence = (), prof: tuple = ("", ())) -> Work:
        """A Task of fn on the plane the dispatch chose (Dispatch.task), and
        its Work: queued (the runner runs it in issue order), or for a
        blocking call (opts.asyncOp False) run here, its error raised at
        once.  result and uses hold the operation's tensors (lists of them
        too).  prof: the operation's profiler name and input tensors
        (_profiling)."""
        sync = opts is not None and getattr(opts, "asyncOp", True) is False
        fn, dev, end, sg = self._d.task(fn, result, uses, p2p, sync)   # UcclError: shut down
        task = Task(fn, result, dev, _profiling.begin(*prof) if prof[0] else None)
        if end is not None:
            task.gpu_end, task.stream, task.check = end, sg.torch_stream, sg.check
        deadline = time.monotonic() + self._timeout
        runner = self._runner
        if not (sync and dev is None and runner.run_here(task)):   # a CPU call: inline
            runner.submit(task, True if sync else (IF_IDLE if p2p else False), deadline)
        if sync:
            task.settle_pending(deadline)
            if task.error is not None:
                raise task.error
            if end is not None:   # as ProcessGroupNCCL: the caller's stream waits, not the host
                torch.cuda.current_stream(dev).wait_event(end)
        return Work(runner, task)

    # -- allgather ----------------------------------------------------------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        what = "all_gather"
        call = self._call(what)
        inp = _one(input_tensors, what)
        if not isinstance(output_tensors, (list, tuple)) or len(output_tensors) != 1:
            raise ValueError(f"{what}: expected one list of output tensors")
        if _uneven(output_tensors[0], inp, self.size()):
            return self._allgather_v(output_tensors, inp, what, call, opts)
        outs = _per_rank(output_tensors[0], inp, self.size(), what, "output")
        alg = self._alg

        def run():
            staged = [_Staged(o, copy_in=False) for o in outs]
            alg.allgather(inp.contiguous(), [s.t.reshape(-1) for s in staged], call)
            for s in staged:
                s.back()
        return self._submit(run, output_tensors, opts, uses=[inp], prof=("all_gather", [inp]))

    def _allgather_v(self, output_tensors, inp: torch.Tensor, what: str, call: tuple,
                     opts: Any) -> Any:
        """all_gather whose outputs differ in size (rank r's input fills
        output r), as ProcessGroupNCCL takes it: an all_to_all sending the
        input to every rank, so every rank's sizes are compared with every
        other's before a byte moves (CPU), or by the stream-ordered
        messages (CUDA)."""
        n = self.size()
        outs = _per_rank_v(output_tensors[0], inp, self.rank(), what, "output", "input")
        return self._all_to_all(outs, [inp] * n, list(output_tensors), [inp], what, call,
                                ("all_gather", [inp]), opts)

    def _gather_flat(self, out: torch.Tensor, inp: torch.Tensor, what: str,
                     call: tuple | None) -> Callable:
        """The task of one all_gather_into_tensor (call: its header, or None
        for a piece of a coalesced call checked as a whole)."""
        out, inp = _checked(out, f"{what} output"), _checked(inp, f"{what} input")
        n = self.size()
        if out.dtype != inp.dtype:
            raise ValueError(f"{what}: output dtype {out.dtype} != input dtype {inp.dtype}")
        if out.numel() != n * inp.numel():
            raise ValueError(f"{what}: output has {out.numel()} elements; group size {n} x "
                             f"input's {inp.numel()} = {n * inp.numel()} expected")
        alg = self._alg
        if not out.is_cuda and out.is_contiguous() and inp.is_contiguous():
            # Written by the engine or copied out of the header's slots
            # without autograd, so no alias is needed: two of them were
            # ~20 us of a 4-byte all_gather_into_tensor on the GPU machine's host.
            flat = out.reshape(-1)
            return lambda: alg.allgather(inp, flat, call)
        out, inp = _alias(out), _alias(inp)

        def run():
            s = _Staged(out, copy_in=False)
            alg.allgather(inp.contiguous(), s.t.reshape(-1), call)
            s.back()
        return run

    def _allgather_base(self, output_tensor, input_tensor, opts=None):
        try:
            w = self._fast_allgather(output_tensor, input_tensor, opts)
        finally:   # (as allreduce)
            call = self._call("all_gather_into_tensor")
        if w is None:
            w = self._round_allgather(output_tensor, input_tensor, opts)
        if w is not None:
            return w
        run = self._gather_flat(output_tensor, input_tensor, "all_gather_into_tensor", call)
        return self._submit(run, [output_tensor], opts, uses=[input_tensor],
                            prof=("all_gather_into_tensor", [input_tensor]))

    def all_gather_single(self, output_tensor, input_tensor, opts=None):
        return self._allgather_base(output_tensor, input_tensor, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        what = "all_gather_into_tensor (coalesced)"
        call = self._call(what)
        if len(outputs) != len(inputs):
            raise ValueError(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs")
        runs = [self._gather_flat(o, i, what, None) for o, i in zip(outputs, inputs)]
        alg, first = self._alg, inputs[0] if len(inputs) else None

        def run():
            # one header for the whole call (the pieces then move unchecked)
            alg.check(call, first, first.dtype if first is not None else None,
                      sum(i.numel() for i in inputs))
            for r in runs:
                r()
        return self._submit(run, list(outputs), opts, uses=list(inputs),
                            prof=("all_gather_into_tensor_coalesced", list(inputs)))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        what = "all_gather_coalesced"
        call = self._call(what)
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
        d, alg = self._d, self._alg

        def run():
            # bytes of every input, back to back (dtypes may differ)
            flat = torch.cat([i.contiguous().reshape(-1).view(torch.uint8) for i in ins]) \
                if ins else torch.empty(0, dtype=torch.uint8)
            got = torch.empty(n * flat.numel(), dtype=torch.uint8, device=flat.device)
            alg.check(call, flat, torch.uint8, flat.numel())
            d.xctx.allgather(flat, got)
            for r, outs in enumerate(out_lists):
                off = r * flat.numel()
                for o in outs:
                    nb = o.numel() * o.element_size()
                    # cloned: a view as o's dtype needs an aligned offset
                    o.copy_(got[off:off + nb].clone().view(o.dtype).reshape(o.shape))
                    off += nb
        return self._submit(run, output_lists, opts, uses=ins, prof=("all_gather", ins))

    # -- reductions ---------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        try:   # (it declines a lone tensor and a ReduceOp for options: below)
            w = self._fast_allreduce(tensors, opts)
        finally:   # the call's number (_call), whatever its route, after the C path's try
            chk = self._chk
            chk.calls += 1
        seq = chk.calls
        if w is None:
            tensors, opts = _overload(tensors, opts, dist.AllreduceOptions, reduceOp=opts)
            w = self._round_allreduce(tensors, opts)
        if w is not None:
            return w
        what = "all_reduce"
        alg = self._alg
        if _sparse.is_sparse(tensors):   # as Gloo (_sparse.py)
            sp = _sparse.check(tensors, opts)
            call = ("all_reduce (sparse)", seq, -1)

            def sparse():
                alg.check(call, sp, sp.dtype, sp.dim())
                _sparse.allreduce(self._ctx, sp, self.rank(), self.size())
            return self._submit(sparse, list(tensors), opts, prof=("sparse_all_reduce", tensors))
        t = _one(tensors, what)
        op = self._reduce_fn(opts, t.dtype, what)
        call = (what, seq, -1)

        def run():
            s = _Staged(t)
            alg.allreduce_flat(s.t.reshape(-1), op, call)
            s.back()
        return self._submit(run, list(tensors), opts, prof=("all_reduce", tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        what = "all_reduce_coalesced"
        call = self._call(what)
        ts = [_tensor(t, what) for t in tensors]
        alg = self._alg
        if not ts:
            return self._submit(lambda: alg.check(call, None), [], opts,
                                prof=("all_reduce_coalesced", []))
        _same_dtype(ts, ts[0].dtype, what)
        op = self._reduce_fn(opts, ts[0].dtype, what)

        def run():
            flat = alg.work_copy(ts, ts[0].dtype)
            alg.allreduce_flat(flat, op, call)
            off = 0
            for t in ts:
                t.copy_(flat[off:off + t.numel()].view(t.shape))
                off += t.numel()
        return self._submit(run, list(tensors), opts, prof=("all_reduce_coalesced", tensors))

    def reduce(self, tensors, opts=None, op=None):
        # (ProcessGroup.reduce(tensor, root, op) too)
        tensors, opts = _overload(tensors, opts, dist.ReduceOptions, rootRank=opts, reduceOp=op)
        what = "reduce"
        seq = self._call(what)[1]
        t = _one(tensors, what)
        op = self._reduce_fn(opts, t.dtype, what)
        root = self._root(opts, what)
        w = self._d.reduce(tensors, t, root, opts)
        if w is not None:
            return w
        alg, call = self._alg, (what, seq, root)
        return self._submit(lambda: alg.reduce(t, op, root, call), list(tensors), opts,
                            prof=("reduce", tensors))

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
        call = self._call(what)
        w = self._d.reduce_scatter(output_tensor, input_tensor, opts)
        if w is not None:
            return w
        out, inp, op = self._scatter_check(output_tensor, input_tensor, what, opts)
        alg = self._alg
        return self._submit(
            lambda: alg.reduce_scatter_flat(out, alg.rs_input([inp], inp.dtype), op, what, call),
            [output_tensor], opts, uses=[input_tensor],
            prof=("reduce_scatter_tensor", [output_tensor]))

    def reduce_scatter_single(self, output_tensor, input_tensor, opts=None):
        return self._reduce_scatter_base(output_tensor, input_tensor, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        what = "reduce_scatter_tensor (coalesced)"
        call = self._call(what)
        if len(outputs) != len(inputs):
            raise ValueError(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs")
        checked = [self._scatter_check(o, i, what, opts) for o, i in zip(outputs, inputs)]
        alg = self._alg

        def run():
            if checked:   # one header for the whole call (the pieces then move unchecked)
                o, _, op = checked[0]
                alg.check(call, o, o.dtype, sum(c[0].numel() for c in checked), op)
            else:
                alg.check(call, None)
            for o, i, op in checked:
                alg.reduce_scatter_flat(o, alg.rs_input([i], i.dtype), op, what)
        return self._submit(run, list(outputs), opts, uses=list(inputs),
                            prof=("reduce_scatter_tensor_coalesced", list(outputs)))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        what = "reduce_scatter"
        call = self._call(what)
        out = _one(output_tensors, what)
        if not isinstance(input_tensors, (list, tuple)) or len(input_tensors) != 1:
            raise ValueError(f"{what}: expected one list of input tensors")
        uneven = _uneven(input_tensors[0], out, self.size())
        ins = (_per_rank_v(input_tensors[0], out, self.rank(), what, "input", "output") if uneven
               else _per_rank(input_tensors[0], out, self.size(), what, "input"))
        op = self._reduce_fn(opts, out.dtype, what)
        alg = self._alg
        if uneven:   # as ProcessGroupNCCL's reduce_scatter_v
            return self._submit(lambda: alg.reduce_scatter_v(out, ins, op, what, call),
                                list(output_tensors), opts, uses=ins,
                                prof=("reduce_scatter", input_tensors))
        return self._submit(
            lambda: alg.reduce_scatter_flat(out, alg.rs_input(ins, out.dtype), op, what, call),
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
        # (ProcessGroup.broadcast(tensor, root) too)
        tensors, opts = _overload(tensors, opts, dist.BroadcastOptions, rootRank=opts)
        what = "broadcast"
        seq = self._call(what)[1]
        t = _one(tensors, what)
        root = self._root(opts, what)
        if opts is not None and opts.rootTensor != 0:
            raise ValueError(f"{what}: rootTensor {opts.rootTensor} (one tensor per rank)")
        w = self._d.broadcast(tensors, t, root, opts)
        if w is not None:
            return w
        alg, call = self._alg, (what, seq, root)
        return self._submit(lambda: alg.broadcast(t, root, what, call), list(tensors), opts,
                            prof=("broadcast", tensors))

    def gather(self, output_tensors, input_tensors, opts=None):
        what = "gather"
        seq = self._call(what)[1]
        inp = _one(input_tensors, what)
        me, n = self.rank(), self.size()
        root = self._root(opts, what)
        outs = _root_side(output_tensors, inp, n, root, me, what, "output")
        alg, call = self._alg, (what, seq, root)

        def run():
            alg.check(call, inp, inp.dtype, inp.numel())
            staged = [_Staged(o, copy_in=False) for o in outs]
            alg.star(what, root, [s.t for s in staged], inp.contiguous(), to_root=True)
            for s in staged:
                s.back()
        return self._submit(run, output_tensors, opts, uses=[inp], prof=("gather", [inp]))

    def scatter(self, output_tensors, input_tensors, opts=None):
        what = "scatter"
        seq = self._call(what)[1]
        out = _one(output_tensors, what)
        me, n = self.rank(), self.size()
        root = self._root(opts, what)
        ins = _root_side(input_tensors, out, n, root, me, what, "input")
        alg, call = self._alg, (what, seq, root)

        def run():
            alg.check(call, out, out.dtype, out.numel())
            s = _Staged(out, copy_in=False)
            alg.star(what, root, [i.contiguous() for i in ins], s.t, to_root=False)
            s.back()
        return self._submit(run, list(output_tensors), opts, uses=ins, prof=("scatter", ins))

    def alltoall_base(self, output_tensor, input_tensor, output_split_sizes,
                      input_split_sizes, opts=None):
        what = "all_to_all_single"
        w = None
        try:   # equal chunks: the C path first (as allreduce)
            if not output_split_sizes and not input_split_sizes:
                w = self._fast_all_to_all(output_tensor, input_tensor, opts)
        finally:
            call = self._call(what)
        if w is not None:
            return w
        out = _checked(output_tensor, f"{what} output")
        inp = _checked(input_tensor, f"{what} input")
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
        if out.is_contiguous() and inp.is_contiguous():
            # the chunks as (address, bytes), no view made: a view costs the
            # host more than the engine's round (benchmarks/fused_probe.py --pieces)
            es, po, pi = out.element_size(), out.data_ptr(), inp.data_ptr()
            work = self._d.all_to_all((out, inp), [(pi + a * es, (b - a) * es) for a, b in ib],
                                      [(po + a * es, (b - a) * es) for a, b in ob],
                                      [output_tensor], opts)
            if work is not None:
                return work
        out, inp = _alias(out), _alias(inp)
        alg = self._alg
        counts = [b - a for a, b in ib] + [b - a for a, b in ob]

        def run():
            alg.check_pairs(call, inp, counts)
            s = _Staged(out, copy_in=False)
            fo, fi = s.t.reshape(-1), inp.contiguous().reshape(-1)
            alg.exchange([fi[a:b] for a, b in ib], [fo[a:b] for a, b in ob], what)
            s.back()
        return self._submit(run, [output_tensor], opts, uses=[inp],
                            prof=("all_to_all", [input_tensor]))

    def all_to_all_single(self, output_tensor, input_tensor, output_split_sizes,
                          input_split_sizes, opts=None):
        return self.alltoall_base(output_tensor, input_tensor, output_split_sizes,
                                  input_split_sizes, opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        what = "all_to_all"
        call = self._call(what)
        n = self.size()
        outs = [_checked(t, f"{what} output") for t in output_tensors]
        ins = [_checked(t, f"{what} input") for t in input_tensors]
        if len(outs) != n or len(ins) != n:
            raise ValueError(f"{what}: {len(outs)} outputs and {len(ins)} inputs for a group "
                             f"of {n}")
        dtype = ins[0].dtype
        _same_dtype(ins + outs, dtype, what)
        me = self.rank()
        if outs[me].numel() != ins[me].numel():
            raise ValueError(f"{what}: this rank sends itself {ins[me].numel()} elements but "
                             f"expects {outs[me].numel()}")
        return self._all_to_all(outs, ins, list(output_tensors), ins, what, call,
                                ("all_to_all", input_tensors), opts)

    def _all_to_all(self, outs: list[torch.Tensor], ins: list[torch.Tensor], result: list,
                    uses: list, what: str, call: tuple, prof: tuple, opts: Any = None) -> Any:
        """ins[r] to rank r, outs[r] from rank r (checked: one dtype, this
        rank's own pair of one size): a blocking call on CUDA tensors whose
        ranks share this host posts its stream-ordered round here (the
        dispatch's row 2); anything else is a task, whose header carries
        every split size on the CPU path and which, on the stream-ordered
        path, runs the same round (_algorithms.exchange), so ranks that
        took either route meet."""
        work = self._d.all_to_all(outs + ins, stream_group.tensor_spans(ins),
                                  stream_group.tensor_spans(outs), result, opts)
        if work is not None:
            return work
        outs, ins = [_alias(t) for t in outs], [_alias(t) for t in ins]
        alg = self._alg
        counts = [i.numel() for i in ins] + [o.numel() for o in outs]

        def run():
            alg.check_pairs(call, ins[0], counts)
            staged = [_Staged(o, copy_in=False) for o in outs]
            alg.exchange([i.contiguous() for i in ins], [s.t for s in staged], what)
            for s in staged:
                s.back()
        return self._submit(run, result, opts, uses=uses, prof=prof)

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
        this host (the dispatch's row 6): one message of the stream-ordered
        group (csrc/sg/sg_p2p.c), posted here with no host wait, after the work
        queued on the current stream, and matched in order with the peer's
        receive or send, as NCCL's are; None elsewhere (CPU tensors, peers
        on other hosts: the engine's messages, _anysource.Channel).  The
        tensors are kept until the message is in place, so that memory
        freed meanwhile is not handed out while a peer still copies."""
        sg = self._d.p2p(t, what)
        if sg is None:
            return None
        return self._posted(sg, what, tensors, (t, tensors), list(tensors),
                            lambda s: sg.p2p(s, [(peer, send, t.data_ptr(), t.nbytes)]))

    def _posted(self, sg: Any, what: str, profiled: list, keep: Any, result: list,
                post: Callable[[int], list[int]]) -> P2PWork:
        """post(the current stream's handle) -> the messages' codes, under
        the profiler; `keep` held until they are in place; their Work."""
        prof = _profiling.begin(what, profiled)
        try:
            codes = post(stream_group._raw_stream(sg.dev))
        finally:
            _profiling.end(prof)
        self._keep_unfinished_p2p()
        self._p2p_live.append((codes, keep))
        return P2PWork(sg, codes, result)

    def _keep_unfinished_p2p(self) -> None:
        """Drop the tensors of messages in place; once the group failed (the
        words say nothing then, and released streams still run the copies
        they had queued) or is closing, keep the rest for good."""
        sg = self._d.sg
        if not self._p2p_live or sg is None or sg.c is None:
            return
        if sg.error() is None:
            self._p2p_live = [e for e in self._p2p_live if not all(map(sg.c.p2p_passed, e[0]))]
        if sg.error() is not None or self._d.closed:
            stream_group._KEPT.append(self._p2p_live)
            self._p2p_live = []

    def send(self, tensors, dstRank, tag=0):
        what = "send"
        t = _one(tensors, what)
        if dstRank == self.rank():   # as NCCL: matched with a receive from this rank
            return self._self_box.send(t, list(tensors))
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
        if srcRank == self.rank():
            return self._self_box.recv(t, list(tensors))
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
        if t.is_cuda and self._d.stream_group(t.device.index) is not None:
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
        call, alg = self._call("barrier"), self._alg
        # every rank's header, exchanged: a barrier (and one call compared)
        return self._submit(lambda: alg.check(call, None), [], opts, prof=("barrier", []))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """As Gloo's (_barrier.py): names the ranks that did not arrive."""
        secs = _barrier.timeout_s(timeout, self._timeout)
        self._call("monitored_barrier")   # (numbered; its own exchange has no header)

        def run():
            try:
                _barrier.run(self._ctx, self.rank(), self.size(), secs, wait_all_ranks)
            except UcclTimeoutError as e:   # receives left posted: the order is lost
                self._runner.poison(f"monitored_barrier failed ({e})")
                raise
        self._submit(run, [], _SYNC, prof=("monitored_barrier", []))

    def _shutdown(self, why: str) -> None:
        d = getattr(self, "_d", None)
        if d is None or d.closed:   # (None: __init__ failed, and closed what it made)
            return
        d.close()
        self._keep_unfinished_p2p()
        self._ctx.finalize()   # fails what is in flight: every Work settles
        self._chan.ctx.finalize()
        self._runner.close(why)   # the context's finalize() closed the stream group
        self._alg.close()

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
