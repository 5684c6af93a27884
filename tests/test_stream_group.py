"""The stream-ordered exchanges' protocol (uccl_collective/_stream_group.py)
on the CPU: ranks are threads of this process, the shared page is the real
one (a file in /dev/shm), and each rank's CUDA stream is emulated by a
thread that runs the queued writes, waits and copies in order.  The CUDA
calls themselves (cuStreamWriteValue32 and friends, CUDA IPC) run on the
GPU machine: tests/test_gpu_collective.py drives the same code through the
backend there."""
from __future__ import annotations

import ctypes
import queue
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from uccl_collective import _stream_group as sgm
from uccl_collective.p2p import UcclError

STUCK_S = 20.0   # an emulated stream wait longer than this fails the test


class Store:
    """torch's store calls that StreamGroup makes, for threads."""

    def __init__(self):
        self._d, self._cv = {}, threading.Condition()

    def set(self, k, v):
        with self._cv:
            self._d[k] = v.encode() if isinstance(v, str) else v
            self._cv.notify_all()

    def get(self, k):
        with self._cv:
            assert self._cv.wait_for(lambda: k in self._d, 10), f"store key {k} never set"
            return self._d[k]

    def add(self, k, n):
        with self._cv:
            self._d[k] = int(self._d.get(k, 0)) + n
            return self._d[k]


class Job:
    """What the fake engine knows: every rank's registrations."""

    def __init__(self):
        self.lock = threading.Lock()
        self.regs: dict[int, tuple[int, int, int]] = {}   # mr -> (rank, ptr, len)
        self.next_mr = 1
        self.reg_calls = [0] * 8
        self.dereg_calls = [0] * 8


class Ep:
    def __init__(self, job: Job, rank: int):
        self.job, self.rank = job, rank

    def reg(self, ptr, nb):
        with self.job.lock:
            mr = self.job.next_mr
            self.job.next_mr += 1
            self.job.regs[mr] = (self.rank, ptr, nb)
            self.job.reg_calls[self.rank] += 1
        return True, mr

    def dereg(self, mr):
        with self.job.lock:
            assert self.job.regs.pop(mr)[0] == self.rank
            self.job.dereg_calls[self.rank] += 1
        return True


class Mapping:
    """A mapping of a peer's memory (the capsule the engine returns)."""


class FakeEngine:
    """The _engine functions StreamGroup calls, over emulated streams: the
    key of a registration is its mr (mapping checks the peer registered the
    range, as the engine checks the peer's export record)."""

    def __init__(self, job: Job):
        self.job = job
        self.streams: dict[int, "Stream"] = {}
        self.mappings: weakref.WeakSet = weakref.WeakSet()   # those not released

    def _gpu_host_register(self, dev, addr, n):
        pass

    def _gpu_host_unregister(self, dev, addr):
        pass

    def _gpu_stream_ops(self, dev, stream, ops):
        self.streams[stream].q.put(list(ops))

    def _ipc_key(self, ep, conn, mr, ptr, nb):
        with self.job.lock:
            r, p, n = self.job.regs.get(mr, (None, 0, 0))
        if r != ep.rank or not (p <= ptr and ptr + nb <= p + n):
            raise UcclError(f"region {mr} does not cover [{ptr:#x}, +{nb})")
        return mr

    def _ipc_map(self, ep, conn, key, addr, nb, dev):
        with self.job.lock:
            r, p, n = self.job.regs.get(key, (None, 0, 0))
        if r != conn or not (p <= addr and addr + nb <= p + n):
            raise UcclError(f"peer's range [{addr:#x}, +{nb}) is outside its export")
        m = Mapping()
        self.mappings.add(m)
        return addr, m


class Stream(threading.Thread):
    """One rank's CUDA stream: runs what is queued, in order."""

    def __init__(self):
        super().__init__(daemon=True)
        self.q: queue.Queue = queue.Queue()
        self.stuck: str | None = None

    def run(self):
        while True:
            ops = self.q.get()
            if ops is None:
                return
            for op in ops:
                if op[0] == "w":
                    ctypes.c_uint32.from_address(op[1]).value = op[2]
                elif op[0] == "a":
                    t0 = time.monotonic()
                    w = ctypes.c_uint32.from_address(op[1])
                    while ((w.value - op[2]) & 0xFFFFFFFF) >= 0x80000000:
                        if time.monotonic() - t0 > STUCK_S:
                            self.stuck = f"wait for {op[2]} stuck at {w.value}"
                            return
                        time.sleep(1e-5)
                else:
                    ctypes.memmove(op[1], op[2], op[3])
            self.q.task_done()

    def drain(self):
        t0 = time.monotonic()
        while self.q.unfinished_tasks and self.stuck is None:
            assert time.monotonic() - t0 < STUCK_S + 5, "emulated stream never drained"
            time.sleep(1e-3)
        assert self.stuck is None, self.stuck


