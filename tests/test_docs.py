"""The documents stay usable by their readers: every relative link and
anchor of README.md and docs/*.md resolves (docs/check_links.py), the README
stays a newcomer's page, its test command is the one CI runs, and no
internal work-log label or commit id shows where a user reads (the dated
benchmark log excepted) or in a benchmark's --help."""
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))
import check_links  # noqa: E402

LABEL = re.compile(r"\b(session|issue|run) \d+\b", re.I)
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")


def _user_pages():
    return [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
            if p.name != "benchmark-log.md"]


def test_no_dangling_link():
    assert check_links.check() == []


def test_the_checker_sees_a_dangling_link(tmp_path, monkeypatch):
    page = tmp_path / "README.md"
    page.write_text("see [there](docs/nowhere.md) and [here](#no-such-heading)\n")
    monkeypatch.setattr(check_links, "pages", lambda: [str(page)])
    monkeypatch.setattr(check_links, "ROOT", str(tmp_path))
    bad = check_links.check()
    assert len(bad) == 2 and "nowhere.md" in bad[0] and "no-such-heading" in bad[1], bad


def test_readme_is_short_and_runs_cis_command():
    text = (ROOT / "README.md").read_text()
    assert text.count("\n") <= 250
    ci = (ROOT / ".ci" / "run").read_text()
    cmd = next(line.strip() for line in ci.splitlines() if "pytest" in line and "pip" in line)
    assert cmd in text, f"README's test command differs from .ci/run's: {cmd}"


@pytest.mark.parametrize("page", _user_pages(), ids=lambda p: p.name)
def test_no_work_log_label_where_users_read(page):
    text = page.read_text()
    assert not LABEL.search(text), LABEL.search(text).group(0)
    assert not COMMIT.search(text), COMMIT.search(text).group(0)


@pytest.mark.parametrize("script", sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda p: p.name)
def test_no_work_log_label_in_help(script):
    if "ArgumentParser" not in script.read_text():
        pytest.skip(f"{script.name} takes no options (a helper module, or a fixed run)")
    p = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0 and "usage" in p.stdout.lower(), p.stderr[-2000:]
    out = p.stdout
    assert not LABEL.search(out), LABEL.search(out).group(0)
    assert not COMMIT.search(out), COMMIT.search(out).group(0)
