"""The README's three examples run as printed and print what it shows: the
torch.distributed backend and CollectiveContext under torchrun (2 ranks),
and the two-process Endpoint transfer whose metadata travels through a
file.  Each example is cut out of README.md by its first line
("# name.py: how to run it"), so the page and the test cannot drift."""
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _example(name: str) -> str:
    m = re.search(rf"```python\n(# {re.escape(name)}:.*?)```", README, re.S)
    assert m, f"README.md has no example {name}"
    return m.group(1)


def _printed_after(name: str) -> list[str]:
    """The lines of the first plain code block after example `name`."""
    start = README.index(f"# {name}:")
    m = re.search(r"\n```\n(.*?)```", README[start + README[start:].index("```") + 3:], re.S)
    return m.group(1).strip().splitlines()


def _same(lines: list[str]) -> list[str]:
    """Lines with what depends on the machine made alike: the address and
    port, and the same-host data path (CMA where the kernel lets processes
    read each other, else the shared-memory ring)."""
    out = [re.sub(r"'[0-9.]+', \d+|from [0-9.]+", "ADDR", x) for x in lines]
    return sorted(re.sub(r"shm-(cma|ring)", "shm", x) for x in out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


@pytest.mark.parametrize("name", ["backend_example.py", "collective_example.py"])
def test_torchrun_example(tmp_path, name):
    (tmp_path / name).write_text(_example(name))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), name],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # the two ranks write to one pipe: a line of one may land inside the other's
    got = [m.strip() for m in re.findall(r"rank \d+: .*?(?=rank \d+: |\n|$)", p.stdout)]
    assert _same(got) == _same(_printed_after(name)), p.stdout


def test_p2p_example(tmp_path):
    src = _example("p2p_example.py")
    meta = tmp_path / "uccl_example.meta"   # this run's own file, not the README's /tmp one
    assert '"/tmp/uccl_example.meta"' in src
    (tmp_path / "p2p_example.py").write_text(src.replace('"/tmp/uccl_example.meta"', repr(str(meta))))
    env = _env()
    recv = subprocess.Popen([sys.executable, "p2p_example.py", "recv"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    send = subprocess.run([sys.executable, "p2p_example.py", "send"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    out, err = recv.communicate(timeout=120)
    assert send.returncode == 0 and recv.returncode == 0, send.stderr[-3000:] + err[-3000:]
    got = send.stdout.splitlines() + out.splitlines()
    want = _printed_after("p2p_example.py")
    assert len(got) == len(want) == 3, (got, want)
    assert _same(got) == _same(want), (got, want)
    assert not meta.exists()
