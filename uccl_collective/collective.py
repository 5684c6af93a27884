"""``uccl_collective.collective``, the name users import: CollectiveContext,
the default context's calls (init_collective, get_collective, send, recv,
allgather, batch_isend_irecv...), P2POp and the handles.  Its code is
core/collective.py, and this name stands for that very module (one module
object, so the default context is one), as if the file were here."""
import sys

from .core import collective

sys.modules[__name__] = collective
