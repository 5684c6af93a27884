"""The group's ``monitored_barrier``, as Gloo's: rank 0 waits for every
other rank to arrive, within the timeout, then releases them; a rank that
does not arrive is named ("[Rank 0]: Rank 1 failed to pass monitoredBarrier
in 2000 ms"); with ``wait_all_ranks`` every rank gets the whole timeout and
every late rank is named; rank 0 that has no time left before it has heard
from everyone says so ("Rank 0 timed out in monitoredBarrier after 0 ms").

(torch's ``dist.monitored_barrier`` accepts Gloo groups only; this is the
group's own method, ``pg.monitored_barrier(timeout, wait_all_ranks)``.)
"""
from __future__ import annotations

import datetime
import time
from typing import Any

import torch

from ..p2p import UcclTimeoutError


def timeout_s(timeout: Any, group_timeout_s: float) -> float:
    """The barrier's timeout in seconds: the group's when none is given
    (None, or a negative one: torch's "unset"); 0 is a real timeout of 0,
    which fails at once unless everyone has already arrived."""
    if timeout is None:
        return group_timeout_s
    secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return group_timeout_s if secs < 0 else secs


def run(ctx: Any, rank: int, size: int, secs: float, wait_all_ranks: bool) -> None:
    """One monitored barrier over ctx's connections (a task of the group:
    every rank runs it in the same place of its order)."""
    if size == 1:
        return
    deadline = time.monotonic() + secs
    ms = int(round(secs * 1000))
    token = torch.zeros(1, dtype=torch.uint8)
    if rank != 0:
        ctx._p2p([("send", token, 0)], "monitored_barrier", blocking=True)
        h = ctx._p2p([("recv", torch.empty(1, dtype=torch.uint8), 0)], "monitored_barrier")
        try:
            h.wait(max(deadline - time.monotonic(), 1e-3))
        except UcclTimeoutError:   # Gloo's words
            raise UcclTimeoutError(f"Rank {rank} successfully reached monitoredBarrier, but "
                                   "received errors while waiting for send/recv from rank 0. "
                                   "Please check rank 0 logs for faulty rank. (Not released "
                                   f"within {ms} ms.)") from None
        return
    handles = {r: ctx._p2p([("recv", torch.empty(1, dtype=torch.uint8), r)], "monitored_barrier")
               for r in range(1, size)}
    processed, late = [], []
    for r, h in handles.items():
        # as Gloo: with wait_all_ranks each rank gets the whole timeout;
        # otherwise what is left of it, and none left is rank 0's own timeout
        left = secs if wait_all_ranks else deadline - time.monotonic()
        if left < 0:
            done = (f"Successfully processed ranks: {', '.join(map(str, processed))}"
                    if processed else "No ranks successfully processed in monitoredBarrier.")
            raise UcclTimeoutError(f"Rank 0 timed out in monitoredBarrier after {ms} ms.\n{done}")
        try:
            h.wait(max(left, 1e-3))
            processed.append(r)
        except UcclTimeoutError:
            late.append(r)
            if not wait_all_ranks:
                break
    if late:
        who = f"Rank {late[0]}" if len(late) == 1 else \
            "Ranks " + ", ".join(str(r) for r in late)
        raise UcclTimeoutError(f"[Rank 0]: {who} failed to pass monitoredBarrier in {ms} ms")
    ctx._p2p([("send", token, r) for r in range(1, size)], "monitored_barrier", blocking=True)
