"""torch's out-of-tree backend autoload: `init_process_group("uccl")` with
the package installed, without `import uccl_collective`.

torch calls `register()` (the "torch.backends" entry point) at the end of
every `import torch`, unless TORCH_DEVICE_BACKEND_AUTOLOAD=0.  So this
module is outside the package, imports nothing but what torch has already
imported, loads no C extension and touches no GPU: the engine is imported
only when a "uccl" group is made.  A failure here must not break `import
torch` (torch turns an exception into an import error): it is logged at
DEBUG and "uccl" stays unregistered, as without the autoload."""
import logging

BACKEND_NAME = "uccl"  # uccl_collective.backend.process_group.BACKEND_NAME


def _create(store, rank, size, timeout):
    from uccl_collective.backend.process_group import _create as create
    return create(store, rank, size, timeout)


def register() -> None:
    """Register "uccl" with torch.distributed for cpu and cuda; never raises."""
    try:
        import torch.distributed as dist
        if not dist.is_available() or BACKEND_NAME in dist.Backend.backend_list:
            return
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
    except Exception as e:  # noqa: BLE001 - import torch must go on
        logging.getLogger("uccl_collective").debug(
            "autoload of the \"uccl\" backend failed (%s: %s); `import uccl_collective` "
            "registers it", type(e).__name__, e)
