"""GPU-initiated transfers (uccl_collective.gpu_ring, csrc/ring/ring.c).

On a GPU (skipped with the reason elsewhere): kernels compiled at run time
enqueue puts on a ring drained by the engine's proxy.  Every test uses
random bytes and poisoned destinations, and checks every byte plus the
guard past the window; the order is checked through the proxy's trace (the
sequence numbers it issued) and the sequence numbers the GPU threads got.

  loopback        commands from a device table (random sizes, offsets and
                  destinations, some empty), many threads at once, into a
                  local window; also with an 8-slot ring and 2 in flight
  in_sequence     every command writes the same range: the last one wins
                  (locally, and in a peer's window with 32 writes in flight)
  full_ring       try_put on a paused ring: exactly `slots` succeed, the rest
                  report EFULL; blocking puts wait (the kernel stays running)
                  until the proxy resumes
  fill_then_put   64 x 256 threads each write their bytes, then put them: the
                  header's fence makes the GPU's writes visible to the copy
  batch_kernel    our own kernel (GpuRing.launch_puts)
  two_process     CollectiveContext.gpu_ring over two processes sharing the
                  GPU, on shared memory (CUDA IPC), on TCP (staged) and on RDMA
                  through the verbs emulator (staged on both sides)
  bad_command     a range past the window fails the ring at that command:
                  earlier ones complete, the kernel's wait and the host's
                  wait report it with the values
  peer_killed     the window's owner is SIGKILLed: the kernel's wait and the
                  host's wait fail within the timeout

Without a GPU: argument checks, the kernel-argument packing, the header's
layout against the engine's, and the error naming a missing CUDA driver.
"""
from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest

from _harness import (GUARD, POISON, TRANSPORTS, Pair, have_cuda, rand_bytes, run_one,
                      run_pair)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_CUDA = have_cuda()
needs_gpu = pytest.mark.skipif(not HAVE_CUDA, reason=(
    "no CUDA device (torch.cuda.is_available() is False): GPU rings need a GPU whose kernels "
    "enqueue; run on the GPU machine (benchmarks/device_gpu_ring.sh)"))
SEED = int(os.environ.get("UCCL_GPU_TEST_SEED", "20261125"))
TIMEOUT_S = 30.0
MiB = 1 << 20

# A user's kernels, as a user writes them: our header, extern "C".
TEST_SRC = r'''
#include "uccl_ring.cuh"

// Thread i enqueues command i of the table and records its sequence number;
// mode 0: put, then wait for it; 1: try_put, no wait; 2: put, no wait.
extern "C" __global__ void table_puts(const uccl_ring_dev *r, int n, const unsigned int *dst,
    const unsigned long long *src_off, const unsigned long long *dst_off,
    const unsigned long long *len, long long *seq_out, int *rc_out, int mode)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    long long s = mode == 1 ? uccl_ring_try_put(r, dst[i], src_off[i], dst_off[i], len[i])
                            : uccl_ring_put(r, dst[i], src_off[i], dst_off[i], len[i]);
    seq_out[i] = s;
    rc_out[i] = mode == 0 ? uccl_ring_wait(r, s) : 0;
}

// One thread enqueues the table in order, then waits for each command.
extern "C" __global__ void serial_puts(const uccl_ring_dev *r, int n, const unsigned int *dst,
    const unsigned long long *src_off, const unsigned long long *dst_off,
    const unsigned long long *len, long long *seq_out, int *rc_out)
{
    if (blockIdx.x || threadIdx.x)
        return;
    for (int i = 0; i < n; i++)
        seq_out[i] = uccl_ring_put(r, dst[i], src_off[i], dst_off[i], len[i]);
    for (int i = 0; i < n; i++)
        rc_out[i] = uccl_ring_wait(r, seq_out[i]);
}

// Thread i writes chunk i of the source (a pattern of i and salt), then puts
// it at chunk i of destination 0, and waits for it.
extern "C" __global__ void fill_then_put(const uccl_ring_dev *r, int n, unsigned char *src,
    unsigned long long chunk, unsigned int salt, long long *seq_out, int *rc_out)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    for (unsigned long long j = 0; j < chunk; j++)
        src[i * chunk + j] = (unsigned char)((i * 131u + (unsigned)j * 7u + salt) & 0xffu);
    long long s = uccl_ring_put(r, 0, i * chunk, i * chunk, chunk);
    seq_out[i] = s;
    rc_out[i] = uccl_ring_wait(r, s);
}
'''


