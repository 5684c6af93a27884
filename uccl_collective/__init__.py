"""uccl-collective: point-to-point transfers and collectives for PyTorch.

The engine is C (uccl_collective._engine, csrc/); the package adds the
Python API in three parts, one folder each:
- p2p/: uccl_collective.p2p.Endpoint, the UCCL P2P engine's API;
- core/: the collectives over endpoints: CollectiveContext (public as
  uccl_collective.collective), GPU rings (uccl_collective.gpu_ring), the
  stream-ordered groups, and the dispatch that chooses each call's route;
- backend/: the torch.distributed backend "uccl", registered on import.
p2p stands on the engine alone, core on p2p, backend on core.
"""
from . import collective, gpu_ring, p2p  # noqa: F401 (the public modules)
from ._engine import UcclError, UcclMismatchError, UcclTimeoutError, UcclUnknownIdError
from .backend import register as _register_backend
from .core import not_traced as _not_traced

_register_backend()  # torch.distributed.init_process_group("uccl")
_not_traced.install()  # torch.compile runs this package's frames as they are

__all__ = ["UcclError", "UcclMismatchError", "UcclTimeoutError", "UcclUnknownIdError"]
__version__ = "0.1.0"
