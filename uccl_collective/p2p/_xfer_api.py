"""Upstream UCCL's newer one-sided API on the Endpoint (a mixin of
_endpoint.Endpoint): register_memory / get_serialized_descs / deserialize_descs /
transfer / deregister_memory with XferDesc, the connection-free
advertise(mr_id, ptr, size), and one transfer id for several transfers
(transfer() of several descriptors, and the vectored *_async calls).

A descriptor made here is offered to any connection of this endpoint (the
engine's advertise with conn 0): whoever holds its bytes, and is connected
here, may read and write exactly that range, until deregister_memory().
Its random token is the capability, so treat serialized descriptors as
credentials, as upstream's rkeys are.
"""
from __future__ import annotations

import itertools
import struct
from typing import Any, Sequence

from .. import _engine
from ._buffers import OP_READ, OP_RECV, OP_SEND, OP_WRITE, buffer_of, current_stream

FIFO = _engine.FIFO_ITEM_SIZE
# A descriptor's keys (lkeys and rkeys alike): the window a registration is
# offered through (window id, token, start address, length) as 8 32-bit
# words, the same for every range inside that registration, as a NIC's keys
# are for every range of one memory region.
_KEYS = struct.Struct("<QQQQ")
_WORDS = _KEYS.size // 4
_HEAD = struct.Struct("<4sI")      # magic, count
_ITEM = struct.Struct(f"<QQ{_KEYS.size}s")
_MAGIC = b"UXD2"
# ids of grouped transfers: far above the engine's, which count up from 1
_GROUP_BASE = 1 << 62


class XferHandle:
    """Upstream's record of a started transfer (conn_id, op_name,
    transfer_id), read-only.  transfer() returns (True, transfer_id) here as
    upstream's does; this type exists so code that names it keeps working."""

    __slots__ = ("conn_id", "op_name", "transfer_id")

    def __init__(self, conn_id: int, op_name: str, transfer_id: int):
        object.__setattr__(self, "conn_id", int(conn_id))
        object.__setattr__(self, "op_name", str(op_name))
        object.__setattr__(self, "transfer_id", int(transfer_id))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"XferHandle.{name} is read-only")

    def __repr__(self) -> str:
        return (f"<XferHandle conn_id={self.conn_id} op_name={self.op_name!r} "
                f"transfer_id={self.transfer_id}>")


class XferDesc:
    """A registered range as upstream's register_memory() returns it: addr,
    size, mr_id (this endpoint's), lkeys (the region) and rkeys (the
    descriptor a peer needs, as 32-bit words).  Fields read as attributes or,
    as upstream's older tests do, as items (desc["addr"])."""

    __slots__ = ("addr", "size", "mr_id", "lkeys", "rkeys")

    def __init__(self, addr: int = 0, size: int = 0, mr_id: int = 0,
                 lkeys: Sequence[int] = (), rkeys: Sequence[int] = ()):
        self.addr, self.size, self.mr_id = int(addr), int(size), int(mr_id)
        self.lkeys, self.rkeys = list(lkeys), list(rkeys)

    def __getitem__(self, key: str) -> Any:
        if key not in self.__slots__:
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: str) -> bool:
        return key in self.__slots__

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, XferDesc) and all(
            getattr(self, k) == getattr(other, k) for k in ("addr", "size", "rkeys"))

    def __repr__(self) -> str:
        return f"<XferDesc addr={self.addr} size={self.size} mr_id={self.mr_id}>"

    def fifo(self) -> bytes:
        """The engine's one-sided descriptor of exactly [addr, +size), inside
        the window rkeys name (its owner checks that it lies inside)."""
        if len(self.rkeys) != _WORDS:
            raise ValueError(f"XferDesc at {self.addr:#x}: rkeys holds {len(self.rkeys)} words, "
                             f"a descriptor of this engine has {_WORDS} (register_memory() or "
                             "deserialize_descs() make them)")
        window, token, base, length = _KEYS.unpack(struct.pack(f"<{_WORDS}I", *self.rkeys))
        if not (base <= self.addr and self.addr + self.size <= base + length):
            raise ValueError(f"XferDesc [{self.addr:#x}, +{self.size}) lies outside the "
                             f"registration its keys name [{base:#x}, +{length})")
        return _engine.fifo_item(window, token, self.addr, self.size, base)


