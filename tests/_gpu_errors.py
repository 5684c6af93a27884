"""The 'errors' scenario of tests/test_gpu.py (see _gpu_worker.py for how
scenarios run): memory the engine must refuse, and addresses freed and
handed out again.  GPU only.

Steps, in order (each a verdict per rank):
  reg_nonsense_ptr            reg(0xdead0000, 4096) raises, naming the pointer
  reg_past_end                reg of a cudaMalloc allocation + 4 KiB raises
  reg_span_two_allocations    reg over two adjacent cudaMalloc allocations raises
  freed_send / freed_recv     a registered region freed for real (empty_cache),
                              then send / recv through it: raises (not a timeout)
  reuse_send_after_dereg      send A, dereg, free, allocate again (same address,
                              normally), reg, send B: B arrives
  reuse_send_stale_region_kept  the same without dereg of the first region
  reuse_recv                  the receiver reallocates between two messages
  reuse_write                 the target re-advertises a reallocated window
  stale_fifo_refused          a write with the first (revoked) fifo item is
                              refused and the new window keeps B
  reuse_read                  the target re-advertises a reallocated source
  stale_region_send_refused   send through the kept stale region raises
  still_usable                the connection still carries data afterwards
"""
from __future__ import annotations

import gc

from _gpu_worker import (DST_GAP, ERR_TIMEOUT_S, POISON, SRC_GAP, Bufs, MiB, Rank, Runner, _ok,
                         allocator_problems, catch, make_endpoint, must_raise, pair_connect)


def _alloc_range(R, ptr: int):
    """(base, size) of the CUDA allocation holding ptr, None when no
    allocation holds it, or 'unknown' when the driver cannot be asked."""
    import ctypes

    try:
        cu = ctypes.CDLL("libcuda.so.1")
        fn = cu.cuMemGetAddressRange_v2
    except (OSError, AttributeError):
        return "unknown"
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    fn.restype = ctypes.c_int
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    rc = fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    return (base.value, size.value) if rc == 0 else None


def _released(R, ptr: int) -> bool | None:
    """Whether no CUDA allocation holds ptr any more (None: cannot tell)."""
    r = _alloc_range(R, ptr)
    if r != "unknown":
        return r is None
    segs = R.torch.cuda.memory_snapshot()
    return not any(s["address"] <= ptr < s["address"] + s["total_size"] for s in segs)


def _fresh_gpu(R, nbytes: int, seed: int | None = None):
    """A GPU tensor (POISON, or seed's bytes generated in place: no temporary
    that would take the address a later reallocation should get back)."""
    t = R.alloc("gpu", nbytes)
    if seed is not None:
        R.gen(seed, nbytes, out=t)
        R.sync()
    return t


def _drop(R, *tensors) -> None:
    """Free tensors for real: back to the driver (empty_cache)."""
    del tensors
    gc.collect()
    R.sync()
    R.torch.cuda.empty_cache()


