"""One-launch rounds of stream-ordered groups (csrc/sg/sg_round.c, struct
uccl_sg_fused) on the CPU's emulated device: all_reduce and allgather of
up to UCCL_SG_FUSED_BYTES per rank go through an arena the peers mapped
once, with no host wait for the peers; their calls are compared one round
late.  The emulated device runs the round's steps one by one (the copy in,
the words, the reduction or copies, fin); the single CUDA launch that does
the same runs in tests/test_gpu_collective.py on the GPU machine."""
from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
import torch

from uccl_collective import _engine
from uccl_collective.core import stream_group as sgm
from uccl_collective.p2p import UcclError, UcclTimeoutError
from test_stream_group import (  # noqa: F401 - caller_streams, no_stale_words: autouse
    Ctx, Store, _callers, caller_streams, close_all, drain, make_groups, no_stale_words, on_ranks)

SLOT = 4096   # UCCL_SG_FUSED_BYTES in these tests: sizes above it go two-sided


@pytest.fixture(autouse=True)
def small_arena(monkeypatch):
    monkeypatch.setenv("UCCL_SG_FUSED_BYTES", str(SLOT))


def allreduce(g, t, op):
    return g.c.allreduce(_callers.stream, True, 0, t.data_ptr(), t.numel(), sgm.DTYPES[t.dtype],
                         op)


def allgather(g, t, out):
    return g.c.allgather(_callers.stream, True, 0, t.data_ptr(), t.numel() * t.element_size(),
                         out.data_ptr())


OPS = [(torch.int64, _engine.RED_SUM, lambda a: a.sum(0)),
       (torch.float32, _engine.RED_MAX, lambda a: a.max(0)),
       (torch.uint8, _engine.RED_BXOR, lambda a: np.bitwise_xor.reduce(a, 0)),
       (torch.int32, _engine.RED_MIN, lambda a: a.min(0))]


@pytest.mark.parametrize("n, before", [(2, None), (3, None), (4, None), (2, 5), (3, 22)])
def test_one_launch_rounds_move_and_reduce_the_right_bytes(n, before):
    """Sizes 0, 1, odd and up to the slot, many rounds (both arena slots
    reused many times), mixed with two-sided rounds above the slot, ranks
    running ahead of each other: every result against numpy's.  before:
    the round numbers wrap past 2^32 after that many rounds."""
    groups = make_groups(n)
    if before is not None:
        for g in groups:
            g.c.emu_renumber(2**32 - 1 - before, 0)
    rng = np.random.default_rng(n)
    plan = []   # (kind, dtype/op index, elements)
    for i in range(40):
        kind = ("allreduce", "allgather")[i % 2]
        esz = 8 if kind == "allreduce" else 1
        top = SLOT // esz if i % 5 else 3 * SLOT // esz   # every fifth: two-sided
        count = int(rng.choice([0, 1, 7, int(rng.integers(1, top + 1)), top]))
        plan.append((kind, i % len(OPS), count))
    data = [[rng.integers(0, 1 << 8, max(c, 1) * 8, dtype=np.uint8) for _ in range(n)]
            for _k, _o, c in plan]

    def inputs(i, r):
        kind, o, count = plan[i]
        dt = OPS[o][0] if kind == "allreduce" else torch.uint8
        raw = torch.from_numpy(data[i][r].copy())
        return raw.view(dt)[:count].clone()

    def rank(r):
        g, keep, inputs_alive, rounds = groups[r], [], [], []
        jitter = np.random.default_rng(100 + r)
        for i, (kind, o, count) in enumerate(plan):
            if jitter.random() < 0.3:
                time.sleep(jitter.random() * 0.003)   # ranks ahead of each other
            x = inputs(i, r)
            if kind == "allreduce":
                k = allreduce(g, x, OPS[o][1])
                keep.append(x)
            else:
                out = torch.full((n * count,), 0xA5, dtype=torch.uint8)   # poisoned
                k = allgather(g, x, out)
                keep.append(out)
                inputs_alive.append(x)   # the stream copies it in after the call returns
            rounds.append(k)
        return keep, inputs_alive, rounds
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    if before is not None:   # the numbers wrapped, skipping 0
        wrapped = list(range(2**32 - before, 2**32)) + list(range(1, len(plan) - before + 1))
        assert all(rounds == wrapped for _k, _a, rounds in res), res[0][2]
    res = [keep for keep, _alive, _rounds in res]
    for i, (kind, o, count) in enumerate(plan):
        ins = [inputs(i, r) for r in range(n)]
        if kind == "allreduce":
            want = torch.from_numpy(np.asarray(OPS[o][2](np.stack([t.numpy() for t in ins]))))
            want = want.to(ins[0].dtype).reshape(-1)
        else:
            want = torch.cat(ins)
        for r in range(n):
            assert torch.equal(res[r][i], want), f"round {i} ({kind}, {count}) at rank {r}"
    close_all(groups, streams)


