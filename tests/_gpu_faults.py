"""Fault trials on GPUs: one rank SIGKILLed (or SIGSTOPped) at a random moment
of a loop of one operation, one process per GPU, as users run.

A trial: the driver (this module, imported by tests/test_gpu_faults.py and
benchmarks/gpu_fault_trials.py) hosts the job's store, as torchrun's agent
does, and forks one rank per GPU (torch is imported once, before the fork;
CUDA is first touched in the ranks).  Each rank joins
init_process_group("uccl", timeout=T) (and a CollectiveContext for the
context's ops), runs the operation three times and checks the results,
then loops on it, waiting for each call's CUDA event (polled, bounded).  The
victim, a random rank, stops itself from a side thread after a random delay
(so the signal lands anywhere in a call: on the host, in the engine, or
while the GPU copies), writing the time first into the store.  Each
survivor records:

- raised_s: seconds from the kill to the first exception (or, for the GPU
  ring, a command's error code) it saw;
- next_s: the next call raises at once (its seconds);
- stream_ok: work queued on the same stream after the failure completes
  and is right (a fill and a multiply, waited for within 5 s);
- closed_s: destroy_process_group() / finalize() returns (seconds);
- gpu_leak: device memory not given back after closing the failed group,
  freeing the tensors and emptying torch's cache (cudaMemGetInfo's free
  after a clean group of the same op was made and closed, minus after).
  Reported, not judged: a failed group keeps, for the life of the process,
  the memory a peer's stream may still copy into (its staging arenas, the
  fused buffers, the tensors of messages not in place; docs/gpu.md).

The driver then checks that every rank process is gone, /dev/shm holds no
file the trial made, and the GPUs' used memory is back to what it was.  A
SIGSTOPped victim is continued once the survivors are done and must raise
too.  Nothing waits unbounded: every poll has a deadline, each rank has a
hard limit (faulthandler), and the driver kills what outstays it.

    python3 benchmarks/gpu_fault_trials.py --help
"""
from __future__ import annotations

import datetime
import faulthandler
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# ops of the "uccl" process group (dist.*) and of a CollectiveContext (ctx_*);
# every stream-ordered collective, point to point and the GPU ring
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "reduce",
       "all_to_all_single", "send_recv", "ctx_allgather", "ctx_sendrecv", "gpu_ring")
GPU_ONLY = ("gpu_ring",)
SIZES = (4096, 1 << 20, 32 << 20)      # bytes a rank; trial i takes SIZES[i % 3]


def gpu_count() -> int:
    """GPUs on this machine, without initialising CUDA here (the ranks are
    forked from this process and must be the first to touch it)."""
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in p.stdout.splitlines() if line.startswith("GPU "))


