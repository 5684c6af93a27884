"""GPU memory through the engine: CUDA tensors, pinned and pageable CPU
memory in every combination, between 2-4 processes sharing one GPU.

Each scenario is ONE run of real processes (``python -m _gpu_worker``, see
that module) that goes through many cases; every case becomes one test here,
and all tests of a scenario share its run (the first test of the scenario
starts it).  Every child has a hard timeout of its own (faulthandler dumps
its stacks and exits) and the parent kills the whole run when it overstays.

Scenarios:
  matrix   2 ranks, same host, allocator default / expandable_segments:
           send/recv, send_ipc/recv_ipc, sendv/recvv, send_async/recv_async,
           send_tensor/recv_tensor, and one-sided write/read with advertise
           (plain, _ipc, _async, v-forms, _tensor helpers), for every
           sender kind x receiver kind in {gpu, pinned, pageable} (9 cells)
           at 0, 1, 4097 and 64 MiB bytes; vector ops with iovs of mixed
           kinds; 1 GiB gpu->gpu send/recv and write.
  tcp      the same machinery over TCP: UCCL_P2P_HOST_ID differing per rank,
           or UCCL_P2P_TRANSPORT=tcp; gpu->gpu, gpu->cpu, cpu->gpu.
  ring     2, 3, 4 ranks: every rank sends mixed-kind messages to both
           neighbours and receives from both, all in flight at once; blocking
           send and recv from two threads at once; one-sided write and read
           around the ring at once.
  stream   stream order (NCCL's rule): a GPU spin then a fill queued right
           before send/write (the engine must wait for it), a spin then a
           poison queued right before recv/read (the data must land after
           it), the received buffer read by a kernel right after the call
           returns; same host and TCP; also on a non-default current stream.
  errors   reg of a nonsense pointer, of a range past an allocation's end or
           spanning two cudaMalloc allocations; send/recv from memory freed
           (for real: empty_cache) after reg; addresses freed and handed out
           again (send, recv, write, read: the new memory's bytes must
           travel, a revoked fifo item or stale region must be refused).

Every transfer moves fresh random bytes (seeded per run; the seed is in
every failure message: rerun with UCCL_GPU_TEST_SEED=<seed>) and is checked
bitwise at its destination, with 4 KiB of poisoned guard bytes before and
after every target range (and between iovs) that must stay untouched.

Without CUDA everything skips.  UCCL_GPU_TESTS_DRYRUN=1 runs the matrix, tcp,
rdma_staged and ring scenarios on CPU memory only (every kind mapped to
pageable, small sizes; rdma_staged with every buffer staged): a check of this
harness on a machine without a GPU.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import _gpu_worker as W
from _harness import BASE_ENV, have_cuda, kill_group

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)

DRY = os.environ.get("UCCL_GPU_TESTS_DRYRUN") == "1"


HAVE_CUDA = have_cuda()
NO_CUDA = ("no CUDA device: torch.cuda.is_available() is False; these tests need one NVIDIA GPU "
           "shared by 2-4 processes (UCCL_GPU_TESTS_DRYRUN=1 checks the harness on CPU memory)")
pytestmark = pytest.mark.skipif(not (HAVE_CUDA or DRY), reason=NO_CUDA)


def _needs_gpu():
    if not HAVE_CUDA:
        pytest.skip("no CUDA device: this scenario only means something on a GPU "
                    "(not part of UCCL_GPU_TESTS_DRYRUN)")


# Variables the developer's shell must not pass on to the ranks: each scenario
# sets what it tests.
_DROP = ("UCCL_P2P_TRANSPORT", "UCCL_P2P_SHM_MODE", "UCCL_P2P_SECRET", "UCCL_P2P_TIMEOUT_S",
         "UCCL_P2P_HOST_ID", "PYTORCH_CUDA_ALLOC_CONF", "UCCL_P2P_LOG_LEVEL")
ALLOC_ENV = {"default": {}, "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
GRACE_S = 30.0     # once one rank has exited, how long the others may take


def _seed() -> int:
    s = os.environ.get("UCCL_GPU_TEST_SEED")
    return int(s) if s else secrets.randbits(31)


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError as e:
        return f"<no log: {e}>"


def launch(scenario: str, world: int, *, params: dict, env: dict | None = None,
           rank_env: list[dict] | None = None, timeout: float = 150.0) -> dict[int, dict]:
    """Run one scenario in `world` processes; {rank: result}.  Fails (naming
    the rank, its exit code and the end of its log) when a rank crashed,
    hung past `timeout` (its stacks are dumped to its log, then it is
    killed), or raised outside every case."""
    from torch.distributed import TCPStore

    params = dict(params, hard_timeout=max(1.0, timeout - 5))  # the child stops itself first
    store = TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=timeout),
                     wait_for_workers=False)
    tmp = tempfile.mkdtemp(prefix=f"uccl-gpu-{scenario}-")
    base = {k: v for k, v in os.environ.items() if k not in _DROP}
    base.update(BASE_ENV)
    base.update(PYTHONPATH=os.pathsep.join(p for p in (TESTS, REPO, base.get("PYTHONPATH")) if p),
                PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR")
    procs, outs, logs, handles = [], [], [], []
    t0 = time.monotonic()
    hung: list[int] = []
    try:
        for r in range(world):
            e = dict(base, **(env or {}), **(rank_env[r] if rank_env else {}))
            outs.append(os.path.join(tmp, f"rank{r}.json"))
            logs.append(os.path.join(tmp, f"rank{r}.log"))
            handles.append(open(logs[-1], "w"))
            cmd = [sys.executable, "-m", "_gpu_worker", scenario, str(r), str(world),
                   str(store.port), outs[-1], json.dumps(params)]
            procs.append(subprocess.Popen(cmd, env=e, cwd=TESTS, stdout=handles[-1],
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline, first_exit = t0 + timeout, None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if first_exit is None and any(c is not None for c in codes):
                first_exit = now
            if now > deadline or (first_exit is not None and now - first_exit > GRACE_S):
                hung = [r for r, c in enumerate(codes) if c is None]
                for r in hung:       # stacks of every thread into the rank's log
                    try:
                        os.kill(procs[r].pid, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
                time.sleep(1.0)
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_group(p)
        for h in handles:
            h.close()
        del store
    took = time.monotonic() - t0
    print(f"[{scenario} x{world}: {took:.1f} s, logs in {tmp}]")

    results, bad = {}, []
    for r in range(world):
        why = None
        try:
            with open(outs[r]) as f:
                results[r] = json.load(f)
        except (OSError, ValueError):
            why = f"no result (exit code {procs[r].returncode})"
        if r in hung:
            why = f"hung: still running {took:.0f} s in (killed; stacks in its log)"
        elif r in results and results[r].get("fatal"):
            why = f"failed outside any case:\n{results[r]['fatal']}"
        if why:
            bad.append(f"--- rank {r}: {why}\n--- end of rank {r}'s log ({logs[r]}):\n{_tail(logs[r])}")
    if bad:
        pytest.fail(f"{scenario} with {world} ranks (seed {params['seed']}):\n" + "\n".join(bad),
                    pytrace=False)
    return results


_JOBS: dict = {}


def cached_job(key, start):
    """One run per scenario variant, shared by all its cases (a run that
    failed as a whole fails each of them with the same message)."""
    if key not in _JOBS:
        try:
            _JOBS[key] = (True, start())
        except pytest.fail.Exception as e:
            _JOBS[key] = (False, str(e))
    ok, val = _JOBS[key]
    if not ok:
        pytest.fail(val, pytrace=False)
    return val


def check(res: dict[int, dict], case: str, label: str) -> None:
    """Every rank's verdict on `case` must be None; 'SKIP: why' on a rank
    (and no failure on any) skips the test with that reason."""
    bad, skips = [], []
    for r in sorted(res):
        v = res[r]["verdicts"].get(case, "<case missing from the rank's verdicts>")
        if v is None:
            continue
        (skips if v.startswith("SKIP:") else bad).append(f"rank {r}: {v}")
    took = max(res[r]["times"].get(case, 0.0) for r in res)
    seed = res[min(res)]["info"].get("seed")
    if bad:
        pytest.fail(f"{label}, case {case} ({took:.2f} s, seed {seed}):\n" + "\n".join(bad),
                    pytrace=False)
    if skips:
        pytest.skip(skips[0].split("SKIP:", 1)[1].strip())


def _params(**kw) -> dict:
    return dict(seed=_seed(), **kw)


def _run(scenario, world, key_label, *, params, env=None, rank_env=None, timeout=150.0):
    def start():
        res = launch(scenario, world, params=params, env=env, rank_env=rank_env, timeout=timeout)
        for r in res:
            res[r]["info"]["seed"] = params["seed"]
        return res
    return cached_job(key_label, start)


# --------------------------------------------------------------------------
# matrix: every op x every memory-kind cell x sizes, same host
def _matrix_plan_args() -> dict:
    if DRY and not HAVE_CUDA:   # the harness check: one cell, small sizes, no 1 GiB
        return dict(cells=[["gpu", "gpu"]], sizes=[0, 1, 4097, W.MiB + 3], big=False, mixed=True)
    return {}


MATRIX_CASES = W.case_names("matrix", {"plan": _matrix_plan_args()})


@pytest.mark.parametrize("alloc", list(ALLOC_ENV))
@pytest.mark.parametrize("case", MATRIX_CASES)
def test_matrix(alloc, case):
    """Same host: each op between each sender/receiver memory kind at 0, 1,
    4097 and 64 MiB bytes (and 1 GiB gpu->gpu send and write) delivers the
    sender's random bytes exactly, touches no guard byte, leaves the source
    unchanged; 'setup' checks the allocator setting took effect and the
    connection is not TCP."""
    res = _run("matrix", 2, ("matrix", alloc), env=ALLOC_ENV[alloc], timeout=170,
               params=_params(alloc=alloc, plan=_matrix_plan_args(), expect_transport="same-host"))
    check(res, case, f"matrix, allocator {alloc}")


# --------------------------------------------------------------------------
# tcp: GPU memory staged over TCP
def _tcp_plan_args() -> dict:
    sizes = [0, 1, 4097, 64 * W.MiB]
    if DRY and not HAVE_CUDA:
        sizes = [0, 1, 4097, W.MiB + 3]
    return dict(cells=W.TCP_CELLS, ops=list(W.TCP_OPS), sizes=sizes, big=False, mixed=False)


TCP_VIA = {
    # Each rank its own "host": same-host detection fails, so TCP.
    "host_id": dict(rank_env=[{"UCCL_P2P_HOST_ID": "uccl-gpu-test-host-a"},
                              {"UCCL_P2P_HOST_ID": "uccl-gpu-test-host-b"}]),
    "transport_env": dict(env={"UCCL_P2P_TRANSPORT": "tcp"}),
}


def _rdma_env() -> dict:
    """RDMA through the verbs emulator (tests/ibv_emu), which, as a NIC
    without GPUDirect, cannot register device memory: GPU memory is staged
    through page-locked host memory."""
    import _ibv_emu
    return _ibv_emu.env()
TCP_CASES = W.case_names("matrix", {"plan": _tcp_plan_args()})


@pytest.mark.parametrize("via", list(TCP_VIA))
@pytest.mark.parametrize("case", TCP_CASES)
def test_tcp(via, case):
    """Over TCP (UCCL_P2P_HOST_ID differing per rank, or UCCL_P2P_TRANSPORT=tcp):
    gpu->gpu, gpu->pinned/pageable, pinned/pageable->gpu by send, send_async,
    sendv, write and read at 0, 1, 4097 and 64 MiB bytes, checked bitwise;
    'setup' checks conn_transport() is 'tcp'."""
    res = _run("matrix", 2, ("tcp", via), timeout=120, **TCP_VIA[via],
               params=_params(plan=_tcp_plan_args(), expect_transport="tcp"))
    check(res, case, f"tcp via {via}")


# What the RDMA transport stages (a NIC that cannot register GPU memory):
# the moves a GPU buffer's own side makes (push: a GPU source sent or written
# to host memory; pull: host memory read into a GPU buffer), and what a peer
# must reach in GPU memory, streamed through the receiving side's staging
# ring (send-into: a send into a GPU receive buffer, from host memory or from
# GPU memory, which is then staged on both sides; write-into: the same into
# a GPU window; read-from: a read of a GPU window into host or GPU memory).
def _rdma_plans() -> dict:
    sizes = [0, 1, 4097, 64 * W.MiB]
    if DRY and not HAVE_CUDA:
        sizes = [0, 1, 4097, W.MiB + 3]
    common = dict(sizes=sizes, big=False, mixed=False)
    into = [["pinned", "gpu"], ["pageable", "gpu"], ["gpu", "gpu"]]
    return {"push": dict(cells=[["gpu", "pinned"], ["gpu", "pageable"]],
                         ops=["send", "send_async", "sendv", "write"], **common),
            "pull": dict(cells=[["pinned", "gpu"], ["pageable", "gpu"]], ops=["read"], **common),
            "send-into": dict(cells=into, ops=["send", "send_async", "sendv"], **common),
            "write-into": dict(cells=into, ops=["write", "write_async", "writev"], **common),
            "read-from": dict(cells=[["gpu", "pinned"], ["gpu", "pageable"], ["gpu", "gpu"]],
                              ops=["read", "read_async", "readv"], **common)}


RDMA_CASES = [(way, c) for way, plan in _rdma_plans().items()
              for c in W.case_names("matrix", {"plan": plan})]


@pytest.mark.parametrize("way,case", RDMA_CASES, ids=[f"{w}-{c}" for w, c in RDMA_CASES])
def test_rdma_staged(way, case):
    """GPU memory over the RDMA transport through the verbs emulator, which
    cannot register GPU memory (as a NIC without GPUDirect), staged through
    page-locked memory on the GPU buffer's own side: a GPU source sent or
    written to host memory, host memory read into a GPU buffer; a send or a
    write into GPU memory and a read of a GPU window, from or into host or
    GPU memory (both sides staged); every byte checked; 'setup' checks
    conn_transport() is 'rdma'.  Dry run (no GPU): every kind is pageable
    CPU memory, staged anyway on both sides (UCCL_P2P_RDMA_STAGE_ALL=1): a
    check of the harness and of the staged paths' host side."""
    env = _rdma_env()
    if not HAVE_CUDA:
        env["UCCL_P2P_RDMA_STAGE_ALL"] = "1"
    res = _run("matrix", 2, ("rdma", way), timeout=150, env=env,
               params=_params(plan=_rdma_plans()[way], expect_transport="rdma"))
    check(res, case, f"rdma (emulator, staged), {way}")


