"""CollectiveContext: the UCCL collective API over this package's C engine.

Bootstraps through torch.distributed (or any c10d Store): every rank publishes
its endpoint address and node, then all pairs connect in parallel, each peer
identified by its rank in the handshake.  The collectives themselves (the
ordered queue, allgather direct and ring, the ring step) run in C (comm.c,
coll_run.c, coll_algo.c, through the _engine.Communicator type);
Python validates the tensors and hands each call to its route
(core/dispatch.py).  ``uccl_collective.collective`` is this module.

Routing: a peer on another node always goes through this engine (TCP).  A
peer on this node goes through this engine (shared memory) when
``use_copy_engine_for_intra=True``, otherwise through torch.distributed, as
upstream does.  Nodes are told apart by UCCL_NODE_ID, else torchrun's node
rank (GROUP_RANK) on top of the kernel's boot id, so two "nodes" that share
one kernel (network namespaces) still use TCP between them.
"""
from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import logging
import numbers
import os
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from .. import _engine
from ..p2p import Endpoint, FloatType, UcclError, UcclMismatchError, UcclTimeoutError
from . import config, dispatch
from .gpu_ring import GpuRing, Remote
# (StreamHandle, NO_STREAM and stream_args: names this module has always offered)
from .handles import Handle, StreamHandle, _flatten_handles, _handle  # noqa: F401
from .stream_group import NO_STREAM, StreamGroup, stream_args  # noqa: F401
from .stream_group import enabled as _stream_ordered

log = logging.getLogger("uccl_collective")

__all__ = [
    "CollectiveContext", "Handle", "P2POp", "init_collective", "get_collective",
    "finalize_collective", "register_tensor", "deregister_tensor", "send", "recv", "isend",
    "irecv", "test", "wait", "wait_all", "batch_isend_irecv", "sendrecv", "allgather",
    "iallgather", "allgatherv", "iallgatherv", "UcclError", "UcclTimeoutError",
]

_ALGOS = {"auto": _engine.AG_AUTO, "direct": _engine.AG_DIRECT, "ring": _engine.AG_RING}
_SEND, _RECV = _engine.OP_SEND, _engine.OP_RECV
_context_seq: dict[str, Any] = {}   # per group: members create contexts in the same order


def node_id() -> str:
    """This process's node: UCCL_NODE_ID, else host id (+ torchrun's node rank)."""
    explicit = config.get("UCCL_NODE_ID")
    if explicit:
        return explicit
    base = config.get("UCCL_P2P_HOST_ID")
    if not base:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                base = f.read().strip()
        except OSError:
            base = os.uname().nodename
    group_rank = os.environ.get("GROUP_RANK")
    return f"{base}/node{group_rank}" if group_rank is not None else base


def _engine_host_id(node: str) -> str:
    """The engine's host id holds at most 63 characters: hash longer node ids."""
    if len(node) <= 63:
        return node
    return hashlib.sha256(node.encode()).hexdigest()[:63]


def _tensor_buf(t: Any, what: str) -> tuple[int, int]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: tensor is not contiguous (shape={tuple(t.shape)}, "
                         f"stride={tuple(t.stride())}); call .contiguous() first")
    if not (t.is_cuda or t.device.type == "cpu"):
        raise ValueError(f"{what}: tensor is on {t.device}; this engine moves CPU and CUDA "
                         "tensors")
    return int(t.data_ptr()), int(t.numel() * t.element_size())


class P2POp:
    """One entry of batch_isend_irecv: op is "send"/"recv" or isend/irecv."""

    __slots__ = ("op", "tensor", "peer")

    def __init__(self, op: Any, tensor: torch.Tensor, peer: int):
        name = op if isinstance(op, str) else getattr(op, "__name__", None)
        if name in ("send", "isend"):
            self.op = "send"
        elif name in ("recv", "irecv"):
            self.op = "recv"
        else:
            raise ValueError(f"P2POp: op must be 'send', 'recv', isend or irecv, got {op!r}")
        self.tensor, self.peer = tensor, peer

    def __repr__(self) -> str:
        return f"P2POp({self.op!r}, tensor{tuple(self.tensor.shape)}, peer={self.peer})"


def _group_moves_cuda(group: Any) -> bool:
    """Can the torch.distributed group move CUDA tensors point to point?
    Gloo cannot (it reads a device pointer as host memory); a group made
    for several devices ("cpu:gloo,cuda:nccl") can when CUDA has its own."""
    backend = str(dist.get_backend(group))
    if ":" in backend:   # "cpu:gloo,cuda:nccl"
        per_device = dict(part.split(":", 1) for part in backend.split(","))
        return per_device.get("cuda", "gloo") != "gloo"
    return backend != "gloo"


def _uses_cuda() -> bool:
    """Will this rank move CUDA tensors?  What it can tell at setup: a GPU
    is visible to torch."""
    return torch.cuda.is_available()


