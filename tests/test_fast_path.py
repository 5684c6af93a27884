"""The backend's blocking all_reduce, all_gather_into_tensor and
all_to_all_single (no split sizes) in one C call (csrc/py/py_fastpath.c:
_engine.FastPath.allreduce / allgather / all_to_all, the first row of
core/dispatch.py) on the CPU's emulated device.  Its checks read
torch's tensors and options through their Python attributes, so a
stand-in whose is_cuda is True, over a CPU tensor, takes it here; the
ranks are threads with emulated groups and streams, as in
test_stream_group.py.  On CUDA tensors the same call runs under every
dist.all_reduce and all_gather_into_tensor of tests/test_gpu_collective.py
(GPU machine).

Checked: the bytes of both collectives on 2 and 3 ranks; every case where
the Python path must decide instead (the call returns None and nothing is
published: the next rounds still meet); the runner's token given back
after a round and after a round's error, which is raised as the Python
path raises it; and that the backend gives the C path its own state (the
runner's token, the stream group, the codes, closed) and calls it first."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from uccl_collective import _engine
from uccl_collective.backend import process_group as bk
from uccl_collective.backend._work import Runner, StreamWork, Task
from uccl_collective.core import dispatch
from uccl_collective.p2p import UcclError
from test_stream_group import (  # noqa: F401 - the fixtures are autouse
    _callers, caller_streams, close_all, drain, make_groups, no_stale_words, on_ranks,
    round_form)

SUM = hash(dist.ReduceOp(dist.ReduceOp.SUM))


class FakeCuda:
    """A CPU tensor that says it is on cuda:dev: what the C path reads."""
    is_cuda = True

    def __init__(self, t: torch.Tensor, dev: int = 0, layout=torch.strided):
        self.t, self.dev, self.layout, self.dtype = t, dev, layout, t.dtype

    def is_contiguous(self):
        return self.t.is_contiguous()

    def get_device(self):
        return self.dev

    def data_ptr(self):
        return self.t.data_ptr()

    def numel(self):
        return self.t.numel()

    def element_size(self):
        return self.t.element_size()

    @property
    def shape(self):
        return self.t.shape


class Switch:
    profiler = False
    capturing = False


pytestmark = pytest.mark.skipif(not dispatch.HASH_IS_OP, reason="this torch's hash(ReduceOp) is not "
                                "its operator's number, so the backend leaves the C path off")


@pytest.fixture(autouse=True)
def fake_cuda_hooks():
    """The C path's torch pieces, for these tests: FakeCuda as the tensor
    type, the rank thread's emulated stream as the current stream; the
    backend's own put back after."""
    _engine.fast_setup(FakeCuda, torch.strided, lambda: Switch.profiler,
                       lambda: Switch.capturing, lambda dev: _callers.stream, StreamWork)
    Switch.profiler = Switch.capturing = False
    yield
    _engine.fast_setup(*bk._FAST_HOOKS)


class Pg:
    """A group's C path as its Dispatch sets it up: a FastPath over its
    runner's token, given its stream group and its cached codes."""

    def __init__(self, sg, n):
        self._runner = Runner("test", 10.0)
        self.sg = sg
        self.fp = _engine.FastPath(self._runner, n)
        self.fp.set_group(sg, sg.c, sg.dev)
        self.fp.codes[(SUM, torch.float32)] = (_engine.DT_F32, _engine.RED_SUM)
        self.fp.codes[(SUM, torch.int64)] = ()   # a dtype the kernel does not take


def sync_opts():
    o = dist.AllreduceOptions()
    o.asyncOp = False
    return o


