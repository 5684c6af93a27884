"""all_to_all as one stream-ordered round (StreamGroup.all_to_all, the
round the backend's all_to_all and all_to_all_single post for CUDA tensors
whose ranks share a host, or run as a task), on the emulated device: every
rank a thread, every stream a thread (test_stream_group.py).  Equal,
unequal and empty chunks, and the MoE pattern (many back-to-back
all_to_alls of small unequal chunks, most tokens to a few ranks); random
bytes, poisoned outputs (the own chunk's too: the round copies it), checked
whole.  Chunk sizes the two sides of a pair disagree on fail the group,
naming both, an empty chunk included."""
import numpy as np
import pytest
import torch

from test_stream_group import (  # noqa: F401 - caller_streams, no_stale_words: autouse
    _callers, caller_streams, close_all, make_groups, no_stale_words, on_ranks)
from test_stream_p2p import drain
from uccl_collective.p2p import UcclError

POISON = 0xA5


def _spans(ts):
    return [(t.data_ptr(), t.numel()) for t in ts]


def _splits(kind, n, rng, rounds):
    """sizes[round][src][dst] in bytes."""
    if kind == "equal":
        return np.full((rounds, n, n), 4099)
    if kind == "unequal":   # 0 and 1 among them, up to 70,000 (staged and not)
        s = rng.integers(0, 70000, (rounds, n, n))
        s[:, 0, n - 1], s[:, n - 1, 0] = 0, 1
        return s
    # "moe": tokens of 1..64 bytes, most to two "hot" ranks, many chunks empty
    hot = rng.integers(0, 4, (rounds, n, n)) == 0
    return np.where(hot, rng.integers(1, 257, (rounds, n, n)) * 16,
                    rng.integers(0, 3, (rounds, n, n)) * 8)


def _plan(kind, n, seed, rounds):
    """(sizes[round][src][dst], data[round][src][dst]): random bytes."""
    rng = np.random.default_rng(seed)
    sizes = _splits(kind, n, rng, rounds)
    data = [[[torch.from_numpy(rng.integers(0, 256, int(sizes[k, s, d]), dtype=np.uint8))
              for d in range(n)] for s in range(n)] for k in range(rounds)]
    return sizes, data


def _run_and_check(n, groups, rank, data):
    """rank(r) on n threads -> [(sends, recvs)] per round; every chunk checked."""
    res, err, streams = on_ranks(n, rank, timeout=120.0)
    assert err == [None] * n, err
    drain(groups, streams)
    for r in range(n):
        for k, (_sends, recvs) in enumerate(res[r]):
            for s in range(n):
                assert torch.equal(recvs[s], data[k][s][r]), f"round {k}: rank {r} from {s}"
    close_all(groups, streams)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("kind, rounds", [("equal", 2), ("unequal", 3), ("moe", 40)])
def test_all_to_all_delivers_every_chunk(n, kind, rounds):
    sizes, data = _plan(kind, n, n * 100 + rounds, rounds)
    groups = make_groups(n, timeout_s=20.0)

    def rank(r):
        outs = []
        for k in range(rounds):
            sends = [data[k][r][d].clone() for d in range(n)]
            recvs = [torch.full((int(sizes[k, s, r]),), POISON, dtype=torch.uint8)
                     for s in range(n)]
            groups[r].all_to_all(_callers.stream, _spans(sends), _spans(recvs))
            outs.append((sends, recvs))   # kept until the streams ran
        return outs
    _run_and_check(n, groups, rank, data)


@pytest.mark.parametrize("sent, expected", [(8, 12), (8, 0), (0, 12)])
def test_split_sizes_the_ranks_disagree_on_fail_the_group_naming_both(sent, expected):
    """Rank 0 sends rank 1 `sent` bytes where rank 1 expects `expected`
    (an empty side included: nothing to copy, but the pair still checked)."""
    groups = make_groups(2, timeout_s=5.0)
    keep = []

    def rank(r):
        sends = [torch.ones(sent if (r, d) == (0, 1) else 4, dtype=torch.uint8)
                 for d in range(2)]
        recvs = [torch.zeros(expected if (r, s) == (1, 0) else 4, dtype=torch.uint8)
                 for s in range(2)]
        keep.append((sends, recvs))
        return groups[r].all_to_all(_callers.stream, _spans(sends), _spans(recvs))
    _res, err, streams = on_ranks(2, rank)
    drain(groups, streams, failed=True)
    want = f"all_to_all: rank 0 sends {sent} bytes where rank 1 receives {expected}"
    msgs = [str(e) for e in err if e is not None] + [g.error() or "" for g in groups]
    assert any(want in m for m in msgs), (err, msgs)
    for g in groups:
        with pytest.raises(UcclError, match=want):
            g.check()
    close_all(groups, streams)


