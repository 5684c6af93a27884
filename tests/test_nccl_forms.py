"""Forms of the collectives that NCCL takes and torch's NCCL-gated suite
uses, on the "uccl" backend (CPU tensors here; the suite runs them on GPUs,
benchmarks/torch_suite.py --as nccl):

- all_gather into outputs of different sizes (all_gather_v: rank r's input
  fills output r) and reduce_scatter from inputs of different sizes
  (reduce_scatter_v), every rank's sizes compared before a byte moves;
- sends to and receives from the rank itself, alone and inside a
  batch_isend_irecv with every other rank, matched in posting order;
- ProcessGroup's other overloads, which torch's own code calls on the
  group object (DDP's `process_group.allreduce(tensor)`): a lone tensor,
  a ReduceOp or a root rank in place of the options.

Every rank's data is random; outputs are poisoned first; the parent
recomputes every expected value from the seeds."""
from __future__ import annotations

import numpy as np

from _harness import run_ranks

WS = 3


def _data(rank: int, n: int, salt: int = 0):
    import torch
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(n, generator=g)


def _rank(rank, ws, path, case, q):
    """Runs in a spawned process (_harness.run_ranks)."""
    import faulthandler
    faulthandler.dump_traceback_later(100, exit=True)
    try:
        import datetime

        import torch
        import torch.distributed as dist

        import uccl_collective  # noqa: F401 - registers "uccl"
        case, _, backend = case.partition("@")
        dist.init_process_group(backend or "uccl", store=dist.FileStore(path, ws), rank=rank,
                                world_size=ws, timeout=datetime.timedelta(seconds=20))
        q.put((rank, _CASES[case](rank, ws, dist, torch)))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, f"Error: {type(e).__name__}: {e}"))


def _all_gather_v(rank, ws, dist, torch):
    sizes = [3 * r + 1 for r in range(ws)]
    out = []
    for async_op in (False, True):
        outs = [torch.full((s,), float("nan")) for s in sizes]
        w = dist.all_gather(outs, _data(rank, sizes[rank], int(async_op)), async_op=async_op)
        if async_op:
            w.wait()
        out.append([o.numpy() for o in outs])
    return out


def _reduce_scatter_v(rank, ws, dist, torch):
    sizes = [2 * r + 1 for r in range(ws)]
    got = {}
    for op in ("SUM", "MAX", "AVG"):
        ins = list(torch.split(_data(rank, sum(sizes), len(got)), sizes))
        out = torch.full((sizes[rank],), float("nan"))
        dist.reduce_scatter(out, ins, op=getattr(dist.ReduceOp, op))
        got[op] = out.numpy()
    return got


def _bad_all_gather_v(rank, ws, dist, torch):
    # rank 2 thinks rank 0 sends 5 elements; rank 0 sends 1
    sizes = [1, 4, 7]
    mine = list(sizes)
    if rank == 2:
        mine[0] = 5
    outs = [torch.zeros(s) for s in mine]
    try:
        dist.all_gather(outs, torch.ones(sizes[rank]))
    except Exception as e:  # noqa: BLE001
        return ("raised", f"{type(e).__name__}: {e}")
    return ("returned", "")


def _self_p2p(rank, ws, dist, torch):
    """torch's test_batch_isend_irecv_nccl: every rank receives from and
    sends to every rank, itself included, receives posted first."""
    recvs = [torch.full((src + 1,), float("nan")) for src in range(ws)]
    ops = []
    for src in range(ws):
        ops.append(dist.P2POp(dist.irecv, recvs[src], src))
        ops.append(dist.P2POp(dist.isend, _data(rank, rank + 1, 10 + src), src))
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    # alone, send first then receive; then two matched in posting order
    a = torch.full((4,), float("nan"))
    dist.isend(_data(rank, 4, 20), rank).wait()   # (dist.send refuses the rank itself)
    dist.irecv(a, rank).wait()
    r1, r2 = torch.zeros(2), torch.zeros(2)
    w1, w2 = dist.irecv(r1, rank), dist.irecv(r2, rank)
    done_before = w1.is_completed()
    dist.isend(torch.tensor([1.0, 2.0]), rank).wait()
    dist.isend(torch.tensor([3.0, 4.0]), rank).wait()
    w1.wait()
    w2.wait()
    return [x.numpy() for x in recvs], a.numpy(), r1.numpy(), r2.numpy(), done_before