@pytest.mark.parametrize("n", [2, 3])
def test_the_c_path_moves_the_bytes_of_both_collectives(n):
    groups = make_groups(n)
    pgs = [Pg(g, n) for g in groups]
    rng = np.random.default_rng(7 + n)
    sizes = [1, 7, 300, 1000]   # 4 B .. 4000 B per rank, odd counts
    data = [[torch.from_numpy(rng.integers(-1000, 1000, s).astype(np.float32)) for _ in range(n)]
            for s in sizes]

    def rank(r):
        kept = []
        for i, s in enumerate(sizes):
            x = data[i][r].clone()
            w = pgs[r].fp.allreduce([FakeCuda(x)], sync_opts())
            assert isinstance(w, StreamWork) and w._caller == _callers.stream
            out = torch.full((n * s,), float("nan"))   # poisoned
            g = pgs[r].fp.allgather(FakeCuda(out), FakeCuda(data[i][r]), sync_opts())
            assert isinstance(g, StreamWork) and g._k == w._k + 1
            assert not pgs[r]._runner._busy, "the token was not given back"
            kept.append((x, out))
        return kept
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    for r in range(n):
        for i in range(len(sizes)):
            x, out = res[r][i]
            assert torch.equal(x, sum(data[i][q] for q in range(n))), (r, i, "all_reduce")
            assert torch.equal(out, torch.cat(data[i])), (r, i, "all_gather")
    close_all(groups, streams)


@pytest.mark.parametrize("n", [2, 3])
def test_the_c_path_all_to_all_meets_the_python_round(n):
    """all_to_all_single with no split sizes through FastPath.all_to_all on
    even ranks and StreamGroup.all_to_all (the round the Python path posts)
    on odd ones: one round, random bytes, poisoned outputs, 2-D tensors
    whose dim 0 is a multiple of the ranks; the own chunk copied too."""
    groups = make_groups(n)
    pgs = [Pg(g, n) for g in groups]
    rng = np.random.default_rng(11 + n)
    rows = [n, 3 * n, 100 * n]   # dim 0; 5 float32 a row
    data = [[torch.from_numpy(rng.standard_normal((d, 5)).astype(np.float32)) for _ in range(n)]
            for d in rows]

    def rank(r):
        kept = []
        for i, d in enumerate(rows):
            x, out = data[i][r], torch.full((d, 5), float("nan"))
            if r % 2 == 0:
                w = pgs[r].fp.all_to_all(FakeCuda(out), FakeCuda(x), sync_opts())
                assert isinstance(w, StreamWork) and w._caller == _callers.stream, w
            else:
                c = x.numel() // n * 4
                groups[r].all_to_all(_callers.stream,
                                     [(x.data_ptr() + j * c, c) for j in range(n)],
                                     [(out.data_ptr() + j * c, c) for j in range(n)])
            assert not pgs[r]._runner._busy, "the token was not given back"
            kept.append(out)
        return kept
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    for r in range(n):
        for i, d in enumerate(rows):
            want = torch.cat([data[i][q].chunk(n)[r] for q in range(n)])
            assert torch.equal(res[r][i], want), (r, d)
    close_all(groups, streams)


def test_the_c_path_all_to_all_declines_what_the_python_path_decides():
    """Each call the Python path must decide (and raise for, where it is
    wrong) returns None, publishing nothing: the next round still meets."""
    groups = make_groups(2)
    pgs = [Pg(g, 2) for g in groups]

    def rank(r):
        o, a = sync_opts(), dist.AllToAllOptions()   # asyncOp defaults to True
        x, y = torch.arange(8, dtype=torch.float32), torch.zeros(8)
        cases = {
            "an asynchronous call": lambda: pgs[r].fp.all_to_all(FakeCuda(y), FakeCuda(x), a),
            "dtypes differ": lambda: pgs[r].fp.all_to_all(FakeCuda(y.double()), FakeCuda(x), o),
            "sizes differ": lambda: pgs[r].fp.all_to_all(FakeCuda(torch.zeros(6)), FakeCuda(x),
                                                         o),
            "dim 0 not a multiple of the ranks": lambda: pgs[r].fp.all_to_all(
                FakeCuda(y.view(1, 8)), FakeCuda(x.view(1, 8)), o),
            "no dimension": lambda: pgs[r].fp.all_to_all(FakeCuda(torch.zeros(())),
                                                         FakeCuda(torch.ones(())), o),
            "input on another device": lambda: pgs[r].fp.all_to_all(FakeCuda(y),
                                                                     FakeCuda(x, dev=1), o),
            "not contiguous": lambda: pgs[r].fp.all_to_all(FakeCuda(y.view(2, 4).t()),
                                                           FakeCuda(x.view(4, 2)), o),
            "a CPU tensor": lambda: pgs[r].fp.all_to_all(y, FakeCuda(x), o),
        }
        got = {name: fn() for name, fn in cases.items()}
        assert got == dict.fromkeys(cases), {k: v for k, v in got.items() if v is not None}
        w = pgs[r].fp.all_to_all(FakeCuda(y), FakeCuda(x), o)   # then a good one meets
        assert isinstance(w, StreamWork) and w._k == 1, w
        return y, x   # x too: the peer reads it once the streams run
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    drain(groups, streams)
    x = torch.arange(8, dtype=torch.float32)
    for r in range(2):
        assert torch.equal(res[r][0], torch.cat([x.chunk(2)[r], x.chunk(2)[r]])), r
    close_all(groups, streams)


