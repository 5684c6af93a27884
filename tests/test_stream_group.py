"""The stream-ordered groups' protocol (csrc/sg/sgroup.c, sg_call.c, through
uccl_collective/core/stream_group.py) on the CPU: ranks are threads of this
process, the shared page is the real one (a file in /dev/shm), and each
CUDA stream is the engine's emulated stream (csrc/sgdev/sg_emu.c: a thread that
runs the queued writes, waits, copies, reductions and events in order).
Only the driver calls are replaced; the CUDA side (cuStreamWaitValue32,
CUDA IPC, the NVRTC reduction kernel) runs on the GPU machine:
tests/test_gpu_collective.py drives the same code through the backend and
CollectiveContext there."""
from __future__ import annotations

import struct
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from uccl_collective import _engine
from uccl_collective.core import stream_group as sgm
from uccl_collective.p2p import UcclError, UcclTimeoutError

R = dist.ReduceOp.RedOpType
IDLE_S = 30.0
# the page's layout (csrc/sg/sgroup.c), for the hostile-peer case
PAGE, RANK_BYTES, OFF_SLOTS, NSLOT = 4096, 5 * 4096, 320, 4
SLOT_BYTES = (RANK_BYTES - OFF_SLOTS) // NSLOT
MAX_ENTRIES = (SLOT_BYTES - 48) // 32


class Store:
    """torch's store calls that the page's setup makes, for threads."""

    def __init__(self):
        self._d, self._cv = {}, threading.Condition()

    def set(self, k, v):
        with self._cv:
            self._d[k] = v.encode() if isinstance(v, str) else v
            self._cv.notify_all()

    def get(self, k):
        with self._cv:
            assert self._cv.wait_for(lambda: k in self._d, 10), f"store key {k} never set"
            return self._d[k]

    def compare_set(self, k, expected, desired):
        with self._cv:
            cur = self._d.get(k)
            if (cur is None and expected == "") or (cur is not None and cur == expected.encode()):
                cur = self._d[k] = desired.encode()
                self._cv.notify_all()
            return cur if cur is not None else expected.encode()

    def add(self, k, n):
        with self._cv:
            self._d[k] = int(self._d.get(k, 0)) + n
            return self._d[k]


class Ctx:
    def __init__(self, store, rank, n, timeout_s):
        self.rank, self.world_size, self.timeout_s = rank, n, timeout_s
        self._kv = store
        self._conns = ([0] * n, [0] * n)


_callers = threading.local()   # each rank thread's emulated caller stream


@pytest.fixture(autouse=True)
def caller_streams(monkeypatch):
    monkeypatch.setattr(sgm, "_raw_stream", lambda dev: _callers.stream)


@pytest.fixture(autouse=True)
def no_stale_words():
    """No wait of an emulated stream passed on a word left 2^31 behind
    (csrc/sgdev/sg_emu.c, STALE_AHEAD), nor an LL line read with a later
    round's number than its own: every test here checks it."""
    before = _engine._sg_emu_stale_passes()
    yield
    assert _engine._sg_emu_stale_passes() == before, "a stream wait passed on a stale word"


@pytest.fixture(autouse=True, params=["two-sided", "one-launch"])
def round_form(request, monkeypatch):
    """Every test here both ways: all_reduce and allgather of a few bytes
    per rank as two-sided rounds, and as one-launch rounds (the default up
    to UCCL_SG_FUSED_BYTES; tests/test_stream_fused.py has their own)."""
    if request.param == "two-sided":
        monkeypatch.setenv("UCCL_SG_FUSED_BYTES", "0")
    else:
        monkeypatch.delenv("UCCL_SG_FUSED_BYTES", raising=False)
    return request.param


