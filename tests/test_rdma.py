"""The RDMA transport (csrc/tp_rdma*.c) and the verbs emulator it is tested
against (tests/ibv_emu/).  The p2p and collective suites run over RDMA too
(the "rdma" entry of _harness.TRANSPORTS; test_collective.py's
test_case_over_rdma); this file holds what is RDMA's own:

- the emulator's semantics, each in two real processes (ibv_emu/emu_check.c):
  WRITE_WITH_IMM consuming a posted receive, SEND into one, READ, rkey / bounds / rights
  checks with REM_ACCESS_ERR and the QP in ERR, a bad lkey, ordering, the
  receiver-not-ready wait and its retry limit, a dead peer, the QP state
  machine; and its symbol versions;
- a missing library, device or active port named by the error;
- auto picking RDMA between hosts, TCP when one end has no device;
- striping over QPs and NICs (the emulator's per-QP counts), and the
  emulator's figures (only a check that nothing is serialised)."""
import os
import shutil
import subprocess
import sys
import time

import pytest

import _ibv_emu
from _harness import MiB, Pair, addr, all_poison, catch, poisoned, rand_bytes, run_pair, sha

SCENARIOS = ["write_imm", "read", "bad_rkey", "out_of_bounds", "no_remote_read", "bad_lkey",
             "ordered", "rnr_wait", "rnr_exceeded", "peer_dies", "peer_dies_midway",
             "state_machine", "send", "send_too_long", "rnr_requester_count",
             "qp_no_remote_write", "read_into_readonly", "recv_no_local_write", "cq_order",
             "flush_on_err", "send_inline", "cq_events"]


