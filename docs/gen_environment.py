"""Writes the table of docs/environment.md from the configuration table
(csrc/base/config.h, through uccl_collective.core.config), between its two
marker lines.  Run it after changing the table; tests/test_config.py fails
while the page and the table differ.

    python3 docs/gen_environment.py
"""
import pathlib

from uccl_collective.core import config

PAGE = pathlib.Path(__file__).resolve().parent / "environment.md"


def main() -> None:
    text = PAGE.read_text()
    start, end = text.index(config.BEGIN), text.index(config.END) + len(config.END) + 1
    PAGE.write_text(text[:start] + config.markdown() + text[end:])


if __name__ == "__main__":
    main()
