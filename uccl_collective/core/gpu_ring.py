"""GPU-initiated transfers: a command ring that GPU kernels enqueue puts on,
drained by a proxy thread of the engine (csrc/ring/ring.c).

A kernel enqueues with the device functions of ``include/uccl_ring.cuh``
(``uccl_ring_put``, ``uccl_ring_try_put``, ``uccl_ring_wait``); the proxy
issues each command on the endpoint's transports (the copy engine through
CUDA IPC for a process on this host, TCP or RDMA for another host, the
copy engine alone for a local destination) and counts completions in
sequence.  Kernels are compiled at run time with NVRTC, which torch's CUDA
wheels ship, so nothing here needs a CUDA toolkit::

    ring = GpuRing(ep, src_tensor, [dst_tensor])          # or CollectiveContext.gpu_ring
    k = Kernel(r'''#include "uccl_ring.cuh"
        extern "C" __global__ void go(const uccl_ring_dev *r, unsigned long long n) {
            unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) uccl_ring_wait(r, uccl_ring_put(r, 0, i * 4096, i * 4096, 4096));
        }''', "go")
    k.launch(grid=1, block=64, args=(ring, 64))            # on torch's current stream
    ring.wait(64)

The same header works from CuPy (``cupy.RawKernel(src, name,
options=("-I" + include_dir(),))``) and any other CUDA C++ compiler; pass
``ring.device_ptr`` as a 64-bit pointer argument.
"""
from __future__ import annotations

import glob
import os
import pathlib
import struct
import sys
from collections import namedtuple
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from .. import _engine

HEADER_NAME = "uccl_ring.cuh"
# at the package's top (uccl_collective/include/), where users look for it
HEADER_PATH = pathlib.Path(__file__).parent.parent / "include" / HEADER_NAME

# GPU-side return codes (uccl_ring.cuh)
EFAILED, ETIMEOUT, EFULL, EINVAL = -1, -2, -3, -4

Counters = namedtuple("Counters", "tickets taken done error")


def include_dir() -> str:
    """The directory holding uccl_ring.cuh (for -I with other compilers)."""
    return str(HEADER_PATH.parent)


def device_header() -> str:
    return HEADER_PATH.read_text()


def find_nvrtc() -> str | None:
    """libnvrtc of torch's CUDA wheel (nvidia/cuda_nvrtc/lib for CUDA 12,
    nvidia/cu13/lib for CUDA 13), or None; UCCL_NVRTC_LIB overrides it."""
    roots = [p for p in sys.path if p and os.path.isdir(p)]
    pats = ("nvidia/cuda_nvrtc/lib/libnvrtc.so*", "nvidia/cu*/lib/libnvrtc.so*",
            "torch/lib/libnvrtc*.so*")
    for root in roots:
        for pat in pats:
            hits = sorted(h for h in glob.glob(os.path.join(root, pat)) if "builtins" not in h
                          and "alt" not in os.path.basename(h))
            if hits:
                return hits[-1]
    return None


_nvrtc_named = False


def _name_nvrtc() -> None:
    global _nvrtc_named
    if not _nvrtc_named:
        path = find_nvrtc()
        if path:
            _engine.nvrtc_set_path(path)
        _nvrtc_named = True


def _device_index(device: Any) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {d}")
    return d.index if d.index is not None else torch.cuda.current_device()


def _stream_handle(stream: Any, dev: int) -> int:
    if stream is None:
        return torch.cuda.current_stream(dev).cuda_stream
    if isinstance(stream, int):
        return stream
    return int(getattr(stream, "cuda_stream", stream))