class CollectiveContext:
    """CollectiveContext(num_cpus=4, local_gpu_idx=None, use_copy_engine_for_intra=False)

    Upstream's argument order.  ``disable_uccl_intra`` (upstream's older
    name) is accepted too: True is use_copy_engine_for_intra=False.

    Needs torch.distributed initialised (any backend), or ``store``, ``rank``
    and ``world_size`` given (how the "uccl" process group bootstraps; its
    keys then go under ``key_prefix`` when given, which must be unique to
    the context, else under a per-process sequence number).
    ``timeout_s`` bounds every blocking call (default UCCL_P2P_TIMEOUT_S or
    300 s); ``group`` is the torch.distributed group same-node traffic uses
    when use_copy_engine_for_intra=False (default: the world).

    Where that group cannot move CUDA tensors (Gloo, as upstream's scripts
    bootstrap) and a rank of a node sees a GPU, same-node traffic goes
    through this engine instead, as with use_copy_engine_for_intra=True
    (copy engine for CUDA tensors, shared memory for CPU ones), with one
    INFO line saying so: every rank takes the same decision from what all
    published at setup."""

    def __init__(self, num_cpus: int = 4, local_gpu_idx: int | None = None,
                 use_copy_engine_for_intra: bool = False, *,
                 disable_uccl_intra: bool | None = None, timeout_s: float | None = None,
                 store: Any = None, rank: int | None = None, world_size: int | None = None,
                 group: Any = None, key_prefix: str | None = None):
        if disable_uccl_intra is not None:
            if use_copy_engine_for_intra and disable_uccl_intra:
                raise ValueError("CollectiveContext: use_copy_engine_for_intra=True and "
                                 "disable_uccl_intra=True contradict each other")
            use_copy_engine_for_intra = not disable_uccl_intra
        for name, v in (("num_cpus", num_cpus), ("local_gpu_idx", local_gpu_idx)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
                raise TypeError(f"CollectiveContext: {name} must be an int, got "
                                f"{type(v).__name__} {v!r} (the order is num_cpus, "
                                "local_gpu_idx, use_copy_engine_for_intra, as upstream's)")
        if local_gpu_idx is None:
            local_gpu_idx = int(os.environ.get("LOCAL_RANK", "0"))
        if local_gpu_idx < 0:
            raise ValueError(f"local_gpu_idx must be >= 0, got {local_gpu_idx}")
        if num_cpus < 1:
            raise ValueError(f"num_cpus must be >= 1, got {num_cpus}")
        self.local_gpu_idx = local_gpu_idx
        self.use_copy_engine_for_intra = bool(use_copy_engine_for_intra)
        self.num_cpus = num_cpus
        self.timeout_s = timeout_s
        self._store, self._group, self._key_prefix = store, group, key_prefix
        self.rank = rank
        self.world_size = world_size
        self.ep: Endpoint | None = None
        self._comm: _engine.Communicator | None = None   # the engine's collectives over ep
        self._engine_peer: list[bool] = []
        self._rings: list[Any] = []  # GPU rings (gpu_ring), closed by finalize()
        self._ring_seq = 0
        self._kv: Any = None
        self._regs: dict[int, tuple[int, int, int]] = {}
        self.setup_seconds: float | None = None
        self._waiter: ThreadPoolExecutor | None = None
        self._orphans: list[Handle] = []   # what dropped, unfinished handles still run
        self.transports: dict[int, str] = {}
        self._conns: tuple[list[int], list[int]] = ([], [])
        self._sg: Any = None        # the stream-ordered group (stream_group.py), made on first use
        self._sg_off = False

    # -- setup ---------------------------------------------------------------
    def init(self) -> "CollectiveContext":
        if self.ep is not None:
            raise ValueError("this CollectiveContext is already initialised")
        t0 = time.perf_counter()
        store = self._store
        if store is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("CollectiveContext needs torch.distributed initialised first "
                                   "(dist.init_process_group(...)), or store/rank/world_size")
            store = dist.distributed_c10d._get_default_store()
            self.rank = dist.get_rank(self._group)
            self.world_size = dist.get_world_size(self._group)
            if self.rank < 0:
                raise ValueError("CollectiveContext(group=...): this process is not a member of "
                                 "the group")
        if self.rank is None or self.world_size is None:
            raise ValueError("with a store, give rank and world_size too")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.world_size - 1}")
        # Keys are per group (disjoint groups share the default store) and per
        # context: every member creates its contexts in the same order.
        tag = "world"
        if self._group is not None and self._store is None:
            members = ",".join(map(str, dist.get_process_group_ranks(self._group)))
            tag = "g" + hashlib.sha256(members.encode()).hexdigest()[:16]
        if self._key_prefix is None:
            seq = _context_seq.setdefault(tag, itertools.count())
            store = dist.PrefixStore(f"uccl_collective/{tag}/ctx{next(seq)}/", store)
        else:  # the caller's prefix, unique to this context
            store = dist.PrefixStore(self._key_prefix, store)
        me = self.rank
        self._kv = store  # this context's keys: later exchanges (gpu_ring) use it too

        secret = config.get("UCCL_P2P_SECRET")
        if not secret:  # a per-job secret, handed out through the store
            if me == 0:
                store.set("secret", secrets.token_hex(16))
            self._store_wait(store, ["secret"], [0], "the job's secret from rank 0")
            secret = store.get("secret").decode()
        node = node_id()
        self.ep = Endpoint(self.local_gpu_idx, self.num_cpus, timeout_s=self.timeout_s,
                           secret=secret, port=0, rank=me, host_id=_engine_host_id(node))
        try:
            self._connect_all(store, node, secret)
        except BaseException:
            self.ep.close()
            self.ep = None
            raise
        self.setup_seconds = time.perf_counter() - t0
        return self

    def _store_wait(self, store, keys: list[str], ranks: list[int], what: str) -> None:
        """Wait for keys of the store within the context's timeout (the
        group's, not the store's own, often longer): setup is bounded as
        every call is.  UcclTimeoutError names the ranks that never came."""
        timeout_s = self.timeout_s or config.get("UCCL_P2P_TIMEOUT_S")
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except Exception as e:   # torch's store raises its own error on a timeout
            try:
                missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
            except Exception:   # noqa: BLE001 - the store itself may be gone
                missing = ranks
            raise UcclTimeoutError(
                f"CollectiveContext setup (rank {self.rank} of {self.world_size}): waited "
                f"{timeout_s:g} s for {what}; rank(s) {missing} never published theirs "
                f"({type(e).__name__}: {e})") from e

    def _connect_all(self, store, node: str, secret: str) -> None:
        n, me, ep = self.world_size, self.rank, self.ep
        ip, port = ep.address()
        store.set(f"meta/{me}", json.dumps({"ip": ip, "port": port, "node": node,
                                            "cuda": _uses_cuda()}))
        self._store_wait(store, [f"meta/{r}" for r in range(n)], list(range(n)),
                         "every rank's address")
        metas = [json.loads(store.get(f"meta/{r}")) for r in range(n)]
        self.nodes = [m["node"] for m in metas]
        self._route_cuda_through_engine(metas)
        self._engine_peer = [r != me and (self.use_copy_engine_for_intra or
                                          self.nodes[r] != node) for r in range(n)]
        # Whether every pair of ranks talks through this engine: the same on
        # every rank, so all of them run the same algorithm implementation.
        self._engine_only = self.use_copy_engine_for_intra or len(set(self.nodes)) == n
        if not self._engine_only and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("use_copy_engine_for_intra=False sends same-node traffic through "
                               "torch.distributed, which is not initialised")
        self.local_world_size = self.nodes.count(node)
        if not config.is_set("UCCL_P2P_SPIN_US") and self.local_world_size > (os.cpu_count() or 1):
            # More ranks than cores: a polling waiter only keeps the peer it
            # waits for off the core (measured: 4 ranks on 2 cores, 1 MiB
            # allgather 1.5 ms with 200 us of polling, 0.85 ms with none).
            ep._set_spin_us(0)
        peers = [r for r in range(n) if self._engine_peer[r]]
        send_conns, recv_conns = [0] * n, [0] * n

        def connect(r: int) -> int:
            return ep.connect(metas[r]["ip"], 0, metas[r]["port"], r)[1]

        if peers:
            with ThreadPoolExecutor(max_workers=min(16, len(peers))) as pool:
                for r, conn in zip(peers, pool.map(connect, peers)):
                    send_conns[r] = conn
        for _ in peers:
            _ok, peer_ip, _gpu, conn = ep.accept()
            r = ep.conn_peer_rank(conn)
            if not (0 <= r < n) or not self._engine_peer[r] or recv_conns[r]:
                raise UcclError(f"rank {me}: unexpected connection from {peer_ip} claiming rank "
                                f"{r} (expected one from each of ranks {peers})")
            recv_conns[r] = conn
        for r in peers:
            self.transports[r] = ep.conn_transport(send_conns[r])
        self._conns = (send_conns, recv_conns)
        self._comm = _engine.Communicator(ep, me, n, send_conns, recv_conns)

    def _sweep(self) -> None:
        """Forget the dropped handles whose operations are over (their
        tensors were kept alive until now)."""
        for _ in range(len(self._orphans)):  # entries appended meanwhile wait for next time
            h = self._orphans.pop(0)
            try:
                if not h.test():
                    self._orphans.append(h)
            except Exception:  # failed: over; the context is poisoned and says so next
                pass

    def _ep(self) -> Endpoint:
        if self._orphans:
            self._sweep()
        if self.ep is None:
            raise ValueError("CollectiveContext is not initialised (call init()) or finalized")
        return self.ep

    def _cm(self) -> _engine.Communicator:
        self._ep()
        cm = self._comm  # once taken, it raises ValueError if finalize() closes it meanwhile
        if cm is None:
            raise ValueError("CollectiveContext is not initialised (call init()) or finalized")
        return cm

    def stream_group(self, dev: int, timeout_s: float | None = None) -> Any:
        """The context's stream-ordered group on CUDA device dev
        (stream_group.StreamGroup), made at the first call, which every
        rank makes at the same point; or None where it does not apply: a
        peer not reached through this engine over shared memory with CUDA
        IPC (another host, or use_copy_engine_for_intra=False),
        UCCL_STREAM_ORDERED=0, a context of one rank.  One device per
        context, as a NCCL communicator."""
        if self._sg is not None:
            if dev != self._sg.dev:
                raise ValueError(f"this context runs its stream-ordered operations on cuda:"
                                 f"{self._sg.dev} (its first one's); got cuda:{dev}")
            return self._sg
        if self._sg_off:
            return None
        me, n = self.rank, self.world_size
        if (n < 2 or not _stream_ordered() or
                any(self.transports.get(r) != "shm-cma" for r in range(n) if r != me)):
            self._sg_off = True
            return None
        self._ep()
        self._sg = StreamGroup(self, dev, timeout_s or self.timeout_s or 300.0)
        return self._sg

    def gpu_ring(self, source: torch.Tensor, window: torch.Tensor, *, slots: int = 1024,
                 inflight: int = 64, trace: int = 0, paused: bool = False):
        """Collective: a command ring for GPU-initiated puts (gpu_ring.GpuRing)
        whose destination i is rank i's `window` (this rank's own: a copy on
        the copy engine).  Every rank calls it with its own source and window
        (CUDA tensors); each window is registered and advertised to every
        peer, and the descriptors are exchanged through the context's store.
        A kernel then enqueues uccl_ring_put(ring, rank, src_off, dst_off,
        len) with ring.device_ptr.  Close the ring (or finalize()) before the
        window's memory is freed."""
        ep, me, n = self._ep(), self.rank, self.world_size
        wptr, wlen = _tensor_buf(window, "gpu_ring window")
        _tensor_buf(source, "gpu_ring source")
        missing = [r for r in range(n) if r != me and not self._engine_peer[r]]
        if missing:
            raise ValueError(f"gpu_ring: ranks {missing} are not reached through this engine "
                             "(use_copy_engine_for_intra=False sends same-host peers through "
                             "torch.distributed); GPU rings need engine connections to all")
        mr = self.register_tensor(window)
        offers = {str(r): bytes(ep.advertise(self._conns[1][r], mr, wptr, wlen)[1]).hex()
                  for r in range(n) if r != me}
        key = f"gpu_ring{self._ring_seq}"  # every rank makes its rings in the same order
        self._ring_seq += 1
        self._kv.set(f"{key}/{me}", json.dumps(offers))
        got = {r: json.loads(self._kv.get(f"{key}/{r}")) for r in range(n) if r != me}
        dsts = [window if r == me else Remote(self._conns[0][r], bytes.fromhex(got[r][str(me)]))
                for r in range(n)]
        ring = GpuRing(ep, source, dsts, slots=slots, inflight=inflight, trace=trace,
                       paused=paused)
        self._rings.append(ring)
        return ring

    def finalize(self) -> None:
        if self._sg is not None:   # before the endpoint its registrations live in
            self._sg.close()
            self._sg = None
        if self._waiter is not None:
            self._waiter.shutdown(wait=False, cancel_futures=True)
            self._waiter = None
        if self.ep is not None:
            self.ep.close()  # fails what is pending: nothing lands in kept tensors afterwards
            self.ep = None
            self._comm = None
            self._regs.clear()
        for ring in self._rings:  # after the close: what their proxies hold fails at once
            ring.close()
        self._rings.clear()
        self._orphans.clear()

    def __enter__(self) -> "CollectiveContext":
        if self.ep is None:
            self.init()
        return self

    def __exit__(self, *exc) -> None:
        self.finalize()

    # -- upstream's attributes ---------------------------------------------------
    P2POp = P2POp

    @property
    def initialized(self) -> bool:
        return self.ep is not None

    @property
    def dist_backend(self) -> str | None:
        """The backend of the torch.distributed group this context bootstraps
        through (None when it was given a store instead)."""
        if self._store is not None or not (dist.is_available() and dist.is_initialized()):
            return None
        return dist.get_backend(self._group)

    def _conn_list(self, which: int) -> list[int | None]:
        conns = self._conns[which]
        return [conns[r] if r < len(conns) and conns[r] else None for r in range(self.world_size)]

    @property
    def send_connections(self) -> list[int | None]:
        """Per rank, the engine connection this rank sends to it on (None:
        this rank, or a peer reached through torch.distributed)."""
        return self._conn_list(0)

    @property
    def recv_connections(self) -> list[int | None]:
        """Per rank, the engine connection this rank receives from it on."""
        return self._conn_list(1)

    @property
    def local_connections(self) -> list[bool]:
        """Per rank, whether it is on this node (its engine connections, if
        any, are same-host: shared memory and CUDA IPC)."""
        nodes = getattr(self, "nodes", None)
        if not nodes:
            return []
        return [r != self.rank and nodes[r] == nodes[self.rank] for r in range(self.world_size)]

    @property
    def memory_regions(self) -> dict[int, int]:
        """Registered tensors: data pointer -> mr_id."""
        return {ptr: mr for ptr, (_p, _n, mr) in self._regs.items()}

    def check_tensor_registered(self, t: torch.Tensor) -> bool:
        """Whether t lies inside a tensor given to register_tensor()."""
        return self._buf(t, "check_tensor_registered")[2] != 0

    @staticmethod
    def float_type_from_tensor(t: torch.Tensor) -> FloatType:
        """Upstream's compression type of a tensor's dtype (kUndefined for
        anything but float16, bfloat16 and float32)."""
        return {torch.float16: FloatType.kFloat16, torch.bfloat16: FloatType.kBFloat16,
                torch.float32: FloatType.kFloat32}.get(t.dtype, FloatType.kUndefined)

    # -- registration ----------------------------------------------------------
    def register_tensor(self, t: torch.Tensor) -> int:
        ptr, size = _tensor_buf(t, "register_tensor")
        if ptr in self._regs:
            return self._regs[ptr][2]
        mr = self._ep().reg(ptr, size)[1]
        self._regs[ptr] = (ptr, size, mr)
        return mr

    def deregister_tensor(self, t: torch.Tensor) -> bool:
        ptr, _ = _tensor_buf(t, "deregister_tensor")
        reg = self._regs.pop(ptr, None)
        if reg is None:
            return False
        self._ep().dereg(reg[2])
        return True

    def _buf(self, t: torch.Tensor, what: str) -> tuple[int, int, int]:
        """(ptr, nbytes, mr): mr of a registered region holding it, else 0."""
        ptr, size = _tensor_buf(t, what)
        for base, length, mr in self._regs.values() if self._regs else ():
            if base <= ptr and ptr + size <= base + length:
                return ptr, size, mr
        return ptr, size, 0

    def _check_peer(self, peer: Any, what: str, own: bool = False) -> int:
        """peer as an int (numpy integers too); own: this rank's own number
        is allowed (point-to-point calls skip it, as upstream does)."""
        if isinstance(peer, bool) or not isinstance(peer, numbers.Integral):
            raise TypeError(f"{what}: peer rank must be an int, got {type(peer).__name__}")
        peer = int(peer)
        if not 0 <= peer < self.world_size or (peer == self.rank and not own):
            raise ValueError(f"{what}: peer rank {peer} is not another rank in "
                             f"0..{self.world_size - 1} (this is rank {self.rank})")
        return peer

    # -- point to point --------------------------------------------------------
    def _p2p(self, entries: Sequence[tuple[str, torch.Tensor, int]], what: str,
             blocking: bool = False) -> Handle | None:
        """Posts the batch; a Handle, or None when blocking (then waited for:
        engine-only batches in the one engine call that posts them)."""
        cm = self._cm()
        checked = []
        for kind, t, peer in entries:  # everything is checked before anything is posted
            peer = self._check_peer(peer, what, own=True)
            _tensor_buf(t, what)
            if peer != self.rank:   # to or from itself: skipped, as upstream does
                checked.append((kind, t, peer))
        entries = checked
        if not entries:
            return None if blocking else Handle(cm)
        engine, works = [], []
        for kind, t, peer in entries:
            if self._engine_peer[peer]:
                engine.append((_SEND if kind == "send" else _RECV, peer, self._buf(t, what)))
            else:
                self._check_torch_route(t, what)
        gpu = stream_args(t for _, t, _ in entries)
        for kind, t, peer in entries:
            if not self._engine_peer[peer]:
                fn = dist.isend if kind == "send" else dist.irecv
                gpeer = peer if self._group is None else dist.get_global_rank(self._group, peer)
                works.append(fn(t, gpeer, group=self._group))
        if blocking and not works:
            cm.p2p(engine, True, self.timeout_s, *gpu)
            return None
        ops = [cm.p2p(engine, False, None, *gpu)] if engine else []
        h = Handle(cm, ops, [self._watch(w) for w in works], [t for _, t, _ in entries],
                   self._orphans)
        if blocking:
            h.wait(self.timeout_s)
            return None
        return h

    def _route_cuda_through_engine(self, metas: list[dict]) -> None:
        """Same-node traffic goes through torch.distributed (upstream's
        use_copy_engine_for_intra=False) only where its group can move the
        CUDA tensors some rank of the node will send: else through this
        engine.  Decided from every rank's published metadata, so the same
        on every rank."""
        if self.use_copy_engine_for_intra or not (dist.is_available() and dist.is_initialized()):
            return   # the engine already, or no torch.distributed group to use
        if not any(m.get("cuda") for m in metas) or _group_moves_cuda(self._group):
            return
        self.use_copy_engine_for_intra = True
        log.info("CollectiveContext (rank %d): the torch.distributed group's backend (%s) cannot "
                 "move CUDA tensors: same-node traffic goes through uccl_collective's engine "
                 "(CUDA IPC for CUDA tensors, shared memory for CPU ones), as with "
                 "use_copy_engine_for_intra=True", self.rank, dist.get_backend(self._group))

    def _check_torch_route(self, t: torch.Tensor, what: str) -> None:
        """Gloo reads a CUDA tensor's device pointer as host memory and
        kills the process ("writev: Bad address"): refuse first."""
        if t.is_cuda and not _group_moves_cuda(self._group):
            raise ValueError(f"{what}: a CUDA tensor to a same-node peer goes through "
                             "torch.distributed when use_copy_engine_for_intra=False, and its "
                             f"backend ({dist.get_backend(self._group)}) cannot move CUDA "
                             "tensors; use "
                             "use_copy_engine_for_intra=True, or a backend that can (nccl, uccl)")

    def _watch(self, work) -> Future:
        """A Future done when a torch.distributed Work is: Gloo's p2p works
        report is_completed() only once waited for, so a thread waits."""
        if self._waiter is None:
            self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="uccl-dist-wait")
        return self._waiter.submit(work.wait)

    def isend(self, tensor: torch.Tensor, dst: int) -> Handle:
        return self._p2p([("send", tensor, dst)], "isend")

    def irecv(self, tensor: torch.Tensor, src: int) -> Handle:
        return self._p2p([("recv", tensor, src)], "irecv")

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._p2p([("send", tensor, dst)], "send", blocking=True)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self._p2p([("recv", tensor, src)], "recv", blocking=True)

    def test(self, handle: Handle) -> bool:
        return _handle(handle, "test").test()

    def wait(self, handle: Handle, timeout: float | None = None) -> bool:
        return _handle(handle, "wait").wait(timeout)

    def wait_all(self, handles: Handle | Iterable, timeout: float | None = None) -> bool:
        """Wait for every handle: a Handle, or a (nested) list of them, as
        iallgather's result is upstream."""
        first = None
        for h in _flatten_handles(handles):
            try:
                h.wait(timeout)
            except BaseException as e:  # wait for the rest, then raise the first
                first = first or e
        if first is not None:
            raise first
        return True

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Handle]:
        """Posts every op at once (in order); returns one handle per op.  An
        entry is a P2POp or an (op, tensor, peer) tuple."""
        ops = list(ops)
        for i, o in enumerate(ops):
            if isinstance(o, (tuple, list)) and len(o) == 3:
                ops[i] = o = P2POp(*o)
            if not isinstance(o, P2POp):
                raise TypeError(f"batch_isend_irecv: entry {i} is {type(o).__name__}, "
                                "not a P2POp or an (op, tensor, peer) tuple")
        if not ops:
            return []
        h = self._p2p([(o.op, o.tensor, o.peer) for o in ops], "batch_isend_irecv")
        return [h] * len(ops)

    def sendrecv(self, send_tensor: torch.Tensor, dst: int, recv_tensor: torch.Tensor,
                 src: int) -> None:
        """One ring step: send to dst and receive from src at once."""
        self._p2p([("send", send_tensor, dst), ("recv", recv_tensor, src)], "sendrecv",
                  blocking=True)

    # -- allgather -------------------------------------------------------------
    def _check_flat(self, send_tensor, recv: torch.Tensor, what: str) -> None:
        """recv as one tensor: send's dtype, world_size times its elements."""
        n = self.world_size
        if not isinstance(send_tensor, torch.Tensor):
            raise TypeError(f"{what}: send_tensor must be a torch.Tensor, got "
                            f"{type(send_tensor).__name__}")
        if recv.dtype != send_tensor.dtype:
            raise ValueError(f"{what}: recv dtype {recv.dtype} != send dtype {send_tensor.dtype}")
        if recv.numel() < n * send_tensor.numel():
            raise ValueError(f"{what}: recv has {recv.numel()} elements; world_size {n} x "
                             f"send's {send_tensor.numel()} = {n * send_tensor.numel()} needed")

    def _recv_chunks(self, send_tensor: torch.Tensor, recv: Any, what: str,
                     uneven: bool) -> list[torch.Tensor]:
        n = self.world_size
        if isinstance(recv, torch.Tensor):
            if uneven:
                raise TypeError(f"{what}: recv_list must be a list of {n} tensors")
            self._check_flat(send_tensor, recv, what)
            _tensor_buf(recv, what)
            k = send_tensor.numel()   # a larger recv keeps what lies past n chunks
            return [recv.reshape(-1)[r * k:(r + 1) * k] for r in range(n)]
        if not isinstance(send_tensor, torch.Tensor):
            raise TypeError(f"{what}: send_tensor must be a torch.Tensor, got "
                            f"{type(send_tensor).__name__}")
        if not isinstance(recv, (list, tuple)):
            raise TypeError(f"{what}: recv must be a tensor or a list of {n} tensors, got "
                            f"{type(recv).__name__}")
        if len(recv) != n:
            raise ValueError(f"{what}: {len(recv)} receive tensors for world_size {n}")
        for r, t in enumerate(recv):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what}: recv[{r}] is {type(t).__name__}, not a tensor")
            if t.dtype != send_tensor.dtype:
                raise ValueError(f"{what}: recv[{r}] dtype {t.dtype} != send dtype "
                                 f"{send_tensor.dtype}")
            if not uneven and t.numel() != send_tensor.numel():
                raise ValueError(f"{what}: recv[{r}] has {t.numel()} elements, send has "
                                 f"{send_tensor.numel()} (use allgatherv for uneven chunks)")
        if recv[self.rank].numel() != send_tensor.numel():
            raise ValueError(f"{what}: recv[{self.rank}] (this rank's chunk) has "
                             f"{recv[self.rank].numel()} elements, send has "
                             f"{send_tensor.numel()}")
        return list(recv)

    def _flat_bufs(self, send_tensor, recv, what: str):
        """Fast path for the common form (recv one tensor): the chunks'
        (ptr, len, mr) computed from one check of each tensor."""
        self._check_flat(send_tensor, recv, what)
        send = self._buf(send_tensor, what)
        base, _, mr = self._buf(recv, what)
        size = send[1]
        return send, [(base + r * size, size, mr) for r in range(self.world_size)]

    def _iallgather(self, send_tensor, recv, algorithm: str, what: str, uneven: bool,
                    async_op: bool = True):
        """Posts the allgather; returns (engine op id, None) when the engine
        runs all of it, else (None, a handle or None) for the stream-ordered
        and mixed-route forms.  With async_op=False the engine part is also
        waited for (in the same call).  Through this engine, the route is
        dispatch.allgather's (rows 7 and 8 of core/dispatch.py)."""
        cm = self._cm()
        algo = _ALGOS.get(algorithm)
        if algo is None:
            raise ValueError(f"{what}: algorithm must be 'auto', 'direct' or 'ring', got "
                             f"{algorithm!r}")
        engine_only = self._engine_only
        if engine_only and not uneven and isinstance(recv, torch.Tensor):
            send, bufs = self._flat_bufs(send_tensor, recv, what)
            return dispatch.allgather(self, cm, (send_tensor, recv), send, bufs, algo, async_op,
                                      True, what)
        chunks = self._recv_chunks(send_tensor, recv, what, uneven)
        send = self._buf(send_tensor, what)
        bufs = [self._buf(c, what) for c in chunks]
        if uneven and not async_op and engine_only:
            self._check_uneven(cm, send[1], [b[1] for b in bufs], what)
        if engine_only:
            return dispatch.allgather(self, cm, [send_tensor, *chunks], send, bufs, algo,
                                      async_op, False, what)
        # Some peers go through torch.distributed (same node, copy engine off).
        n, me = self.world_size, self.rank
        algo = cm.pick_algo(algo, send[1])
        if chunks[me].data_ptr() != send_tensor.data_ptr():
            chunks[me].copy_(send_tensor.reshape(-1).view_as(chunks[me]))
        if algo == _engine.AG_DIRECT:
            entries = [("recv", chunks[r], r) for r in range(n) if r != me]
            entries += [("send", send_tensor, r) for r in range(n) if r != me]
            return None, self._p2p(entries, what)
        # Ring with mixed hops: one step at a time (synchronous).
        left, right = (me - 1) % n, (me + 1) % n
        for s in range(n - 1):
            out_c, in_c = chunks[(me - s) % n], chunks[(me - s - 1) % n]
            self._p2p([("send", out_c, right), ("recv", in_c, left)], what, blocking=True)
        return None, Handle(cm)

    _AGV_MAGIC = 0x7663636c   # b"lccv": a record of _check_uneven's

    def _check_uneven(self, cm: Any, sends: int, expects: list[int], what: str) -> None:
        """Before a blocking allgatherv moves anything: every rank tells
        every other how many bytes it sends and expects from each, so that
        a disagreement raises UcclMismatchError on every rank, naming the
        ranks and sizes (the transfers alone would fail only the two ranks
        of each pair that disagree).  One small allgather more."""
        n, me = self.world_size, self.rank
        rec = torch.tensor([self._AGV_MAGIC, sends, *expects], dtype=torch.int64)
        got = torch.empty(n * (n + 2), dtype=torch.int64)
        base, k = got.data_ptr(), 8 * (n + 2)
        cm.allgather((rec.data_ptr(), k, 0), [(base + r * k, k, 0) for r in range(n)],
                     _engine.AG_DIRECT, False, self.timeout_s, -1, 0)
        rows = got.view(n, n + 2).tolist()
        alien = [r for r in range(n) if rows[r][0] != self._AGV_MAGIC]
        if alien:
            raise UcclMismatchError(f"{what}: rank(s) {alien} are not in an allgatherv (this is "
                                    f"rank {me}); nothing was sent or received")
        bad = [(r, q, rows[r][1], rows[q][2 + r]) for r in range(n) for q in range(n)
               if q != r and rows[q][2 + r] != rows[r][1]]
        if bad:
            shown = "; ".join(f"rank {r} sends {s} bytes, rank {q} expects {x} from it"
                              for r, q, s, x in bad[:8])
            more = f" (and {len(bad) - 8} more)" if len(bad) > 8 else ""
            raise UcclMismatchError(f"{what}: the ranks' chunk sizes disagree (this is rank "
                                    f"{me}): {shown}{more}; nothing was sent or received")

    def iallgather(self, send_tensor: torch.Tensor, recv: Any, algorithm: str = "auto") -> Handle:
        op, handle = self._iallgather(send_tensor, recv, algorithm, "iallgather", False)
        return handle or Handle(self._comm, [op], (), (send_tensor, recv), self._orphans)

    def allgather(self, send_tensor: torch.Tensor, recv: Any, algorithm: str = "auto") -> None:
        # Blocking: this thread advances the operation itself (no handoff),
        # inside the one engine call that submitted it.
        _, handle = self._iallgather(send_tensor, recv, algorithm, "allgather", False, False)
        if handle is not None:
            handle.wait(self.timeout_s)

    def iallgatherv(self, send_tensor: torch.Tensor, recv_list: Sequence[torch.Tensor],
                    algorithm: str = "auto") -> Handle:
        op, handle = self._iallgather(send_tensor, recv_list, algorithm, "iallgatherv", True)
        return handle or Handle(self._comm, [op], (), (send_tensor, recv_list), self._orphans)

    def allgatherv(self, send_tensor: torch.Tensor, recv_list: Sequence[torch.Tensor],
                   algorithm: str = "auto") -> None:
        """recv_list[r] <- rank r's send_tensor.  Every rank's sizes are
        compared first (one small exchange): a disagreement raises
        UcclMismatchError on every rank and moves nothing.  (iallgatherv
        does not wait for the others to compare: there only the ranks
        whose sizes disagree raise.)"""
        _, handle = self._iallgather(send_tensor, recv_list, algorithm, "allgatherv", True, False)
        if handle is not None:
            handle.wait(self.timeout_s)

    def transport_to(self, peer: int) -> str:
        """'tcp', 'shm-cma', 'shm-ring' or 'torch.distributed'."""
        self._check_peer(peer, "transport_to")
        return self.transports.get(peer, "torch.distributed")


