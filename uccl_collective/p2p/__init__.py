"""The p2p face: the UCCL P2P engine's Endpoint, for moving bytes between two
processes (connect/accept, send/recv, one-sided read/write with advertised
windows, upstream's descriptor and group APIs).  ``uccl_collective.p2p`` is
the public module; its pieces are _endpoint.py (Endpoint), _buffers.py (the
operation codes, buffer_of, current_stream), _xfer_api.py (descriptors and
grouped transfers), _ipc_api.py (upstream's same-host names), _metadata.py
(the endpoint's metadata) and _rendezvous.py (join_group).  It stands on the
C engine alone: modules here import only uccl_collective._engine, each other,
the standard library and numpy (torch only where a caller's tensor is
already there: current_stream reads it from sys.modules; join_group's
tcp:// and file:// stores import torch.distributed when used), never
uccl_collective.core or uccl_collective.backend."""
from .. import _engine
from .._engine import UcclError, UcclMismatchError, UcclTimeoutError, UcclUnknownIdError
from ._buffers import OP_READ, OP_RECV, OP_SEND, OP_WRITE, buffer_of, current_stream, get_oob_ip
from ._endpoint import Endpoint, FloatType
from ._xfer_api import XferDesc, XferHandle
# names the module has always had (the Endpoint's parts and helpers)
from ._ipc_api import IpcAPI  # noqa: F401
from ._metadata import gpu_bus_id, parse_metadata  # noqa: F401
from ._rendezvous import GroupAPI  # noqa: F401
from ._xfer_api import TransferAPI  # noqa: F401

__all__ = ["Endpoint", "FloatType", "UcclError", "UcclMismatchError", "UcclTimeoutError",
           "UcclUnknownIdError", "XferDesc", "XferHandle", "buffer_of", "current_stream",
           "get_oob_ip"]
