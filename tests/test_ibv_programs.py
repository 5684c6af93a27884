"""rdma-core's own programs run unchanged against the verbs emulator
(tests/ibv_emu/): Debian's ibverbs-utils binaries (ibv_devices, ibv_devinfo,
ibv_rc_pingpong) with LD_LIBRARY_PATH pointing at the emulator's
libibverbs.so.1.  They import more than the engine does (device queries,
the node GUID, completion channels and CQ events, ibv_query_qp,
ibv_wc_status_str) and reach the data path through verbs.h's inline calls,
so they check the emulator's ABI and semantics against rdma-core's own
expectations:

- ibv_devices lists every emulated device with its node GUID;
- ibv_devinfo (and -v) prints the device, its port and its GIDs;
- ibv_rc_pingpong between two processes, polling and sleeping on CQ events
  (-e), 1 B to 1 MiB, up to 10,000 round trips, the receiver validating
  the bytes (-c): both sides print rdma-core's "bytes in ... Mbit/sec" and
  "iters in ... usec/iter" lines, and each names the other's QP;
- without a GRH (no -g) a RoCE port refuses the connection, as real RoCE
  hardware does.

Skipped, saying so, where ibverbs-utils is not installed."""
import os
import re
import shutil
import subprocess
import time

import pytest

import _ibv_emu
from _harness import free_port

PROGRAMS = ("ibv_devices", "ibv_devinfo", "ibv_rc_pingpong")
_missing = [p for p in PROGRAMS if not shutil.which(p)]
pytestmark = pytest.mark.skipif(
    bool(_missing), reason=f"{', '.join(_missing)} not found: rdma-core's programs come with "
                           "Debian's ibverbs-utils (apt-get install ibverbs-utils)")

GUID = "020000fffe000001"  # the first emulated device's node GUID (ibv_emu_device.c)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCCL_IBV_EMU")}
    env.update(LD_LIBRARY_PATH=os.path.dirname(_ibv_emu.path()), **extra)
    return env


def _run(*argv, **env) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=_env(**env), capture_output=True, text=True, timeout=60)


# --------------------------------------------------------------------------
# device queries
def test_devices_lists_every_device_with_its_guid():
    p = _run("ibv_devices", UCCL_IBV_EMU_DEVICES="emu0,mlx5_7")
    assert p.returncode == 0, p.stderr
    rows = [line.split() for line in p.stdout.splitlines()[2:]]
    assert rows == [["emu0", GUID], ["mlx5_7", "020000fffe000002"]], p.stdout


def test_devices_none():
    p = _run("ibv_devices", UCCL_IBV_EMU_DEVICES="")
    assert p.returncode == 0 and p.stdout.splitlines()[2:] == [], p.stdout + p.stderr


def _fields(text: str) -> dict:
    """ibv_devinfo's "name: value" lines (the first of each name)."""
    out = {}
    for line in text.splitlines():
        k, sep, v = line.strip().partition(":")
        if sep and k not in out:
            out[k] = v.strip()
    return out


@pytest.mark.parametrize("port_down", [False, True])
def test_devinfo(port_down):
    p = _run("ibv_devinfo", **({"UCCL_IBV_EMU_PORT_DOWN": "all"} if port_down else {}))
    assert p.returncode == 0, p.stdout + p.stderr
    f = _fields(p.stdout)
    want = {"hca_id": "emu0", "transport": "InfiniBand (0)", "fw_ver": "1.0 (ibv_emu)",
            "node_guid": "0200:00ff:fe00:0001", "sys_image_guid": "0200:00ff:fe00:0001",
            "phys_port_cnt": "1", "port": "1", "max_mtu": "4096 (5)", "active_mtu": "1024 (3)",
            "link_layer": "Ethernet",
            "state": "PORT_DOWN (1)" if port_down else "PORT_ACTIVE (4)"}
    assert {k: f.get(k) for k in want} == want, p.stdout


def test_devinfo_verbose():
    p = _run("ibv_devinfo", "-v")
    assert p.returncode == 0, p.stdout + p.stderr
    f = _fields(p.stdout)
    want = {"max_qp_wr": "16384", "max_sge": "8", "max_cqe": "4194304",
            "atomic_cap": "ATOMIC_NONE (0)", "max_srq": "0", "num_comp_vectors": "1",
            "max_msg_sz": "0x80000000", "gid_tbl_len": "2", "phys_state": "LINK_UP (5)",
            "device_cap_flags": "0x00001000"}
    assert {k: f.get(k) for k in want} == want, p.stdout
    gids = re.findall(r"GID\[\s*(\d+)\]:\s+(\S+), (RoCE v\d)", p.stdout)
    assert gids == [("0", "fe80:0000:0000:0000:0000:0000:0000:0001", "RoCE v1"),
                    ("1", "::ffff:127.0.0.1", "RoCE v2")], p.stdout


def test_devinfo_unknown_device_fails():
    p = _run("ibv_devinfo", "-d", "mlx5_9")
    assert p.returncode != 0 and "mlx5_9" in p.stdout + p.stderr, p.stdout + p.stderr