def declines(pg, x, out):
    """Every call the Python path must decide: each returns None."""
    o = sync_opts()
    async_o = dist.AllreduceOptions()   # asyncOp defaults to True
    t, y = FakeCuda(x), FakeCuda(out)
    cases = {
        "no options": lambda: pg.fp.allreduce([t], None),
        "an asynchronous call": lambda: pg.fp.allreduce([t], async_o),
        "two tensors": lambda: pg.fp.allreduce([t, t], o),
        "a tuple": lambda: pg.fp.allreduce((t,), o),
        "not a tensor": lambda: pg.fp.allreduce([object()], o),
        "a CPU tensor": lambda: pg.fp.allreduce([x], o),
        "is_cuda False": lambda: pg.fp.allreduce([not_cuda(x)], o),
        "another device": lambda: pg.fp.allreduce([FakeCuda(x, dev=1)], o),
        "a sparse layout": lambda: pg.fp.allreduce([FakeCuda(x, layout=torch.sparse_coo)],
                                                          o),
        "not contiguous": lambda: pg.fp.allreduce([FakeCuda(x.view(2, -1).t())], o),
        "codes not cached": lambda: pg.fp.allreduce([FakeCuda(x.double())], o),
        "a dtype the kernel does not take": lambda: pg.fp.allreduce(
            [FakeCuda(x.long())], o),
        "another operator": lambda: pg.fp.allreduce([t], max_opts()),
        "all_gather, dtypes differ": lambda: pg.fp.allgather(y, FakeCuda(x.double()),
                                                                     o),
        "all_gather, output not world x input": lambda: pg.fp.allgather(
            FakeCuda(out[:-1]), t, o),
        "all_gather, output world x input + 1": lambda: pg.fp.allgather(
            FakeCuda(torch.zeros(2 * x.numel() + 1)), t, o),
        "all_gather, input on another device": lambda: pg.fp.allgather(
            y, FakeCuda(x, dev=1), o),
    }
    got = {name: fn() for name, fn in cases.items()}
    assert got == dict.fromkeys(cases), {k: v for k, v in got.items() if v is not None}


def not_cuda(x):
    t = FakeCuda(x)
    t.is_cuda = False
    return t


def max_opts():
    o = sync_opts()
    o.reduceOp = dist.ReduceOp.MAX
    return o


