"""The engine's layout (docs/ARCHITECTURE.md) holds.

csrc/ has one folder per layer.  A file includes and calls only files of its
own folder and of the folders of lower layers (folders on one layer do not
reach each other); a transport calls up only through the upcalls
tp/transport.h declares; no two files call each other, directly or round a
circle; the collectives, groups, rings and the module stand on the public C
API; only py/pyengine.h includes Python.h; every C file stays under 800
lines; and the architecture page names every file.

Calls are found by name (uccl_* and uccl__* functions, defined in one file
and called in another); calls through function pointers (a transport's
ops, a group's device ops) are the contracts themselves and are not
followed."""
import collections
import pathlib
import re

import pytest

from _graph import circles

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"

# The folders, bottom (0) to top.  Folders on one layer are siblings: they
# use the layers below, never each other.
LAYERS = {
    "base": 0,    # status, logging, the id map, copy helpers, element types
    "load": 1,    # libcuda, libibverbs, NVRTC loaded at run time
    "net": 2,     # sockets and the wire records
    "gpu": 3,     # what a pointer is, copies, kernels, mapped host memory
    "mem": 4,     # registered regions and advertised windows
    "tp": 5,      # the transport contract and the transports, the handshake
    "conn": 6,    # a connection and its protocol
    "ep": 7,      # endpoints, transfers (public C API: uccl.h)
    "sgdev": 8,   # the devices of stream-ordered groups (CUDA, emulated)
    "coll": 9,    # communicators: collectives over endpoints
    "sg": 9,      # stream-ordered groups
    "ring": 9,    # GPU-initiated transfers
    "py": 10,     # the CPython module
}
# What a transport may call in the connection layer (tp/transport.h, "upcalls").
UPCALLS = {"uccl__conn_rx_begin", "uccl__conn_rx_end", "uccl__conn_rx_abort",
           "uccl__conn_tx_done", "uccl__conn_send_msg", "uccl__conn_fail"}
# Folders that stand on the public C API: of the layers below they call only
# public functions (uccl_*), or base's, and include only these headers.
PUBLIC_ONLY = {"coll", "sg", "ring", "py"}
PUBLIC_HEADERS = {"ep/uccl.h", "coll/coll.h", "ring/ring.h", "sg/sgroup.h",
                  "net/sock.h", "net/wire.h",
                  "gpu/gpu_api.h",     # the GPU's public calls (uccl.h, ring.h include it)
                  "sgdev/sg_dev.h"}    # the devices of groups: their contract (sgroup.h's)
MAX_LINES = 800

DEF_RE = re.compile(r"^(?!static)[A-Za-z_][\w \*]*?\b(uccl_\w+)\s*\([^;]*?\)\s*\{",
                    re.M | re.S)
CALL_RE = re.compile(r"\b(uccl_\w+)\s*\(")
INC_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _strip(src: str) -> str:
    """C source without comments and string literals."""
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    src = re.sub(r"//[^\n]*", " ", src)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', src)


def _rel(p: pathlib.Path) -> str:
    return p.relative_to(CSRC).as_posix()


def _folder(rel: str) -> str:
    return rel.split("/")[0]


def _sources() -> dict[str, str]:
    """folder/file.c -> its source, stripped."""
    return {_rel(p): _strip(p.read_text()) for p in sorted(CSRC.glob("*/*.c"))}


def _includes() -> dict[str, list[str]]:
    """folder/file.[ch] -> what it includes in quotes (comments left out)."""
    return {_rel(p): INC_RE.findall(re.sub(r"/\*.*?\*/", " ", p.read_text(), flags=re.S))
            for p in sorted(CSRC.glob("*/*.[ch]"))}


def _definitions(srcs: dict[str, str]) -> dict[str, str]:
    defs = {}
    for name, src in srcs.items():
        for fn in DEF_RE.findall(src):
            assert fn not in defs, f"{fn} defined in both {defs[fn]} and {name}"
            defs[fn] = name
    return defs


def _calls(srcs: dict[str, str]) -> dict[str, dict[str, set[str]]]:
    """caller file -> callee file -> the functions it calls there."""
    defs = _definitions(srcs)
    out: dict[str, dict[str, set[str]]] = {}
    for caller, src in srcs.items():
        per = out.setdefault(caller, collections.defaultdict(set))
        for fn in set(CALL_RE.findall(src)):
            callee = defs.get(fn)
            if callee is not None and callee != caller:
                per[callee].add(fn)
    return out


def test_every_file_is_in_a_layer_folder():
    loose = sorted(p.name for p in CSRC.iterdir() if p.is_file())
    assert loose == [], f"files at the top of csrc/, in no layer: {loose}"
    folders = {p.name for p in CSRC.iterdir() if p.is_dir()}
    assert folders == set(LAYERS), (f"not in LAYERS: {sorted(folders - set(LAYERS))}; "
                                    f"gone: {sorted(set(LAYERS) - folders)}")
    for f in sorted(folders):
        assert list((CSRC / f).glob("*.h")), f"csrc/{f}/ has no header: its interface"


