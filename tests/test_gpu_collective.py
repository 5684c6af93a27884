"""Issue 11: CUDA tensors in CollectiveContext and the "uccl" torch.distributed
backend, between 2-4 processes sharing one GPU, and (the backend) between
processes with a GPU each.

Each scenario is ONE run of real processes (``python -m _gpu_coll_worker``,
see that module) that goes through many cases; every case becomes one test
here, and all tests of a run share it (the first test of the run starts it).
Every rank has a hard timeout of its own (faulthandler dumps its stacks and
exits), the parent kills the whole run when it overstays, and each rank
writes its verdicts after every case, so a run that hangs still reports the
cases it finished.  NCCL cannot serve one GPU shared by several processes
and Gloo cannot gather CUDA tensors, so the reference is always Gloo on CPU
copies of the same seeded inputs.

Scenarios:
  ctx      2, 3, 4 ranks; Gloo bootstraps, CollectiveContext(local_gpu_idx=0,
           use_copy_engine_for_intra=True) on CUDA tensors: allgather and
           iallgather (direct, ring, auto; one output tensor or a list),
           allgatherv and iallgatherv (an empty chunk, mixed lengths),
           blocking send/recv, isend/irecv with test/wait/wait_all,
           batch_isend_irecv ("send"/"recv" and the functions), sendrecv,
           register/deregister_tensor; float32, bfloat16, float16, int64,
           uint8 at 0, 1 and 4097 elements, a few at 2 and 64 MiB; each
           against Gloo's all_gather / send / recv on CPU copies, bitwise.
           Stream order: a GPU spin then a fill of the source and a poison
           of the output queued right before the call, a clone of the output
           right after it returned (or after wait()), no synchronize:
           allgather (direct, ring), iallgather + wait, send/recv, isend/
           irecv, sendrecv, batch_isend_irecv, also on a non-default stream.
  backend  2, 3, 4 ranks; init_process_group("uccl") and a Gloo group over
           the same ranks: all_reduce (SUM, PRODUCT, MIN, MAX, AVG), reduce,
           reduce_scatter, reduce_scatter_tensor, all_gather,
           all_gather_into_tensor, broadcast, all_to_all, all_to_all_single
           (equal and split sizes), gather, scatter, send/recv, isend/irecv,
           batch_isend_irecv over the five dtypes and three sizes, several at
           2 and 64 MiB, each against the same op of the Gloo group on CPU
           copies; async_op=True works (wait() then read; get_future().wait()
           first); barrier with a late rank; all_gather_object and
           broadcast_object_list.  Stream order: all_reduce and
           all_gather_into_tensor after a late fill, blocking or async with
           work.wait(), then a clone; on the current and on a side stream.
           DDP (20 steps) against DDP over Gloo on CPU copies; FSDP2 (5
           steps) against a local single-process reference.
  backend, a GPU per rank (test_backend_gpu_per_rank): the same cases
           with the ranks spread over the host's GPUs: 2, 3 and 4 ranks a
           GPU each, 8 ranks two to a GPU under CUDA MPS (a daemon running
           and UCCL_GPU_TESTS_MPS=1); each skips, naming why, on a host with
           too few GPUs.
  backend, two nodes (test_backend_two_nodes): 4 ranks, ranks 0-1 and 2-3
           each with a host id of their own (two "hosts" on one machine):
           IPC inside a node, TCP between; a GPU per rank (4 GPUs), or the
           dry run on CPU tensors.
  kill     3 ranks (one SIGKILLs itself) and 2 ranks (one os._exit()s), a
           uccl group and a CollectiveContext with 20 s timeouts: after a
           good warm-up on CUDA tensors the victim dies before the next
           collective; the survivors' allgather and recv (context), async
           all_reduce and irecv (their futures), blocking all_reduce plus
           barrier must each raise within 40 s; then the CUDA stream must
           not stay blocked.

Comparisons are bitwise (torch.equal of the bytes) wherever the result does
not depend on the order of a reduction: integers, floats holding small
integers (sums and products are exact), MIN/MAX, every float at 2 ranks,
AVG as Gloo's SUM divided once by the world size (as the backend defines
it).  Random floats summed over 3-4 ranks are compared within a relative
bound derived from the format (_gpu_coll_worker.rtol).  DDP and FSDP2 are
within tolerances argued in their cases (_case_ddp, _case_fsdp).  Every
input comes from the run's seed (printed in every failure: rerun with
UCCL_GPU_TEST_SEED=<seed>).

Without CUDA everything skips.  UCCL_GPU_TESTS_DRYRUN=1 runs every scenario
on CPU tensors ("cuda" is the CPU, the MiB cases smaller): a check of this
harness and of the CPU path on a machine without a GPU; the stream-order
cases skip there.

    python3 -m pytest -q tests/test_gpu_collective.py
"""
from __future__ import annotations

