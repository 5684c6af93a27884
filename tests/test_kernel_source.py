"""The CUDA sources that csrc/sg_cuda.c hands NVRTC at run time (the
reduction, the copies, the one-launch round) parse as C++17 for every
element type: a typo there would fail only on a GPU machine, at the first
call.  They are checked here with the host's g++ against stand-ins for the
few CUDA built-ins they use (no semantics: the GPU tests run them)."""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "csrc" / "sg_cuda.c"
STANDINS = r"""
#define __device__
#define __global__
#define __forceinline__ inline
#define asm(...)
struct dim3 { unsigned x, y, z; };
static dim3 blockIdx, blockDim, threadIdx, gridDim;
static void __syncthreads() {}
static void __threadfence() {}
static void __threadfence_system() {}
static void __nanosleep(unsigned) {}
static unsigned atomicAdd(unsigned *p, unsigned v) { unsigned o = *p; *p += v; return o; }
"""


def c_string(name: str) -> str:
    """The C string literal `static const char name[] = "..." "...";` of sg_cuda.c."""
    m = re.search(r"static const char %s\[\] =\n(.*?);\n" % name, SRC.read_text(), re.S)
    assert m, f"{name} not found in {SRC.name}"
    return "".join(ast.literal_eval(f'"{lit}"')
                   for lit in re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1)))


def dtype_names() -> list[str]:
    m = re.search(r"dt_names\[UCCL_DT_COUNT\] = \{(.*?)\};", SRC.read_text(), re.S)
    return re.findall(r'"(\w+)"', m.group(1))


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine to parse with")
@pytest.mark.parametrize("dtype", dtype_names())
def test_nvrtc_sources_parse(tmp_path, dtype):
    code = (STANDINS + f"#define UCCL_DT {dtype}\n" + c_string("kernel_src") +
            c_string("fused_src") + c_string("copy_src")).replace('extern "C"', "")
    # each module is compiled on its own by NVRTC; together here, so the
    # copy kernel's own V16 and typedefs are renamed out of the way
    code = code.replace("struct alignas(16) V16 { u32 w[4]; };\nstruct CopyArgs",
                        "struct CopyArgs")
    f = tmp_path / "k.cpp"
    f.write_text(code)
    r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wno-unknown-pragmas", str(f)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[:4000]
    assert "uccl_sg_fused" in code and "uccl_sg_reduce" in code and "uccl_sg_copy" in code
