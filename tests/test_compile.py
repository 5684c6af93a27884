"""torch.compile with the "uccl" backend (core/not_traced.py): a compiled
DDP model, and a compiled FSDP2 model, train bit for bit as the same
compiled models on Gloo (dynamo
used to fail hard on the backend's Python frames, which DDP's reducer
calls at a graph break); a compiled function that calls dist.all_reduce
gives the sum; and the package goes on dynamo's skip list only once dynamo
is imported (importing it costs about a second).  The same on CUDA tensors,
a GPU per rank, against NCCL where the machine has 2 GPUs (their
operations are stream-ordered there: no record_stream in what dynamo
traces)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np

import pytest

from _harness import run_ranks

DEVICES = ("cpu", "cuda")


def _skip_cuda(device: str) -> None:
    import torch
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"CUDA tensors a GPU per rank need 2 GPUs; this host has "
                    f"{torch.cuda.device_count()} (torch {torch.__version__})")


def _rank(rank, ws, backend, path, device, q):
    """Runs in a spawned process (_harness.run_ranks)."""
    import faulthandler
    faulthandler.dump_traceback_later(240, exit=True)   # a hang names its stack
    try:
        import torch
        import torch.distributed as dist

        import uccl_collective  # noqa: F401 - registers "uccl"
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=dist.FileStore(path, ws), rank=rank,
                                world_size=ws)
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).to(device)
        model = torch.compile(torch.nn.parallel.DistributedDataParallel(m))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):   # the reducer rebuilds its buckets after the first
            model(torch.randn(8, 16, generator=g).to(device)).sum().backward()
            opt.step()
            opt.zero_grad()

        @torch.compile
        def scaled_sum(x):
            y = x * 2
            dist.all_reduce(y)
            return y + 1
        x = torch.from_numpy(np.random.default_rng(7 + rank).integers(-1000, 1000, 33)).float()
        got = scaled_sum(x.to(device)).cpu()
        dist.barrier()
        params = [p.detach().cpu().numpy().copy() for p in m.parameters()]
        dist.destroy_process_group()
        q.put((rank, (params, got.numpy().copy())))
    except BaseException as e:  # noqa: BLE001
        q.put((rank, f"{type(e).__name__}: {e}"))


def _job(tmp_path, backend, device, ws=2):
    return run_ranks(_rank, ws, (backend, str(tmp_path / backend), device), timeout=300)


def _reference(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_ddp_and_a_compiled_all_reduce_match_gloo(tmp_path, device):
    """On CUDA the reference is NCCL (two ranks: a sum of two is the same
    whatever the order, so bit for bit)."""
    _skip_cuda(device)
    uccl, gloo = _job(tmp_path, "uccl", device), _job(tmp_path, _reference(device), device)
    xs = [np.random.default_rng(7 + r).integers(-1000, 1000, 33).astype(np.float32)
          for r in range(2)]
    want = sum(x * 2 for x in xs) + 1
    for r in range(2):
        for i, (a, b) in enumerate(zip(uccl[r][0], gloo[r][0])):
            assert np.array_equal(a, b), \
                f"rank {r}: parameter {i} differs from {_reference(device)}'s"
        assert np.array_equal(uccl[r][1], want), (r, uccl[r][1], want)
    # and DDP kept the ranks' models equal
    for a, b in zip(uccl[0][0], uccl[1][0]):
        assert np.array_equal(a, b)


def _fsdp_rank(rank, ws, backend, path, device, q):
    """A compiled FSDP2 model (fully_shard per layer and at the root) on
    `backend`; its full parameters after three steps."""
    import faulthandler
    faulthandler.dump_traceback_later(240, exit=True)
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        import uccl_collective  # noqa: F401 - registers "uccl"
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=dist.FileStore(path, ws), rank=rank,
                                world_size=ws)
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).to(device)
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(m)
        compiled = torch.compile(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            compiled(torch.randn(8, 16, generator=g).to(device)).sum().backward()
            opt.step()
            opt.zero_grad()
        full = [p.full_tensor().detach().cpu().numpy().copy() for p in m.parameters()]
        dist.destroy_process_group()
        q.put((rank, full))
    except BaseException as e:  # noqa: BLE001
        q.put((rank, f"{type(e).__name__}: {e}"))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_fsdp2_matches_gloo(tmp_path, device):
    _skip_cuda(device)
    ref = _reference(device)
    uccl = run_ranks(_fsdp_rank, 2, ("uccl", str(tmp_path / "fsdp_uccl"), device), timeout=300)
    gloo = run_ranks(_fsdp_rank, 2, (ref, str(tmp_path / f"fsdp_{ref}"), device), timeout=300)
    for r in range(2):
        for i, (a, b) in enumerate(zip(uccl[r], gloo[r])):
            assert np.array_equal(a, b), f"rank {r}: parameter {i} differs from {ref}'s"
        for a, b in zip(uccl[r], uccl[0]):   # the ranks' models are one model
            assert np.array_equal(a, b)


def _fresh(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip()


def test_the_skip_list_waits_for_dynamo_and_then_holds_the_package():
    out = _fresh(
        "import sys, os, uccl_collective\n"
        "print('loaded' if 'torch._dynamo.trace_rules' in sys.modules else 'not loaded')\n"
        "import torch._dynamo.trace_rules as tr\n"
        "d = os.path.dirname(uccl_collective.__file__)\n"
        "print(any(s.rstrip('/') == d for s in tr.SKIP_DIRS), bool(tr.SKIP_DIRS_RE.match("
        "uccl_collective.backend.process_group.__file__)))\n")
    assert out.splitlines() == ["not loaded", "True True"], out


def test_dynamo_loaded_first_is_covered_too():
    out = _fresh(
        "import os, torch._dynamo.trace_rules as tr, uccl_collective\n"
        "d = os.path.dirname(uccl_collective.__file__)\n"
        "print(sum(s.rstrip('/') == d for s in tr.SKIP_DIRS))\n"
        "from uccl_collective.core import not_traced; not_traced.install()\n"
        "print(sum(s.rstrip('/') == d for s in tr.SKIP_DIRS))\n")
    assert out.splitlines() == ["1", "1"], out
