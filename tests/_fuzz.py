"""The fuzz harnesses (tests/fuzz/): built here, run by tests/test_fuzz.py,
never installed.

Two builds of each harness:
  - ``replay``: any C compiler (``$CC``, else gcc) with ASan and UBSan where
    it has them, and tests/fuzz/replay.c as main(): plays back files (the
    seed corpus and the crash inputs kept as regression inputs);
  - ``fuzz``: clang with libFuzzer (-fsanitize=fuzzer,address,undefined),
    where clang and its fuzzer runtime are installed.
Each links the engine's C sources but the Python module's (csrc/py/),
compiled once per build into an archive under tests/fuzz/build/<build>/
(again when a source is newer)."""
from __future__ import annotations

import concurrent.futures
import functools
import os
import pathlib
import shutil
import subprocess
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
FUZZ = HERE / "fuzz"
ROOT = HERE.parent
CSRC = ROOT / "csrc"
BUILD = FUZZ / "build"
CORPUS = FUZZ / "corpus"
CRASHES = FUZZ / "crashes"
#: every harness: tests/fuzz/fuzz_<name>.c, its seeds in corpus/<name>/
HARNESSES = ["hello", "msg", "chunk", "fifo", "meta", "sg_round", "sg_p2p"]

SAN = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
COMMON = ["-std=c11", "-g", "-O1", "-Wall", "-Wextra", f"-I{CSRC}", f"-I{FUZZ}"]
#: what the sanitizers do at run time: stop at the first report, leaks included
ENV = {"ASAN_OPTIONS": "abort_on_error=0:detect_leaks=1:allocator_may_return_null=1",
       "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}


def _engine_sources() -> list[pathlib.Path]:
    return [p for p in sorted(CSRC.glob("*/*.c")) if p.parent.name != "py"]


def _headers() -> list[pathlib.Path]:
    return sorted(CSRC.glob("*/*.h")) + sorted(FUZZ.glob("*.h"))


def _stale(out: pathlib.Path, srcs) -> bool:
    if not out.exists():
        return True
    t = out.stat().st_mtime
    return any(s.stat().st_mtime > t for s in srcs)


def _works(cc: str, flags: list[str], src: str) -> bool:
    """Does `cc flags` build and run this program?"""
    with tempfile.TemporaryDirectory() as d:
        c, exe = pathlib.Path(d) / "t.c", pathlib.Path(d) / "t"
        c.write_text(src)
        try:
            if subprocess.run([cc, *flags, str(c), "-o", str(exe)], capture_output=True,
                              timeout=120).returncode:
                return False
            return subprocess.run([str(exe), "-runs=1"], capture_output=True, timeout=60,
                                  env={**os.environ, **ENV}).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False


@functools.lru_cache(None)
def replay_cc() -> tuple[str, list[str]]:
    """The compiler of the replay build and its sanitizer flags (none where
    it has no ASan runtime: the corpus still runs, unchecked for overreads)."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or "cc"
    main = "int main(void) { return 0; }\n"
    return cc, SAN if _works(cc, SAN, main) else []


@functools.lru_cache(None)
def libfuzzer() -> str | None:
    """clang, where it has libFuzzer with ASan and UBSan; else None."""
    clang = os.environ.get("FUZZ_CLANG") or shutil.which("clang")
    if not clang:
        return None
    src = ("#include <stddef.h>\n#include <stdint.h>\n"
           "int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n")
    return clang if _works(clang, ["-fsanitize=fuzzer", *SAN], src) else None


def why_no_libfuzzer() -> str:
    if not (os.environ.get("FUZZ_CLANG") or shutil.which("clang")):
        return "clang is not installed (Debian: apt-get install clang), so no fuzzing; the corpus replays"
    return "clang cannot build a libFuzzer program with ASan and UBSan (Debian: libclang-rt-<version>-dev)"


def _archive(build: str, cc: str, flags: list[str]) -> pathlib.Path:
    """The engine (but csrc/py/) compiled for one build, as an archive."""
    out = BUILD / build / "libengine.a"
    srcs = _engine_sources()
    if not _stale(out, srcs + _headers()):
        return out
    obj = BUILD / build / "obj"
    obj.mkdir(parents=True, exist_ok=True)

    def compile_one(src: pathlib.Path) -> pathlib.Path:
        o = obj / (src.parent.name + "_" + src.stem + ".o")
        subprocess.run([cc, *COMMON, *flags, "-c", str(src), "-o", str(o)], check=True,
                       timeout=300, capture_output=True)
        return o

    with concurrent.futures.ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as ex:
        objs = list(ex.map(compile_one, srcs))
    tmp = out.with_name(f"libengine.a.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    subprocess.run(["ar", "rcs", str(tmp), *map(str, objs)], check=True, timeout=120)
    os.replace(tmp, out)
    return out


def build(name: str, mode: str) -> pathlib.Path:
    """Harness `name` built for `mode` ("replay" or "fuzz"), rebuilt when stale."""
    if mode == "fuzz":
        cc = libfuzzer()
        if not cc:
            raise RuntimeError(why_no_libfuzzer())
        eng_flags, link = ["-fsanitize=fuzzer-no-link", *SAN], ["-fsanitize=fuzzer", *SAN]
        extra: list[pathlib.Path] = []
    else:
        cc, san = replay_cc()
        eng_flags = link = san
        extra = [FUZZ / "replay.c"]
    lib = _archive(mode, cc, eng_flags)
    src = FUZZ / f"fuzz_{name}.c"
    exe = BUILD / mode / name
    if _stale(exe, [src, lib, *extra, *_headers()]):
        tmp = exe.with_name(f"{name}.{os.getpid()}")
        subprocess.run([cc, *COMMON, *link, str(src), *map(str, extra), str(lib), "-o", str(tmp),
                        "-lpthread", "-ldl"], check=True, timeout=300, capture_output=True)
        os.replace(tmp, exe)
    return exe


def inputs(name: str) -> list[pathlib.Path]:
    """The folders of inputs a harness replays: its seeds, and the crash
    inputs kept as regression inputs (where there are any)."""
    return [d for d in (CORPUS / name, CRASHES / name) if d.is_dir()]


def seeds() -> None:
    """Write the seed corpus again (tests/fuzz/seeds.c), e.g. after a
    record's layout changed; the files are kept in the repository."""
    cc, _ = replay_cc()
    lib = _archive("plain", cc, [])
    exe = BUILD / "seeds"
    subprocess.run([cc, *COMMON, str(FUZZ / "seeds.c"), str(lib), "-o", str(exe), "-lpthread",
                    "-ldl"], check=True, timeout=300)
    subprocess.run([str(exe), str(CORPUS)], check=True, timeout=300)
