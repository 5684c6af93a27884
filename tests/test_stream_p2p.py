"""Stream-ordered point-to-point messages (csrc/sg/sg_p2p.c, through
uccl_collective/core/stream_group.py's StreamGroup.p2p) on the CPU: ranks are
threads, the page is the real shared file, streams are the engine's
emulated streams (test_stream_group.py's harness).  What is checked: the
bytes of every message, whatever order the ranks post in; that posting
never waits for a peer; that a mismatch, a missing peer and a hostile
argument fail loudly; that nothing stays blocked or registered."""
from __future__ import annotations

import struct
import threading
import time

import numpy as np
import pytest
import torch

from uccl_collective import _engine
from uccl_collective.p2p import UcclError
from test_stream_group import (  # noqa: F401 - caller_streams, no_stale_words: autouse
    PAGE, RANK_BYTES, Ctx, _callers, caller_streams, close_all, make_groups, no_stale_words,
    on_ranks)
from test_stream_group import drain as drain_streams
from uccl_collective.core import stream_group as sgm

P2P_SLOTS = sgm.P2P_SLOTS   # csrc/sg/sgroup.h
# struct p2p_chan (csrc/sg/sg_page.h): the ready and done words, high, the
# slots, then the rows of the captured messages' words
P2P_GRAPH, PG_WORDS = 64, 6
CHAN_BYTES = 2 * 2 * 64 + 64 + P2P_SLOTS * 64 + P2P_GRAPH * PG_WORDS * 4


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def drain(groups, streams, failed=False):
    """The streams idle; and, unless the test failed the groups itself,
    none failed: a failed group releases its streams' waits, so a message
    never copied would otherwise read as "passed" and its buffer as
    corrupt (the groups' 5 s timeout, run under TSan, did that)."""
    drain_streams(groups, streams)
    if not failed:
        assert [g.error() for g in groups] == [None] * len(groups)


def post(g, msgs):
    """msgs [(peer, send?, tensor)] -> codes, after the caller's stream."""
    return g.p2p(_callers.stream, [(p, s, t.data_ptr(), nbytes(t)) for p, s, t in msgs])


def wait_all(g, codes):
    for c in codes:
        g.c.p2p_wait(c, _callers.stream)


def _plan(n: int, per_pair: int, seed: int):
    """Every pair's payloads (random sizes, 0 and 1 among them)."""
    rng = np.random.default_rng(seed)
    data = {}
    for s in range(n):
        for d in range(n):
            if s != d:
                sizes = [0, 1] + [int(x) for x in rng.integers(2, 70000, per_pair - 2)]
                rng.shuffle(sizes)
                data[s, d] = [torch.from_numpy(rng.integers(0, 256, z, dtype=np.uint8))
                              for z in sizes]
    return data


@pytest.mark.parametrize("n, per_pair, before", [(2, 6, None), (3, 6, None), (4, 6, None),
                                                  (2, 3 * P2P_SLOTS + 9, 17),
                                                  (3, 3 * P2P_SLOTS + 5, P2P_SLOTS + 4)])