def gpu_used_mib() -> list[int]:
    p = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=30)
    return [int(v) for v in p.stdout.split()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------
# the rank
class _Op:
    """One operation on this rank's tensors: run() queues it (blocking call
    or waited handles, as a user writes it), check() tells whether the
    result is right (warm-up only: after the kill the bytes are undefined)."""

    def __init__(self, name, rank, world, nbytes, dev, ctx, g):
        import torch
        import torch.distributed as dist
        self.name, self.rank, self.world = name, rank, world
        n = max(world, nbytes // 4 // world * world)     # float32 elements, a multiple of world
        f = dict(dtype=torch.float32, device=dev)
        r, w = rank, world
        tot = w * (w + 1) / 2
        self.ring = None
        nxt, prv = (r + 1) % w, (r - 1) % w
        if name == "all_reduce":
            x = torch.empty(n, **f)
            self.run = lambda: (x.fill_(r + 1), dist.all_reduce(x, group=g))
            self.check = lambda: bool((x == tot).all())
        elif name == "all_gather_into_tensor":
            x, out = torch.full((n,), r + 1.0, **f), torch.empty(w * n, **f)
            want = torch.arange(1, w + 1, **f).repeat_interleave(n)
            self.run = lambda: dist.all_gather_into_tensor(out, x, group=g)
            self.check = lambda: bool(torch.equal(out, want))
        elif name == "reduce_scatter_tensor":
            x, out = torch.full((w * n,), r + 1.0, **f), torch.empty(n, **f)
            self.run = lambda: dist.reduce_scatter_tensor(out, x, group=g)
            self.check = lambda: bool((out == tot).all())
        elif name in ("broadcast", "reduce"):
            x = torch.empty(n, **f)
            if name == "broadcast":
                self.run = lambda: (x.fill_(r + 1), dist.broadcast(x, 0, group=g))
                self.check = lambda: bool((x == 1).all())
            else:
                self.run = lambda: (x.fill_(r + 1), dist.reduce(x, 0, group=g))
                self.check = lambda: r != 0 or bool((x == tot).all())
        elif name == "all_to_all_single":
            x, out = torch.full((n,), r + 1.0, **f), torch.empty(n, **f)
            want = torch.arange(1, w + 1, **f).repeat_interleave(n // w)
            self.run = lambda: dist.all_to_all_single(out, x, group=g)
            self.check = lambda: bool(torch.equal(out, want))
        elif name in ("send_recv", "ctx_sendrecv"):
            s, d = torch.full((n,), r + 1.0, **f), torch.empty(n, **f)
            if name == "send_recv":
                ops = [dist.P2POp(dist.isend, s, nxt, group=g), dist.P2POp(dist.irecv, d, prv, group=g)]
                self.run = lambda: [q.wait() for q in dist.batch_isend_irecv(ops)]
            else:
                self.run = lambda: ctx.sendrecv(s, nxt, d, prv)
            self.check = lambda: bool((d == prv + 1).all())
        elif name == "ctx_allgather":
            x, out = torch.full((n,), r + 1.0, **f), torch.empty(w * n, **f)
            want = torch.arange(1, w + 1, **f).repeat_interleave(n)
            self.run = lambda: ctx.allgather(x, out)
            self.check = lambda: bool(torch.equal(out, want))
        elif name == "gpu_ring":
            # every rank puts into every other rank's window each call, so
            # every survivor has commands for the victim
            src = torch.full((nbytes,), r + 1, dtype=torch.uint8, device=dev)
            win = torch.zeros(w * nbytes, dtype=torch.uint8, device=dev)
            self.ring = ctx.gpu_ring(src, win, slots=256, inflight=32)
            size = max(1, nbytes // 16)
            peers = [p for p in range(w) if p != r]
            if not os.environ.get("UCCL_FAULTS_NO_PRELOAD"):
                # torch loads a kernel's module at its first launch (CUDA lazy
                # loading, torch's default), and a load waits for the device's
                # running kernels while it holds the driver's lock, so the
                # engine's copies for the ring would wait behind it: a ring
                # kernel spinning on its puts would then never end.  run()
                # launches torch.stack while ring kernels spin: load it now.
                torch.stack([torch.zeros(2, dtype=torch.int64, device=dev)] * len(peers))
                torch.cuda.synchronize()

            def run():
                st = [self.ring.launch_puts(16, size, dst=p) for p in peers]
                self.status = torch.stack(st)
            self.run = run
            # the peers' windows cannot be read back here without a barrier
            # per call: the status words say every put completed (code 0);
            # the bytes themselves are checked by tests/test_gpu_ring.py
            self.check = lambda: bool((self.status[:, 0] == 0).all())
        else:
            raise ValueError(f"unknown op {name!r}; known: {', '.join(OPS)}")

    def diagnosis(self) -> str:
        if self.ring is None:
            return ""
        return (f": status words {self.status.tolist()}, ring error {self.ring.error()!r}, "
                f"counters {self.ring.counters()}")

    def failed_on_gpu(self) -> str | None:
        """The GPU ring reports a failure in its commands' status words
        (error codes), not by raising: the first nonzero code, if any."""
        if self.ring is None:
            return None
        codes = [int(c) for c in self.status[:, 0].tolist() if int(c) != 0]
        return f"ring command error code {codes[0]} ({self.ring.error()})" if codes else None


def _poll(ev, deadline: float) -> bool:
    while not ev.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0002)
    return True


def rank_main(p: dict) -> dict:
    """One rank of a trial (in a forked child): the result dict."""
    import torch
    import torch.distributed as dist
    rank, world, T = p["rank"], p["world"], p["timeout_s"]
    res = {"rank": rank, "victim": rank == p["victim"]}
    cpu = p["device"] == "cpu"
    dev = "cpu" if cpu else f"cuda:{p['gpus'][rank]}"
    if not cpu:
        torch.cuda.set_device(dev)
        torch.cuda.init()
        free0 = torch.cuda.mem_get_info()[0]
    store = dist.TCPStore("127.0.0.1", p["port"], world + 1, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    import uccl_collective  # noqa: F401  registers "uccl"
    from uccl_collective.collective import CollectiveContext
    dist.init_process_group("uccl", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=T))   # the bootstrap
    sync = (lambda d: True) if cpu else (lambda d: _poll(_record(), d))

    def make():
        """A group (or a context) of its own for the op, and the op, warmed up."""
        g = ctx = None
        if p["op"].startswith("ctx_") or p["op"] == "gpu_ring":
            ctx = CollectiveContext(local_gpu_idx=None if cpu else p["gpus"][rank],
                                    use_copy_engine_for_intra=not cpu, timeout_s=T).init()
        else:
            g = dist.new_group(backend="uccl", timeout=datetime.timedelta(seconds=T))
        op = _Op(p["op"], rank, world, p["size"], dev, ctx, g)
        for i in range(3):
            op.run()
            if not sync(time.monotonic() + 60):
                raise AssertionError(f"warm-up call {i} of {p['op']}: the stream stayed blocked")
            if not op.check():
                raise AssertionError(f"warm-up call {i} of {p['op']} gave a wrong result"
                                     + op.diagnosis())
        return op, g, ctx

    def barrier(key):
        """Every rank past this point (one-sided puts land in the peers'
        windows: a rank must not close its own while others still write)."""
        store.add(key, 1)
        until = time.monotonic() + 60
        while store.add(key, 0) < world:
            if time.monotonic() > until:
                raise TimeoutError(f"the other ranks never reached {key!r}")
            time.sleep(0.001)

    def close(op, g, ctx):
        if op.ring is not None:
            op.ring.close()
        if ctx is not None:
            ctx.finalize()
        if g is not None:
            dist.destroy_process_group(g)

    def free_now():
        import gc
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]

    if not cpu:
        # a clean round first: what a group keeps for the life of the
        # process once closed (kernels loaded, streams) is not the fault's
        clean = make()
        barrier("clean")
        close(*clean)
        del clean
        free_clean = free_now()
        res["kept_by_clean_close"] = free0 - free_clean
    op, g, ctx = make()
    barrier("armed")
    if res["victim"]:
        sig = signal.SIGKILL if p["mode"] == "kill" else signal.SIGSTOP

        def die():
            time.sleep(p["delay_s"])
            store.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), sig)
        threading.Thread(target=die, daemon=True).start()
    calls, err, t_err = 0, None, None
    end = time.monotonic() + p["delay_s"] + T + 20
    while time.monotonic() < end:
        try:
            op.run()
            calls += 1
            if not sync(time.monotonic() + T + 10):
                res["stream_blocked"] = True     # the GPU never got past the call
                break
            bad = op.failed_on_gpu()
            if bad:
                err, t_err = bad, time.time()
                break
        except Exception as e:  # noqa: BLE001 - what the survivor sees
            err, t_err = f"{type(e).__name__}: {e}", time.time()
            break
    res["calls"] = calls
    res["error"] = err and err.splitlines()[0][:300]
    if err is not None:
        killed_at = float(store.get("killed_at")) if _has(store, "killed_at") else None
        res["raised_s"] = None if killed_at is None else round(t_err - killed_at, 3)
        t = time.monotonic()
        try:
            op.run()
            res["next_raised"] = op.failed_on_gpu() is not None
        except Exception:  # noqa: BLE001
            res["next_raised"] = True
        res["next_s"] = round(time.monotonic() - t, 3)
    if not cpu and not res.get("stream_blocked"):
        y = torch.full((1 << 20,), 3.0, device=dev)
        y.mul_(2)
        res["stream_ok"] = _poll(_record(), time.monotonic() + 5) and bool((y == 6).all())
        del y
    t = time.monotonic()
    close(op, g, ctx)
    dist.destroy_process_group()
    res["closed_s"] = round(time.monotonic() - t, 3)
    if not cpu:
        del op
        res["gpu_leak"] = free_clean - free_now()
    return res