@pytest.mark.parametrize("wire", ["unix", "tcp"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_emulator_semantics(scenario, wire):
    """One RC semantic of the emulator between two processes, checked by the
    C driver (what each scenario asserts is written next to it there); over
    each of the emulator's wires: abstract Unix sockets (the default) and
    TCP (UCCL_IBV_EMU_IPV4, here on loopback; what two hosts use)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCCL_IBV_EMU")}
    if wire == "tcp":
        env["UCCL_IBV_EMU_IPV4"] = "127.0.0.1"
    p = subprocess.run([_ibv_emu.check_path(), _ibv_emu.path(), scenario], capture_output=True,
                       text=True, timeout=90, env=env)
    assert p.returncode == 0 and f"OK {scenario}" in p.stdout, p.stdout + p.stderr


def test_emulator_symbol_versions():
    """Every entry point the engine looks up exists at rdma-core's version."""
    if not shutil.which("readelf"):
        pytest.skip("readelf (binutils) is not installed: cannot list symbol versions")
    out = subprocess.run(["readelf", "--dyn-syms", "-W", _ibv_emu.path()], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    for name in ("ibv_get_device_list", "ibv_open_device", "ibv_query_port", "ibv_query_gid",
                 "ibv_alloc_pd", "ibv_reg_mr", "ibv_dereg_mr", "ibv_create_cq",
                 "ibv_create_qp", "ibv_modify_qp", "ibv_destroy_qp", "ibv_query_qp",
                 # what rdma-core's programs import besides (test_ibv_programs.py)
                 "ibv_get_device_guid", "ibv_query_device", "ibv_get_cq_event",
                 "ibv_ack_cq_events", "ibv_wc_status_str"):
        assert f"{name}@@IBVERBS_1.1" in out, name
    for name in ("ibv_create_comp_channel", "ibv_destroy_comp_channel", "ibv_read_sysfs_file"):
        assert f"{name}@@IBVERBS_1.0" in out, name
    assert "ibv_qp_to_qp_ex@@IBVERBS_1.6" in out
    assert "ibv_query_gid_type@@IBVERBS_PRIVATE_34" in out
    assert "_ibv_query_gid_ex@@IBVERBS_1.11" in out
    assert "ibv_post_send" not in out, "the data path is inline (context ops), never exported"


# --------------------------------------------------------------------------
# what is missing, named
def _endpoint_error(env: dict) -> str:
    code = ("from uccl_collective.p2p import Endpoint\n"
            "try:\n    Endpoint(port=0)\nexcept Exception as e:\n"
            "    print(type(e).__name__, e)\nelse:\n    print('no error')\n")
    full = {k: v for k, v in os.environ.items() if not k.startswith(("UCCL_IBV", "UCCL_P2P_RDMA"))}
    full.update(env, UCCL_P2P_TRANSPORT="rdma")
    p = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                       timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    return p.stdout.strip() + p.stderr.strip()


@pytest.mark.parametrize("case", ["no-library", "not-libibverbs", "no-device", "no-active-port",
                                  "unknown-device", "bad-gid-index"])
def test_forced_rdma_names_what_is_missing(case, tmp_path):
    """UCCL_P2P_TRANSPORT=rdma where RDMA cannot work raises UcclError at
    Endpoint() naming the missing piece (never a fallback, never a crash)."""
    lib = _ibv_emu.path()
    env, want = {
        "no-library": ({"UCCL_IBVERBS_LIB": str(tmp_path / "libibverbs.so.1")},
                       ["no RDMA library", "libibverbs.so.1"]),
        "not-libibverbs": ({"UCCL_IBVERBS_LIB": "libm.so.6"}, ["lacks ibv_get_device_list"]),
        "no-device": ({"UCCL_IBVERBS_LIB": lib, "UCCL_IBV_EMU_DEVICES": ""}, ["no RDMA device"]),
        "no-active-port": ({"UCCL_IBVERBS_LIB": lib, "UCCL_IBV_EMU_PORT_DOWN": "all"},
                           ["no active port", "emu0 port 1 DOWN"]),
        "unknown-device": ({"UCCL_IBVERBS_LIB": lib, "UCCL_P2P_RDMA_DEV": "mlx5_9"},
                           ["UCCL_P2P_RDMA_DEV=mlx5_9", "devices: emu0"]),
        "bad-gid-index": ({"UCCL_IBVERBS_LIB": lib, "UCCL_P2P_RDMA_GID_INDEX": "7"},
                          ["UCCL_P2P_RDMA_GID_INDEX=7", "holds 2"]),
    }[case]
    msg = _endpoint_error(env)
    assert msg.startswith("UcclError") and "rdma" in msg, msg
    for w in want:
        assert w in msg, (w, msg)


# --------------------------------------------------------------------------
# auto: RDMA between hosts when both ends can
def _auto_server(ch):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=20)
    ch.send("meta", ep.get_metadata())
    ok, _, _, conn = ep.accept()
    buf = poisoned(MiB)
    mr = ep.reg(addr(buf), buf.nbytes)[1]
    assert ep.recv(conn, mr, addr(buf), MiB) is True
    out = {"tp": ep.conn_transport(conn), "got": sha(buf[:MiB]), "guard": all_poison(buf[MiB:])}
    ep.close()
    return out


def _auto_client(ch):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=20)
    ok, conn = ep.add_remote_endpoint(ch.recv("meta"))
    data = rand_bytes(MiB, 5)
    mr = ep.reg(addr(data), MiB)[1]
    assert ep.send(conn, mr, addr(data), MiB) is True
    tp = ep.conn_transport(conn)
    ep.close()
    return {"tp": tp}


@pytest.mark.parametrize("client_has_rdma", [True, False])
def test_auto_picks_rdma_between_hosts(client_has_rdma, tmp_path):
    """Two endpoints with different host ids (UCCL_P2P_HOST_ID: other hosts)
    and no forced transport: RDMA when both have a usable device, else TCP;
    the bytes arrive either way."""
    lib = _ibv_emu.path()
    s, c = run_pair(_auto_server, _auto_client, timeout=60,
                    server_env={"UCCL_P2P_HOST_ID": "host-a", "UCCL_IBVERBS_LIB": lib},
                    client_env={"UCCL_P2P_HOST_ID": "host-b", "UCCL_IBVERBS_LIB":
                                lib if client_has_rdma else str(tmp_path / "none.so")})
    want = "rdma" if client_has_rdma else "tcp"
    assert s["tp"] == c["tp"] == want
    assert s["got"] == sha(rand_bytes(MiB, 5)) and s["guard"]


def test_same_host_keeps_shared_memory():
    """Same host, nothing forced: shared memory, even with an RDMA device."""
    s, c = run_pair(_auto_server, _auto_client, timeout=60,
                    env={"UCCL_IBVERBS_LIB": _ibv_emu.path()})
    assert s["tp"] == c["tp"] == "shm-cma" or s["tp"] == c["tp"] == "shm-ring", (s, c)


# --------------------------------------------------------------------------
# striping, and the emulator's figures
SIZE = 16 * MiB


def _bench_server(ch, rounds):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=30)
    ch.send("meta", ep.get_metadata())
    ok, _, _, conn = ep.accept()
    buf = poisoned(SIZE)
    mr = ep.reg(addr(buf), buf.nbytes)[1]
    for _ in range(rounds):
        assert ep.recv(conn, mr, addr(buf), SIZE) is True
    out = {"got": sha(buf[:SIZE]), "guard": all_poison(buf[SIZE:])}
    ch.recv("done")
    ep.close()
    return out