def test_all_to_all_names_a_wrong_number_of_chunks():
    groups = make_groups(2)

    def rank(r):
        with pytest.raises(ValueError, match="all_to_all: 1 sends and 2 receives for a group "
                                             "of 2"):
            groups[r].all_to_all(_callers.stream, [(0, 0)], [(0, 0), (0, 0)])
    _res, err, streams = on_ranks(2, rank)
    assert err == [None, None], err
    drain(groups, streams)
    close_all(groups, streams)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_backends_round_and_its_task_meet(n, monkeypatch):
    """The backend's two routes for all_to_all of CUDA tensors on one host:
    a blocking call posts the round from its thread (Dispatch.all_to_all,
    a StreamWork), and a call whose round cannot go now (an async one, a
    task queued before) runs it as a task (Algorithms.exchange through the
    StreamCtx).  Ranks may take either, so both must be the same round:
    even ranks take the first here, odd ranks the second, on CPU tensors
    standing in for CUDA ones, unequal and empty chunks, every byte checked."""
    from uccl_collective.backend._algorithms import Algorithms
    from uccl_collective.backend._work import Runner, StreamWork
    from uccl_collective.core import dispatch
    from uccl_collective.core.stream_group import StreamCtx
    import torch.distributed as dist
    monkeypatch.setattr(dispatch, "_dense_cuda", lambda *ts: 0)   # CPU tensors as CUDA ones
    rounds = 4
    sizes, data = _plan("unequal", n, 50 + n, rounds)
    groups = make_groups(n, timeout_s=20.0)

    class Ctx:
        world_size, timeout_s = n, 20.0

        def __init__(self, r):
            self.rank = r

        def stream_group(self, dev, timeout_s):
            return groups[self.rank]

    def rank(r):
        d = dispatch.Dispatch(Ctx(r), Runner("test", 20.0), r, n, 20.0, StreamWork, None)
        d.sg_off = False
        opts = dist.AllToAllOptions()
        opts.asyncOp = False
        task = Algorithms(None, type("D", (), {"xctx": StreamCtx(Ctx(r), groups[r])})(),
                          r, n, None, None)
        kept = []
        try:
            for k in range(rounds):
                sends = [data[k][r][j].clone() for j in range(n)]
                recvs = [torch.full((int(sizes[k, s, r]),), POISON, dtype=torch.uint8)
                         for s in range(n)]
                if r % 2 == 0:
                    w = d.all_to_all(recvs + sends, _spans(sends), _spans(recvs), [recvs], opts)
                    assert isinstance(w, StreamWork), w
                else:
                    task.exchange(sends, recvs, "all_to_all")
                kept.append((sends, recvs))
        finally:
            d.close()
        return kept
    _run_and_check(n, groups, rank, data)


def test_all_to_all_against_another_exchange_fails_on_both_ranks():
    """Rank 0 in all_to_all, rank 1 in a gather to rank 0 whose bytes would
    fit (its send is what rank 0 expects from it): the rounds' kinds differ,
    so both ranks raise naming the two calls, and nothing is copied."""
    from uccl_collective.core.stream_group import StreamCtx
    groups = make_groups(2, timeout_s=5.0)
    keep = {}

    class Ctx:
        world_size, timeout_s = 2, 5.0

        def __init__(self, r):
            self.rank = r

    def rank(r):
        if r == 0:
            sends = [torch.ones(4, dtype=torch.uint8) for _ in range(2)]
            recvs = [torch.full((4,), POISON, dtype=torch.uint8) for _ in range(2)]
            keep[0] = recvs
            StreamCtx(Ctx(0), groups[0]).all_to_all(sends, recvs)
        else:
            mine = torch.ones(4, dtype=torch.uint8)
            keep[1] = mine
            StreamCtx(Ctx(1), groups[1])._p2p([("send", mine, 0)], "gather")
    _res, err, streams = on_ranks(2, rank)
    drain(groups, streams, failed=True)
    for g in groups:
        with pytest.raises(UcclError, match=r"the ranks' calls disagree .*rank \d calls "
                                            r"(all_to_all|gather)\(kind"):
            g.check()
    assert torch.equal(keep[0][1], torch.full((4,), POISON, dtype=torch.uint8)), \
        "rank 1's bytes were copied into rank 0's output"
    close_all(groups, streams)
