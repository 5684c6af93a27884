"""The torch backend face: the torch.distributed backend "uccl"
(``init_process_group("uccl")``, registered by ``import uccl_collective``).
process_group.py is ProcessGroupUCCL, which adapts torch's API (argument
checks, shapes, Works) and hands every call to its core.dispatch.Dispatch;
_work.py holds the runner that orders a group's tasks and the Works;
_algorithms.py what a task does (with _reduce.py, _reduce_gpu.py and
_sparse.py for the reductions); _anysource.py the send/recv channel with
receive from any source; _barrier.py monitored_barrier; _profiling.py the
profiler's events.  Modules here import uccl_collective.core, the p2p face,
the engine, torch and each other; nothing below imports them."""
from .process_group import BACKEND_NAME, ProcessGroupUCCL, register

__all__ = ["BACKEND_NAME", "ProcessGroupUCCL", "register"]
