"""The engine's layout (docs/ARCHITECTURE.md) holds: every call between C
files goes down the layers, transports call up only through the upcalls
transport.h declares, only the py_*.c files include Python.h, every C file
stays under 800 lines, and the architecture page names every file.

Calls are found by name (uccl_* and uccl__* functions, defined in one file
and called in another); calls through function pointers (a transport's ops)
are the contract itself and are not followed."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"

# Layer of each C file, bottom (0) to top.  A file may call files of its own
# layer and of the layers below it.
LAYERS = {
    "status.c": 0, "log.c": 0, "sock.c": 0, "wire.c": 0, "idmap.c": 0, "pool.c": 0,
    "cuda_loader.c": 0, "ibv_loader.c": 0, "nvrtc_loader.c": 0, "dtype.c": 0,
    "gpu_mem.c": 1, "gpu_copy.c": 1, "gpu_kernel.c": 1, "gpu_stream.c": 1, "mem.c": 1, "transport.c": 1,
    "handshake.c": 2,
    "tp_tcp.c": 3, "tp_shm.c": 3, "tp_shm_ipc.c": 3, "tp_rdma.c": 3, "tp_rdma_dev.c": 3,
    "tp_rdma_stage.c": 3,
    "conn.c": 4, "proto.c": 4, "proto_eager.c": 4, "proto_stream.c": 4,
    "engine.c": 5, "listen.c": 5, "xfer.c": 5, "gate.c": 5, "ipc_share.c": 5,
    "sg_cuda.c": 5, "sg_kernels.c": 5, "sg_emu.c": 5,
    "comm.c": 6, "coll_run.c": 6, "coll_algo.c": 6, "ring.c": 6, "sgroup.c": 6, "sg_round.c": 6, "sg_call.c": 6,
    "sg_p2p.c": 6,
    "py_module.c": 7, "py_endpoint.c": 7, "py_comm.c": 7, "py_ring.c": 7,
    "py_stream.c": 7, "py_sgroup.c": 7, "py_sgroup_mod.c": 7, "py_fastpath.c": 7,
}
# What a transport may call in the protocol (transport.h, "upcalls").
UPCALLS = {"uccl__conn_rx_begin", "uccl__conn_rx_end", "uccl__conn_rx_abort",
           "uccl__conn_tx_done", "uccl__conn_send_msg", "uccl__conn_fail"}
# The collective layer and the module stand on the public C API alone.
PUBLIC_ONLY = {6: ("uccl.h", "coll.h", "ring.h", "sgroup.h"),
               7: ("uccl.h", "coll.h", "ring.h", "sgroup.h")}
MAX_LINES = 800

DEF_RE = re.compile(r"^(?!static)[A-Za-z_][\w \*]*?\b(uccl_\w+)\s*\([^;]*?\)\s*\{",
                    re.M | re.S)
CALL_RE = re.compile(r"\b(uccl_\w+)\s*\(")


def _strip(src: str) -> str:
    """C source without comments and string literals."""
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    src = re.sub(r"//[^\n]*", " ", src)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', src)


def _sources() -> dict[str, str]:
    return {p.name: _strip(p.read_text()) for p in sorted(CSRC.glob("*.c"))}


def _definitions(srcs: dict[str, str]) -> dict[str, str]:
    defs = {}
    for name, src in srcs.items():
        for fn in DEF_RE.findall(src):
            assert fn not in defs, f"{fn} defined in both {defs[fn]} and {name}"
            defs[fn] = name
    return defs


def test_every_c_file_has_a_layer():
    files = {p.name for p in CSRC.glob("*.c")}
    assert files == set(LAYERS), (f"not in LAYERS: {sorted(files - set(LAYERS))}; "
                                  f"gone: {sorted(set(LAYERS) - files)}")


def test_definitions_are_found():
    # The parser must see the functions it judges, or the next test proves nothing.
    defs = _definitions(_sources())
    for fn, where in [("uccl__mem_window_check", "mem.c"), ("uccl__conn_post", "proto.c"),
                      ("uccl__conn_drive", "conn.c"), ("uccl_ep_post", "xfer.c"),
                      ("uccl_comm_wait", "comm.c"), ("uccl__open_stream", "handshake.c"),
                      ("uccl__sock_sendv", "sock.c"), ("uccl__py_raise", "py_module.c")]:
        assert defs.get(fn) == where, (fn, defs.get(fn))
    assert len(defs) > 120


def _violations() -> list[str]:
    srcs = _sources()
    defs = _definitions(srcs)
    bad = []
    for caller, src in srcs.items():
        lc = LAYERS[caller]
        for fn in sorted(set(CALL_RE.findall(src))):
            callee = defs.get(fn)
            if callee is None or callee == caller:
                continue
            lf = LAYERS[callee]
            if lc in PUBLIC_ONLY and fn.startswith("uccl__") and lf not in (0, lc):
                bad.append(f"{caller} (layer {lc}) calls {fn}, internal to {callee}: the "
                           "collectives and the module use the public C API")
                continue
            if lf <= lc:
                continue
            if lc == LAYERS["tp_tcp.c"] and fn in UPCALLS:
                continue
            bad.append(f"{caller} (layer {lc}) calls {fn} of {callee} (layer {lf})")
    return bad


def test_calls_go_down_the_layers():
    assert _violations() == []


def test_the_checker_catches_an_upward_call(monkeypatch):
    # A call from the protocol into the endpoint layer, as conn.c once made.
    real = _sources

    def with_upcall():
        srcs = real()
        srcs["proto.c"] += "\nvoid f(void) { uccl__ep_conn_get(0, 0); }\n"
        return srcs

    monkeypatch.setattr(__import__(__name__), "_sources", with_upcall)
    assert any("proto.c" in v and "uccl__ep_conn_get" in v for v in _violations())


@pytest.mark.parametrize("layer", sorted(PUBLIC_ONLY))
def test_upper_layers_include_only_the_public_headers(layer):
    allowed = PUBLIC_ONLY[layer] + ("comm.h", "sg_page.h", "pyengine.h", "status.h", "sock.h",
                                    "idmap.h", "log.h", "wire.h")
    for name, lv in LAYERS.items():
        if lv != layer:
            continue
        for inc in re.findall(r'#include "([^"]+)"', (CSRC / name).read_text()):
            assert inc in allowed, f"{name} includes {inc}"


def test_only_the_module_files_include_python():
    for p in sorted(CSRC.glob("*.[ch]")):
        if "Python.h" in p.read_text():
            assert p.name.startswith("py") and p.name in (*LAYERS, "pyengine.h"), p.name
            assert p.name == "pyengine.h", f"{p.name} includes Python.h (only pyengine.h may)"


def test_c_files_are_small():
    for p in sorted(CSRC.glob("*.[ch]")):
        n = p.read_text().count("\n")
        assert n <= MAX_LINES, f"{p.name} has {n} lines (at most {MAX_LINES})"


def test_architecture_page_names_every_file():
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = [p.name for p in sorted(CSRC.glob("*.[ch]")) if f"`{p.name}`" not in page]
    assert missing == [], f"docs/ARCHITECTURE.md does not describe {missing}"
