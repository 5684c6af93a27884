"""Upstream UCCL's same-host IPC calls on the Endpoint (a mixin of
p2p.Endpoint), in both of upstream's forms, told apart by their number of
arguments: with an mr_id, as the two-sided and one-sided calls take it
(send_ipc(conn_id, mr_id, ptr, size)), or without one, as upstream's IPC
path takes them (send_ipc(conn_id, ptr, size), write_ipc(conn_id, ptr,
size, info), advertise_ipc(conn_id, ptr, size), the vectored and _async
forms).  They take the same paths as the other calls; the transport is the
connection's (same host: shared memory and CUDA IPC).

Without an mr_id the buffer is registered on its first use and the
registration kept, one per distinct buffer (as upstream keeps an IPC handle
per buffer), until dereg() of its mr_id or close().
"""
from __future__ import annotations

from typing import Any, Sequence


class IpcAPI:
    """Mixed into p2p.Endpoint, which provides reg, dereg and the calls below
    in their mr_id forms (send, recv, write, read, writev, readv, their
    _async forms, advertise, advertisev)."""

    def _auto_mr(self, ptr: int, size: int) -> int:
        regs = self.__dict__.setdefault("_ipc_regs", {})
        hit = regs.get(ptr)
        if hit is not None and size <= hit[0]:
            return hit[1]
        mr = self.reg(ptr, size)[1]
        regs[ptr] = (size, mr)
        return mr

    def _auto_mrs(self, ptrs: Sequence[int], sizes: Sequence[int], what: str) -> list[int]:
        if len(ptrs) != len(sizes):
            raise ValueError(f"{what}: {len(ptrs)} pointers but {len(sizes)} sizes")
        return [self._auto_mr(p, n) for p, n in zip(ptrs, sizes)]

    def dereg(self, mr_id: int) -> bool:
        regs = self.__dict__.get("_ipc_regs")
        if regs:
            for ptr in [p for p, (_n, mr) in regs.items() if mr == mr_id]:
                del regs[ptr]
        return super().dereg(mr_id)

    @staticmethod
    def _arity(what: str, args: tuple, short: int, long: tuple[int, ...], forms: str) -> bool:
        """True for the mr-less form (short arguments after conn_id)."""
        if len(args) == short:
            return True
        if len(args) in long:
            return False
        raise TypeError(f"{what} takes {forms}, got {len(args) + 1} arguments")

    # -- two-sided -------------------------------------------------------------
    def _two_sided(self, what: str, fn, conn_id: int, a: tuple):
        if self._arity(what, a, 2, (3,), "(conn_id, [mr_id,] ptr, size)"):
            return fn(conn_id, self._auto_mr(*a), *a)
        return fn(conn_id, *a)

    def send_ipc(self, conn_id: int, *a: Any):
        return self._two_sided("send_ipc", self.send, conn_id, a)

    def recv_ipc(self, conn_id: int, *a: Any):
        return self._two_sided("recv_ipc", self.recv, conn_id, a)

    def send_ipc_async(self, conn_id: int, *a: Any):
        return self._two_sided("send_ipc_async", self.send_async, conn_id, a)

    def recv_ipc_async(self, conn_id: int, *a: Any):
        return self._two_sided("recv_ipc_async", self.recv_async, conn_id, a)

    def advertise_ipc(self, conn_id: int, *a: Any):
        return self._two_sided("advertise_ipc", self.advertise, conn_id, a)

    # -- one-sided -------------------------------------------------------------
    def advertisev_ipc(self, conn_id: int, *a: Any):
        if self._arity("advertisev_ipc", a, 2, (4,),
                       "(conn_id, ptr_v, size_v) or (conn_id, mr_ids, addrs, lens, num_iovs)"):
            ptrs, sizes = list(a[0]), list(a[1])
            mrs = self._auto_mrs(ptrs, sizes, "advertisev_ipc")
            return self.advertisev(conn_id, mrs, ptrs, sizes, len(ptrs))
        return self.advertisev(conn_id, *a)

    def _one_sided(self, what: str, fn, conn_id: int, a: tuple):
        if self._arity(what, a, 3, (4,), "(conn_id, [mr_id,] ptr, size, info)"):
            ptr, size, info = a
            return fn(conn_id, self._auto_mr(ptr, size), ptr, size, info)
        return fn(conn_id, *a)

    def write_ipc(self, conn_id: int, *a: Any):
        return self._one_sided("write_ipc", self.write, conn_id, a)

    def read_ipc(self, conn_id: int, *a: Any):
        return self._one_sided("read_ipc", self.read, conn_id, a)

    def write_ipc_async(self, conn_id: int, *a: Any):
        return self._one_sided("write_ipc_async", self.write_async, conn_id, a)

    def read_ipc_async(self, conn_id: int, *a: Any):
        return self._one_sided("read_ipc_async", self.read_async, conn_id, a)

    def _vectored(self, what: str, fn, conn_id: int, a: tuple):
        if self._arity(what, a, 3, (4, 5),
                       "(conn_id, ptr_v, size_v, info_v) or (conn_id, mr_ids, ptrs, sizes, "
                       "fifo_items[, num_iovs])"):
            ptrs, sizes, infos = list(a[0]), list(a[1]), list(a[2])
            mrs = self._auto_mrs(ptrs, sizes, what)
            return fn(conn_id, mrs, ptrs, sizes, infos, len(ptrs))
        if len(a) == 4:
            a = (*a, len(a[0]))
        return fn(conn_id, *a)

    def writev_ipc(self, conn_id: int, *a: Any):
        return self._vectored("writev_ipc", self.writev, conn_id, a)

    def readv_ipc(self, conn_id: int, *a: Any):
        return self._vectored("readv_ipc", self.readv, conn_id, a)

    def writev_ipc_async(self, conn_id: int, *a: Any):
        return self._vectored("writev_ipc_async", self.writev_async, conn_id, a)

    def readv_ipc_async(self, conn_id: int, *a: Any):
        return self._vectored("readv_ipc_async", self.readv_async, conn_id, a)