# -- the default context and module-level wrappers ------------------------------
_default: CollectiveContext | None = None
_default_lock = threading.Lock()


def init_collective(num_cpus: int = 4, local_gpu_idx: int | None = None,
                    use_copy_engine_for_intra: bool = False, **kwargs) -> CollectiveContext:
    """Make and initialise the default context (CollectiveContext's
    arguments, in upstream's order).  Called again, it replaces the default
    context (finalizing the old one), as upstream does."""
    global _default
    with _default_lock:
        if _default is not None:
            _default.finalize()
            _default = None
        ctx = CollectiveContext(num_cpus, local_gpu_idx, use_copy_engine_for_intra, **kwargs)
        ctx.init()
        _default = ctx
        return ctx


def get_collective() -> CollectiveContext:
    if _default is None:
        raise RuntimeError("no collective context: call init_collective() first")
    return _default


def finalize_collective() -> None:
    global _default
    with _default_lock:
        if _default is not None:
            _default.finalize()
            _default = None


def _wrap(name: str) -> Callable:
    def fn(*args, **kwargs):
        return getattr(get_collective(), name)(*args, **kwargs)
    fn.__name__ = name
    fn.__doc__ = f"{name}(...) on the default context (see CollectiveContext.{name})."
    return fn


register_tensor = _wrap("register_tensor")
deregister_tensor = _wrap("deregister_tensor")
send, recv = _wrap("send"), _wrap("recv")
isend, irecv = _wrap("isend"), _wrap("irecv")
test, wait, wait_all = _wrap("test"), _wrap("wait"), _wrap("wait_all")
batch_isend_irecv = _wrap("batch_isend_irecv")
sendrecv = _wrap("sendrecv")
allgather, iallgather = _wrap("allgather"), _wrap("iallgather")
allgatherv, iallgatherv = _wrap("allgatherv"), _wrap("iallgatherv")