def test_messages_arrive_whatever_order_the_ranks_post_in(n, per_pair, before):
    """before: the channels' message numbers wrap past 2^32 after that many
    messages (every slot then reused across the wrap)."""
    data = _plan(n, per_pair, seed=n + per_pair)
    groups = make_groups(n)
    if before is not None:
        for g in groups:
            g.c.emu_renumber(0, 2**32 - 1 - before)

    def rank(r):
        rng = np.random.default_rng(100 + r)
        # this rank's messages, each channel in order, the channels interleaved at random
        queues = [[(j, True, i) for i in range(per_pair)] for j in range(n) if j != r] + \
                 [[(j, False, i) for i in range(per_pair)] for j in range(n) if j != r]
        order = []
        while any(queues):
            q = queues[int(rng.choice([i for i, q in enumerate(queues) if q]))]
            order.append(q.pop(0))
        got = {(j, i): torch.full((nbytes(data[j, r][i]),), 0xA5, dtype=torch.uint8)
               for j in range(n) if j != r for i in range(per_pair)}   # poisoned
        sends = {(j, i): data[r, j][i].clone() for j in range(n) if j != r
                 for i in range(per_pair)}
        codes = []
        while order:   # posts of 1..4 messages
            k = int(rng.integers(1, 5))
            batch, order = order[:k], order[k:]
            codes += post(groups[r], [(j, s, sends[j, i] if s else got[j, i])
                                      for j, s, i in batch])
        wait_all(groups[r], codes)
        return got, sends, codes
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    for r in range(n):
        got, _sends, codes = res[r]
        assert len(codes) == 2 * (n - 1) * per_pair
        if before is not None:   # the numbers wrapped, skipping 0
            numbers = set(range(2**32 - before, 2**32)) | set(range(1, per_pair - before + 1))
            assert {c & 0xFFFFFFFF for c in codes} == numbers, codes
        assert all(groups[r].c.p2p_passed(c) for c in codes)
        for (j, i), t in got.items():
            assert torch.equal(t, data[j, r][i]), f"rank {r}: message {i} from rank {j}"
    counts = close_all(groups, streams)
    # every registration released, every mapping too (a rank that always
    # posted second registered nothing: the first side's buffer is mapped)
    assert sum(c[0] for c in counts) > 0, counts
    for regs, deregs, maps in counts:
        assert regs == deregs and maps == 0, counts


def test_words_a_long_run_of_one_role_left_behind_are_written_again():
    """Where every receiver posts first, senders never write their ready
    word nor receivers their done word: after 2^31 such messages those
    words would read as ahead.  Every message numbered a multiple of 2^29
    writes them again (csrc/sg/sg_page.h, REFRESH_EVERY).  Here the numbers
    start 3 messages before one, with those words 50 messages short of
    stale; 60 messages with the receiver first follow, then 20 with the
    sender first, whose waits would pass on them otherwise (the
    no_stale_words fixture counts such waits).  Between the two, with both
    pair streams idle, the words read back as the refresh wrote them (the
    streams run apart: without the pause a receiver's stream may reach its
    wait before the sender's has run the refresh)."""
    refresh, first, later = 1 << 29, 60, 20
    groups = make_groups(2)
    for g in groups:
        g.c.emu_renumber(0, 3 * refresh - 3, (1 << 31) - 50)
    rng = np.random.default_rng(12)
    xs = [torch.from_numpy(rng.integers(0, 256, int(rng.integers(1, 9000)), dtype=np.uint8))
          for _ in range(first + later)]
    posted = [threading.Event() for _ in xs]
    gate = threading.Barrier(2)

    def rank(r):
        codes, ys = [], []
        for i, x in enumerate(xs):
            sender_first = i >= first
            if i == first:   # both pair streams past the refresh (message 3 * 2^29)
                assert _engine._sg_emu_stream_idle(groups[r].pair_stream(1 - r), 10)
                gate.wait(10)
                # channel 0 -> 1 (csrc/sg/sg_page.h, struct p2p_chan): its
                # sender's ready word and its receiver's done word
                chan = PAGE + 2 * RANK_BYTES + 1 * CHAN_BYTES
                rdy_src, done_dst = (struct.unpack_from("<I", groups[r]._mm, chan + o)[0]
                                     for o in (0, 2 * 64 + 64))
                gate.wait(10)   # both read before either posts again
                assert rdy_src == done_dst == 3 * refresh - 1, (hex(rdy_src), hex(done_dst))
            if (r == 0) != sender_first:   # second: after the other side's post
                assert posted[i].wait(10)
            if r == 0:
                codes += post(groups[0], [(1, True, x)])
            else:
                ys.append(torch.full_like(x, 0xA5))
                codes += post(groups[1], [(0, False, ys[-1])])
            posted[i].set()
        wait_all(groups[r], codes)
        return codes, ys
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    drain(groups, streams)
    assert [c & 0xFFFFFFFF for c in res[0][0]] == [3 * refresh - 2 + i for i in range(len(xs))]
    for i, (x, y) in enumerate(zip(xs, res[1][1])):
        assert torch.equal(x, y), f"message {i}"
    close_all(groups, streams)


