"""uccl_collective.collective (API.md section 2) with real multi-rank jobs.

One job per world size (2, 3, 4, 5): spawned processes, Gloo on loopback for the
bootstrap and as the reference, the default context made by
init_collective(use_copy_engine_for_intra=True) ("ce": same-host peers through
this engine) plus a second CollectiveContext(use_copy_engine_for_intra=False)
("td": same-host peers through torch.distributed).  Every rank runs the same
plan of cases in the same order and returns one verdict per case; each case is
then its own pytest test (``test_case[ws3-ce-ag-ring-float32-4097-list]``).

Every case: random bytes from a seed (never the poison byte), receive buffers
poisoned with a guard tail, the result compared bitwise with the expected
bytes and with Gloo's dist.all_gather on the same inputs.  All communication
of a case happens before its checks, so a failed check cannot leave ranks out
of step.  The parent waits with a deadline, then dumps the stacks of the ranks
still running, kills them and fails naming them.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import socket
import time
import traceback
from multiprocessing import connection as mp_connection

import pytest

CTX = mp.get_context("spawn")
WORLD_SIZES = (2, 3, 4, 5)
POISON = 0xA5
GUARD = 256                  # bytes past every receive buffer that must stay POISON
MiB = 1 << 20
JOB_TIMEOUT = 80.0           # a whole world-size job, parent side
CTX_TIMEOUT = 20.0           # timeout_s of the contexts the cases use
KILL_TIMEOUT_S = 5.0         # timeout_s of the contexts in the peer-killed job
DTYPES = ("float32", "bfloat16", "int64", "uint8")
ALGOS = ("direct", "ring", "auto")
SIZES = (0, 1, 4097)
BIG_ALGO = {2: "direct", 3: "ring", 4: "auto", 5: "auto"}  # 16 MiB per rank, once per job


# ----------------------------------------------------------------------------
# the plan: the same list in the parent (test ids) and in every rank
def _plan(ws: int) -> list[tuple[str, str, dict]]:
    cases: list[tuple[str, str, dict]] = [("no-init", "no_init", {}), ("info", "info", {})]
    for cx in ("ce", "td"):
        for algo in ALGOS:
            for dt in DTYPES:
                for n in SIZES:
                    for form in ("tensor", "list"):
                        if cx == "td" and form == "list" and n != 4097:
                            continue
                        cases.append((f"{cx}-ag-{algo}-{dt}-{n}-{form}", "ag",
                                      dict(cx=cx, api="allgather", algo=algo, dt=dt, n=n,
                                           form=form)))
            for form in ("inplace-tensor", "inplace-list"):
                for dt, n in (("float32", 4097), ("bfloat16", 1), ("uint8", 4097)):
                    cases.append((f"{cx}-ag-{algo}-{dt}-{n}-{form}", "ag",
                                  dict(cx=cx, api="allgather", algo=algo, dt=dt, n=n, form=form)))
            for form in ("tensor", "list"):
                cases.append((f"{cx}-iag-{algo}-int64-4097-{form}", "ag",
                              dict(cx=cx, api="iallgather", algo=algo, dt="int64", n=4097,
                                   form=form)))
            for lens in ("zero", "mixed"):
                for dt in DTYPES:
                    cases.append((f"{cx}-agv-{algo}-{dt}-{lens}", "agv",
                                  dict(cx=cx, api="allgatherv", algo=algo, dt=dt, lens=lens,
                                       inplace=False)))
                cases.append((f"{cx}-iagv-{algo}-float32-{lens}", "agv",
                              dict(cx=cx, api="iallgatherv", algo=algo, dt="float32", lens=lens,
                                   inplace=False)))
                cases.append((f"{cx}-agv-{algo}-bfloat16-{lens}-inplace", "agv",
                              dict(cx=cx, api="allgatherv", algo=algo, dt="bfloat16", lens=lens,
                                   inplace=True)))
        for dt in DTYPES:
            for n in SIZES:
                cases.append((f"{cx}-sendrecv-{dt}-{n}", "star", dict(cx=cx, dt=dt, n=n)))
                cases.append((f"{cx}-isend-irecv-{dt}-{n}", "a2a", dict(cx=cx, dt=dt, n=n)))
            for style in ("str", "fn"):
                cases.append((f"{cx}-batch-{style}-{dt}", "batch", dict(cx=cx, dt=dt, n=4097,
                                                                         style=style)))
            cases.append((f"{cx}-ringstep-{dt}-4097", "ring_step", dict(cx=cx, dt=dt, n=4097)))
        cases.append((f"{cx}-ringstep-uint8-0", "ring_step", dict(cx=cx, dt="uint8", n=0)))
        cases.append((f"{cx}-register", "register", dict(cx=cx)))
        cases.append((f"{cx}-test-polls-to-true", "test_poll", dict(cx=cx)))
        for err in ("recv-size", "dtype", "algo", "peer", "noncontig"):
            cases.append((f"{cx}-err-{err}", "err_" + err.replace("-", "_"), dict(cx=cx)))
        cases.append((f"{cx}-upstream-forms", "upstream_forms", dict(cx=cx)))
        cases.append((f"{cx}-usable-after-errors", "ag",
                      dict(cx=cx, api="allgather", algo="auto", dt="float32", n=4097,
                           form="tensor")))
    cases.append((f"ce-ag-{BIG_ALGO[ws]}-uint8-16MiB-tensor", "ag",
                  dict(cx="ce", api="allgather", algo=BIG_ALGO[ws], dt="uint8", n=16 * MiB,
                       form="tensor")))
    # Chunks of 1 MiB and more take both ring directions (halves, with an
    # odd length so the split is not page-aligned) and several pieces.
    cases.append(("ce-ag-ring-float32-2MiB+3-tensor", "ag",
                  dict(cx="ce", api="allgather", algo="ring", dt="float32",
                       n=(2 * MiB) // 4 + 3, form="tensor")))
    cases.append(("ce-agv-ring-uint8-big-uneven", "agv",
                  dict(cx="ce", api="allgatherv", algo="ring", dt="uint8", lens="big",
                       inplace=False)))
    if ws == 2:
        cases.append(("ce-ringstep-float32-16MiB", "ring_step",
                      dict(cx="ce", dt="float32", n=4 * MiB)))
    if ws == 3:
        cases.append(("td-ag-ring-float32-16MiB-list", "ag",
                      dict(cx="td", api="allgather", algo="ring", dt="float32", n=4 * MiB,
                           form="list")))
    if ws == 2:
        cases.append(("ce-wait-timeout", "wait_timeout", dict(cx="ce")))
        cases.append(("td-wait-timeout", "wait_timeout", dict(cx="td")))
    # a bad batch must not leave half of it posted (td: 3 s when it does, so once)
    if ws == 3:
        cases.append(("td-err-batch-posts-nothing", "err_batch_partial", dict(cx="td")))
    cases.append(("ce-err-batch-posts-nothing", "err_batch_partial", dict(cx="ce")))
    # last of all: failures, each in its own context
    cases.append(("mismatch-allgatherv-direct", "mismatch_agv",
                  dict(algo="direct", delta=1, trials=20)))
    cases.append(("mismatch-allgatherv-ring", "mismatch_agv",
                  dict(algo="ring", delta=-1, trials=5)))
    cases.append(("mismatch-p2p-recv-size", "mismatch_p2p", {}))
    cases.append(("init-twice-and-finalize", "finalize", {}))
    return cases


# ----------------------------------------------------------------------------
# rank side helpers
def _dtype(name):
    import torch
    return getattr(torch, name)


def _gen(seed: int, n: int, dt):
    """n elements of dtype dt from random bytes; no byte equals POISON."""
    import torch
    dt = _dtype(dt) if isinstance(dt, str) else dt
    esz = torch.empty(0, dtype=dt).element_size()
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n * esz,), dtype=torch.uint8, generator=g)
    b[b == POISON] = 0x5A
    return b.view(dt)


def _poisoned(n: int, dt):
    """(tensor of n elements, its backing bytes incl. a guard tail), all POISON."""
    import torch
    dt = _dtype(dt) if isinstance(dt, str) else dt
    esz = torch.empty(0, dtype=dt).element_size()
    back = torch.full((n * esz + GUARD,), POISON, dtype=torch.uint8)
    return back[:n * esz].view(dt), back


def _bytes(t):
    import torch
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(got, exp, what: str) -> None:
    """Bitwise equality, with a useful message."""
    import torch
    assert got.dtype == exp.dtype, f"{what}: dtype {got.dtype} != {exp.dtype}"
    assert got.numel() == exp.numel(), f"{what}: {got.numel()} elements != {exp.numel()}"
    a, b = _bytes(got), _bytes(exp)
    if not torch.equal(a, b):
        bad = (a != b).nonzero().reshape(-1)
        npois = int((a == POISON).sum())
        raise AssertionError(f"{what}: {bad.numel()} of {a.numel()} bytes differ (first at byte "
                             f"{int(bad[0])}: got {int(a[bad[0]])} want {int(b[bad[0]])}); "
                             f"{npois} bytes still POISON")


def _guard_ok(back, nbytes: int, what: str) -> None:
    tail = back[nbytes:]
    assert bool((tail == POISON).all()), f"{what}: bytes written past the end of the buffer"


def _seed(i: int, src: int, dst: int = 0) -> int:
    return 1_000_003 * (i + 1) + 1009 * src + dst


def _raises(fn, exc, *needles):
    """fn() must raise exc (or a subclass) whose message contains every needle."""
    try:
        fn()
    except exc as e:
        msg = str(e)
        for nd in needles:
            assert str(nd) in msg, f"{exc.__name__} message {msg!r} does not mention {nd!r}"
        return e
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"expected {exc.__name__}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {exc.__name__}, nothing was raised")


def _finish(api, h, cx, bound: float = 10.0):
    """Complete handle h: on the copy-engine context by polling test() until
    True (bounded); on the torch.distributed one test() is called once (it must
    not raise) and wait() completes it -- polling test() there is its own case,
    test-polls-to-true.  Then wait() and test() must keep answering True."""
    if cx == "ce":
        deadline = time.monotonic() + bound
        while not api.test(h):
            if time.monotonic() > deadline:
                raise AssertionError(f"test(handle) still False after {bound} s")
            time.sleep(0.0005)
    else:
        assert api.test(h) in (True, False)
    assert api.wait(h) is True
    assert api.test(h) is True and api.wait(h) is True


class _R:
    """What a rank needs to run a case."""

    def __init__(self, me, ws, ctxs):
        from uccl_collective import collective
        self.me, self.ws, self.ctxs, self.C = me, ws, ctxs, collective
        self.left, self.right = (me - 1) % ws, (me + 1) % ws

    def api(self, cx):
        # the copy-engine context is the default one: use the module-level wrappers
        return self.C if cx == "ce" else self.ctxs[cx]


def _gloo_allgather(t, ws):
    import torch
    import torch.distributed as dist
    outs = [torch.empty_like(t) for _ in range(ws)]
    dist.all_gather(outs, t.clone())
    return outs


# ----------------------------------------------------------------------------
# the cases
def _case_no_init(R, i, p):
    pass  # run before init, see _suite


def _case_info(R, i, p):
    ce, td = R.ctxs["ce"], R.ctxs["td"]
    assert R.C.get_collective() is ce
    for c in (ce, td):
        assert (c.rank, c.world_size) == (R.me, R.ws), (c.rank, c.world_size)
    assert ce.local_gpu_idx == R.me, f"LOCAL_RANK={R.me} but local_gpu_idx={ce.local_gpu_idx}"
    assert td.local_gpu_idx == 0, td.local_gpu_idx  # given explicitly
    for r in range(R.ws):
        if r == R.me:
            continue
        want = "rdma" if os.environ.get("UCCL_P2P_TRANSPORT") == "rdma" else "shm-cma"
        assert ce.transport_to(r) == want, (r, ce.transport_to(r))
        assert td.transport_to(r) == "torch.distributed", (r, td.transport_to(r))
    _raises(lambda: ce.transport_to(R.me), ValueError, "peer rank")
    _raises(lambda: td.transport_to(R.ws), ValueError, "peer rank")


def _case_ag(R, i, p):
    me, ws, n, dt, form = R.me, R.ws, p["n"], p["dt"], p["form"]
    api = R.api(p["cx"])
    exps = [_gen(_seed(i, r), n, dt) for r in range(ws)]
    send = exps[me].clone()
    esz = send.element_size()
    if form in ("tensor", "inplace-tensor"):
        recv, back = _poisoned(ws * n, dt)
        chunks, backs = [recv[r * n:(r + 1) * n] for r in range(ws)], None
        arg = recv
    else:
        made = [_poisoned(n, dt) for _ in range(ws)]
        chunks, backs = [m[0] for m in made], [m[1] for m in made]
        arg = chunks if form == "list" else tuple(chunks)
    src = send
    if form.startswith("inplace"):
        chunks[me].copy_(send)
        src = chunks[me]      # a view of this rank's chunk of the output
    if p["api"] == "allgather":
        assert api.allgather(src, arg, algorithm=p["algo"]) is None
    else:
        _finish(api, api.iallgather(src, arg, p["algo"]), p["cx"])
    ref = _gloo_allgather(send, ws)
    for r in range(ws):
        _same(chunks[r], exps[r], f"chunk of rank {r} vs the data rank {r} sent")
        _same(chunks[r], ref[r], f"chunk of rank {r} vs Gloo all_gather")
    if backs is None:
        _guard_ok(back, ws * n * esz, "recv")
    else:
        for r in range(ws):
            _guard_ok(backs[r], n * esz, f"recv[{r}]")
    if not form.startswith("inplace"):
        _same(send, exps[me], "send tensor (must not change)")


def _lens(kind, ws):
    if kind == "big":  # around the 1 MiB two-direction threshold, odd, one empty
        return [0 if r == 1 else MiB + 4097 * r - 1 for r in range(ws)]
    if kind == "zero":
        return [0 if r == 1 else 4097 + 61 * r for r in range(ws)]
    return [(r * r * 37) % 11 for r in range(ws)]   # 0, 4, 5, 3, 9


def _case_agv(R, i, p):
    import torch
    me, ws, dt = R.me, R.ws, p["dt"]
    api = R.api(p["cx"])
    lens = _lens(p["lens"], ws)
    exps = [_gen(_seed(i, r), lens[r], dt) for r in range(ws)]
    send = exps[me].clone()
    made = [_poisoned(lens[r], dt) for r in range(ws)]
    recv = [m[0] for m in made]
    src = send
    if p["inplace"]:
        recv[me].copy_(send)
        src = recv[me]
    if p["api"] == "allgatherv":
        assert api.allgatherv(src, recv, algorithm=p["algo"]) is None
    else:
        _finish(api, api.iallgatherv(src, recv, p["algo"]), p["cx"])
    # Gloo reference: pad every chunk to the longest, gather, cut back
    m = max(max(lens), 1)
    padded = torch.zeros(m, dtype=_dtype(dt))
    padded[:lens[me]] = send
    ref = _gloo_allgather(padded, ws)
    esz = send.element_size()
    for r in range(ws):
        _same(recv[r], exps[r], f"recv[{r}] ({lens[r]} elements) vs the data rank {r} sent")
        _same(recv[r], ref[r][:lens[r]], f"recv[{r}] vs Gloo")
        _guard_ok(made[r][1], lens[r] * esz, f"recv[{r}]")


def _case_star(R, i, p):
    """Blocking send/recv (dst=/src= keywords): rank 0 to each rank, then back."""
    me, ws, n, dt = R.me, R.ws, p["n"], p["dt"]
    api = R.api(p["cx"])
    got = {}
    if me == 0:
        for r in range(1, ws):
            assert api.send(_gen(_seed(i, 0, r), n, dt), dst=r) is None
        for r in range(1, ws):
            got[r] = _poisoned(n, dt)
            assert api.recv(got[r][0], src=r) is None
    else:
        got[0] = _poisoned(n, dt)
        api.recv(got[0][0], src=0)
        api.send(_gen(_seed(i, me, 0), n, dt), dst=0)
    for r, (t, back) in got.items():
        _same(t, _gen(_seed(i, r, me), n, dt), f"recv from rank {r}")
        _guard_ok(back, t.numel() * t.element_size(), f"recv from rank {r}")


def _case_a2a(R, i, p):
    """isend/irecv to and from every rank; test() polled, wait(), wait_all()."""
    me, ws, n, dt = R.me, R.ws, p["n"], p["dt"]
    api = R.api(p["cx"])
    bufs, sends, hs = {}, [], []
    for r in range(ws):
        if r != me:
            bufs[r] = _poisoned(n, dt)
            hs.append(api.irecv(bufs[r][0], src=r))
    for r in range(ws):
        if r != me:
            sends.append(_gen(_seed(i, me, r), n, dt))
            hs.append(api.isend(sends[-1], dst=r))
    _finish(api, hs[0], p["cx"])
    assert api.wait(hs[1]) is True
    assert api.wait_all(hs[2:]) is True
    assert all(api.test(h) is True for h in hs), "test() after completion must stay True"
    assert all(api.wait(h) is True for h in hs), "wait() after completion must stay True"
    for r, (t, back) in bufs.items():
        _same(t, _gen(_seed(i, r, me), n, dt), f"irecv from rank {r}")
        _guard_ok(back, t.numel() * t.element_size(), f"irecv from rank {r}")
    for k, r in enumerate(r for r in range(ws) if r != me):
        _same(sends[k], _gen(_seed(i, me, r), n, dt), f"isend buffer to {r} (must not change)")


def _case_batch(R, i, p):
    """batch_isend_irecv: send to right and left, receive from left and right."""
    me, n, dt = R.me, p["n"], p["dt"]
    api, C = R.api(p["cx"]), R.C
    S, Rv = ("send", "recv") if p["style"] == "str" else (C.isend, C.irecv)
    a, c = _gen(_seed(i, me, 0), n, dt), _gen(_seed(i, me, 1), n, dt)
    (b, bb), (d, db) = _poisoned(n, dt), _poisoned(n, dt)
    ops = [C.P2POp(S, a, R.right), C.P2POp(Rv, b, R.left), C.P2POp(S, c, R.left),
           C.P2POp(Rv, d, R.right)]
    assert [o.op for o in ops] == ["send", "recv", "send", "recv"]
    hs = api.batch_isend_irecv(ops)
    assert len(hs) == len(ops), f"{len(hs)} handles for {len(ops)} ops"
    assert api.wait_all(hs) is True
    assert api.batch_isend_irecv([]) == []
    _same(b, _gen(_seed(i, R.left, 0), n, dt), "recv from left (its send to the right)")
    _same(d, _gen(_seed(i, R.right, 1), n, dt), "recv from right (its send to the left)")
    _guard_ok(bb, b.numel() * b.element_size(), "recv from left")
    _guard_ok(db, d.numel() * d.element_size(), "recv from right")


def _case_ring_step(R, i, p):
    me, n, dt = R.me, p["n"], p["dt"]
    api = R.api(p["cx"])
    s = _gen(_seed(i, me), n, dt)
    r, back = _poisoned(n, dt)
    assert api.sendrecv(s, R.right, r, R.left) is None
    _same(r, _gen(_seed(i, R.left), n, dt), "sendrecv from the left")
    _guard_ok(back, r.numel() * r.element_size(), "sendrecv recv")
    # keyword form, the other way round
    r2, back2 = _poisoned(n, dt)
    api.sendrecv(send_tensor=s, dst=R.left, recv_tensor=r2, src=R.right)
    _same(r2, _gen(_seed(i, R.right), n, dt), "sendrecv from the right")
    _guard_ok(back2, r2.numel() * r2.element_size(), "sendrecv recv (2)")


def _case_test_poll(R, i, p):
    """Polling test() alone (no wait()) must see isend, irecv and iallgather
    finish.  Bounded at 2 s; wait() then completes them either way."""
    me, ws, n = R.me, R.ws, 4097
    api = R.api(p["cx"])
    s = _gen(_seed(i, me), n, "float32")
    r, back = _poisoned(n, "float32")
    ag, agb = _poisoned(n * ws, "float32")
    hs = {"irecv": api.irecv(r, src=R.left), "isend": api.isend(s, dst=R.right),
          "iallgather(direct)": api.iallgather(s, ag, "direct")}
    pending, end = dict(hs), time.monotonic() + 2.0
    while pending and time.monotonic() < end:
        for k, h in list(pending.items()):
            if api.test(h):
                del pending[k]
        time.sleep(0.001)
    assert api.wait_all(hs.values()) is True
    _same(r, _gen(_seed(i, R.left), n, "float32"), "irecv")
    for q in range(ws):
        _same(ag[q * n:(q + 1) * n], _gen(_seed(i, q), n, "float32"), f"iallgather chunk {q}")
    assert not pending, (f"test() never returned True within 2 s for {sorted(pending)}, "
                         "although wait() then completed them at once")


def _case_wait_timeout(R, i, p):
    """wait(h, timeout=1) on an irecv nobody sends to must raise
    UcclTimeoutError after about 1 s.  Own context (and for td its own Gloo
    group, timeout 5 s) since a timed-out communicator is poisoned."""
    import datetime

    import torch
    import torch.distributed as dist
    from uccl_collective import UcclTimeoutError
    from uccl_collective.collective import CollectiveContext
    group = None
    if p["cx"] == "td":
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
    ctx = CollectiveContext(use_copy_engine_for_intra=p["cx"] == "ce", timeout_s=1.0,
                            group=group).init()
    try:
        err, el = None, 0.0
        if R.me == 0:
            h = ctx.irecv(torch.empty(100), src=1)
            t0 = time.monotonic()
            try:
                ctx.wait(h, timeout=1.0)
            except Exception as e:  # noqa: BLE001
                err = e
            el = time.monotonic() - t0
        dist.barrier()
        if R.me == 0:
            assert err is not None, "wait() returned though nothing was sent"
            assert isinstance(err, UcclTimeoutError), f"{type(err).__name__}: {err}"
            assert el < 3.0, f"wait(timeout=1) took {el:.1f} s"
    finally:
        ctx.finalize()


def _case_register(R, i, p):
    import torch
    me, ws, n = R.me, R.ws, 4097
    api = R.api(p["cx"])
    exps = [_gen(_seed(i, r), n, "float32") for r in range(ws)]
    big = torch.full((ws * n * 4 + 3 * n * 4 + GUARD,), POISON, dtype=torch.uint8)
    mr = api.register_tensor(big)
    assert isinstance(mr, int) and not isinstance(mr, bool), repr(mr)
    assert api.register_tensor(big) == mr, "registering the same tensor again must reuse it"
    send = exps[me].clone()
    smr = api.register_tensor(send)
    assert isinstance(smr, int) and smr != mr
    # allgather into a sub-range of the registered region
    recv = big[:ws * n * 4].view(torch.float32)
    api.allgather(send, recv, algorithm="ring")
    ref = _gloo_allgather(send, ws)
    for r in range(ws):
        _same(recv[r * n:(r + 1) * n], exps[r], f"registered recv, chunk {r}")
        _same(recv[r * n:(r + 1) * n], ref[r], f"registered recv, chunk {r} vs Gloo")
    # a ring step between two other sub-ranges of it
    s2 = big[ws * n * 4:(ws + 1) * n * 4].view(torch.float32)
    s2.copy_(_gen(_seed(i, me, 7), n, "float32"))
    r2 = big[(ws + 1) * n * 4:(ws + 2) * n * 4].view(torch.float32)
    api.sendrecv(s2, R.right, r2, R.left)
    _same(r2, _gen(_seed(i, R.left, 7), n, "float32"), "sendrecv in registered memory")
    assert bool((big[(ws + 2) * n * 4:] == POISON).all()), "bytes past the used sub-ranges"
    assert api.deregister_tensor(big) is True
    assert api.deregister_tensor(big) is False, "deregistering twice must return False"
    assert api.deregister_tensor(send) is True
    assert api.deregister_tensor(torch.zeros(3)) is False
    # the same buffers, unregistered now, still work
    big[:ws * n * 4].fill_(POISON)
    api.allgather(send, recv, algorithm="direct")
    for r in range(ws):
        _same(recv[r * n:(r + 1) * n], exps[r], f"after deregister, chunk {r}")


def _case_err_recv_size(R, i, p):
    import torch
    api, ws, me = R.api(p["cx"]), R.ws, R.me
    s = torch.zeros(10)
    # (a larger recv is accepted, as upstream: case upstream_forms)
    _raises(lambda: api.allgather(s, torch.zeros(10 * ws - 1)), ValueError, str(10 * ws - 1),
            "elements")
    _raises(lambda: api.iallgather(s, torch.zeros(10)), ValueError, "elements")
    bad = [torch.zeros(10) for _ in range(ws)]
    bad[R.right] = torch.zeros(11)
    _raises(lambda: api.allgather(s, bad), ValueError, "11")
    _raises(lambda: api.allgather(s, [torch.zeros(10)] * (ws + 1)), ValueError, str(ws + 1))
    own = [torch.zeros(10) for _ in range(ws)]
    own[me] = torch.zeros(9)   # allgatherv: this rank's own chunk must match send
    _raises(lambda: api.allgatherv(s, own), ValueError, "9")


def _case_err_dtype(R, i, p):
    import torch
    api, ws = R.api(p["cx"]), R.ws
    s = torch.zeros(10)
    _raises(lambda: api.allgather(s, torch.zeros(10 * ws, dtype=torch.int32)), ValueError,
            "dtype", "int32")
    lst = [torch.zeros(10) for _ in range(ws)]
    lst[R.left] = torch.zeros(10, dtype=torch.bfloat16)
    _raises(lambda: api.allgather(s, lst), ValueError, "dtype", "bfloat16")
    _raises(lambda: api.allgatherv(s, lst), ValueError, "dtype")


def _case_err_algo(R, i, p):
    import torch
    api, ws = R.api(p["cx"]), R.ws
    s, r = torch.zeros(10), torch.zeros(10 * ws)
    _raises(lambda: api.allgather(s, r, algorithm="tree"), ValueError, "'tree'")
    _raises(lambda: api.iallgather(s, r, "Ring"), ValueError, "'Ring'")
    _raises(lambda: api.allgatherv(s, list(r.chunk(ws)), algorithm=""), ValueError, "algorithm")


def _case_err_peer(R, i, p):
    import torch
    api, ws, C = R.api(p["cx"]), R.ws, R.C
    t = torch.zeros(10)
    for bad in (ws, ws + 7, -1):
        _raises(lambda: api.send(t, dst=bad), ValueError, f"peer rank {bad}")
        _raises(lambda: api.recv(t, src=bad), ValueError, f"peer rank {bad}")
        _raises(lambda: api.isend(t, bad), ValueError, f"peer rank {bad}")
        _raises(lambda: api.irecv(t, bad), ValueError, f"peer rank {bad}")
        _raises(lambda: api.sendrecv(t, bad, torch.zeros(10), R.left), ValueError,
                f"peer rank {bad}")
        _raises(lambda: api.batch_isend_irecv([C.P2POp("recv", t, bad)]), ValueError,
                f"peer rank {bad}")
    _raises(lambda: api.send(t, dst=float(R.right)), TypeError, "int")
    _raises(lambda: api.send(t, dst=True), TypeError, "int")
    _raises(lambda: C.P2POp("bcast", t, R.right), ValueError, "'bcast'")


def _case_upstream_forms(R, i, p):
    """What upstream's scripts write, accepted: an op with the caller's own
    rank is skipped (nothing is copied, the handle is done at once); numpy
    integer peers; (op, tensor, peer) tuples in batch_isend_irecv; a recv
    larger than world_size chunks (the part past them untouched);
    wait_all(iallgather(...)) and iterating its result; the attributes
    upstream's CollectiveContext has."""
    import numpy as np
    import torch
    api, ws, me, C = R.api(p["cx"]), R.ws, R.me, R.C
    n = 257
    # own rank: skipped, buffer untouched
    got, back = _poisoned(n, "int64")
    src = _gen(_seed(i, me), n, "int64")
    api.send(src, dst=me)
    api.recv(got, src=me)
    assert bool((back == POISON).all()), "a skipped recv from this rank wrote into its buffer"
    h = api.isend(src, np.int64(me))
    assert isinstance(h, int) and h == -1, f"own-rank isend gave {h!r}, upstream's dummy id is -1"
    assert api.test(h) is True and api.wait(h) is True
    assert api.wait(api.irecv(got, me)) is True
    assert bool((back == POISON).all())
    assert api.wait(-1) is True and api.test(-1) is True and api.wait_all([-1, h]) is True
    for bad in (7, "h", None):
        _raises(lambda: api.wait(bad), TypeError, "not a handle")
    # numpy peers and tuples, with a self entry among them
    ops = [("send", _gen(_seed(i, me, R.right), n, "int64"), np.int32(R.right)),
           (C.irecv, got, np.int64(R.left)), ("send", src, me)]
    hs = api.batch_isend_irecv(ops)
    assert all(isinstance(h, int) for h in hs) and hs[0] > 0, f"handles are ids: {hs!r}"
    api.wait_all(hs)
    _same(got, _gen(_seed(i, R.left, me), n, "int64"), "batch of tuples with numpy peers")
    # isend/irecv: ids (ints), distinct, waited for through the context by id
    r1, r2 = _poisoned(n, "int64"), _poisoned(n, "int64")
    ids = [api.irecv(r1[0], R.left), api.isend(_gen(_seed(i, me, 7), n, "int64"), R.right),
           api.irecv(r2[0], R.left), api.isend(_gen(_seed(i, me, 8), n, "int64"), R.right)]
    assert all(type(x).__name__ == "Handle" and isinstance(x, int) for x in ids)
    assert len({int(x) for x in ids}) == 4 and min(ids) > 0, f"ids not distinct: {ids!r}"
    assert api.wait_all(ids) is True
    _same(r1[0], _gen(_seed(i, R.left, 7), n, "int64"), "irecv by id")
    _same(r2[0], _gen(_seed(i, R.left, 8), n, "int64"), "irecv by id")
    _guard_ok(r1[1], n * 8, "irecv by id")
    _guard_ok(back, n * 8, "batch of tuples with numpy peers")
    # a larger recv, through wait_all(iallgather) and iteration over its result
    big, bback = _poisoned(ws * n + 5, "int64")
    hs = api.iallgather(_gen(_seed(i, me, 99), n, "int64"), big)
    assert [x for x in hs] == [hs]
    assert api.wait_all(hs) is True
    exp = torch.cat([_gen(_seed(i, r, 99), n, "int64") for r in range(ws)])
    _same(big[:ws * n], exp, "allgather into a larger recv")
    _guard_ok(bback, ws * n * 8, "allgather into a larger recv (the part past the chunks)")
    api.wait_all([[api.iallgather(torch.zeros(1), torch.zeros(ws))], []])
    # upstream's attributes
    ctx = api if isinstance(api, C.CollectiveContext) else C.get_collective()
    assert ctx.initialized is True and ctx.P2POp is C.P2POp
    assert ctx.dist_backend == "gloo"
    sc, rc = ctx.send_connections, ctx.recv_connections
    assert len(sc) == len(rc) == ws and sc[me] is None and rc[me] is None
    for r in range(ws):
        if r != me and ctx.transport_to(r) != "torch.distributed":
            assert isinstance(sc[r], int) and isinstance(rc[r], int)
    assert ctx.local_connections == [r != me for r in range(ws)]   # one host here
    t = torch.zeros(64)
    assert ctx.check_tensor_registered(t) is False
    mr = ctx.register_tensor(t)
    assert ctx.check_tensor_registered(t[8:16]) is True
    assert ctx.memory_regions[t.data_ptr()] == mr
    assert ctx.deregister_tensor(t) is True and t.data_ptr() not in ctx.memory_regions
    from uccl_collective.p2p import FloatType as F
    assert ctx.float_type_from_tensor(torch.zeros(1, dtype=torch.bfloat16)) == F.kBFloat16
    assert ctx.float_type_from_tensor(torch.zeros(1)) == F.kFloat32
    assert ctx.float_type_from_tensor(torch.zeros(1, dtype=torch.int64)) == F.kUndefined