def _unmatched_self_recv(rank, ws, dist, torch):
    import time
    w = dist.irecv(torch.zeros(3), rank)
    t0 = time.monotonic()
    try:
        w.wait(datetime_s(1.0))
    except Exception as e:  # noqa: BLE001
        return ("raised", f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}")
    return ("returned", "")


def datetime_s(s: float):
    import datetime
    return datetime.timedelta(seconds=s)


def _overloads(rank, ws, dist, torch):
    pg = dist.distributed_c10d._get_default_group()
    a = _data(rank, 5, 30)
    pg.allreduce(a).wait()                              # (tensor)
    b = _data(rank, 5, 31)
    pg.allreduce([b], dist.ReduceOp.MAX).wait()         # (tensors, op)
    c = _data(rank, 5, 32) if rank == 1 else torch.full((5,), float("nan"))
    pg.broadcast(c, 1).wait()                           # (tensor, root)
    d = _data(rank, 5, 33)
    pg.reduce(d, 2, dist.ReduceOp.MIN).wait()           # (tensor, root, op)
    return a.numpy(), b.numpy(), c.numpy(), (d.numpy() if rank == 2 else None)


def _ddp_join(rank, ws, dist, torch):
    """DDP over uneven inputs (torch's test_ddp_uneven_inputs): a rank that
    runs out joins, and its join hook calls process_group.allreduce(tensor)
    (find_unused_parameters) to match the others' backward passes."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(m, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(50 + rank)
    with ddp.join():
        for _ in range(2 + 2 * rank):
            ddp(torch.randn(4, 8, generator=g)).sum().backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().numpy() for p in m.parameters()]


def _ddp_grad_div(rank, ws, dist, torch):
    """torch's test_ddp_grad_div_uneven_inputs: with
    join(divide_by_initial_world_size=False) DDP's reducer waits, in the
    backward pass, for the forward pass's all_reduce of the count of ranks
    not joined, a Work the Python side has dropped by then (it hung)."""
    dim, scale = 5, 50.0
    net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(dim, dim, bias=False),
                                                    bucket_cap_mb=1)
    inp = torch.ones(1, dim) * scale
    n_iters = 3 + 2 * (rank > 0)
    grads = []
    for initial in (False, True):
        with net.join(divide_by_initial_world_size=initial):
            for _ in range(n_iters):
                net(inp).sum().backward()
                grads.append(next(iter(net.parameters())).grad.clone().numpy())
                net.zero_grad()
    return grads


_CASES = {"ddp_grad_div": _ddp_grad_div, "ddp_join": _ddp_join, "all_gather_v": _all_gather_v, "reduce_scatter_v": _reduce_scatter_v,
          "bad_all_gather_v": _bad_all_gather_v, "self_p2p": _self_p2p,
          "unmatched_self_recv": _unmatched_self_recv, "overloads": _overloads}


def _run(case, tmp_path):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return run_ranks(_rank, WS, (str(tmp_path / "store"), case), timeout=150)


def _np(rank, n, salt=0):
    return _data(rank, n, salt).numpy()


def test_all_gather_into_outputs_of_different_sizes(tmp_path):
    got = _run("all_gather_v", tmp_path)
    sizes = [3 * r + 1 for r in range(WS)]
    for rank in range(WS):
        for salt, outs in enumerate(got[rank]):
            for r in range(WS):
                np.testing.assert_array_equal(outs[r], _np(r, sizes[r], salt))


def test_reduce_scatter_from_inputs_of_different_sizes(tmp_path):
    got = _run("reduce_scatter_v", tmp_path)
    sizes = [2 * r + 1 for r in range(WS)]
    starts = np.cumsum([0] + sizes)
    for salt, op in enumerate(("SUM", "MAX", "AVG")):
        full = np.stack([_np(r, sum(sizes), salt) for r in range(WS)])
        want = {"SUM": full.sum(0), "MAX": full.max(0), "AVG": full.sum(0) / WS}[op]
        for rank in range(WS):
            np.testing.assert_allclose(got[rank][op], want[starts[rank]:starts[rank + 1]],
                                       rtol=1e-6, err_msg=f"{op} on rank {rank}")


def test_all_gather_v_whose_sizes_the_ranks_disagree_on_raises_everywhere(tmp_path):
    got = _run("bad_all_gather_v", tmp_path)
    for rank in range(WS):
        assert got[rank][0] == "raised", f"rank {rank}: {got[rank]}"
        assert "UcclMismatchError: all_gather: the ranks' split sizes disagree" in got[rank][1]
        assert "rank 2 expects 5 from rank 0" in got[rank][1], got[rank]


def test_send_to_and_receive_from_the_rank_itself(tmp_path):
    got = _run("self_p2p", tmp_path)
    for rank in range(WS):
        recvs, a, r1, r2, done_before = got[rank]
        for src in range(WS):
            np.testing.assert_array_equal(recvs[src], _np(src, src + 1, 10 + rank))
        np.testing.assert_array_equal(a, _np(rank, 4, 20))
        np.testing.assert_array_equal(r1, [1.0, 2.0])
        np.testing.assert_array_equal(r2, [3.0, 4.0])
        assert done_before is False


def test_a_receive_from_itself_no_send_matches_raises_at_the_timeout(tmp_path):
    got = _run("unmatched_self_recv", tmp_path)
    for rank in range(WS):
        how, msg = got[rank]
        assert how == "raised" and msg.startswith("UcclTimeoutError after 1."), got[rank]
        assert f"recv from this rank ({rank}): no matching send to this rank" in msg, msg


def test_process_group_overloads_torch_calls_on_the_group(tmp_path):
    got = _run("overloads", tmp_path)
    a = sum(_np(r, 5, 30) for r in range(WS))
    b = np.max([_np(r, 5, 31) for r in range(WS)], axis=0)
    d = np.min([_np(r, 5, 33) for r in range(WS)], axis=0)
    for rank in range(WS):
        ga, gb, gc, gd = got[rank]
        np.testing.assert_allclose(ga, a, rtol=1e-6)
        np.testing.assert_array_equal(gb, b)
        np.testing.assert_array_equal(gc, _np(1, 5, 32))
        if rank == 2:
            np.testing.assert_array_equal(gd, d)



def test_ddp_over_uneven_inputs_with_join_trains_as_on_gloo(tmp_path):
    ours = _run("ddp_join", tmp_path / "uccl")
    gloo = _run("ddp_join@gloo", tmp_path / "gloo")
    for rank in range(WS):   # (3 ranks' sums, added in another order than Gloo's)
        for a, b in zip(ours[rank], gloo[rank]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # every rank ends with the same model (those that joined early took the others' steps)
    for rank in range(1, WS):
        for a, b in zip(ours[0], ours[rank]):
            np.testing.assert_array_equal(a, b)


def test_ddp_join_dividing_by_the_ranks_still_training(tmp_path):
    got = _run("ddp_grad_div", tmp_path)
    for rank in range(WS):
        n_iters = 3 + 2 * (rank > 0)
        assert len(got[rank]) == 2 * n_iters
        for i, g in enumerate(got[rank]):
            by_active = i < n_iters        # the first join: divided by the ranks still active
            k = i % n_iters
            active = WS if k < 3 else WS - 1
            want = 50.0 if by_active else 50.0 * active / WS
            np.testing.assert_allclose(g, np.full((5, 5), want, np.float32), rtol=1e-6,
                                       err_msg=f"rank {rank} iteration {i}")