def test_renumbering_after_a_message_is_refused():
    groups = make_groups(2)
    x = torch.from_numpy(np.random.default_rng(5).integers(0, 256, 16, dtype=np.uint8))

    def rank(r):
        if r == 0:
            codes = post(groups[0], [(1, True, x)])
            with pytest.raises(ValueError, match="messages to or from rank 1 were posted "
                                                 "already: too late to renumber them"):
                groups[0].c.emu_renumber(0, 7)
            wait_all(groups[0], codes)
            return None
        groups[1].c.emu_renumber(0, 0)   # nothing posted here yet: allowed (0: unchanged)
        y = torch.full((16,), 0xA5, dtype=torch.uint8)
        wait_all(groups[1], post(groups[1], [(0, False, y)]))
        return y
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    drain(groups, streams)
    assert torch.equal(res[1], x)
    close_all(groups, streams)


def test_a_post_returns_before_the_peer_posts_and_the_stream_waits():
    groups = make_groups(2)
    x = torch.from_numpy(np.random.default_rng(7).integers(0, 256, 100003, dtype=np.uint8))
    go = threading.Event()

    def rank(r):
        if r == 1:
            assert go.wait(10)
            time.sleep(0.05)
            wait_all(groups[1], post(groups[1], [(0, True, x)]))
            return None
        y = torch.full((nbytes(x),), 0xA5, dtype=torch.uint8)
        t0 = time.monotonic()
        codes = post(groups[0], [(1, False, y)])
        wait_all(groups[0], codes)
        took = time.monotonic() - t0
        passed_early = groups[0].c.p2p_passed(codes[0])
        # the caller's stream is held at the wait: the bytes do not exist yet
        idle_early = _engine._sg_emu_stream_idle(_callers.stream, 0.2)
        go.set()
        return y, codes, took, passed_early, idle_early
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    y, codes, took, passed_early, idle_early = res[0]
    assert took < 1.0 and not passed_early and not idle_early, (took, passed_early, idle_early)
    drain(groups, streams)
    assert groups[0].c.p2p_passed(codes[0])
    assert torch.equal(y, x)
    close_all(groups, streams)


def test_sizes_that_differ_fail_both_sides_and_release_the_streams():
    groups = make_groups(2)
    posted = threading.Event()

    def rank(r):
        if r == 0:
            a = torch.ones(8, dtype=torch.uint8)
            codes = post(groups[0], [(1, True, a)])
            posted.set()
            wait_all(groups[0], codes)
            return a
        assert posted.wait(10)   # rank 1 posts second: it finds the mismatch
        b = torch.zeros(12, dtype=torch.uint8)
        post(groups[1], [(0, False, b)])
        return b
    res, err, streams = on_ranks(2, rank)
    assert isinstance(err[1], UcclError) and "rank 0 sends 8 bytes, rank 1 receives 12" in \
        str(err[1]), err
    drain(groups, streams, failed=True)   # rank 0's stream, waiting for the copy, was released
    for r in range(2):
        with pytest.raises(UcclError, match="rank 0 sends 8 bytes, rank 1 receives 12"):
            groups[r].check()

    def again(r):   # every later post raises with the reason
        post(groups[r], [(1 - r, r == 0, torch.ones(4, dtype=torch.uint8))])
    _res, err2, streams2 = on_ranks(2, again)
    assert all(isinstance(e, UcclError) and "sends 8 bytes" in str(e) for e in err2), err2
    close_all(groups, streams + streams2)


