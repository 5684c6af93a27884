"""Mismatched collective calls raise on every rank (issue 35, failure 7).

Jobs of real spawned ranks on loopback (world sizes 2 and 3; the launcher
comes from test_collective.py).  In each case every rank makes a call that
disagrees with another rank's (the root, the size, the dtype, the reduce
op, the operation itself, the split sizes, the number of calls made), on a
fresh "uccl" group whose timeout is GROUP_TIMEOUT_S, with its outputs
poisoned (every byte 0xA5) and its in-place tensors' bytes noted.  Every
rank must raise UcclMismatchError within BOUND_S (far below the group's
timeout: the calls are compared before anything moves), naming the
operation, the ranks and their values, with every output byte unchanged;
then the same group must still work: a matching call of the same kind
gives Gloo's result bitwise (the group's order survived the mismatch).

Also: CollectiveContext.allgather and allgatherv whose sizes disagree (every
rank raises, naming the ranks and sizes), and send/recv of different sizes
(both sides raise naming both sizes; the next message is received intact).

On the tree before the fix, these fail: broadcast with ranks naming
different roots returned on rank 2 with rank 0's data while ranks 0 and 1
raised at the timeout with transport messages; a size mismatch named "p2p"
and connection numbers; an all_reduce against a broadcast of the same size
returned wrong data on both.
"""
from __future__ import annotations

import datetime
import time

import pytest

from test_collective import _launch, cached_job, check_verdicts

GROUP_TIMEOUT_S = 10     # each case's fresh group: a hang shows as >= this
BOUND_S = 2.0            # a mismatch must raise within this
JOB_TIMEOUT = 600.0      # one job, parent side (the tree before the fix waits out timeouts)
POISON = 0xA5
WORLD_SIZES = (2, 3)


# ----------------------------------------------------------------------------
# helpers (run in the ranks)
def _bytes(t):
    import torch
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _poisoned(n, dtype):
    import torch
    esz = torch.empty(0, dtype=dtype).element_size()
    return torch.full((n * esz,), POISON, dtype=torch.uint8).view(dtype)


def _data(n, dtype, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g) + 0.5).to(dtype)
    return torch.randint(1, 100, (n,), generator=g).to(dtype)


def _mismatch(call, needles, kept):
    """call() must raise UcclMismatchError naming every needle within BOUND_S,
    and leave every tensor of kept byte for byte as it was."""
    import uccl_collective
    mm = getattr(uccl_collective, "UcclMismatchError", ValueError)
    before = [_bytes(t) for t in kept]
    t0 = time.monotonic()
    try:
        call()
    except mm as e:
        err = e
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"expected UcclMismatchError after {time.monotonic() - t0:.2f} s, "
                             f"got {type(e).__name__}: {e}") from e
    else:
        raise AssertionError(f"returned normally after {time.monotonic() - t0:.2f} s")
    took = time.monotonic() - t0
    assert took < BOUND_S, f"raised after {took:.2f} s (bound {BOUND_S} s): {err}"
    for nd in needles:
        assert nd in str(err), f"{nd!r} not in the message: {err}"
    for i, (t, b) in enumerate(zip(kept, before)):
        import torch
        assert torch.equal(_bytes(t), b), f"tensor {i} was written although the call raised"
    return err


def _like_gloo(fn, g, gloo):
    """fn(group) -> tensors (a matching call) on the uccl group g and on Gloo:
    bitwise equal."""
    import torch
    ours, theirs = fn(g), fn(gloo)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(_bytes(a), _bytes(b)), \
            f"after the mismatch, a matching call differs from Gloo (tensor {i})"


def _ranks_say(vals):
    """'ranks 0, 2 say 0, rank 1 says 1' for vals[r] per rank."""
    order = {}
    for r, v in enumerate(vals):
        order.setdefault(v, []).append(r)
    return ", ".join(f"{'ranks' if len(rs) > 1 else 'rank'} {', '.join(map(str, rs))} "
                     f"{'say' if len(rs) > 1 else 'says'} {v}" for v, rs in order.items())


