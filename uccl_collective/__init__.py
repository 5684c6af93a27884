"""uccl-collective: point-to-point transfers and collectives for PyTorch.

The engine is C (uccl_collective._engine); this package adds the Python API:
- uccl_collective.p2p.Endpoint: the UCCL P2P engine's API.
"""
from ._engine import UcclError, UcclTimeoutError

__all__ = ["UcclError", "UcclTimeoutError"]
__version__ = "0.1.0"