def test_a_receiver_that_never_posts_fails_the_group_within_the_timeout():
    groups = make_groups(2, timeout_s=1.0)

    def rank(r):
        if r == 1:
            return None   # never posts its recv
        a = torch.ones(64, dtype=torch.uint8)
        t0 = time.monotonic()
        wait_all(groups[0], post(groups[0], [(1, True, a)]))
        while groups[0].error() is None and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        return time.monotonic() - t0, a
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    took = res[0][0]
    assert 0.9 < took < 5.0, took
    drain(groups, streams, failed=True)   # the caller's stream waited for the copy: released
    for r in range(2):
        with pytest.raises(UcclError, match="message 1 from rank 0 to rank 1 not in place "
                                            "within 1 s: the receiver never posted its recv"):
            groups[r].check()
    close_all(groups, streams)


def test_a_sender_more_than_the_slots_ahead_waits_for_the_receiver():
    groups = make_groups(2)
    count = P2P_SLOTS + 4
    xs = [torch.from_numpy(np.random.default_rng(i).integers(0, 256, 999 + i, dtype=np.uint8))
          for i in range(count)]

    full = threading.Event()

    def rank(r):
        if r == 0:
            codes = [post(groups[0], [(1, True, x)])[0] for x in xs[:P2P_SLOTS]]
            full.set()
            t0 = time.monotonic()   # the next post waits for a free slot
            codes += [post(groups[0], [(1, True, x)])[0] for x in xs[P2P_SLOTS:]]
            took = time.monotonic() - t0
            wait_all(groups[0], codes)
            return took
        assert full.wait(10)
        time.sleep(0.5)
        ys = [torch.full_like(x, 0xA5) for x in xs]
        wait_all(groups[1], [post(groups[1], [(0, False, y)])[0] for y in ys])
        return ys
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    assert res[0] > 0.4, f"message {P2P_SLOTS + 1} was posted without waiting ({res[0]:.3f} s)"
    drain(groups, streams)
    for x, y in zip(xs, res[1]):
        assert torch.equal(x, y)
    close_all(groups, streams)


def test_a_sender_too_far_ahead_of_a_receiver_that_never_comes_times_out():
    groups = make_groups(2, timeout_s=1.0)
    xs = [torch.ones(16, dtype=torch.uint8) for _ in range(P2P_SLOTS + 1)]

    def rank(r):
        if r == 1:
            return None
        for i, x in enumerate(xs):
            try:
                post(groups[0], [(1, True, x)])
            except UcclError as e:
                return i, str(e)
        return None
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    i, msg = res[0]
    # Two clocks race, both 1 s long: the sender's wait for a free slot (from
    # the last post) and the watchdog's on message 1 (from the first post,
    # looked at every 20 ms).  Either may fail the group first; both name
    # the message the receiver never took.
    slot_wait = f"taking message 1 of the 0 -> 1 channel ({P2P_SLOTS} messages ahead)" in msg \
        and "timeout" in msg
    watchdog = "message 1 from rank 0 to rank 1 not in place within 1 s: the receiver never " \
        "posted its recv" in msg
    assert i == P2P_SLOTS and (slot_wait or watchdog), res
    drain(groups, streams, failed=True)
    close_all(groups, streams)


def test_messages_and_collective_rounds_in_different_orders_on_the_ranks():
    groups = make_groups(2)
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.integers(0, 256, 5000, dtype=np.uint8))
    parts = [torch.from_numpy(rng.integers(0, 256, 777, dtype=np.uint8)) for _ in range(2)]

    def rank(r):
        ctx = sgm.StreamCtx(Ctx(None, r, 2, 5.0), groups[r])
        out = torch.full((2 * 777,), 0xA5, dtype=torch.uint8)
        if r == 0:   # recv, then allgather
            y = torch.full_like(x, 0xA5)
            codes = post(groups[0], [(1, False, y)])
            ctx.allgather(parts[0], out)
            wait_all(groups[0], codes)
            return out, y
        ctx.allgather(parts[1], out)   # allgather, then send
        wait_all(groups[1], post(groups[1], [(0, True, x)]))
        return out, None
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    drain(groups, streams)
    assert torch.equal(res[0][1], x)
    for r in range(2):
        assert torch.equal(res[r][0], torch.cat(parts))
    close_all(groups, streams)


