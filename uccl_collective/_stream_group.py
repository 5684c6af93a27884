"""Stream-ordered exchanges: the backend's GPU collectives where every rank
of the group is on this host, queued on a CUDA stream without the host ever
waiting for the GPU (as ProcessGroupNCCL's kernels are).

Each operation is one or more *rounds*.  In round k every rank
1. queues on its stream a write of k to its ``ready`` word, so peers start
   reading its buffers only once the work queued ahead of the operation is
   done;
2. publishes, in a slot of its part of a shared page, the buffers peers may
   read (the key of each buffer's registration, its address and length,
   and a tag saying whom it is for);
3. reads every peer's slot of round k (the host waits here for the peers to
   *arrive*, never for a GPU), maps what it needs (CUDA IPC, checked against
   the owner's export record: uccl_ep_ipc_map), and queues: a wait for each
   peer's ``ready`` >= k, its copies, a write of k to its ``done`` word, a
   wait for every peer's ``done`` >= k (so no rank's later work overwrites a
   buffer a peer is still reading), and a write of k to its ``fin`` word.

The words live in page-locked host memory that every rank maps (one file in
/dev/shm per group, registered with CUDA in each process); streams write
and wait for them with cuStreamWriteValue32 / cuStreamWaitValue32.  Nothing
a process queues after such a wait is needed to end it (only the peers'
streams, whose writes never wait for anything queued later), so the waits
cannot hold their own release behind them in the few hardware queues CUDA
maps streams onto, which is what hung the earlier host-flag design (README,
"GPU tensors").

Failures: a peer that does not arrive within the group's timeout, a
mismatch between what one rank sends and another receives, or a rank whose
stream has not passed a round within the timeout (a peer that died after
arriving) fail the group: every rank's words are set far ahead so no stream
anywhere stays blocked, a flag in the page tells the other ranks at once,
and every later call raises with the reason.  The watchdog thread that
notices stalled rounds also releases, once a round is behind the stream,
the peers' memory it mapped.  This rank's own buffers stay registered
while their memory is the allocation registered (an LRU of REG_CACHE).

The page's words are written by one side each: ready/done/fin by the
owner's stream, consumed and the slots by the owner's host; the host
reads them with aligned 4- and 8-byte loads, which x86 performs whole and
in program order (the round of a slot is stored last, alone).
"""
from __future__ import annotations

import collections
import ctypes
import mmap
import os
import secrets
import struct
import threading
import time
from typing import Any, Callable, Sequence

import torch

from . import _engine
from .p2p import UcclError, UcclTimeoutError

PAGE = 4096              # the group's first page: failed flag (u32), then the reason at 8
REASON = 448
RANK_BYTES = 5 * PAGE    # per rank: words, then the descriptor slots
OFF_READY, OFF_DONE, OFF_FIN = 0, 64, 128      # u32 words the streams write
OFF_CONSUMED, OFF_PID = 192, 200               # u64 words the host writes
OFF_SLOTS = 256
NSLOT = 4
SLOT_BYTES = (RANK_BYTES - OFF_SLOTS) // NSLOT
ENTRY = struct.Struct("<QQQQ")                # tag, key, addr, len
SLOT_HEAD = 16           # a slot's entry count (u32) at 0, its round (u64) at 8, then entries
MAX_ENTRIES = (SLOT_BYTES - SLOT_HEAD) // ENTRY.size
U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")
RELEASE_AHEAD = 1 << 30  # words set this far past the last round let every wait pass

TAG_ALL = 0              # a buffer every peer reads

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or \
    (lambda dev: torch.cuda.current_stream(dev).cuda_stream)


def tag_to(dst: int, k: int) -> int:
    """The tag of the k-th buffer of one operation sent to rank dst."""
    return (1 << 40) | (dst << 20) | k


def _ahead(a: int, b: int) -> bool:
    """a >= b for round numbers compared as the streams compare them
    (cyclic, 32-bit)."""
    return ((a - b) & 0xFFFFFFFF) < 0x80000000


def enabled() -> bool:
    return os.environ.get("UCCL_STREAM_ORDERED", "1") != "0"



