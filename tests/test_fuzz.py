"""The decoders of what a peer sends, fuzzed (tests/fuzz/, docs/testing.md):
the handshake record, control messages, data chunk headers, one-sided
descriptors and the target's check of a request against its windows,
endpoint metadata, and a stream-ordered group's peers' slots in the shared
page (its rounds and its point-to-point messages).

Always: every harness replays its seed corpus and the crash inputs kept as
regression inputs (tests/fuzz/crashes/<harness>/), under ASan and UBSan
where the C compiler has them.  Where clang has libFuzzer: every harness
is fuzzed for FUZZ_SECONDS from its corpus; a crash fails the test and
names the input to keep."""
import os
import pathlib
import re
import shutil
import subprocess

import pytest

import _fuzz

FUZZ_SECONDS = 20


def _run(cmd, timeout, **kw):
    env = {**os.environ, **_fuzz.ENV}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)


@pytest.mark.parametrize("name", _fuzz.HARNESSES)
def test_corpus_and_kept_crashes_replay(name):
    exe = _fuzz.build(name, "replay")
    dirs = _fuzz.inputs(name)
    n = sum(len([f for f in d.iterdir() if not f.name.startswith(".")]) for d in dirs)
    assert n >= 5, f"{name}: only {n} seed inputs in {dirs}"
    p = _run([str(exe), *map(str, dirs)], timeout=300)
    assert p.returncode == 0, f"{name}: an input failed (the last one named):\n{p.stderr[-6000:]}"
    assert f"replay: {n} inputs ran" in p.stdout, p.stdout


def test_the_replay_catches_an_overread(tmp_path):
    """The replay build's sanitizer is live: a harness that reads one byte
    past its input fails, naming the overflow."""
    cc, san = _fuzz.replay_cc()
    if not san:
        pytest.skip(f"{cc} has no ASan runtime here: the corpus replays unchecked for overreads")
    src = tmp_path / "overread.c"
    src.write_text('#include "fuzz.h"\n'
                   "int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n)\n"
                   "{ return n > 2 && d[0] == 'X' ? d[n] : 0; }\n")
    exe = tmp_path / "overread"
    subprocess.run([cc, *_fuzz.COMMON, *san, str(src), str(_fuzz.FUZZ / "replay.c"), "-o",
                    str(exe)], check=True, timeout=120)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "fine").write_bytes(b"abc")
    assert _run([str(exe), str(tmp_path / "in")], timeout=60).returncode == 0
    (tmp_path / "in" / "bad").write_bytes(b"Xbc")
    p = _run([str(exe), str(tmp_path / "in")], timeout=60)
    assert p.returncode != 0 and "heap-buffer-overflow" in p.stderr, p.stderr[-3000:]


def _libfuzzer_or_skip():
    if not _fuzz.libfuzzer():
        pytest.skip(_fuzz.why_no_libfuzzer())


@pytest.mark.parametrize("name", _fuzz.HARNESSES)
def test_fuzz(name, tmp_path):
    """FUZZ_SECONDS of libFuzzer from the seed corpus; new inputs go to a
    scratch folder (the repository's corpus stays as it is)."""
    _libfuzzer_or_skip()
    exe = _fuzz.build(name, "fuzz")
    work = tmp_path / "corpus"
    work.mkdir()
    p = _run([str(exe), f"-max_total_time={FUZZ_SECONDS}", "-timeout=10", "-rss_limit_mb=2048",
              "-max_len=8192", f"-artifact_prefix={tmp_path}/", "-print_final_stats=1",
              str(work), *map(str, _fuzz.inputs(name))], timeout=FUZZ_SECONDS + 240)
    found = sorted(f.name for f in tmp_path.iterdir()
                   if f.name.startswith(("crash-", "leak-", "timeout-", "oom-")))
    keep = _fuzz.CRASHES / name
    assert p.returncode == 0 and not found, (
        f"{name}: libFuzzer found {found or 'a failure'} in {tmp_path}; fix it, then keep the "
        f"input as a regression input in {keep}/\n{p.stderr[-6000:]}")
    assert "Done" in p.stderr and "stat::number_of_executed_units" in p.stderr, p.stderr[-2000:]
    stats = dict(re.findall(r"^stat::(\w+):\s+(\d+)", p.stderr, re.M))
    # shown by pytest -rP (the figures docs/testing.md quotes)
    print(f"fuzz {name}: {stats['number_of_executed_units']} inputs in {FUZZ_SECONDS} s, "
          f"{stats.get('new_units_added', '?')} new, peak {stats.get('peak_rss_mb', '?')} MB")


def test_the_fuzzer_catches_a_planted_bug(tmp_path):
    """The libFuzzer build reports a bug and keeps its input: a harness that
    reads past its input on a seed that reaches it fails at once."""
    _libfuzzer_or_skip()
    clang = _fuzz.libfuzzer()
    src = tmp_path / "planted.c"
    src.write_text('#include "fuzz.h"\n'
                   "int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n)\n"
                   "{ return n == 4 && !memcmp(d, \"UCCL\", 4) ? d[n] : 0; }\n")
    exe = tmp_path / "planted"
    subprocess.run([clang, *_fuzz.COMMON, "-fsanitize=fuzzer", *_fuzz.SAN, str(src), "-o",
                    str(exe)], check=True, timeout=120)
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    (seeds / "magic").write_bytes(b"UCCL")
    p = _run([str(exe), "-max_total_time=20", f"-artifact_prefix={tmp_path}/", str(seeds)],
             timeout=120)
    assert p.returncode != 0 and "heap-buffer-overflow" in p.stderr, p.stderr[-3000:]
    assert any(f.name.startswith("crash-") for f in tmp_path.iterdir())


def test_every_decoder_has_a_harness_and_seeds():
    """The harnesses named here are the files there, each with a corpus."""
    files = sorted(p.stem[len("fuzz_"):] for p in _fuzz.FUZZ.glob("fuzz_*.c"))
    assert files == sorted(_fuzz.HARNESSES)
    for name in _fuzz.HARNESSES:
        assert (_fuzz.CORPUS / name).is_dir(), name
    kept = [d.name for d in _fuzz.CRASHES.iterdir()] if _fuzz.CRASHES.is_dir() else []
    assert set(kept) <= set(_fuzz.HARNESSES), kept
    assert shutil.which("ar"), "binutils' ar builds the engine's archive"
    assert pathlib.Path(_fuzz.FUZZ / "replay.c").exists()
