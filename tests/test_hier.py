"""all_reduce by node on the "uccl" backend (backend/_reduce.py
hier_allreduce, what UCCL_PG_ALGO=auto takes for CPU tensors where the
nodes are alike, and hier asks for): ranks on "nodes" of their own
(UCCL_NODE_ID: shared memory inside a node, TCP between, or RDMA over the
verbs emulator), CPU tensors.
Within each node a reduce-scatter, across the nodes an all_reduce of each
rank's chunk, then within each node an allgather.

Checked: random data of several sizes (above the small-tensor threshold,
odd lengths) and dtypes, SUM, MAX and PRODUCT, every rank's result against
the value the parent computes from the seeds (exact for integers, MIN/MAX
and small-integer floats; float sums within the bound of two orders of
reduction), the ranks bitwise alike, the route taken (counted in each
rank), and nodes of unequal sizes falling back to the flat algorithms with
the same results.  The CUDA path's form (_reduce_gpu._by_node) is driven on
CPU tensors through the same context calls."""
from __future__ import annotations

import os

import numpy as np
import pytest

import _ibv_emu
from _harness import run_ranks

SIZES = [(1 << 20) + 3, 3 * (1 << 20) + 1]   # elements: past the small-tensor path
CASES = [("float32", "SUM"), ("int64", "SUM"), ("float32", "MAX"), ("int32", "PRODUCT")]



def _count_calls(module, name: str) -> list:
    """Wrap module.name so that each call appends to the returned list (in
    the rank's process: which route an operation took)."""
    taken, orig = [], getattr(module, name)

    def counted(*a, **k):
        taken.append(1)
        return orig(*a, **k)
    setattr(module, name, counted)
    return taken

def _data(rank: int, n: int, dtype: str, op: str, salt: int) -> np.ndarray:
    g = np.random.default_rng(1000 * salt + rank)
    if op == "PRODUCT":   # -1, 1, 2: products stay exact in int32 at 4 ranks
        return g.choice(np.array([-1, 1, 2], dtype=dtype), n)
    if dtype.startswith("int"):
        return g.integers(-1000, 1000, n).astype(dtype)
    return g.standard_normal(n).astype(dtype)


