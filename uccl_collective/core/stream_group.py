"""Stream-ordered exchanges: the GPU collectives of a group whose ranks are
all on this host, queued on a CUDA stream without the host ever waiting for
the GPU (as ProcessGroupNCCL's kernels are).

The protocol is the engine's (csrc/sg/sgroup.h): each operation is one *round*
of a shared page's counters that the ranks' streams write and wait for
(cuStreamWriteValue32 / cuStreamWaitValue32), copies from the peers'
buffers through CUDA IPC, and for reductions one kernel that reads every
rank's buffer in place.  The host only publishes its buffers and waits for
its peers to *arrive* (never for a GPU); a C call does all of a round.  This
module makes the shared page (one file in /dev/shm per group, named through
the context's store) and the group's stream, and gives the backend and
CollectiveContext the calls they make:

- ``StreamGroup.c``: the engine's StreamGroup (allreduce, reduce_scatter,
  allgather, broadcast, reduce, and the general ``round``);
- ``StreamGroup.run``: one general round (publish, pulls, local copies);
- ``StreamCtx``: what the backend's GPU algorithms call on a context
  (allgather, allgather_chunks, _p2p), as rounds of the group, plus the
  reductions the engine's kernel does (allreduce, reduce, reduce_scatter);
- ``stream_args``: the (device, stream) an engine operation on an
  operation's tensors is ordered after.

Which of these a call takes is core/dispatch.py's choice.

A blocking call's round runs on the caller's stream, others on the group's
own stream after an event of the caller's; a round on another stream than
the last starts after it, so the counters only grow.  Failures (a peer that does not arrive
within the timeout, a peer process gone, calls that disagree, a round not
through the stream in time) fail the group for every rank: every stream is
released, and every later call raises with the reason.  A failed group keeps
its page and the peers' memory its pending rounds mapped for the life of
the process: no host wait tells when its stream is past them.
"""
from __future__ import annotations

import collections
import logging
import mmap
import os
import re
import secrets
import threading
from typing import Any, Iterable, Sequence

import ctypes

import torch
import torch.distributed as dist

from .. import _engine
from .._engine import UcclError
from . import config
from .gpu_ring import _name_nvrtc

log = logging.getLogger("uccl_collective")

_NOTICED = re.compile(r"stream-ordered group \(rank (\d+)\)")


def failure(rank: int, err: str) -> str:
    """The group's failure as rank tells it.  The reason in the page starts
    with the prefix of the rank that noticed it; this rank's name goes in
    front of it only once: "stream-ordered group (rank 0): failed at rank
    1: message 3 ...", not the two prefixes nested."""
    m = _NOTICED.match(err)
    if m is None:
        return f"stream-ordered group (rank {rank}): {err}"
    if int(m.group(1)) == rank:
        return err
    return f"stream-ordered group (rank {rank}): failed at rank {m.group(1)}{err[m.end():]}"


R = dist.ReduceOp.RedOpType

TAG_ALL = 0              # a buffer every peer reads
KIND_EXCHANGE = 1        # a general round (its pulls are checked buffer by buffer)

# The raw cudaStream_t of a device's current stream in one call (what Triton
# uses); torch.cuda.current_stream(dev) builds a Stream object through
# several Python layers, a cost paid on every operation on CUDA tensors.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or \
    (lambda dev: torch.cuda.current_stream(dev).cuda_stream)

#: stream_args of an operation with no tensor on a GPU
NO_STREAM = (-1, 0)


def stream_args(tensors: Iterable[Any]) -> tuple[int, int]:
    """(device, stream) the engine orders an operation after: torch's current
    CUDA stream of the tensors' device (the operation starts once the work
    queued there before the call is done, as NCCL's kernels do), or
    NO_STREAM when no tensor is on a GPU.  The CUDA tensors of one operation
    must share a device, as with NCCL, and an operation does not mix CPU and
    CUDA tensors (as neither NCCL nor Gloo does: an allgather of a CUDA send
    tensor into host memory failed on the H100, so it is refused up front)."""
    dev, cpu = -1, False
    for t in tensors:
        if isinstance(t, torch.Tensor):
            if not t.is_cuda:
                cpu = True
                continue
            d = t.device.index
            if dev >= 0 and d != dev:
                raise ValueError(f"one operation's CUDA tensors must be on one device, got "
                                 f"cuda:{dev} and cuda:{d}")
            dev = d
    if dev < 0:
        return NO_STREAM
    if cpu:
        raise ValueError(f"one operation mixes CPU tensors and CUDA tensors (cuda:{dev}); put "
                         "them all on one device")
    return dev, _raw_stream(dev)


