"""Setup is bounded by the group's timeout, not the store's: a rank that
never arrives (killed during init_process_group, say) makes the others raise
UcclTimeoutError naming it once the group's timeout has passed.  The store's
own timeout here is 60 s and the group's a few seconds, so a setup that
waited on the store alone would fail these tests by their elapsed time."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from uccl_collective import UcclTimeoutError, collective

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUP_TIMEOUT = 2.0


@pytest.mark.parametrize("secret", [None, "s3cret"], ids=["job-secret", "given-secret"])
def test_a_rank_that_never_comes_fails_the_others_within_the_timeout(monkeypatch, secret):
    # without UCCL_P2P_SECRET the ranks wait for rank 0's per-job secret; with
    # it, for every rank's address: either wait is bounded
    if secret:
        monkeypatch.setenv("UCCL_P2P_SECRET", secret)
    else:
        monkeypatch.delenv("UCCL_P2P_SECRET", raising=False)
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=60))
    res: dict[int, tuple] = {}

    def rank(r: int) -> None:
        t0 = time.monotonic()
        try:
            # (one key prefix for the ranks, which are threads of one process here)
            collective.CollectiveContext(use_copy_engine_for_intra=True, store=store, rank=r,
                                         world_size=3, timeout_s=GROUP_TIMEOUT,
                                         key_prefix="setup/").init()
            res[r] = ("returned", time.monotonic() - t0)
        except BaseException as e:   # noqa: BLE001 - reported below
            res[r] = (e, time.monotonic() - t0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(res) == [1, 2], res
    for r, (err, elapsed) in res.items():
        assert isinstance(err, UcclTimeoutError), (r, err)
        assert "rank(s) [0] never published" in str(err), str(err)
        assert f"rank {r} of 3" in str(err), str(err)
        assert GROUP_TIMEOUT - 0.5 <= elapsed < GROUP_TIMEOUT + 5, (r, elapsed)


_RANK = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    import uccl_collective
    rank, port, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=timedelta(seconds=60))
    t0 = time.monotonic()
    try:
        dist.init_process_group("uccl", store=store, rank=rank, world_size=3,
                                timeout=timedelta(seconds=timeout))
        print("RESULT returned", time.monotonic() - t0)
    except Exception as e:
        print("RESULT", type(e).__name__, time.monotonic() - t0, str(e).replace("\\n", " "))
""")


def test_init_process_group_is_bounded_by_its_timeout():
    # rank 0 never calls init_process_group (as if killed 4 ms into it); the
    # parent hosts the store so that it outlives every rank
    store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(store.port),
                               str(GROUP_TIMEOUT)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (1, 2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        assert line is not None, err[-3000:]
        kind, elapsed, *msg = line.split(" ", 3)[1:]
        assert kind == "UcclTimeoutError", line
        # the group's timeout, plus the import and the store's connect
        assert float(elapsed) < GROUP_TIMEOUT + 10, line
        assert "rank(s) [0] never published" in line, line