import datetime
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import _gpu_coll_worker as CW
from _harness import BASE_ENV, have_cuda, kill_group

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)

DRY = os.environ.get("UCCL_GPU_TESTS_DRYRUN") == "1"


HAVE_CUDA = have_cuda()
NO_CUDA = ("no CUDA device: torch.cuda.is_available() is False; these tests need one NVIDIA GPU "
           "shared by 2-4 processes (UCCL_GPU_TESTS_DRYRUN=1 runs them on CPU tensors)")
pytestmark = pytest.mark.skipif(not (HAVE_CUDA or DRY), reason=NO_CUDA)

# What the developer's shell must not pass on to the ranks: launcher
# variables (LOCAL_RANK would make the backend's context pick GPU <rank>:
# every rank here uses GPU 0), engine and algorithm settings.
_DROP = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "MASTER_PORT", "TORCHELASTIC_RUN_ID", "UCCL_P2P_TRANSPORT", "UCCL_P2P_SHM_MODE",
         "UCCL_P2P_SECRET", "UCCL_P2P_TIMEOUT_S", "UCCL_P2P_HOST_ID", "UCCL_NODE_ID",
         "UCCL_P2P_LOG_LEVEL", "UCCL_PG_ALGO", "UCCL_PG_SMALL_KB", "UCCL_PG_PIECE_KB",
         "UCCL_PG_WINDOW", "UCCL_PG_REDUCE_THREADS", "PYTORCH_CUDA_ALLOC_CONF")
GRACE_S = 45.0     # once a rank has exited (not a victim), how long the others may take
WORLDS = (2, 3, 4)
KILL_RUNS = {"sigkill-n3": dict(world=3, victim=2, how="sigkill"),
             "exit-n2": dict(world=2, victim=1, how="exit")}
# one run, parent side; UCCL_GPU_TESTS_TIMEOUT_SCALE scales them (a quick
# look at a hang in a short device call)
TIMEOUTS = {k: v * float(os.environ.get("UCCL_GPU_TESTS_TIMEOUT_SCALE", "1"))
            for k, v in {"ctx": 150.0, "backend": 240.0, "kill": 200.0}.items()}


def _seed() -> int:
    s = os.environ.get("UCCL_GPU_TEST_SEED")
    return int(s) if s else secrets.randbits(31)


SEED = _seed()   # one per session: every run and every failure message names it


def _big() -> list[int]:
    return list(CW.DRY_BIG if DRY and not HAVE_CUDA else CW.BIG)


def _params(**kw) -> dict:
    return dict(seed=SEED, big=_big(), **kw)


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError as e:
        return f"<no log: {e}>"


class Run:
    """The outcome of one run: per-rank results (verdicts of the cases each
    rank finished), what went wrong with the run as a whole (or None), and
    the ranks that were meant to die."""

    def __init__(self, label: str, world: int, results: dict, problem: str | None,
                 victims: frozenset):
        self.label, self.world, self.results = label, world, results
        self.problem, self.victims = problem, victims
        self.reported_in: str | None = None   # the first case that showed the problem in full


