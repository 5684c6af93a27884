"""Shared setup: loopback only, for this process and (through _harness.BASE_ENV)
every rank it spawns; the tests directory importable by spawned ranks."""
import os
import sys

os.environ["UCCL_SOCKET_IFNAME"] = "lo"
os.environ.setdefault("UCCL_P2P_LOG_LEVEL", "ERROR")
for _k in ("UCCL_P2P_TRANSPORT", "UCCL_P2P_SHM_MODE", "UCCL_P2P_SECRET", "UCCL_P2P_TIMEOUT_S",
           "UCCL_IBVERBS_LIB", "UCCL_P2P_RDMA_DEV", "UCCL_P2P_RDMA_GID_INDEX", "UCCL_IBV_EMU_DEVICES",
           "UCCL_IBV_EMU_PORT_DOWN"):
    os.environ.pop(_k, None)  # a developer's shell must not change what the tests test

_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    sys.path.insert(0, _here)  # spawned ranks unpickle functions from test modules

import pytest  # noqa: E402


def pytest_configure(config):
    """Build the verbs emulator the "rdma" transport runs over (tests/_ibv_emu.py)."""
    import _ibv_emu

    _ibv_emu.path()


@pytest.fixture
def endpoints():
    """Factory of in-process Endpoints (port 0, short timeout), all closed at teardown."""
    from uccl_collective.p2p import Endpoint

    made = []

    def make(**kw):
        kw.setdefault("port", 0)
        kw.setdefault("timeout_s", 5)
        ep = Endpoint(**kw)
        made.append(ep)
        return ep

    yield make
    for ep in made:
        ep.close()
