"""all_to_all as stream-ordered messages (StreamGroup.all_to_all, what the
backend's all_to_all and all_to_all_single post for CUDA tensors whose ranks
share a host), on the emulated device: every rank a thread, every stream a
thread (test_stream_group.py).  Equal, unequal and empty chunks, and the
MoE pattern (many back-to-back all_to_alls of small unequal chunks, most
tokens to a few ranks); random bytes, poisoned outputs, checked whole.  The
own chunk is the caller's to copy (the backend copies it on its stream);
here the test does."""
import numpy as np
import pytest
import torch

from test_stream_group import (  # noqa: F401 - caller_streams, no_stale_words: autouse
    _callers, caller_streams, close_all, make_groups, no_stale_words, on_ranks)
from test_stream_p2p import drain, wait_all
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


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("kind, rounds", [("equal", 2), ("unequal", 3), ("moe", 40)])
def test_all_to_all_delivers_every_chunk(n, kind, rounds):
    rng = np.random.default_rng(n * 100 + rounds)
    sizes = _splits(kind, n, rng, rounds)
    data = [[[torch.from_numpy(rng.integers(0, 256, int(sizes[k, s, d]), dtype=np.uint8))
              for d in range(n)] for s in range(n)] for k in range(rounds)]
    groups = make_groups(n, timeout_s=20.0)

    def rank(r):
        outs = []
        for k in range(rounds):
            sends = [data[k][r][d].clone() for d in range(n)]
            recvs = [torch.full((int(sizes[k, s, r]),), POISON, dtype=torch.uint8)
                     for s in range(n)]
            recvs[r].copy_(sends[r])
            codes = groups[r].all_to_all(_callers.stream, _spans(sends), _spans(recvs))
            assert len(codes) == 2 * (n - 1)
            wait_all(groups[r], codes)
            outs.append((sends, recvs))   # kept until the streams ran
        return outs
    res, err, streams = on_ranks(n, rank, timeout=120.0)
    assert err == [None] * n, err
    drain(groups, streams)
    for r in range(n):
        for k, (_sends, recvs) in enumerate(res[r]):
            for s in range(n):
                assert torch.equal(recvs[s], data[k][s][r]), f"round {k}: rank {r} from {s}"
    close_all(groups, streams)


def test_split_sizes_the_ranks_disagree_on_fail_the_group_naming_both():
    groups = make_groups(2, timeout_s=5.0)
    keep = []

    def rank(r):
        sends = [torch.ones(8 if r == 0 else 4, dtype=torch.uint8) for _ in range(2)]
        recvs = [torch.zeros(12 if r == 1 else 4, dtype=torch.uint8) for _ in range(2)]
        keep.append((sends, recvs))
        return groups[r].all_to_all(_callers.stream, _spans(sends), _spans(recvs))
    _res, err, streams = on_ranks(2, rank)
    drain(groups, streams, failed=True)
    msgs = [str(e) for e in err if e is not None] + [g.error() or "" for g in groups]
    assert any("rank 0 sends 8 bytes, rank 1 receives 12" in m for m in msgs), (err, msgs)
    for g in groups:
        with pytest.raises(UcclError, match="rank 0 sends 8 bytes, rank 1 receives 12"):
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