# ----------------------------------------------------------------------------
# the cases: case(rank, ws, g, gloo) raises AssertionError on a failure
def _case_broadcast_src(rank, ws, g, gloo):
    import torch
    import torch.distributed as dist
    srcs = [0, 1, 0][:ws]
    t = _data(5, torch.float32, rank)
    _mismatch(lambda: dist.broadcast(t, src=srcs[rank], group=g),
              ["broadcast", "on src", _ranks_say(srcs)], [t])

    def again(grp):
        x = _data(5, torch.float32, 10 + rank)
        dist.broadcast(x, src=1, group=grp)
        return [x]
    _like_gloo(again, g, gloo)


def _ar_again(rank, n=7, dtype=None):
    import torch
    import torch.distributed as dist

    def fn(grp):
        x = _data(n, dtype or torch.int64, 20 + rank)
        dist.all_reduce(x, group=grp)
        return [x]
    return fn


def _case_all_reduce_size(rank, ws, g, gloo):
    import torch
    import torch.distributed as dist
    sizes = [4 + r for r in range(ws)]
    t = _data(sizes[rank], torch.float32, rank)
    _mismatch(lambda: dist.all_reduce(t, group=g),
              ["all_reduce", "on the size", _ranks_say(sizes)], [t])
    _like_gloo(_ar_again(rank), g, gloo)


def _case_all_reduce_size_large(rank, ws, g, gloo):
    # above 64 KiB: the reduce-scatter's path (the header goes alone first)
    import torch
    import torch.distributed as dist
    sizes = [70001 + r for r in range(ws)]
    t = _data(sizes[rank], torch.float32, rank)
    _mismatch(lambda: dist.all_reduce(t, group=g),
              ["all_reduce", "on the size", _ranks_say(sizes)], [t])
    _like_gloo(_ar_again(rank, 70001), g, gloo)


def _case_all_reduce_small_vs_large(rank, ws, g, gloo):
    # the slots differ in size (data behind the header against a header
    # alone): the engine's allgather fails everywhere, then the headers tell
    import torch
    import torch.distributed as dist
    sizes = [70001 if r == 0 else 3 for r in range(ws)]
    t = _data(sizes[rank], torch.float32, rank)
    _mismatch(lambda: dist.all_reduce(t, group=g),
              ["all_reduce", "on the size", _ranks_say(sizes)], [t])
    _like_gloo(_ar_again(rank), g, gloo)


def _case_all_reduce_op(rank, ws, g, gloo):
    import torch
    import torch.distributed as dist
    ops = ["MAX" if r == 1 else "SUM" for r in range(ws)]
    t = _data(6, torch.int32, rank)
    _mismatch(lambda: dist.all_reduce(t, op=getattr(dist.ReduceOp, ops[rank]), group=g),
              ["all_reduce", "on the reduce op", _ranks_say(ops)], [t])
    _like_gloo(_ar_again(rank), g, gloo)


def _case_all_reduce_dtype(rank, ws, g, gloo):
    # the same bytes, another dtype: the engine alone could not tell
    import torch
    import torch.distributed as dist
    dts = [torch.int32 if r == ws - 1 else torch.float32 for r in range(ws)]
    t = _data(6, dts[rank], rank)
    _mismatch(lambda: dist.all_reduce(t, group=g),
              ["all_reduce", "on the dtype", _ranks_say([str(d) for d in dts])], [t])
    _like_gloo(_ar_again(rank), g, gloo)


def _case_all_reduce_vs_broadcast(rank, ws, g, gloo):
    # two operations of the same size: before, both "succeeded" with wrong data
    import torch
    import torch.distributed as dist
    t = _data(4, torch.float32, rank)
    if rank == 0:
        call, mine = (lambda: dist.broadcast(t, src=0, group=g)), "broadcast"
    else:
        call, mine = (lambda: dist.all_reduce(t, group=g)), "all_reduce"
    calls = ["broadcast" if r == 0 else "all_reduce" for r in range(ws)]
    order = _ranks_say(calls).replace(" say ", " call ").replace(" says ", " calls ")
    _mismatch(call, [f"{mine}: ", "on the operation", order], [t])
    _like_gloo(_ar_again(rank), g, gloo)