def test_bad_arguments_raise_before_anything_is_posted():
    groups = make_groups(2)

    def rank(r):
        g, t = groups[r], torch.ones(4, dtype=torch.uint8)
        errs = []
        for msgs in ([(r, True, t.data_ptr(), 4)], [(2, True, t.data_ptr(), 4)],
                     [(-1, False, t.data_ptr(), 4)], [(1 - r, True, 0, 4)], []):
            try:
                g.p2p(_callers.stream, msgs)
            except ValueError as e:
                errs.append(str(e))
        for code in (0, 12345, (3 << 33) | 1, (5 << 33) | 1):   # own channel, no channel
            try:
                g.c.p2p_passed(code)
            except ValueError as e:
                errs.append(str(e))
        return errs
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    for errs in res:
        assert len(errs) == 9, errs
        assert any("peer 0 in a group of 2 (this rank 0)" in e or
                   "peer 1 in a group of 2 (this rank 1)" in e for e in errs), errs
        assert any("is not a message code of this group" in e for e in errs), errs
    for g in groups:
        assert g.error() is None   # nothing was posted, nothing failed
    drain(groups, streams)
    close_all(groups, streams)


def test_a_small_send_posted_first_is_complete_once_staged():
    groups = make_groups(2)
    x = torch.from_numpy(np.random.default_rng(11).integers(0, 256, 4099, dtype=np.uint8))
    go = threading.Event()

    def rank(r):
        if r == 0:
            src = x.clone()
            codes = post(groups[0], [(1, True, src)])
            wait_all(groups[0], codes)
            # the receiver has not posted: the send is complete all the same
            idle = _engine._sg_emu_stream_idle(_callers.stream, 5.0)
            passed = groups[0].c.p2p_passed(codes[0])
            src.fill_(0)   # the send buffer is the caller's again
            go.set()
            return idle, passed
        assert go.wait(10)
        y = torch.full_like(x, 0xA5)
        wait_all(groups[1], post(groups[1], [(0, False, y)]))
        return y
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    assert res[0] == (True, True), res[0]
    drain(groups, streams)
    assert torch.equal(res[1], x)
    close_all(groups, streams)


@pytest.mark.parametrize("n", [2, 3])
def test_every_rank_sending_then_receiving_blocking_works_for_staged_sends(n):
    """dist.send(); dist.recv() on every rank, each wait()ed (the caller's
    stream waits for the send before the receive is even posted): works as
    NCCL's and Gloo's small buffered sends do, whichever side posts first,
    and with the arena's slots reused (more messages than slots)."""
    groups = make_groups(n)
    rounds = P2P_SLOTS + 5
    data = {(r, i): torch.from_numpy(np.random.default_rng(r * 1000 + i).integers(
        0, 256, 1000 + 37 * i, dtype=np.uint8)) for r in range(n) for i in range(rounds)}

    def rank(r):
        right, left = (r + 1) % n, (r - 1) % n
        got, sent = [], []   # kept until the streams ran (as the backend keeps them)
        for i in range(rounds):
            sent.append(data[r, i].clone())
            wait_all(groups[r], post(groups[r], [(right, True, sent[-1])]))
            y = torch.full_like(data[left, i], 0xA5)
            wait_all(groups[r], post(groups[r], [(left, False, y)]))
            got.append(y)
        return got, sent
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    drain(groups, streams)
    for r in range(n):
        for i in range(rounds):
            assert torch.equal(res[r][0][i], data[(r - 1) % n, i]), (r, i)
    close_all(groups, streams)