def make_groups(n, timeout_s=5.0):
    store, out = Store(), [None] * n

    def mk(r):
        out[r] = sgm.StreamGroup(Ctx(store, r, n, timeout_s), 0, timeout_s, emulated=True)
    ts = [threading.Thread(target=mk, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(15)
    assert all(out), "a rank did not open the shared page"
    return out


def on_ranks(n, fn, timeout=40.0):
    """fn(rank) on n threads, each with its own emulated caller stream;
    returns (results, errors, caller streams)."""
    res, err = [None] * n, [None] * n
    streams = [_engine._sg_emu_stream() for _ in range(n)]

    def body(r):
        _callers.stream = streams[r]
        try:
            res[r] = fn(r)
        except BaseException as e:   # noqa: BLE001 - reported to the test
            err[r] = e
    ts = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
        assert not t.is_alive(), "a rank's host part hung"
    return res, err, streams


def drain(groups, streams):
    for s in list(streams) + [g.stream for g in groups]:
        assert _engine._sg_emu_stream_idle(s, IDLE_S), "an emulated stream stayed blocked"


def close_all(groups, streams):
    """Close the groups; returns each one's emulated counts (registrations
    made, released, mappings live).  No stream wait may have been stuck."""
    counts = []
    for g in groups:
        c = g.c
        g.close()
        counts.append(c.emu_counts())
    stuck = [_engine._sg_emu_stream_free(s) for s in streams]
    assert stuck == [0] * len(streams), f"waits stuck past the bound: {stuck}"
    return counts


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allgather_and_p2p_rounds_move_the_right_bytes(n):
    rounds = 3 * NSLOT + 1   # every descriptor slot reused
    groups = make_groups(n)
    rng = np.random.default_rng(n)
    sizes = [int(s) for s in rng.integers(1, 5000, rounds)]
    data = [[torch.from_numpy(rng.integers(0, 256, sizes[i], dtype=np.uint8)) for r in range(n)]
            for i in range(rounds)]

    def rank(r):
        ctx = sgm.StreamCtx(Ctx(None, r, n, 5.0), groups[r])
        seen = []
        for i in range(rounds):
            out = torch.full((n * sizes[i],), 0xA5, dtype=torch.uint8)   # poisoned
            lst = [torch.full((sizes[i],), 0xA5, dtype=torch.uint8) for _ in range(n)]
            send = data[i][r].clone()
            ctx.allgather(send, out)
            ctx.allgather(send, lst)
            # personalised: rank r sends (r + j) to rank j, from a piece of its own
            pieces = [torch.full((j + 1 + i,), r * 16 + j, dtype=torch.uint8) for j in range(n)]
            got = [torch.full((r + 1 + i,), 0xA5, dtype=torch.uint8) for _ in range(n)]
            ctx._p2p([("send", pieces[j], j) for j in range(n) if j != r] +
                     [("recv", got[j], j) for j in range(n) if j != r], "p2p")
            seen.append((out, lst, got, send, pieces))   # kept alive until the stream ran
        return seen
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    for r in range(n):
        for i, (out, lst, got, _s, _p) in enumerate(res[r]):
            assert torch.equal(out, torch.cat(data[i])), f"rank {r} round {i}: allgather bytes"
            assert torch.equal(torch.cat(lst), torch.cat(data[i])), f"rank {r} round {i}: list"
            for j in range(n):
                if j != r:
                    assert torch.equal(got[j], torch.full((r + 1 + i,), j * 16 + r,
                                                          dtype=torch.uint8)), (r, i, j)
    counts = close_all(groups, streams)
    for regs, deregs, maps in counts:   # every registration released, every mapping too
        assert regs > 0 and regs == deregs and maps == 0, counts


def _reference(xs: list[torch.Tensor], op, dtype) -> torch.Tensor:
    """The kernel's arithmetic in torch, in rank order: 16-bit floats
    accumulate in float32, integers in int64 (wrapping), one rounding at the
    end; AVG is the sum rounded to the type, then divided (integers:
    truncated)."""
    if dtype == torch.bool:
        acc = xs[0].clone()
        for x in xs[1:]:
            if op in (R.PRODUCT, R.MIN, R.BAND):
                acc = acc & x
            elif op == R.BXOR:
                acc = acc ^ x
            else:
                acc = acc | x
        return acc
    flt = dtype.is_floating_point
    acc_t = (torch.float64 if dtype == torch.float64 else torch.float32) if flt else torch.int64
    acc = xs[0].to(acc_t)
    for x in xs[1:]:
        x = x.to(acc_t)
        if op in (R.SUM, R.AVG):
            acc = acc + x
        elif op == R.PRODUCT:
            acc = acc * x
        elif op == R.MIN:
            acc = torch.minimum(acc, x)
        elif op == R.MAX:
            acc = torch.maximum(acc, x)
        elif op == R.BAND:
            acc = acc & x
        elif op == R.BOR:
            acc = acc | x
        else:
            acc = acc ^ x
    out = acc.to(dtype)
    if op == R.AVG:
        s = out.to(acc_t)
        out = (s / len(xs) if flt else torch.div(s, len(xs), rounding_mode="trunc")).to(dtype)
    return out


def _inputs(seed: int, n: int, count: int, dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return [torch.randint(0, 2, (count,), generator=g).bool() for _ in range(n)]
    if dtype.is_floating_point:
        return [(torch.rand(count, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
                for _ in range(n)]
    info = torch.iinfo(dtype)
    return [torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, (count,),
                          generator=g).to(dtype) for _ in range(n)]


OPS = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, R.BAND, R.BOR, R.BXOR]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_reductions_compute_what_the_kernel_promises(n):
    """allreduce (in place, two phases), reduce_scatter, reduce: every dtype
    and operator the kernel takes, sizes 0, 1, odd and larger than a vector,
    bitwise against the same arithmetic in torch; every rank's result equal."""
    groups = make_groups(n)
    cases = []
    for dtype in sgm.DTYPES:
        for op in OPS:
            if op in (R.BAND, R.BOR, R.BXOR) and dtype.is_floating_point:
                continue
            if op == R.AVG and dtype == torch.bool:
                continue
            for count in (0, 1, 4099):
                cases.append((dtype, op, count))

    def rank(r):
        sg, out = groups[r], []
        for i, (dtype, op, count) in enumerate(cases):
            dt, opc = sg.reduce_codes(dtype, op)
            xs = _inputs(i, n, count, dtype)
            buf = xs[r].clone()
            sg.c.allreduce(_callers.stream, True, 0, buf.data_ptr(), count, dt, opc)
            rs_in = torch.cat(_inputs(1000 + i, n, n * count, dtype)[r:r + 1])
            rs_out = torch.zeros(count, dtype=dtype)
            sg.c.reduce_scatter(_callers.stream, True, 0, rs_out.data_ptr(), rs_in.data_ptr(),
                                count, dt, opc)
            root = i % n
            red = _inputs(2000 + i, n, count, dtype)[r].clone()
            sg.c.reduce(_callers.stream, True, 0, red.data_ptr(), count, dt, opc, root)
            out.append((buf, rs_out, red, rs_in))
        return out
    res, err, streams = on_ranks(n, rank, timeout=120)
    assert err == [None] * n, err
    drain(groups, streams)
    for i, (dtype, op, count) in enumerate(cases):
        what = f"{dtype} {op.name} x{count}"
        want = _reference(_inputs(i, n, count, dtype), op, dtype)
        rs_all = [_inputs(1000 + i, n, n * count, dtype)[q] for q in range(n)]
        rs_want = _reference(rs_all, op, dtype)
        red_want = _reference(_inputs(2000 + i, n, count, dtype), op, dtype)
        for r in range(n):
            buf, rs_out, red, _ = res[r][i]
            assert torch.equal(buf.view(torch.uint8), want.view(torch.uint8)), f"all_reduce {what}"
            assert torch.equal(rs_out.view(torch.uint8),
                               rs_want[r * count:(r + 1) * count].view(torch.uint8)), \
                f"reduce_scatter {what} rank {r}"
            if r == i % n:
                assert torch.equal(red.view(torch.uint8), red_want.view(torch.uint8)), \
                    f"reduce {what}"
            else:   # a non-root's buffer is only read
                assert torch.equal(red, _inputs(2000 + i, n, count, dtype)[r]), f"reduce {what}"
    close_all(groups, streams)


SPLIT = 4 << 20   # sg_call.c's BCAST_SPLIT_BYTES: from here, 3+ ranks scatter then allgather


@pytest.mark.parametrize("n,nbytes", [(3, 777), (2, SPLIT + 13), (3, SPLIT), (3, SPLIT + 13),
                                      (4, SPLIT + 4099)])
def test_broadcast_from_every_root(n, nbytes, round_form):
    """Every root in turn, random bytes, outputs poisoned.  From SPLIT bytes
    at 3 ranks or more the round is a scatter (each rank's slice from the
    root) then an allgather (each slice from the rank that holds it): then
    every rank publishes its buffer in every round (n registrations each);
    below it, or at 2 ranks, only the root does (one each)."""
    groups = make_groups(n)
    data = [torch.from_numpy(np.random.default_rng(r).integers(0, 256, nbytes, dtype=np.uint8))
            for r in range(n)]

    def rank(r):
        outs = []
        for root in range(n):
            t = data[r].clone() if r == root else torch.full((nbytes,), 0xA5, dtype=torch.uint8)
            groups[r].c.broadcast(_callers.stream, True, 0, t.data_ptr(), nbytes, root)
            outs.append(t)
        return outs
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    for r in range(n):
        for root in range(n):
            assert torch.equal(res[r][root], data[root]), (r, root)
    counts = close_all(groups, streams)
    split = n >= 3 and nbytes >= SPLIT
    arena = 1 if round_form == "one-launch" else 0   # the one-launch rounds' arena, registered
    for r, c in enumerate(counts):   # a registration per buffer published
        assert c[0] - arena == (n if split else 1), (r, c, "split" if split else "one pull")


def test_calls_that_disagree_fail_every_rank_and_release_every_stream(round_form):
    n = 3
    groups = make_groups(n)
    # the failed round's copies may still run once its words are released:
    # its buffers live until the streams are freed (the emulated device's
    # memory is the heap; ASan saw the copy read a freed tensor)
    alive = []

    def rank(r):
        ctx = sgm.StreamCtx(Ctx(None, r, n, 5.0), groups[r])
        a = torch.ones(8, dtype=torch.uint8)
        b = torch.zeros(8 if r != 1 else 12, dtype=torch.uint8)   # rank 1 expects 12 from 0
        alive.append((a, b))
        ctx._p2p([("send", a, (r + 1) % n), ("recv", b, (r - 1) % n)], "sendrecv")
        return b
    res, err, streams = on_ranks(n, rank)
    assert isinstance(err[1], UcclError) and \
        "rank 0 sends 8 bytes where rank 1 receives 12" in str(err[1]), err
    drain(groups, streams)   # nothing stays blocked: the group's words were released
    for r in range(n):
        with pytest.raises(UcclError, match="sends 8 bytes where rank 1 receives 12"):
            groups[r].check()

    def again(r):   # every later call raises with the reason
        groups[r].c.allgather(_callers.stream, True, 0, 0, 0, 0)
    _res, err2, streams2 = on_ranks(n, again)
    assert all(isinstance(e, UcclError) and "sends 8 bytes" in str(e) for e in err2), err2
    # after a failure nothing tells when a real stream is past its copies:
    # the mappings of the failed round are never released
    counts = close_all(groups, streams + streams2)
    del alive
    # ranks 0 and 2 had mapped their peer; with arenas (one-launch), every
    # rank mapped its peers' at that first round too
    arenas = n * (n - 1) if round_form == "one-launch" else 0
    assert sum(c[2] for c in counts) == 2 + arenas, counts


def test_different_operations_are_refused_by_name():
    n = 2
    groups = make_groups(n)

    def rank(r):
        x = torch.zeros(16, dtype=torch.float32)
        if r == 0:
            groups[r].c.allreduce(_callers.stream, True, 0, x.data_ptr(), 16, _engine.DT_F32,
                                  _engine.RED_SUM)
        else:
            groups[r].c.allgather(_callers.stream, True, 0, x.data_ptr(), 32, x.data_ptr())
    res, err, streams = on_ranks(n, rank)
    assert all(isinstance(e, UcclError) for e in err), err
    assert "calls disagree" in str(err[0]) and "allgather" in str(err[0]) and \
        "all_reduce" in str(err[0]), err
    drain(groups, streams)
    close_all(groups, streams)


def test_a_rank_that_never_arrives_times_the_others_out():
    n = 3
    groups = make_groups(n, timeout_s=1.0)

    def rank(r):
        if r == 2:
            return None   # never calls
        ctx = sgm.StreamCtx(Ctx(None, r, n, 1.0), groups[r])
        t0 = time.monotonic()
        # the first to time out fails the group; the other may learn it from the page
        with pytest.raises(UcclError, match="rank 2 arriving at round 1") as e:
            ctx.allgather(torch.ones(4, dtype=torch.uint8), torch.zeros(12, dtype=torch.uint8))
        return (t0, time.monotonic()), isinstance(e.value, UcclTimeoutError)
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    # from the first call (the threads start apart): not before the timeout, and not long after
    first = min(res[r][0][0] for r in (0, 1))
    assert all(0.9 < res[r][0][1] - first < 5.0 for r in (0, 1)), res
    assert res[0][1] or res[1][1], "one of them timed out"
    for r in range(n):
        with pytest.raises(UcclError, match="rank 2 arriving at round 1"):
            groups[r].check()
    drain(groups, streams)
    close_all(groups, streams)


def test_a_hostile_slot_count_is_refused():
    n = 2
    groups = make_groups(n, timeout_s=2.0)
    # rank 1 claims more entries than a slot holds, for round 1, in a call
    # like rank 0's (a general exchange, argument 0, one phase)
    slot = PAGE + RANK_BYTES + OFF_SLOTS + (1 % NSLOT) * SLOT_BYTES
    mm = groups[1]._mm
    struct.pack_into("<II", mm, slot, MAX_ENTRIES + 1, sgm.KIND_EXCHANGE)
    struct.pack_into("<QI", mm, slot + 16, 0, 1)
    struct.pack_into("<Q", mm, slot + 8, 1)

    def rank(r):
        if r == 1:
            return None
        ctx = sgm.StreamCtx(Ctx(None, r, n, 2.0), groups[0])
        ctx._p2p([("recv", torch.zeros(4, dtype=torch.uint8), 1)], "recv")
    res, err, streams = on_ranks(n, rank)
    assert isinstance(err[0], UcclError) and \
        f"rank 1 published {MAX_ENTRIES + 1} buffers (at most {MAX_ENTRIES})" in str(err[0]), err
    drain(groups[:1], streams)
    close_all(groups, streams)


def test_registrations_are_reused_and_bounded(monkeypatch):
    """Two-sided rounds (one-launch rounds register nothing but their arena)."""
    monkeypatch.setenv("UCCL_SG_FUSED_BYTES", "0")
    n = 2
    groups = make_groups(n)
    rounds = 64 + 20   # the cache holds 64 (csrc/sg/sgroup.c, REG_CACHE)
    bufs = [[torch.full((16,), r, dtype=torch.uint8) for _ in range(rounds)] for r in range(n)]

    def rank(r):
        ctx = sgm.StreamCtx(Ctx(None, r, n, 5.0), groups[r])
        outs, live = [], 0
        for i in range(rounds):   # a new buffer every round, then the first one again
            for b in (bufs[r][i], bufs[r][0]):
                out = torch.zeros(32, dtype=torch.uint8)
                ctx.allgather(b, out)
                outs.append(out)
            regs, deregs, _m = groups[r].c.emu_counts()
            live = max(live, regs - deregs)
        return outs, groups[r].c.emu_counts(), live
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    want = torch.cat([torch.zeros(16), torch.ones(16)]).to(torch.uint8)
    for r in range(n):
        outs, (regs, deregs, _m), live = res[r]
        assert all(torch.equal(o, want) for o in outs)
        assert regs == rounds, "one registration per distinct buffer"
        assert deregs >= rounds - 64 - 2 and live <= 64 + 2, (regs, deregs, live)
    close_all(groups, streams)


def test_events_and_rounds_passed():
    """An async-style round: an event recorded at its end, waited for by
    another stream; passed() once the group's stream is past it."""
    n = 2
    groups = make_groups(n)

    def rank(r):
        sg = groups[r]
        ev = sg.c.event_new()
        x = torch.full((8,), r, dtype=torch.int64)
        y = torch.full((16,), -1, dtype=torch.int64)
        k = sg.c.allgather(_callers.stream, False, ev, x.data_ptr(), 64, y.data_ptr())
        other = _engine._sg_emu_stream()
        sg.c.event_wait(other, ev)
        assert _engine._sg_emu_stream_idle(other, IDLE_S)
        done = sg.c.event_query(ev) and sg.c.passed(k)
        assert _engine._sg_emu_stream_free(other) == 0
        sg.c.event_free(ev)
        return done, y
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    for r in range(n):
        done, y = res[r]
        assert done and torch.equal(y, torch.tensor([0] * 8 + [1] * 8)), res[r]
    drain(groups, streams)
    close_all(groups, streams)


def test_bad_arguments_raise_before_anything_is_published():
    groups = make_groups(2)

    def rank(r):
        sg = groups[r]
        with pytest.raises(ValueError, match="reduction of type 99"):
            sg.c.round(_callers.stream, True, 0, "x", 1, 0, 1, [], [], [],
                       (99, 0, 0, 0, 0, 4))
        with pytest.raises(ValueError, match="pull 0 from rank 5"):
            sg.c.round(_callers.stream, True, 0, "x", 1, 0, 1, [], [(5, 1, True, 0, 0, 0, 4)],
                       [], None)
        with pytest.raises(ValueError, match="root rank 2 is not in 0..1"):
            sg.c.broadcast(_callers.stream, True, 0, 0, 0, 2)
        assert sg.error() is None   # nothing failed
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    close_all(groups, streams)


def test_rounds_on_changing_streams_stay_in_order():
    """Blocking rounds run on the caller's stream, the others on the
    group's: a round on another stream than the last starts after it (the
    words only grow).  Each rank switches between two caller streams and
    the group's stream every round; every result arrives, nothing sticks."""
    n = 3
    groups = make_groups(n)
    rounds = 3 * NSLOT + 2

    def rank(r):
        sg, outs = groups[r], []
        other = _engine._sg_emu_stream()
        for i in range(rounds):
            x = torch.full((64,), 100 * i + r, dtype=torch.int32)
            y = torch.full((64 * n,), -1, dtype=torch.int32)
            stream = (_callers.stream, other)[(i + r) % 2]
            blocking = (i + r) % 3 != 0
            sg.c.allgather(stream, blocking, 0, x.data_ptr(), x.nbytes, y.data_ptr())
            outs.append((x, y))
        assert _engine._sg_emu_stream_idle(other, IDLE_S)
        assert _engine._sg_emu_stream_free(other) == 0
        return outs
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    for r in range(n):
        for i, (_x, y) in enumerate(res[r]):
            want = torch.cat([torch.full((64,), 100 * i + q, dtype=torch.int32) for q in range(n)])
            assert torch.equal(y, want), (r, i)
    close_all(groups, streams)


def test_a_rank_on_the_general_path_meets_one_on_the_fast_path():
    """The backend's blocking broadcast and reduce go straight to the
    engine where they can, and through a task (StreamCtx) where they cannot
    (a task queued ahead, a profiler): each rank decides alone, so both ways
    must make the same round.  Rank 0 calls the engine, rank 1 StreamCtx."""
    n = 2
    groups = make_groups(n)
    data = [torch.arange(16, dtype=torch.float32) * (r + 1) for r in range(n)]

    def rank(r):
        b = data[r].clone() if r == 0 else torch.full((16,), -1.0)
        red = data[r].clone()
        if r == 0:
            groups[0].c.broadcast(_callers.stream, True, 0, b.data_ptr(), b.nbytes, 0)
            groups[0].c.reduce(_callers.stream, True, 0, red.data_ptr(), 16, _engine.DT_F32,
                               _engine.RED_SUM, 1)
        else:
            ctx = sgm.StreamCtx(Ctx(None, r, n, 5.0), groups[1])
            ctx.broadcast(b, 0)
            ctx.reduce(red, R.SUM, 1, None)
        return b, red
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    assert torch.equal(res[1][0], data[0]), "broadcast"
    assert torch.equal(res[1][1], data[0] + data[1]), "reduce at the root"
    assert torch.equal(res[0][1], data[0]), "reduce: a non-root's buffer is only read"
    close_all(groups, streams)


def test_groups_of_ranks_on_different_devices_meet():
    """The page is the context's, whatever device each rank's group is on
    (one GPU per rank: devices 0 and 1)."""
    store, out = Store(), [None, None]

    def mk(r):
        out[r] = sgm.StreamGroup(Ctx(store, r, 2, 5.0), r, 5.0, emulated=True)
    ts = [threading.Thread(target=mk, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(15)
    assert all(out), "the ranks did not meet"
    close_all(out, [])


def test_closing_a_group_with_a_round_in_flight_fails_it_and_waits():
    """close() on one thread while another waits in a round for a peer that
    never comes: the round raises at once, close returns, nothing crashes."""
    groups = make_groups(2, timeout_s=20.0)
    s0 = _engine._sg_emu_stream()
    x = torch.zeros(16, dtype=torch.float32)
    got = []

    def r0():
        try:
            groups[0].c.allreduce(s0, True, 0, x.data_ptr(), 16, _engine.DT_F32,
                                  _engine.RED_SUM)
        except BaseException as e:   # noqa: BLE001 - reported to the test
            got.append(e)
    t = threading.Thread(target=r0)
    t.start()
    # rank 0 has published round 1 (it waits for rank 1, which never calls)
    mine = PAGE + OFF_SLOTS + (1 % NSLOT) * SLOT_BYTES + 8
    until = time.monotonic() + 10.0
    while struct.unpack_from("<Q", groups[0]._mm, mine)[0] != 1 and time.monotonic() < until:
        time.sleep(0.001)
    assert struct.unpack_from("<Q", groups[0]._mm, mine)[0] == 1, "rank 0 never published round 1"
    time.sleep(0.05)   # and is past publishing, in its wait
    t0 = time.monotonic()
    groups[0].close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 5.0
    assert len(got) == 1 and isinstance(got[0], UcclError) and \
        "closed with an operation in flight" in str(got[0]), got
    groups[1].close()
    assert _engine._sg_emu_stream_free(s0) == 0


def test_operators_the_kernel_does_not_define_are_refused():
    groups = make_groups(2)

    def rank(r):
        x = torch.zeros(4, dtype=torch.float32)
        with pytest.raises(ValueError, match="bitwise operators need integers"):
            groups[r].c.allreduce(_callers.stream, True, 0, x.data_ptr(), 4, _engine.DT_F32,
                                  _engine.RED_BXOR)
        b = torch.zeros(4, dtype=torch.bool)
        with pytest.raises(ValueError, match="AVG a number"):
            groups[r].c.allreduce(_callers.stream, True, 0, b.data_ptr(), 4, _engine.DT_BOOL,
                                  _engine.RED_AVG)
        assert groups[r].error() is None
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    close_all(groups, streams)


def test_the_fast_path_runs_only_with_nothing_of_the_group_ahead():
    """Runner.inline (the backend's fast path): runs the call holding the
    runner's token when no task is queued or running; else declines, and
    the call takes the general path behind the task (the order the ranks
    share).  A task submitted while the inline call runs waits for it."""
    from uccl_collective.backend._work import Runner, Task
    r = Runner("test", 10.0)
    assert r.inline(lambda: 42) == (True, 42)
    gate, order = threading.Event(), []

    def slow():
        gate.wait(10)
        order.append("task")
    t = Task(slow, [])
    r.submit(t, False, time.monotonic() + 10)   # the runner's thread runs it
    deadline = time.monotonic() + 5
    while not r._busy and time.monotonic() < deadline:
        time.sleep(1e-3)
    assert r.inline(lambda: order.append("inline")) == (False, None)
    gate.set()
    r.drive(t, time.monotonic() + 10, run_here=False)
    assert order == ["task"]

    def during():   # a task submitted now must not start before this returns
        t2 = Task(lambda: order.append("task2"), [])
        r.submit(t2, False, time.monotonic() + 10)
        time.sleep(0.2)
        order.append("inline")
        return t2
    ran, t2 = r.inline(during)
    r.drive(t2, time.monotonic() + 10, run_here=False)
    assert ran and order == ["task", "inline", "task2"], order
    r.poison("test")
    assert r.inline(lambda: 1) == (False, None)
    r.close("test")


def test_a_blocking_task_runs_here_only_with_nothing_ahead():
    """Runner.run_here (the backend's blocking CPU calls): runs the task on
    this thread when nothing is queued or running, keeping its error as a
    queued task's; else leaves it to submit (behind what is ahead)."""
    from uccl_collective.backend._work import Runner, Task
    r = Runner("test", 10.0)
    who = []
    t = Task(lambda: who.append(threading.current_thread()), [])
    assert r.run_here(t) and t.ran and t.error is None and who == [threading.current_thread()]

    def boom():
        raise ValueError("from the task")
    t = Task(boom, [])
    assert r.run_here(t) and t.ran and isinstance(t.error, ValueError) and t.fn is None
    assert not r._busy
    gate = threading.Event()
    first = Task(lambda: gate.wait(10), [])
    r.submit(first, False, time.monotonic() + 10)   # the runner's thread runs it
    deadline = time.monotonic() + 5
    while not r._busy and time.monotonic() < deadline:
        time.sleep(1e-3)
    t = Task(lambda: who.append("second"), [])
    assert not r.run_here(t) and not t.ran and who[-1] != "second"
    gate.set()
    r.drive(first, time.monotonic() + 10, run_here=False)
    r.close("test")
