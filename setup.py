"""Builds the C engine as uccl_collective._engine (C11, stable ABI).

Links only libc, libpthread and libdl: CUDA and libibverbs are loaded at run
time by the transports that need them, so the module imports anywhere.
"""
import glob
import os
import pathlib

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext

# A build for the sanitizers (docs/testing.md): UCCL_SANITIZE=address,undefined
# or UCCL_SANITIZE=thread (a build-time switch, read here only).  The module
# then needs the runtime preloaded into the (unsanitized) python.
SANITIZERS = {"address", "undefined", "thread"}
SANITIZE = ",".join(sorted(w.strip() for w in os.environ.get("UCCL_SANITIZE", "").split(",")
                           if w.strip()))
if not set(SANITIZE.split(",") if SANITIZE else []) <= SANITIZERS or \
        ("thread" in SANITIZE and SANITIZE != "thread"):
    raise SystemExit(f"UCCL_SANITIZE={os.environ['UCCL_SANITIZE']}: expected address, "
                     "undefined, address,undefined or thread (thread alone)")
SAN_FLAGS = ([f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer", "-g", "-O1"]
             if SANITIZE else [])

try:
    from wheel.bdist_wheel import bdist_wheel as _bdist_wheel

    class bdist_wheel(_bdist_wheel):
        # One abi3 wheel serves CPython 3.10 and newer.
        def get_tag(self):
            python, abi, plat = super().get_tag()
            if python.startswith("cp"):
                return "cp310", "abi3", plat
            return python, abi, plat

    cmdclass = {"bdist_wheel": bdist_wheel}
except ImportError:  # wheel not installed: in-place builds still work
    cmdclass = {}


class build_ext(_build_ext):
    """Rebuilds everything when the sanitizers asked for differ from the last
    build's (a stale sanitized module would need its runtime preloaded)."""

    def run(self):
        stamp = pathlib.Path(self.build_temp) / "uccl-sanitize"
        if not stamp.exists() or stamp.read_text() != SANITIZE:
            self.force = True
        super().run()
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(SANITIZE)


cmdclass["build_ext"] = build_ext

engine = Extension(
    "uccl_collective._engine",
    sources=sorted(glob.glob("csrc/*/*.c")),
    include_dirs=["csrc"],
    define_macros=[("Py_LIMITED_API", "0x030A0000")],
    py_limited_api=True,
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration",
                        "-fvisibility=hidden", *SAN_FLAGS],
    extra_link_args=SAN_FLAGS,
    libraries=["pthread", "dl"],
)

setup(ext_modules=[engine], cmdclass=cmdclass)
