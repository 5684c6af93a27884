"""FSDP2 (fully_shard) on CPU over the "uccl" process group, against Gloo.

The same model, seeds and data are trained once with init_process_group("uccl")
and once with "gloo" in fresh jobs; the full parameters after training must
match (bitwise at 2 ranks, where a sum of two floats does not depend on order;
within 1e-6 relative at 3), must have changed, and must be the same on every
rank.  FSDP2 drives all_gather_into_tensor and reduce_scatter_tensor from
Python, so this exercises the underscore methods and the group name DeviceMesh
reads.
"""
from __future__ import annotations

import datetime

import numpy as np
import pytest

from test_collective import _launch

STEPS = 5


def _train(rank, ws, port, backend):
    import torch
    import torch.distributed as dist

    import uccl_collective  # noqa: F401  registers "uccl"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ws, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(),
                                torch.nn.Linear(40, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    initial = [p.detach().clone().numpy() for p in model.parameters()]
    # a CPU mesh: on a GPU machine FSDP2 would otherwise pick CUDA
    mesh = init_device_mesh("cpu", (ws,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randn(16, 24, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    final = [p.full_tensor().detach().clone().numpy() for p in model.parameters()]
    dist.destroy_process_group()
    return {"initial": initial, "final": final}


@pytest.mark.parametrize("ws", [2, 3])
def test_fsdp2_matches_gloo(ws):
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:  # torch older than 2.6
        pytest.skip(f"this torch has no FSDP2 fully_shard: {e}")
    got = _launch(_train, ws, timeout=120, backend="uccl")
    want = _launch(_train, ws, timeout=120, backend="gloo")
    for r in range(ws):
        for i, (a, b) in enumerate(zip(got[r]["final"], got[0]["final"])):
            assert a.tobytes() == b.tobytes(), f"rank {r} parameter {i} differs from rank 0's"
    changed = 0
    for i, (u, g, init) in enumerate(zip(got[0]["final"], want[0]["final"], got[0]["initial"])):
        assert u.shape == g.shape
        changed += int(not np.array_equal(u, init))
        if ws == 2:
            assert u.tobytes() == g.tobytes(), f"parameter {i}: uccl and gloo differ at 2 ranks"
        else:
            np.testing.assert_allclose(u, g, rtol=1e-6, atol=1e-7,
                                       err_msg=f"parameter {i}: uccl vs gloo")
    assert changed == len(got[0]["final"]), "training left some parameters unchanged"
