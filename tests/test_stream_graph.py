"""Rounds captured in a CUDA graph (csrc/sg/sg_graph.c), on the CPU: the
emulated device (csrc/sgdev/sg_emu.c) records what a stream queues while it
captures and queues a copy of it at each launch, as a CUDA graph replays.
The host does a round's part once, at the capture; every replay must still
pair each rank's round with the same replay of its peers' and move the
bytes of that replay.  So the inputs change before every replay, the
outputs are poisoned, and every replay is checked against the reference;
two graphs take turns, and a graph is launched on another stream than the
one it was captured on.  The GPU side (the memory operations counted from
the epoch as one launch) runs on the GPU machine."""
from __future__ import annotations

import struct
import subprocess

import pytest
import torch
import torch.distributed as dist

from uccl_collective import _engine
from uccl_collective.core import stream_group as sgm
from uccl_collective.p2p import UcclError

from test_stream_group import (Ctx, _callers, caller_streams, close_all,  # noqa: F401
                               drain, make_groups, no_stale_words, on_ranks, round_form)

R = dist.ReduceOp.RedOpType
REPLAYS = 300
PAGE, RANK_BYTES, OFF_PID = 4096, 5 * 4096, 264   # the page's layout (csrc/sg/sg_page.h)
POISON = -7


def _graph(what, a, b=0):
    return _engine._sg_emu_graph(what, a, b)


def _inputs(n: int, r: int, i: int, count: int) -> torch.Tensor:
    """Rank r's input of replay i: random int32, the same on every rank's
    reckoning (a seed per rank and replay)."""
    g = torch.Generator().manual_seed(1000003 * i + 7919 * r + n)
    return torch.randint(-1000, 1000, (count,), dtype=torch.int32, generator=g)


class Bufs:
    """One rank's buffers, fixed for the graph's life (as a graph's memory
    is): an all_reduce in place, an allgather, a reduce_scatter, a
    broadcast from rank 1 % n, an all_to_all."""

    def __init__(self, n: int, count: int):
        self.n, self.count = n, count
        self.ar = torch.zeros(count, dtype=torch.int32)
        self.ag_in = torch.zeros(count, dtype=torch.int32)
        self.ag_out = torch.zeros(n * count, dtype=torch.int32)
        self.rs_in = torch.zeros(n * count, dtype=torch.int32)
        self.rs_out = torch.zeros(count, dtype=torch.int32)
        self.bc = torch.zeros(count, dtype=torch.int32)
        self.a2a_in = [torch.zeros(count, dtype=torch.int32) for _ in range(n)]
        self.a2a_out = [torch.zeros(count, dtype=torch.int32) for _ in range(n)]

    def fill(self, r: int, i: int) -> None:
        """The inputs of replay i, the outputs poisoned."""
        n, c = self.n, self.count
        x = _inputs(n, r, i, (3 + n) * c)
        self.ar.copy_(x[:c])
        self.ag_in.copy_(x[c:2 * c])
        self.rs_in.copy_(x[2 * c:(2 + n) * c])
        self.bc.copy_(x[(2 + n) * c:] if r == 1 % n else torch.full((c,), POISON))
        for j in range(n):
            self.a2a_in[j].copy_(x[:c] * (j + 1) + r)
        for t in [self.ag_out, self.rs_out] + self.a2a_out:
            t.fill_(POISON)

    def issue(self, ctx) -> None:
        ctx.allreduce(self.ar, R.SUM, None)
        ctx.allgather(self.ag_in, self.ag_out)
        ctx.reduce_scatter(self.rs_out, self.rs_in, R.SUM, None, "reduce_scatter")
        ctx.broadcast(self.bc, 1 % self.n)
        ctx.all_to_all(self.a2a_in, self.a2a_out)

    def check(self, r: int, i: int) -> None:
        n, c = self.n, self.count
        xs = [_inputs(n, q, i, (3 + n) * c) for q in range(n)]
        where = f"rank {r}, replay {i}"
        assert torch.equal(self.ar, sum(x[:c] for x in xs)), f"{where}: all_reduce"
        assert torch.equal(self.ag_out, torch.cat([x[c:2 * c] for x in xs])), \
            f"{where}: allgather"
        rs = sum(x[2 * c:(2 + n) * c] for x in xs)
        assert torch.equal(self.rs_out, rs[r * c:(r + 1) * c]), f"{where}: reduce_scatter"
        assert torch.equal(self.bc, xs[1 % n][(2 + n) * c:]), f"{where}: broadcast"
        for q in range(n):
            assert torch.equal(self.a2a_out[q], xs[q][:c] * (r + 1) + q), \
                f"{where}: all_to_all from rank {q}"


def _on_ranks_then_close(groups, rank) -> None:
    """rank(r) on every rank; then no error anywhere, and at close every
    registration released and no mapping left (the graphs' are let go
    there)."""
    n = len(groups)
    res, err, streams = on_ranks(n, rank, timeout=300.0)
    assert err == [None] * n, err
    drain(groups, streams)
    assert all(g.c.error() is None for g in groups)
    counts = close_all(groups, streams)
    for regs, deregs, maps in counts:
        assert regs == deregs and maps == 0, counts