#: torch dtypes and reduce operators the engine's reduction kernel handles
DTYPES = {torch.float32: _engine.DT_F32, torch.float64: _engine.DT_F64,
          torch.float16: _engine.DT_F16, torch.bfloat16: _engine.DT_BF16,
          torch.int8: _engine.DT_I8, torch.uint8: _engine.DT_U8, torch.int16: _engine.DT_I16,
          torch.int32: _engine.DT_I32, torch.int64: _engine.DT_I64, torch.bool: _engine.DT_BOOL}
OPS = {R.SUM: _engine.RED_SUM, R.PRODUCT: _engine.RED_PROD, R.MIN: _engine.RED_MIN,
       R.MAX: _engine.RED_MAX, R.BAND: _engine.RED_BAND, R.BOR: _engine.RED_BOR,
       R.BXOR: _engine.RED_BXOR, R.AVG: _engine.RED_AVG}


def tensor_spans(ts: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """(address, bytes) of each tensor (contiguous ones: a round's chunks)."""
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in ts]


def tag_to(dst: int, k: int) -> int:
    """The tag of the k-th buffer of one operation sent to rank dst."""
    return (1 << 40) | (dst << 20) | k


#: messages posted ahead per pair of ranks before a post waits (csrc/sg/sgroup.h)
P2P_SLOTS = _engine.SG_P2P_SLOTS


def eager_bytes() -> int:
    """UCCL_SG_EAGER_BYTES: sends up to this size are staged when the
    sender posts first (complete once staged, as a buffered send); 0: none."""
    return config.get("UCCL_SG_EAGER_BYTES")


def fused_bytes() -> int:
    """UCCL_SG_FUSED_BYTES: all_reduce and allgather of up to this many
    bytes per rank run as one launch that stages the input in an arena the
    peers mapped once (no host wait for the peers; csrc/sg/sg_round.c), in
    groups of up to SG_FUSED_RANKS ranks; 0: never.  The same on every rank."""
    return config.get("UCCL_SG_FUSED_BYTES")


def enabled() -> bool:
    return config.get("UCCL_STREAM_ORDERED")


def capturing(dev: int | None = None) -> bool:
    """Whether the current stream of cuda:dev (None: of the current device)
    captures a CUDA graph."""
    if dev is None or dev == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(dev):
        return torch.cuda.is_current_stream_capturing()


def refuse_capture(dev: int, what: str) -> None:
    """What cannot be captured in a CUDA graph raises before anything is
    queued or published: a collective whose round would run on another
    stream than the capturing one (the group's stream, after an event).  A
    collective that goes straight to the engine (contiguous tensors of one
    device, no other call of the group in progress) runs on the capturing
    stream and is captured, async_op=True too, and so are sends and
    receives, whose pair streams join the capture (csrc/sg/sg_graph.c)."""
    if capturing(dev):
        raise UcclError(f"{what}: the current stream of cuda:{dev} is capturing a CUDA graph, "
                        "and this call's round would run on another stream (uccl captures a "
                        "collective whose tensors are contiguous and on one device, issued "
                        "while no other call of the group is in progress, and send/recv)")


