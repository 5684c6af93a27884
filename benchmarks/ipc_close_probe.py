"""Does opening or closing a CUDA IPC mapping wait for a kernel that runs on the device?

    python3 benchmarks/ipc_close_probe.py                    # both processes on GPU 0
    python3 benchmarks/ipc_close_probe.py --devices 1,0      # exporter on GPU 1, importer on GPU 0
    python3 benchmarks/ipc_close_probe.py --spin-ms 3000 --json out.json

Why: the engine opens a peer's GPU memory (cuIpcOpenMemHandle) on the thread
that serves the peer's write (gpu/gpu_mem.c), while GPU rings' kernels may
spin on the device until their own puts complete.  If an open waits for
every kernel of the device, such a thread waits for a kernel that waits for
it.  Closes of dropped mappings run on a closer thread of the engine's own
for that reason, but a reopen of memory whose close is still under way
waits for that close (10 s at most), so a close that waits for kernels
matters too.

Two processes.  The exporter allocates three buffers with the driver
(cuMemAlloc: three allocations, filled with 1, 2 and 3) and sends their raw
CUipcMemHandles (cuIpcGetMemHandle), not the handles of torch's
_share_cuda_(): torch prefixes those with a version and a type byte, and
small tensors may share one cudaMalloc segment.  It frees the buffers once
the importer is done.  The importer opens the first one, then starts a
kernel that spins for --spin-ms on torch's current stream
(torch.cuda._sleep), and from another thread, while it spins, times: a
copy on a non-blocking stream of its own (the control: it should not
wait), opening the second and the third, then closing the second and the
first (the opens first: a close that waits for the kernel would put every
later call after its end; the third is closed after the kernel, untimed).  Then a
second kernel: one thread closes a mapping while another, 200 ms later,
times a copy and an open of other memory (does a close under way hold
them up?).  Each line says how long the call took and whether it returned
before the kernel ended.  Exit
status 0 whatever the answer; 2 if the probe itself could not run.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import sys
import threading
import time
import types

CU_IPC_LAZY_PEER_ACCESS = 1
CU_STREAM_NON_BLOCKING = 1
CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13   # kHz


class IpcHandle(ctypes.Structure):
    """CUipcMemHandle, passed by value.  Built from bytes with
    from_buffer_copy and read with bytes(h): the c_char array field itself
    stops at the first zero byte, both ways."""
    _fields_ = [("reserved", ctypes.c_char * 64)]


def _cuda() -> types.SimpleNamespace:
    """The driver calls the probe makes, with their C signatures."""
    lib = ctypes.CDLL("libcuda.so.1")
    u64, ptr = ctypes.c_uint64, ctypes.c_void_p

    def fn(names, argtypes):
        for n in names:
            if hasattr(lib, n):
                f = getattr(lib, n)
                f.argtypes, f.restype = argtypes, ctypes.c_int
                return f
        raise SystemExit(f"libcuda has none of {names}")
    return types.SimpleNamespace(
        open=fn(("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"),
                [ctypes.POINTER(u64), IpcHandle, ctypes.c_uint]),
        close=fn(("cuIpcCloseMemHandle",), [u64]),
        ctx_get=fn(("cuCtxGetCurrent",), [ctypes.POINTER(ptr)]),
        ctx_set=fn(("cuCtxSetCurrent",), [ptr]),
        stream_create=fn(("cuStreamCreate",), [ctypes.POINTER(ptr), ctypes.c_uint]),
        memcpy=fn(("cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync"), [u64, u64, ctypes.c_size_t, ptr]),
        stream_sync=fn(("cuStreamSynchronize",), [ptr]),
        stream_query=fn(("cuStreamQuery",), [ptr]),
        wait_value32=fn(("cuStreamWaitValue32_v2", "cuStreamWaitValue32"),
                        [ptr, u64, ctypes.c_uint32, ctypes.c_uint]),
        attr=fn(("cuDeviceGetAttribute",), [ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                                            ctypes.c_int]),
        # the exporter's: CUdeviceptr is an unsigned 64-bit integer
        alloc=fn(("cuMemAlloc_v2",), [ctypes.POINTER(u64), ctypes.c_size_t]),
        memset=fn(("cuMemsetD8_v2",), [u64, ctypes.c_ubyte, ctypes.c_size_t]),
        free=fn(("cuMemFree_v2",), [u64]),
        get_handle=fn(("cuIpcGetMemHandle",), [ctypes.POINTER(IpcHandle), u64]))


def _exporter(dev: int, nbytes: int, conn) -> None:
    """Sends [(raw 64-byte CUipcMemHandle, offset 0)] * 3, or {"error": why}."""
    import torch
    torch.cuda.set_device(dev)
    torch.empty(1, device=dev)   # the primary context, current on this thread
    cu = _cuda()
    ptrs, handles = [], []
    try:
        for i in range(3):
            p = ctypes.c_uint64()
            rc = cu.alloc(ctypes.byref(p), nbytes)
            if rc:
                conn.send({"error": f"cuMemAlloc_v2 of {nbytes} bytes: CUresult {rc}"})
                return
            ptrs.append(p.value)
            h = IpcHandle()
            rc = cu.memset(p.value, i + 1, nbytes) or cu.get_handle(ctypes.byref(h), p.value)
            if rc:
                conn.send({"error": f"cuMemsetD8_v2 or cuIpcGetMemHandle: CUresult {rc}"})
                return
            handles.append((bytes(h), 0))
        torch.cuda.synchronize()   # the fills are done before the importer looks
        conn.send(handles)
        conn.recv()   # until the importer is done: the memory stays allocated
    finally:
        for p in ptrs:
            cu.free(p)


def _timed(what: str, fn, since: float) -> dict:
    """One call timed: its row (how long it took, its CUresult, and when it
    returned, counted from `since`, the kernel's launch)."""
    t0 = time.perf_counter()
    rc = fn()
    t1 = time.perf_counter()
    return {"call": what, "ms": round((t1 - t0) * 1e3, 3), "cuda_result": int(rc),
            "returned_at_ms": round((t1 - since) * 1e3, 3)}


def _before_kernel_end(res: dict) -> None:
    """Marks each timed call of res by whether it returned before its
    kernel (res["kernel_ms"]) ended."""
    for c in res["calls"]:
        c["before_kernel_end"] = c["returned_at_ms"] < res["kernel_ms"] * 0.9


def _importer(dev: int, spin_ms: float, nbytes: int, handles: list) -> dict:
    import torch
    torch.cuda.set_device(dev)
    torch.cuda.init()
    torch.empty(1, device=dev)   # the primary context, current on this thread
    cu = _cuda()
    ctx = ctypes.c_void_p()
    cu.ctx_get(ctypes.byref(ctx))

    def open_(h):
        p = ctypes.c_uint64()
        rc = cu.open(ctypes.byref(p), IpcHandle.from_buffer_copy(h[0]),
                     CU_IPC_LAZY_PEER_ACCESS)
        return rc, p.value + h[1]

    rc, p0 = open_(handles[0])
    if rc:
        return {"error": f"cuIpcOpenMemHandle before the kernel: CUresult {rc}"}
    khz = ctypes.c_int()
    cu.attr(ctypes.byref(khz), CU_DEVICE_ATTRIBUTE_CLOCK_RATE, dev)
    scratch = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    out: dict = {"device": dev, "spin_ms": spin_ms, "calls": []}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(int(spin_ms * khz.value))   # cycles = ms x kHz
    end.record()
    t_launch = time.perf_counter()

    got: dict = {}   # the probe's opens: (CUresult, pointer)

    def probe():
        cu.ctx_set(ctx)
        s = ctypes.c_void_p()
        cu.stream_create(ctypes.byref(s), CU_STREAM_NON_BLOCKING)
        # the opens first: a close that waits for the kernel would leave
        # every later call after its end
        calls = [("copy on a non-blocking stream (control)",
                  lambda: cu.memcpy(scratch.data_ptr(), p0, nbytes, s) or cu.stream_sync(s)),
                 ("cuIpcOpenMemHandle",
                  lambda: got.setdefault("p1", open_(handles[1]))[0]),
                 ("cuIpcOpenMemHandle of another",
                  lambda: got.setdefault("p2", open_(handles[2]))[0]),
                 ("cuIpcCloseMemHandle of a mapping opened while the kernel runs",
                  lambda: cu.close(got["p1"][1] - handles[1][1])),
                 ("cuIpcCloseMemHandle of a mapping opened before the kernel",
                  lambda: cu.close(p0 - handles[0][1]))]
        for what, fn in calls:
            out["calls"].append(_timed(what, fn, t_launch))
    th = threading.Thread(target=probe)
    th.start()
    th.join(60 + spin_ms / 1e3 * 3)
    torch.cuda.synchronize()
    out["kernel_ms"] = round(start.elapsed_time(end), 3)
    if th.is_alive():
        out["error"] = "the probe thread did not return within the bound"
        return out
    _before_kernel_end(out)
    if got.get("p2", (1,))[0] != 0:
        return out
    out["while_closing"] = _while_closing(cu, ctx, khz.value, spin_ms, nbytes, handles,
                                          got["p2"][1], scratch, open_)
    cu.close(got["p2"][1] - handles[2][1])   # before the exporter frees it (untimed)
    return out


def _while_closing(cu, ctx, khz, spin_ms, nbytes, handles, p2, scratch, open_) -> dict:
    """The second kernel: one thread closes a mapping (which waits for the
    kernel, as the first part shows), and another, 200 ms later, times a
    copy and an open of other memory.  Whether they wait too tells whether
    a close under way on the engine's closer thread holds up the thread
    that serves a peer's write."""
    import torch
    rc, p0 = open_(handles[0])
    if rc:
        return {"error": f"reopening the first buffer: CUresult {rc}"}
    res: dict = {"calls": []}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(int(spin_ms * khz))
    end.record()
    t0 = time.perf_counter()

    def closer():
        cu.ctx_set(ctx)
        res["calls"].append(_timed("cuIpcCloseMemHandle (the closer)",
                                   lambda: cu.close(p0 - handles[0][1]), t0))

    def server():
        cu.ctx_set(ctx)
        s = ctypes.c_void_p()
        cu.stream_create(ctypes.byref(s), CU_STREAM_NON_BLOCKING)
        time.sleep(0.2)
        opened: dict = {}
        for what, fn in (("copy on a non-blocking stream while a close waits",
                          lambda: cu.memcpy(scratch.data_ptr(), p2, nbytes, s)
                          or cu.stream_sync(s)),
                         ("cuIpcOpenMemHandle of other memory while a close waits",
                          lambda: opened.setdefault("p1", open_(handles[1]))[0])):
            res["calls"].append(_timed(what, fn, t0))
        if opened.get("p1", (1,))[0] == 0:
            res["reopened"] = opened["p1"][1] - handles[1][1]
    ths = [threading.Thread(target=closer), threading.Thread(target=server)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60 + spin_ms / 1e3 * 3)
    torch.cuda.synchronize()
    res["kernel_ms"] = round(start.elapsed_time(end), 3)
    if any(t.is_alive() for t in ths):
        res["error"] = "a probe thread did not return within the bound"
        return res
    _before_kernel_end(res)
    if "reopened" in res:
        cu.close(res.pop("reopened"))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--devices", default="0,0",
                    help="exporter's GPU, importer's GPU (default 0,0)")
    ap.add_argument("--spin-ms", type=float, default=2000.0,
                    help="how long the importer's kernel spins (default 2000)")
    ap.add_argument("--bytes", type=int, default=1 << 20, help="size of each buffer")
    ap.add_argument("--json", help="write the result here too")
    a = ap.parse_args()
    exp_dev, imp_dev = (int(x) for x in a.devices.split(","))
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device: this probe needs one (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_exporter, args=(exp_dev, a.bytes, there))
    p.start()
    try:
        deadline = time.monotonic() + 120
        while not here.poll(0.5):
            if not p.is_alive() or time.monotonic() > deadline:
                print("the exporter sent no handles (it exited, or 120 s passed)",
                      file=sys.stderr)
                return 2
        got = here.recv()
        if isinstance(got, dict):
            print(f"the exporter failed: {got['error']}", file=sys.stderr)
            return 2
        res = _importer(imp_dev, a.spin_ms, a.bytes, got)
    finally:
        try:
            here.send("done")
        except OSError:   # the exporter is gone already
            pass
        p.join(30)
        if p.is_alive():
            p.kill()
    res["devices"] = a.devices
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 2 if "error" in res else 0


if __name__ == "__main__":
    sys.exit(main())