def _case_err_noncontig(R, i, p):
    import torch
    api, ws, C = R.api(p["cx"]), R.ws, R.C
    nc = torch.zeros(20)[::2]
    assert not nc.is_contiguous()
    _raises(lambda: api.send(nc, dst=R.right), ValueError, "contiguous")
    _raises(lambda: api.irecv(nc, R.left), ValueError, "contiguous")
    _raises(lambda: api.isend(nc, R.left), ValueError, "contiguous")
    _raises(lambda: api.allgather(nc, torch.zeros(10 * ws)), ValueError, "contiguous")
    recv_nc = torch.zeros(10, ws).t()     # (ws, 10), not contiguous
    _raises(lambda: api.allgather(torch.zeros(10), recv_nc), ValueError, "contiguous")
    lst = [torch.zeros(10) for _ in range(ws)]
    lst[R.right] = torch.zeros(20)[::2]
    _raises(lambda: api.allgatherv(torch.zeros(10), lst), ValueError, "contiguous")
    _raises(lambda: api.register_tensor(nc), ValueError, "contiguous")
    _raises(lambda: api.batch_isend_irecv([C.P2POp("send", nc, R.right)]), ValueError,
            "contiguous")


def _case_err_batch_partial(R, i, p):
    """A batch with a bad entry after a good one must raise and post nothing:
    afterwards a fresh exchange with the same peers gets the fresh data.
    td: its own context over its own Gloo group (timeout 3 s), since a
    half-posted Gloo batch can wedge the pair."""
    import datetime

    import torch
    import torch.distributed as dist
    from uccl_collective.collective import CollectiveContext
    api, C, n = R.api(p["cx"]), R.C, 1000
    if p["cx"] == "td":
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
        api = CollectiveContext(use_copy_engine_for_intra=False, group=group, timeout_s=3).init()
    stray = _gen(_seed(i, R.me, 1), n, "int64")
    _raises(lambda: api.batch_isend_irecv([C.P2POp("send", stray, R.right),
                                           C.P2POp("recv", _poisoned(n, "int64")[0], R.ws)]),
            ValueError, f"peer rank {R.ws}")
    _raises(lambda: api.batch_isend_irecv([C.P2POp("send", stray, R.right),
                                           C.P2POp("recv", _poisoned(2 * n, "int64")[0][::2],
                                                   R.left)]),
            ValueError, "contiguous")
    # Probe: receive from the left until the fresh message comes (at most 3
    # receives: 2 stray sends + the fresh one), counting strays on the way.
    fresh = _gen(_seed(i, R.me, 2), n, "int64")
    want_stray = _bytes(_gen(_seed(i, R.left, 1), n, "int64"))
    strays, err = 0, None
    try:
        hs = api.isend(fresh, dst=R.right)
        for _ in range(3):
            got, back = _poisoned(n, "int64")
            assert api.wait(api.irecv(got, src=R.left)) is True
            if torch.equal(_bytes(got), want_stray):
                strays += 1
                continue
            _same(got, _gen(_seed(i, R.left, 2), n, "int64"), "fresh message after rejected "
                  "batches")
            _guard_ok(back, n * 8, "fresh recv")
            break
        assert api.wait(hs) is True
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {str(e)[:200]}"
    assert strays == 0 and err is None, (
        f"after two batch_isend_irecv calls that raised ValueError (a good send entry, then a "
        f"bad one), the fresh send/recv with the same peers: {strays} stray message(s) "
        f"received first; error: {err}")