def test_every_rank_sending_then_receiving_unstaged_fails_loudly_as_a_deadlock(monkeypatch):
    """The same with staging off: each send completes only in the peer's
    receive, which its stream orders after its own send; the streams wait
    on each other (NCCL deadlocks there too, for sends larger than its
    buffers).  The watchdog fails the group within the timeout and
    releases every stream."""
    monkeypatch.setenv("UCCL_SG_EAGER_BYTES", "0")
    groups = make_groups(2, timeout_s=1.0)

    def rank(r):
        # both buffers kept until the streams ran (returned): once the group
        # failed, the released streams still run the copies they queued
        x = torch.ones(64, dtype=torch.uint8)
        wait_all(groups[r], post(groups[r], [(1 - r, True, x)]))
        y = torch.zeros(64, dtype=torch.uint8)
        wait_all(groups[r], post(groups[r], [(1 - r, False, y)]))
        t0 = time.monotonic()
        while groups[r].error() is None and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        return time.monotonic() - t0, x, y
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    assert all(t < 5 for t, _x, _y in res), res
    drain(groups, streams, failed=True)
    for g in groups:
        with pytest.raises(UcclError, match="not in place within 1 s"):
            g.check()
    close_all(groups, streams)


def test_messages_of_different_pairs_do_not_queue_behind_each_other():
    """Each pair has its own stream (as NCCL's): rank 0's send to rank 2
    must not wait behind its send to rank 1, whose receiver's stream waits
    (through its caller's stream) for rank 2's send, which waits for the
    send to rank 2.  One stream for every pair made this a cycle."""
    groups = make_groups(3, timeout_s=5.0)
    e1, e2 = threading.Event(), threading.Event()
    rng = np.random.default_rng(5)
    xs = {k: torch.from_numpy(rng.integers(0, 256, 3000, dtype=np.uint8)) for k in
          ("0to1", "0to2", "2to1")}

    def rank(r):
        if r == 1:
            a = torch.full((3000,), 0xA5, dtype=torch.uint8)
            wait_all(groups[1], post(groups[1], [(2, False, a)]))   # the caller waits for 2 -> 1
            b = torch.full((3000,), 0xA5, dtype=torch.uint8)
            codes = post(groups[1], [(0, False, b)])                 # starts after that wait
            wait_all(groups[1], codes)
            e1.set()
            return a, b
        if r == 2:
            assert e1.wait(10)
            a = torch.full((3000,), 0xA5, dtype=torch.uint8)
            wait_all(groups[2], post(groups[2], [(0, False, a)]))   # the caller waits for 0 -> 2
            s = xs["2to1"].clone()
            wait_all(groups[2], post(groups[2], [(1, True, s)]))
            e2.set()
            return a, s
        assert e2.wait(10)
        a, b = xs["0to1"].clone(), xs["0to2"].clone()
        wait_all(groups[0], post(groups[0], [(1, True, a)]) + post(groups[0], [(2, True, b)]))
        return a, b
    res, err, streams = on_ranks(3, rank)
    assert err == [None] * 3, err
    drain(groups, streams)
    for g in groups:
        assert g.error() is None, g.error()
    assert torch.equal(res[1][0], xs["2to1"]) and torch.equal(res[1][1], xs["0to1"])
    assert torch.equal(res[2][0], xs["0to2"])
    close_all(groups, streams)