def launch(scenario: str, world: int, *, params: dict, timeout: float,
           victims: frozenset = frozenset()) -> Run:
    """Run one scenario in `world` processes.  A rank that crashed, hung past
    `timeout` (stacks dumped to its log, then killed) or failed outside any
    case is described in Run.problem with the end of its log; the ranks in
    `victims` may exit early."""
    from torch.distributed import TCPStore

    params = dict(params, hard_timeout=max(1.0, timeout - 5))   # the child stops itself first
    store = TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=timeout),
                     wait_for_workers=False)
    tmp = tempfile.mkdtemp(prefix=f"uccl-gpu-coll-{scenario}-")
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env.update(BASE_ENV)
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join(p for p in (TESTS, REPO, env.get("PYTHONPATH")) if p))
    procs, outs, logs, handles = [], [], [], []
    t0 = time.monotonic()
    hung: list[int] = []
    try:
        for r in range(world):
            outs.append(os.path.join(tmp, f"rank{r}.json"))
            logs.append(os.path.join(tmp, f"rank{r}.log"))
            handles.append(open(logs[-1], "w"))
            cmd = [sys.executable, "-m", "_gpu_coll_worker", scenario, str(r), str(world),
                   str(store.port), outs[-1], json.dumps(params)]
            env_r = dict(env)
            if "gpus" in params:   # ranks spread over GPUs: LOCAL_RANK names the rank's GPU
                env_r["LOCAL_RANK"] = str(r % params["gpus"])
            if "nodes" in params:  # consecutive ranks on one "host", as two hosts' ranks are
                node = f"uccl-gpu-test-node-{r * params['nodes'] // world}"
                env_r.update(UCCL_P2P_HOST_ID=node, UCCL_NODE_ID=node)
            if "verbs" in params:  # a libibverbs (the emulator's): RDMA between the hosts
                env_r["UCCL_IBVERBS_LIB"] = params["verbs"]
            procs.append(subprocess.Popen(cmd, env=env_r, cwd=TESTS, stdout=handles[-1],
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline, first_exit = t0 + timeout, None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if first_exit is None and any(c is not None for r, c in enumerate(codes)
                                          if r not in victims):
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
    label = f"{scenario} with {world} ranks (seed {params['seed']})"
    print(f"[{label}: {took:.1f} s, logs in {tmp}]")

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
        elif r not in victims and procs[r].returncode not in (0, None) and why is None:
            why = f"exit code {procs[r].returncode}"
        if why:
            bad.append(f"--- rank {r}: {why}\n--- end of rank {r}'s log ({logs[r]}):\n"
                       f"{_tail(logs[r])}")
    return Run(label, world, results, "\n".join(bad) or None, victims)


_RUNS: dict = {}


def cached_run(key, start) -> Run:
    """One run per scenario variant, shared by all its cases."""
    if key not in _RUNS:
        _RUNS[key] = start()
    return _RUNS[key]


def check(run: Run, case: str, first: str) -> None:
    """Every rank's verdict on `case` must be None; 'SKIP: why' (and no
    failure) skips with that reason.  A rank without a verdict fails the
    case with what went wrong with the run.  Victims answer `first` only."""
    bad, skips = [], []
    for r in range(run.world):
        if r in run.victims and case != first:
            continue
        v = run.results.get(r, {}).get("verdicts", {}).get(case, "<no verdict>")
        if v is None:
            continue
        if v.startswith("SKIP:"):
            skips.append(v)
        else:
            bad.append(f"rank {r}: {v}")
    if any(v.endswith("<no verdict>") or "not run:" in v for v in bad) and run.problem:
        if run.reported_in is None:
            run.reported_in = case
            bad.append(f"the run:\n{run.problem}")
        else:
            bad.append(f"the run failed: see case {run.reported_in} for how")
    took = max((res.get("times", {}).get(case, 0.0) for res in run.results.values()),
               default=0.0)
    if bad:
        pytest.fail(f"{run.label}, case {case} ({took:.2f} s):\n" + "\n".join(bad), pytrace=False)
    if skips:
        pytest.skip(skips[0].split("SKIP:", 1)[1].strip())


def _world_cases(scenario: str) -> list:
    return [pytest.param(w, c, id=f"n{w}-{c}") for w in WORLDS
            for c in CW.case_names(scenario, w, _params())]


def _run_world(scenario: str, world: int) -> Run:
    return cached_run((scenario, world), lambda: launch(
        scenario, world, params=_params(), timeout=TIMEOUTS[scenario]))


@pytest.mark.parametrize("world,case", _world_cases("ctx"))
def test_collective_context(world, case):
    """CollectiveContext on CUDA tensors: every method at every dtype and
    size delivers what the ranks sent, equal to Gloo on CPU copies, guards
    untouched, sources unchanged; stream-order cases see the late producer's
    data and the data after the late poison; 'end' finalizes cleanly."""
    check(_run_world("ctx", world), case, "setup")


@pytest.mark.parametrize("world,case", _world_cases("backend"))
def test_backend(world, case):
    """The "uccl" process group on CUDA tensors: every dist.* op equals the
    Gloo group's result on CPU copies (bitwise where exact), async works,
    stream order, DDP and FSDP2;
    'end' destroys the groups cleanly."""
    check(_run_world("backend", world), case, "setup")


def _gpu_count() -> int:
    if not HAVE_CUDA:
        return 0
    import torch
    return torch.cuda.device_count()


NGPU = _gpu_count()
SPREAD_WORLDS = (2, 3, 4, 8)   # 8: two ranks a GPU on a 4-GPU host, under CUDA MPS
MPS = os.environ.get("UCCL_GPU_TESTS_MPS") == "1"


def _spread_skip(world: int) -> str | None:
    """Why the ranks cannot each have a GPU of their own here (or share
    them two to a GPU under MPS), or None."""
    if NGPU < 2:
        return (f"one GPU per rank needs 2 GPUs or more; this host has {NGPU} "
                f"({'no CUDA' if not HAVE_CUDA else 'torch.cuda.device_count()'})")
    if world > 2 * NGPU:
        return f"{world} ranks on {NGPU} GPUs: at most two ranks a GPU"
    if world > NGPU and not MPS:
        return (f"{world} ranks on {NGPU} GPUs share GPUs, which needs a CUDA MPS daemon; start "
                "one (nvidia-cuda-mps-control -d) and set UCCL_GPU_TESTS_MPS=1")
    return None


@pytest.mark.parametrize("world,case", [pytest.param(w, c, id=f"n{w}-{c}") for w in SPREAD_WORLDS
                                        for c in CW.case_names("backend", w, _params())])
def test_backend_gpu_per_rank(world, case):
    """The backend scenario with the ranks spread over the host's GPUs (rank
    r on GPU r % min(world, GPUs), LOCAL_RANK set as torchrun sets it): 2, 3
    and 4 ranks a GPU each, 8 ranks two to a GPU under MPS.  Every dist.*
    op at every dtype, in place and not, unequal splits, DDP and FSDP2,
    against the Gloo group on CPU copies (bitwise where the result does not
    depend on the order of a reduction)."""
    why = _spread_skip(world)
    if why:
        pytest.skip(why)
    gpus = min(world, NGPU)
    check(cached_run(("backend-spread", world), lambda: launch(
        "backend", world, params=_params(gpus=gpus),
        timeout=TIMEOUTS["backend"] * (1.5 if world > 4 else 1.0))), case, "setup")


@pytest.mark.parametrize("world,case", [pytest.param(4, c, id=f"n4-{c}")
                                        for c in CW.case_names("backend", 4, _params())])
def test_backend_two_nodes(world, case):
    """The backend scenario on two "nodes" of two ranks (ranks 0-1 and 2-3
    with a host id each, UCCL_P2P_HOST_ID and UCCL_NODE_ID, as ranks of two
    hosts have): inside a node the ranks' GPU memory moves by CUDA IPC,
    between nodes over TCP, staged through page-locked memory, and no
    round is stream-ordered across the nodes.  A GPU per rank where the
    host has 4; on 2 GPUs, under MPS, rank r on GPU r % 2 (each node then
    spans both GPUs); on a machine without CUDA the dry run (CPU tensors)
    takes the same routes over shared memory and TCP."""
    why = _spread_skip(world) if HAVE_CUDA else None
    if why:
        pytest.skip(why)
    params = _params(nodes=2, gpus=min(world, NGPU)) if HAVE_CUDA else _params(nodes=2)
    check(cached_run(("backend-nodes", world), lambda: launch(
        "backend", world, params=params, timeout=TIMEOUTS["backend"] * 1.5)), case, "setup")


@pytest.mark.parametrize("run,case", [pytest.param(k, c, id=f"{k}-{c}") for k, v in
                                      KILL_RUNS.items()
                                      for c in CW.case_names("kill", v["world"], _params())])
def test_killed_rank(run, case):
    """One rank dies (SIGKILL, or os._exit) after a good warm-up, before the
    next collective: the survivors' operations on CUDA tensors through the
    context and the group raise within 40 s (timeouts 20 s), and their CUDA
    stream is not left blocked."""
    v = KILL_RUNS[run]
    res = cached_run(("kill", run), lambda: launch(
        "kill", v["world"], params=_params(victim=v["victim"], how=v["how"]),
        timeout=TIMEOUTS["kill"], victims=frozenset({v["victim"]})))
    check(res, case, "setup")