def scenario_errors(R: Rank, names: list[str]) -> dict:
    run = Runner(R, names)
    expandable = R.params.get("alloc") == "expandable"
    N = 32 * MiB
    ep = make_endpoint(R, timeout_s=ERR_TIMEOUT_S)
    conn = pair_connect(R, ep)
    # The freed-memory probes run on connections of their own: an engine that
    # wrongly accepts the memory blocks there until its timeout, which fails
    # that connection only.
    probes = {k: make_endpoint(R, timeout_s=ERR_TIMEOUT_S) for k in ("freed_send", "freed_recv")}
    probe_conns = {k: pair_connect(R, e, k) for k, e in probes.items()}
    st: dict = {}    # state kept from one step to a later one

    def send_one(t, mr, seed_note=""):
        _ok(ep.send(conn, mr, t.data_ptr(), t.numel()), f"send{seed_note}")

    def recv_check(seed, what) -> list[str]:
        d = Bufs(R, "gpu", [N], DST_GAP)
        m = d.reg(ep)
        _ok(ep.recv(conn, m[0], d.ptrs()[0], N), "recv")
        probs = d.check([seed], what)
        d.dereg(ep)
        return probs

    def reg_nonsense():
        p = 0xDEAD0000
        return must_raise(catch(ep.reg, p, 4096), p, "reg(0xdead0000, 4096)")

    def reg_past_end():
        if expandable:
            return ("SKIP: with expandable segments the bytes past a tensor belong to the same "
                    "mapped segment; 'past the allocation' is not defined there")
        _drop(R)
        t = _fresh_gpu(R, N)
        p = t.data_ptr()
        rng = _alloc_range(R, p)
        if rng not in ("unknown", None) and rng != (p, N):
            return f"SKIP: the {N}-byte tensor is not a whole allocation of its own ({rng})"
        probs = must_raise(catch(ep.reg, p, N + 4096), p, f"reg({p:#x}, {N} + 4096) past the end")
        del t
        return probs

    def reg_span_two():
        if expandable:
            return ("SKIP: with expandable segments tensors share one mapped segment; there are "
                    "no separate cudaMalloc allocations to span")
        _drop(R)
        ts = [_fresh_gpu(R, N) for _ in range(8)]
        by_addr = sorted(ts, key=lambda t: t.data_ptr())
        pair = None
        for a, b in zip(by_addr, by_addr[1:]):
            if a.data_ptr() + N == b.data_ptr():
                ra, rb = _alloc_range(R, a.data_ptr()), _alloc_range(R, b.data_ptr())
                if ra == "unknown" or (ra is not None and rb is not None and ra[0] != rb[0]):
                    pair = (a.data_ptr(), b.data_ptr())
                    break
        if pair is None:
            return (f"SKIP: no two of 8 fresh {N}-byte allocations were adjacent "
                    f"({[hex(t.data_ptr()) for t in by_addr]})")
        pa, pb = pair
        probs = must_raise(catch(ep.reg, pa, 2 * N), pa, f"reg({pa:#x}, 2 x {N}) over two allocations")
        q = pb - 4096
        probs += must_raise(catch(ep.reg, q, 8192), q, f"reg({q:#x}, 8192) across the boundary")
        for p in (pa, pb):   # each allocation alone is fine
            ok, m = ep.reg(p, N)
            assert ok is True
            ep.dereg(m)
        del ts, by_addr
        return probs

    def reuse_send(keep_stale: bool, tag: str):
        # Rank 0 sends A from a fresh allocation, frees it for real (back to
        # the driver), allocates again (the same address, normally) and sends
        # B from there.  A receiver or engine that cached the first
        # allocation's mapping by address would deliver A (or fault).
        a_seed, b_seed = R.seed + 101 + (10 if keep_stale else 0), R.seed + 102 + (10 if keep_stale else 0)
        if R.rank == 1:
            return recv_check(a_seed, f"{tag}: first message") + \
                recv_check(b_seed, f"{tag}: second message (from the reallocated address)")
        _drop(R)
        t1 = _fresh_gpu(R, N, a_seed)
        p1 = t1.data_ptr()
        ok, m1 = ep.reg(p1, N)
        send_one(t1, m1)
        if not keep_stale:
            ep.dereg(m1)
        del t1
        _drop(R)
        t2 = _fresh_gpu(R, N, b_seed)
        p2 = t2.data_ptr()
        ret = ep.reg(p2, N)   # must be accepted: the address is valid memory again
        assert ret[0] is True, f"reg of the reused address returned {ret!r}"
        m2 = ret[1]
        send_one(t2, m2)
        R.info[f"{tag}_address_reused"] = p1 == p2
        if keep_stale:
            st["stale"] = dict(p=p1, mr=m1, new_mr=m2, reused=p1 == p2, t=t2)
        else:
            ep.dereg(m2)
            del t2
        return []

    def reuse_recv():
        # Rank 1 receives into an allocation, frees it for real, allocates
        # again and receives again: the sender side must not write through a
        # mapping of the first allocation.
        a_seed, b_seed = R.seed + 201, R.seed + 202
        if R.rank == 0:
            src = _fresh_gpu(R, N, a_seed)
            ok, m = ep.reg(src.data_ptr(), N)
            send_one(src, m)
            R.get("reuse_recv/ready")
            src.copy_(R.gen(b_seed, N))
            R.sync()
            send_one(src, m)
            ep.dereg(m)
            return []
        _drop(R)
        d1 = _fresh_gpu(R, N)
        p1 = d1.data_ptr()
        ok, m1 = ep.reg(p1, N)
        _ok(ep.recv(conn, m1, p1, N), "recv")
        probs = [f"first message: {x}" for x in _check_whole(R, d1, a_seed)]
        ep.dereg(m1)
        del d1
        _drop(R)
        d2 = _fresh_gpu(R, N)
        p2 = d2.data_ptr()
        R.info["reuse_recv_address_reused"] = p1 == p2
        ok, m2 = ep.reg(p2, N)
        R.put("reuse_recv/ready", True)
        _ok(ep.recv(conn, m2, p2, N), "recv")
        probs += [f"second message (into the reallocated address): {x}"
                  for x in _check_whole(R, d2, b_seed)]
        ep.dereg(m2)
        return probs

    def reuse_write():
        # Rank 1 advertises a GPU window, rank 0 writes A; rank 1 deregisters,
        # frees it for real, allocates again and advertises anew; rank 0
        # writes B.  Then stale_fifo_refused: rank 0 writes with the first
        # (revoked) fifo item.
        a_seed, b_seed = R.seed + 301, R.seed + 302
        if R.rank == 0:
            src = _fresh_gpu(R, N, a_seed)
            ok, m = ep.reg(src.data_ptr(), N)
            f1 = R.get("rw/fifo1")
            _ok(ep.write(conn, m, src.data_ptr(), N, f1), "write")
            R.sync()
            R.put("rw/written1", True)
            f2 = R.get("rw/fifo2")
            src.copy_(R.gen(b_seed, N))
            R.sync()
            _ok(ep.write(conn, m, src.data_ptr(), N, f2), "write")
            R.sync()
            R.put("rw/written2", True)
            st["rw"] = dict(src=src, mr=m, fifo1=f1)
            return []
        _drop(R)
        w1 = _fresh_gpu(R, N)
        p1 = w1.data_ptr()
        ok, m1 = ep.reg(p1, N)
        R.put("rw/fifo1", ep.advertise(conn, m1, p1, N)[1])
        R.get("rw/written1")
        probs = [f"first write: {x}" for x in _check_whole(R, w1, a_seed)]
        ep.dereg(m1)
        del w1
        _drop(R)
        w2 = _fresh_gpu(R, N)
        p2 = w2.data_ptr()
        R.info["reuse_write_address_reused"] = p1 == p2
        ok, m2 = ep.reg(p2, N)
        R.put("rw/fifo2", ep.advertise(conn, m2, p2, N)[1])
        R.get("rw/written2")
        probs += [f"second write (into the reallocated window): {x}"
                  for x in _check_whole(R, w2, b_seed)]
        st["rw"] = dict(w=w2, mr=m2, seed=b_seed)
        return probs

    def stale_fifo():
        if R.rank == 0:
            s = st.pop("rw")
            err = catch(ep.write, conn, s["mr"], s["src"].data_ptr(), N, s["fifo1"])
            R.put("rw/stale_done", True)
            ep.dereg(s["mr"])
            if err is None:
                return ["a write with the fifo item of a deregistered (and freed) window succeeded"]
            if err["timeout"]:
                return [f"a write with a revoked fifo item timed out instead of being refused: "
                        f"{err['msg']}"]
            if not (err["value"] or err["uccl"]):
                return [f"a write with a revoked fifo item raised {err['type']}: {err['msg']}"]
            return []
        s = st.pop("rw")
        R.get("rw/stale_done")
        probs = [f"the new window after a write with the revoked fifo item: {x}"
                 for x in _check_whole(R, s["w"], s["seed"])]
        ep.dereg(s["mr"])
        return probs

    def reuse_read():
        a_seed, b_seed = R.seed + 401, R.seed + 402
        if R.rank == 1:
            _drop(R)
            s1 = _fresh_gpu(R, N, a_seed)
            p1 = s1.data_ptr()
            ok, m1 = ep.reg(p1, N)
            R.put("rr/fifo1", ep.advertise(conn, m1, p1, N)[1])
            R.get("rr/read1")
            ep.dereg(m1)
            del s1
            _drop(R)
            s2 = _fresh_gpu(R, N, b_seed)
            p2 = s2.data_ptr()
            R.info["reuse_read_address_reused"] = p1 == p2
            ok, m2 = ep.reg(p2, N)
            R.put("rr/fifo2", ep.advertise(conn, m2, p2, N)[1])
            R.get("rr/read2")
            ep.dereg(m2)
            return []
        d = _fresh_gpu(R, N)
        ok, m = ep.reg(d.data_ptr(), N)
        _ok(ep.read(conn, m, d.data_ptr(), N, R.get("rr/fifo1")), "read")
        probs = [f"first read: {x}" for x in _check_whole(R, d, a_seed)]
        R.put("rr/read1", True)
        d.fill_(POISON)
        R.sync()
        _ok(ep.read(conn, m, d.data_ptr(), N, R.get("rr/fifo2")), "read")
        probs += [f"second read (from the reallocated source): {x}"
                  for x in _check_whole(R, d, b_seed)]
        R.put("rr/read2", True)
        ep.dereg(m)
        return probs

    def freed(side: int, what: str):
        # Register, free for real (empty_cache returns it to the driver), then
        # use the registration: the engine must refuse, naming the pointer.
        # With expandable segments only whole 20 MiB pages go back, so the
        # transfer uses a part of the freed range the driver no longer maps.
        if R.rank != side:
            R.get(f"{what}/done", timeout=ERR_TIMEOUT_S + 60)
            return []
        pep, pconn = probes[what], probe_conns[what]
        try:
            _drop(R)
            size = 64 * MiB
            t = _fresh_gpu(R, size)
            p = t.data_ptr()
            ok, m = pep.reg(p, size)
            del t
            _drop(R)
            q = next((p + o for o in range(0, size, 2 * MiB) if _released(R, p + o)), None)
            if q is None:
                return (f"SKIP: no part of the freed [{p:#x}, +{size}) was unmapped after "
                        "empty_cache; cannot test")
            n = min(2 * MiB, p + size - q)
            op = pep.send if side == 0 else pep.recv
            probs = must_raise(catch(op, pconn, m, q, n), (q, p),
                               f"{op.__name__}({q:#x}, {n}) of memory freed after reg")
            catch(pep.dereg, m)
            return probs
        finally:
            R.put(f"{what}/done", True)

    def stale_region():
        if R.rank != 0:
            R.get("stale/done", timeout=ERR_TIMEOUT_S + 60)
            return []
        try:
            s = st.pop("stale", None)
            if s is None:
                return "SKIP: reuse_send_stale_region_kept did not run"
            if not s["reused"]:
                return "SKIP: the freed address was not handed out again; nothing stale to test"
            if s["new_mr"] == s["mr"]:
                ep.dereg(s["new_mr"])
                return ("SKIP: reg of the reused address returned the stale region's id (the "
                        "engine revalidated it); the data check of reuse_send_stale_region_kept "
                        "covers it")
            probs = must_raise(catch(ep.send, conn, s["mr"], s["p"], N), s["p"],
                               "send through a region whose memory was freed and reallocated")
            catch(ep.dereg, s["mr"])
            ep.dereg(s["new_mr"])
            return probs
        finally:
            R.put("stale/done", True)

    def still_usable():
        # After every refusal above the connection still carries data.
        seed = R.seed + 999
        if R.rank == 0:
            b = Bufs(R, "gpu", [4097], SRC_GAP)
            b.fill([seed])
            m = b.reg(ep)
            _ok(ep.send(conn, m[0], b.ptrs()[0], 4097), "send")
            b.dereg(ep)
            return []
        b = Bufs(R, "gpu", [4097], DST_GAP)
        m = b.reg(ep)
        _ok(ep.recv(conn, m[0], b.ptrs()[0], 4097), "recv")
        probs = b.check([seed], "received after the refusals")
        b.dereg(ep)
        return probs

    run.run("setup", lambda: allocator_problems(R))
    run.run("reg_nonsense_ptr", reg_nonsense)
    run.run("reg_past_end", reg_past_end)
    run.run("reg_span_two_allocations", reg_span_two)
    run.run("freed_send", freed, 0, "freed_send")
    run.run("freed_recv", freed, 1, "freed_recv")
    run.run("reuse_send_after_dereg", reuse_send, False, "reuse_send_after_dereg")
    run.run("reuse_send_stale_region_kept", reuse_send, True, "reuse_send_stale_region_kept")
    run.run("reuse_recv", reuse_recv)
    run.run("reuse_write", reuse_write)
    run.run("stale_fifo_refused", stale_fifo)
    run.run("reuse_read", reuse_read)
    run.run("stale_region_send_refused", stale_region)
    run.run("still_usable", still_usable)
    st.clear()
    run.end()
    for e in (ep, *probes.values()):
        e.close()
    return run.result()


def _check_whole(R, t, seed) -> list[str]:
    """A whole tensor must hold seed's bytes."""
    exp = R.gen(seed, t.numel())
    if R.torch.equal(t, exp):
        return []
    bad = (t != exp).nonzero()
    first = int(bad[0])
    note = " (all POISON: nothing arrived)" if bool((t == POISON).all()) else ""
    return [f"{bad.numel()} of {t.numel()} bytes wrong, first at {first}: got "
            f"{int(t[first]):#04x} want {int(exp[first]):#04x}{note}"]
