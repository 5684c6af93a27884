"""One configuration table (csrc/base/config.h): every UCCL_* variable is
declared there once, read by one parser from C and from Python, with the
same syntax per kind everywhere; a bad value raises naming the variable and
the value; nothing reads a variable the table does not declare; and
docs/environment.md's table is the table."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

from uccl_collective import _engine
from uccl_collective.core import config
from uccl_collective.p2p import Endpoint

ROOT = pathlib.Path(__file__).resolve().parent.parent
TABLE = {name: kind for name, kind, _, _ in config.table()}
# for the C files: the table's names without their UCCL_ prefix
CFG_IDS = {name[len("UCCL_"):] for name in TABLE}


def _strip_c(src: str) -> str:
    return re.sub(r"/\*.*?\*/", " ", src, flags=re.S)


def test_the_table_is_whole():
    assert len(TABLE) == len(config.table()) >= 38, "a name declared twice"
    for name, kind, default, meaning in config.table():
        assert name.startswith("UCCL_") and kind in {"int", "size", "bool", "choice", "str"}
        assert default and meaning, name
        assert "|" not in meaning + default, f"{name}: a '|' breaks the docs' table"


@pytest.mark.parametrize("text,nbytes", [
    ("64K", 64 << 10), ("1m", 1 << 20), (" 2M ", 2 << 20), ("1MiB", 1 << 20), ("3KB", 3 << 10),
    ("4096", 4096), ("0", 0), ("64M", 64 << 20)])
def test_sizes_in_bytes(text, nbytes):
    assert _engine.config("UCCL_SG_EAGER_BYTES", text) == nbytes


@pytest.mark.parametrize("text,nbytes", [("1024", 1 << 20), ("1M", 1 << 20), ("4", 4 << 10),
                                         ("8192K", 8 << 20)])
def test_plain_digits_count_kib_in_a_kb_variable(text, nbytes):
    assert _engine.config("UCCL_P2P_TCP_CHUNK_KB", text) == nbytes


def test_every_size_variable_takes_the_same_syntax():
    # the issue this table closed: UCCL_SG_EAGER_BYTES=1M worked and
    # UCCL_SG_KERNEL_COPY_BYTES=1M did not
    sizes = [n for n, k in TABLE.items() if k == "size"]
    assert len(sizes) >= 10
    for name in sizes:
        for text in ("1M", "1m", "1MiB", " 1M"):
            try:
                assert _engine.config(name, text) == 1 << 20, (name, text)
            except ValueError as e:   # only where 1 MiB is outside the variable's range
                assert f"{name}={text.strip()}: expected a size in" in str(e) or \
                    f"{name}={text}: expected a size in" in str(e)


@pytest.mark.parametrize("name,text,why", [
    ("UCCL_SG_EAGER_BYTES", "1.5M", "expected a size in 0..64M"),
    ("UCCL_SG_EAGER_BYTES", "65M", "expected a size in 0..64M"),
    ("UCCL_SG_EAGER_BYTES", "-1", "expected a size in 0..64M"),
    ("UCCL_SG_EAGER_BYTES", "1T", "expected a size in 0..64M"),
    ("UCCL_SG_KERNEL_COPY_BYTES", "lots", "expected a size in 0..1024G"),
    ("UCCL_P2P_TCP_CHUNK_KB", "1", "expected a size in 4K..64M"),
    ("UCCL_P2P_TIMEOUT_S", "1.5", "expected an integer in 1..604800"),
    ("UCCL_P2P_TIMEOUT_S", "0", "expected an integer in 1..604800"),
    ("UCCL_P2P_TCP_STREAMS", "17", "expected an integer in 1..16"),
    ("UCCL_P2P_RDMA_GID_INDEX", "-2", "expected an integer in -1..1023"),
    ("UCCL_STREAM_ORDERED", "maybe", "expected 0 or 1"),
    ("UCCL_P2P_TRANSPORT", "udp", "expected one of auto|tcp|shm|ipc|rdma"),
    ("UCCL_PG_ALGO", "tree", "expected one of auto|ring|direct"),
])
def test_a_bad_value_names_the_variable_and_the_value(name, text, why):
    with pytest.raises(ValueError, match=re.escape(f"{name}={text}: {why}")):
        _engine.config(name, text)


@pytest.mark.parametrize("text,value", [("0", False), ("1", True), ("yes", True), ("OFF", False),
                                        ("true", True), ("", True)])
def test_bools(text, value):
    assert _engine.config("UCCL_STREAM_ORDERED", text) is value


def test_choices_any_case_and_text(monkeypatch):
    assert _engine.config("UCCL_P2P_TRANSPORT", "SHM") == "shm"
    assert _engine.config("UCCL_P2P_LOG_LEVEL", "warn") == "WARN"
    monkeypatch.delenv("UCCL_P2P_SECRET", raising=False)
    assert config.get("UCCL_P2P_SECRET") is None and not config.is_set("UCCL_P2P_SECRET")
    monkeypatch.setenv("UCCL_P2P_SECRET", "s3cret")
    assert config.get("UCCL_P2P_SECRET") == "s3cret" and config.is_set("UCCL_P2P_SECRET")
    with pytest.raises(KeyError, match="UCCL_NO_SUCH"):
        config.get("UCCL_NO_SUCH")


def test_the_environment_is_read_by_the_same_parser(monkeypatch):
    monkeypatch.setenv("UCCL_SG_EAGER_BYTES", "96k")
    monkeypatch.setenv("UCCL_STREAM_ORDERED", "no")
    from uccl_collective.core import stream_group
    assert stream_group.eager_bytes() == 96 << 10 and stream_group.enabled() is False
    monkeypatch.setenv("UCCL_SG_EAGER_BYTES", "   ")   # blanks: unset
    assert stream_group.eager_bytes() == 256 << 10


# Every variable endpoint creation reads: a bad value makes Endpoint() raise
# ValueError naming it (the C side of the one parser).
@pytest.mark.parametrize("name,text", [
    ("UCCL_P2P_TIMEOUT_S", "soon"), ("UCCL_P2P_SPIN_US", "-5"), ("UCCL_P2P_TCP_STREAMS", "0"),
    ("UCCL_P2P_TCP_CHUNK_KB", "2G"), ("UCCL_P2P_BASE_PORT", "70000"),
    ("UCCL_P2P_DONE_IDS", "8"), ("UCCL_P2P_CUDA_STREAMS", "9"), ("UCCL_P2P_TRANSPORT", "udp"),
    ("UCCL_P2P_SHM_MODE", "pipe"), ("UCCL_P2P_LOG_LEVEL", "LOUD")])
def test_endpoint_creation_raises_on_a_bad_value(monkeypatch, name, text):
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=re.escape(f"{name}={text}: expected")):
        Endpoint(port=0, timeout_s=5)


@pytest.mark.parametrize("name,text", [("UCCL_PG_SMALL_KB", "big"), ("UCCL_PG_ALGO", "tree"),
                                       ("UCCL_PG_GPU_SMALL_KB", "1.5")])
def test_the_backend_raises_on_a_bad_value_at_import(name, text):
    env = dict(os.environ, **{name: text})
    p = subprocess.run([sys.executable, "-c", "import uccl_collective"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert f"ValueError: {name}={text}: expected" in p.stderr, p.stderr[-2000:]


def test_only_the_table_reads_the_environment_in_c():
    for p in sorted((ROOT / "csrc").glob("*/*.c")):
        if p.relative_to(ROOT / "csrc").as_posix() == "base/config.c":
            continue
        src = _strip_c(p.read_text())
        assert "getenv" not in src, f"{p.name} reads the environment outside base/config.c"
        for ident in re.findall(r"\bUCCL_CFG_([A-Z0-9_]+)\b", src):
            assert ident in CFG_IDS or ident in {"INT", "SIZE", "BOOL", "CHOICE", "STR",
                                                 "COUNT"}, (p.name, ident)


def test_only_the_config_module_reads_uccl_variables_in_python():
    for p in sorted((ROOT / "uccl_collective").rglob("*.py")):
        if p.relative_to(ROOT).as_posix() == "uccl_collective/core/config.py":
            continue
        src = p.read_text()
        assert not re.search(r"os\.(environ|getenv)\b[^\n]*UCCL_", src), \
            f"{p} reads a UCCL_ variable from os.environ: use core.config"
        for name in re.findall(r"config\.(?:get|is_set)\(\"([A-Z0-9_]+)\"\)", src):
            assert name in TABLE, f"{p}: {name} is not in the table"


def test_every_variable_of_the_table_is_read_somewhere():
    c = "".join(_strip_c(p.read_text()) for p in (ROOT / "csrc").glob("*/*.c")
                if p.name != "config.c")
    py = "".join(p.read_text() for p in (ROOT / "uccl_collective").rglob("*.py"))
    for name in TABLE:
        short = name[len("UCCL_"):]
        assert re.search(rf"\bUCCL_CFG_{short}\b", c) or f'"{name}"' in py, \
            f"{name} is declared but nothing reads it"


def test_docs_table_is_the_table():
    page = (ROOT / "docs" / "environment.md").read_text()
    start, end = page.index(config.BEGIN), page.index(config.END) + len(config.END) + 1
    assert page[start:end] == config.markdown(), \
        "docs/environment.md differs from csrc/base/config.h: run python3 docs/gen_environment.py"
