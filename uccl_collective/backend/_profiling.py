"""Profiler events for the process group's operations, named as Gloo's and
NCCL's are (``uccl:all_reduce``, ``uccl:send``, ``uccl:recvAnySource``...).

torch's C++ backends open a RecordFunction with the operation's input
tensors when the Work is made and close it when the Work completes, on the
backend's own thread: the profiler then shows an asynchronous event whose
input shapes are the tensors'.  Here ``begin`` opens one on the calling
thread (only while a profiler is running: otherwise it costs one check)
and ties its end to a torch Future (the profiler's own way for events that
end elsewhere, which RPC uses); ``end`` completes that Future from a helper
thread, so the event is asynchronous as torch's backends' are (tools and
torch's own tests expect ``is_async``), and waits for it, so the event is
complete when the operation counts as done.  (Closing the RecordFunction
itself on another thread loses the event in CUDA builds of torch 2.11.)
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

PREFIX = "uccl:"

_closer: ThreadPoolExecutor | None = None
_closer_lock = threading.Lock()


def _tensors(xs: Any) -> list[torch.Tensor]:
    """The tensors in xs (nested lists), in order; complex ones as torch's
    backends record them (torch passes their real view)."""
    out: list[torch.Tensor] = []
    stack = [xs]
    while stack:
        x = stack.pop(0)
        if isinstance(x, torch.Tensor):
            out.append(torch.view_as_real(x) if x.is_complex() else x)
        elif isinstance(x, (list, tuple)):
            stack[0:0] = list(x)
    return out


def begin(op: str, inputs: Sequence = ()) -> Any:
    """Opens the event "uccl:<op>" with inputs' shapes when a profiler is
    running; returns its handle, or None."""
    if not torch.autograd._profiler_enabled():
        return None
    rf = torch.autograd._record_function_with_args_enter(PREFIX + op, *_tensors(inputs))
    fut = torch.futures.Future()
    return fut, torch.ops.profiler._call_end_callbacks_on_jit_fut(rf, fut)


def end(handle: Any) -> None:
    """Closes the event begun by begin() (None: nothing), on another thread."""
    global _closer
    if handle is None:
        return
    with _closer_lock:
        if _closer is None:
            _closer = ThreadPoolExecutor(1, thread_name_prefix="uccl-profiler")
        closer = _closer
    fut, ended = handle
    try:
        closer.submit(fut.set_result, None).result()
        ended.wait()
    except Exception:   # noqa: BLE001  (a profiler's trouble never fails the operation)
        pass