def _rank(rank, ws, nodes, algo, verbs, path, q):
    """Runs in a spawned process (_harness.run_ranks)."""
    import faulthandler
    faulthandler.dump_traceback_later(150, exit=True)
    try:
        os.environ["UCCL_NODE_ID"] = f"hier-node-{nodes[rank]}"
        os.environ["UCCL_PG_ALGO"] = algo
        if verbs:   # the verbs emulator: RDMA between the nodes
            os.environ["UCCL_IBVERBS_LIB"] = verbs
        import datetime
        import hashlib

        import torch
        import torch.distributed as dist

        import uccl_collective  # noqa: F401 - registers "uccl"
        from uccl_collective.backend import _reduce
        taken = _count_calls(_reduce, "hier_allreduce")
        dist.init_process_group("uccl", store=dist.FileStore(path, ws), rank=rank, world_size=ws,
                                timeout=datetime.timedelta(seconds=60))
        out = {}
        for salt, (dtype, op) in enumerate(CASES):
            for n in SIZES:
                t = torch.from_numpy(_data(rank, n, dtype, op, salt))
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                out[(dtype, op, n)] = (hashlib.sha256(t.numpy().tobytes()).hexdigest(),
                                       t.numpy())
        ctx = dist.group.WORLD.context
        routes = {p: ctx.transport_to(p) for p in range(ws) if p != rank}
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, ({k: v[0] for k, v in out.items()},
                      {k: v[1] for k, v in out.items() if k[2] == SIZES[0]}, len(taken),
                      routes)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback
        q.put((rank, f"Error: {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _expected(ws: int, n: int, dtype: str, op: str, salt: int) -> np.ndarray:
    xs = [_data(r, n, dtype, op, salt) for r in range(ws)]
    if op == "SUM":
        return np.sum(np.stack(xs).astype(np.float64 if dtype == "float32" else dtype), axis=0)
    if op == "MAX":
        return np.max(np.stack(xs), axis=0)
    return np.prod(np.stack(xs), axis=0)


@pytest.mark.parametrize("nodes,algo,rdma", [((0, 0, 1, 1), "auto", False),
                                             ((0, 1, 0, 1), "hier", False),
                                             ((0, 0, 0, 1), "hier", False),
                                             ((0, 0, 1, 1), "direct", False),
                                             ((0, 0, 1, 1), "auto", True)],
                         ids=["2x2-auto", "2x2-interleaved-hier", "3+1-flat", "2x2-direct",
                              "2x2-rdma"])
def test_all_reduce_by_node(tmp_path, nodes, algo, rdma):
    """By node where the nodes are alike and UCCL_PG_ALGO is auto or hier;
    the flat algorithms where they are not (3 + 1) or another is asked
    for (direct): the same results either way.  Between nodes TCP, or RDMA
    over the verbs emulator (rdma); inside a node shared memory."""
    ws = len(nodes)
    verbs = _ibv_emu.path() if rdma else None
    res = run_ranks(_rank, ws, (nodes, algo, verbs, str(tmp_path / "store")), timeout=240)
    equal = len({nodes.count(x) for x in nodes}) == 1 and algo in ("auto", "hier")
    for r in range(ws):
        digests, small, taken, routes = res[r]
        for p, route in routes.items():
            want = "shm" if nodes[p] == nodes[r] else "rdma" if rdma else "tcp"
            assert route.startswith(want), (r, p, route)
        # the route: one by-node all_reduce per call where the nodes are alike, else none
        assert taken == (len(CASES) * len(SIZES) if equal else 0), (r, taken)
        assert digests == res[0][0], f"rank {r}'s results differ from rank 0's"
        for salt, (dtype, op) in enumerate(CASES):
            got = small[(dtype, op, SIZES[0])]
            want = _expected(ws, SIZES[0], dtype, op, salt)
            if dtype == "float32" and op == "SUM":   # two orders of 4 float32 sums
                bound = 2 * ws * 2.0 ** -24 * np.sum(np.abs(np.stack(
                    [_data(q, SIZES[0], dtype, op, salt) for q in range(ws)])), axis=0)
                assert np.all(np.abs(got.astype(np.float64) - want) <= bound), (r, dtype, op)
            else:
                assert np.array_equal(got, want.astype(dtype)), (r, dtype, op)


def _gpu_form_rank(rank, ws, nodes, path, q):
    """The CUDA path's by-node all_reduce (_reduce_gpu._by_node), driven on
    CPU tensors through the same context calls (runs in a spawned process)."""
    import faulthandler
    faulthandler.dump_traceback_later(150, exit=True)
    try:
        os.environ["UCCL_NODE_ID"] = f"hier-gpu-node-{nodes[rank]}"
        import datetime

        import torch
        import torch.distributed as dist

        from uccl_collective.backend import _reduce_gpu
        from uccl_collective.collective import CollectiveContext
        taken = _count_calls(_reduce_gpu, "_by_node")
        dist.init_process_group("gloo", store=dist.FileStore(path, ws), rank=rank, world_size=ws,
                                timeout=datetime.timedelta(seconds=60))
        ctx = CollectiveContext(use_copy_engine_for_intra=True, timeout_s=30).init()
        bufs: dict = {}

        def scratch(nb):
            if bufs.get("s") is None or bufs["s"].numel() < nb:
                bufs["s"] = torch.empty(nb, dtype=torch.uint8)
            return bufs["s"][:nb]
        out = {}
        for salt, (dtype, op) in enumerate(CASES):
            for n in SIZES:
                t = torch.from_numpy(_data(rank, n, dtype, op, salt))
                _reduce_gpu.allreduce(ctx, t, getattr(dist.ReduceOp.RedOpType, op), scratch)
                out[(dtype, op, n)] = t.numpy()
        ctx.finalize()
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, ({k: v for k, v in out.items() if k[2] == SIZES[0]}, len(taken))))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback
        q.put((rank, f"Error: {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def test_the_cuda_path_by_node_on_cpu_tensors(tmp_path):
    """The CUDA path's form (_reduce_gpu: one exchange and one reduction a
    phase, the messages through the context) takes nodes alike by node too;
    driven here on CPU tensors (the context moves them the same way), 2 x 2:
    the route counted, every result against the parent's."""
    nodes = (0, 0, 1, 1)
    res = run_ranks(_gpu_form_rank, 4, (nodes, str(tmp_path / "store")), timeout=240)
    for r in range(4):
        small, taken = res[r]
        assert taken == len(CASES) * len(SIZES), (r, taken)
        for salt, (dtype, op) in enumerate(CASES):
            got, want = small[(dtype, op, SIZES[0])], _expected(4, SIZES[0], dtype, op, salt)
            if dtype == "float32" and op == "SUM":
                bound = 2 * 4 * 2.0 ** -24 * np.sum(np.abs(np.stack(
                    [_data(q, SIZES[0], dtype, op, salt) for q in range(4)])), axis=0)
                assert np.all(np.abs(got.astype(np.float64) - want) <= bound), (r, dtype, op)
            else:
                assert np.array_equal(got, want.astype(dtype)), (r, dtype, op)