def _capture(ctx, bufs: Bufs, stream: int) -> int:
    _graph("begin", stream)
    try:
        bufs.issue(ctx)
    finally:
        graph = _graph("end", stream)
    return graph


@pytest.mark.parametrize("count, replays, ll", [(37, REPLAYS, None), (37, 60, "0"), (16384, 20, None),
                                               (24000, 40, None)])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_captured_rounds_replay_with_the_data_of_each_replay(n, count, replays, ll, round_form,
                                                             monkeypatch):
    """Two graphs of five collectives each, captured once and replayed
    `replays` times in turn, every second replay on a stream other than the
    capturing one; every replay's results checked.  One-launch rounds
    (round_form): the all_reduce and the allgather are captured as one
    launch each (an arena of their own, numbered from its epoch): 37
    elements go as LL lines, or with UCCL_SG_GRAPH_LL_BYTES=0 (ll "0") as
    the input and a ready word, as 24,000 (96 KB, above the default) do."""
    if ll is not None:
        monkeypatch.setenv("UCCL_SG_GRAPH_LL_BYTES", ll)
    groups = make_groups(n)

    def rank(r):
        ctx = sgm.StreamCtx(Ctx(None, r, n, 5.0), groups[r])
        mine = _callers.stream
        other = _engine._sg_emu_stream()
        a, b = Bufs(n, count), Bufs(n, count)
        ga, gb = _capture(ctx, a, mine), _capture(ctx, b, mine)
        try:
            want = 2 if round_form == "one-launch" else 0   # the all_reduce and the allgather
            assert [_graph("launches", g) for g in (ga, gb)] == [want, want]
            assert _engine._sg_emu_stream_idle(mine, 5.0), "a capture ran something"
            for i in range(replays):
                s = mine if i % 2 == 0 else other
                for bufs, g, seed in ((a, ga, 2 * i), (b, gb, 2 * i + 1)):
                    bufs.fill(r, seed)
                    _graph("launch", g, s)
                    assert _engine._sg_emu_stream_idle(s, 20.0), f"replay {i} did not end"
                    bufs.check(r, seed)
        finally:
            _graph("free", ga)
            _graph("free", gb)
            _engine._sg_emu_stream_free(other)
        return True
    _on_ranks_then_close(groups, rank)


def _stalled_replay(good: int):
    """Two ranks capture a graph and replay it `good` times, checked; then
    rank 0 launches one more replay that rank 1 never launches.  Returns
    (groups, graphs, rank 0's buffers, the callers' streams) with rank 0's
    replay waiting for rank 1's."""
    n, count = 2, 16
    groups = make_groups(n, timeout_s=5.0)
    graphs = [None] * n
    bufs = [Bufs(n, count) for _ in range(n)]

    def capture(r):
        ctx = sgm.StreamCtx(Ctx(None, r, n, 5.0), groups[r])
        graphs[r] = _capture(ctx, bufs[r], _callers.stream)
        for i in range(good):
            bufs[r].fill(r, i)
            _graph("launch", graphs[r], _callers.stream)
            assert _engine._sg_emu_stream_idle(_callers.stream, 20.0)
            bufs[r].check(r, i)
    res, err, streams = on_ranks(n, capture)
    assert err == [None] * n, err
    bufs[0].fill(0, good)
    _graph("launch", graphs[0], streams[0])
    assert not _engine._sg_emu_stream_idle(streams[0], 0.3), \
        "rank 0's replay ran without rank 1's"
    return groups, graphs, bufs[0], streams


def _survivor_raises(groups, graphs, bufs, streams, match: str) -> None:
    """Rank 0's replay ends, and its next call raises naming why."""
    assert _engine._sg_emu_stream_idle(streams[0], 10.0), "rank 0's replay stayed blocked"
    _callers.stream = streams[0]
    ctx = sgm.StreamCtx(Ctx(None, 0, 2, 5.0), groups[0])
    with pytest.raises(UcclError, match=match):
        ctx.allreduce(bufs.ar, R.SUM, None)
    for g in graphs:
        _graph("free", g)
    close_all(groups, streams)


def test_a_failed_rank_ends_the_survivors_replays_and_their_next_call_raises():
    """Rank 1 stops replaying and fails the group (as a rank whose process
    died does, through the watchdog): rank 0's replay, which waits for rank
    1's, ends, and rank 0's next call raises naming why."""
    groups, graphs, bufs, streams = _stalled_replay(3)
    groups[1].c.fail("rank 1 went away during the replays")
    _survivor_raises(groups, graphs, bufs, streams, "rank 1 went away")


