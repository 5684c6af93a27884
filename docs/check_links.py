"""Check that every relative link of the README and of docs/*.md points to a
file (or folder) that exists, and that every #anchor names a heading of the
page it points to (GitHub's heading ids).

    python3 docs/check_links.py          # from the repository root; exit 1 on a dangling link

Links inside fenced code blocks and inline code are not links and are
skipped; so are http(s) and mailto links, which need the network.
"""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages() -> list[str]:
    out = [os.path.join(ROOT, "README.md")]
    docs = os.path.join(ROOT, "docs")
    out += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    return out


def prose_lines(path: str):
    """(line number, text) of the lines outside fenced code, inline code removed."""
    fenced = False
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if FENCE.match(line):
                fenced = not fenced
                continue
            if not fenced:
                yield n, re.sub(r"`[^`]*`", "", line)


def slug(heading: str) -> str:
    """GitHub's id for a heading: lower case, inline markup and punctuation
    dropped (hyphens and underscores kept), spaces to hyphens."""
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())   # [text](url) -> text
    h = h.replace("`", "").lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if FENCE.match(line):
                fenced = not fenced
                continue
            m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                s = slug(m.group(1))
                k = seen.get(s, 0)
                out.add(s if k == 0 else f"{s}-{k}")
                seen[s] = k + 1
    return out


def check() -> list[str]:
    bad = []
    for page in pages():
        rel_page = os.path.relpath(page, ROOT)
        for n, line in prose_lines(page):
            for m in LINK.finditer(line):
                target = m.group(1)
                if re.match(r"[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = page if not path else os.path.normpath(os.path.join(os.path.dirname(page), path))
                if not os.path.exists(dest):
                    bad.append(f"{rel_page}:{n}: {target}: no such file")
                elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                    bad.append(f"{rel_page}:{n}: {target}: no heading #{anchor} in "
                               f"{os.path.relpath(dest, ROOT)}")
    return bad


def main() -> int:
    bad = check()
    for b in bad:
        print(b)
    print(f"{len(pages())} pages checked, {len(bad)} dangling link(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