def _bench_client(ch, rounds):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=30)
    ok, conn = ep.add_remote_endpoint(ch.recv("meta"))
    data = rand_bytes(SIZE, 11)
    mr = ep.reg(addr(data), SIZE)[1]
    t0 = time.perf_counter()
    for _ in range(rounds):
        assert ep.send(conn, mr, addr(data), SIZE) is True
    took = time.perf_counter() - t0
    ch.send("done")
    ep.close()
    return {"gbps": SIZE * rounds / took / 1e9}


def _stats(path):
    rows = [ln.split() for ln in open(path).read().splitlines()]
    return [(dev, int(reqs), int(nbytes)) for dev, _, reqs, nbytes in rows]


@pytest.mark.parametrize("devices,qps", [("emu0", 4), ("emu0,emu1", 4)])
def test_striping_over_qps_and_nics(devices, qps, tmp_path):
    """A 16 MiB send over 4 QPs (512 KiB chunks) is split evenly: every QP
    carries 4 MiB (the emulator counts what each QP sent); with two NICs the
    QPs alternate between them.  The bytes arrive intact."""
    stats = tmp_path / "stats"
    env = _ibv_emu.env(UCCL_IBV_EMU_DEVICES=devices, UCCL_P2P_RDMA_QPS=str(qps),
                       UCCL_P2P_RDMA_CHUNK_KB="512", UCCL_IBV_EMU_STATS=str(stats))
    s, c = run_pair(_bench_server, _bench_client, env=env, timeout=90,
                    server_kwargs={"rounds": 1}, client_kwargs={"rounds": 1})
    assert s["got"] == sha(rand_bytes(SIZE, 11)) and s["guard"]
    rows = _stats(stats)
    assert len(rows) == qps, rows  # only the sender's QPs asked for anything
    assert sorted(n for _, _, n in rows) == [SIZE // qps] * qps, rows
    assert sorted({d for d, _, _ in rows}) == sorted(devices.split(",")), rows


def _multi_server(ch, nconn, rounds):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=60)
    ch.send("port", ep.address()[1])
    conns = [ep.accept(timeout=20)[3] for _ in range(nconn)]
    bufs = [poisoned(SIZE) for _ in conns]
    mrs = [ep.reg(addr(b), b.nbytes)[1] for b in bufs]
    for _ in range(rounds):
        ids = [ep.recv_async(c, m, addr(b), SIZE)[1] for c, m, b in zip(conns, mrs, bufs)]
        for t in ids:
            assert ep.wait(t, timeout=60) is True
            ep.release(t)
    ch.recv("done")
    return {"got": [sha(b[:SIZE]) for b in bufs]}


def _multi_client(ch, nconn, rounds):
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=60)
    port = ch.recv("port")
    conns = [ep.connect("127.0.0.1", -1, remote_port=port)[1] for _ in range(nconn)]
    data = rand_bytes(SIZE, 11)
    mr = ep.reg(addr(data), SIZE)[1]
    t0 = time.perf_counter()
    for _ in range(rounds):  # one send in flight on every connection at once
        ids = [ep.send_async(c, mr, addr(data), SIZE)[1] for c in conns]
        for t in ids:
            assert ep.wait(t, timeout=60) is True
            ep.release(t)
    took = time.perf_counter() - t0
    ch.send("done")
    return {"gbps": SIZE * rounds * nconn / took / 1e9}