def _case_reduce_dst(rank, ws, g, gloo):
    import torch
    import torch.distributed as dist
    dsts = [1 if r == 1 else 0 for r in range(ws)]
    t = _data(3, torch.int64, rank)
    _mismatch(lambda: dist.reduce(t, dst=dsts[rank], group=g),
              ["reduce", "on dst", _ranks_say(dsts)], [t])

    def again(grp):   # (only the root's tensor is defined afterwards)
        x = _data(3, torch.int64, 30 + rank)
        dist.reduce(x, dst=ws - 1, group=grp)
        return [x] if rank == ws - 1 else []
    _like_gloo(again, g, gloo)


def _case_all_gather_into_tensor_size(rank, ws, g, gloo):
    import torch
    import torch.distributed as dist
    sizes = [3 if r == 1 else 2 for r in range(ws)]
    inp = _data(sizes[rank], torch.float32, rank)
    out = _poisoned(ws * sizes[rank], torch.float32)
    _mismatch(lambda: dist.all_gather_into_tensor(out, inp, group=g),
              ["all_gather_into_tensor", "on the size (input elements)", _ranks_say(sizes)],
              [out, inp])

    def again(grp):
        x, o = _data(5, torch.float32, 40 + rank), _poisoned(5 * ws, torch.float32)
        dist.all_gather_into_tensor(o, x, group=grp)
        return [o]
    _like_gloo(again, g, gloo)


def _case_all_gather_into_tensor_large(rank, ws, g, gloo):
    # above the slots' size: the header goes alone, then the data
    import torch
    import torch.distributed as dist
    sizes = [50000 + r for r in range(ws)]
    inp = _data(sizes[rank], torch.float32, rank)
    out = _poisoned(ws * sizes[rank], torch.float32)
    _mismatch(lambda: dist.all_gather_into_tensor(out, inp, group=g),
              ["all_gather_into_tensor", "on the size (input elements)", _ranks_say(sizes)],
              [out])

    def again(grp):
        x, o = _data(50000, torch.float32, 40 + rank), _poisoned(50000 * ws, torch.float32)
        dist.all_gather_into_tensor(o, x, group=grp)
        return [o]
    _like_gloo(again, g, gloo)


def _case_all_gather_dtype(rank, ws, g, gloo):
    import torch
    import torch.distributed as dist
    dts = [torch.int32 if r == 0 else torch.float32 for r in range(ws)]
    inp = _data(2, dts[rank], rank)
    outs = [_poisoned(2, dts[rank]) for _ in range(ws)]
    _mismatch(lambda: dist.all_gather(outs, inp, group=g),
              ["all_gather", "on the dtype", _ranks_say([str(d) for d in dts])], outs)

    def again(grp):
        x, os_ = _data(3, torch.float32, 50 + rank), [_poisoned(3, torch.float32)
                                                       for _ in range(ws)]
        dist.all_gather(os_, x, group=grp)
        return os_
    _like_gloo(again, g, gloo)


def _case_reduce_scatter_tensor_size(rank, ws, g, gloo):
    import torch
    import torch.distributed as dist
    sizes = [2 if r == 0 else 3 for r in range(ws)]
    inp = _data(ws * sizes[rank], torch.int64, rank)
    out = _poisoned(sizes[rank], torch.int64)
    _mismatch(lambda: dist.reduce_scatter_tensor(out, inp, group=g),
              ["reduce_scatter_tensor", "on the size (output elements)", _ranks_say(sizes)],
              [out, inp])

    def again(grp):
        x, o = _data(4 * ws, torch.int64, 60 + rank), _poisoned(4, torch.int64)
        dist.reduce_scatter_tensor(o, x, group=grp)
        return [o]
    _like_gloo(again, g, gloo)


