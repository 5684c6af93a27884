"""uccl-collective: point-to-point transfers and collectives for PyTorch.

The engine is C (uccl_collective._engine); this package adds the Python API:
- uccl_collective.p2p.Endpoint: the UCCL P2P engine's API.
- uccl_collective.collective: CollectiveContext (send/recv, allgather, ring).
- the torch.distributed backend "uccl", registered on import.
"""
from ._engine import UcclError, UcclTimeoutError, UcclUnknownIdError
from .backend import register as _register_backend

_register_backend()  # torch.distributed.init_process_group("uccl")

__all__ = ["UcclError", "UcclTimeoutError", "UcclUnknownIdError"]
__version__ = "0.1.0"