def _fill_pattern(n: int, chunk: int, salt: int) -> np.ndarray:
    i = np.arange(n, dtype=np.uint64)[:, None]
    j = np.arange(chunk, dtype=np.uint64)[None, :]
    return ((i * 131 + j * 7 + salt) & 0xFF).astype(np.uint8).reshape(-1)


def _table(rng, n: int, ndst: int, max_len: int, src_len: int, region: int,
           zero_frac: float = 0.05):
    """n commands: destination, source offset, destination offset, length.
    The ranges of one destination are disjoint (random gaps), in a random
    order over the commands; about zero_frac of them are empty."""
    dst = rng.integers(0, ndst, n).astype(np.uint32)
    lens = rng.integers(1, max_len + 1, n).astype(np.uint64)
    lens[rng.random(n) < zero_frac] = 0
    src_off = np.array([rng.integers(0, src_len - int(ln) + 1) for ln in lens], np.uint64)
    dst_off = np.zeros(n, np.uint64)
    for d in range(ndst):
        idx = np.flatnonzero(dst == d)
        idx = idx[rng.permutation(len(idx))]
        at = 0
        for i in idx:
            at += int(rng.integers(0, 64))
            dst_off[i] = at
            at += int(lens[i])
        assert at <= region, f"table overflows its region: {at} > {region}"
    return dst, src_off, dst_off, lens


def _expect(window_len: int, cmds, src: np.ndarray, d: int, base: int = 0,
            expected: np.ndarray | None = None) -> np.ndarray:
    out = np.full(window_len, POISON, np.uint8) if expected is None else expected
    dst, src_off, dst_off, lens = cmds
    for i in np.flatnonzero(dst == d):
        s, o, ln = int(src_off[i]), int(dst_off[i]), int(lens[i])
        out[base + o:base + o + ln] = src[s:s + ln]
    return out


def _mismatch(got: np.ndarray, want: np.ndarray, what: str) -> None:
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{what}: {bad.size} of {want.size} bytes differ, first at {bad[0]} "
                           f"(got {got[bad[0]]}, expected {want[bad[0]]})")


def _dev_arrays(cmds):
    import torch
    dst, src_off, dst_off, lens = cmds
    n = len(dst)
    return ([torch.from_numpy(dst.view(np.int32)).cuda(),
             torch.from_numpy(src_off.view(np.int64)).cuda(),
             torch.from_numpy(dst_off.view(np.int64)).cuda(),
             torch.from_numpy(lens.view(np.int64)).cuda()],
            torch.full((n,), -99, dtype=torch.int64, device="cuda"),
            torch.full((n,), -99, dtype=torch.int32, device="cuda"))


def _i32(v: int):
    return np.int32(v)