def test_definitions_are_found():
    # The parser must see the functions it judges, or the next tests prove nothing.
    defs = _definitions(_sources())
    for fn in ["uccl__mem_window_check", "uccl__conn_post", "uccl_ep_post", "uccl_comm_wait",
               "uccl__open_stream", "uccl__sock_sendv", "uccl__py_raise", "uccl_sg_error"]:
        assert fn in defs, fn
    assert len(defs) > 120


def _call_violations(srcs=None) -> list[str]:
    srcs = _sources() if srcs is None else srcs
    bad = []
    for caller, per in _calls(srcs).items():
        fc = _folder(caller)
        for callee, fns in sorted(per.items()):
            ff = _folder(callee)
            if ff == fc:
                continue
            for fn in sorted(fns):
                if fc == "tp" and ff == "conn" and fn in UPCALLS:
                    continue
                if LAYERS[ff] > LAYERS[fc] or (LAYERS[ff] == LAYERS[fc]):
                    bad.append(f"{caller} calls {fn} of {callee}: {ff}/ is not below {fc}/")
                elif fc in PUBLIC_ONLY and fn.startswith("uccl__") and ff != "base":
                    bad.append(f"{caller} calls {fn}, internal to {callee}: {fc}/ uses the "
                               "public C API")
    return bad


def test_calls_go_down_the_layers():
    assert _call_violations() == []


def test_the_checker_catches_an_upward_call():
    # A call from the protocol into the endpoint layer, as conn.c once made.
    srcs = _sources()
    srcs["conn/proto.c"] += "\nvoid f(void) { uccl__ep_conn_get(0, 0); }\n"
    assert any("conn/proto.c" in v and "uccl__ep_conn_get" in v for v in _call_violations(srcs))


def _include_violations(incs=None) -> list[str]:
    incs = _includes() if incs is None else incs
    bad = []
    for name, lst in incs.items():
        fc = _folder(name)
        for inc in lst:
            if "/" not in inc:
                bad.append(f"{name} includes \"{inc}\": name its folder")
                continue
            fi = _folder(inc)
            if fi not in LAYERS or not (CSRC / inc).exists():
                bad.append(f"{name} includes {inc}, which does not exist")
            elif fi == fc:
                continue
            elif LAYERS[fi] >= LAYERS[fc]:
                bad.append(f"{name} includes {inc}: {fi}/ is not below {fc}/")
            elif fc in PUBLIC_ONLY and fi != "base" and inc not in PUBLIC_HEADERS:
                bad.append(f"{name} includes {inc}: {fc}/ uses the public C API")
    return bad


def test_includes_go_down_the_layers():
    assert _include_violations() == []


def test_the_checker_catches_an_upward_include():
    incs = _includes()
    incs["gpu/gpu_kernel.c"] = incs["gpu/gpu_kernel.c"] + ["ring/ring.h"]
    incs["py/py_comm.c"] = incs["py/py_comm.c"] + ["conn/conn.h"]
    bad = _include_violations(incs)
    assert any("gpu/gpu_kernel.c includes ring/ring.h" in v for v in bad), bad
    assert any("py/py_comm.c includes conn/conn.h" in v for v in bad), bad


def _circles(calls) -> list[list[str]]:
    """Strongly connected sets of more than one file in the call graph
    (a transport's upcalls left out: they are the declared way up)."""
    return circles({f: {c for c, fns in per.items()
                        if not (_folder(f) == "tp" and _folder(c) == "conn" and fns <= UPCALLS)}
                    for f, per in calls.items()})


def test_no_circle_between_files():
    calls = _calls(_sources())
    circles = _circles(calls)
    detail = [f"{a} -> {b}: {sorted(calls[a][b])}" for c in circles for a in c for b in c
              if b in calls[a]]
    assert circles == [], detail


def test_the_checker_catches_a_circle():
    calls = _calls(_sources())
    calls["base/log.c"]["base/status.c"].add("uccl__err")
    calls["base/status.c"]["base/log.c"].add("uccl__log")
    assert any({"base/log.c", "base/status.c"} <= set(c) for c in _circles(calls))


def test_only_the_module_header_includes_python():
    for p in sorted(CSRC.glob("*/*.[ch]")):
        if "Python.h" in p.read_text():
            assert _rel(p) == "py/pyengine.h", f"{_rel(p)} includes Python.h (only py/pyengine.h may)"


def test_c_files_are_small():
    for p in sorted(CSRC.glob("*/*.[ch]")):
        n = p.read_text().count("\n")
        assert n <= MAX_LINES, f"{_rel(p)} has {n} lines (at most {MAX_LINES})"


def test_architecture_page_names_every_file():
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = [_rel(p) for p in sorted(CSRC.glob("*/*.[ch]")) if f"`{_rel(p)}`" not in page]
    assert missing == [], f"docs/ARCHITECTURE.md does not describe {missing}"
