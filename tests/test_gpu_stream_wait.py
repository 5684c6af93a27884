"""Endpoint.stream_wait(): torch's current stream waits for a transfer without
blocking the host (stream order as NCCL's handles give it).  Needs a CUDA
device (two processes share it); skips with the reason elsewhere.

The receiver posts recv_async into poisoned GPU memory, calls stream_wait
while the sender is still asleep (so the call must return before the bytes
exist), queues a clone of the buffer on its stream with no synchronize, and
only then tells the sender to send.  The clone must hold the sender's
random bytes: the stream waited for the transfer, not for the call."""
from __future__ import annotations

import os
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip(f"no CUDA device (torch {torch.__version__}): stream_wait needs one",
                allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

SIZE = (16 << 20) + 3


def _data(seed: int) -> "torch.Tensor":
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=g)


def _rank(rank: int, mode: str, seed: int, q_in, q_out, result) -> None:
    try:
        if mode == "tcp":
            os.environ["UCCL_P2P_HOST_ID"] = f"stream-wait-host-{rank}"
        from uccl_collective.p2p import Endpoint
        torch.cuda.set_device(0)
        ep = Endpoint(0, port=0, timeout_s=60)
        if rank == 0:  # receiver
            q_out.put(ep.get_metadata())
            _, _, _, conn = ep.accept(30)
            y = torch.full((SIZE,), 0x5A, dtype=torch.uint8, device="cuda")
            mr = ep.reg(y.data_ptr(), y.numel())[1]
            ok, tid = ep.recv_async(conn, mr, y.data_ptr(), SIZE)
            t0 = time.monotonic()
            ep.stream_wait(tid)
            took = time.monotonic() - t0
            z = y.clone()          # queued after the wait, no synchronize
            q_out.put("send now")  # only now do the bytes start to exist
            torch.cuda.current_stream().synchronize()
            ep.wait(tid)
            ep.release(tid)
            same = torch.equal(z.cpu(), _data(seed))
            result.put(("ok", took, same))
        else:
            meta = q_in.get(timeout=30)
            ok, conn = ep.add_remote_endpoint(meta)
            x = _data(seed).cuda()
            mr = ep.reg(x.data_ptr(), x.numel())[1]
            assert q_in.get(timeout=30) == "send now"
            time.sleep(0.3)  # the receiver's stream must be waiting all along
            ep.send(conn, mr, x.data_ptr(), SIZE)
            result.put(("sent",))
        ep.close()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        result.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))


@pytest.mark.parametrize("mode", ["ipc", "tcp"])
def test_stream_wait_orders_the_stream_without_blocking(mode):
    ctx = mp.get_context("spawn")
    a, b, result = ctx.Queue(), ctx.Queue(), ctx.Queue()
    seed = int.from_bytes(os.urandom(4), "little")
    procs = [ctx.Process(target=_rank, args=(0, mode, seed, a, b, result)),
             ctx.Process(target=_rank, args=(1, mode, seed, b, a, result))]
    for p in procs:
        p.start()
    try:
        outs = [result.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [o[1] for o in outs if o[0] == "error"]
    assert not errors, f"seed {seed}: {errors}"
    recv = [o for o in outs if o[0] == "ok"][0]
    _, took, same = recv
    assert took < 0.25, f"stream_wait blocked the host for {took:.3f} s (seed {seed})"
    assert same, f"the clone queued after stream_wait did not see the sender's bytes (seed {seed})"