@pytest.mark.skipif(not os.environ.get("UCCL_RDMA_EMU_FIGURES"),
                    reason="figures only on request (UCCL_RDMA_EMU_FIGURES=1): timing, not a test")
def test_emulator_figures():
    """Prints the emulator's throughput: one 16 MiB send at a time over 1, 2
    and 4 QPs, and 1, 2 and 4 connections with a send in flight on each.
    Only a check that nothing serialises (nothing collapses with more QPs
    or more transfers in flight), never performance: every emulated byte is
    copied twice, by a sender and a receiver thread, so one transfer already
    keeps two cores busy and a 2-core machine cannot show gains."""
    qps, conns = {}, {}
    for n in (1, 2, 4):
        _, c = run_pair(_bench_server, _bench_client, env=_ibv_emu.env(UCCL_P2P_RDMA_QPS=str(n)),
                        timeout=120, server_kwargs={"rounds": 8}, client_kwargs={"rounds": 8})
        qps[n] = c["gbps"]
        s, c = run_pair(_multi_server, _multi_client, env=_ibv_emu.env(), timeout=120,
                        server_kwargs={"nconn": n, "rounds": 8 // n},
                        client_kwargs={"nconn": n, "rounds": 8 // n})
        assert s["got"] == [sha(rand_bytes(SIZE, 11))] * n
        conns[n] = c["gbps"]
    print("\nemulator, 16 MiB sends: by QPs", {q: f"{g:.2f} GB/s" for q, g in qps.items()},
          "by connections in flight", {q: f"{g:.2f} GB/s" for q, g in conns.items()})
    assert qps[4] > 0.25 * qps[1] and conns[4] > 0.25 * conns[1], (qps, conns)


def _verbs_include():
    for d in filter(None, [os.environ.get("UCCL_TEST_VERBS_INCLUDE"), "/usr/include"]):
        if os.path.exists(os.path.join(d, "infiniband", "verbs.h")):
            return d
    return None


def test_declared_abi_matches_rdma_core(tmp_path):
    """csrc/load/ibv_loader.h declares the verbs ABI itself (no build dependency);
    compiled against rdma-core's own verbs.h, every member offset, size and
    constant used must match (ibv_emu/abi_check.c: a mismatch fails to
    compile, naming it)."""
    inc = _verbs_include()
    if not inc:
        pytest.skip("rdma-core's <infiniband/verbs.h> is not installed (Debian: libibverbs-dev; "
                    "or point UCCL_TEST_VERBS_INCLUDE at an include directory holding it)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([os.environ.get("CC", "gcc"), "-std=gnu11", "-fsyntax-only", f"-I{inc}",
                        f"-I{root}/csrc", f"{root}/tests/ibv_emu/abi_check.c"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


# --------------------------------------------------------------------------
# staged memory: what no NIC can register, moved through registered memory
STAGED_SIDES = {"receiver": ("server",), "sender": ("client",), "both": ("server", "client")}


@pytest.mark.parametrize("side", list(STAGED_SIDES))
@pytest.mark.parametrize("what", ["two_sided", "one_sided"])
def test_staged_memory(what, side, monkeypatch):
    """UCCL_P2P_RDMA_STAGE_ALL=1 registers no memory with the NIC and stages
    it as GPU memory without GPUDirect is staged, with host copies where the
    GPU's copy engine would copy: test_transfers.py's send/recv, sendv,
    send_async (two_sided) and write, read, writev, readv, write_async,
    read_async (one_sided) of 0 B to 64 MiB, with its checks (every byte,
    poisoned destinations and guards), with the receiver / window owner
    staged (a send into its buffer, a write into or a read from its window
    stream through its staging ring), the sender / initiator staged (its own
    moves through its staging chunk), or both.  With the receiver staged no
    peer ever holds an rkey of its buffers: the bytes can only have come
    through the ring."""
    import test_transfers as T

    stage = {"UCCL_P2P_RDMA_STAGE_ALL": "1"}
    real = T.run_pair

    def run_staged(*a, **kw):
        for rank in STAGED_SIDES[side]:
            kw[f"{rank}_env"] = stage
        return real(*a, **kw)

    monkeypatch.setattr(T, "run_pair", run_staged)
    getattr(T, f"test_{what}_all_sizes")("rdma")


STAGED_BIG = 64 * MiB
SURVIVOR_TIMEOUT = 10.0


def _staged_loop(ch, role, survivor, what):
    """One rank of a pair moving 64 MiB again and again until a side dies:
    'server' receives (what='send') or advertises a window the client reads
    (what='read'); 'client' sends or reads.  Returns the first error
    (catch()), or None."""
    from uccl_collective.p2p import Endpoint

    ep = Endpoint(port=0, timeout_s=SURVIVOR_TIMEOUT if survivor else 60)
    if role == "server":
        ch.send("meta", ep.get_metadata())
        conn = ep.accept()[3]
    else:
        conn = ep.add_remote_endpoint(ch.recv("meta"))[1]
    buf = rand_bytes(STAGED_BIG, 21)
    mr = ep.reg(addr(buf), buf.nbytes)[1]
    if what == "read" and role == "server":
        ch.send("fifo", ep.advertise(conn, mr, addr(buf), STAGED_BIG)[1])
        if not survivor:
            ch.event("streaming")
            time.sleep(120)  # the window streams out on the engine's threads; killed before
        # the reader was killed while the window streamed out: the stream
        # thread must stop, a call on the dead connection raise, close() return
        ch.recv("killed", timeout=120)
        err = catch(ep.recv, conn, mr, addr(buf), STAGED_BIG)
        t0 = time.monotonic()
        ep.close()
        return {**err, "close_s": time.monotonic() - t0} if err else None
    fifo = ch.recv("fifo") if what == "read" else None
    for i in range(100000):
        if i == 2:
            ch.event("streaming")
        if what == "read":
            err = catch(ep.read, conn, mr, addr(buf), STAGED_BIG, fifo)
        elif role == "client":
            err = catch(ep.send, conn, mr, addr(buf), STAGED_BIG)
        else:
            err = catch(ep.recv, conn, mr, addr(buf), STAGED_BIG)
        if err:
            t0 = time.monotonic()
            ep.close()  # joins the connection's threads, the stream thread among them
            return {**err, "close_s": time.monotonic() - t0}
    return None


def _staged_server(ch, **kw):
    return _staged_loop(ch, "server", **kw)


def _staged_client(ch, **kw):
    return _staged_loop(ch, "client", **kw)


@pytest.mark.parametrize("staged", ["receiver", "both"])
@pytest.mark.parametrize("what,killed", [("send", "client"), ("send", "server"),
                                          ("read", "server"), ("read", "client")])
def test_staged_stream_peer_killed(what, killed, staged):
    """While 64 MiB sends (or reads of a 64 MiB window) stream through the
    staging ring one after the other, the peer is SIGKILLed: the survivor's
    call raises UcclError well inside its 10 s timeout, never hangs, and
    closing its endpoint then returns at once.  (read, client): the reader
    dies while the window's owner streams to it; the owner's next call on
    that connection raises, and its close() returns."""
    survivor = "server" if killed == "client" else "client"
    env = {"UCCL_P2P_RDMA_STAGE_ALL": "1"}
    with Pair(_staged_server, _staged_client, env=_ibv_emu.env(),
              server_env=env, client_env=env if staged == "both" else None,
              server_kwargs={"survivor": survivor == "server", "what": what},
              client_kwargs={"survivor": survivor == "client", "what": what}) as p:
        p.wait_event(killed if what == "read" and killed == "client" else survivor,
                     "streaming", timeout=60)
        time.sleep(0.05)
        p.kill(killed)
        if what == "read" and survivor == "server":
            p.tell("server", "killed")
        err = p.result(survivor, timeout=SURVIVOR_TIMEOUT + 10)
    assert err is not None and err.get("uccl"), err
    assert not err["timeout"] and err["elapsed"] < SURVIVOR_TIMEOUT, err
    assert err["close_s"] < 5, f"close() after the failure took {err['close_s']:.1f} s"