def open_page(kv: Any, key: str, rank: int, size: int) -> tuple[mmap.mmap, Any, int, int]:
    """The group's shared file, mapped: the first rank to get here makes it
    (its name through the store's compare_set; the group is made at the
    first stream-ordered operation, which a send and its receive may be,
    with other ranks never coming), the others open it; unlinked once every
    rank has it open.  Returns (mmap, its ctypes buffer, address, length)."""
    length = _engine.sg_page_bytes(size)
    mine = f"/dev/shm/uccl-sg-{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(mine, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, length)   # sized before anyone can see its name
        name = kv.compare_set(f"{key}/name", "", mine).decode()
        if name != mine:   # another rank's came first
            os.close(fd)
            fd = -1
            os.unlink(mine)
            fd = os.open(name, os.O_RDWR)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    try:
        got = os.fstat(fd).st_size
        if got != length:
            raise UcclError(f"stream group: {name} is {got} bytes, {length} expected (ranks "
                            "disagree on the group size?)")
        mm = mmap.mmap(fd, length)
    finally:
        os.close(fd)
    buf = ctypes.c_char.from_buffer(mm)
    if kv.add(f"{key}/opened", 1) == size:
        os.unlink(name)   # the last to open it: nobody needs the name any more
    return mm, buf, ctypes.addressof(buf), length


#: what failed groups' streams may still touch (the page): never released
_KEPT: list = []