def test_done_words_a_long_run_of_one_launch_rounds_left_behind_are_written_again():
    """One-launch rounds write neither of the two-sided rounds' done words:
    after 2^31 of them those words would read as ahead.  Every round
    numbered a multiple of 2^29 writes them again (csrc/sg/sg_page.h,
    REFRESH_EVERY).  Here the numbers start 3 rounds before one, with the
    done words 50 rounds short of stale; 60 one-launch rounds follow, then
    two-sided ones, whose waits would pass on them otherwise (the
    no_stale_words fixture counts such waits), all checked against numpy."""
    n, refresh = 3, 1 << 29
    groups = make_groups(n)
    for g in groups:
        g.c.emu_renumber(3 * refresh - 3, 0, (1 << 31) - 50)
    rng = np.random.default_rng(11)
    small, large = 60, 6
    data = [[rng.integers(-1000, 1000, SLOT // 8 if i < small else 3 * SLOT // 8)
             for _ in range(n)] for i in range(small + large)]

    def rank(r):
        outs = []
        for i, d in enumerate(data):
            x = torch.from_numpy(d[r].copy())
            k = allreduce(groups[r], x, _engine.RED_SUM)
            outs.append((k, x))
        return outs
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    for i, d in enumerate(data):
        want = torch.from_numpy(np.sum(d, axis=0))
        for r in range(n):
            k, x = res[r][i]
            assert k == 3 * refresh - 3 + i + 1 and torch.equal(x, want), f"round {k} at rank {r}"
    close_all(groups, streams)


def test_one_launch_rounds_register_only_the_arena():
    """No host wait for the peers, no registration of the callers' buffers:
    a hundred rounds on fresh buffers register one thing, the arena."""
    n = 2
    groups = make_groups(n)

    def rank(r):
        keep = []
        for i in range(100):
            x = torch.full((64,), r + i, dtype=torch.int64)
            allreduce(groups[r], x, _engine.RED_SUM)
            keep.append(x)
        return keep, groups[r].c.emu_counts()
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    for r in range(n):
        keep, (regs, _deregs, _maps) = res[r]
        assert regs == 1, "only the arena"
        assert all(torch.equal(x, torch.full((64,), 1 + 2 * i)) for i, x in enumerate(keep))
    close_all(groups, streams)
    # every peer is past the last round: the arenas are let go
    assert all(g._fused is None for g in groups)


def test_a_disagreement_raises_at_the_next_call_on_every_rank():
    """Calls of one-launch rounds that differ (counts 10 and 12) are compared
    one round late: both return, the next call raises on every rank with
    both calls named, and every stream is released."""
    n = 2
    groups = make_groups(n)

    def rank(r):
        g = groups[r]
        x = torch.ones(4, dtype=torch.int64)
        allreduce(g, x, _engine.RED_SUM)   # the first: arenas exchanged, compared at once
        y = torch.ones(10 + 2 * r, dtype=torch.int64)
        allreduce(g, y, _engine.RED_SUM)   # returns: compared at the next call
        with pytest.raises(UcclError, match="calls disagree in round 2") as e:
            allreduce(g, x, _engine.RED_SUM)
        return str(e.value)
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    for r in range(n):
        for k in (10, 12):   # both calls in words
            assert f"all_reduce(SUM, {k} elements of int64, one launch)" in res[r], res[r]
    drain(groups, streams)
    for g in groups:
        with pytest.raises(UcclError, match="calls disagree"):
            g.check()
    arenas = [g._fused for g in groups]
    close_all(groups, streams)
    # a failed group's released launches may still read a peer's arena: kept
    for a in arenas:
        assert any(isinstance(e, tuple) and len(e) == 2 and e[1] is a for e in sgm._KEPT)


def arena_on_rank_0_only(monkeypatch) -> list:
    """Two ranks' groups, rank 1 made as with UCCL_SG_FUSED_BYTES=0 (no arena)."""
    per_rank = threading.local()
    monkeypatch.setattr(sgm, "fused_bytes", lambda: per_rank.nb)
    store, groups = Store(), [None, None]

    def mk(r):
        per_rank.nb = SLOT if r == 0 else 0
        groups[r] = sgm.StreamGroup(Ctx(store, r, 2, 5.0), 0, 5.0, emulated=True)
    ts = [threading.Thread(target=mk, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(15)
    assert all(groups)
    return groups


def test_ranks_that_disagree_on_the_threshold_fail_at_once(monkeypatch):
    """Rank 0 takes a one-launch round, rank 1 (as with UCCL_SG_FUSED_BYTES=0)
    a two-sided one: both raise in the call, naming the variable."""
    groups = arena_on_rank_0_only(monkeypatch)

    def rank(r):
        x = torch.ones(8, dtype=torch.int64)
        allreduce(groups[r], x, _engine.RED_SUM)
    res, err, streams = on_ranks(2, rank)
    assert all(isinstance(e, UcclError) and "UCCL_SG_FUSED_BYTES must be the same" in str(e)
               for e in err), err
    drain(groups, streams)
    close_all(groups, streams)


def test_the_arenas_go_with_the_first_round_of_either_kind():
    """A group whose first round is two-sided maps the peers' arenas there
    (its handshakes poll them on a GPU); the one-launch rounds after it are
    right, and no further arena is mapped."""
    n = 3
    groups = make_groups(n)
    big = SLOT // 8 + 2   # int64s: above the arena's slot, a two-sided round

    def rank(r):
        g, got = groups[r], []
        for i, count in enumerate((big, 4, big, 4, 4)):
            x = torch.full((count,), 10 * r + i, dtype=torch.int64)
            out = torch.zeros(n * count, dtype=torch.int64)
            allgather(g, x, out)
            got.append((x, out))
            if i == 0:
                maps_after_first = g.c.emu_counts()[2]
        return got, maps_after_first, g.c.emu_counts()[2]
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    for r in range(n):
        got, first, last = res[r]
        # the peers' buffers of the round, and their arenas
        assert first == 2 * (n - 1), f"rank {r}: {first} mappings after the first round"
        for i, (_x, out) in enumerate(got):
            want = torch.cat([torch.full((out.numel() // n,), 10 * q + i, dtype=torch.int64)
                              for q in range(n)])
            assert torch.equal(out, want), (r, i)
    close_all(groups, streams)


def test_a_rank_without_an_arena_leaves_two_sided_rounds_as_they_were(monkeypatch):
    """Rank 1 without an arena (UCCL_SG_FUSED_BYTES=0 there): rank 0 offers
    its own in the first two-sided round, finds none, and stops offering;
    two-sided rounds go on right."""
    groups = arena_on_rank_0_only(monkeypatch)
    count = SLOT // 8 + 2

    def rank(r):
        outs = []
        for i in range(3):
            x = torch.full((count,), 10 * r + i, dtype=torch.int64)
            out = torch.zeros(2 * count, dtype=torch.int64)
            allgather(groups[r], x, out)
            outs.append((x, out))   # x too: the stream reads it after the call
        return [o for _x, o in outs], outs
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    drain(groups, streams)
    for r in range(2):
        for i, out in enumerate(res[r][0]):
            assert torch.equal(out, torch.cat([torch.full((count,), i, dtype=torch.int64),
                                               torch.full((count,), 10 + i, dtype=torch.int64)]))
    close_all(groups, streams)


def test_a_peer_that_stops_coming_fails_the_group_within_the_timeout():
    """After a round together, rank 1 stops: rank 0's next one-launch round
    returns at once (its stream waits for rank 1), the watchdog fails the
    group within the timeout and releases the stream, and the call after it
    raises."""
    n, timeout = 2, 1.5
    groups = make_groups(n, timeout_s=timeout)

    def rank(r):
        g = groups[r]
        x = torch.ones(4, dtype=torch.int64)
        allreduce(g, x, _engine.RED_SUM)
        if r == 1:
            return x   # kept: the streams may still read and write it after the call
        t0 = time.monotonic()
        allreduce(g, x, _engine.RED_SUM)
        queued = time.monotonic() - t0
        with pytest.raises(UcclError) as e:
            allreduce(g, x, _engine.RED_SUM)
        return queued, time.monotonic() - t0, e.value, x
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    queued, took, e, _x = res[0]
    assert queued < 0.5 * timeout, f"the round waited {queued:.2f} s on the host"
    assert took < timeout + 2.0, f"raised after {took:.2f} s (timeout {timeout} s)"
    # Two clocks of the timeout's length race: the third call's host wait for
    # rank 1 at round 2 (from the call) and the watchdog's on round 2 (from
    # its queueing, a moment earlier, looked at every 20 ms).  Either may
    # fail the group first; both name round 2.
    assert isinstance(e, UcclTimeoutError) or "not within the group's timeout" in str(e) or \
        f"round 2 not through rank 0's stream within {timeout:g} s" in str(e), e
    drain(groups, streams)   # rank 0's stream was released
    close_all(groups, streams)


@pytest.mark.parametrize("off, nb, slot, why", [
    (None, 4096, 1024, "arena 0 of 4096 bytes"),
    (8, 4096, 1024, "arena 0x[0-9a-f]+ of 4096 bytes"),   # not 16-aligned
    (0, 4096, 1000, "slots of 1000 bytes"),
    (0, 2047, 1024, "arena 0x[0-9a-f]+ of 2047 bytes, slots of 1024 bytes"),
    (0, 4096, 1024, "the arena is set already"),
])
def test_bad_arenas_are_refused(off, nb, slot, why):
    groups = make_groups(2)
    buf = torch.zeros(8192, dtype=torch.uint8)
    base = (buf.data_ptr() + 15) // 16 * 16
    with pytest.raises(ValueError, match=why):
        groups[0].c.fused_arena(0 if off is None else base + off, nb, slot)
    for g in groups:
        g.close()


def test_an_arena_or_renumbering_after_the_first_round_is_refused(monkeypatch):
    """The arena's words start at 0, a round number to come: it is set
    before the group's first round, as the renumbering of tests is."""
    monkeypatch.setenv("UCCL_SG_FUSED_BYTES", "0")   # no arena at the group's making
    groups = make_groups(2)

    def rank(r):
        x = torch.arange(8, dtype=torch.int64)
        allreduce(groups[r], x, _engine.RED_SUM)
        return x
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    drain(groups, streams)
    assert torch.equal(res[0], 2 * torch.arange(8, dtype=torch.int64))
    buf = torch.zeros(8192, dtype=torch.uint8)
    base = (buf.data_ptr() + 15) // 16 * 16
    with pytest.raises(ValueError, match=r"the arena comes before the group's first round "
                                         r"\(this rank is at round 1\)"):
        groups[0].c.fused_arena(base, 4096, 1024)
    with pytest.raises(ValueError, match="round 1 was run already: too late to renumber"):
        groups[1].c.emu_renumber(7, 0)
    close_all(groups, streams)


@pytest.mark.parametrize("value,nbytes", [("", 1 << 20), ("0", 0), ("4096", 4096),
                                          ("64K", 64 << 10), ("1m", 1 << 20), (" 2M ", 2 << 20)])
def test_the_threshold_is_read_in_bytes_kib_or_mib(monkeypatch, value, nbytes):
    monkeypatch.setenv("UCCL_SG_FUSED_BYTES", value)
    assert sgm.fused_bytes() == nbytes


@pytest.mark.parametrize("value", ["1.5M", "M", "1G", "65M", "-1", "1T"])
def test_a_bad_threshold_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv("UCCL_SG_FUSED_BYTES", value)
    with pytest.raises(ValueError, match=re.escape(f"UCCL_SG_FUSED_BYTES={value}: expected a "
                                                   "size in 0..64M")):
        sgm.fused_bytes()
