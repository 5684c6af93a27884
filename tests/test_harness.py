"""The harness itself: a rank's exception and a hung rank both fail the test
within the bound, so no test of this suite can hang or pass by accident."""
from __future__ import annotations

import time

import pytest

from _harness import Pair, poisoned, rand_bytes, run_one, run_pair, sha, all_poison


def _raise(ch):
    raise RuntimeError("boom from the rank")


def _hang(ch):
    time.sleep(600)


def _echo(ch, x):
    ch.send("x", x)
    return ch.recv("y")


def _reply(ch):
    return ch.send("y", ch.recv("x") * 2)


def test_rank_exception_fails_the_test():
    """An exception inside a rank fails the test and carries its message."""
    with pytest.raises(pytest.fail.Exception, match="boom from the rank"):
        run_one(_raise, timeout=20)


def test_hung_rank_is_killed_within_bound():
    """A rank that never finishes is killed and the test fails after the
    given timeout, not later."""
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="hung"):
        with Pair(_hang, _hang) as p:
            p.result("server", timeout=1.5)
    assert time.monotonic() - t0 < 15
    assert not any(pr.is_alive() for pr in p.procs.values())


def test_messages_round_trip():
    """Values travel between the two ranks and back to the parent."""
    assert run_pair(_reply, _echo, client_kwargs={"x": 21}, timeout=30) == (None, 42)


def test_data_helpers():
    """rand_bytes is reproducible per seed and differs across seeds; poisoned
    buffers are all POISON until written."""
    assert sha(rand_bytes(4097, 1)) == sha(rand_bytes(4097, 1)) != sha(rand_bytes(4097, 2))
    b = poisoned(10)
    assert all_poison(b) and b.nbytes == 10 + 4096
    b[3] = 0
    assert not all_poison(b)
