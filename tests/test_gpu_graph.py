"""The "uccl" backend's collectives captured in CUDA graphs (csrc/sg/sg_graph.c)
on a GPU per rank: all_reduce, all_gather_into_tensor, reduce_scatter_tensor,
broadcast and all_to_all_single captured once in torch.cuda.graph, then
REPLAYS replays with the inputs changed before each, every replay's outputs
checked against the sums computed on the CPU; a second graph captured under
the first one's memory pool (graph_pool_handle) and replayed on another
stream, the two taking turns; sends and receives captured (batch_isend_irecv
and blocking send/recv); CollectiveContext.allgather and async_op=True
collectives captured; the collectives again at each size where the
captured form changes, at 2 ranks and at 4; ranks that differ in
UCCL_SG_GRAPH_LL_BYTES; a rank SIGKILLed during replays.  Needs 2 GPUs
(4 for the 4-rank cases); skips, naming why, elsewhere.
tests/test_stream_graph.py holds the protocol to the same on the CPU."""
from __future__ import annotations

import pytest
import torch

from _harness import run_ranks

REPLAYS = 1000
WS = 2

if torch.cuda.device_count() < WS:
    pytest.skip(f"CUDA graphs with a GPU per rank need {WS} GPUs; this host has "
                f"{torch.cuda.device_count()} (torch {torch.__version__})", allow_module_level=True)


def _x(r: int, i: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * i + 104729 * r + 1)
    return torch.randint(-1000, 1000, (n,), dtype=torch.int32, generator=g).float()


def _replays(body):
    """A rank's process target: body(rank, ws, path, *args) runs its
    replays (raising at a wrong one) and returns how many; the rank reports
    that, or what it raised; a hang dumps the stacks into the report."""
    import functools

    @functools.wraps(body)
    def run(rank, ws, path, *args):
        import faulthandler
        *args, q = args
        faulthandler.dump_traceback_later(300, exit=True)
        try:
            q.put((rank, body(rank, ws, path, *args)))
        except BaseException as e:  # noqa: BLE001
            q.put((rank, f"{type(e).__name__}: {e}"))
    return run


def _every_replay_right(target, where, timeout=360, ws=WS, args=(), replays=REPLAYS):
    got = run_ranks(target, ws, (str(where), *args), timeout=timeout)
    assert got == {r: replays for r in range(ws)}, got


def _needs_gpus(ws: int) -> None:
    if torch.cuda.device_count() < ws:
        pytest.skip(f"{ws} ranks need {ws} GPUs; this host has {torch.cuda.device_count()}")


def _captured(ops, *, pool=None, warm=True) -> "torch.cuda.CUDAGraph":
    """ops() run once on a side stream (warm-up outside the capture, as
    torch asks; not where warm is False), then captured in a new graph (in
    pool's memory, if given)."""
    if warm:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ops()
        torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        ops()
    return g


