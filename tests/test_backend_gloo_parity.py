"""What torch's distributed suite found missing against Gloo, each checked
against a Gloo group in the same job: receive from any source (mixed with
named receives and collectives, nothing lost or taken out of order),
all_reduce of sparse COO tensors (and DDP's sparse embedding gradients),
profiler events ("uccl:all_reduce"... as Gloo's "gloo:all_reduce"), and
the group's monitored_barrier (the late rank named, a zero timeout failing
at once, wait_all_ranks).  One job of 3
ranks; every wait is bounded by the harness."""
from __future__ import annotations

import datetime

import pytest

from test_collective import _launch, _raises

PLAN = ["any-source", "any-source-order", "any-source-size-mismatch", "sparse", "sparse-errors",
        "ddp-sparse-embedding", "profiler", "monitored-barrier-late", "monitored-barrier-zero",
        "monitored-barrier-all-ranks"]


def _run(rank, ws, port):
    import time
    import traceback

    import torch
    import torch.distributed as dist

    import uccl_collective  # noqa: F401

    torch.set_num_threads(1)
    tmo = datetime.timedelta(seconds=30)
    dist.init_process_group("uccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ws, timeout=tmo)
    gloo = dist.new_group(backend="gloo", timeout=tmo)
    out = {}

    def case(name, fn):
        try:
            fn()
            out[name] = None
        except BaseException as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        dist.barrier(group=gloo)   # the next case starts together

    def payload(src, k, n):
        g = torch.Generator().manual_seed(1000 * src + k)
        return torch.randn(n, generator=g)

    def any_source():
        # Rank 0 takes 2 messages from each other rank through recv(any),
        # irecv(any) and directed receives; then a collective, then named
        # receives: the lookaheads left posted must not take the
        # collective's bytes nor lose a message.
        if rank == 0:
            got = []
            for k in range(ws - 1):
                t = torch.full((64,), -7.0)
                src = dist.recv(t)
                got.append((src, t.clone()))
                t2 = torch.full((64,), -7.0)
                w = dist.irecv(t2)
                w.wait()
                got.append((w._source_rank(), t2.clone()))
            per = {}
            for src, t in got:
                per.setdefault(src, []).append(t)
            assert sorted(per) == list(range(1, ws)), f"senders {sorted(per)}"
            for src, ts in per.items():
                assert len(ts) == 2, f"rank {src}: {len(ts)} messages"
                for k, t in enumerate(ts):   # each rank's messages in its order
                    assert torch.equal(t, payload(src, k, 64)), f"rank {src} message {k}"
        else:
            dist.send(payload(rank, 0, 64), 0)
            w = dist.isend(payload(rank, 1, 64), 0)
            w.wait()
            _raises(lambda: w._source_rank(), ValueError, "not a receive from any source")
        x = payload(rank, 9, 1000)
        ref = x.clone()
        dist.all_reduce(x)
        dist.all_reduce(ref, group=gloo)
        assert torch.allclose(x, ref, rtol=1e-6, atol=1e-6), "all_reduce after any-source recv"
        if rank == 0:
            for src in range(1, ws):
                t = torch.full((32,), -7.0)
                dist.recv(t, src)
                assert torch.equal(t, payload(src, 5, 32)), f"named recv from {src}"
        else:
            dist.send(payload(rank, 5, 32), 0)

    def any_source_order():
        # An irecv(any) posted before a named recv has the first pick; both
        # complete and every message lands once.
        if rank == 0:
            a = torch.full((16,), -7.0)
            wa = dist.irecv(a)
            b = torch.full((16,), -7.0)
            dist.recv(b, 1)
            wa.wait()
            src = wa._source_rank()
            msgs = {(1, 0): payload(1, 0, 16), (1, 1): payload(1, 1, 16)}
            if ws > 2:
                msgs[(2, 0)] = payload(2, 0, 16)
            if src == 1:
                assert torch.equal(a, msgs[(1, 0)]) and torch.equal(b, msgs[(1, 1)])
            else:
                assert src == 2 and torch.equal(a, msgs[(2, 0)])
                assert torch.equal(b, msgs[(1, 0)])
                c = torch.empty(16)
                dist.recv(c, 1)
                assert torch.equal(c, msgs[(1, 1)])
                return
            if ws > 2:
                c = torch.empty(16)
                assert dist.recv(c) == 2 and torch.equal(c, msgs[(2, 0)])
        elif rank == 1:
            dist.send(payload(1, 0, 16), 0)
            dist.send(payload(1, 1, 16), 0)
        elif rank == 2:
            dist.send(payload(2, 0, 16), 0)

    def size_mismatch():
        # its own group: a mismatch leaves that group's connection unusable
        g = dist.new_group(backend="uccl", timeout=datetime.timedelta(seconds=10))
        if rank == 0:
            t = torch.empty(8)
            _raises(lambda: dist.recv(t, 1, group=g), Exception, "40", "32")
        elif rank == 1:   # the sender is told too (Gloo's is)
            _raises(lambda: dist.send(torch.ones(10), 0, group=g), Exception, "40", "32")
        dist.destroy_process_group(g)

    def sparse_input(seed):
        g = torch.Generator().manual_seed(seed)
        nnz = int(torch.randint(0, 12, (1,), generator=g))
        idx = torch.stack([torch.randint(0, 7, (nnz,), generator=g),    # duplicates
                           torch.randint(0, 5, (nnz,), generator=g)])   # on purpose
        val = torch.randn(nnz, 3, generator=g)
        return torch.sparse_coo_tensor(idx, val, (7, 5, 3), check_invariants=True)

    def sparse():
        for trial in range(4):
            mine = sparse_input(97 * trial + rank)
            ours, ref = mine.clone(), mine.clone()
            dist.all_reduce(ours)
            dist.all_reduce(ref, group=gloo)
            ours, ref = ours.coalesce(), ref.coalesce()
            assert torch.equal(ours.indices(), ref.indices()), f"trial {trial}: indices"
            assert torch.allclose(ours.values(), ref.values(), rtol=1e-6, atol=1e-6)
            dense = sum(sparse_input(97 * trial + r).to_dense() for r in range(ws))
            assert torch.allclose(ours.to_dense(), dense, rtol=1e-5, atol=1e-5)
            w = dist.all_reduce(mine, async_op=True)
            w.wait()
            assert w.get_future().value()[0].layout == torch.sparse_coo

    def sparse_errors():
        s = sparse_input(rank)
        _raises(lambda: dist.all_reduce(s, op=dist.ReduceOp.MAX), ValueError, "MAX", "SUM")
        shape = (7, 5, 3) if rank else (7, 6, 3)
        bad = torch.sparse_coo_tensor(torch.zeros(2, 1, dtype=torch.long), torch.ones(1, 3),
                                      shape)
        _raises(lambda: dist.all_reduce(bad), ValueError, "shape", "(7, 6, 3)", "(7, 5, 3)")
        x = torch.ones(3)   # the group is still in step
        dist.all_reduce(x)
        assert x.tolist() == [float(ws)] * 3

    def ddp_sparse():
        # DDP all-reduces an Embedding(sparse=True)'s sparse gradient: the
        # same training step through uccl and through Gloo
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(5)
        base = torch.nn.Sequential(torch.nn.Embedding(50, 6, sparse=True), torch.nn.Linear(6, 2))
        models = {}
        for name, grp in (("uccl", None), ("gloo", gloo)):
            m = torch.nn.Sequential(torch.nn.Embedding(50, 6, sparse=True), torch.nn.Linear(6, 2))
            m.load_state_dict(base.state_dict())
            models[name] = DDP(m, process_group=grp)
        g = torch.Generator().manual_seed(40 + rank)
        idx = torch.randint(0, 50, (8, 3), generator=g)
        for name, m in models.items():
            m(idx).sum().backward()
        gu = models["uccl"].module[0].weight.grad
        gg = models["gloo"].module[0].weight.grad
        assert gu.layout == torch.sparse_coo, gu.layout
        assert torch.allclose(gu.to_dense(), gg.to_dense(), rtol=1e-6, atol=1e-6), "sparse grad"
        lu, lg = models["uccl"].module[1].weight.grad, models["gloo"].module[1].weight.grad
        assert torch.allclose(lu, lg, rtol=1e-6, atol=1e-6), "dense grad"

    def profiler():
        from torch.autograd.profiler import profile
        for grp, name in ((None, "uccl"), (gloo, "gloo")):
            x = torch.randn(5, 4)
            with profile(record_shapes=True) as prof:
                dist.all_reduce(x, group=grp)
                dist.all_reduce(x, group=grp, async_op=True).wait()
                dist.broadcast(x, 0, group=grp)
                if rank == 0:
                    dist.send(torch.ones(6), 1, group=grp)
                elif rank == 1:
                    dist.recv(torch.empty(6), 0, group=grp)
            ev = {}
            for e in prof.function_events:
                if e.name.startswith(name + ":"):
                    ev.setdefault(e.name, []).append(e)
            want = {f"{name}:all_reduce": 2, f"{name}:broadcast": 1}
            if rank == 0:
                want[f"{name}:send"] = 1
            elif rank == 1:
                want[f"{name}:recv"] = 1
            got = {k: len(v) for k, v in ev.items() if k in want}
            assert got == want, f"{name}: events {sorted((k, len(v)) for k, v in ev.items())}"
            for e in ev[f"{name}:all_reduce"]:
                assert e.is_async and e.input_shapes == [[5, 4]], (e.is_async, e.input_shapes)
        with profile() as prof:   # nothing profiled: nothing recorded
            pass
        x = torch.ones(2)
        dist.all_reduce(x)
        assert not [e for e in prof.function_events if e.name.startswith("uccl:")]

    def late_barrier(late, secs, wait_all, sleep_s=1.5):
        g = dist.new_group(backend="uccl", timeout=tmo)
        dist.barrier(group=gloo)   # the on-time ranks meet it within secs of each other
        err = None
        if rank in late:
            time.sleep(sleep_s)
        t0 = time.monotonic()
        try:
            g.monitored_barrier(datetime.timedelta(seconds=secs), wait_all_ranks=wait_all)
        except RuntimeError as e:
            err = e
        took = time.monotonic() - t0
        dist.barrier(group=gloo)
        dist.destroy_process_group(g)
        return err, took

    def mb_late():
        g = dist.new_group(backend="uccl", timeout=tmo)
        g.monitored_barrier(datetime.timedelta(seconds=5))   # everyone on time: passes
        g.monitored_barrier()                                  # the group's timeout
        dist.destroy_process_group(g)
        err, took = late_barrier({ws - 1}, 0.5, False)
        if rank == 0:
            assert err is not None and f"Rank {ws - 1} failed to pass monitoredBarrier in " \
                "500 ms" in str(err), f"rank 0 got {err!r}"
            assert took < 1.4, f"rank 0 raised after {took:.2f} s (timeout 0.5 s)"

    def mb_zero():
        err, took = late_barrier({1}, 0, False, sleep_s=1.0)
        if rank == 0:
            assert err is not None and "Rank 0 timed out in monitoredBarrier after 0 ms" in \
                str(err), f"rank 0 got {err!r}"
            assert took < 0.5, f"a zero timeout took {took:.2f} s"

    def mb_all():
        if ws < 3:
            return
        err, took = late_barrier({1, 2}, 0.5, True)
        if rank == 0:
            assert err is not None and "Ranks 1, 2 failed to pass monitoredBarrier in 500 ms" \
                in str(err), f"rank 0 got {err!r}"

    for name, fn in zip(PLAN, [any_source, any_source_order, size_mismatch, sparse,
                               sparse_errors, ddp_sparse, profiler, mb_late, mb_zero, mb_all]):
        case(name, fn)
    dist.destroy_process_group()
    return out


_RESULT: dict = {}


@pytest.mark.parametrize("name", PLAN)
def test_gloo_parity(name):
    if not _RESULT:
        _RESULT.update(_launch(_run, 3, timeout=240))
    bad = [f"rank {r}: {v[name]}" for r, v in sorted(_RESULT.items()) if v[name] is not None]
    assert not bad, "\n".join(bad)
