"""The *_tensor helpers with CPU torch tensors and numpy arrays of several
dtypes, between two processes, plus the explicit connect()/accept() path
(connect_local/accept_local) and the upstream IPC alias names."""
from __future__ import annotations

import pytest

from _harness import GUARD, POISON, TRANSPORTS, addr, catch, rand_bytes, run_pair, sha

N_F32 = 4097          # float32 elements
N_I64 = 1 << 17       # int64 elements (1 MiB)
N_WIN = 33 * 1024     # bytes of the one-sided windows


def _torch_recv_buf(nbytes):
    """(whole poisoned uint8 tensor with guard, its first nbytes)."""
    import torch

    whole = torch.full((nbytes + GUARD,), POISON, dtype=torch.uint8)
    return whole, whole[:nbytes]


def _guard_ok(whole, nbytes):
    return bool((whole[nbytes:] == POISON).all())


def _server(ch):
    import numpy as np
    import torch

    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=30)
    ip, port = ep.address()
    ch.send("addr", (ip, port))
    ok, gpu, conn = ep.accept_local()
    assert ok is True and gpu == -1
    out = {"tp": ep.conn_transport(conn)}

    # torch float32 <- torch float32
    whole, head = _torch_recv_buf(N_F32 * 4)
    mr = ep.reg_tensor(whole)
    dst = head.view(torch.float32)
    assert ep.recv_tensor(conn, mr, dst) is True
    out["f32"], out["f32_guard"] = sha(head.numpy()), _guard_ok(whole, N_F32 * 4)

    # numpy int64 <- numpy int64 (received into a numpy array)
    buf = np.full(N_I64 * 8 + GUARD, POISON, np.uint8)
    mr = ep.reg_tensor(buf)
    assert ep.recv_tensor(conn, mr, buf[:N_I64 * 8].view(np.int64)) is True
    out["i64"], out["i64_guard"] = sha(buf[:N_I64 * 8]), bool((buf[N_I64 * 8:] == POISON).all())

    # async: a torch tensor and a numpy array in flight at once
    w1, h1 = _torch_recv_buf(4097)
    b2 = np.full(8192 + GUARD, POISON, np.uint8)
    m1, m2 = ep.reg_tensor(w1), ep.reg_tensor(b2)
    ok1, t1 = ep.recv_tensor_async(conn, m1, h1)
    ok2, t2 = ep.recv_ipc_async(conn, m2, addr(b2), 8192)  # upstream alias of recv_async
    assert ok1 and ok2
    assert ep.wait(t1, timeout=20) is True and ep.wait(t2, timeout=20) is True
    ep.release(t1)
    ep.release(t2)
    out["async"] = [sha(h1.numpy()), sha(b2[:8192])]
    out["async_guard"] = _guard_ok(w1, 4097) and bool((b2[8192:] == POISON).all())

    # after the non-contiguous attempt on the client, the connection still works
    whole, head = _torch_recv_buf(64 * 8)
    mr = ep.reg_tensor(whole)
    assert ep.recv_tensor(conn, mr, head.view(torch.float64)) is True
    out["after_bad"] = sha(head.numpy())

    # one-sided: a torch window written by the client, a numpy window it reads
    wwhole, wwin = _torch_recv_buf(N_WIN)
    wmr = ep.reg_tensor(wwhole)
    src = rand_bytes(N_WIN, 77)
    smr = ep.reg_tensor(src)
    ch.send("fifos", (ep.advertise_tensor(conn, wmr, wwin), ep.advertise_ipc(conn, smr, addr(src), N_WIN)[1]))
    ch.recv("one_sided_done")
    out["written"], out["written_guard"] = sha(wwin.numpy()), _guard_ok(wwhole, N_WIN)
    out["read_src"] = sha(src)
    return out


def _client(ch):
    import numpy as np
    import torch

    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=30)
    ip, port = ch.recv("addr")
    ok, conn = ep.connect_local(-1, port)
    assert ok is True
    out = {"tp": ep.conn_transport(conn)}

    f32 = torch.from_numpy(rand_bytes(N_F32 * 4, 11)).view(torch.float32)
    assert ep.send_tensor(conn, ep.reg_tensor(f32), f32) is True
    out["f32"] = sha(f32.view(torch.uint8).numpy())

    i64 = rand_bytes(N_I64 * 8, 12).view(np.int64)
    assert ep.send_tensor(conn, ep.reg_tensor(i64), i64) is True

    a1 = torch.from_numpy(rand_bytes(4097, 13))
    a2 = rand_bytes(8192, 14)
    ok1, t1 = ep.send_tensor_async(conn, ep.reg_tensor(a1), a1)
    ok2, t2 = ep.send_ipc_async(conn, ep.reg_tensor(a2), addr(a2), 8192)
    assert ep.wait(t1, timeout=20) is True and ep.wait(t2, timeout=20) is True

    # non-contiguous tensors and arrays are refused before anything is sent
    m = torch.from_numpy(rand_bytes(64 * 8, 15)).view(torch.float64).reshape(8, 8)
    mr = ep.reg_tensor(m)
    out["noncontig"] = [catch(ep.send_tensor, conn, mr, m.t()),
                        catch(ep.reg_tensor, m.t()),
                        catch(ep.send_tensor_async, conn, mr, m[:, ::2]),
                        catch(ep.reg_tensor, np.arange(64.0).reshape(8, 8)[:, 1])]
    assert ep.send_tensor(conn, mr, m) is True  # the connection keeps working

    wf, rf = ch.recv("fifos")
    src = torch.from_numpy(rand_bytes(N_WIN, 16))
    assert ep.write_tensor(conn, ep.reg_tensor(src), src, wf) is True
    dst = np.full(N_WIN + GUARD, POISON, np.uint8)
    dmr = ep.reg_tensor(dst)
    assert ep.read_tensor(conn, dmr, dst[:N_WIN], rf) is True
    out["read"], out["read_guard"] = sha(dst[:N_WIN]), bool((dst[N_WIN:] == POISON).all())
    ch.send("one_sided_done")
    return out


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_tensor_helpers(transport):
    """reg_tensor/send_tensor/recv_tensor (torch float32, numpy int64),
    send_tensor_async/recv_tensor_async (+ the *_ipc aliases) and
    advertise_tensor/write_tensor/read_tensor move exactly the source bytes
    between processes connected with connect_local()/accept_local(); with no
    forced transport a same-host pair uses shared memory (shm-cma).
    Non-contiguous tensors/arrays raise ValueError (and send nothing: the next
    message is received intact)."""
    env, expect_tp = TRANSPORTS["tcp"] if transport == "tcp" else ({}, "shm-cma")
    s, c = run_pair(_server, _client, env=env, timeout=90)
    assert s["tp"] == c["tp"] == expect_tp
    assert s["f32"] == c["f32"] == sha(rand_bytes(N_F32 * 4, 11))
    assert s["f32_guard"]
    assert s["i64"] == sha(rand_bytes(N_I64 * 8, 12)) and s["i64_guard"]
    assert s["async"] == [sha(rand_bytes(4097, 13)), sha(rand_bytes(8192, 14))]
    assert s["async_guard"]
    for err in c["noncontig"]:
        assert err and err["value"] and "contiguous" in err["msg"], err
    assert s["after_bad"] == sha(rand_bytes(64 * 8, 15))
    assert s["written"] == sha(rand_bytes(N_WIN, 16)) and s["written_guard"]
    assert c["read"] == s["read_src"] == sha(rand_bytes(N_WIN, 77)) and c["read_guard"]
