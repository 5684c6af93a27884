"""Regressions for the findings of the CollectiveContext review (2026-11-22).

Each test is a real multi-rank job (the launcher of test_collective.py):
- a dropped iallgather handle must not free tensors the engine still fills;
- mixed routes (use_copy_engine_for_intra=False, one rank alone on its node)
  must run the same ring implementation on every rank;
- allgatherv with algorithm="auto" must pick the same algorithm on every rank
  when the chunks straddle the ring threshold;
- wait(timeout) on an operation queued behind a stuck one returns in time;
- contexts over disjoint subgroups must not connect to each other, and
  same-node traffic of a subgroup reaches the right global ranks.
"""
from __future__ import annotations

import os
import time

from test_collective import _gen, _init_gloo, _launch, _poisoned, _same

MiB = 1 << 20


def _dropped_handle(rank, ws, port):
    import gc

    import torch
    from uccl_collective import collective

    _init_gloo(rank, ws, port)
    ctx = collective.init_collective(use_copy_engine_for_intra=True, timeout_s=20)
    n = MiB // 4
    if rank == 0:
        recv = torch.empty(n * ws)
        ctx.iallgather(_gen(0, n, "float32"), recv)  # the handle is dropped at once
        del recv             # the context must keep the buffer until the operation ends
        gc.collect()
        time.sleep(0.3)      # rank 1 joins late: the operation is still in flight here
    else:
        time.sleep(0.5)
        recv = torch.empty(n * ws)
        ctx.allgather(_gen(1, n, "float32"), recv)
        _same(recv[:n], _gen(0, n, "float32"), "chunk of rank 0")
    for k in range(3):       # the context stays healthy
        recv, _ = _poisoned(n * ws, "float32")
        ctx.allgather(_gen(rank + 10 * k, n, "float32"), recv)
        for r in range(ws):
            _same(recv[r * n:(r + 1) * n], _gen(r + 10 * k, n, "float32"), f"round {k}")
    return True


def test_dropped_handle_keeps_tensors_alive():
    assert _launch(_dropped_handle, 2, timeout=60) == {0: True, 1: True}


def _mixed_routes(rank, ws, port, algo, lens):
    import torch.distributed
    from uccl_collective.collective import CollectiveContext

    os.environ["UCCL_NODE_ID"] = "nodeA" if rank < 2 else f"node{rank}"
    _init_gloo(rank, ws, port)
    ctx = CollectiveContext(use_copy_engine_for_intra=False, timeout_s=20).init()
    routes = [ctx.transport_to(p) for p in range(ws) if p != rank]
    out = [_poisoned(lens[r], "uint8")[0] for r in range(ws)]
    send = _gen(rank, lens[rank], "uint8")
    ctx.allgatherv(send, out, algorithm=algo)
    for r in range(ws):
        _same(out[r], _gen(r, lens[r], "uint8"), f"chunk of rank {r}")
    ctx.finalize()
    torch.distributed.barrier()   # rank 0 hosts the store: it leaves last
    return routes


def test_mixed_routes_ring_same_everywhere():
    """Ranks 0 and 1 share a node (torch.distributed between them), rank 2 is
    alone: every rank must still run the same ring (1 MiB and odd chunks)."""
    lens = [MiB, MiB + 1, MiB]
    res = _launch(_mixed_routes, 3, timeout=60, algo="ring", lens=lens)
    assert res[0] == ["torch.distributed", "tcp"] and res[2] == ["tcp", "tcp"], res


def test_allgatherv_auto_agrees_across_the_threshold():
    """5 ranks on 5 "nodes" (TCP, where auto may choose the ring): one chunk
    of 2 MiB, the others 256 KiB, so each rank's own size points elsewhere."""
    lens = [2 * MiB] + [MiB // 4] * 4
    res = _launch(_nodes_each, 5, timeout=90, lens=lens)
    assert all(v == ["tcp"] * 4 for v in res.values()), res


def _nodes_each(rank, ws, port, lens):
    import torch.distributed
    from uccl_collective.collective import CollectiveContext

    os.environ["UCCL_NODE_ID"] = f"node{rank}"
    _init_gloo(rank, ws, port)
    ctx = CollectiveContext(use_copy_engine_for_intra=True, timeout_s=20).init()
    out = [_poisoned(lens[r], "uint8")[0] for r in range(ws)]
    ctx.allgatherv(_gen(rank, lens[rank], "uint8"), out, algorithm="auto")
    for r in range(ws):
        _same(out[r], _gen(r, lens[r], "uint8"), f"chunk of rank {r}")
    routes = [ctx.transport_to(p) for p in range(ws) if p != rank]
    ctx.finalize()
    torch.distributed.barrier()   # rank 0 hosts the store: it leaves last
    return routes


def _queued_timeout(rank, ws, port):
    import torch
    import torch.distributed as dist
    from uccl_collective import UcclTimeoutError
    from uccl_collective.collective import CollectiveContext

    _init_gloo(rank, ws, port)
    ctx = CollectiveContext(use_copy_engine_for_intra=True, timeout_s=8).init()
    if rank == 1:            # never joins: rank 0's first allgather is stuck
        dist.barrier()
        return "idle"
    n = 1024
    a = ctx.iallgather(torch.ones(n), torch.empty(n * ws))
    b = ctx.iallgather(torch.ones(n), torch.empty(n * ws))
    t0 = time.monotonic()
    try:
        b.wait(timeout=0.5)
    except UcclTimeoutError as e:
        took = time.monotonic() - t0
        assert took < 3.0, f"wait(timeout=0.5) returned after {took:.1f} s"
        assert "queued" in str(e), str(e)
    else:
        raise AssertionError("wait(timeout=0.5) on a queued operation did not raise")
    try:
        a.wait(timeout=0.5)
    except Exception:  # noqa: BLE001 (stuck, then given up: any error is right)
        pass
    dist.barrier()
    return "ok"


def test_wait_timeout_on_queued_operation():
    assert _launch(_queued_timeout, 2, timeout=60) == {0: "ok", 1: "idle"}


def _subgroups(rank, ws, port):
    import torch.distributed as dist
    from uccl_collective.collective import CollectiveContext

    _init_gloo(rank, ws, port)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    out = {}
    for intra in (True, False):
        ctx = CollectiveContext(use_copy_engine_for_intra=intra, timeout_s=20, group=mine).init()
        assert (ctx.rank, ctx.world_size) == (rank % 2, 2)
        n = 4097
        recv, _ = _poisoned(2 * n, "float32")
        ctx.allgather(_gen(100 + rank, n, "float32"), recv)
        base = rank - rank % 2   # the group's first global rank
        for r in range(2):
            _same(recv[r * n:(r + 1) * n], _gen(100 + base + r, n, "float32"),
                  f"intra={intra}: chunk of group rank {r}")
        out[intra] = ctx.transport_to(1 - ctx.rank)
        ctx.finalize()
    dist.barrier()   # rank 0 hosts the store: it must not exit while the other pair uses it
    return out


def test_disjoint_subgroups_stay_apart():
    res = _launch(_subgroups, 4, timeout=60)
    assert all(v == {True: "shm-cma", False: "torch.distributed"} for v in res.values()), res