# --------------------------------------------------------------------------
# ring: 2-4 ranks on the one GPU, many connections busy at once
RING_RUNS = [(2, "default"), (3, "default"), (4, "default"), (3, "expandable")]
RING_CASES = W.case_names("ring", {})


@pytest.mark.parametrize("world,alloc", RING_RUNS, ids=[f"n{n}-{a}" for n, a in RING_RUNS])
@pytest.mark.parametrize("case", RING_CASES)
def test_ring(world, alloc, case):
    """All ranks connected to all; ring:async sends 8 mixed-kind messages
    (0 B to 64 MiB) to both neighbours and receives as many from both, all
    posted at once; ring:threads runs blocking send and recv from two
    threads at once; ring:one-sided writes into the next rank's GPU window
    while reading its pinned source.  Every byte checked."""
    params = _params(alloc=alloc)
    if DRY and not HAVE_CUDA:
        params["max_size"] = W.MiB
    res = _run("ring", world, ("ring", world, alloc), env=ALLOC_ENV[alloc], timeout=120,
               params=params)
    check(res, case, f"ring of {world} ranks, allocator {alloc}")


# --------------------------------------------------------------------------
# stream order
STREAM_CASES = W.case_names("stream", {})


@pytest.mark.parametrize("alloc", list(ALLOC_ENV))
@pytest.mark.parametrize("case", STREAM_CASES)
def test_stream_order(alloc, case):
    """Nothing synchronizes between the kernels and the engine calls: a
    sender's late fill (behind a ~0.1 s GPU spin) must be what travels, a
    receiver's late poison must be overwritten by the data, and a kernel
    reading the buffer right after recv/read returned must see the data;
    same host and TCP, blocking and async, and on a non-default stream."""
    _needs_gpu()
    res = _run("stream", 2, ("stream", alloc), env=ALLOC_ENV[alloc], timeout=120,
               params=_params(alloc=alloc))
    check(res, case, f"stream order, allocator {alloc}")


