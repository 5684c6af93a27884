"""What every transfer call of the Endpoint takes: the operation codes, a
buffer's (address, nbytes), and the CUDA stream a transfer is ordered after.
Shared by the Endpoint (_endpoint.py) and its one-sided API (_xfer_api.py);
it imports only the engine."""
from __future__ import annotations

import sys
from typing import Any

from .. import _engine

#: get_oob_ip() -> str: the IPv4 address endpoints put in their metadata
#: (UCCL_SOCKET_IFNAME, else the first interface that is up, not loopback).
get_oob_ip = _engine.get_oob_ip

OP_SEND = _engine.OP_SEND
# A recv's size is a capacity, as upstream's: a shorter message is taken
# (nothing lands past it; received_bytes(id) tells how much came).
OP_RECV = _engine.OP_RECV | _engine.XFER_CAPACITY
OP_WRITE, OP_READ = _engine.OP_WRITE, _engine.OP_READ


def buffer_of(obj: Any) -> tuple[int, int]:
    """(address, nbytes) of a contiguous torch tensor or numpy array."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):  # torch.Tensor
        if not obj.is_contiguous():
            raise ValueError(
                f"tensor is not contiguous (shape={tuple(obj.shape)}, stride={tuple(obj.stride())}); "
                "call .contiguous() first")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size())
    if hasattr(obj, "__array_interface__"):  # numpy.ndarray and friends
        if not obj.flags["C_CONTIGUOUS"]:
            raise ValueError(
                f"array is not C-contiguous (shape={obj.shape}, strides={obj.strides}); "
                "use numpy.ascontiguousarray first")
        if not obj.flags["WRITEABLE"]:
            raise ValueError("array is read-only; the engine needs writable memory")
        return int(obj.__array_interface__["data"][0]), int(obj.nbytes)
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(obj).__name__}")


def current_stream() -> int:
    """torch's current CUDA stream on the current device, as an integer.

    Transfers of GPU memory are ordered after it, as NCCL's are: they start
    once the work queued there before the call is done, and are complete
    for any work queued after they finish.  0 (the legacy default stream)
    where torch has not initialised CUDA; host memory ignores it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    try:
        return int(torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice()))
    except AttributeError:  # private names moved: the public way, slower
        return int(torch.cuda.current_stream().cuda_stream)
