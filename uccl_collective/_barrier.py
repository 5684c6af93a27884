"""The group's ``monitored_barrier``, as Gloo's: rank 0 waits for every
other rank to arrive, within the timeout, then releases them; a rank that
does not arrive is named ("Rank 1 failed to pass monitoredBarrier in
2000 ms"); with ``wait_all_ranks`` every late rank is named.

(torch's ``dist.monitored_barrier`` accepts Gloo groups only; this is the
group's own method, ``pg.monitored_barrier(timeout, wait_all_ranks)``.)
"""
from __future__ import annotations

import datetime
import time
from typing import Any

import torch

from .p2p import UcclTimeoutError


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
        except UcclTimeoutError:
            raise UcclTimeoutError(f"Rank {rank} was not released by rank 0 within the "
                                   f"monitoredBarrier timeout ({ms} ms): rank 0 failed or "
                                   "another rank did not arrive") from None
        return
    handles = {r: ctx._p2p([("recv", torch.empty(1, dtype=torch.uint8), r)], "monitored_barrier")
               for r in range(1, size)}
    late = []
    for r, h in handles.items():
        try:
            h.wait(max(deadline - time.monotonic(), 1e-3))
        except UcclTimeoutError:
            late.append(r)
            if not wait_all_ranks:
                break
    if late:
        who = f"Rank {late[0]}" if len(late) == 1 else \
            "Ranks " + ", ".join(str(r) for r in late)
        raise UcclTimeoutError(f"{who} failed to pass monitoredBarrier in {ms} ms")
    ctx._p2p([("send", token, r) for r in range(1, size)], "monitored_barrier", blocking=True)