@_replays
def _rank(rank, ws, path, n=4096, replays=REPLAYS):
    import torch.distributed as dist
    import uccl_collective  # noqa: F401 - registers "uccl"
    torch.cuda.set_device(rank)
    dist.init_process_group("uccl", store=dist.FileStore(path, ws), rank=rank,
                            world_size=ws)
    dev = torch.device("cuda", rank)
    ar, ag_in = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    ag_out, rs_in = torch.zeros(ws * n, device=dev), torch.zeros(ws * n, device=dev)
    rs_out, bc = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    a2a_in, a2a_out = torch.zeros(ws * n, device=dev), torch.zeros(ws * n, device=dev)

    def ops():
        dist.all_reduce(ar)
        dist.all_gather_into_tensor(ag_out, ag_in)
        dist.reduce_scatter_tensor(rs_out, rs_in)
        dist.broadcast(bc, src=1)
        dist.all_to_all_single(a2a_out, a2a_in)

    def fill(i):
        x = _x(rank, i, (3 + 2 * ws) * n).to(dev)
        ar.copy_(x[:n]); ag_in.copy_(x[n:2 * n]); rs_in.copy_(x[2 * n:(2 + ws) * n])
        bc.copy_(x[(2 + ws) * n:(3 + ws) * n] if rank == 1 else torch.full((n,), -7.0))
        a2a_in.copy_(x[(3 + ws) * n:])
        for t in (ag_out, rs_out, a2a_out):
            t.fill_(-7.0)

    def check(i):
        xs = [_x(r, i, (3 + 2 * ws) * n) for r in range(ws)]
        where = f"rank {rank} replay {i}"
        got, want = ar.cpu(), sum(x[:n] for x in xs)
        bad = (got != want).nonzero().flatten()
        assert not len(bad), (f"{where}: all_reduce: {len(bad)} of {n} elements wrong, the "
                              f"first at {bad[0].item()}: got {got[bad[:4]].tolist()}, want "
                              f"{want[bad[:4]].tolist()} (the ranks' inputs there: "
                              f"{[x[:n][bad[:4]].tolist() for x in xs]})")
        assert torch.equal(ag_out.cpu(), torch.cat([x[n:2 * n] for x in xs])), where
        rs = sum(x[2 * n:(2 + ws) * n] for x in xs)[rank * n:(rank + 1) * n]
        assert torch.equal(rs_out.cpu(), rs), f"{where}: reduce_scatter"
        assert torch.equal(bc.cpu(), xs[1][(2 + ws) * n:(3 + ws) * n]), f"{where}: broadcast"
        want = torch.cat([x[(3 + ws) * n:][rank * n:(rank + 1) * n] for x in xs])
        assert torch.equal(a2a_out.cpu(), want), f"{where}: all_to_all_single"

    fill(0)
    g1 = _captured(ops)
    g2 = _captured(ops, pool=g1.pool(), warm=False)
    other = torch.cuda.Stream()
    for i in range(replays):
        for k, g in enumerate((g1, g2)):
            seed = 2 * i + k
            fill(seed)
            torch.cuda.synchronize()
            if k:
                with torch.cuda.stream(other):
                    g.replay()
            else:
                g.replay()
            torch.cuda.synchronize()
            check(seed)
    dist.barrier()
    dist.destroy_process_group()
    return replays


def test_collectives_captured_in_graphs_replay_right_every_time(tmp_path):
    """4,096 floats a rank (16 KiB: the all_reduce and the all-gather
    as LL lines), REPLAYS replays."""
    _every_replay_right(_rank, tmp_path / "store", timeout=420)


@pytest.mark.parametrize("ws, n", [(2, 16384), (2, 20001), (2, 70001), (4, 4096), (4, 16384),
                                   (4, 20001), (4, 70001)])
def test_collectives_captured_at_each_size_and_four_ranks_replay_right(tmp_path, ws, n):
    """The same at 200 replays, at the sizes where the captured form
    changes (bytes a rank): 64 KiB, the last of the LL lines; 80,004, one
    launch with a ready word, its slices not 16-byte aligned; 280,004,
    above the one-launch rounds (two-sided); at two and four ranks."""
    _needs_gpus(ws)
    _every_replay_right(_rank, tmp_path / "store", timeout=420, ws=ws, args=(n, 200),
                        replays=200)


def _ll_apart_rank(rank, ws, path, q):
    """Rank 0 with UCCL_SG_GRAPH_LL_BYTES=0, rank 1 with the default: the
    capture of a 16 KiB all_reduce must fail naming the setting, on either
    rank, and the other rank's capture or its next call raise (no hang)."""
    import os
    import faulthandler
    faulthandler.dump_traceback_later(120, exit=True)
    if rank == 0:
        os.environ["UCCL_SG_GRAPH_LL_BYTES"] = "0"
    try:
        import torch.distributed as dist
        import uccl_collective  # noqa: F401 - registers "uccl"
        torch.cuda.set_device(rank)
        dist.init_process_group("uccl", store=dist.FileStore(path, ws), rank=rank,
                                world_size=ws, timeout=__import__("datetime").timedelta(seconds=20))
        t = torch.ones(4096, device="cuda")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        errors = []
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                dist.all_reduce(t)
        except Exception as e:  # noqa: BLE001
            errors.append(str(e))
        if not errors:
            try:
                dist.all_reduce(t)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                errors.append(str(e))
        q.put((rank, ("raised", errors[0]) if errors else "nothing raised"))
    except BaseException as e:  # noqa: BLE001
        q.put((rank, f"{type(e).__name__}: {e}"))