def _case_reduce_scatter_op(rank, ws, g, gloo):
    import torch
    import torch.distributed as dist
    ops = ["MIN" if r == ws - 1 else "SUM" for r in range(ws)]
    ins = [_data(2, torch.int64, rank * 10 + r) for r in range(ws)]
    out = _poisoned(2, torch.int64)
    _mismatch(lambda: dist.reduce_scatter(out, ins, op=getattr(dist.ReduceOp, ops[rank]),
                                          group=g),
              ["reduce_scatter", "on the reduce op", _ranks_say(ops)], [out] + ins)

    def again(grp):
        xs, o = [_data(2, torch.int64, 70 + rank * 10 + r) for r in range(ws)], \
            _poisoned(2, torch.int64)
        dist.reduce_scatter(o, xs, group=grp)
        return [o]
    _like_gloo(again, g, gloo)


def _case_all_to_all_single_splits(rank, ws, g, gloo):
    # rank 0 sends rank 1 two elements; rank 1 expects one from rank 0
    import torch
    import torch.distributed as dist
    ins_s = [[2] * ws for _ in range(ws)]
    outs_s = [[2] * ws for _ in range(ws)]
    outs_s[1][0], outs_s[1][1] = 1, 3   # rank 1: one from rank 0, three from itself
    ins_s[1][1], ins_s[1][0] = 3, 1     # ... and sends itself three, rank 0 one
    inp = _data(sum(ins_s[rank]), torch.float32, rank)
    out = _poisoned(sum(outs_s[rank]), torch.float32)
    _mismatch(lambda: dist.all_to_all_single(out, inp, outs_s[rank], ins_s[rank], group=g),
              ["all_to_all_single", "split sizes disagree",
               "rank 0 sends rank 1 2 elements, rank 1 expects 1 from rank 0",
               "rank 1 sends rank 0 1 elements, rank 0 expects 2 from rank 1"], [out, inp])

    def again(grp):
        x, o = _data(2 * ws, torch.float32, 80 + rank), _poisoned(2 * ws, torch.float32)
        dist.all_to_all_single(o, x, group=grp)
        return [o]
    _like_gloo(again, g, gloo)


def _case_all_to_all_sizes(rank, ws, g, gloo):
    import torch
    import torch.distributed as dist
    n_in = [[2] * ws for _ in range(ws)]
    n_out = [[2] * ws for _ in range(ws)]
    n_in[ws - 1][0] = 5                  # the last rank sends rank 0 five, rank 0 expects two
    ins = [_data(k, torch.int64, rank * 7 + j) for j, k in enumerate(n_in[rank])]
    outs = [_poisoned(k, torch.int64) for k in n_out[rank]]
    _mismatch(lambda: dist.all_to_all(outs, ins, group=g),
              ["all_to_all", f"rank {ws - 1} sends rank 0 5 elements, rank 0 expects 2 from "
               f"rank {ws - 1}"], outs + ins)

    def again(grp):
        xs = [_data(2, torch.int64, 90 + rank * 7 + j) for j in range(ws)]
        os_ = [_poisoned(2, torch.int64) for _ in range(ws)]
        dist.all_to_all(os_, xs, group=grp)
        return os_
    _like_gloo(again, g, gloo)


def _case_gather_dst(rank, ws, g, gloo):
    import torch
    import torch.distributed as dist
    dsts = [1 if r == 1 else 0 for r in range(ws)]
    inp = _data(3, torch.float32, rank)
    outs = [_poisoned(3, torch.float32) for _ in range(ws)] if dsts[rank] == rank else None
    _mismatch(lambda: dist.gather(inp, outs, dst=dsts[rank], group=g),
              ["gather", "on dst", _ranks_say(dsts)], (outs or []) + [inp])

    def again(grp):
        x = _data(3, torch.float32, 100 + rank)
        os_ = [_poisoned(3, torch.float32) for _ in range(ws)] if rank == 0 else None
        dist.gather(x, os_, dst=0, group=grp)
        return os_ or [x]
    _like_gloo(again, g, gloo)