# --------------------------------------------------------------------------
# errors and freed / reused memory
ERROR_CASES = W.case_names("errors", {})


@pytest.mark.parametrize("alloc", list(ALLOC_ENV))
@pytest.mark.parametrize("case", ERROR_CASES)
def test_errors(alloc, case):
    """reg of 0xdead0000, of a range past a cudaMalloc allocation or across
    two adjacent ones raises (ValueError or UcclError naming the pointer in
    hex); send/recv through a region whose memory was freed (empty_cache)
    raises the same way, not a timeout; an address freed and handed out
    again can be registered and its new bytes travel (send, recv, write,
    read); a revoked fifo item and a stale region are refused; the
    connection still carries data afterwards."""
    _needs_gpu()
    res = _run("errors", 2, ("errors", alloc), env=ALLOC_ENV[alloc], timeout=120,
               params=_params(alloc=alloc))
    check(res, case, f"errors, allocator {alloc}")


# --------------------------------------------------------------------------
# upstream's names on GPU memory (issue 12)
UPSTREAM_CASES = W.case_names("upstream", {})


@pytest.mark.parametrize("case", UPSTREAM_CASES)
def test_upstream_names(case):
    """What upstream's scripts call, on GPU memory (and GPU to/from host),
    between two processes: the IPC calls without an mr_id (two-sided,
    one-sided, vectored, _async), sendv_async/recvv_async with one id, and
    register_memory/get_serialized_descs/deserialize_descs/transfer (write,
    read, and a range inside a registration sharing its keys) at 1, 4097
    and 16 MiB+3 bytes, every byte and guard checked; 'setup' checks the
    endpoint names its GPU by PCI bus id."""
    _needs_gpu()
    res = _run("upstream", 2, ("upstream",), timeout=150, params=_params())
    check(res, case, "upstream names")