@pytest.mark.parametrize("how", ["reaped", "zombie"])
def test_a_peer_process_gone_during_replays_fails_the_group_and_releases_them(how):
    """Nothing is pending on the host while graphs replay, yet a peer whose
    process is gone fails the group (the watchdog watches the peers once the
    group has captured rounds): rank 1's process id in the page is made a
    dead process's, and rank 0's replay, waiting for rank 1's, ends; its
    next call raises naming rank 1.  "zombie": the dead process is not
    reaped yet (its parent has not waited for it, as a launcher blocked
    elsewhere has not), so it still answers kill(pid, 0)."""
    groups, graphs, bufs, streams = _stalled_replay(1)
    dead = subprocess.Popen(["true"])
    if how == "reaped":
        dead.wait()
    else:
        with open(f"/proc/{dead.pid}/stat") as f:   # exited, not reaped: state Z
            for _ in range(500):
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
                f.seek(0)
                __import__("time").sleep(0.01)
            else:
                raise AssertionError(f"process {dead.pid} did not exit")
    try:
        struct.pack_into("<Q", groups[0]._mm, PAGE + RANK_BYTES + OFF_PID, dead.pid)
        _survivor_raises(groups, graphs, bufs, streams, "rank 1 exited while a CUDA graph")
    finally:
        dead.wait()


def test_a_capture_must_be_a_blocking_call_on_the_capturing_stream():
    """A round whose caller does not wait for it (the group's own stream
    runs it, after an event) cannot be captured: refused, naming why,
    before anything is published, so the group goes on."""
    n = 2
    groups = make_groups(n)

    def rank(r):
        s = _callers.stream
        t = torch.zeros(8, dtype=torch.int32)
        _graph("begin", s)
        try:
            with pytest.raises(ValueError, match="captured in a CUDA graph"):
                groups[r].c.allgather(s, False, 0, t.data_ptr(), 16, t.data_ptr())
        finally:
            _graph("free", _graph("end", s))
        x = torch.full((4,), r + 1, dtype=torch.int32)
        sgm.StreamCtx(Ctx(None, r, n, 5.0), groups[r]).allreduce(x, R.SUM, None)
        assert _engine._sg_emu_stream_idle(s, 10.0)
        assert torch.equal(x, torch.full((4,), 3, dtype=torch.int32))
        return True
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    close_all(groups, streams)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_captured_sends_and_receives_replay_with_the_data_of_each_replay(n):
    """Messages captured in graphs (their pair streams join the capture
    through the post's event, as CUDA streams do): a ring (each rank sends
    to r + 1 and receives from r - 1, posted together, then waited for) and
    an exchange with rank 0 of sizes that differ per rank, in two graphs
    replayed REPLAYS times in turn, every second replay on another stream;
    the sends' data change before each replay, the receives are poisoned
    and checked after it."""
    groups = make_groups(n)

    def sizes(r):
        return 29 + 7 * r

    def data(r, i, count, salt):
        return _inputs(n, r, 10 * i + salt, count)

    def rank(r):
        g = groups[r]
        mine, other = _callers.stream, _engine._sg_emu_stream()
        nxt, prv = (r + 1) % n, (r - 1) % n
        ring_s, ring_r = torch.zeros(31, dtype=torch.int32), torch.zeros(31, dtype=torch.int32)
        peers = range(1, n) if r == 0 else [0]
        ex_s = {p: torch.zeros(sizes(max(p, r)), dtype=torch.int32) for p in peers}
        ex_r = {p: torch.zeros(sizes(max(p, r)), dtype=torch.int32) for p in peers}

        def post_and_wait(s, msgs):
            codes = g.p2p(s, msgs)
            assert all(c >> 63 for c in codes), "a message posted in a capture not captured"
            for c in codes:
                g.c.p2p_wait(c, s)

        def ring(s):
            post_and_wait(s, [(nxt, True, ring_s.data_ptr(), ring_s.nbytes),
                              (prv, False, ring_r.data_ptr(), ring_r.nbytes)])

        def exchange(s):
            msgs = []
            for p in peers:
                msgs += [(p, True, ex_s[p].data_ptr(), ex_s[p].nbytes),
                         (p, False, ex_r[p].data_ptr(), ex_r[p].nbytes)]
            post_and_wait(s, msgs)

        graphs = []
        for body in (ring, exchange):
            _graph("begin", mine)
            try:
                body(mine)
            finally:
                graphs.append(_graph("end", mine))
        try:
            assert _engine._sg_emu_stream_idle(mine, 5.0), "a capture ran something"
            for i in range(REPLAYS):
                s = mine if i % 2 == 0 else other
                ring_s.copy_(data(r, i, 31, 0))
                ring_r.fill_(POISON)
                for p in peers:
                    ex_s[p].copy_(data(r, i, ex_s[p].numel(), 1 + p))
                    ex_r[p].fill_(POISON)
                for gr in graphs:
                    _graph("launch", gr, s)
                assert _engine._sg_emu_stream_idle(s, 20.0), f"replay {i} did not end"
                assert torch.equal(ring_r, data(prv, i, 31, 0)), f"rank {r}, replay {i}: ring"
                for p in peers:
                    want = data(p, i, ex_r[p].numel(), 1 + r)
                    assert torch.equal(ex_r[p], want), f"rank {r}, replay {i}: from rank {p}"
        finally:
            for gr in graphs:
                _graph("free", gr)
            _engine._sg_emu_stream_free(other)
        return True
    _on_ranks_then_close(groups, rank)
