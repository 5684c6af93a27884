"""Two "nodes" on one machine: two network namespaces joined by a veth pair,
one torchrun per namespace (static rendezvous, 2 ranks each, world 4).

The namespaces share one kernel (one boot id), so the library must tell the
nodes apart through torchrun's GROUP_RANK: cross-node peers must go through
the engine over TCP (on the veth addresses), same-node peers through shared
memory (use_copy_engine_for_intra=True) or torch.distributed (False).  In the
rdma_inter case each node also has an emulated RDMA NIC (tests/ibv_emu, its
port and wire on the node's veth address): cross-node peers must then use
RDMA, same-node ones shared memory.  The
worker (tests/_netns_worker.py) checks transports, allgather (direct and ring,
tensor and list receive), allgatherv and a cross-node sendrecv ring step
against dist.all_gather / known data, bit for bit.

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2; skipped otherwise.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import _ibv_emu
from _harness import kill_group

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_netns_worker.py")
JOB_TIMEOUT_S = 50.0   # one torchrun job (both nodes); a healthy one takes ~10 s
MASTER_PORT = 29517    # inside node0's fresh namespace: nothing else listens there

# Env of the launching process that must not leak into the ranks.
_DROP = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "MASTER_PORT", "UCCL_NODE_ID", "UCCL_P2P_HOST_ID", "UCCL_P2P_TRANSPORT",
         "UCCL_P2P_SHM_MODE", "UCCL_P2P_SECRET", "UCCL_P2P_TIMEOUT_S", "UCCL_SOCKET_IFNAME",
         "GLOO_SOCKET_IFNAME", "TORCHELASTIC_RUN_ID")


def _ip(*args: str, timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def two_nodes():
    """[(netns, veth, address)] for node 0 and node 1; deleted at teardown."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_SYS_ADMIN); not running as root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's 'ip' command is missing")
    pid = os.getpid()
    ns = [f"uccl{pid}n0", f"uccl{pid}n1"]
    veth = [f"uv{pid}a"[:15], f"uv{pid}b"[:15]]
    addr = ["10.213.77.1", "10.213.77.2"]
    made: list[str] = []

    def cleanup():
        for name in reversed(made):  # the veth pair dies with its namespaces
            _kill_netns(name)        # no rank may outlive the test
            _ip("netns", "del", name)

    try:
        for name in ns:
            r = _ip("netns", "add", name)
            if r.returncode != 0:
                pytest.skip(f"'ip netns add' failed (no CAP_SYS_ADMIN?): {r.stderr.strip()}")
            made.append(name)
        # Create the pair inside node 0's namespace, move one end to node 1: the
        # host's own namespace is never touched.
        r = _ip("-n", ns[0], "link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        if r.returncode != 0:
            pytest.skip(f"cannot create a veth pair (no veth support?): {r.stderr.strip()}")
        steps = [("-n", ns[0], "link", "set", veth[1], "netns", ns[1])]
        for i in (0, 1):
            steps += [("-n", ns[i], "addr", "add", f"{addr[i]}/24", "dev", veth[i]),
                      ("-n", ns[i], "link", "set", veth[i], "up"),
                      ("-n", ns[i], "link", "set", "lo", "up")]
        for args in steps:
            r = _ip(*args)
            assert r.returncode == 0, f"ip {' '.join(args)}: {r.stderr.strip()}"
        r = subprocess.run(["ip", "netns", "exec", ns[1], "ping", "-c", "1", "-W", "2", addr[0]],
                           capture_output=True, text=True, timeout=10) \
            if shutil.which("ping") else None
        assert r is None or r.returncode == 0, f"veth link is down: {r.stdout}{r.stderr}"
        yield list(zip(ns, veth, addr))
    finally:
        cleanup()


def _kill_netns(ns: str) -> None:
    """SIGKILL every process inside namespace ns (ours alone: its name holds our pid).
    torchrun starts each worker in a session of its own, so killing torchrun's
    process group is not enough."""
    for _ in range(3):
        r = _ip("netns", "pids", ns)
        pids = [int(x) for x in r.stdout.split()] if r.returncode == 0 else []
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def _run_job(nodes, mode: str, tmp_path) -> float:
    """Both torchruns of one job; fails naming the node that failed or hung."""
    base = {k: v for k, v in os.environ.items() if k not in _DROP and not k.startswith("UCCL_IBV")}
    base.update(PYTHONPATH=REPO + os.pathsep + base.get("PYTHONPATH", ""),
                UCCL_P2P_LOG_LEVEL="ERROR", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                TORCH_CPP_LOG_LEVEL="ERROR")
    master = nodes[0][2]
    procs, logs = [], []
    t0 = time.monotonic()
    try:
        for i, (ns, veth, addr) in enumerate(nodes):
            env = dict(base, UCCL_SOCKET_IFNAME=veth, GLOO_SOCKET_IFNAME=veth,
                       NETNS_EXPECT_IP=addr)
            if mode == "rdma":  # each node's emulated NIC on its veth address
                env.update(UCCL_IBVERBS_LIB=_ibv_emu.path(), UCCL_IBV_EMU_IPV4=addr)
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
                   "--nnodes", "2", "--node_rank", str(i), "--nproc_per_node", "2",
                   "--rdzv_backend", "static", "--master_addr", master,
                   "--master_port", str(MASTER_PORT), "--max_restarts", "0",
                   WORKER, mode]
            log = open(tmp_path / f"{mode}-node{i}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = t0 + JOB_TIMEOUT_S
        hung = []
        for i, p in enumerate(procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(i)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_group(p)
        for ns, _veth, _addr in nodes:
            _kill_netns(ns)  # orphaned workers of a killed or failed torchrun
    elapsed = time.monotonic() - t0

    def tail(i: int) -> str:
        logs[i].flush()
        logs[i].seek(0)
        text = logs[i].read()
        return f"--- node {i} ({nodes[i][0]}) log, last 4000 chars ---\n{text[-4000:]}"

    try:
        if hung:
            pytest.fail(f"[{mode}] node(s) {hung} still running after {JOB_TIMEOUT_S:.0f} s; "
                        "killed their process groups\n" + "\n".join(tail(i) for i in (0, 1)))
        bad = [i for i, p in enumerate(procs) if p.returncode != 0]
        if bad:
            pytest.fail(f"[{mode}] node(s) {bad} exited with "
                        f"{[procs[i].returncode for i in bad]}\n"
                        + "\n".join(tail(i) for i in bad))
        for i in (0, 1):
            logs[i].seek(0)
            ok = logs[i].read().count("NETNS-OK")
            assert ok == 2, f"[{mode}] node {i}: {ok}/2 ranks reported NETNS-OK\n{tail(i)}"
    finally:
        for log in logs:
            log.close()
    return elapsed


@pytest.mark.parametrize("mode", ["copy", "dist", "rdma"],
                         ids=["copy_engine_intra", "torch_distributed_intra", "rdma_inter"])
def test_two_node_netns(two_nodes, mode, tmp_path):
    _run_job(two_nodes, mode, tmp_path)
