"""The UCCL P2P engine's Endpoint API over the C engine.

Raw-pointer methods keep upstream's names and return shapes (``(success, ...)``
tuples) but raise instead of returning False: ValueError/TypeError for the
caller's mistakes, UcclError for failed transfers, UcclTimeoutError when a
deadline passes.  The ``*_tensor`` helpers take torch tensors or numpy arrays.

Connections are one-way, as upstream: the side that calls connect() sends,
reads and writes; the side that accepts receives and advertises.
"""
from __future__ import annotations

import atexit
import enum
import weakref
from typing import Any, Sequence

from .. import _engine
from ._buffers import OP_READ, OP_RECV, OP_SEND, OP_WRITE, buffer_of, current_stream
from ._ipc_api import IpcAPI
from ._metadata import gpu_bus_id, gpu_index as _gpu_index, parse_metadata
from ._rendezvous import GroupAPI
from ._xfer_api import TransferAPI


class FloatType(enum.IntEnum):
    """Upstream's element types of a registration (``reg(ptr, size,
    floatType=...)``), which upstream uses to compress floating-point data
    on the wire (DietGPU).  Accepted and checked here, so upstream code runs
    unchanged, but nothing is compressed: every transfer moves the bytes as
    they are."""
    kUndefined = 0
    kFloat16 = 1
    kBFloat16 = 2
    kFloat32 = 3
    kFloat8E4M3FN = 4  # upstream HEAD's
    kFloat8E5M2 = 5


def _float_type(value: Any, what: str) -> FloatType:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what}: floatType must be a p2p.FloatType, got "
                        f"{type(value).__name__} {value!r}")
    try:
        return FloatType(value)
    except ValueError:
        known = ", ".join(f"{m.name}={m.value}" for m in FloatType)
        raise ValueError(f"{what}: floatType {value} is not a FloatType ({known})") from None


def _lists(name: str, num_iovs: int, *lists: Sequence) -> None:
    if num_iovs < 0:
        raise ValueError(f"{name}: num_iovs must be >= 0, got {num_iovs}")
    for lst in lists:
        if len(lst) != num_iovs:
            raise ValueError(f"{name}: num_iovs={num_iovs} but a list has {len(lst)} entries")


# Endpoints still open at interpreter exit are closed first, so their peers
# hear a clean BYE instead of a reset (and log nothing alarming).
_live: "weakref.WeakSet[Endpoint]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for ep in list(_live):
        ep.close()