def _case_scatter_size(rank, ws, g, gloo):
    import torch
    import torch.distributed as dist
    sizes = [4 if r == ws - 1 else 3 for r in range(ws)]
    out = _poisoned(sizes[rank], torch.float32)
    ins = [_data(sizes[rank], torch.float32, r) for r in range(ws)] if rank == 0 else None
    _mismatch(lambda: dist.scatter(out, ins, src=0, group=g),
              ["scatter", "on the size", _ranks_say(sizes)], [out] + (ins or []))

    def again(grp):
        o = _poisoned(3, torch.float32)
        xs = [_data(3, torch.float32, 110 + r) for r in range(ws)] if rank == 1 else None
        dist.scatter(o, xs, src=1, group=grp)
        return [o]
    _like_gloo(again, g, gloo)


def _case_barrier_vs_all_reduce(rank, ws, g, gloo):
    # a rank that calls something else where the others wait in a barrier
    import torch
    import torch.distributed as dist
    t = _data(1, torch.uint8, rank)
    if rank == ws - 1:
        call = lambda: dist.all_reduce(t, group=g)   # noqa: E731
    else:
        call = lambda: dist.barrier(group=g)   # noqa: E731
    _mismatch(call, ["on the operation", "barrier", "all_reduce"], [t])
    _like_gloo(_ar_again(rank), g, gloo)


def _case_skipped_call(rank, ws, g, gloo):
    # rank 1's first call raises before anything moves (a bad argument), and
    # it carries on: its next all_reduce meets the others' first
    import torch
    import torch.distributed as dist
    if rank == 1:
        try:
            dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND, group=g)   # float: refused
        except ValueError:
            pass
    t = _data(2, torch.int64, rank)
    calls = [2 if r == 1 else 1 for r in range(ws)]
    _mismatch(lambda: dist.all_reduce(t, group=g),
              ["all_reduce", "on the call number",
               _ranks_say(calls).replace(" say ", " are at call ").replace(" says ",
                                                                             " is at call ")],
              [t])
    if rank != 1:   # the others make up the call rank 1 made: in step again
        try:
            dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND, group=g)
        except ValueError:
            pass
    _like_gloo(_ar_again(rank), g, gloo)


def _case_send_recv_size(rank, ws, g, gloo):
    # both sides name both sizes; the message after the mismatched one is intact
    import torch
    import torch.distributed as dist
    if rank == 0:
        t = _poisoned(8, torch.float32)
        _mismatch(lambda: dist.recv(t, src=1, group=g),
                  ["recv from rank 1", "sent 40 bytes", "holds 32"], [t])
        t = _poisoned(3, torch.float32)
        dist.recv(t, src=1, group=g)
        assert t.tolist() == [7.0, 7.0, 7.0], f"the next message: {t.tolist()}"
    elif rank == 1:
        _mismatch(lambda: dist.send(torch.ones(10), dst=0, group=g),
                  ["send to rank 0", "has 40 bytes", "posted 32 bytes"], [])
        dist.send(torch.full((3,), 7.0), dst=0, group=g)
    _like_gloo(_ar_again(rank), g, gloo)


def _random_call(rng, ws):
    """A call description: (operation, elements, dtype, root) (sizes on both
    sides of the header's folding thresholds)."""
    ops = ["all_reduce", "broadcast", "all_gather_into_tensor", "all_gather", "reduce",
           "reduce_scatter_tensor", "gather", "scatter", "all_to_all_single", "barrier"]
    op = ops[rng.randrange(len(ops))]
    if op == "barrier":
        return (op, 0, "float32", -1)
    n = rng.choice([1, 3, 1000, 20000, 70001])
    dt = rng.choice(["float32", "int32"])
    root = rng.randrange(ws) if op in ("broadcast", "reduce", "gather", "scatter") else -1
    return (op, n, dt, root)