def _case_mismatch_agv(R, i, p):
    """Rank 0 expects rank 1's chunk one element longer (direct) / shorter (ring)
    than rank 1 sends: every rank must raise UcclMismatchError (a ValueError:
    API.md, a size mismatch is the caller's mistake) naming rank 1's size and
    rank 0's, at once (the sizes are compared before anything moves), with
    every receive buffer still poisoned; the context stays usable (the next
    allgatherv gives every rank's chunk).  Each trial in its own context;
    repeated, since the ranks arrive in varying order."""
    import collections

    import torch.distributed as dist
    from uccl_collective import UcclMismatchError
    from uccl_collective.collective import CollectiveContext
    me, ws = R.me, R.ws
    lens = [100 + 3 * r for r in range(ws)]
    want = list(lens)
    if me == 0:
        want[1] += p["delta"]
    sent, posted = 4 * lens[1], 4 * (lens[1] + p["delta"])   # (rank 0's, on every rank)
    outcomes, slow = collections.Counter(), []
    for trial in range(p["trials"]):
        ctx = CollectiveContext(use_copy_engine_for_intra=True, timeout_s=5).init()
        try:
            send = _gen(_seed(i, me, trial), lens[me], "float32")
            recv = [_poisoned(want[r], "float32") for r in range(ws)]
            t0 = time.monotonic()
            err = None
            try:
                ctx.allgatherv(send, [t for t, _ in recv], algorithm=p["algo"])
            except Exception as e:  # noqa: BLE001
                err = e
            el = time.monotonic() - t0
            if el > 2:
                slow.append(f"trial {trial} took {el:.1f} s")
            ok = (isinstance(err, UcclMismatchError) and
                  f"rank 1 sends {sent} bytes, rank 0 expects {posted}" in str(err) and
                  all(bool((back == POISON).all()) for _, back in recv))
            outcomes["raised naming both sizes, nothing written" if ok else
                     ("no error" if err is None else
                      f"{type(err).__name__}: {str(err)[:160]}")] += 1
            # still usable: every rank's chunk arrives
            got = [_poisoned(lens[r], "float32")[0] for r in range(ws)]
            ctx.allgatherv(send, got, algorithm=p["algo"])
            for r in range(ws):
                _same(got[r], _gen(_seed(i, r, trial), lens[r], "float32"),
                      f"trial {trial}: chunk of rank {r} after the mismatch")
            dist.barrier()
        finally:
            ctx.finalize()
    assert not slow, "; ".join(slow)
    good = outcomes.pop("raised naming both sizes, nothing written", 0)
    assert not outcomes, (f"{sum(outcomes.values())} of {p['trials']} trials ({good} good): "
                          + "; ".join(f"{v}x {k}" for k, v in outcomes.items()))


