"""Endpoint metadata in every form upstream has used, and GPUs named by PCI
bus id (upstream's newer spelling).

Three forms of get_metadata() bytes are read:
- upstream 681068e4's 10 bytes: IPv4 address, port (network order), GPU
  index (native int32).  This engine writes it for an endpoint without a
  secret, since scripts of that generation unpack it themselves;
- upstream HEAD's: IPv4 (4 bytes) or IPv6 (16), port (network order), one
  length byte, then the GPU's PCI bus id ("0000:3b:00.0"; empty for none);
- this engine's 192 bytes, which also carry the job's secret.
parse_metadata() answers (ip, port, gpu): the GPU as an index for the first
and last, as a bus id string for HEAD's; connect() takes either.
"""
from __future__ import annotations

import ipaddress
import re
import struct
from typing import Any

from .. import _engine

# "dddd:bb:dd.f" (domain optional), as cuDeviceGetPCIBusId and nvidia-smi
# spell it; hex digits in either case.
_BDF = re.compile(r"^(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def _head_form(meta: bytes) -> tuple[str, int, str] | None:
    """HEAD's form, or None when meta is not one (its length byte must
    account for the whole blob, and the name must be a bus id)."""
    for ip_len in (4, 16):
        if len(meta) < ip_len + 3 or len(meta) != ip_len + 3 + meta[ip_len + 2]:
            continue
        bdf = meta[ip_len + 3:]
        try:
            name = bdf.decode("ascii")
        except UnicodeDecodeError:
            continue
        if name and not _BDF.match(name):
            continue
        ip = str(ipaddress.ip_address(bytes(meta[:ip_len])))
        (port,) = struct.unpack("!H", meta[ip_len:ip_len + 2])
        return ip, port, name
    return None


def parse_metadata(metadata: Any) -> tuple[str, int, Any]:
    """parse_metadata(metadata) -> (ip, port, gpu): gpu is an index (int) for
    681068e4's and this engine's forms, a PCI bus id (str) for HEAD's."""
    meta = bytes(metadata)
    # Never ambiguous: in the other forms the byte after the port is part of
    # a GPU index or of the secret form, and what would follow is no bus id.
    head = _head_form(meta)
    return head if head is not None else _engine.parse_metadata(meta)


def gpu_bus_id(index: int | None) -> str:
    """The PCI bus id of this host's CUDA device `index` ("" for None, a
    CPU-only endpoint, and where the driver has no such device)."""
    if index is None:
        return ""
    try:
        return _engine.gpu_bus_id(index)
    except (_engine.UcclError, ValueError):   # no driver; no such device
        return ""


def gpu_index(gpu: Any, port: int, what: str) -> int:
    """A peer's GPU as the index that picks its well-known port: an int as
    it is; a PCI bus id through this host's CUDA devices (right for a peer on
    this host or on one of the same layout), unless an explicit port makes
    the index moot."""
    if isinstance(gpu, str):
        if not _BDF.match(gpu):
            raise ValueError(f"{what}: {gpu!r} is not a PCI bus id (like '0000:3b:00.0')")
        try:
            return _engine.gpu_of_bus_id(gpu)
        except (_engine.UcclError, ValueError) as e:   # no driver; not a device here
            if port != -1:
                return 0
            raise ValueError(f"{what}: the GPU {gpu!r} is named by PCI bus id, and this host "
                             f"cannot turn it into an index ({e}); pass remote_port "
                             "(parse_metadata() returns it)") from None
    if isinstance(gpu, bool) or not isinstance(gpu, int):
        raise TypeError(f"{what}: the remote GPU must be an index (int) or a PCI bus id (str), "
                        f"got {type(gpu).__name__}")
    return gpu
