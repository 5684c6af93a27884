"""Where same-node traffic of a CollectiveContext goes when the job asked
for torch.distributed (use_copy_engine_for_intra=False, upstream's
default): there, unless the group's backend cannot move the CUDA tensors a
rank of the node will send (Gloo, as upstream's GPU scripts bootstrap);
then through this engine, the same decision on every rank.

Run on CPU: "sees a GPU" is the module's `_uses_cuda`, which each rank
sets for the case (one rank only, to show that one is enough and that the
others follow), and the data moved are CPU tensors (random, poisoned
receive buffers, checked end to end)."""
from __future__ import annotations

import numpy as np
import pytest

from _harness import run_ranks

POISON = 0xA5


def _rank(rank, ws, path, gpu_ranks, q):
    import logging

    import torch
    import torch.distributed as dist

    from uccl_collective.core import collective as coll

    try:
        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
        logging.getLogger("uccl_collective").addHandler(Keep())
        logging.getLogger("uccl_collective").setLevel(logging.INFO)
        coll._uses_cuda = lambda: rank in gpu_ranks
        dist.init_process_group("gloo", store=dist.FileStore(path, ws), rank=rank, world_size=ws)
        ctx = coll.CollectiveContext(use_copy_engine_for_intra=False, timeout_s=20).init()
        n = 4099
        xs = [torch.from_numpy(np.random.default_rng(11 + r).integers(0, 255, n, dtype=np.uint8))
              for r in range(ws)]
        out = torch.full((ws * n,), POISON, dtype=torch.uint8)
        ctx.allgather(xs[rank], out)
        got = torch.full((n,), POISON, dtype=torch.uint8)
        peer = (rank + 1) % ws
        ctx.sendrecv(xs[rank], peer, got, (rank - 1) % ws)
        res = {"engine": ctx.use_copy_engine_for_intra,
               "engine_peers": [bool(p) for p in ctx._engine_peer],
               "allgather_ok": bool(torch.equal(out, torch.cat(xs))),
               "sendrecv_ok": bool(torch.equal(got, xs[(rank - 1) % ws])),
               "log": [m for m in records if "cannot move CUDA tensors" in m]}
        ctx.finalize()
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, res))
    except BaseException as e:  # noqa: BLE001
        q.put((rank, f"{type(e).__name__}: {e}"))


def _job(tmp_path, ws, gpu_ranks):
    return run_ranks(_rank, ws, (str(tmp_path / "store"), gpu_ranks))


@pytest.mark.parametrize("ws", [2, 3])
def test_a_gloo_group_and_a_rank_with_a_gpu_route_same_node_traffic_through_the_engine(
        tmp_path, ws):
    got = _job(tmp_path, ws, gpu_ranks={ws - 1})
    for r, res in got.items():
        assert res["engine"] is True, (r, res)
        assert res["engine_peers"] == [q != r for q in range(ws)], (r, res)
        assert res["allgather_ok"] and res["sendrecv_ok"], (r, res)
        assert len(res["log"]) == 1 and "backend (gloo)" in res["log"][0], (r, res)


def test_without_a_gpu_same_node_traffic_stays_on_torch_distributed(tmp_path):
    got = _job(tmp_path, 2, gpu_ranks=set())
    for r, res in got.items():
        assert res["engine"] is False, (r, res)
        assert res["engine_peers"] == [False, False], (r, res)
        assert res["allgather_ok"] and res["sendrecv_ok"], (r, res)
        assert res["log"] == [], (r, res)


@pytest.mark.parametrize("backend, moves", [
    ("gloo", False), ("nccl", True), ("uccl", True), ("cpu:gloo,cuda:nccl", True),
    ("cpu:gloo,cuda:gloo", False), ("cpu:gloo", False), ("cuda:nccl,cpu:gloo", True)])
def test_which_backends_move_cuda_tensors(monkeypatch, backend, moves):
    import torch.distributed as dist

    from uccl_collective.core import collective as coll
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert coll._group_moves_cuda(None) is moves
