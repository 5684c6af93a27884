"""The Python package's layout (uccl_collective/__init__.py says it): three
folders, p2p/ (the Endpoint), core/ (CollectiveContext, stream-ordered
groups, GPU rings, the dispatch) and backend/ (the torch.distributed
backend), each standing only on those below it (p2p on the engine, core on
p2p, backend on core); the module imports form no circle; and no import of
a package module hides inside a function (an import inside a function is
allowed only for an optional dependency, listed here with its reason).

Read from the source with ast, so it judges the files, not what happens to
be imported already."""
import ast
import pathlib

import pytest

from _graph import circles

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "uccl_collective"
NAME = "uccl_collective"

#: module -> the folders' modules it may import, by the first part of the
#: name below uccl_collective (the top-level modules are the public names)
MAY_IMPORT = {
    "p2p": {"_engine", "p2p"},
    "core": {"_engine", "p2p", "core"},
    "backend": {"_engine", "p2p", "core", "backend"},
}

#: (module, function, imported module) -> why it is imported there and not
#: at the top: optional dependencies only
LAZY = {
    ("uccl_collective.p2p._rendezvous", "__init__", "redis"):
        "optional: only join_group with a redis:// URI needs the redis package",
    ("uccl_collective.p2p._rendezvous", "_store", "torch.distributed"):
        "the p2p face does not import torch; only join_group's tcp:// and file:// "
        "stores (torch's TCPStore, FileStore) need it",
}


def _modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every .py of the package."""
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()
EXTENSIONS = {f"{NAME}._engine"}   # the C module (csrc/), built in place


def _is_module(name: str) -> bool:
    return name in MODULES or name in EXTENSIONS


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute name a `from ... import` names (its module part)."""
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mod: str, path: pathlib.Path):
    """(imported name, function name or None, line) for each import in mod:
    package modules by their dotted name, others by theirs."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            f = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Import):
                out.extend((a.name, func, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(mod, is_pkg, child)
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    # a submodule, or a name of the module (its __init__ for a package)
                    out.append((sub if _is_module(sub) else base, func, child.lineno))
            visit(child, f)
    visit(tree, None)
    return out


def _graph() -> dict[str, set[str]]:
    """Package module -> the package modules it imports (anywhere in it)."""
    return {m: {n for n, _, _ in _imports(m, p) if n.split(".")[0] == NAME and n != m}
            for m, p in MODULES.items()}


def test_the_parser_sees_the_package():
    # The judge must see what it judges, or the next tests prove nothing.
    for m in ["uccl_collective", "uccl_collective.p2p", "uccl_collective.p2p._endpoint",
              "uccl_collective.core.collective", "uccl_collective.core.dispatch",
              "uccl_collective.backend.process_group", "uccl_collective.backend._work"]:
        assert m in MODULES, m
    g = _graph()
    assert "uccl_collective.core.dispatch" in g["uccl_collective.backend.process_group"]
    assert "uccl_collective.p2p._buffers" in g["uccl_collective.p2p._xfer_api"]
    assert "uccl_collective._engine" in g["uccl_collective.p2p._metadata"]


def test_the_three_faces_are_folders_with_a_docstring():
    for sub in MAY_IMPORT:
        init = PKG / sub / "__init__.py"
        assert init.is_file(), f"uccl_collective/{sub}/ is not a package"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "import" in doc, f"{sub}/__init__.py must say what it holds and imports"
    loose = sorted(p.name for p in PKG.glob("*.py"))
    assert loose == ["__init__.py", "collective.py", "gpu_ring.py"], \
        f"modules at the top of the package, in no folder: {loose}"


def test_each_folder_imports_only_what_it_stands_on():
    bad = []
    for m, deps in _graph().items():
        parts = m.split(".")
        if len(parts) < 2 or parts[1] not in MAY_IMPORT:
            continue
        for d in sorted(deps):
            top = d.split(".")[1] if "." in d else ""
            if top not in MAY_IMPORT[parts[1]]:
                bad.append(f"{m} imports {d}")
    assert bad == []


def test_no_circle_of_imports():
    g = _graph()
    assert circles(g) == []


def test_the_checker_catches_a_circle():
    g = _graph()
    g["uccl_collective.core.stream_group"].add("uccl_collective.backend._reduce_gpu")
    found = circles(g)
    assert any("uccl_collective.core.stream_group" in c and
               "uccl_collective.backend._reduce_gpu" in c for c in found), found


def test_no_import_hides_in_a_function():
    hidden, unlisted = [], []
    for m, p in MODULES.items():
        for name, func, line in _imports(m, p):
            if func is None:
                continue
            if name.split(".")[0] == NAME:
                hidden.append(f"{p.relative_to(ROOT)}:{line} ({func}) imports {name}")
            elif (m, func, name) not in LAZY:
                unlisted.append(f"{p.relative_to(ROOT)}:{line} ({func}) imports {name}")
    assert hidden == [], "an import of a package module inside a function (a circle hidden?)"
    assert unlisted == [], "an import inside a function: list it in LAZY with its reason"
    seen = {(m, f, n) for m, p in MODULES.items() for n, f, _ in _imports(m, p) if f}
    assert set(LAZY) <= seen, f"LAZY lists imports that are gone: {set(LAZY) - seen}"


@pytest.mark.parametrize("public, module", [
    ("uccl_collective.collective", "uccl_collective.core.collective"),
    ("uccl_collective.gpu_ring", "uccl_collective.core.gpu_ring"),
])
def test_the_public_names_are_the_core_modules(public, module):
    import importlib
    assert importlib.import_module(public) is importlib.import_module(module)


def test_the_build_ships_every_folder():
    """pyproject.toml's packages: the package and each of its folders (a
    wheel without one would import nothing of it)."""
    tomllib = pytest.importorskip("tomllib")
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(conf["tool"]["setuptools"]["packages"])
    folders = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert listed == folders
