"""Does a copy on a fresh non-blocking stream wait for a kernel on another stream?

    python3 benchmarks/stream_queue_probe.py                 # GPU 0, 40 streams
    python3 benchmarks/stream_queue_probe.py --streams 64 --json out.json

Why: a context has a few hardware work queues per device
(CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), streams are dealt onto them as
they are made, and the work of one queue runs in order.  If that holds, a
copy on a stream that shares a queue with a spinning kernel's stream waits
for the kernel, whatever the streams' flags say; a GPU ring's kernel spins
until the engine's copies are done, so such a copy would never start.

For k = 1..--streams: hold torch's current (legacy default) stream, make
the k-th stream (cuStreamCreate, CU_STREAM_NON_BLOCKING), copy 4 KiB device
to device on it and time the copy to its end.  --blocker kernel holds the
stream with a kernel that spins --spin-ms; --blocker wait-value with a
cuStreamWaitValue32 on a word in pinned host memory that the host sets
--spin-ms later (the stream memory operation the engine's rounds queue).
A stream whose copy took about --spin-ms shares the held stream's queue.
Prints one line per stream and the indices that waited; exit status 0
whatever the answer, 2 if the probe could not run.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ipc_close_probe import CU_DEVICE_ATTRIBUTE_CLOCK_RATE, CU_STREAM_NON_BLOCKING, _cuda  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--streams", type=int, default=40, help="streams to make (default 40)")
    ap.add_argument("--spin-ms", type=float, default=150.0, help="the kernel's spin (default 150)")
    ap.add_argument("--blocker", choices=("kernel", "wait-value"), default="kernel",
                    help="what holds torch's stream (default: a spinning kernel)")
    ap.add_argument("--json", help="write the result here too")
    a = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device: this probe needs one", file=sys.stderr)
        return 2
    torch.cuda.set_device(a.device)
    x = torch.empty(4096, dtype=torch.uint8, device=a.device)
    y = torch.empty_like(x)
    torch.cuda.synchronize()
    cu = _cuda()
    khz = ctypes.c_int()
    cu.attr(ctypes.byref(khz), CU_DEVICE_ATTRIBUTE_CLOCK_RATE, a.device)
    word = torch.zeros(1, dtype=torch.int32).pin_memory()   # UVA: its address serves the GPU
    flag = ctypes.c_int32.from_address(word.data_ptr())
    held = torch.cuda.current_stream().cuda_stream
    rows = []
    for k in range(1, a.streams + 1):
        s = ctypes.c_void_p()
        if cu.stream_create(ctypes.byref(s), CU_STREAM_NON_BLOCKING):
            print(f"cuStreamCreate failed at stream {k}", file=sys.stderr)
            return 2
        if a.blocker == "kernel":
            torch.cuda._sleep(int(a.spin_ms * khz.value))
        elif cu.wait_value32(held, word.data_ptr(), k, 0):   # CU_STREAM_WAIT_VALUE_GEQ
            print(f"cuStreamWaitValue32 failed at stream {k}", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        rc = cu.memcpy(y.data_ptr(), x.data_ptr(), x.numel(), s)
        if a.blocker == "wait-value":   # the copy's end, or the word set after --spin-ms
            while cu.stream_query(s) != 0 and time.perf_counter() - t0 < a.spin_ms / 1e3:
                time.sleep(0.0001)
            flag.value = k
        rc = rc or cu.stream_sync(s)
        ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        rows.append({"stream": k, "copy_ms": round(ms, 3), "cuda_result": rc,
                     "waited": ms > a.spin_ms * 0.5})
        note = "  (waited for the held stream)" if ms > a.spin_ms * 0.5 else ""
        print(f"stream {k:3d}: copy {ms:8.3f} ms{note}")
    waited = [r["stream"] for r in rows if r["waited"]]
    out = {"device": a.device, "blocker": a.blocker, "spin_ms": a.spin_ms, "streams": rows,
           "waited": waited,
           "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}
    print(f"streams whose copy waited for the held stream: {waited or 'none'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
