"""The verbs emulator (tests/ibv_emu/): built here with the C compiler, loaded
by the engine through UCCL_IBVERBS_LIB, never installed or used outside the
tests.  ``path()`` builds it once (again when a source is newer) and returns
the library's path."""
from __future__ import annotations

import os
import pathlib
import subprocess

HERE = pathlib.Path(__file__).resolve().parent
SRC = HERE / "ibv_emu"
ROOT = HERE.parent
OUT = SRC / "build" / "libibverbs.so.1"
_C = [SRC / "ibv_emu.c", SRC / "ibv_emu_device.c", SRC / "ibv_emu_cq.c", SRC / "ibv_emu_qp.c",
      SRC / "ibv_emu_wire.c", SRC / "ibv_emu_sock.c"]
_SOURCES = _C + [SRC / "ibv_emu.h", SRC / "ibv_emu_qp.h", SRC / "ibv_emu.map",
                 ROOT / "csrc" / "load" / "ibv_loader.h"]


def path() -> str:
    """The emulator's libibverbs.so.1, built if missing or stale."""
    if OUT.exists() and all(OUT.stat().st_mtime >= s.stat().st_mtime for s in _SOURCES):
        return str(OUT)
    OUT.parent.mkdir(exist_ok=True)
    tmp = OUT.with_name(f"libibverbs.so.1.{os.getpid()}")
    cmd = [os.environ.get("CC", "gcc"), "-std=c11", "-O2", "-g", "-Wall", "-Wextra", "-Werror",
           "-fPIC", "-shared", "-fvisibility=hidden", f"-I{ROOT / 'csrc'}",
           f"-Wl,--version-script={SRC / 'ibv_emu.map'}", "-Wl,-soname,libibverbs.so.1",
           "-o", str(tmp), *map(str, _C), "-lpthread"]
    subprocess.run(cmd, check=True, timeout=120)
    os.replace(tmp, OUT)  # atomic: a rank never loads a half-written file
    return str(OUT)


CHECK = SRC / "build" / "emu_check"


def check_path() -> str:
    """The emulator's own test driver (ibv_emu/emu_check.c), built if stale."""
    srcs = [SRC / "emu_check.c", SRC / "ibv_emu.h", ROOT / "csrc" / "load" / "ibv_loader.h"]
    if CHECK.exists() and all(CHECK.stat().st_mtime >= s.stat().st_mtime for s in srcs):
        return str(CHECK)
    CHECK.parent.mkdir(exist_ok=True)
    tmp = CHECK.with_name(f"emu_check.{os.getpid()}")
    subprocess.run([os.environ.get("CC", "gcc"), "-std=c11", "-O1", "-g", "-Wall", "-Wextra",
                    "-Werror", f"-I{ROOT / 'csrc'}", "-o", str(tmp), str(SRC / "emu_check.c"),
                    "-ldl"], check=True, timeout=120)
    os.replace(tmp, CHECK)
    return str(CHECK)


def env(**extra) -> dict:
    """Environment that makes the engine use the emulator over RDMA."""
    return {"UCCL_P2P_TRANSPORT": "rdma", "UCCL_IBVERBS_LIB": path(), **extra}
