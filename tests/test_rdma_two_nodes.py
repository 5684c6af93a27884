"""Every dist.* op of the backend scenario (tests/_gpu_coll_worker.py: every
collective at every dtype, in place and not, unequal splits, send/recv,
DDP and FSDP2, checked against the Gloo group) on two "nodes" of two ranks
(ranks 0-1 and 2-3, each pair with a host id of its own) and CPU tensors,
with RDMA between the nodes: every rank loads the verbs emulator
(tests/ibv_emu) as its libibverbs, so each op's cross-node hop goes through
the engine's RDMA transport; the setup case checks "rdma" between the
nodes and shared memory inside one.  Runs on the CPU (CI); on a machine with
CUDA the scenario would move GPU tensors, which the emulator cannot reach,
so it skips there (test_gpu_collective.py's two-node case covers GPUs over
TCP)."""
from __future__ import annotations

import pytest

import _ibv_emu
import _gpu_coll_worker as CW
import test_gpu_collective as G


@pytest.mark.parametrize("case", CW.case_names("backend", 4, G._params()))
def test_every_op_across_two_nodes_over_rdma(case):
    if G.HAVE_CUDA:
        pytest.skip("the verbs emulator moves host memory only; with CUDA the scenario moves "
                    "GPU tensors (test_gpu_collective.py::test_backend_two_nodes, over TCP)")
    params = G._params(nodes=2, verbs=_ibv_emu.path())
    G.check(G.cached_run(("backend-nodes-rdma", 4), lambda: G.launch(
        "backend", 4, params=params, timeout=G.TIMEOUTS["backend"] * 2)), case, "setup")