def _pack_args(args: Iterable[Any]) -> tuple[bytes, list[tuple[int, int]]]:
    """Kernel parameters packed at their natural alignment, and each one's
    (offset, size): tensors and rings as 64-bit pointers, Python ints as
    64-bit integers, floats as double, numpy scalars as their own type.  The
    engine checks the sizes against the kernel's parameters where the driver
    tells them (CUDA 12.4)."""
    buf, offs = bytearray(), []
    for i, a in enumerate(args):
        if hasattr(a, "data_ptr"):
            raw = struct.pack("<Q", int(a.data_ptr()))
        elif isinstance(a, GpuRing):
            raw = struct.pack("<Q", a.device_ptr)
        elif isinstance(a, np.generic):
            raw = a.tobytes()
        elif isinstance(a, bool):
            raise TypeError(f"kernel argument {i}: pass a bool as numpy.int32 or numpy.bool_")
        elif isinstance(a, int):
            if not -(1 << 63) <= a < (1 << 64):
                raise ValueError(f"kernel argument {i}: {a} does not fit 64 bits")
            raw = struct.pack("<q" if a < 0 else "<Q", a)
        elif isinstance(a, float):
            raw = struct.pack("<d", a)
        else:
            raise TypeError(f"kernel argument {i}: {type(a).__name__} is not a tensor, ring, "
                            "int, float or numpy scalar")
        align = min(len(raw), 8)
        buf += b"\0" * (-len(buf) % align)
        offs.append((len(buf), len(raw)))
        buf += raw
    return bytes(buf or b"\0"), offs


def _dims(v: Any, what: str) -> tuple[int, int, int]:
    t = (v,) if isinstance(v, int) else tuple(v)
    if not 1 <= len(t) <= 3 or not all(isinstance(x, int) and x >= 1 for x in t):
        raise ValueError(f"{what} must be 1 to 3 positive ints, got {v!r}")
    return (t + (1, 1))[:3]


class Kernel:
    """A CUDA C++ kernel compiled at run time (NVRTC) for one device; its
    source may #include "uccl_ring.cuh".  Declare the kernel extern "C"."""

    def __init__(self, source: str, name: str, device: Any = None,
                 options: Sequence[str] = ()):
        self.device = _device_index(device)
        self.name = name
        _name_nvrtc()
        self._k = _engine.gpu_compile(self.device, source, name,
                                      [(HEADER_NAME, device_header())], list(options))

    def launch(self, grid: Any, block: Any, args: Sequence[Any] = (), *, stream: Any = None,
               shared_mem: int = 0) -> None:
        """Queue the kernel on `stream` (default: torch's current stream)."""
        params, offs = _pack_args(args)
        _engine.gpu_launch(self._k, _dims(grid, "grid"), _dims(block, "block"), shared_mem,
                           _stream_handle(stream, self.device), params, offs)


# Our own kernel, for benchmarks and as an example: thread i of n enqueues
# put i (source and destination offsets cycle through size-byte slots),
# then waits for its last command if `wait`; the first error code lands in
# status[0], the highest sequence number in status[1].
BATCH_SOURCE = r'''
#include "uccl_ring.cuh"
extern "C" __global__ void uccl_ring_batch_puts(
    const uccl_ring_dev *r, unsigned long long n, unsigned int dst, unsigned long long size,
    unsigned long long src_slots, unsigned long long dst_slots, int wait, long long *status)
{
    long long last = -1;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < n; i += (unsigned long long)gridDim.x * blockDim.x) {
        long long s = uccl_ring_put(r, dst, (i % src_slots) * size, (i % dst_slots) * size, size);
        if (s < 0) {
            atomicCAS((unsigned long long *)&status[0], 0ULL, (unsigned long long)s);
            return;
        }
        last = s;
    }
    if (last >= 0) {
        atomicMax(&status[1], last);
        if (wait) {
            int rc = uccl_ring_wait(r, last);
            if (rc)
                atomicCAS((unsigned long long *)&status[0], 0ULL, (unsigned long long)(long long)rc);
        }
    }
}
'''
_batch_kernels: dict[int, Kernel] = {}


def batch_kernel(device: int) -> Kernel:
    k = _batch_kernels.get(device)
    if k is None:
        k = _batch_kernels[device] = Kernel(BATCH_SOURCE, "uccl_ring_batch_puts", device)
    return k