def _make_call(desc, rank, ws, g):
    import torch
    import torch.distributed as dist
    op, n, dt, root = desc
    dtype = getattr(torch, dt)
    x = _data(max(n, 1), dtype, rank)[:n] if n else None
    if op == "barrier":
        return lambda: dist.barrier(group=g)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=g)
    if op == "broadcast":
        return lambda: dist.broadcast(x, src=root, group=g)
    if op == "reduce":
        return lambda: dist.reduce(x, dst=root, group=g)
    if op == "all_gather_into_tensor":
        out = _poisoned(ws * n, dtype)
        return lambda: dist.all_gather_into_tensor(out, x, group=g)
    if op == "all_gather":
        outs = [_poisoned(n, dtype) for _ in range(ws)]
        return lambda: dist.all_gather(outs, x, group=g)
    if op == "reduce_scatter_tensor":
        inp, out = _data(ws * n, dtype, rank), _poisoned(n, dtype)
        return lambda: dist.reduce_scatter_tensor(out, inp, group=g)
    if op == "gather":
        outs = [_poisoned(n, dtype) for _ in range(ws)] if rank == root else None
        return lambda: dist.gather(x, outs, dst=root, group=g)
    if op == "scatter":
        ins = [_data(n, dtype, r) for r in range(ws)] if rank == root else None
        out = _poisoned(n, dtype)
        return lambda: dist.scatter(out, ins, src=root, group=g)
    inp, out = _data(ws * n, dtype, rank), _poisoned(ws * n, dtype)
    return lambda: dist.all_to_all_single(out, inp, group=g)


def _case_random_calls(rank, ws, g, gloo):
    """Trials of random calls (the same seed on every rank, so each knows the
    others'): half the time every rank makes the same call, which must
    succeed; otherwise each picks its own, and where any differs every rank
    must raise UcclMismatchError within the bound.  The group works after
    every trial."""
    import random

    import torch
    import torch.distributed as dist
    import uccl_collective
    mm = getattr(uccl_collective, "UcclMismatchError", ValueError)
    rng = random.Random(1234)
    for trial in range(60):
        if rng.random() < 0.5:
            descs = [_random_call(rng, ws)] * ws
        else:
            descs = [_random_call(rng, ws) for _ in range(ws)]
        call = _make_call(descs[rank], rank, ws, g)
        t0 = time.monotonic()
        try:
            call()
            err = None
        except Exception as e:  # noqa: BLE001
            err = e
        took = time.monotonic() - t0
        same = len(set(descs)) == 1
        if same:
            assert err is None, f"trial {trial}: {descs[rank]} on every rank raised {err!r}"
        else:
            assert isinstance(err, mm), f"trial {trial}: calls {descs}: rank {rank} got {err!r}"
            assert took < BOUND_S, f"trial {trial}: raised after {took:.2f} s: {err}"
        x = torch.full((2,), float(rank + 1))
        dist.all_reduce(x, group=g)
        assert x.tolist() == [ws * (ws + 1) / 2] * 2, f"trial {trial}: the group after it"


PLAN = {name[len("_case_"):]: fn for name, fn in sorted(globals().items())
        if name.startswith("_case_")}


