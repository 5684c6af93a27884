"""The CUDA sources that csrc/sgdev/sg_cuda.c hands NVRTC at run time (the parts
of csrc/sgdev/sg_kernels.c: the reduction, the copies, the one-launch rounds, the
handshake) parse as C++17 for every
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

CSRC = Path(__file__).resolve().parents[1] / "csrc" / "sgdev"
SRC = CSRC / "sg_kernels.c"
# every part, in an order where each comes after what it uses (sg_kernels.h)
PARTS = ("prelude", "reduce", "copy_fn", "fused", "cfused", "cll", "copy", "sync", "gather",
         "eops")
STANDINS = r"""
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
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
    """The C string literal `const char uccl__sg_<name>_src[] = "..." "...";` of sg_kernels.c."""
    m = re.search(r"^const char uccl__sg_%s_src\[\] =\n(.*?);\n" % name, SRC.read_text(),
                  re.S | re.M)
    assert m, f"{name} not found in {SRC.name}"
    return "".join(ast.literal_eval(f'"{lit}"')
                   for lit in re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1)))


def dtype_names() -> list[str]:
    m = re.search(r"dt_names\[UCCL_DT_COUNT\] = \{(.*?)\};", (CSRC / "sg_cuda.c").read_text(),
                  re.S)
    return re.findall(r'"(\w+)"', m.group(1))


def modules() -> list[tuple[str, list[str]]]:
    """Each kernel sg_cuda.c compiles, with its list of parts (`parts[] = {...}`)."""
    found = re.findall(r"parts\[\] = \{(.*?)\};.*?\"(uccl_sg_\w+)\"",
                       (CSRC / "sg_cuda.c").read_text(), re.S)
    return [(name, re.findall(r"uccl__sg_(\w+)_src", body)) for body, name in found]


def test_every_kernel_has_its_parts():
    got = dict(modules())
    assert sorted(got) == ["uccl_sg_cfused", "uccl_sg_cll", "uccl_sg_copy", "uccl_sg_eops",
                           "uccl_sg_fused", "uccl_sg_gather", "uccl_sg_reduce", "uccl_sg_sync"], got
    assert all(parts and parts[0] == "prelude" and set(parts) <= set(PARTS)
               for parts in got.values()), got


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine to parse with")
@pytest.mark.parametrize("dtype", dtype_names())
def test_nvrtc_sources_parse(tmp_path, dtype):
    # each module on its own, as NVRTC compiles it (a part it lacks fails here)
    for kernel, parts in modules():
        code = (STANDINS + (f"#define UCCL_DT {dtype}\n" if "reduce" in parts else "") +
                "".join(c_string(p) for p in parts)).replace('extern "C"', "")
        assert f"void {kernel}(" in code or f") {kernel}(" in code, kernel
        f = tmp_path / f"{kernel}.cpp"
        f.write_text(code)
        r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wno-unknown-pragmas", str(f)],
                           capture_output=True, text=True)
        assert r.returncode == 0, (kernel, r.stderr[:4000])