# --------------------------------------------------------------------------
# rank functions (module level: the harness spawns them)
def _loopback(ch, seed, n, slots, inflight, max_len, ndst):
    import torch
    from uccl_collective.gpu_ring import GpuRing, Kernel
    from uccl_collective.p2p import Endpoint
    torch.cuda.set_device(0)
    rng = np.random.default_rng(seed)
    src_len, region = 4 * MiB, n * (max_len + 64)
    src_np = rand_bytes(src_len, seed)
    src = torch.from_numpy(src_np).cuda()
    wins = [torch.full((region + GUARD,), POISON, dtype=torch.uint8, device="cuda")
            for _ in range(ndst)]
    cmds = _table(rng, n, ndst, max_len, src_len, region)
    ep = Endpoint(0, 1, timeout_s=TIMEOUT_S)
    ring = GpuRing(ep, src, [w[:region] for w in wins], slots=slots, inflight=inflight, trace=n)
    k = Kernel(TEST_SRC, "table_puts")
    arrs, seqs, rcs = _dev_arrays(cmds)
    threads = 128
    k.launch((n + threads - 1) // threads, threads, (ring, _i32(n), *arrs, seqs, rcs, _i32(0)))
    torch.cuda.synchronize()
    ring.wait(n, timeout=TIMEOUT_S)
    seq_np, rc_np = seqs.cpu().numpy(), rcs.cpu().numpy()
    assert (rc_np == 0).all(), f"device waits failed: {np.unique(rc_np)}"
    assert sorted(seq_np.tolist()) == list(range(n)), "sequence numbers are not 0..n-1 once each"
    assert ring.trace() == list(range(n)), "the proxy did not issue the commands in sequence"
    c = ring.counters()
    assert (c.tickets, c.taken, c.done, c.error) == (n, n, n, 0), c
    # the table is in thread order; the ring ran it in ticket order: map it
    for d in range(ndst):
        _mismatch(wins[d].cpu().numpy(), _expect(region + GUARD, cmds, src_np, d),
                  f"window {d}")
    ring.close()
    ep.close()
    return {"n": n, "bytes": int(cmds[3].sum())}


def _in_sequence(ch, seed, n, length):
    import torch
    from uccl_collective.gpu_ring import GpuRing, Kernel
    from uccl_collective.p2p import Endpoint
    torch.cuda.set_device(0)
    src_np = rand_bytes(n * length, seed)
    src = torch.from_numpy(src_np).cuda()
    win = torch.full((length + GUARD,), POISON, dtype=torch.uint8, device="cuda")
    ep = Endpoint(0, 1, timeout_s=TIMEOUT_S)
    ring = GpuRing(ep, src, [win[:length]], slots=64, inflight=32, trace=n)
    cmds = (np.zeros(n, np.uint32), np.arange(n, dtype=np.uint64) * length,
            np.zeros(n, np.uint64), np.full(n, length, np.uint64))
    arrs, seqs, rcs = _dev_arrays(cmds)
    Kernel(TEST_SRC, "table_puts").launch((n + 63) // 64, 64,
                                          (ring, _i32(n), *arrs, seqs, rcs, _i32(0)))
    torch.cuda.synchronize()
    ring.wait(n, timeout=TIMEOUT_S)
    seq_np = seqs.cpu().numpy()
    last = int(np.argmax(seq_np))  # the thread whose command came last
    assert seq_np[last] == n - 1 and ring.trace() == list(range(n))
    want = np.full(length + GUARD, POISON, np.uint8)
    want[:length] = src_np[last * length:(last + 1) * length]
    _mismatch(win.cpu().numpy(), want, "the window after every command wrote it")
    ring.close()
    ep.close()
    return {"last_thread": last}


def _full_ring(ch, seed, slots):
    import torch
    from uccl_collective.gpu_ring import EFULL, GpuRing, Kernel
    from uccl_collective.p2p import Endpoint
    torch.cuda.set_device(0)
    chunk = 4096
    n1, n2 = 2 * slots, 4 * slots
    src_np = rand_bytes((n1 + n2) * chunk, seed)
    src = torch.from_numpy(src_np).cuda()
    win = torch.full(((n1 + n2) * chunk + GUARD,), POISON, dtype=torch.uint8, device="cuda")
    ep = Endpoint(0, 1, timeout_s=TIMEOUT_S)
    ring = GpuRing(ep, src, [win[:(n1 + n2) * chunk]], slots=slots, inflight=2,
                   trace=n1 + n2, paused=True)
    k = Kernel(TEST_SRC, "table_puts")

    def table(first, n):
        i = np.arange(first, first + n, dtype=np.uint64)
        return (np.zeros(n, np.uint32), i * chunk, i * chunk, np.full(n, chunk, np.uint64))

    # 1. try_put on a paused ring: the first `slots` get a slot, the rest EFULL
    arrs, seqs, rcs = _dev_arrays(table(0, n1))
    k.launch(1, n1, (ring, _i32(n1), *arrs, seqs, rcs, _i32(1)))
    torch.cuda.synchronize()
    s = seqs.cpu().numpy()
    ok = s[s >= 0]
    assert sorted(ok.tolist()) == list(range(slots)), f"try_put seqs {sorted(ok.tolist())}"
    assert (s[s < 0] == EFULL).all() and (s < 0).sum() == n1 - slots, s
    c = ring.counters()
    assert (c.tickets, c.taken, c.done) == (slots, 0, 0), c
    ring.resume()
    ring.wait(slots, timeout=TIMEOUT_S)
    got = win.cpu().numpy()
    for i in np.flatnonzero(s >= 0):
        _mismatch(got[i * chunk:(i + 1) * chunk], src_np[i * chunk:(i + 1) * chunk],
                  f"try_put command of thread {i}")
    # 2. blocking puts on a paused ring: the kernel waits for slots
    ring.pause()
    arrs2, seqs2, rcs2 = _dev_arrays(table(n1, n2))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        k.launch(1, n2, (ring, _i32(n2), *arrs2, seqs2, rcs2, _i32(2)))
    time.sleep(0.5)
    running = not stream.query()
    c = ring.counters()
    held = (c.tickets, c.taken)
    ring.resume()
    stream.synchronize()
    ring.wait(slots + n2, timeout=TIMEOUT_S)
    assert running, "the kernel finished although the paused ring had no free slot for it"
    assert held == (slots + n2, slots), f"while paused: (tickets, taken) = {held}"
    s2 = seqs2.cpu().numpy()
    assert sorted(s2.tolist()) == list(range(slots, slots + n2))
    assert ring.trace() == list(range(slots + n2))
    got = win.cpu().numpy()
    for i in range(n2):
        j = n1 + i
        _mismatch(got[j * chunk:(j + 1) * chunk], src_np[j * chunk:(j + 1) * chunk],
                  f"blocking put of thread {i}")
    # nothing landed where the failed try_puts pointed
    for i in np.flatnonzero(s < 0):
        assert (got[i * chunk:(i + 1) * chunk] == POISON).all(), f"EFULL command {i} landed"
    ring.close()
    ep.close()
    return {"efull": int((s < 0).sum())}


def _fill_then_put(ch, blocks, threads, chunk, salt):
    import torch
    from uccl_collective.gpu_ring import GpuRing, Kernel
    from uccl_collective.p2p import Endpoint
    torch.cuda.set_device(0)
    n = blocks * threads
    src = torch.full((n * chunk,), POISON, dtype=torch.uint8, device="cuda")
    win = torch.full((n * chunk + GUARD,), POISON, dtype=torch.uint8, device="cuda")
    ep = Endpoint(0, 1, timeout_s=TIMEOUT_S)
    ring = GpuRing(ep, src, [win[:n * chunk]], slots=1024, inflight=64, trace=n)
    seqs = torch.full((n,), -99, dtype=torch.int64, device="cuda")
    rcs = torch.full((n,), -99, dtype=torch.int32, device="cuda")
    Kernel(TEST_SRC, "fill_then_put").launch(
        blocks, threads, (ring, _i32(n), src, chunk, np.uint32(salt), seqs, rcs))
    torch.cuda.synchronize()
    ring.wait(n, timeout=TIMEOUT_S)
    assert (rcs.cpu().numpy() == 0).all()
    assert sorted(seqs.cpu().numpy().tolist()) == list(range(n))
    assert ring.trace() == list(range(n))
    want = np.concatenate([_fill_pattern(n, chunk, salt), np.full(GUARD, POISON, np.uint8)])
    _mismatch(win.cpu().numpy(), want, "the window")
    ring.close()
    ep.close()
    return {"n": n}


def _batch_kernel(ch, seed, n, size):
    import torch
    from uccl_collective.gpu_ring import GpuRing
    from uccl_collective.p2p import Endpoint
    torch.cuda.set_device(0)
    slots_src = 64
    src_np = rand_bytes(slots_src * size, seed)
    src = torch.from_numpy(src_np).cuda()
    win = torch.full((n * size + GUARD,), POISON, dtype=torch.uint8, device="cuda")
    ep = Endpoint(0, 1, timeout_s=TIMEOUT_S)
    ring = GpuRing(ep, src, [win[:n * size]], slots=256, inflight=32)
    status = ring.launch_puts(n, size, wait=True)
    torch.cuda.synchronize()
    ring.wait(n, timeout=TIMEOUT_S)
    st = status.cpu().tolist()
    assert st == [0, n - 1], st
    want = np.concatenate([np.tile(src_np, (n + slots_src - 1) // slots_src)[:n * size],
                           np.full(GUARD, POISON, np.uint8)])
    _mismatch(win.cpu().numpy(), want, "the window")
    ring.close()
    ep.close()
    return st


def _two_process(ch, rank, seed, store_path, n, max_len, transport):
    import torch
    import torch.distributed as dist
    from uccl_collective.collective import CollectiveContext
    from uccl_collective.gpu_ring import Kernel
    torch.cuda.set_device(0)
    world = 2
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world)
    ctx = CollectiveContext(local_gpu_idx=0, use_copy_engine_for_intra=True,
                            timeout_s=TIMEOUT_S).init()
    peer = 1 - rank
    got_tp = ctx.transports[peer]
    assert got_tp == transport, f"transport {got_tp}, expected {transport}"
    src_len, region = 4 * MiB, n * (max_len + 64)
    srcs = [rand_bytes(src_len, seed + r) for r in range(world)]
    tables = [_table(np.random.default_rng(seed + 100 + r), n, world, max_len, src_len, region)
              for r in range(world)]
    src = torch.from_numpy(srcs[rank]).cuda()
    win = torch.full((world * region + GUARD,), POISON, dtype=torch.uint8, device="cuda")
    ring = ctx.gpu_ring(src, win[:world * region], slots=128, inflight=16, trace=n)
    # each rank writes into the part of every window that is its own
    dst, src_off, dst_off, lens = tables[rank]
    cmds = (dst, src_off, dst_off + np.uint64(rank * region), lens)
    arrs, seqs, rcs = _dev_arrays(cmds)
    Kernel(TEST_SRC, "table_puts").launch((n + 127) // 128, 128,
                                          (ring, _i32(n), *arrs, seqs, rcs, _i32(0)))
    torch.cuda.synchronize()
    ring.wait(n, timeout=TIMEOUT_S)
    assert (rcs.cpu().numpy() == 0).all()
    assert ring.trace() == list(range(n))
    ch.send("written")
    ch.recv("written", timeout=60)
    want = np.full(world * region + GUARD, POISON, np.uint8)
    for r in range(world):
        d, so, do, ln = tables[r]
        _expect(0, (d, so, do + np.uint64(r * region), ln), srcs[r], rank, expected=want)
    _mismatch(win.cpu().numpy(), want, f"rank {rank}'s window")
    ch.send("checked")
    ch.recv("checked", timeout=60)
    ctx.finalize()
    dist.destroy_process_group()
    return {"rank": rank, "transport": got_tp, "to_peer": int((dst == peer).sum())}


def _seq_owner(ch, length):
    import torch
    from uccl_collective.p2p import Endpoint
    torch.cuda.set_device(0)
    ep = Endpoint(0, 1, timeout_s=TIMEOUT_S)
    ch.send("meta", bytes(ep.get_metadata()))
    _ok, _ip, _gpu, conn = ep.accept()
    win = torch.full((length + GUARD,), POISON, dtype=torch.uint8, device="cuda")
    mr = ep.reg(win.data_ptr(), length)[1]
    ch.send("fifo", bytes(ep.advertise(conn, mr, win.data_ptr(), length)[1]))
    want = np.concatenate([np.frombuffer(ch.recv("last_chunk", timeout=120), np.uint8),
                           np.full(GUARD, POISON, np.uint8)])
    _mismatch(win.cpu().numpy(), want, "the peer's window after every command wrote it")
    ch.send("checked")
    ep.close()
    return True


def _seq_writer(ch, seed, n, length):
    import torch
    from uccl_collective.gpu_ring import GpuRing, Kernel, Remote
    from uccl_collective.p2p import Endpoint
    torch.cuda.set_device(0)
    ep = Endpoint(0, 1, timeout_s=TIMEOUT_S)
    _ok, conn = ep.add_remote_endpoint(ch.recv("meta"))
    src_np = rand_bytes(n * length, seed)
    src = torch.from_numpy(src_np).cuda()
    ring = GpuRing(ep, src, [Remote(conn, ch.recv("fifo"))], slots=64, inflight=32, trace=n)
    cmds = (np.zeros(n, np.uint32), np.arange(n, dtype=np.uint64) * length,
            np.zeros(n, np.uint64), np.full(n, length, np.uint64))
    arrs, seqs, rcs = _dev_arrays(cmds)
    Kernel(TEST_SRC, "table_puts").launch((n + 63) // 64, 64,
                                          (ring, _i32(n), *arrs, seqs, rcs, _i32(0)))
    torch.cuda.synchronize()
    ring.wait(n, timeout=TIMEOUT_S)
    assert (rcs.cpu().numpy() == 0).all() and ring.trace() == list(range(n))
    last = int(np.argmax(seqs.cpu().numpy()))
    ch.send("last_chunk", src_np[last * length:(last + 1) * length].tobytes())
    ch.recv("checked", timeout=120)
    ring.close()
    ep.close()
    return last


def _bad_command(ch, seed):
    import torch
    from uccl_collective.gpu_ring import EFAILED, GpuRing, Kernel
    from uccl_collective.p2p import Endpoint, UcclError
    torch.cuda.set_device(0)
    chunk, n, bad = 4096, 6, 3
    src_np = rand_bytes(n * chunk, seed)
    src = torch.from_numpy(src_np).cuda()
    win = torch.full((n * chunk + GUARD,), POISON, dtype=torch.uint8, device="cuda")
    ep = Endpoint(0, 1, timeout_s=TIMEOUT_S)
    ring = GpuRing(ep, src, [win[:n * chunk]], slots=16, inflight=1)
    i = np.arange(n, dtype=np.uint64)
    dst_off = i * chunk
    dst_off[bad] = n * chunk - chunk // 2  # half past the window's end
    arrs, seqs, rcs = _dev_arrays((np.zeros(n, np.uint32), i * chunk, dst_off,
                                   np.full(n, chunk, np.uint64)))
    Kernel(TEST_SRC, "serial_puts").launch(1, 1, (ring, _i32(n), *arrs, seqs, rcs))
    torch.cuda.synchronize()
    rc = rcs.cpu().tolist()
    assert rc == [0] * bad + [EFAILED] * (n - bad), rc
    ring.wait(bad, timeout=TIMEOUT_S)  # those before it finished
    c = ring.counters()
    assert (c.done, c.error) == (bad, bad + 1), c
    try:
        ring.wait(bad + 1, timeout=TIMEOUT_S)
        raise AssertionError("wait past the failed command returned")
    except UcclError as e:
        msg = str(e)
    for part in (f"command {bad}", "outside the destination's window",
                 f"offset {n * chunk - chunk // 2}", f"{chunk} bytes", f"{n * chunk} bytes"):
        assert part in msg, f"{part!r} not in {msg!r}"
    got = win.cpu().numpy()
    _mismatch(got[:bad * chunk], src_np[:bad * chunk], "commands before the failed one")
    assert (got[bad * chunk:] == POISON).all(), "bytes landed at or after the failed command"
    ring.close()
    ep.close()
    return msg


def _owner(ch, seed):
    import torch
    from uccl_collective.p2p import Endpoint
    torch.cuda.set_device(0)
    ep = Endpoint(0, 1, timeout_s=10)
    ch.send("meta", bytes(ep.get_metadata()))
    ok, _ip, _gpu, conn = ep.accept()
    win = torch.full((MiB,), POISON, dtype=torch.uint8, device="cuda")
    mr = ep.reg(win.data_ptr(), MiB)[1]
    ch.send("fifo", bytes(ep.advertise(conn, mr, win.data_ptr(), MiB)[1]))
    ch.recv("never", timeout=120)  # killed by the parent


def _writer(ch, seed):
    import torch
    from uccl_collective.gpu_ring import EFAILED, ETIMEOUT, GpuRing, Kernel, Remote
    from uccl_collective.p2p import Endpoint, UcclError
    torch.cuda.set_device(0)
    ep = Endpoint(0, 1, timeout_s=10)
    ok, conn = ep.add_remote_endpoint(ch.recv("meta"))
    src = torch.from_numpy(rand_bytes(MiB, seed)).cuda()
    ring = GpuRing(ep, src, [Remote(conn, ch.recv("fifo"))], slots=16, inflight=4)
    k = Kernel(TEST_SRC, "serial_puts")
    one = lambda off: _dev_arrays((np.zeros(1, np.uint32), np.zeros(1, np.uint64),
                                   np.full(1, off, np.uint64), np.full(1, 65536, np.uint64)))
    arrs, seqs, rcs = one(0)
    k.launch(1, 1, (ring, _i32(1), *arrs, seqs, rcs))
    torch.cuda.synchronize()
    assert rcs.cpu().tolist() == [0], "the first put, before the owner died, failed"
    ch.event("kill_owner")
    ch.recv("killed", timeout=60)
    t0 = time.monotonic()
    arrs, seqs, rcs = one(65536)
    k.launch(1, 1, (ring, _i32(1), *arrs, seqs, rcs))
    torch.cuda.synchronize()
    took = time.monotonic() - t0
    rc = rcs.cpu().tolist()[0]
    assert rc in (EFAILED, ETIMEOUT), f"the put to a dead peer returned {rc}"
    try:
        ring.wait(2, timeout=30)
        raise AssertionError("the host's wait for the dead peer's command returned")
    except UcclError as e:
        msg = str(e)
    ring.close()
    ep.close()
    return {"rc": rc, "seconds": took, "msg": msg}


# --------------------------------------------------------------------------
# tests on the GPU
@needs_gpu
@pytest.mark.parametrize("slots,inflight,ndst", [(1024, 64, 1), (8, 2, 1), (256, 16, 3)],
                         ids=["roomy", "tight", "3-windows"])
def test_loopback(slots, inflight, ndst):
    res = run_one(_loopback, timeout=180, seed=SEED, n=2000, slots=slots, inflight=inflight,
                  max_len=65536, ndst=ndst)
    assert res["n"] == 2000


@needs_gpu
def test_in_sequence():
    run_one(_in_sequence, timeout=120, seed=SEED + 1, n=512, length=65536)


@needs_gpu
@pytest.mark.parametrize("transport", ["shm-cma", "tcp"])
def test_in_sequence_remote(transport):
    """Every command writes the same range of a peer's window, up to 32 in
    flight at once over the connection (over TCP striped over 2 data
    streams): the proxy holds each until the one before it finished, so the
    last one's bytes are what stays."""
    env = {} if transport == "shm-cma" else TRANSPORTS[transport][0]
    run_pair(_seq_writer, _seq_owner, timeout=180, env=env,
             server_kwargs={"seed": SEED + 7, "n": 256, "length": 65536},
             client_kwargs={"length": 65536})


@needs_gpu
@pytest.mark.parametrize("slots", [8, 64])
def test_full_ring(slots):
    res = run_one(_full_ring, timeout=120, seed=SEED + 2, slots=slots)
    assert res["efull"] == slots


@needs_gpu
def test_fill_then_put():
    run_one(_fill_then_put, timeout=180, blocks=64, threads=256, chunk=256, salt=SEED % 251)


@needs_gpu
def test_batch_kernel():
    assert run_one(_batch_kernel, timeout=120, seed=SEED + 3, n=4096, size=4096) == [0, 4095]


@needs_gpu
@pytest.mark.parametrize("transport", ["shm-cma", "tcp", "rdma"])
def test_two_process(transport, tmp_path):
    """rdma: through the verbs emulator, which cannot register GPU memory
    (as a NIC without GPUDirect): the source and the windows are staged."""
    env = {} if transport == "shm-cma" else TRANSPORTS[transport][0]
    kw = dict(seed=SEED + 4, store_path=str(tmp_path / "store"), n=600, max_len=32768,
              transport=transport)
    s, c = run_pair(_two_process, _two_process, timeout=240, env=env,
                    server_kwargs={"rank": 0, **kw}, client_kwargs={"rank": 1, **kw})
    assert s["transport"] == c["transport"] == transport
    assert s["to_peer"] > 0 and c["to_peer"] > 0


@needs_gpu
def test_bad_command():
    msg = run_one(_bad_command, timeout=120, seed=SEED + 5)
    assert "command 3" in msg


@needs_gpu
def test_peer_killed():
    with Pair(_writer, _owner, server_kwargs={"seed": SEED + 6},
              client_kwargs={"seed": SEED + 6}) as pair:
        pair.wait_event("server", "kill_owner", timeout=120)
        pair.kill("client")
        pair.tell("server", "killed")
        res = pair.result("server", timeout=120)
    assert res["seconds"] < 40, res


# --------------------------------------------------------------------------
# without a GPU
_WIDTH = {"uint64_t": 8, "unsigned long long": 8, "uint32_t": 4, "unsigned int": 4}


def _fields(text: str, struct: str) -> list[tuple[str, int]]:
    """(name with its array length, bytes per element) of each field."""
    body = re.search(r"struct " + struct + r" \{(.*?)\};", text, re.S).group(1)
    body = re.sub(r"/\*.*?\*/|//[^\n]*", "", body, flags=re.S)
    out = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if decl:
            m = re.fullmatch(r"(.+?) (\w+(\[\d+\])?)", decl)
            assert m and m.group(1) in _WIDTH, f"unexpected field declaration {decl!r}"
            out.append((m.group(2), _WIDTH[m.group(1)]))
    return out


@pytest.mark.parametrize("struct", ["uccl_ring_cmd", "uccl_ring_dev"])
def test_header_layout_matches_the_engine(struct):
    """The device header and csrc/ring/ring.h declare the same fields, of the same
    widths, in the same order (sizes are also pinned by static asserts in
    ring.c and in the header itself)."""
    cuh = open(os.path.join(ROOT, "uccl_collective", "include", "uccl_ring.cuh")).read()
    h = open(os.path.join(ROOT, "csrc", "ring", "ring.h")).read()
    assert _fields(cuh, struct) == _fields(h, struct)
    assert len(_fields(h, struct)) >= 7


def test_pack_args():
    import struct as st
    import torch
    from uccl_collective.gpu_ring import _pack_args
    t = torch.zeros(4)
    buf, offs = _pack_args([np.int32(-5), t, 7, np.float32(1.5), -1, 2.5])
    assert offs == [(0, 4), (8, 8), (16, 8), (24, 4), (32, 8), (40, 8)]
    assert st.unpack_from("<i", buf, 0)[0] == -5
    assert st.unpack_from("<Q", buf, 8)[0] == t.data_ptr()
    assert st.unpack_from("<Q", buf, 16)[0] == 7
    assert st.unpack_from("<f", buf, 24)[0] == 1.5
    assert st.unpack_from("<q", buf, 32)[0] == -1
    assert st.unpack_from("<d", buf, 40)[0] == 2.5
    with pytest.raises(TypeError, match="argument 0"):
        _pack_args([True])
    with pytest.raises(ValueError, match="64 bits"):
        _pack_args([1 << 64])
    with pytest.raises(TypeError, match="argument 1: str"):
        _pack_args([1, "x"])


def _bad_opts(ch):
    from uccl_collective import _engine
    from uccl_collective.p2p import Endpoint
    ep = Endpoint(0, 1, timeout_s=5)
    buf = bytearray(4096)
    import ctypes
    p = ctypes.addressof((ctypes.c_char * 4096).from_buffer(buf))
    fifo = bytes(64)
    cases = {
        "slots3": dict(slots=3, dsts=[("local", p, 4096)]),
        "inflight0": dict(inflight=0, dsts=[("local", p, 4096)]),
        "nodst": dict(dsts=[]),
        "kind": dict(dsts=[("elsewhere", p, 4096)]),
        "fifo_len": dict(dsts=[("remote", 1, b"x" * 10)]),
        "fifo_bad": dict(dsts=[("remote", 1, fifo)]),
    }
    out = {}
    for name, c in cases.items():
        args = dict(slots=16, inflight=4)
        args.update(c)
        try:
            _engine.GpuRing(ep, 0, args["slots"], args["inflight"], 1, p, 4096, args["dsts"])
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the type and message are what we check
            out[name] = f"{type(e).__name__}: {e}"
    ep.close()
    return out


def test_ring_arguments_are_checked():
    """Every bad argument is refused by name before any GPU is touched."""
    out = run_one(_bad_opts, timeout=60)
    assert out["slots3"].startswith("ValueError") and "3 is not a power of two" in out["slots3"]
    assert out["inflight0"].startswith("ValueError") and "0 is not in 1..1024" in out["inflight0"]
    assert out["nodst"].startswith("ValueError") and "0 destinations" in out["nodst"]
    assert "kind 'elsewhere'" in out["kind"]
    assert "fifo_item is 64 bytes, got 10" in out["fifo_len"]
    assert out["fifo_bad"].startswith("ValueError") and "not a window descriptor" in out["fifo_bad"]


def _no_driver(ch):
    import torch
    from uccl_collective.gpu_ring import GpuRing, Kernel
    from uccl_collective.p2p import Endpoint
    ep = Endpoint(0, 1, timeout_s=5)
    buf = torch.zeros(4096, dtype=torch.uint8)
    out = []
    for make in (lambda: GpuRing(ep, (buf.data_ptr(), 4096), [buf], device=0),
                 lambda: Kernel("extern \"C\" __global__ void k() {}", "k", device=0)):
        try:
            make()
            out.append("no error")
        except Exception as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {e}")
    ep.close()
    return out


def test_missing_cuda_driver_is_named():
    out = run_one(_no_driver, timeout=60,
                  env={"UCCL_CUDA_LIBRARY": "/nonexistent/libcuda.so.1"})
    for o in out:
        assert o.startswith("UcclError") and "cannot load the CUDA driver" in o, o
        assert "/nonexistent/libcuda.so.1" in o, o