class Endpoint(IpcAPI, TransferAPI, GroupAPI, _engine.Endpoint):
    """Endpoint(local_gpu_idx=None, num_cpus=4, *, timeout_s=None, secret=None, port=-1)

    local_gpu_idx=None means CPU only.  timeout_s bounds every blocking call
    (default UCCL_P2P_TIMEOUT_S or 300 s).  secret (or UCCL_P2P_SECRET) must be
    presented by every peer that connects here.  port=-1 tries the well-known
    port (UCCL_P2P_BASE_PORT + gpu index) first, so that connect(ip, gpu) finds
    it, then any free port; port=0 takes any free port.
    """

    parse_metadata = staticmethod(parse_metadata)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._local_gpu = args[0] if args else kwargs.get("local_gpu_idx")
        _live.add(self)

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- connections ------------------------------------------------------
    def connect(self, remote_ip_addr: str, remote_gpu_idx: Any = 0, remote_port: int = -1,
                rank: int = -1, secret: Any = None, *, remote_gpu_bdf: Any = None,
                remote_gpu: Any = None):
        """connect(remote_ip_addr, remote_gpu_idx=0, remote_port=-1) -> (True, conn_id).
        The peer's GPU may be named by index or, as upstream's newer API
        does, by PCI bus id (remote_gpu_bdf="0000:3b:00.0", or remote_gpu=);
        it only picks the peer's well-known port (UCCL_P2P_BASE_PORT + index)
        when remote_port is -1, and a bus id does so only when it names a GPU
        of this host (a peer on this host, or one laid out the same)."""
        named = [g for g in (remote_gpu_bdf, remote_gpu) if g is not None]
        if len(named) > 1:
            raise TypeError("connect: name the remote GPU once (remote_gpu_bdf or remote_gpu)")
        gpu = named[0] if named else remote_gpu_idx
        return super().connect(remote_ip_addr, _gpu_index(gpu, remote_port, "connect"),
                               remote_port, rank, secret)

    def connect_local(self, remote_gpu_idx: Any = 0, remote_port: int = -1, *,
                      remote_gpu_bdf: Any = None):
        """Same-host form of connect()."""
        return self.connect("127.0.0.1", remote_gpu_idx, remote_port,
                            remote_gpu_bdf=remote_gpu_bdf)

    def get_endpoint_metadata(self) -> bytes:
        """Upstream's older name of get_metadata()."""
        return self.get_metadata()

    @property
    def gpu_bdf(self) -> str:
        """This endpoint's GPU by PCI bus id ("" when CPU only, or where the
        CUDA driver has no such device)."""
        return gpu_bus_id(self._local_gpu)

    def accept_local(self, timeout: float | None = None):
        """Same-host form of accept(); returns (success, remote_gpu, conn_id):
        the peer's GPU as the index its handshake gave (upstream HEAD gives a
        PCI bus id; both are accepted wherever a GPU is named)."""
        ok, _ip, gpu, conn_id = self.accept(timeout)
        return ok, gpu, conn_id

    # -- memory ------------------------------------------------------------
    def reg(self, ptr: int, size: int, floatType: Any = FloatType.kUndefined):
        """reg(ptr, size, floatType=FloatType.kUndefined) -> (True, mr_id).
        floatType is upstream's compression hint: checked, not used."""
        _float_type(floatType, "reg")
        return super().reg(ptr, size)

    def regv(self, ptrs: Sequence[int], sizes: Sequence[int]):
        """Register several regions at once -> (True, [mr_id, ...]).  If one
        fails, those registered before it are deregistered and the error is
        raised."""
        ptrs, sizes = list(ptrs), list(sizes)
        if len(ptrs) != len(sizes):
            raise ValueError(f"regv: {len(ptrs)} pointers but {len(sizes)} sizes")
        mr_ids: list[int] = []
        try:
            for ptr, size in zip(ptrs, sizes):
                mr_ids.append(super().reg(ptr, size)[1])
        except BaseException:
            for mr in mr_ids:
                try:
                    self.dereg(mr)
                except Exception:  # noqa: BLE001 - the first error is the one to raise
                    pass
            raise
        return True, mr_ids

    # -- two-sided ---------------------------------------------------------
    def send(self, conn_id: int, mr_id: int, ptr: int, size: int) -> bool:
        return self._transfer(OP_SEND, conn_id, mr_id, ptr, size, None, current_stream())

    def recv(self, conn_id: int, mr_id: int, ptr: int, size: int) -> bool:
        return self._transfer(OP_RECV, conn_id, mr_id, ptr, size, None, current_stream())

    def send_async(self, conn_id: int, mr_id: int, ptr: int, size: int):
        return True, self._post(OP_SEND, conn_id, mr_id, ptr, size, None, current_stream())

    def stream_wait(self, transfer_id: int) -> bool:
        """Order torch's current CUDA stream after a transfer, without blocking
        the host (as NCCL's handles do): work queued on the stream after this
        call runs once the transfer has finished.  A transfer of host memory
        is waited for on the host instead.  Errors are reported by
        poll_async()/wait(), which the id still answers (a failed transfer
        releases the stream too: check before using the data)."""
        if not self._stream_wait(transfer_id, current_stream()):
            self.wait(transfer_id)
        return True

    def recv_async(self, conn_id: int, mr_id: int, ptr: int, size: int):
        return True, self._post(OP_RECV, conn_id, mr_id, ptr, size, None, current_stream())

    def _vector(self, name, op, conn_id, mr_ids, ptrs, sizes, num_iovs, fifos=None) -> bool:
        _lists(name, num_iovs, mr_ids, ptrs, sizes, *([fifos] if fifos is not None else []))
        ids, first_error = [], None
        stream = current_stream()
        try:
            for i in range(num_iovs):
                fifo = None if fifos is None else fifos[i]
                ids.append(self._post(op, conn_id, mr_ids[i], ptrs[i], sizes[i], fifo, stream))
        except Exception as e:  # later iovs are not posted; wait for those that were
            first_error = e
        # Every posted iov is waited for, even after an error, so that no byte
        # lands in these buffers once this returns.
        for t in ids:
            try:
                self.wait(t)
            except Exception as e:
                first_error = first_error or e
            try:
                self.release(t)
            except ValueError:
                pass
        if first_error is not None:
            raise first_error
        return True

    def sendv(self, conn_id, mr_id_list, ptr_list, size_list, num_iovs) -> bool:
        """Each iov is one message; the receiver's recvv must post the same sizes."""
        return self._vector("sendv", OP_SEND, conn_id, mr_id_list, ptr_list, size_list, num_iovs)

    def recvv(self, conn_id, mr_id_list, ptr_list, size_list, num_iovs) -> bool:
        return self._vector("recvv", OP_RECV, conn_id, mr_id_list, ptr_list, size_list, num_iovs)

    # -- one-sided ---------------------------------------------------------
    def advertise(self, *args):
        """advertise(conn_id, mr_id, addr, len) -> (True, fifo_item): for the
        peer of that accepted connection; or, as upstream's newer API,
        advertise(mr_id, ptr, size): for the peer of any connection of this
        endpoint that holds the descriptor."""
        if len(args) == 3:
            return super().advertise(0, *args)
        if len(args) != 4:
            raise TypeError(f"advertise takes (conn_id, mr_id, addr, len) or (mr_id, ptr, size), "
                            f"got {len(args)} arguments")
        return super().advertise(*args)

    def advertisev(self, *args):
        """advertisev(conn_id, mr_id_list, addr_list, len_list, num_iovs) or,
        as upstream's newer API, advertisev(mr_id_v, ptr_v, size_v, num_iovs)
        (any connection) -> (True, [fifo_item, ...])."""
        if len(args) == 4:
            args = (0, *args)
        if len(args) != 5:
            raise TypeError("advertisev takes (conn_id, mr_ids, addrs, lens, num_iovs) or "
                            f"(mr_ids, ptrs, sizes, num_iovs), got {len(args)} arguments")
        conn_id, mr_id_list, addr_list, len_list, num_iovs = args
        _lists("advertisev", num_iovs, mr_id_list, addr_list, len_list)
        return True, [self.advertise(conn_id, mr_id_list[i], addr_list[i], len_list[i])[1]
                      for i in range(num_iovs)]

    def write(self, conn_id: int, mr_id: int, src: int, size: int, fifo_item: bytes) -> bool:
        return self._transfer(OP_WRITE, conn_id, mr_id, src, size, bytes(fifo_item), current_stream())

    def read(self, conn_id: int, mr_id: int, dst: int, size: int, fifo_item: bytes) -> bool:
        return self._transfer(OP_READ, conn_id, mr_id, dst, size, bytes(fifo_item), current_stream())

    def write_async(self, conn_id, mr_id, src, size, fifo_item):
        return True, self._post(OP_WRITE, conn_id, mr_id, src, size, bytes(fifo_item), current_stream())

    def read_async(self, conn_id, mr_id, dst, size, fifo_item):
        return True, self._post(OP_READ, conn_id, mr_id, dst, size, bytes(fifo_item), current_stream())

    def writev(self, conn_id, mr_id_list, src_list, size_list, fifo_items, num_iovs) -> bool:
        return self._vector("writev", OP_WRITE, conn_id, mr_id_list, src_list, size_list,
                            num_iovs, [bytes(f) for f in fifo_items])

    def readv(self, conn_id, mr_id_list, dst_list, size_list, fifo_items, num_iovs) -> bool:
        return self._vector("readv", OP_READ, conn_id, mr_id_list, dst_list, size_list,
                            num_iovs, [bytes(f) for f in fifo_items])

    # -- upstream's same-host IPC names: _ipc_api.py (with or without mr_id) --
    sendv_ipc_async, recvv_ipc_async = TransferAPI.sendv_async, TransferAPI.recvv_async

    # -- torch tensors and numpy arrays -----------------------------------
    def reg_tensor(self, t) -> int:
        """Register a tensor's or array's memory; returns mr_id."""
        ptr, size = buffer_of(t)
        return self.reg(ptr, size)[1]

    def send_tensor(self, conn_id: int, mr_id: int, t) -> bool:
        return self.send(conn_id, mr_id, *buffer_of(t))

    def recv_tensor(self, conn_id: int, mr_id: int, t) -> bool:
        return self.recv(conn_id, mr_id, *buffer_of(t))

    def send_tensor_async(self, conn_id: int, mr_id: int, t):
        return self.send_async(conn_id, mr_id, *buffer_of(t))

    def recv_tensor_async(self, conn_id: int, mr_id: int, t):
        return self.recv_async(conn_id, mr_id, *buffer_of(t))

    def advertise_tensor(self, conn_id: int, mr_id: int, t) -> bytes:
        return self.advertise(conn_id, mr_id, *buffer_of(t))[1]

    def write_tensor(self, conn_id: int, mr_id: int, t, fifo_item: bytes) -> bool:
        return self.write(conn_id, mr_id, *buffer_of(t), fifo_item)

    def read_tensor(self, conn_id: int, mr_id: int, t, fifo_item: bytes) -> bool:
        return self.read(conn_id, mr_id, *buffer_of(t), fifo_item)