def test_graph_ll_setting_apart_on_two_ranks_fails_the_capture_naming_it(tmp_path):
    got = run_ranks(_ll_apart_rank, WS, (str(tmp_path / "ll"),), timeout=150)
    assert all(isinstance(v, tuple) for v in got.values()), got
    assert any("UCCL_SG_GRAPH_LL_BYTES" in v[1] for v in got.values()), got


def _killed_rank(rank, ws, path, q):
    """Rank 1 dies (SIGKILL) after good replays; rank 0 replays once more:
    the replay must end (the watchdog sees rank 1 gone and releases the
    words) and rank 0's next call raise, all within the timeout."""
    import faulthandler
    import os
    import signal
    import time
    faulthandler.dump_traceback_later(150, exit=True)   # a hang shows where, in the report
    try:
        import torch.distributed as dist
        from uccl_collective.p2p import UcclError
        import uccl_collective  # noqa: F401 - registers "uccl"
        torch.cuda.set_device(rank)
        dist.init_process_group("uccl", store=dist.FileStore(path, ws), rank=rank,
                                world_size=ws, timeout=__import__("datetime").timedelta(seconds=20))
        t = torch.zeros(1024, device="cuda")
        g = _captured(lambda: dist.all_reduce(t))
        for i in range(20):
            t.fill_(float(rank + i))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(t.cpu(), torch.full((1024,), float(2 * i + 1))), i
        dist.barrier()
        if rank == 1:
            q.put((rank, "dying"))
            q.close()
            q.join_thread()   # the message is in the pipe before the process dies
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1.0)
        t0 = time.monotonic()
        g.replay()
        torch.cuda.synchronize()   # ends once the group failed and released the words
        ended = time.monotonic() - t0
        try:
            dist.all_reduce(torch.ones(4, device="cuda"))
            torch.cuda.synchronize()
            q.put((rank, f"no error after rank 1 died (replay ended after {ended:.1f} s)"))
        except UcclError as e:
            q.put((rank, (ended, time.monotonic() - t0, str(e))))
    except BaseException as e:  # noqa: BLE001
        q.put((rank, f"{type(e).__name__}: {e}"))


def test_a_rank_killed_during_replays_ends_the_survivors_and_their_next_call_raises(tmp_path):
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_killed_rank, args=(r, WS, str(tmp_path / "kill"), q))
          for r in range(WS)]
    for p in ps:
        p.start()
    got: dict = {}
    try:
        for _ in ps:
            r, v = q.get(timeout=180)
            got[r] = v
    except Exception as e:   # noqa: BLE001 - reported with what did arrive
        got["error"] = repr(e)
    finally:
        for p in ps:
            p.join(30)
            if p.is_alive():
                p.kill()
    got["exit codes"] = [p.exitcode for p in ps]
    assert got.get(1) == "dying" and 0 in got, got
    assert isinstance(got[0], tuple), got[0]
    ended, raised, msg = got[0]
    assert raised < 40.0, f"rank 0's next call raised only after {raised:.1f} s"
    assert "rank 1" in msg, msg