def _case_mismatch_p2p(R, i, p):
    import torch.distributed as dist
    from uccl_collective.collective import CollectiveContext
    me = R.me
    ctx = CollectiveContext(use_copy_engine_for_intra=True, timeout_s=5).init()
    try:
        err = None
        try:
            if me == 1:
                ctx.send(_gen(1, 100, "float32"), 0)
            elif me == 0:
                ctx.recv(_poisoned(101, "float32")[0], 1)
        except Exception as e:  # noqa: BLE001
            err = e
        dist.barrier()
        # both sides raise, naming the peer and both sizes
        needles = {0: ("recv from rank 1", "size mismatch", "sent 400 bytes", "posted 404 bytes"),
                   1: ("send to rank 0", "size mismatch", "has 400 bytes", "posted 404 bytes")}
        if me in needles:
            assert isinstance(err, ValueError), f"rank {me}: {err!r}"
            for nd in needles[me]:
                assert nd in str(err), f"rank {me}: {nd!r} not in {str(err)!r}"
        # the mismatched message was taken on both sides: the next one matches
        if me == 1:
            ctx.send(_gen(2, 100, "float32"), 0)
        elif me == 0:
            t = _poisoned(100, "float32")[0]
            ctx.recv(t, 1)
            _same(t, _gen(2, 100, "float32"), "the message after the mismatched one")
        dist.barrier()
    finally:
        ctx.finalize()