class StreamGroup:
    """The stream-ordered exchanges of one process group on one CUDA device
    (every rank on this host, reached over shared memory with CUDA IPC)."""

    def __init__(self, ctx: Any, dev: int, timeout_s: float):
        self._ctx, self.dev, self.timeout_s = ctx, dev, timeout_s
        self.rank, self.size = ctx.rank, ctx.world_size
        self._ep = ctx._ep()
        self._conn = list(ctx._conns[0])   # the send connection to each peer
        self._round = 0
        self._pending: list[tuple[int, float, list]] = []   # round, time, mappings
        # registrations of this rank's buffers, reused while their memory is
        # the same allocation: (ptr, nbytes) -> [mr, key, last round used]
        self._regs: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()      # _pending and the failure
        self._error: str | None = None
        self._closed = False
        self._map_open()
        self._watch = threading.Thread(target=self._watchdog, daemon=True,
                                       name=f"uccl-stream-watch-r{self.rank}")
        self._watch_cv = threading.Condition(self._lock)
        self._watch.start()

    # -- the shared page ---------------------------------------------------------
    def _map_open(self) -> None:
        """Rank 0 makes the file; the others open it (its name through the
        context's store); every rank maps it and registers it with CUDA; the
        file is unlinked once all have it open."""
        kv, n, me = self._ctx._kv, self.size, self.rank
        key = f"stream_group/{self.dev}"
        length = PAGE + n * RANK_BYTES
        if me == 0:
            name = f"/dev/shm/uccl-sg-{os.getpid()}-{secrets.token_hex(8)}"
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, length)
            kv.set(f"{key}/name", name)
        else:
            name = kv.get(f"{key}/name").decode()
            fd = os.open(name, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != length:
                raise UcclError(f"stream group: {name} is {os.fstat(fd).st_size} bytes, "
                                f"{length} expected (ranks disagree on the group size?)")
            self._mm = mmap.mmap(fd, length)
        finally:
            os.close(fd)
        self._buf = ctypes.c_char.from_buffer(self._mm)
        self._base = ctypes.addressof(self._buf)
        self._rank_off = [PAGE + r * RANK_BYTES for r in range(n)]
        U64.pack_into(self._mm, self._rank_off[me] + OFF_PID, os.getpid())
        _engine._gpu_host_register(self.dev, self._base, length)
        if kv.add(f"{key}/opened", 1) == n:
            os.unlink(name)   # the last to open it: nobody needs the name any more

    def _word(self, r: int, off: int) -> int:
        return self._base + self._rank_off[r] + off

    def _slot(self, r: int, k: int) -> int:
        """Where rank r's descriptor slot of round k is in the page."""
        return self._rank_off[r] + OFF_SLOTS + (k % NSLOT) * SLOT_BYTES

    def _wait_all(self, off: int, k: int) -> list:
        """Stream ops: wait until every peer's word at off reaches k."""
        return [("a", self._word(r, off), k) for r in range(self.size) if r != self.rank]

    def _u32(self, r: int, off: int) -> int:
        return U32.unpack_from(self._mm, self._rank_off[r] + off)[0]

    def _u64(self, r: int, off: int) -> int:
        return U64.unpack_from(self._mm, self._rank_off[r] + off)[0]

    # -- failure -----------------------------------------------------------------
    def error(self) -> str | None:
        """Why the group failed (this rank or another noticed), or None."""
        if self._error is None and U32.unpack_from(self._mm, 0)[0]:
            raw = bytes(self._mm[8:8 + REASON]).split(b"\0", 1)[0]
            self._error = raw.decode(errors="replace") or "another rank failed the group"
        return self._error

    def check(self) -> None:
        err = self.error()
        if err is not None:
            raise UcclError(f"stream-ordered group (rank {self.rank}): {err}")

    def fail(self, why: str) -> None:
        """Fail the group for every rank: the reason in the page, and every
        stream's words set far ahead so that no stream stays blocked."""
        with self._lock:
            if self._error is None:
                self._error = why
                if not U32.unpack_from(self._mm, 0)[0]:
                    self._mm[8:8 + REASON] = why.encode()[:REASON - 1].ljust(REASON, b"\0")
                    U32.pack_into(self._mm, 0, 1)
            self._release()
            self._watch_cv.notify_all()

    def _release(self) -> None:
        """Every rank's words far past any round.  Done again while rounds
        are pending after a failure: a live rank's stream may still write
        the rounds it had queued, lowering a word a stream waits on."""
        far = (self._round + RELEASE_AHEAD) & 0xFFFFFFFF
        for r in range(self.size):
            for off in (OFF_READY, OFF_DONE, OFF_FIN):
                U32.pack_into(self._mm, self._rank_off[r] + off, far)

    # -- waiting for peers on the host ------------------------------------------------
    def _gone(self) -> list[int]:
        """The peers whose process has exited."""
        return [r for r in range(self.size)
                if r != self.rank and not _alive(self._u64(r, OFF_PID))]

    def _spin(self, ready: Callable[[], bool], what: str, deadline: float) -> None:
        spins = 0
        while not ready():
            spins += 1
            if spins & 63 == 0:
                self.check()
                now = time.monotonic()
                gone = self._gone() if spins & 4095 == 0 else []
                if gone:
                    msg = f"{what}: rank(s) {gone} exited"
                    self.fail(msg)
                    raise UcclError(f"stream-ordered group (rank {self.rank}): {msg}")
                if now > deadline:
                    msg = f"{what}: not within the group's timeout ({self.timeout_s:g} s)"
                    self.fail(msg)
                    raise UcclTimeoutError(f"stream-ordered group (rank {self.rank}): {msg}")
                time.sleep(0 if spins < 4096 else 50e-6)

    # -- one round -----------------------------------------------------------------
    def run(self, stream: int, publish: Sequence[tuple[int, int, int]],
            pulls: Sequence[tuple[int, int, int, int]],
            local: Sequence[tuple[int, int, int]] = (), what: str = "exchange") -> None:
        """Queue one round on `stream`: peers may read publish's buffers
        (tag, ptr, nbytes); this rank copies, for each pull (peer, tag,
        dst_ptr, nbytes), the buffer rank `peer` published under `tag` (of
        exactly nbytes) to dst_ptr, and each local copy (dst, src, nbytes).
        Returns once all of it is queued."""
        self.check()
        n, me, dev = self.size, self.rank, self.dev
        k = (self._round + 1) & 0xFFFFFFFF or 1
        deadline = time.monotonic() + self.timeout_s
        entries = [(tag, p, nb) for tag, p, nb in publish if nb > 0]
        if len(entries) > MAX_ENTRIES:
            raise ValueError(f"{what}: {len(entries)} buffers in one round (at most "
                             f"{MAX_ENTRIES})")
        # the slot of round k was last used by round k - NSLOT: every peer has read it
        self._spin(lambda: all(_ahead(self._u64(r, OFF_CONSUMED), k - NSLOT)
                               for r in range(n) if r != me),
                   f"{what}: peers reading round {k - NSLOT}", deadline)
        desc = [(tag, self._key(p, nb, k), p, nb) for tag, p, nb in entries]
        mappings: list = []
        self._round = k
        with self._lock:
            if not self._pending:
                self._watch_cv.notify_all()
            self._pending.append((k, time.monotonic(), mappings))
        ops: list = [("w", self._word(me, OFF_READY), k)]
        _engine._gpu_stream_ops(dev, stream, ops)
        slot = self._slot(me, k)
        for i, e in enumerate(desc):
            ENTRY.pack_into(self._mm, slot + SLOT_HEAD + i * ENTRY.size, *e)
        # the round alone and last (x86 keeps stores in order, and an aligned
        # 8-byte store whole): a peer that sees it sees the entries and count
        U32.pack_into(self._mm, slot, len(desc))
        U64.pack_into(self._mm, slot + 8, k)
        try:
            ops = self._pull_ops(k, pulls, mappings, deadline, what)
        except BaseException as e:
            if not isinstance(e, UcclTimeoutError):
                self.fail(f"{what} (round {k}): {e}")
            raise
        ops += [("c", d, s, nb) for d, s, nb in local if nb > 0 and d != s]
        ops.append(("w", self._word(me, OFF_DONE), k))
        ops += self._wait_all(OFF_DONE, k)
        ops.append(("w", self._word(me, OFF_FIN), k))
        try:
            _engine._gpu_stream_ops(dev, stream, ops)
        except BaseException as e:
            self.fail(f"{what} (round {k}): queueing on the stream failed: {e}")
            raise

    REG_CACHE = 64

    def _key(self, ptr: int, nb: int, k: int) -> int:
        """The key peers map [ptr, +nb) by, from a registration made once
        and reused while the memory is the allocation it registered (the
        engine checks that at every use: a freed and reused address fails
        the check and is registered anew)."""
        ent = self._regs.get((ptr, nb))
        if ent is not None:
            try:
                ent[1] = _engine._ipc_key(self._ep, self._any_conn(), ent[0], ptr, nb)
            except UcclError:
                del self._regs[(ptr, nb)]
                self._dereg(ent[0])
                ent = None
        if ent is None:
            mr = self._ep.reg(ptr, nb)[1]
            try:
                key = _engine._ipc_key(self._ep, self._any_conn(), mr, ptr, nb)
            except BaseException:
                self._dereg(mr)
                raise
            ent = self._regs[(ptr, nb)] = [mr, key, k]
            self._evict()
        self._regs.move_to_end((ptr, nb))
        ent[2] = k
        return ent[1]

    def _evict(self) -> None:
        """Past REG_CACHE registrations: drop the least recently used ones
        that every peer has read the keys of (so none is still to map one)."""
        if len(self._regs) <= self.REG_CACHE:
            return
        read = min((self._u64(r, OFF_CONSUMED) for r in range(self.size) if r != self.rank),
                   default=self._round)
        for pk in list(self._regs):
            if len(self._regs) <= self.REG_CACHE:
                break
            if _ahead(read, self._regs[pk][2]):
                self._dereg(self._regs.pop(pk)[0])

    def _dereg(self, mr: int) -> None:
        try:
            self._ep.dereg(mr)
        except Exception:
            pass   # the endpoint is closing: it frees its registrations

    def _any_conn(self) -> int:
        return self._conn[(self.rank + 1) % self.size]

    def _pull_ops(self, k: int, pulls, mappings: list, deadline: float, what: str) -> list:
        n, me = self.size, self.rank
        got: dict[int, dict[int, tuple[int, int, int]]] = {}
        for r in range(n):
            if r == me:
                continue
            slot = self._slot(r, k)
            self._spin(lambda: U64.unpack_from(self._mm, slot + 8)[0] == k,
                       f"{what}: rank {r} arriving at round {k}", deadline)
            count = U32.unpack_from(self._mm, slot)[0]
            if count > MAX_ENTRIES:
                raise UcclError(f"rank {r} published {count} buffers (at most {MAX_ENTRIES})")
            got[r] = {}
            for i in range(count):
                tag, key, addr, nb = ENTRY.unpack_from(self._mm, slot + SLOT_HEAD + i * ENTRY.size)
                got[r][tag] = (key, addr, nb)
        ops: list = self._wait_all(OFF_READY, k) if any(nb for *_x, nb in pulls) else []
        for peer, tag, dst, nb in pulls:
            if nb == 0:
                continue
            have = got.get(peer, {}).get(tag)
            if have is None:
                raise UcclError(f"rank {peer} published nothing for this rank to receive "
                                f"{nb} bytes from (tag {tag:#x}): the ranks' calls disagree")
            key, addr, pnb = have
            if pnb != nb:
                raise UcclError(f"rank {peer} sends {pnb} bytes where this rank receives {nb}")
            ptr, mapping = _engine._ipc_map(self._ep, self._conn[peer], key, addr, nb, self.dev)
            mappings.append(mapping)
            ops.append(("c", dst, ptr, nb))
        # every peer's buffers this round are read and mapped: their slots may be reused
        U64.pack_into(self._mm, self._rank_off[me] + OFF_CONSUMED, k)
        return ops

    # -- after the stream -----------------------------------------------------------
    def _reclaim(self) -> None:
        """Release the peers' memory that rounds behind this rank's stream
        mapped (its fin word passed them).  Not once the group failed: fin
        may then be the release's value, with copies still queued."""
        fin = self._u32(self.rank, OFF_FIN)
        if self.error() is not None:   # read after fin: a release's fin comes after its flag
            return
        done = []
        with self._lock:
            while self._pending and _ahead(fin, self._pending[0][0]):
                done.append(self._pending.pop(0))
        for _k, _t, mappings in done:
            mappings.clear()

    def _watchdog(self) -> None:
        try:
            self._watch_loop()
        except ValueError:
            pass   # the page was unmapped by a close() that stopped waiting for us

    def _watch_loop(self) -> None:
        """While rounds are pending: release what rounds behind the stream
        held; fail the group if the oldest one has not passed this rank's
        stream within the timeout, or a peer process is gone; once the group
        failed (here or at another rank), keep every stream released."""
        while True:
            with self._lock:
                while not self._closed and not self._pending:
                    self._watch_cv.wait()
                if self._closed:
                    return
                oldest = self._pending[0]
                self._watch_cv.wait(0.02)
            if self.error() is not None:
                with self._lock:
                    self._release()
                self._reclaim()
                continue
            self._reclaim()
            with self._lock:
                if not self._pending or self._pending[0] is not oldest:
                    continue
            k, t0, _m = oldest
            gone = self._gone()
            if gone or time.monotonic() - t0 > self.timeout_s:
                lag = {r: (self._u32(r, OFF_READY), self._u32(r, OFF_DONE))
                       for r in range(self.size)}
                why = (f"rank(s) {gone} exited" if gone else
                       f"round {k} not through this rank's stream within "
                       f"{self.timeout_s:g} s")
                self.fail(f"{why} (ready/done words by rank: {lag})")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._watch_cv.notify_all()
        self._watch.join(timeout=2.0)
        # the copies of rounds still queued read through their mappings: wait
        # (on the host, bounded) until this rank's stream is past them
        if self._pending:
            last, until = self._pending[-1][0], time.monotonic() + self.timeout_s
            while not _ahead(self._u32(self.rank, OFF_FIN), last):
                if time.monotonic() > until:
                    self.fail("closed with rounds still queued that did not finish")
                    break
                time.sleep(1e-3)
        pending, self._pending = self._pending, []
        regs, self._regs = self._regs, collections.OrderedDict()
        for mr, _key, _k in regs.values():
            self._dereg(mr)
        if self.error() is not None:
            # this rank's stream may still run copies through the mappings and
            # write into the page: both stay for the life of the process
            _KEPT.append((pending, self._mm, self._buf))
            return
        for _k, _t, mappings in pending:
            mappings.clear()
        try:
            _engine._gpu_host_unregister(self.dev, self._base)
        except Exception:
            pass   # CUDA is being torn down at exit
        del self._buf
        try:
            self._mm.close()
        except BufferError:
            pass


#: what failed groups' streams may still touch (mappings of peers' memory,
#: the page): never released, since no host wait tells when they are done
_KEPT: list = []


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True   # not written yet
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StreamCtx:
    """What the backend's GPU algorithms call on a context (allgather,
    _p2p, allgather_chunks), as rounds of a StreamGroup on the current
    stream."""

    def __init__(self, ctx: Any, group: StreamGroup):
        self._ctx, self._g = ctx, group
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.timeout_s = ctx.timeout_s

    def _stream(self) -> int:
        return _raw_stream(self._g.dev)

    def allgather(self, send: torch.Tensor, recv: Any, algorithm: str = "auto") -> None:
        n, me = self.world_size, self.rank
        nb = send.numel() * send.element_size()
        if isinstance(recv, torch.Tensor):   # one flat tensor of n chunks
            if recv.numel() * recv.element_size() != n * nb:
                raise ValueError(f"allgather: output holds {recv.numel() * recv.element_size()} "
                                 f"bytes; group size {n} x input's {nb} expected")
            base = recv.data_ptr()
            self._g.run(self._stream(), [(TAG_ALL, send.data_ptr(), nb)],
                        [(r, TAG_ALL, base + r * nb, nb) for r in range(n) if r != me],
                        [(base + me * nb, send.data_ptr(), nb)], "allgather")
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