class Remote(namedtuple("Remote", "conn_id fifo_item")):
    """A destination on a peer: its window's descriptor (what advertise()
    gave it) and the connection to reach it on."""


HOST = -1   # the device of a HostRing (ring.h, UCCL_RING_HOST)
RingStats = namedtuple("RingStats", "taken posts")


def _buf(x: Any, what: str) -> tuple[int, int]:
    if hasattr(x, "data_ptr"):
        if not x.is_contiguous():
            raise ValueError(f"{what}: the tensor is not contiguous")
        return int(x.data_ptr()), int(x.numel() * x.element_size())
    if isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(v, int) for v in x):
        return int(x[0]), int(x[1])
    raise TypeError(f"{what}: expected a tensor or (ptr, size), got {type(x).__name__}")


class GpuRing:
    """A command ring for GPU kernels, drained by a proxy thread of `endpoint`.

    source: the region every command copies from (a CUDA tensor, or
    (ptr, size)); registered with the endpoint here.  destinations: per
    index, a Remote(conn_id, fifo_item) (a peer's advertised window) or
    local memory (a tensor, or (ptr, size)).  slots: the ring's size (a power
    of two); inflight: commands the proxy keeps in flight at once.  trace: keep
    the first `trace` sequence numbers issued (tests).  paused: start without
    draining (resume())."""

    def __init__(self, endpoint: Any, source: Any, destinations: Sequence[Any], *,
                 slots: int = 1024, inflight: int = 64, device: Any = None, trace: int = 0,
                 paused: bool = False):
        sptr, slen = _buf(source, "GpuRing source")
        if device is None and hasattr(source, "is_cuda"):
            if not source.is_cuda:
                raise ValueError("GpuRing: the source tensor must be on a GPU (the kernels "
                                 "that enqueue write it)")
            device = source.device
        self.device = HOST if device == HOST else _device_index(device)
        dsts, self.dst_sizes = [], []
        for i, d in enumerate(destinations):
            if isinstance(d, Remote):
                fields = _engine.fifo_fields(bytes(d.fifo_item))
                dsts.append(("remote", int(d.conn_id), bytes(d.fifo_item)))
                self.dst_sizes.append(int(fields[3]))
            else:
                p, n = _buf(d, f"GpuRing destination {i}")
                dsts.append(("local", p, n))
                self.dst_sizes.append(n)
        self.endpoint = endpoint
        self.source_size = slen
        # the memory stays the ring's: the proxy reads and writes it until close()
        self._keep = (source, list(destinations))
        self._mr = endpoint.reg(sptr, slen)[1]
        try:
            self._ring = _engine.GpuRing(endpoint, self.device, slots, inflight, self._mr, sptr,
                                         slen, dsts, trace, paused)
        except BaseException:
            endpoint.dereg(self._mr)
            raise

    def _r(self):
        ring = getattr(self, "_ring", None)
        if ring is None:
            raise ValueError("the GPU ring is closed")
        return ring

    @property
    def device_ptr(self) -> int:
        """The device address of the ring (a `const uccl_ring_dev *`)."""
        return self._r().device_ptr

    def counters(self) -> Counters:
        """(tickets handed out, commands taken, done, error: 0 or 1 + the
        sequence number of the first command that failed)."""
        return Counters(*self._r().counters())

    @property
    def done(self) -> int:
        return self._r().counters()[2]

    def wait(self, count: int, timeout: float | None = None) -> bool:
        """Block until `count` commands are complete; raises UcclError if the
        ring failed before them, UcclTimeoutError after `timeout` seconds."""
        return self._r().wait(int(count), timeout)

    def error(self) -> str:
        return self._r().error()

    def pause(self) -> None:
        self._r().pause()

    def resume(self) -> None:
        self._r().resume()

    def trace(self) -> list[int]:
        return self._r().trace()

    def stats(self) -> RingStats:
        """(commands taken, transfers and copies the proxy started for
        them: fewer where it wrote consecutive puts as one,
        UCCL_RING_BATCH_BYTES)."""
        return RingStats(*self._r().stats())

    def launch_puts(self, n: int, size: int, *, dst: int = 0, wait: bool = True,
                    threads: int = 256, blocks: int | None = None, stream: Any = None):
        """Our own kernel: n threads each enqueue one put of `size` bytes to
        destination dst (offsets cycle through size-byte slots of the source
        and of the destination), then wait for completion on the GPU if
        `wait`.  Returns a device int64 tensor [first error code, highest
        sequence number], filled as the kernel runs."""
        if not 0 <= dst < len(self.dst_sizes):
            raise ValueError(f"launch_puts: destination {dst} of {len(self.dst_sizes)}")
        if size <= 0 or size > self.source_size or size > self.dst_sizes[dst]:
            raise ValueError(f"launch_puts: size {size} must be in 1..min(source "
                             f"{self.source_size}, destination {self.dst_sizes[dst]})")
        status = torch.tensor([0, -1], dtype=torch.int64, device=f"cuda:{self.device}")
        if n > 0:
            blocks = blocks or max(1, min((n + threads - 1) // threads, 1024))
            batch_kernel(self.device).launch(
                blocks, threads, (self, n, _u32(dst), size, self.source_size // size,
                                  self.dst_sizes[dst] // size, _i32(1 if wait else 0), status),
                stream=stream)
        return status

    def close(self) -> None:
        """Stop the proxy once what it took has finished; no kernel may use
        the ring afterwards."""
        ring, self._ring = getattr(self, "_ring", None), None
        if ring is not None:
            ring.close()
            try:
                self.endpoint.dereg(self._mr)
            except Exception:  # the endpoint may be closed already
                pass
            self._keep = None

    def __enter__(self) -> "GpuRing":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _u32(v: int):
    return np.uint32(v)


def _i32(v: int):
    return np.int32(v)


class HostRing(GpuRing):
    """A ring that host threads fill (put()), drained by the same proxy
    as a GPU's ring, with the same checks, order, batching and failures:
    the proxy's behaviour and its cost per command without a GPU (tests,
    benchmarks/ring_proxy.py).  The source and local destinations are host
    memory (a CPU tensor, or (ptr, size)); destinations as GpuRing's."""

    def __init__(self, endpoint: Any, source: Any, destinations: Sequence[Any], *,
                 slots: int = 1024, inflight: int = 64, trace: int = 0, paused: bool = False):
        if getattr(source, "is_cuda", False):
            raise ValueError("HostRing: the source must be host memory; a GPU's ring is "
                             "GpuRing, filled by its kernels")
        super().__init__(endpoint, source, destinations, slots=slots, inflight=inflight,
                         device=HOST, trace=trace, paused=paused)

    def put(self, dst: int, src_off: int, dst_off: int, length: int) -> int:
        """Enqueue a put of `length` bytes from the source at src_off to
        destination dst at dst_off, as a kernel's uccl_ring_put does (waits
        while the ring is full, up to the endpoint's timeout); returns its
        sequence number.  The proxy checks it: a bad one fails the ring
        there (wait() raises naming it)."""
        return self._r().put(int(dst), int(src_off), int(dst_off), int(length))

    def puts(self, dst: int, table: Any) -> int:
        """put() for every row of table (n x 3 integers: src_off, dst_off,
        length), in one call with the GIL let go, as many kernel threads
        would; returns the first one's sequence number (the rest follow)."""
        rows = np.ascontiguousarray(table, dtype=np.uint64)
        if rows.ndim != 2 or rows.shape[1] != 3:
            raise ValueError(f"puts: the table must be n x 3 (src_off, dst_off, length), "
                             f"got shape {rows.shape}")
        return self._r().puts(int(dst), rows.tobytes())