def _case_finalize(R, i, p):
    import torch
    C, ce, ws = R.C, R.ctxs["ce"], R.ws
    assert C.get_collective() is ce
    # a second init_collective replaces the default context (upstream's
    # behaviour), finalizing the old one
    new = C.init_collective(use_copy_engine_for_intra=True, timeout_s=CTX_TIMEOUT)
    assert new is not ce and C.get_collective() is new and ce.ep is None
    out, back = _poisoned(ws, "int64")
    new.allgather(torch.full((1,), R.me, dtype=torch.int64), out)
    _same(out, torch.arange(ws), "allgather on the replacing context")
    _guard_ok(back, ws * 8, "allgather on the replacing context")
    C.finalize_collective()
    _raises(C.get_collective, RuntimeError, "init_collective")
    _raises(lambda: C.allgather(torch.zeros(1), torch.zeros(R.ws)), RuntimeError)
    _raises(lambda: ce.allgather(torch.zeros(1), torch.zeros(R.ws)), ValueError,
            "not initialised")
    C.finalize_collective()   # a second time is harmless
    R.ctxs["td"].finalize()
    with R.ctxs["td"]:
        pass                   # re-initialised by the context manager, then finalized
    assert R.ctxs["td"].ep is None


CASES = {name[len("_case_"):]: fn for name, fn in list(globals().items())
         if name.startswith("_case_")}


