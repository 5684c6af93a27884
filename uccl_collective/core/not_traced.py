"""torch.compile never traces this package: its frames run as they are.

While compiled code runs, dynamo's frame hook compiles every Python frame
that starts, ours too when C++ calls into them: DDP's reducer, at a graph
break in a compiled forward, broadcasts its rebuilt buckets through the
process group, and with "uccl" that is ProcessGroupUCCL.broadcast, a
Python method.  Dynamo cannot trace a ProcessGroup subclass (its attributes
are an opaque object's to it) and fails hard ("Attempted to access
unregistered member on an OpaqueObject").  Gloo's and NCCL's code is C++
and never meets the hook; ours is host code that moves bytes, which there
is no reason to trace either.  So the package's folder goes on dynamo's
skip list, as numpy's does (`trace_rules.add`): its frames, and calls into
it from traced code, run eagerly.

`import torch._dynamo` takes about a second, and only torch.compile needs
it: the folder is added when dynamo's trace rules are imported (a finder
placed before the others for that one module, removed once used), or at
once where they already are.  Nothing costs a call of ours anything."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from typing import Any

log = logging.getLogger("uccl_collective")

RULES = "torch._dynamo.trace_rules"
PACKAGE = __name__.split(".")[0]


def _skip(rules: Any) -> None:
    if getattr(rules, "_uccl_skipped", False):
        return
    try:
        rules.add(PACKAGE)
        rules._uccl_skipped = True
    except Exception as e:  # noqa: BLE001 - a torch without it: compile as before
        log.debug("could not put %s on torch.compile's skip list (%s: %s)", PACKAGE,
                  type(e).__name__, e)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds dynamo's trace rules as the path finder would, and adds the
    package once the module has run."""

    def find_spec(self, name, path, target=None):
        if name != RULES:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def run_then_skip(module):
            run(module)
            _skip(module)
        spec.loader.exec_module = run_then_skip   # this spec's own loader
        return spec


def install() -> None:
    """Keep torch.compile out of this package (idempotent)."""
    rules = sys.modules.get(RULES)
    if rules is not None:
        _skip(rules)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