def test_gpu_named_by_pci_bus_id(monkeypatch):
    """Upstream HEAD names GPUs by PCI bus id: Endpoint(0).gpu_bdf is device
    0's bus id as torch reports it, it parses back out of HEAD's metadata
    layout, and connect(remote_gpu_bdf=...) with no port finds the peer's
    well-known port through this host's devices."""
    _needs_gpu()
    import socket
    import struct

    import numpy as np
    import torch
    from uccl_collective import p2p
    props = torch.cuda.get_device_properties(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    monkeypatch.setenv("UCCL_P2P_BASE_PORT", str(base))
    rx, tx = p2p.Endpoint(0, timeout_s=10), p2p.Endpoint(None, port=0, timeout_s=10)
    try:
        bdf = rx.gpu_bdf
        assert re.fullmatch(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", bdf), bdf
        if hasattr(props, "pci_bus_id"):
            assert int(bdf.split(":")[1], 16) == props.pci_bus_id, (bdf, props.pci_bus_id)
        assert rx.address()[1] == base, "the well-known port was taken: rerun"
        head = socket.inet_aton("127.0.0.1") + struct.pack("!H", base) + bytes([len(bdf)]) + \
            bdf.encode()
        ip, port, got = p2p.Endpoint.parse_metadata(head)
        assert (ip, port, got) == ("127.0.0.1", base, bdf)
        ok, conn = tx.connect("127.0.0.1", remote_gpu_bdf=bdf)
        ok2, _ip, _gpu, rconn = rx.accept()
        assert ok and ok2
        src = np.random.default_rng(base).integers(0, 256, 4099, dtype=np.uint8)
        dst = np.full(4099 + 64, 0xAB, np.uint8)
        smr, rmr = tx.reg(src.ctypes.data, src.size)[1], rx.reg(dst.ctypes.data, dst.size)[1]
        tid = rx.recv_async(rconn, rmr, dst.ctypes.data, src.size)[1]
        tx.send(conn, smr, src.ctypes.data, src.size)
        rx.wait(tid)
        assert np.array_equal(dst[:src.size], src) and (dst[src.size:] == 0xAB).all()
    finally:
        rx.close()
        tx.close()
