"""The "upstream" GPU scenario of tests/test_gpu.py (run by _gpu_worker): the
names a UCCL user switching from upstream calls, on GPU memory between two
processes of one host: the IPC calls without an mr_id (send_ipc(conn, ptr,
size), advertise_ipc / write_ipc / read_ipc(conn, ptr, size, info), the
vectored and _async forms), the vectored async calls with one id
(sendv_async / recvv_async), a recv posting more than comes (its size is a
capacity), HEAD's advertise(mr_id, ptr, size) without a connection, and
register_memory / get_serialized_descs /
deserialize_descs / transfer, including a descriptor of a range inside a
registration whose keys it shares.  Rank 0 sends, writes and reads; rank 1
receives and is the target.  Every byte is checked, guards included
(Bufs), and every size runs in fresh buffers."""
from __future__ import annotations

from _gpu_worker import (DST_GAP, MiB, SRC_GAP, Bufs, Rank, Runner, _ok, _posted, finish,
                         fmt, make_endpoint, pair_connect)

UPSTREAM_OPS = ("recv:capacity", "write:connless", "send_ipc", "send_ipc_async", "write_ipc", "write_ipc_async", "read_ipc",
                "read_ipc_async", "writev_ipc", "readv_ipc", "writev_ipc_async",
                "readv_ipc_async", "sendv_async", "transfer:write", "transfer:read",
                "transfer:write:inside")
UPSTREAM_CELLS = [("gpu", "gpu"), ("gpu", "pageable"), ("pinned", "gpu")]
UPSTREAM_SIZES = [1, 4097, 16 * MiB + 3]


def upstream_plan():
    return [(f"{op}:{s}->{d}", op, s, d) for op in UPSTREAM_OPS for s, d in UPSTREAM_CELLS]