def _record():
    import torch
    ev = torch.cuda.Event()
    ev.record()
    return ev


def _has(store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception:  # noqa: BLE001
        return False


def _child(p: dict, out: str) -> None:
    """The forked rank: run, write the result, never run the parent's code."""
    faulthandler.enable()
    faulthandler.dump_traceback_later(p["hard_s"], exit=True)
    try:
        res = rank_main(p)
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        res = {"rank": p["rank"], "fatal": f"{type(e).__name__}: {e}",
               "trace": traceback.format_exc()[-2000:]}
    with open(out + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out + ".tmp", out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------
# the driver
def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def trial(op: str, world: int, *, mode: str = "kill", victim: int, delay_s: float, size: int,
          timeout_s: float = 5.0, device: str = "cuda", gpus: list[int] | None = None) -> dict:
    """One trial; the dict tells what every rank saw and what was left."""
    import torch.distributed as dist
    gpus = gpus or list(range(world))
    shm0 = _shm()
    used0 = gpu_used_mib() if device == "cuda" else []
    tmp = tempfile.mkdtemp(prefix="uccl-faults-")
    port = _free_port()
    hard = timeout_s * 2 + delay_s + 90
    base = dict(op=op, world=world, mode=mode, victim=victim, delay_s=delay_s, size=size,
                timeout_s=timeout_s, device=device, gpus=gpus, port=port, hard_s=hard)
    pids = {}
    for r in range(world):
        out = os.path.join(tmp, f"rank{r}.json")
        pid = os.fork()
        if pid == 0:
            _child(dict(base, rank=r), out)
        pids[r] = pid
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    t0 = time.monotonic()
    results, dead = {}, set()
    survivors = [r for r in range(world) if r != victim]
    deadline = t0 + hard + 10
    continued = False
    while time.monotonic() < deadline:
        for r, pid in pids.items():
            if r not in dead and os.waitpid(pid, os.WNOHANG)[0] == pid:
                dead.add(r)
        for r in range(world):
            f = os.path.join(tmp, f"rank{r}.json")
            if r not in results and os.path.exists(f):
                with open(f) as fh:
                    results[r] = json.load(fh)
        if mode == "stop" and not continued and all(r in results for r in survivors):
            if victim not in dead:
                os.kill(pids[victim], signal.SIGCONT)   # the stalled rank wakes up
            continued = True
        if len(dead) == world:
            break
        time.sleep(0.02)
    for r, pid in pids.items():       # whatever outstayed its deadline
        if r not in dead:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            results.setdefault(r, {"rank": r, "fatal": "outstayed the trial's deadline: killed"})
    del store
    time.sleep(0.2)                   # the driver's view of what the ranks left
    leftover = sorted(_shm() - shm0)
    used1 = gpu_used_mib() if device == "cuda" else []
    for f in os.listdir(tmp):
        os.unlink(os.path.join(tmp, f))
    os.rmdir(tmp)
    return dict(base, results=[results.get(r, {"rank": r}) for r in range(world)],
                shm_left=leftover, gpu_used_before=used0, gpu_used_after=used1,
                seconds=round(time.monotonic() - t0, 2))


def trial_fresh(op: str, world: int, **kw) -> dict:
    """trial() from a fresh interpreter: the ranks are forked from the
    driver, which must not have made engines or threads of its own (a
    pytest process has; a fork copies their locks mid-use)."""
    arg = json.dumps(dict(kw, op=op, world=world))
    limit = 2 * kw.get("timeout_s", 5.0) + kw.get("delay_s", 0) + 240
    p = subprocess.run([sys.executable, os.path.abspath(__file__), arg], capture_output=True,
                       text=True, timeout=limit)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode or not lines:
        raise RuntimeError(f"the trial's driver exited {p.returncode}: {p.stderr[-3000:]}")
    return json.loads(lines[-1])


def verdict(t: dict) -> list[str]:
    """What went wrong in a trial (empty: it passed).  A survivor must raise
    within timeout + 5 s of the kill, raise again at once, get its stream
    back and close; the SIGSTOPped victim must raise once continued; once
    the job's processes are gone nothing may stay in /dev/shm or on the
    GPUs."""
    bad, lim = [], t["timeout_s"] + 5
    for res in t["results"]:
        r = res.get("rank")
        who = f"rank {r}"
        if "fatal" in res:
            if not (res.get("victim") or r == t["victim"]) or t["mode"] == "stop":
                bad.append(f"{who}: {res['fatal']}")
            continue
        if r == t["victim"] and t["mode"] == "kill":
            if "calls" in res:
                bad.append(f"{who}: the victim reported instead of dying")
            continue
        if res.get("stream_blocked"):
            bad.append(f"{who}: its CUDA stream stayed blocked after {res.get('calls')} calls")
        if res.get("error") is None:
            bad.append(f"{who}: never raised ({res.get('calls')} calls)")
        elif r != t["victim"] and (res.get("raised_s") is None or res["raised_s"] > lim):
            bad.append(f"{who}: raised {res.get('raised_s')} s after the kill (limit {lim} s)")
        if res.get("error") is not None and not res.get("next_raised"):
            bad.append(f"{who}: the next call did not raise")
        elif res.get("next_s", 0) > 1.0:
            bad.append(f"{who}: the next call took {res['next_s']} s to raise")
        if res.get("stream_ok") is False:
            bad.append(f"{who}: work queued after the failure did not complete right")
    if t["shm_left"]:
        bad.append(f"/dev/shm left: {t['shm_left'][:5]}")
    if t["gpu_used_after"] and any(a > b + 64 for a, b in zip(t["gpu_used_after"],
                                                               t["gpu_used_before"])):
        bad.append(f"GPU memory used after the trial {t['gpu_used_after']} MiB, "
                   f"before {t['gpu_used_before']} MiB")
    return bad


def campaign(ops, world: int, trials: int, *, mode: str = "kill", timeout_s: float = 5.0,
             device: str = "cuda", seed: int = 20261127, log=print,
             only: set[int] | None = None) -> list[dict]:
    """`trials` trials of each op: victim, delay and size drawn from seed;
    only: run just these trial numbers (each drawn as in the whole
    campaign, so a failed trial can be run again alone)."""
    rng = random.Random(seed)
    out = []
    for op in ops:
        for i in range(trials):
            victim, delay = rng.randrange(world), round(rng.uniform(0.0, 0.3), 4)
            if only is not None and i not in only:
                continue
            t = trial(op, world, mode=mode, victim=victim, delay_s=delay,
                      size=SIZES[i % len(SIZES)], timeout_s=timeout_s, device=device)
            t["bad"] = verdict(t)
            out.append(t)
            surv = [x for x in t["results"] if x.get("rank") != t["victim"]]
            log(f"{op:24s} w{world} {mode:4s} trial {i} victim {t['victim']} "
                f"delay {t['delay_s']:.3f}s size {t['size']:>9d}: "
                f"raised {[x.get('raised_s') for x in surv]} s, {t['seconds']} s, "
                f"{'ok' if not t['bad'] else 'FAIL ' + '; '.join(t['bad'])}")
    return out


if __name__ == "__main__":   # trial_fresh's driver
    print(json.dumps(trial(**json.loads(sys.argv[1]))), flush=True)