# ----------------------------------------------------------------------------
# a rank
def _rank_entry(target, rank, ws, port, out, kwargs):
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update({"UCCL_SOCKET_IFNAME": "lo", "UCCL_P2P_LOG_LEVEL": "ERROR",
                       "GLOO_SOCKET_IFNAME": "lo", "LOCAL_RANK": str(rank)})
    try:
        res = target(rank, ws, port, **kwargs)
    except BaseException as e:  # noqa: BLE001
        out.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    else:
        out.send(("ok", res))
    out.close()
    os._exit(0)   # no teardown that could wait on a peer


def _init_gloo(rank, ws, port):
    import datetime

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ws, timeout=datetime.timedelta(seconds=60))


def _suite(rank, ws, port):
    import torch
    from uccl_collective import collective
    from uccl_collective.collective import CollectiveContext

    torch.set_num_threads(1)
    verdicts: dict[str, str | None] = {}
    # before any init: no default context, and a context cannot bootstrap
    try:
        _raises(collective.get_collective, RuntimeError, "init_collective")
        _raises(lambda: collective.allgather(torch.zeros(1), torch.zeros(ws)), RuntimeError)
        _raises(lambda: collective.register_tensor(torch.zeros(1)), RuntimeError)
        _raises(lambda: CollectiveContext().init(), RuntimeError, "init_process_group")
        _raises(lambda: CollectiveContext().allgather(torch.zeros(1), torch.zeros(ws)),
                ValueError, "not initialised")
        verdicts["no-init"] = None
    except Exception as e:  # noqa: BLE001
        verdicts["no-init"] = f"{type(e).__name__}: {e}"
    _init_gloo(rank, ws, port)
    ce = collective.init_collective(use_copy_engine_for_intra=True, timeout_s=CTX_TIMEOUT)
    td = CollectiveContext(local_gpu_idx=0, use_copy_engine_for_intra=False,
                           timeout_s=CTX_TIMEOUT).init()
    R = _R(rank, ws, {"ce": ce, "td": td})
    times = {}
    for i, (name, kind, params) in enumerate(_plan(ws)):
        if name in verdicts:
            continue
        t0 = time.monotonic()
        try:
            CASES[kind](R, i, params)
            verdicts[name] = None
        except Exception as e:  # noqa: BLE001
            tb = traceback.format_exc(limit=-3)
            verdicts[name] = f"{type(e).__name__}: {e}\n{tb}"
        times[name] = round(time.monotonic() - t0, 3)
    import torch.distributed as dist
    dist.barrier()   # rank 0 hosts the store: nobody may still need it when it exits
    return {"verdicts": verdicts, "times": times}