def states(pg):
    """The switches of the group, the runner and torch that send a call to
    the Python path, one at a time: (name, set, reset).  (The group's
    engine object is the FastPath's own, type-checked when set: see
    test_the_c_path_takes_only_an_engine_group; closed, its round raises:
    test_a_closed_group_raises_as_the_python_path_does.)"""
    fp, r, sg = pg.fp, pg._runner, pg.sg
    tok = r   # the runner is the token (its C base)

    def setter(obj, attr, value):
        old = getattr(obj, attr)
        return lambda: setattr(obj, attr, value), lambda: setattr(obj, attr, old)

    def group(*args):
        return lambda: fp.set_group(*args)
    held, release = threading.Event(), threading.Event()

    def hold_lock():   # another thread queueing or running a task holds the runner's lock
        def hold():
            with r._cv:
                held.set()
                release.wait(10)
        threading.Thread(target=hold, daemon=True).start()
        assert held.wait(10)

    def let_go():
        release.set()
        with r._cv:   # the holder is gone
            pass
        held.clear()
        release.clear()
    return [
        ("the profiler on", *setter(Switch, "profiler", True)),
        ("a graph capturing", *setter(Switch, "capturing", True)),
        ("the group shut down", *setter(fp, "closed", True)),
        ("no stream group yet", group(None, None, -1), group(sg, sg.c, sg.dev)),
        ("a task running", *setter(tok, "busy", True)),
        ("a task queued", lambda: r._q.append(Task(lambda: None, [])), r._q.clear),
        ("the runner closed", *setter(tok, "closed", "closed")),
        ("the runner poisoned", *setter(tok, "poisoned", "poisoned")),
        ("the runner's lock held", hold_lock, let_go),
        ("the group on another device", group(sg, sg.c, 1), group(sg, sg.c, sg.dev)),
    ]


def test_every_case_of_the_python_path_is_declined_and_publishes_nothing():
    n = 2
    groups = make_groups(n)
    pgs = [Pg(g, n) for g in groups]
    x0 = [torch.arange(8, dtype=torch.float32) + r for r in range(n)]

    def rank(r):
        x, out = x0[r].clone(), torch.zeros(8 * n)
        declines(pgs[r], x, out)
        for name, on, off in states(pgs[r]):
            on()
            try:
                assert pgs[r].fp.allreduce([FakeCuda(x)], sync_opts()) is None, name
                assert pgs[r].fp.allgather(FakeCuda(out), FakeCuda(x),
                                              sync_opts()) is None, name
            finally:
                off()
        # nothing was published: the first round that runs is round 1 on both ranks
        w = pgs[r].fp.allreduce([FakeCuda(x)], sync_opts())
        assert w is not None and w._k == 1, w
        return x
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    for r in range(n):
        assert torch.equal(res[r], x0[0] + x0[1])
    close_all(groups, streams)


def test_a_round_that_fails_raises_and_gives_the_token_back():
    """Ranks that call different collectives: the round's error (the
    Python path raises the same) comes out of the C call, and the runner's
    token is free again, on both ranks."""
    n = 2
    groups = make_groups(n)
    pgs = [Pg(g, n) for g in groups]

    def rank(r):
        x, out = torch.ones(4), torch.zeros(8)
        with pytest.raises(UcclError) as e:
            for _ in range(3):   # (raises at the first: its round compares the calls)
                if r == 0:
                    pgs[r].fp.allreduce([FakeCuda(x)], sync_opts())
                else:
                    pgs[r].fp.allgather(FakeCuda(out), FakeCuda(x), sync_opts())
        assert not pgs[r]._runner._busy, "the token was not given back"
        return str(e.value), x, out   # kept alive until the streams drained
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    for r in range(n):
        assert "calls disagree" in res[r][0] and "all_reduce" in res[r][0], res[r][0]
    close_all(groups, streams)


def test_a_closed_group_raises_as_the_python_path_does():
    groups = make_groups(2)
    pg = Pg(groups[0], 2)
    groups[0].c.close()
    _callers.stream = _engine._sg_emu_stream()
    try:
        with pytest.raises(ValueError, match="stream-ordered group is closed"):
            pg.fp.allreduce([FakeCuda(torch.ones(4))], sync_opts())
        assert not pg._runner._busy, "the token was not given back"
    finally:
        close_all(groups, [_callers.stream])


