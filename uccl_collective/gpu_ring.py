"""``uccl_collective.gpu_ring``, the name users import: GPU-initiated
transfers (GpuRing, Kernel, Remote, include_dir...).  Its code is
core/gpu_ring.py, and this name stands for that very module (one module
object), as if the file were here."""
import sys

from .core import gpu_ring

sys.modules[__name__] = gpu_ring