def test_a_staged_slot_is_rewritten_only_after_its_receiver_copied_it_out():
    """The receiver's copies are held (its caller's stream waits for a
    message rank 2 sends only at the end) while the sender stages more
    messages than there are slots: the later ones must wait on the GPU for
    the earlier ones to be copied out, not overwrite them."""
    groups = make_groups(3)
    count = P2P_SLOTS + 4
    xs = [torch.from_numpy(np.random.default_rng(100 + i).integers(0, 256, 2000, dtype=np.uint8))
          for i in range(count)]
    held, posted, release = threading.Event(), threading.Event(), threading.Event()

    def rank(r):
        if r == 2:
            assert release.wait(20)
            s = torch.ones(8, dtype=torch.uint8)
            wait_all(groups[2], post(groups[2], [(1, True, s)]))
            return s
        if r == 0:
            sent = [x.clone() for x in xs]
            codes = [post(groups[0], [(1, True, sent[i])])[0] for i in range(P2P_SLOTS)]
            assert held.wait(20)   # rank 1 posted its first receives; its copies are held
            codes += [post(groups[0], [(1, True, sent[i])])[0] for i in range(P2P_SLOTS, count)]
            posted.set()
            wait_all(groups[0], codes)
            return sent
        gate = torch.zeros(8, dtype=torch.uint8)
        wait_all(groups[1], post(groups[1], [(2, False, gate)]))   # holds the caller's stream
        ys = [torch.full_like(x, 0xA5) for x in xs]
        codes = [post(groups[1], [(0, False, ys[i])])[0] for i in range(P2P_SLOTS)]
        held.set()
        assert posted.wait(20)
        time.sleep(0.2)   # the sender's stream had time to overwrite a slot, were it free
        release.set()
        codes += [post(groups[1], [(0, False, ys[i])])[0] for i in range(P2P_SLOTS, count)]
        wait_all(groups[1], codes)
        return ys, gate
    res, err, streams = on_ranks(3, rank, timeout=60)
    assert err == [None] * 3, err
    drain(groups, streams)
    for i, (x, y) in enumerate(zip(xs, res[1][0])):
        assert torch.equal(x, y), f"message {i}"
    close_all(groups, streams)


def test_posts_from_several_threads_at_once():
    """Two threads of rank 0 send to rank 1 at once (the first staged send
    makes the peer's staging arena: one, whichever thread comes first)."""
    groups = make_groups(2)
    rounds = 20
    xs = [torch.full((777,), i, dtype=torch.uint8) for i in range(2 * rounds)]

    def rank(r):
        if r == 1:
            ys = [torch.full((777,), 0xA5, dtype=torch.uint8) for _ in xs]
            for y in ys:
                wait_all(groups[1], post(groups[1], [(0, False, y)]))
            return ys
        errs = []

        def sender(lo):
            _callers.stream = stream
            try:
                for i in range(lo, lo + rounds):
                    wait_all(groups[0], post(groups[0], [(1, True, xs[i])]))
            except BaseException as e:   # noqa: BLE001
                errs.append(e)
        stream = _callers.stream
        ts = [threading.Thread(target=sender, args=(lo,)) for lo in (0, rounds)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        return errs
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None] and res[0] == [], (err, res[0])
    drain(groups, streams)
    got = sorted(int(y[0]) for y in res[1])
    assert got == list(range(2 * rounds)), got   # every message once, whole
    for y in res[1]:
        assert torch.equal(y, torch.full_like(y, int(y[0])))
    close_all(groups, streams)


def _rank0_sends_and_rank1_never_posts(groups):
    """Rank 0 sends rank 1 a staged message; rank 1 posts nothing.  The
    caller streams."""
    x = torch.ones(100, dtype=torch.uint8)

    def rank(r):
        if r == 0:
            wait_all(groups[0], post(groups[0], [(1, True, x)]))
            # the stream copies x into staging after the call returns: x must
            # outlive that copy (ASan in CI caught a free before it)
            assert _engine._sg_emu_stream_idle(_callers.stream, 5.0)
        return None
    _res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    return streams