def _ctx_cases(rank, ws, store, verdicts, times):
    """CollectiveContext.allgather and allgatherv whose sizes disagree."""
    import torch

    from uccl_collective.collective import CollectiveContext

    def run(name, fn):
        ctx = CollectiveContext(use_copy_engine_for_intra=True, store=store, rank=rank,
                                world_size=ws, timeout_s=GROUP_TIMEOUT_S,
                                key_prefix=f"ctxcase/{name}/")
        ctx.init()
        t0 = time.monotonic()
        try:
            fn(ctx)
            verdicts[name] = None
        except BaseException as e:   # noqa: BLE001 - the verdict
            verdicts[name] = f"{type(e).__name__}: {e}"
        times[name] = time.monotonic() - t0
        store.add(f"ctxcase/{name}/done", 1)   # in step before the context goes
        while int(store.add(f"ctxcase/{name}/done", 0)) < ws:
            time.sleep(0.01)
        ctx.finalize()

    def allgather(ctx):
        sizes = [3 if r == 1 else 2 for r in range(ws)]
        send = _data(sizes[rank], torch.float32, rank)
        out = _poisoned(ws * sizes[rank], torch.float32)
        # the engine's words: "ranks 0, 2 send 8 bytes, rank 1 sends 12 bytes"
        byte_sizes = [4 * s for s in sizes]
        _mismatch(lambda: ctx.allgather(send, out),
                  ["allgather", "chunk sizes disagree"] +
                  [f"send{'s' if byte_sizes.count(b) == 1 else ''} {b} bytes"
                   for b in set(byte_sizes)], [send])
        # the chunks of the ranks that differ from this one were not written
        mine = sizes[rank]
        for r in range(ws):
            if sizes[r] != mine:
                part = out[r * mine:(r + 1) * mine]
                assert torch.equal(_bytes(part), _bytes(_poisoned(mine, torch.float32))), \
                    f"rank {r}'s chunk was written although its size differs"
        got = _poisoned(ws * 2, torch.float32)
        ctx.allgather(_data(2, torch.float32, 5 + rank), got)
        want = torch.cat([_data(2, torch.float32, 5 + r) for r in range(ws)])
        assert torch.equal(got, want), "the allgather after the mismatch"

    def allgatherv(ctx):
        lens = [2 + r for r in range(ws)]
        want = list(lens)
        if rank == 0:
            want[ws - 1] += 1
        send = _data(lens[rank], torch.float32, rank)
        recv = [_poisoned(k, torch.float32) for k in want]
        _mismatch(lambda: ctx.allgatherv(send, recv),
                  ["allgatherv", f"rank {ws - 1} sends {4 * lens[ws - 1]} bytes, rank 0 "
                   f"expects {4 * (lens[ws - 1] + 1)}"], recv + [send])
        recv = [_poisoned(k, torch.float32) for k in lens]
        ctx.allgatherv(send, recv)
        for r in range(ws):
            assert torch.equal(recv[r], _data(lens[r], torch.float32, r)), \
                f"the allgatherv after the mismatch: rank {r}'s chunk"

    run("ctx_allgather_size", allgather)
    run("ctx_allgatherv_sizes", allgatherv)


CTX_CASES = ("ctx_allgather_size", "ctx_allgatherv_sizes")


def _job(rank, ws, port):
    import logging
    import warnings

    import torch.distributed as dist

    import uccl_collective  # noqa: F401 (the backend)
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("uccl", store=store, rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=60))
    gloo = dist.new_group(backend="gloo")
    verdicts, times = {}, {}
    for name, case in PLAN.items():
        g = dist.new_group(backend="uccl", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        t0 = time.monotonic()
        try:
            case(rank, ws, g, gloo)
            verdicts[name] = None
        except BaseException as e:   # noqa: BLE001 - the verdict
            verdicts[name] = f"{type(e).__name__}: {e}"
        times[name] = time.monotonic() - t0
        dist.barrier(group=gloo)   # in step whatever happened (Gloo's own)
        try:
            dist.destroy_process_group(g)
        except Exception:   # noqa: BLE001
            pass
    _ctx_cases(rank, ws, store, verdicts, times)
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    return {"verdicts": verdicts, "times": times}


_JOBS: dict = {}


@pytest.mark.parametrize("ws,case", [pytest.param(ws, c, id=f"ws{ws}-{c}")
                                     for ws in WORLD_SIZES for c in list(PLAN) + list(CTX_CASES)])
def test_mismatch(ws, case):
    res = cached_job(_JOBS, ws, lambda: _launch(_job, ws, timeout=JOB_TIMEOUT))
    check_verdicts(res, case, f"world size {ws}")