def _killed_peer(rank, ws, port, victim):
    """Two contexts (timeout_s=5); a good allgather on each; then the victim
    exits and the survivors run allgather (direct on one, ring on the other)
    and a recv from the victim on a third."""
    import torch
    import torch.distributed as dist
    from uccl_collective import UcclError, UcclTimeoutError, collective
    from uccl_collective.collective import CollectiveContext

    _init_gloo(rank, ws, port)
    a = collective.init_collective(use_copy_engine_for_intra=True, timeout_s=KILL_TIMEOUT_S)
    b = CollectiveContext(use_copy_engine_for_intra=True, timeout_s=KILL_TIMEOUT_S).init()
    c = CollectiveContext(use_copy_engine_for_intra=True, timeout_s=KILL_TIMEOUT_S).init()
    n = 1 << 16
    for ctx, algo in ((a, "direct"), (b, "ring")):
        recv, _ = _poisoned(n * ws, "float32")
        ctx.allgather(_gen(rank, n, "float32"), recv, algorithm=algo)
        for r in range(ws):
            _same(recv[r * n:(r + 1) * n], _gen(r, n, "float32"), f"warm-up {algo}, chunk {r}")
    dist.barrier()
    if rank == victim:
        os._exit(0)
    out = {}
    for name, fn in (
            ("allgather-direct", lambda: a.allgather(_gen(rank, n, "float32"),
                                                     _poisoned(n * ws, "float32")[0],
                                                     algorithm="direct")),
            ("allgather-ring", lambda: b.allgather(_gen(rank, n, "float32"),
                                                   _poisoned(n * ws, "float32")[0],
                                                   algorithm="ring")),
            ("recv", lambda: c.recv(torch.empty(n), src=victim))):
        t0 = time.monotonic()
        try:
            fn()
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = dict(type=type(e).__name__, msg=str(e),
                             ok_type=isinstance(e, (UcclError, UcclTimeoutError)),
                             elapsed=time.monotonic() - t0)
    return out