def test_closing_with_a_message_the_peer_never_posts_fails_within_the_timeout():
    """The receiver lives on and never posts: the sender's close waits for
    it (a slower receiver would still come) up to the group's timeout, then
    fails the group naming the message."""
    groups = make_groups(2, timeout_s=2.0)
    streams = _rank0_sends_and_rank1_never_posts(groups)
    t0 = time.monotonic()
    c = groups[0].c
    groups[0].close()
    took = time.monotonic() - t0
    assert 1.9 < took < 5.0, f"close() took {took:.1f} s (the group's timeout is 2 s)"
    with pytest.raises(UcclError, match="message 1 from rank 0 to rank 1 not in place when rank 0 "
                                        "closed the group: the receiver never posted its recv"):
        groups[1].check()
    del c
    drain([groups[1]], streams, failed=True)
    close_all([groups[1]], streams)


def test_closing_with_a_message_the_peer_closed_without_posting_fails_at_once():
    """The receiver closed its group without posting: it never will, and
    the sender's close fails the group at once, not after the timeout."""
    groups = make_groups(2, timeout_s=30.0)
    streams = _rank0_sends_and_rank1_never_posts(groups)
    groups[1].close()
    t0 = time.monotonic()
    groups[0].close()
    took = time.monotonic() - t0
    assert took < 5.0, f"close() took {took:.1f} s (the group's timeout is 30 s)"
    drain([], streams)
    close_all([], streams)


def test_a_sender_closing_before_its_receiver_posts_a_staged_send_delivers_it():
    """A buffered (staged) send is complete on the sender's side, so the
    sender may close at once; the receiver posting a little later still gets
    every byte and nothing fails (it failed the group before: found by the
    GPU fault trials, send_recv at 4 KiB on 4 GPUs)."""
    groups = make_groups(2, timeout_s=10.0)
    x = torch.from_numpy(np.random.default_rng(12).integers(0, 256, 4099, dtype=np.uint8))
    closing = threading.Event()
    closed = []

    def rank(r):
        if r == 0:
            src = x.clone()        # kept until the send is complete
            wait_all(groups[0], post(groups[0], [(1, True, src)]))
            assert _engine._sg_emu_stream_idle(_callers.stream, 5.0)
            del src
            closing.set()
            t0 = time.monotonic()
            groups[0].close()
            closed.append(time.monotonic() - t0)
            return None
        assert closing.wait(10)
        time.sleep(0.3)            # the sender is inside close() by now
        y = torch.full_like(x, 0xA5)
        wait_all(groups[1], post(groups[1], [(0, False, y)]))
        assert _engine._sg_emu_stream_idle(_callers.stream, 5.0)
        return y
    res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    assert torch.equal(res[1], x)
    assert groups[1].error() is None, groups[1].error()
    assert 0.2 < closed[0] < 5.0, closed
    drain([groups[1]], streams)
    close_all([groups[1]], streams)


@pytest.mark.parametrize("rank, err, want", [
    (0, "stream-ordered group (rank 1): message 3 from rank 1 to rank 0 not in place",
     "stream-ordered group (rank 0): failed at rank 1: message 3 from rank 1 to rank 0 not in "
     "place"),
    (1, "stream-ordered group (rank 1): message 3 not in place",
     "stream-ordered group (rank 1): message 3 not in place"),
    (2, "stream-ordered group (rank 0), allreduce: not within the timeout",
     "stream-ordered group (rank 2): failed at rank 0, allreduce: not within the timeout"),
    (0, "rank 3 exited", "stream-ordered group (rank 0): rank 3 exited")])
def test_a_failure_names_this_rank_once_and_the_rank_that_noticed_it(rank, err, want):
    assert sgm.failure(rank, err) == want


def test_a_peers_failure_reads_without_nested_prefixes():
    groups = make_groups(2, timeout_s=1.0)
    groups[1].fail("stream-ordered group (rank 1): the test failed it")
    msgs = []
    for g in groups:
        with pytest.raises(UcclError) as e:
            g.check()
        msgs.append(str(e.value))
    assert all(m.count("stream-ordered group") == 1 for m in msgs), msgs
    assert msgs[0].startswith("stream-ordered group (rank 0): failed at rank 1"), msgs
    close_all(groups, [])
