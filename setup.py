"""Builds the C engine as uccl_collective._engine (C11, stable ABI).

Links only libc, libpthread and libdl: CUDA and libibverbs are loaded at run
time by the transports that need them, so the module imports anywhere.
"""
import glob

from setuptools import Extension, setup

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

engine = Extension(
    "uccl_collective._engine",
    sources=sorted(glob.glob("csrc/*/*.c")),
    include_dirs=["csrc"],
    define_macros=[("Py_LIMITED_API", "0x030A0000")],
    py_limited_api=True,
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration",
                        "-fvisibility=hidden"],
    libraries=["pthread", "dl"],
)

setup(ext_modules=[engine], cmdclass=cmdclass)
