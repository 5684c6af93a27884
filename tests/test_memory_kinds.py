"""What reg() makes of a pointer, checked where there is no GPU (CI): readable
host memory registers and moves whether or not libcuda can be loaded; memory
this process cannot read (a device pointer of another process, freed memory,
or a CUDA pointer where libcuda is missing) is refused at registration with
the pointer in the message, and nothing is registered.  The GPU side of the
matrix is tests/test_gpu.py, which runs on the GPU machine."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from uccl_collective import p2p

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _no_access_region(n: int = 1 << 16):
    """n bytes of address space this process may not read (PROT_NONE), as a
    device pointer of another process or an unmapped CUDA address looks."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20
    addr = libc.mmap(None, n, 0, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    return addr, n


def test_unreadable_memory_is_refused_with_the_pointer(endpoints):
    """reg() of memory that is neither CUDA memory of this process nor
    readable host memory raises ValueError naming the address and the size;
    a transfer could never touch it."""
    ep = endpoints()
    addr, n = _no_access_region()
    with pytest.raises(ValueError) as ei:
        ep.reg(addr, n)
    msg = str(ei.value)
    assert f"0x{addr:x}" in msg and str(n) in msg, msg
    # the last byte counts too: a readable start whose range runs 1 TiB on
    # into address space nobody mapped
    buf = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(ValueError, match=f"0x{buf.ctypes.data:x}"):
        ep.reg(buf.ctypes.data, 1 << 40)


def test_host_memory_registers_as_before(endpoints):
    """Readable host memory (numpy) registers, including a zero-length region
    at any address."""
    ep = endpoints()
    a = np.random.randint(0, 256, 8192, dtype=np.uint8)
    ok, mr = ep.reg(a.ctypes.data, a.nbytes)
    assert ok and mr > 0
    ok, mr0 = ep.reg(a.ctypes.data, 0)
    assert ok and mr0 != mr


def test_current_stream_is_zero_without_cuda():
    """p2p.current_stream() (what every Endpoint call passes for stream order)
    is 0, the legacy default stream, where torch has not initialised CUDA."""
    assert p2p.current_stream() == 0


_WITHOUT_LIBCUDA = textwrap.dedent(r"""
    import ctypes, os, threading, numpy as np
    from uccl_collective.p2p import Endpoint
    a, b = Endpoint(port=0), Endpoint(port=0)
    src = np.random.randint(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.full(src.size + 8192, 0x5A, dtype=np.uint8)
    mr_s = a.reg(src.ctypes.data, src.nbytes)[1]
    mr_d = b.reg(dst.ctypes.data, dst.nbytes)[1]
    res = {}
    t = threading.Thread(target=lambda: res.update(acc=b.accept(10)))
    t.start()
    ok, conn = a.connect(*b.address()[:1], 0, b.address()[1])
    t.join()
    conn_b = res["acc"][3]
    t = threading.Thread(target=lambda: b.recv(conn_b, mr_d, dst.ctypes.data + 4096, src.nbytes))
    t.start()
    a.send(conn, mr_s, src.ctypes.data, src.nbytes)
    t.join()
    assert (dst[4096:4096 + src.size] == src).all() and (dst[:4096] == 0x5A).all() \
        and (dst[4096 + src.size:] == 0x5A).all()
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    bad = libc.mmap(None, 4096, 0, 0x22, -1, 0)
    try:
        a.reg(bad, 4096)
    except ValueError as e:
        print("REFUSED:", e)
    a.close(); b.close()
    print("MOVED")
""")


def test_without_libcuda_cpu_works_and_cuda_pointers_are_explained(tmp_path):
    """With libcuda impossible to load (UCCL_CUDA_LIBRARY names a missing
    file), the module imports, host memory registers and moves, and an
    unreadable pointer (what a CUDA pointer is here) is refused with the
    loader's reason: CUDA memory cannot be used, and why."""
    env = dict(os.environ, UCCL_CUDA_LIBRARY=str(tmp_path / "no-libcuda.so.1"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _WITHOUT_LIBCUDA], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "MOVED" in p.stdout, p.stdout
    refused = [ln for ln in p.stdout.splitlines() if ln.startswith("REFUSED:")]
    assert refused, p.stdout
    assert "CUDA memory cannot be used here" in refused[0], refused[0]
    assert "no-libcuda.so.1" in refused[0], refused[0]


def test_stream_wait_on_host_memory_waits_on_the_host(endpoints):
    """stream_wait() of a transfer of host memory has no stream to order: it
    waits on the host like wait(), so the bytes are there when it returns
    (the GPU form, which does not block, is tests/test_gpu_stream_wait.py)."""
    import threading
    a, b = endpoints(), endpoints()
    src = np.random.randint(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.full(src.size, 0x5A, dtype=np.uint8)
    mr_s = a.reg(src.ctypes.data, src.nbytes)[1]
    mr_d = b.reg(dst.ctypes.data, dst.nbytes)[1]
    res = {}
    t = threading.Thread(target=lambda: res.update(acc=b.accept(10)))
    t.start()
    ip, port = b.address()
    _, conn = a.connect(ip, 0, port)
    t.join()
    _, tid = b.recv_async(res["acc"][3], mr_d, dst.ctypes.data, dst.nbytes)
    sender = threading.Thread(target=a.send, args=(conn, mr_s, src.ctypes.data, src.nbytes))
    sender.start()
    assert b.stream_wait(tid) is True
    assert (dst == src).all()
    sender.join()
    assert b.release(tid) is True