class RegisterError(TypeError, RuntimeError):
    """register_memory() of something that is not a tensor or array: a
    TypeError, and a RuntimeError as upstream raises there."""


class _Shared:
    __slots__ = ("addr", "size", "window_mr", "keys", "mrs")

    def __init__(self, addr: int, size: int, window_mr: int, keys: Sequence[int]):
        self.addr, self.size, self.window_mr = addr, size, window_mr
        self.keys, self.mrs = list(keys), set()


class _KeyCache:
    """register_memory()'s registrations whose keys later ones share: a
    window (advertised on its first mr) and the mr_ids that use its keys."""

    def __init__(self):
        self.shared: dict[tuple[int, int], _Shared] = {}
        self.by_mr: dict[int, _Shared] = {}

    def covering(self, addr: int, size: int) -> _Shared | None:
        exact = self.shared.get((addr, size))
        if exact is not None:
            return exact
        return next((e for e in self.shared.values()
                     if e.addr <= addr and addr + size <= e.addr + e.size), None)

    def add(self, addr: int, size: int, mr: int, keys: Sequence[int]) -> _Shared:
        e = self.shared[(addr, size)] = _Shared(addr, size, mr, keys)
        return e

    def use(self, e: _Shared, mr: int) -> None:
        e.mrs.add(mr)
        self.by_mr[mr] = e

    def drop(self, mr: int) -> list[int]:
        """The mr_ids to deregister now that mr's descriptor goes: mr itself
        (unless its window still serves others), and the window's own mr
        once nothing uses it."""
        e = self.by_mr.pop(mr, None)
        if e is None:
            return [mr]
        e.mrs.discard(mr)
        out = [] if mr == e.window_mr else [mr]
        if not e.mrs:
            del self.shared[(e.addr, e.size)]
            out.append(e.window_mr)
        return out


def _descs(seq: Any, what: str) -> list[XferDesc]:
    out = list(seq)
    for i, d in enumerate(out):
        if not isinstance(d, XferDesc):
            raise TypeError(f"{what}: entry {i} is {type(d).__name__}, not an XferDesc")
    return out