class Ctx:
    def __init__(self, job, store, rank, n, timeout_s):
        self.rank, self.world_size, self.timeout_s = rank, n, timeout_s
        self._kv = store
        self._conns = ([r for r in range(n)], [r for r in range(n)])   # conn id = peer rank
        self.ep = Ep(job, rank)

    def _ep(self):
        return self.ep


@pytest.fixture
def job(monkeypatch):
    j = Job()
    fake = FakeEngine(j)
    monkeypatch.setattr(sgm, "_engine", fake)
    monkeypatch.setattr(sgm, "_raw_stream", lambda dev: threading.get_ident() % 100000)
    j.fake = fake
    return j


def make_groups(job, n, timeout_s=5.0):
    store = Store()
    out = [None] * n

    def mk(r):
        out[r] = sgm.StreamGroup(Ctx(job, store, r, n, timeout_s), 0, timeout_s)
    ts = [threading.Thread(target=mk, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(15)
    assert all(out), "a rank did not open the shared page"
    return out


def on_ranks(n, fn, timeout=30.0):
    """fn(rank) on n threads, each with its own emulated stream; returns
    (results, errors, streams)."""
    res, err, streams = [None] * n, [None] * n, [Stream() for _ in range(n)]

    def body(r):
        sgm._engine.streams[threading.get_ident() % 100000] = streams[r]
        try:
            res[r] = fn(r)
        except BaseException as e:   # noqa: BLE001 - reported to the test
            err[r] = e
    for s in streams:
        s.start()
    ts = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
        assert not t.is_alive(), "a rank's host part hung"
    return res, err, streams


def close_all(groups, streams):
    for s in streams:   # stopped first: they write into the page close() unmaps
        s.q.put(None)
    for s in streams:
        s.join(STUCK_S + 5)
    for g in groups:
        g.close()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allgather_and_p2p_rounds_move_the_right_bytes(job, n):
    rounds = 3 * sgm.NSLOT + 1   # every descriptor slot reused
    groups = make_groups(job, n)
    rng = np.random.default_rng(n)
    sizes = [int(s) for s in rng.integers(1, 5000, rounds)]
    data = [[torch.from_numpy(rng.integers(0, 256, sizes[i], dtype=np.uint8)) for r in range(n)]
            for i in range(rounds)]

    def rank(r):
        ctx = sgm.StreamCtx(groups[r]._ctx, groups[r])
        seen = []
        for i in range(rounds):
            out = torch.full((n * sizes[i],), 0xA5, dtype=torch.uint8)   # poisoned
            send = data[i][r].clone()
            ctx.allgather(send, out)
            # personalised: rank r sends (r + j) to rank j, from a piece of its own
            pieces = [torch.full((j + 1 + i,), r * 16 + j, dtype=torch.uint8) for j in range(n)]
            got = [torch.full((r + 1 + i,), 0xA5, dtype=torch.uint8) for _ in range(n)]
            ctx._p2p([("send", pieces[j], j) for j in range(n) if j != r] +
                     [("recv", got[j], j) for j in range(n) if j != r], "p2p")
            seen.append((out, got, send, pieces))   # kept alive until the stream ran
        return seen
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    for s in streams:
        s.drain()
    for r in range(n):
        for i, (out, got, _s, _p) in enumerate(res[r]):
            assert torch.equal(out, torch.cat(data[i])), f"rank {r} round {i}: allgather bytes"
            for j in range(n):
                if j != r:
                    assert torch.equal(got[j], torch.full((r + 1 + i,), j * 16 + r,
                                                          dtype=torch.uint8)), (r, i, j)
    # one registration per distinct buffer; none, and no mapping, left after close
    close_all(groups, streams)
    assert job.regs == {}
    assert len(job.fake.mappings) == 0


def test_size_mismatch_fails_every_rank_and_releases_every_stream(job):
    n = 3
    groups = make_groups(job, n)

    def rank(r):
        ctx = sgm.StreamCtx(groups[r]._ctx, groups[r])
        a = torch.ones(8 if r != 2 else 8, dtype=torch.uint8)
        b = torch.zeros(8 if r != 1 else 12, dtype=torch.uint8)   # rank 1 expects 12 from 0
        ctx._p2p([("send", a, (r + 1) % n), ("recv", b, (r - 1) % n)], "sendrecv")
        return b
    res, err, streams = on_ranks(n, rank)
    assert isinstance(err[1], UcclError) and "sends 8 bytes where this rank receives 12" \
        in str(err[1]), err
    for s in streams:
        s.drain()   # nothing stays blocked: the group's words were released
    for r in range(n):
        with pytest.raises(UcclError, match="sends 8 bytes where this rank receives 12"):
            groups[r].check()
    # ranks 0 and 2 mapped their peer's buffer; after the failure nothing tells
    # when a real stream is past its copies, so the mappings are never released
    mapped = len(job.fake.mappings)
    assert mapped == 2, mapped
    close_all(groups, streams)
    assert len(job.fake.mappings) == mapped


def test_a_rank_that_never_arrives_times_the_others_out(job):
    n = 3
    groups = make_groups(job, n, timeout_s=1.0)

    def rank(r):
        if r == 2:
            return None   # never calls
        ctx = sgm.StreamCtx(groups[r]._ctx, groups[r])
        t0 = time.monotonic()
        try:
            ctx.allgather(torch.ones(4, dtype=torch.uint8), torch.zeros(12, dtype=torch.uint8))
        finally:
            return time.monotonic() - t0   # noqa: B012 - the time it took, error or not
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n
    assert all(0.9 < res[r] < 5.0 for r in (0, 1)), res
    for r in range(n):
        with pytest.raises(UcclError, match="rank 2 arriving at round 1"):
            groups[r].check()
    for s in streams[:2]:
        s.drain()
    close_all(groups, streams)


def test_a_hostile_slot_count_is_refused(job):
    n = 2
    groups = make_groups(job, n, timeout_s=2.0)
    g1 = groups[1]
    # rank 1 claims more entries than a slot holds, for round 1
    slot = g1._rank_off[1] + sgm.OFF_SLOTS + (1 % sgm.NSLOT) * sgm.SLOT_BYTES
    sgm.U32.pack_into(g1._mm, slot, sgm.MAX_ENTRIES + 1)
    sgm.U64.pack_into(g1._mm, slot + 8, 1)

    def rank(r):
        if r == 1:
            return None
        ctx = sgm.StreamCtx(groups[0]._ctx, groups[0])
        ctx._p2p([("recv", torch.zeros(4, dtype=torch.uint8), 1)], "recv")
    res, err, streams = on_ranks(n, rank)
    assert isinstance(err[0], UcclError) and "published" in str(err[0]) and \
        str(sgm.MAX_ENTRIES + 1) in str(err[0]), err
    close_all(groups, streams)


def test_registrations_are_reused_and_bounded(job):
    n = 2
    groups = make_groups(job, n)
    rounds = sgm.StreamGroup.REG_CACHE + 20
    bufs = [[torch.full((16,), r, dtype=torch.uint8) for _ in range(rounds)] for r in range(n)]

    def rank(r):
        ctx = sgm.StreamCtx(groups[r]._ctx, groups[r])
        outs = []
        for i in range(rounds):   # a new buffer every round, then the first one again
            for b in (bufs[r][i], bufs[r][0]):
                out = torch.zeros(32, dtype=torch.uint8)
                ctx.allgather(b, out)
                outs.append(out)
        return outs
    res, err, streams = on_ranks(n, rank)
    assert err == [None] * n, err
    for s in streams:
        s.drain()
    for r in range(n):
        assert all(torch.equal(o, torch.cat([torch.zeros(16), torch.ones(16)]).to(torch.uint8))
                   for o in res[r])
        assert job.reg_calls[r] == rounds, "one registration per distinct buffer"
        assert job.dereg_calls[r] >= rounds - sgm.StreamGroup.REG_CACHE, "the cache is bounded"
        assert len(groups[r]._regs) <= sgm.StreamGroup.REG_CACHE
    close_all(groups, streams)