@_replays
def _p2p_rank(rank, ws, path):
    """Sends and receives captured: batch_isend_irecv both ways, then a
    blocking send/recv pair (rank 0 sends first, rank 1 receives first),
    one graph, REPLAYS replays with the data changed and the receives
    poisoned before each, checked after each."""
    import torch.distributed as dist
    import uccl_collective  # noqa: F401 - registers "uccl"
    torch.cuda.set_device(rank)
    dist.init_process_group("uccl", store=dist.FileStore(path, ws), rank=rank,
                            world_size=ws)
    peer, n, dev = 1 - rank, 1000 + 24 * rank, torch.device("cuda", rank)
    a_s, a_r = torch.zeros(4096, device=dev), torch.zeros(4096, device=dev)
    b_s, b_r = torch.zeros(n, device=dev), torch.zeros(2024 - n, device=dev)

    def ops():
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, a_s, peer),
                                         dist.P2POp(dist.irecv, a_r, peer)]):
            w.wait()
        if rank == 0:
            dist.send(b_s, peer)
            dist.recv(b_r, peer)
        else:
            dist.recv(b_r, peer)
            dist.send(b_s, peer)

    def fill(i):
        a_s.copy_(_x(rank, i, 4096).to(dev))
        b_s.copy_(_x(rank, i + 77777, n).to(dev))
        a_r.fill_(-7.0)
        b_r.fill_(-7.0)

    fill(0)
    g = _captured(ops)
    for i in range(REPLAYS):
        fill(i)
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(a_r.cpu(), _x(peer, i, 4096)), f"rank {rank} replay {i}: batch"
        assert torch.equal(b_r.cpu(), _x(peer, i + 77777, 2024 - n)), \
            f"rank {rank} replay {i}: send/recv"
    dist.barrier()
    dist.destroy_process_group()
    return REPLAYS


def test_sends_and_receives_captured_replay_right_every_time(tmp_path):
    _every_replay_right(_p2p_rank, tmp_path / "p2p")


@_replays
def _ctx_rank(rank, ws, path):
    """CollectiveContext.allgather (flat output) captured, REPLAYS replays,
    the input changed and the output poisoned before each."""
    import torch.distributed as dist
    from uccl_collective.collective import CollectiveContext
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", store=dist.FileStore(path, ws), rank=rank,
                            world_size=ws)
    ctx = CollectiveContext(local_gpu_idx=rank, use_copy_engine_for_intra=True).init()
    n, dev = 3000, torch.device("cuda", rank)
    send, out = torch.zeros(n, device=dev), torch.zeros(ws * n, device=dev)
    g = _captured(lambda: ctx.allgather(send, out))
    for i in range(REPLAYS):
        send.copy_(_x(rank, i, n).to(dev))
        out.fill_(-7.0)
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        want = torch.cat([_x(r, i, n) for r in range(ws)])
        assert torch.equal(out.cpu(), want), f"rank {rank} replay {i}"
    ctx.finalize()
    dist.destroy_process_group()
    return REPLAYS


def test_collective_context_allgather_captured_replays_right_every_time(tmp_path):
    _every_replay_right(_ctx_rank, tmp_path / "ctx")


@_replays
def _async_rank(rank, ws, path):
    """async_op=True collectives captured (their rounds on the capturing
    stream, as blocking ones), wait() called inside the capture; REPLAYS
    replays with the inputs changed before each, checked after each."""
    import torch.distributed as dist
    import uccl_collective  # noqa: F401 - registers "uccl"
    torch.cuda.set_device(rank)
    dist.init_process_group("uccl", store=dist.FileStore(path, ws), rank=rank, world_size=ws)
    n, dev = 2048, torch.device("cuda", rank)
    ar, ag_in, ag_out = (torch.zeros(n, device=dev), torch.zeros(n, device=dev),
                         torch.zeros(ws * n, device=dev))

    def ops():
        works = [dist.all_reduce(ar, async_op=True),
                 dist.all_gather_into_tensor(ag_out, ag_in, async_op=True)]
        for w in works:
            w.wait()

    g = _captured(ops)
    for i in range(REPLAYS):
        ar.copy_(_x(rank, i, n).to(dev))
        ag_in.copy_(_x(rank, i + 5000, n).to(dev))
        ag_out.fill_(-7.0)
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(ar.cpu(), sum(_x(r, i, n) for r in range(ws))), f"replay {i}"
        assert torch.equal(ag_out.cpu(), torch.cat([_x(r, i + 5000, n) for r in range(ws)])), \
            f"replay {i}: all_gather"
    dist.barrier()
    dist.destroy_process_group()
    return REPLAYS


def test_async_op_collectives_captured_replay_right_every_time(tmp_path):
    _every_replay_right(_async_rank, tmp_path / "async")