class TransferAPI:
    """Mixed into p2p.Endpoint (which provides reg, dereg, _post, poll_async,
    wait, release and the engine's advertise)."""

    # -- one id for several transfers ------------------------------------------
    # The engine's poll_async/wait/release stay the endpoint's methods (no
    # Python layer on their hot path) until the first group id is made; then
    # this instance's are replaced by group-aware ones.
    def _group(self, ids: list[int]) -> int:
        """One id standing for several engine transfers (all must finish)."""
        if len(ids) == 1:
            return ids[0]
        if "_groups" not in self.__dict__:
            self._groups: dict[int, list[int]] = {}
            self._group_ids = itertools.count(_GROUP_BASE)
            self.poll_async, self.wait = self._group_poll, self._group_wait
            self.release = self._group_release
        gid = next(self._group_ids)
        self._groups[gid] = list(ids)
        return gid

    def _group_poll(self, transfer_id: int):
        parts = self._groups.get(transfer_id)
        if parts is None:
            return _engine.Endpoint.poll_async(self, transfer_id)
        for t in parts:   # every part answers (errors included) before the group is done
            if not _engine.Endpoint.poll_async(self, t)[1]:
                return True, False
        return True, True

    def _group_wait(self, transfer_id: int, timeout: float | None = None) -> bool:
        parts = self._groups.get(transfer_id)
        if parts is None:
            return _engine.Endpoint.wait(self, transfer_id, timeout)
        first = None
        for t in parts:   # all of them, so nothing lands after an error is raised
            try:
                _engine.Endpoint.wait(self, t, timeout)
            except BaseException as e:  # noqa: BLE001 - the first one is raised
                first = first or e
        if first is not None:
            raise first
        return True

    def _group_release(self, transfer_id: int) -> bool:
        parts = self._groups.get(transfer_id)
        if parts is None:
            return _engine.Endpoint.release(self, transfer_id)
        for t in parts:
            if not _engine.Endpoint.poll_async(self, t)[1]:
                raise ValueError(f"transfer_id {transfer_id} is still in flight: wait for it "
                                 "before releasing it")
        for t in parts:
            _engine.Endpoint.release(self, t)
        del self._groups[transfer_id]
        return True

    def _post_all(self, what: str, op: int, conn_id: int, mrs, ptrs, sizes, fifos=None) -> int:
        mrs, ptrs, sizes = list(mrs), list(ptrs), list(sizes)
        if not (len(mrs) == len(ptrs) == len(sizes)) or (fifos is not None and
                                                          len(fifos) != len(mrs)):
            raise ValueError(f"{what}: lists of different lengths ({len(mrs)} mr ids, "
                             f"{len(ptrs)} pointers, {len(sizes)} sizes"
                             + (f", {len(fifos)} descriptors)" if fifos is not None else ")"))
        if not mrs:
            raise ValueError(f"{what}: nothing to transfer (empty lists)")
        stream, ids = current_stream(), []
        try:
            for i in range(len(mrs)):
                fifo = None if fifos is None else bytes(fifos[i])
                ids.append(self._post(op, conn_id, mrs[i], ptrs[i], sizes[i], fifo, stream))
        except BaseException:
            for t in ids:   # what was posted ends before we raise
                try:
                    _engine.Endpoint.wait(self, t)
                    _engine.Endpoint.release(self, t)
                except Exception:  # noqa: BLE001 - the posting error is the one to raise
                    pass
            raise
        return self._group(ids)

    # -- upstream's vectored async calls ----------------------------------------
    def sendv_async(self, conn_id, mr_id_v, ptr_v, size_v, num_iovs=None):
        return True, self._post_all("sendv_async", OP_SEND, conn_id, mr_id_v, ptr_v, size_v)

    def recvv_async(self, conn_id, mr_id_v, ptr_v, size_v, num_iovs=None):
        return True, self._post_all("recvv_async", OP_RECV, conn_id, mr_id_v, ptr_v, size_v)

    def writev_async(self, conn_id, mr_id_v, src_v, size_v, fifo_items, num_iovs=None):
        return True, self._post_all("writev_async", OP_WRITE, conn_id, mr_id_v, src_v, size_v,
                                    fifo_items)

    def readv_async(self, conn_id, mr_id_v, dst_v, size_v, fifo_items, num_iovs=None):
        return True, self._post_all("readv_async", OP_READ, conn_id, mr_id_v, dst_v, size_v,
                                    fifo_items)

    # -- register_memory and transfer ------------------------------------------
    def register_memory(self, tensor_list: Sequence) -> list[XferDesc]:
        """Register and describe each tensor (or numpy array): one XferDesc
        per entry, offered to any connection of this endpoint.  As upstream's
        registration cache: a range inside one registered before gets its
        own mr_id but the same keys (lkeys, rkeys), which stay valid until
        the last descriptor sharing them is deregistered."""
        objs = list(tensor_list)
        spans = []
        for i, t in enumerate(objs):   # every entry checked before anything is made
            try:
                spans.append(buffer_of(t))
            except TypeError as e:
                raise RegisterError(f"register_memory: entry {i}: {e}") from None
        cache = self.__dict__.get("_xfer_keys")
        if cache is None:
            cache = self._xfer_keys = _KeyCache()
        made: list[XferDesc] = []
        try:
            for addr, size in spans:
                mr = self.reg(addr, size)[1]
                shared = cache.covering(addr, size)
                if shared is None:
                    try:
                        fifo = _engine.Endpoint.advertise(self, 0, mr, addr, size)[1]
                    except BaseException:
                        self.dereg(mr)
                        raise
                    window, token = _engine.fifo_fields(fifo)[:2]
                    shared = cache.add(addr, size, mr, struct.unpack(
                        f"<{_WORDS}I", _KEYS.pack(window, token, addr, size)))
                cache.use(shared, mr)
                made.append(XferDesc(addr, size, mr, shared.keys, shared.keys))
        except BaseException:
            self.deregister_memory(made)
            raise
        return made

    def deregister_memory(self, desc_list: Sequence) -> bool:
        """Deregister the regions of these descriptors.  Keys shared with a
        descriptor still registered keep working; once the last one goes, a
        peer's access through them fails."""
        cache = self.__dict__.get("_xfer_keys")
        for mr in dict.fromkeys(d.mr_id for d in _descs(desc_list, "deregister_memory")):
            for gone in (cache.drop(mr) if cache else [mr]):
                try:
                    self.dereg(gone)
                except ValueError:
                    pass   # already gone: upstream's deregister is idempotent too
        return True

    @staticmethod
    def get_serialized_descs(desc_list: Sequence) -> bytes:
        """What a peer needs of these descriptors, as bytes (addr, size and
        the engine descriptor of each; not the local mr_id)."""
        descs = _descs(desc_list, "get_serialized_descs")
        for d in descs:
            d.fifo()   # keys of this engine, naming a window that holds the range
        return _HEAD.pack(_MAGIC, len(descs)) + b"".join(
            _ITEM.pack(d.addr, d.size, struct.pack(f"<{_WORDS}I", *d.rkeys)) for d in descs)

    @staticmethod
    def deserialize_descs(serialized_bytes: bytes) -> list[XferDesc]:
        b = bytes(serialized_bytes)
        if len(b) < _HEAD.size or b[:4] != _MAGIC:
            raise ValueError(f"deserialize_descs: {len(b)} bytes that get_serialized_descs() "
                             "did not make (bad header)")
        n = _HEAD.unpack_from(b)[1]
        if len(b) != _HEAD.size + n * _ITEM.size:
            raise ValueError(f"deserialize_descs: {len(b)} bytes for {n} descriptors (expected "
                             f"{_HEAD.size + n * _ITEM.size})")
        out = []
        for i in range(n):
            addr, size, keys = _ITEM.unpack_from(b, _HEAD.size + i * _ITEM.size)
            words = struct.unpack(f"<{_WORDS}I", keys)
            out.append(XferDesc(addr, size, 0, words, words))
        return out

    def transfer(self, conn_id: int, op_name: str, local_desc_list: Sequence,
                 remote_desc_list: Sequence):
        """Write local ranges into the peer's (op_name "write") or read the
        peer's into local ones ("read"), pairwise -> (True, transfer_id): one
        id for all of them (poll_async, wait, release)."""
        local = _descs(local_desc_list, "transfer")
        remote = _descs(remote_desc_list, "transfer")
        if len(local) != len(remote):
            raise ValueError(f"transfer: {len(local)} local descriptors but {len(remote)} "
                             "remote ones")
        if op_name not in ("write", "read"):
            raise ValueError(f"transfer: op_name must be 'write' or 'read', got {op_name!r}")
        for i, (l, r) in enumerate(zip(local, remote)):
            if l.size > r.size:
                raise ValueError(f"transfer: local descriptor {i} has {l.size} bytes, the remote "
                                 f"one {r.size}")
        op = OP_WRITE if op_name == "write" else OP_READ
        return True, self._post_all("transfer", op, conn_id, [d.mr_id for d in local],
                                    [d.addr for d in local], [d.size for d in local],
                                    [d.fifo() for d in remote])
