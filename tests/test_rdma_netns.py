"""RDMA between two hosts: two network namespaces joined by a veth pair
(made and removed by test_collective_netns.two_nodes), each rank in its own,
with its own host id (UCCL_P2P_HOST_ID), the veth as its interface and the
verbs emulator's port on the veth's address (UCCL_IBV_EMU_IPV4, which also
moves the emulator's wire from abstract Unix sockets, one namespace each,
to TCP on the veth).  So the peers differ by every check the engine makes:
host id, address, network namespace; and the RDMA bytes cross the veth.

- the p2p suite's RDMA entries (test_transfers, test_concurrency,
  test_eager, test_errors, test_failures: -k rdma) with rank "server" in
  one namespace and "client" in the other (_harness: UCCL_TEST_NETNS);
- rdma-core's ibv_rc_pingpong between the namespaces;
- the collective suite over RDMA across them is test_collective_netns.py's
  rdma_inter case (two torchrun nodes of two ranks).

Needs root and iproute2 (skipped otherwise, saying why)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from test_collective_netns import two_nodes  # noqa: F401  (the fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
P2P_FILES = ["test_transfers.py", "test_concurrency.py", "test_eager.py", "test_errors.py",
             "test_failures.py"]


def test_p2p_suite_over_rdma_between_namespaces(two_nodes):  # noqa: F811
    """Every RDMA case of the p2p suite, its ranks on two "hosts"; each case
    checks its own bytes and that the transport is RDMA."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("UCCL_IBV", "UCCL_P2P", "UCCL_TEST"))}
    env.update(PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""),
               UCCL_TEST_NETNS=",".join(":".join(n) for n in two_nodes))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-k", "rdma", *[os.path.join(HERE, f) for f in P2P_FILES]],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    out = p.stdout + p.stderr
    m = re.search(r"(\d+) passed", out)
    assert p.returncode == 0 and m and int(m.group(1)) >= 10, out[-6000:]
    assert not re.search(r"\d+ (failed|error|skipped)", out), out[-6000:]


@pytest.mark.skipif(not shutil.which("ibv_rc_pingpong"),
                    reason="ibv_rc_pingpong not found (Debian: apt-get install ibverbs-utils)")
def test_rc_pingpong_between_namespaces(two_nodes):  # noqa: F811
    """rdma-core's pingpong, server in one namespace and client in the other,
    each port's GID its own veth address, events and validation on."""
    from test_ibv_programs import check_pingpong, pingpong

    (ns0, _, ip0), (ns1, _, ip1) = two_nodes
    sout, cout = pingpong(["-g", "1", "-c", "-e", "-s", "65536", "-n", "300"], host=ip0,
                          port=18515, wrap=(["ip", "netns", "exec", ns0],
                                            ["ip", "netns", "exec", ns1]),
                          envs=({"UCCL_IBV_EMU_IPV4": ip0}, {"UCCL_IBV_EMU_IPV4": ip1}))
    check_pingpong(sout, cout, 65536, 300, gids=(ip0, ip1))
