"""`init_process_group("uccl")` without `import uccl_collective`: torch's
out-of-tree backend autoload (the "torch.backends" entry point,
uccl_collective_autoload.py).  Each case runs in a fresh interpreter, in an
empty folder, so that nothing of this suite is imported already."""
import importlib.metadata
import json
import logging
import os
import subprocess
import sys

import pytest

import uccl_collective_autoload

#: two ranks, each a fresh `import torch` and nothing of ours: all_reduce
#: random integers, then report what was loaded when
RANK = r"""
import json, sys
import numpy as np
import torch
import torch.distributed as dist
rank, path = int(sys.argv[1]), sys.argv[2]
out = {"after_import_torch": sorted(m for m in sys.modules if m.startswith("uccl_collective")),
       "registered": "uccl" in dist.Backend.backend_list}
dist.init_process_group("uccl", store=dist.FileStore(path, 2), rank=rank, world_size=2)
xs = [torch.from_numpy(np.random.default_rng(7 + r).integers(-2**40, 2**40, 1001)) for r in range(2)]
t = xs[rank].clone()
dist.all_reduce(t)
out["sum_ok"] = bool(torch.equal(t, xs[0] + xs[1]))
out["backend"] = str(dist.get_backend())
out["engine_loaded"] = "uccl_collective._engine" in sys.modules
dist.destroy_process_group()
print(json.dumps(out))
"""


def _entry_point():
    eps = [e for e in importlib.metadata.entry_points(group="torch.backends") if e.name == "uccl"]
    return eps[0] if eps else None


needs_install = pytest.mark.skipif(
    _entry_point() is None,
    reason="the package is not installed (no \"torch.backends\" entry point named uccl): "
           "pip install -e . registers it")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, **extra}


@needs_install
def test_the_entry_point_names_the_autoload_module():
    assert _entry_point().value == "uccl_collective_autoload:register"


@needs_install
def test_init_process_group_uccl_without_importing_the_package(tmp_path):
    store = tmp_path / "store"
    ps = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(store)], cwd=tmp_path,
                           env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for r in range(2)]
    outs = []
    for p in ps:
        try:
            o, e = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in ps:
                q.kill()
            raise
        assert p.returncode == 0, e[-3000:]
        outs.append(json.loads(o.strip().splitlines()[-1]))
    for r, out in enumerate(outs):
        # `import torch` registered the backend and loaded nothing of ours
        # but the autoload module (no package, no engine)
        assert out["registered"] is True, (r, out)
        assert out["after_import_torch"] == ["uccl_collective_autoload"], (r, out)
        assert out["sum_ok"] is True, (r, out)
        assert out["backend"] == "uccl", (r, out)
        assert out["engine_loaded"] is True, (r, out)


@needs_install
def test_autoload_off_leaves_uccl_unregistered(tmp_path):
    code = ("import sys, torch, torch.distributed as dist; "
            "print('uccl' in dist.Backend.backend_list, "
            "sorted(m for m in sys.modules if m.startswith('uccl_collective')))")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env=_env(TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "False []", p.stdout


def test_a_failing_registration_does_not_raise(monkeypatch, caplog):
    """torch turns an exception of an entry point into an ImportError of
    torch itself: register() logs and returns instead."""
    import torch.distributed as dist

    def refuse(*a, **k):
        raise ValueError("refused by the test")
    monkeypatch.setattr(dist.Backend, "backend_list", [b for b in dist.Backend.backend_list
                                                      if b != "uccl"])
    monkeypatch.setattr(dist.Backend, "register_backend", refuse)
    with caplog.at_level(logging.DEBUG, logger="uccl_collective"):
        assert uccl_collective_autoload.register() is None
    assert "ValueError: refused by the test" in caplog.text, caplog.text


def test_registering_twice_keeps_the_first():
    """`import uccl_collective` after the autoload (or the autoload of a
    second interpreter state) leaves one registration."""
    import torch.distributed as dist
    import uccl_collective  # noqa: F401 - registers, as a user's import does
    before = dist.Backend._plugins["UCCL"]
    uccl_collective_autoload.register()
    assert dist.Backend._plugins["UCCL"] is before