# ----------------------------------------------------------------------------
# the parent
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(target, ws, *, timeout=JOB_TIMEOUT, expect_exit=(), **kwargs):
    """Run target(rank, ws, port, **kwargs) in ws spawned ranks; {rank: result}.
    Ranks in expect_exit may exit without a result.  Fails the test naming any
    rank that raised, died, or did not finish within `timeout` (then killed)."""
    port = _free_port()
    pipes = [CTX.Pipe(duplex=False) for _ in range(ws)]
    procs = [CTX.Process(target=_rank_entry, name=f"uccl-coll-rank{r}", daemon=True,
                         args=(target, r, ws, port, pipes[r][1], kwargs)) for r in range(ws)]
    for p in procs:
        p.start()
    for _, w in pipes:
        w.close()
    results: dict[int, tuple[str, object]] = {}
    gone: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(gone) < ws:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            live = {pipes[r][0]: r for r in range(ws) if r not in results and r not in gone}
            for c in mp_connection.wait(list(live), timeout=min(left, 0.5)):
                r = live[c]
                try:
                    results[r] = c.recv()
                except (EOFError, OSError):
                    gone.add(r)   # exited without a result
        pending = [r for r in range(ws) if r not in results and r not in gone]
        if pending:
            for r in pending:
                try:
                    os.kill(procs[r].pid, signal.SIGUSR1)   # stacks to the captured stderr
                except OSError:
                    pass
            time.sleep(0.5)
            errs = [f"--- rank {r}:\n{v}" for r, (k, v) in sorted(results.items()) if k == "err"]
            errs += [f"--- rank {r} exited without a result (exit code {procs[r].exitcode})"
                     for r in sorted(gone)]
            pytest.fail(f"world size {ws}: rank(s) {pending} hung: no result within "
                        f"{timeout:.0f} s (killed)" +
                        ("; meanwhile\n" + "\n".join(errs) if errs else ""), pytrace=False)
        for r in sorted(gone):
            procs[r].join(5)
            if r not in expect_exit:
                pytest.fail(f"world size {ws}: rank {r} died (exit code {procs[r].exitcode}) "
                            "without a result", pytrace=False)
        errs = [f"--- rank {r}:\n{v}" for r, (k, v) in sorted(results.items()) if k == "err"]
        if errs:
            pytest.fail(f"world size {ws}: rank(s) raised outside any case\n" + "\n".join(errs),
                        pytrace=False)
        return {r: v for r, (k, v) in results.items()}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)


def cached_job(cache: dict, key, launch):
    """One job per key, shared by all its cases (a failed job fails them
    all): launch() the first time, its result or failure every time."""
    if key not in cache:
        t0 = time.monotonic()
        try:
            cache[key] = (True, launch())
        except pytest.fail.Exception as e:
            cache[key] = (False, str(e))
        print(f"[job {key}: {time.monotonic() - t0:.1f} s]")
    ok, val = cache[key]
    if not ok:
        pytest.fail(val, pytrace=False)
    return val


def check_verdicts(res: dict, case: str, label: str) -> None:
    """Every rank's verdict on case must be None (passed); a verdict
    "SKIP: why" on every failing rank skips the case with that reason."""
    bad, skips = [], []
    for r in sorted(res):
        v = res[r]["verdicts"]
        if case not in v:
            bad.append(f"rank {r}: case did not run")
        elif v[case] is not None:
            (skips if v[case].startswith("SKIP:") else bad).append(f"rank {r}: {v[case]}")
    took = max(res[r]["times"].get(case, 0.0) for r in res)
    assert not bad, f"{label}, {case} ({took:.2f} s):\n" + "\n".join(bad)
    if skips:
        pytest.skip(skips[0].split("SKIP:", 1)[1].strip())


_JOBS: dict[int, tuple[bool, object]] = {}


@pytest.mark.parametrize("ws,case", [pytest.param(ws, name, id=f"ws{ws}-{name}")
                                     for ws in WORLD_SIZES for name, _, _ in _plan(ws)])
def test_case(ws, case):
    res = cached_job(_JOBS, ws, lambda: _launch(_suite, ws))
    check_verdicts(res, case, f"world size {ws}")


# The same suite with every connection over RDMA, through the verbs emulator
# (tests/ibv_emu): world sizes 2 and 3 (the ring then has a middle rank).
RDMA_WORLD_SIZES = (2, 3)
_RDMA_JOBS: dict[int, tuple[bool, object]] = {}


def _suite_over_rdma(rank, ws, port):
    import _ibv_emu

    os.environ.update(_ibv_emu.env())
    return _suite(rank, ws, port)


@pytest.mark.parametrize("ws,case", [pytest.param(ws, name, id=f"rdma-ws{ws}-{name}")
                                     for ws in RDMA_WORLD_SIZES for name, _, _ in _plan(ws)])
def test_case_over_rdma(ws, case):
    res = cached_job(_RDMA_JOBS, ws, lambda: _launch(_suite_over_rdma, ws))
    check_verdicts(res, case, f"world size {ws} over rdma")


def test_killed_peer_makes_survivors_raise():
    """Rank 2 of 3 exits (os._exit) right before an allgather; the survivors'
    allgather (direct and ring) and recv from it raise UcclError or
    UcclTimeoutError within about timeout_s=5."""
    res = _launch(_killed_peer, 3, timeout=60, expect_exit={2}, victim=2)
    assert set(res) == {0, 1}, f"results from ranks {sorted(res)}"
    for r in (0, 1):
        for op, out in res[r].items():
            assert out is not None, f"rank {r}: {op} returned normally with its peer dead"
            assert out["ok_type"], f"rank {r}: {op} raised {out['type']}: {out['msg']}"
            # names a rank: the dead one, or (ring) a survivor that gave up first
            assert "rank" in out["msg"], f"rank {r}: {op}: message names no rank: {out['msg']}"
            assert out["elapsed"] < KILL_TIMEOUT_S + 5, \
                f"rank {r}: {op} took {out['elapsed']:.1f} s (timeout_s={KILL_TIMEOUT_S})"