def test_a_task_queued_for_the_runner_thread_during_the_round_is_woken():
    """A task queued during the round for the runner's thread (no waiter
    polls for it): giving the token back must wake that thread, else the
    task never starts."""
    n = 2
    groups = make_groups(n)
    pgs = [Pg(g, n) for g in groups]
    started = []
    task = Task(lambda: started.append(time.monotonic()), [])

    def rank(r):
        x = torch.ones(4)
        if r == 1:
            time.sleep(0.5)
        else:
            threading.Timer(0.1, pgs[0]._runner.submit, (task, False, time.monotonic() + 10)).start()
        w = pgs[r].fp.allreduce([FakeCuda(x)], sync_opts())
        return w, time.monotonic(), x
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    pgs[0]._runner.drive(task, time.monotonic() + 3, run_here=False)   # UcclTimeoutError if never woken
    assert started and started[0] >= res[0][1] - 0.05 and started[0] - res[0][1] < 1.0, \
        (started, res[0][1])
    drain(groups, streams)
    pgs[0]._runner.close("test")
    close_all(groups, streams)


def test_the_c_path_takes_only_an_engine_group():
    groups = make_groups(2)
    pg = Pg(groups[0], 2)
    try:
        for c in (None, object(), groups[0]):
            with pytest.raises(TypeError, match="not a StreamGroup of the engine"):
                pg.fp.set_group(groups[0], c, 0)
        assert pg.fp.group is groups[0]   # unchanged by the refusals
        with pytest.raises(TypeError, match="not a Token"):
            _engine.FastPath(object(), 2)
    finally:
        close_all(groups, [])


def test_all_to_all_single_tries_the_c_path_only_without_split_sizes():
    """alltoall_base hands the C path (output, input, opts) when neither
    side has split sizes, and takes its Work; with split sizes it never
    asks it (the C call takes equal chunks only), and numbers the call
    either way (the next header check counts it)."""
    from datetime import timedelta
    pg = bk.ProcessGroupUCCL(dist.HashStore(), 0, 1, timedelta(seconds=30))
    asked, sentinel = [], object()
    try:
        pg._fast_all_to_all = lambda o, i, opts: asked.append((o, i, opts)) or sentinel
        x, y, o = torch.arange(4.0), torch.zeros(4), dist.AllToAllOptions()
        calls = pg._chk.calls
        assert pg.alltoall_base(y, x, [], [], o) is sentinel
        assert asked == [(y, x, o)] and pg._chk.calls == calls + 1
        w = pg.alltoall_base(y, x, [4], [4], o)   # split sizes: the Python path (CPU here)
        w.wait()
        assert len(asked) == 1 and torch.equal(y, x) and pg._chk.calls == calls + 2
    finally:
        pg.shutdown()


def test_the_backend_gives_the_c_path_its_state():
    """The C path reads only its own state, which the backend keeps: a
    FastPath over the runner's token (the token a task holds is the one the
    C call takes), closed when the group shuts down; the group's
    allreduce and _allgather_base call it first."""
    from datetime import timedelta
    pg = bk.ProcessGroupUCCL(dist.HashStore(), 0, 1, timedelta(seconds=30))
    try:
        d, r = pg._d, pg._runner
        fp = d.fp
        assert fp.token is r and isinstance(r, _engine.Token)
        assert fp.closed is False and fp.group is None
        assert fp.codes is d.codes and fp.codes == {}
        assert pg._fast_allreduce == fp.allreduce and pg._fast_allgather == fp.allgather
        assert pg._fast_all_to_all == fp.all_to_all
        assert r.busy is False and not r._q and r.closed is None and r.poisoned is None
        assert r.inline(lambda: r.busy) == (True, True) and r.busy is False
        assert bk.ProcessGroupUCCL.allreduce.__code__.co_names[0] == "_fast_allreduce"
        assert bk.ProcessGroupUCCL._allgather_base.__code__.co_names[0] == "_fast_allgather"
    finally:
        pg.shutdown()
    assert fp.closed is True and r.closed