# --------------------------------------------------------------------------
# ibv_rc_pingpong between two processes
def _listening(port: int, pid: int | None = None) -> bool:
    """Is some socket listening on TCP `port` (in process pid's network
    namespace)?  Read from /proc: never connects, since the pingpong server
    takes the first connection as its peer."""
    where = f"/proc/{pid}/net" if pid else "/proc/net"
    for f in ("tcp", "tcp6"):
        try:
            with open(f"{where}/{f}") as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for r in rows:
            local, state = r.split()[1], r.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                return True
    return False


def pingpong(args: list[str], tries: int = 3, host: str = "127.0.0.1", port: int | None = None,
             wrap: tuple[list[str], list[str]] = ([], []),
             envs: tuple[dict, dict] = ({}, {})) -> tuple[str, str]:
    """Server and client with the same options, each command prefixed by
    its `wrap` (e.g. ip netns exec) and run with its `envs`; (server out,
    client out), both having exited 0 within the timeout."""
    for _ in range(tries):
        p = port or free_port()
        cmd = ["ibv_rc_pingpong", "-p", str(p), *args]
        srv = subprocess.Popen(wrap[0] + cmd, env=_env(**envs[0]), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 20
            while (not _listening(p, srv.pid) and srv.poll() is None
                   and time.monotonic() < deadline):
                time.sleep(0.02)
            if srv.poll() is not None:
                out = srv.communicate(timeout=10)[0]
                if "Couldn't listen" in out and not port:
                    continue  # the port was taken meanwhile: another one
                pytest.fail(f"server exited {srv.returncode} before listening:\n{out}")
            assert _listening(p, srv.pid), "server not listening within 20 s"
            cli = subprocess.run(wrap[1] + cmd + [host], env=_env(**envs[1]), capture_output=True,
                                 text=True, timeout=120)
            sout = srv.communicate(timeout=120)[0]
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait(10)
        cout = cli.stdout + cli.stderr
        assert cli.returncode == 0 and srv.returncode == 0, \
            f"client {cli.returncode}:\n{cout}\nserver {srv.returncode}:\n{sout}"
        return sout, cout
    pytest.fail(f"no free port to listen on in {tries} tries")


ADDR = re.compile(r"(local|remote) address:\s+LID 0x0000, QPN 0x([0-9a-f]{6}), PSN 0x[0-9a-f]{6}, "
                  r"GID ::ffff:([\d.]+)$", re.M)
BYTES = re.compile(r"^(\d+) bytes in ([\d.]+) seconds = ([\d.]+) Mbit/sec$", re.M)
ITERS = re.compile(r"^(\d+) iters in ([\d.]+) seconds = ([\d.]+) usec/iter$", re.M)


@pytest.mark.parametrize("events", [False, True], ids=["poll", "events"])
@pytest.mark.parametrize("size,iters", [(1, 10000), (4096, 1000), (65537, 200), (1 << 20, 50)])
def test_rc_pingpong(size, iters, events):
    """Round trips of SENDs between two RC QPs, the receiver checking the
    bytes (-c); RoCE needs a GRH, hence -g 1 (GID 1: RoCE v2)."""
    args = ["-g", "1", "-c", "-s", str(size), "-n", str(iters)] + (["-e"] if events else [])
    check_pingpong(*pingpong(args), size, iters)


def check_pingpong(sout: str, cout: str, size: int, iters: int,
                   gids: tuple[str, str] = ("127.0.0.1", "127.0.0.1")) -> None:
    """Both sides printed rdma-core's rate lines for size x iters, each side
    names the other's QP and GID, and the receiver found nothing invalid."""
    seen = {}
    for side, out in (("server", sout), ("client", cout)):
        addrs = {k: (qpn, gid) for k, qpn, gid in ADDR.findall(out)}
        assert set(addrs) == {"local", "remote"}, f"{side}:\n{out}"
        seen[side] = addrs
        b, it = BYTES.findall(out), ITERS.findall(out)
        assert len(b) == 1 and len(it) == 1, f"{side}:\n{out}"
        assert int(b[0][0]) == size * iters * 2 and float(b[0][2]) > 0, f"{side}:\n{out}"
        assert int(it[0][0]) == iters and float(it[0][2]) > 0, f"{side}:\n{out}"
        assert "invalid data" not in out and "Failed" not in out, f"{side}:\n{out}"
    assert seen["server"]["remote"] == seen["client"]["local"], seen
    assert seen["client"]["remote"] == seen["server"]["local"], seen
    assert (seen["server"]["local"][1], seen["client"]["local"][1]) == gids, seen


def test_rc_pingpong_without_grh_is_refused():
    """No -g: the address vector has no GRH, which a RoCE (Ethernet) port
    cannot route: the server's move to RTR (made first, before it answers)
    fails with EINVAL, as on real RoCE hardware, and the client, left
    without the server's address, fails too."""
    port = free_port()
    cmd = ["ibv_rc_pingpong", "-p", str(port), "-n", "10"]
    srv = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        deadline = time.monotonic() + 20
        while not _listening(port, srv.pid) and srv.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        cli = subprocess.run(cmd + ["127.0.0.1"], env=_env(), capture_output=True, text=True,
                             timeout=60)
        sout = srv.communicate(timeout=60)[0]
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait(10)
    assert srv.returncode != 0 and "Failed to modify QP to RTR" in sout, sout
    assert "Couldn't connect to remote QP" in sout, sout
    assert cli.returncode != 0 and "Couldn't read/write remote address" in cli.stderr, cli.stderr
