"""The project's environment variables, read through the engine's one table
(csrc/base/config.h) and its one parser, so that a variable means the same
to the C engine and to this package: sizes take K, M or G everywhere, and a
value that does not parse raises ValueError naming the variable and the
value.  Nothing else in the package reads a UCCL_* variable from os.environ
(tests/test_config.py checks it).  docs/environment.md's table is
markdown() (python3 docs/gen_environment.py writes it there).
"""
from __future__ import annotations

import os
from typing import Any

from .. import _engine

#: docs/environment.md holds the generated table between these two lines
BEGIN = "<!-- generated from csrc/base/config.h by: python3 docs/gen_environment.py -->"
END = "<!-- end of the generated table -->"


def get(name: str) -> Any:
    """The variable's value: int (sizes in bytes), bool, the CHOICE's word
    as the table writes it, or for text its value (None when unset); the
    table's default when unset or empty."""
    return _engine.config(name)


def is_set(name: str) -> bool:
    """Whether the environment sets the variable (to anything but blanks)."""
    get(name)   # a name outside the table is a KeyError, a bad value a ValueError
    return bool(os.environ.get(name, "").strip())


def table() -> tuple[tuple[str, str, str, str], ...]:
    """(name, kind, default as the docs show it, meaning) of every variable."""
    return _engine.config_table()


def markdown() -> str:
    """The table of docs/environment.md, with its two marker lines."""
    rows = [BEGIN, "| variable | kind | default | meaning |", "| --- | --- | --- | --- |"]
    for name, kind, default, meaning in table():
        rows.append(f"| `{name}` | {kind} | {default} | {meaning} |")
    rows.append(END)
    return "\n".join(rows) + "\n"