def test_the_dispatch_gives_the_c_path_the_stream_group():
    """The stream group the dispatch makes at a group's first CUDA call is
    the one the C path then runs its rounds on."""
    groups = make_groups(2)

    class Ctx:
        rank, world_size, timeout_s = 0, 2, 5.0

        def stream_group(self, dev, timeout_s):
            return groups[0]
    d = dispatch.Dispatch(Ctx(), Runner("test", 5.0), 0, 2, 5.0, StreamWork, None)
    try:
        d.sg_off = False   # (as where UCCL_STREAM_ORDERED is on)
        assert d.stream_group(0) is groups[0]
        assert d.fp.group is groups[0] and d.sctx is not None
        d.close()
        assert d.fp.closed is True
    finally:
        close_all(groups, [])


def test_an_interrupt_in_a_check_is_raised_not_swallowed():
    """A KeyboardInterrupt raised by something the checks call (a signal
    handler runs in Python code) comes out of the call; nothing ran."""
    groups = make_groups(2)
    pg = Pg(groups[0], 2)

    def interrupted():
        raise KeyboardInterrupt
    _engine.fast_setup(FakeCuda, torch.strided, lambda: False, interrupted,
                       lambda dev: _callers.stream, StreamWork)
    _callers.stream = _engine._sg_emu_stream()
    try:
        with pytest.raises(KeyboardInterrupt):
            pg.fp.allreduce([FakeCuda(torch.ones(4))], sync_opts())
        assert not pg._runner._busy
    finally:
        close_all(groups, [_callers.stream])


def test_a_task_submitted_during_the_round_waits_for_it():
    """The token is held across the round (Runner.inline's rule): rank 0's
    first round waits on the host for rank 1, which comes 0.5 s late; a
    task another thread submits 0.1 s in must start after that round."""
    n = 2
    groups = make_groups(n)
    pgs = [Pg(g, n) for g in groups]
    t0 = time.monotonic()
    started = []

    def rank(r):
        x = torch.ones(4)
        if r == 1:
            time.sleep(0.5)
            return pgs[r].fp.allreduce([FakeCuda(x)], sync_opts()), x
        task = Task(lambda: started.append(time.monotonic() - t0), [])
        tm = threading.Timer(0.1, pgs[0]._runner.submit, (task, True, time.monotonic() + 10))
        tm.start()
        w = pgs[r].fp.allreduce([FakeCuda(x)], sync_opts())
        tm.join(10)
        return w, x
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    assert res[0][0] is not None and res[1][0] is not None
    assert len(started) == 1 and started[0] >= 0.45, started
    close_all(groups, streams)


def test_a_token_or_fast_path_never_initialised_refuses_instead_of_crashing():
    # made by __new__ alone (or a subclass that forgot super().__init__)
    tok = _engine.Token.__new__(_engine.Token)
    with pytest.raises(RuntimeError, match=r"__init__\(cv, q\), which makes its lock, was not"):
        tok.run(lambda: None)
    fp = _engine.FastPath.__new__(_engine.FastPath)
    assert fp.allreduce([torch.zeros(1)], None) is None   # declines: the Python path decides
    assert fp.allgather(torch.zeros(2), torch.zeros(1), None) is None
    with pytest.raises(RuntimeError, match="FastPath.__init__ was not called"):
        fp.set_group(None, None, -1)


class _Interrupting(list):
    """A queue whose truth test raises KeyboardInterrupt on its n-th read."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def __bool__(self):
        self.n -= 1
        if self.n == 0:
            raise KeyboardInterrupt("while the token is given back")
        return len(self) > 0


def test_an_interrupt_while_the_token_is_given_back_is_raised_as_itself():
    # Token.run's `finally` (with cv: busy = False; if q: cv.notify_all()):
    # the interrupt raised there, the lock released, the token free again
    cv = threading.Condition(threading.RLock())
    for reads in (1, 2):   # the read before fn (1: refused there) or the one after (2)
        q = _Interrupting(reads)
        tok = _engine.Token(cv, q)
        ran = []
        with pytest.raises(KeyboardInterrupt, match="given back"):
            tok.run(ran.append, 1)
        assert ran == ([] if reads == 1 else [1])
        assert tok.busy is False
        assert cv.acquire(blocking=False)   # not left held
        cv.release()