def _lens(op: str, n: int) -> list[int]:
    """Vectored forms cut the message into 3 iovs (odd lengths and offsets)."""
    if op.startswith(("writev", "readv", "sendv")):
        return [n // 3, n // 3, n - 2 * (n // 3)]
    return [n]


def _drop_auto(ep) -> None:
    """The IPC forms register each buffer on first use and keep it: drop
    those registrations, as the buffers of this size go away."""
    for _n, mr in list(ep.__dict__.get("_ipc_regs", {}).values()):
        ep.dereg(mr)


def _two_sided(R, ep, conn, op, key, bufs, lens) -> None:
    sender = R.rank == 0
    ptrs = bufs.ptrs()
    if op == "send_ipc":
        _ok((ep.send_ipc if sender else ep.recv_ipc)(conn, ptrs[0], lens[0]), op)
    elif op == "send_ipc_async":
        fn = ep.send_ipc_async if sender else ep.recv_ipc_async
        finish(ep, [_posted(fn(conn, ptrs[0], lens[0]), op)])
    elif op == "recv:capacity":   # a recv's size is a capacity: post more than comes
        mrs = bufs.reg(ep)
        if sender:
            _ok(ep.send(conn, mrs[0], ptrs[0], lens[0]), op)
        else:
            tid = _posted(ep.recv_async(conn, mrs[0], ptrs[0], lens[0] + DST_GAP // 2), op)
            assert ep.wait(tid) is True
            got = ep.received_bytes(tid)
            ep.release(tid)
            assert got == lens[0], f"received_bytes {got}, sent {lens[0]}"
    else:  # sendv_async / recvv_async: one id for every iov
        mrs = bufs.reg(ep)
        fn = ep.sendv_async if sender else ep.recvv_async
        finish(ep, [_posted(fn(conn, mrs, ptrs, lens, len(lens)), op)])


def _one_sided(R, ep, conn, op, key, bufs, lens) -> None:
    """Rank 1 advertises (or registers) its buffers, rank 0 writes or reads."""
    ptrs = bufs.ptrs()
    vec = op.startswith(("writev", "readv"))
    if op.startswith("transfer"):
        if R.rank == 1:
            views = bufs.views()
            if op.endswith(":inside"):   # the whole tensor first: the range shares its keys
                whole = ep.register_memory([bufs.t[0]])
                descs = ep.register_memory(views)
                assert all(d.rkeys == whole[0].rkeys for d in descs), "keys not shared"
                ep.deregister_memory(whole)   # the range's keys outlive it
            else:
                descs = ep.register_memory(views)
            R.put(f"{key}/descs", ep.get_serialized_descs(descs))
            R.get(f"{key}/done")
            ep.deregister_memory(descs)
            return
        remote = ep.deserialize_descs(R.get(f"{key}/descs"))
        local = ep.register_memory(bufs.views())
        ok, tid = ep.transfer(conn, "read" if ":read" in op else "write", local, remote)
        _ok(ok, op)
        finish(ep, [tid])
        R.sync()
        R.put(f"{key}/done", True)
        ep.deregister_memory(local)
        return
    if op == "write:connless":   # HEAD's advertise(mr_id, ptr, size): no connection
        mrs = bufs.reg(ep)
        if R.rank == 1:
            ok, fifo = ep.advertise(mrs[0], ptrs[0], lens[0])
            _ok(ok, "advertise(mr_id, ptr, size)")
            R.put(f"{key}/info", bytes(fifo))
            R.get(f"{key}/done")
            return
        _ok(ep.write(conn, mrs[0], ptrs[0], lens[0], R.get(f"{key}/info")), op)
        R.sync()
        R.put(f"{key}/done", True)
        return
    if R.rank == 1:
        if vec:
            ok, infos = ep.advertisev_ipc(conn, ptrs, lens)
            _ok(ok, "advertisev_ipc")
        else:
            ok, info = ep.advertise_ipc(conn, ptrs[0], lens[0])
            _ok(ok, "advertise_ipc")
            infos = [info]
        R.put(f"{key}/info", [bytes(i) for i in infos])
        R.get(f"{key}/done")
        return
    infos = R.get(f"{key}/info")
    fn = getattr(ep, op)
    if vec:
        ret = fn(conn, ptrs, lens, infos)
    else:
        ret = fn(conn, ptrs[0], lens[0], infos[0])
    if op.endswith("_async"):
        finish(ep, [_posted(ret, op)])
    else:
        _ok(ret, op)
    R.sync()
    R.put(f"{key}/done", True)


def _case(R, ep, conn, i, case) -> list[str]:
    name, op, skind, dkind = case
    reads = ":read" in op or op.startswith("read")
    problems = []
    for si, n in enumerate(UPSTREAM_SIZES):
        lens = _lens(op, n)
        seed = R.seed + i * 1000 + si * 10
        seeds = [seed + j for j in range(len(lens))]
        # the data flows from the source kind to the destination kind
        src_rank = 1 if reads else 0
        mine_is_src = R.rank == src_rank
        bufs = Bufs(R, skind if mine_is_src else dkind, lens, SRC_GAP if mine_is_src else DST_GAP)
        if mine_is_src:
            bufs.fill(seeds)
        key = f"{name}/{n}"
        if op in ("send_ipc", "send_ipc_async", "sendv_async", "recv:capacity"):
            _two_sided(R, ep, conn, op, key, bufs, lens)
        else:
            _one_sided(R, ep, conn, op, key, bufs, lens)
        R.barrier(f"{key}/checked-before")
        what = "source changed" if mine_is_src else "received"
        problems += [f"{fmt(n)} (seed {seed}): {p}" for p in bufs.check(seeds, what)]
        bufs.dereg(ep)
        _drop_auto(ep)
        R.barrier(f"{key}/after")
    return problems


def scenario_upstream(R: Rank, names: list[str]) -> dict:
    run = Runner(R, names)
    ep = make_endpoint(R)
    conn = pair_connect(R, ep)

    def setup():
        probs = []
        bdf = ep.gpu_bdf
        if R.cuda and not bdf:
            probs.append("gpu_bdf is empty on a GPU endpoint")
        return probs

    run.run("setup", setup)
    for i, case in enumerate(upstream_plan()):
        run.run(case[0], _case, R, ep, conn, i, case)
    run.end()
    ep.close()
    return run.result()