class StreamGroup:
    """The stream-ordered group of a context's ranks on CUDA device dev
    (every rank on this host, reached over shared memory with CUDA IPC).
    emulated: the engine's emulated device instead of CUDA (tests; the
    streams are _engine._sg_emu_stream handles)."""

    def __init__(self, ctx: Any, dev: int, timeout_s: float, emulated: bool = False):
        self.rank, self.size, self.dev, self.timeout_s = ctx.rank, ctx.world_size, dev, timeout_s
        self.emulated = emulated
        # one group per context: the key names no device (the ranks' devices differ
        # where each rank has a GPU of its own)
        self._mm, self._buf, self._base, self._len = open_page(
            ctx._kv, "stream_group", self.rank, self.size)
        self._torch_stream = None
        self._pair_streams: dict[int, Any] = {}   # per peer, made on first use (pair_stream)
        self._future_stream: Any = None
        self._arenas: dict[int, torch.Tensor] = {}   # per peer: staged sends (p2p)
        self._arena_lock = threading.Lock()
        self._eager = eager_bytes()   # read once: posts are a hot path
        self._kernels: dict[int, bool] = {}
        self._lock = threading.Lock()
        self._held: collections.deque = collections.deque()   # (event, tensors): hold()
        self._held_lock = threading.Lock()
        fused = fused_bytes()   # a bad value raises before anything is made
        self._fused: torch.Tensor | None = None
        try:
            if emulated:
                self.stream = _engine._sg_emu_stream()
            else:
                _engine._gpu_host_register(dev, self._base, self._len)
                self._torch_stream = torch.cuda.Stream(dev)
                self.stream = self._torch_stream.cuda_stream
                _name_nvrtc()   # where the reduction kernel's compiler is
            self.c = _engine.StreamGroup(None if emulated else ctx._ep(), list(ctx._conns[0]),
                                         self.rank, self.size, dev, self._base, self._len,
                                         float(timeout_s), self.stream, owner=self._mm)
            self._fused = self._fused_arena(fused)
        except BaseException:
            self._release_page(False)
            raise

    def _fused_arena(self, nb: int) -> torch.Tensor | None:
        """The arena of one-launch rounds (two slots of nb bytes and two
        counters, zeroed), kept until close: the peers map it."""
        if not nb or self.size > _engine.SG_FUSED_RANKS:
            return None
        slot = (nb + 15) // 16 * 16
        arena = torch.zeros(2 * slot + _engine.SG_FUSED_TAIL, dtype=torch.uint8,
                            device="cpu" if self.emulated else torch.device("cuda", self.dev))
        if not self.emulated:
            torch.cuda.synchronize(self.dev)   # zeroed before any round's launch reads it
        self.c.fused_arena(arena.data_ptr(), arena.numel(), slot)
        return arena

    @property
    def torch_stream(self) -> Any:
        """The group's stream as a torch Stream (CUDA only)."""
        return self._torch_stream

    def hold(self, event: Any, tensors: Any) -> None:
        """Keep tensors alive until event (recorded on the group's stream
        after their last use there) has completed, so that memory the
        caller frees meanwhile is not handed out again while the stream
        still reads or writes it.  This is what Tensor.record_stream did
        here; torch.compile cannot trace record_stream (an operator whose
        output aliases its input), and NCCL's process group keeps the
        tensors in its Work instead for the same reason.  Those held are
        let go, oldest first, at the next hold() whose events completed."""
        with self._held_lock:
            q = self._held
            while q and q[0][0].query():
                q.popleft()
            q.append((event, tuple(tensors)))

    # -- what the engine's kernel reduces ----------------------------------------
    def reduce_codes(self, dtype: torch.dtype, op: Any) -> tuple[int, int] | None:
        """(dtype, operator) codes of the engine's reduction kernel for op (a
        RedOpType, as _reduce.op_type gives), or None
        where the kernel does not apply (another dtype or operator, or no
        compiler: the callers then reduce with torch ops)."""
        dt, opc = DTYPES.get(dtype), OPS.get(op)
        if dt is None or opc is None:
            return None
        ok = self._kernels.get(dt)
        if ok is None:
            try:
                self.c.kernel_ready(dt)
                ok = True
            except (UcclError, ValueError) as e:
                log.warning("uccl: no reduction kernel for %s (%s); reducing with torch ops",
                            dtype, e)
                ok = False
            self._kernels[dt] = ok
        return (dt, opc) if ok else None

    # -- a general round ------------------------------------------------------------
    def run(self, caller: int, publish: Sequence[tuple[int, int, int]],
            pulls: Sequence[tuple[int, int, int, int]],
            local: Sequence[tuple[int, int, int]] = (), what: str = "exchange") -> int:
        """Queue one round after the work on stream `caller`: peers may read
        publish's buffers (tag, ptr, nbytes); this rank copies, for each
        pull (peer, tag, dst_ptr, nbytes), the buffer rank `peer` published
        under `tag` (of exactly nbytes) to dst_ptr, and each local copy
        (dst, src, nbytes).  The caller's stream waits for the round's end
        (unless it is the group's own).  Returns the round's number."""
        pull = [(peer, 1, True, tag, 0, dst, nb) for peer, tag, dst, nb in pulls]
        return self.c.round(*self.order(caller), 0, what, KIND_EXCHANGE, 0, 1, list(publish),
                            pull, list(local), None)

    def order(self, caller: int) -> tuple[int, bool]:
        """(caller, caller_waits) of a round after the work on stream caller:
        the caller's stream waits for it (the round runs there) unless it is
        the group's own stream."""
        return caller, caller != self.stream

    # -- point to point ---------------------------------------------------------------
    def pair_stream(self, peer: int) -> int:
        """The stream this rank's messages with peer (both ways) run on, in
        the order they were posted, as NCCL's per-pair streams (made on
        first use; csrc/sg/sg_p2p.c says why the order matters)."""
        s = self._pair_streams.get(peer)
        if s is None:
            with self._lock:
                s = self._pair_streams.get(peer)
                if s is None:
                    s = self._pair_streams[peer] = (
                        _engine._sg_emu_stream() if self.emulated else torch.cuda.Stream(self.dev))
        return s if self.emulated else s.cuda_stream

    def future_stream(self) -> Any:
        """A torch stream of the group's that only waits (for messages a
        CUDA future of a P2PWork stands for): torch records the future's
        events on it."""
        with self._lock:
            if self._future_stream is None:
                self._future_stream = torch.cuda.Stream(self.dev)
            return self._future_stream

    def p2p(self, caller: int, msgs: Sequence[tuple[int, bool, int, int]]) -> list[int]:
        """Post messages (peer, send?, ptr, nbytes) in order, after the work
        on stream `caller`; no host wait (but for P2P_SLOTS messages ahead
        of a peer).  Returns a code per message for p2p_wait / p2p_passed.
        A send of up to eager_bytes() (read when the group was made) is
        staged when posted first (the peer's arena is made at the first
        such send)."""
        eager = self._eager
        out = []
        for peer, send, ptr, nb in msgs:
            # not while capturing: a captured send is never staged, and the
            # arena would come from the graph's memory pool
            if send and 0 < nb <= eager and peer not in self._arenas and \
                    not (self._torch_stream is not None and capturing(self.dev)):
                self._make_arena(peer, eager)
            ok = isinstance(peer, int) and 0 <= peer < self.size and peer != self.rank
            out.append((peer, send, ptr, nb, self.pair_stream(peer) if ok else 0))
        return self.c.p2p(caller, out)

    def all_to_all(self, caller: int, sends: Sequence[tuple[int, int]],
                   recvs: Sequence[tuple[int, int]]) -> int:
        """all_to_all as one round after the work on stream `caller`:
        sends[j] and recvs[j], (ptr, nbytes), go to and come from rank j,
        this rank's own chunk copied in the round (the engine's
        uccl_sg_all_to_all: every rank publishes its chunk for each peer and
        pulls its own from each, of exactly the size it expects; a pair
        whose sizes differ fails the group, naming both sides; an empty
        chunk still pairs with the peer's; its kind is its own, so a rank in
        a gather or scatter does not meet it).  The backend's fast path and
        its exchange task run the same round.  The caller's stream waits
        for its end (unless it is the group's own).  Returns the round's
        number."""
        return self.c.all_to_all(*self.order(caller), 0, sends, recvs)

    def _make_arena(self, peer: int, eager: int) -> None:
        with self._arena_lock:   # one per peer, whichever thread sends first
            if peer in self._arenas:
                return
            nb = P2P_SLOTS * ((eager + 255) // 256 * 256)
            dev = "cpu" if self.emulated else torch.device("cuda", self.dev)
            arena = torch.empty(nb, dtype=torch.uint8, device=dev)
            self.c.p2p_arena(peer, arena.data_ptr(), nb)
            self._arenas[peer] = arena   # kept until close (the peer maps it)

    # -- failure ---------------------------------------------------------------------
    def error(self) -> str | None:
        """Why the group failed (this rank or another noticed), or None."""
        return self.c.error()

    def check(self) -> None:
        err = self.c.error()
        if err is not None:
            raise UcclError(failure(self.rank, err))

    def fail(self, why: str) -> None:
        self.c.fail(why)

    def close(self) -> None:
        with self._lock:
            c, self.c = getattr(self, "c", None), None
        if c is None:
            return
        ok = c.close()
        with self._held_lock:   # close waited for the stream (ok), else they stay
            if not ok:
                _KEPT.append(tuple(self._held))
            self._held.clear()
        if ok:
            self._arenas.clear()
            self._fused = None
        else:   # peers' streams may still copy out of them
            _KEPT.append((self._arenas, self._fused))
        if self.emulated:
            _engine._sg_emu_stream_free(self.stream)
            for s in self._pair_streams.values():
                _engine._sg_emu_stream_free(s)
        self._release_page(ok)

    def _release_page(self, ok: bool) -> None:
        if not ok:
            # this rank's stream may still write into the page: it stays for
            # the life of the process
            _KEPT.append((self._mm, self._buf))
            return
        if not self.emulated:
            try:
                _engine._gpu_host_unregister(self.dev, self._base)
            except Exception:
                pass   # CUDA is being torn down at exit
        del self._buf
        try:
            self._mm.close()
        except BufferError:
            pass


class StreamCtx:
    """What the backend's GPU algorithms call on a context (allgather,
    _p2p, allgather_chunks, and the reductions), as rounds of a StreamGroup
    queued after the current stream's work."""

    def __init__(self, ctx: Any, group: StreamGroup):
        self._ctx, self._g = ctx, group
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.timeout_s = ctx.timeout_s

    def _stream(self) -> int:
        return _raw_stream(self._g.dev)

    def _at(self) -> tuple[int, bool]:
        """(caller, caller_waits) for a round after the current stream's work."""
        return self._g.order(_raw_stream(self._g.dev))

    def allgather(self, send: torch.Tensor, recv: Any, algorithm: str = "auto") -> None:
        n, me = self.world_size, self.rank
        nb = send.numel() * send.element_size()
        if isinstance(recv, torch.Tensor):   # one flat tensor of n chunks
            if recv.numel() * recv.element_size() != n * nb:
                raise ValueError(f"allgather: output holds {recv.numel() * recv.element_size()} "
                                 f"bytes; group size {n} x input's {nb} expected")
            self._g.c.allgather(*self._at(), 0, send.data_ptr(), nb, recv.data_ptr())
            return
        outs = list(recv)
        if len(outs) != n:
            raise ValueError(f"allgather: {len(outs)} outputs for a group of {n}")
        for r, o in enumerate(outs):
            if o.numel() * o.element_size() != nb:
                raise ValueError(f"allgather: output {r} holds {o.numel() * o.element_size()} "
                                 f"bytes, the input {nb}")
        src = send.data_ptr()
        self._g.run(self._stream(), [(TAG_ALL, src, nb)],
                    [(r, TAG_ALL, outs[r].data_ptr(), nb) for r in range(n) if r != me],
                    [(outs[me].data_ptr(), src, nb)], "allgather")

    def allgather_chunks(self, flat: torch.Tensor, chunk: Sequence[tuple[int, int]]) -> None:
        """In place: every rank's flat[chunk[me]] to every rank."""
        esz, base, me = flat.element_size(), flat.data_ptr(), self.rank
        a, b = chunk[me]
        self._g.run(self._stream(), [(TAG_ALL, base + a * esz, (b - a) * esz)],
                    [(r, TAG_ALL, base + s * esz, (e - s) * esz)
                     for r, (s, e) in enumerate(chunk) if r != me], (), "allgather")

    def all_to_all(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]) -> None:
        """sends[r] to rank r, recvs[r] from rank r (contiguous): the round
        a blocking all_to_all posts from its thread (StreamGroup.all_to_all;
        the engine names it in its errors)."""
        self._g.all_to_all(self._stream(), tensor_spans(sends), tensor_spans(recvs))

    def _p2p(self, entries: Sequence[tuple[str, torch.Tensor, int]], what: str,
             blocking: bool = True) -> None:
        """Sends and receives of one operation (contiguous tensors): the k-th
        send to a rank matches its k-th receive from this one."""
        publish, pulls = [], []
        sent: dict[int, int] = {}
        got: dict[int, int] = {}
        for kind, t, peer in entries:
            nb = t.numel() * t.element_size()
            if kind == "send":
                k = sent[peer] = sent.get(peer, -1) + 1
                publish.append((tag_to(peer, k), t.data_ptr(), nb))
            else:
                k = got[peer] = got.get(peer, -1) + 1
                pulls.append((peer, tag_to(self.rank, k), t.data_ptr(), nb))
        self._g.run(self._stream(), publish, pulls, (), what)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        """t (contiguous) <- the root's t: the engine's broadcast round, the
        same one a blocking call's fast path makes (ranks may take either)."""
        self._g.c.broadcast(*self._at(), 0, t.data_ptr(), t.numel() * t.element_size(), root)

    # -- reductions: the engine's kernel where it applies -------------------------------
    # Each returns True once its round is queued, or False, queuing nothing,
    # where the kernel does not apply (a dtype or operator it lacks, no
    # compiler): the caller then reduces with torch ops on the stream
    # (backend/_reduce_gpu.py), as every rank does alike, since the kernel's
    # availability is the same on all of them.
    def allreduce(self, flat: torch.Tensor, op: Any, scratch) -> bool:
        """flat (contiguous, 1-D) <- its reduction over the group, in place."""
        codes = self._g.reduce_codes(flat.dtype, op)
        if codes is None:
            return False
        self._g.c.allreduce(*self._at(), 0, flat.data_ptr(), flat.numel(), *codes)
        return True

    def reduce(self, flat: torch.Tensor, op: Any, root: int, scratch) -> bool:
        """The root's flat (contiguous, 1-D) <- the reduction over the group
        (the others' only read): the engine's reduce round, as a blocking
        call's fast path makes, where its kernel applies (else the caller
        all-reduces)."""
        codes = self._g.reduce_codes(flat.dtype, op)
        if codes is None:
            return False
        self._g.c.reduce(*self._at(), 0, flat.data_ptr(), flat.numel(), *codes, root)
        return True

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, op: Any, scratch,
                       what: str) -> bool:
        """out (contiguous) <- this rank's chunk of the reduction of flat."""
        codes = self._g.reduce_codes(flat.dtype, op)
        if codes is None:
            return False
        self._g.c.reduce_scatter(*self._at(), 0, out.data_ptr(), flat.data_ptr(), out.numel(),
                                 *codes)
        return True
