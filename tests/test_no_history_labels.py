"""What a reader of pkvrt sees speaks of pkvrt, not of how it was made: no work-session labels
("session 13", "Sessions 8-24") and no issue references ("issue 12", "issue #7", a bare "#15").
A reader knows neither; a claim says what it means instead: a date, a commit, a result file, or
the technical reason.

Checked (CPU only): README.md, every file under docs/, routes.toml, every text file under pkvrt/
and kernels/ (those git tracks, and new ones it does not ignore; without git: every file there
but build outputs), and the help of ``pkvrt`` and of every command and mode its parser builds
(``pkvrt.tools.cli.build_parser``, walked in-process). A failure lists ``file:line: text``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# "session 13", "Sessions 8-24", "session13/"; "issue 12", "issues 5", "issue #7".
LABEL = re.compile(r"\bsessions? ?[0-9]|\bissues? ?#?[0-9]", re.IGNORECASE)
# A bare issue reference ("#15"), not an HTML entity ("&#39;") nor part of a word.
BARE_REF = re.compile(r"(?<![&\w])#[0-9]+\b")
# Lines where '#' starts a code construct (C preprocessor), not a reference.
CODE_LINE = re.compile(r"^\s*#\s*(include|pragma|define|if)")
# A hex-looking token (a colour such as #336699 or #11223344) at a '#'.
HEX_TOKEN = re.compile(r"#(?:[0-9a-fA-F]{6}|[0-9a-fA-F]{8})\b")

# What is scanned: a single file, or every text file under a folder.
SCANNED = ("README.md", "docs", "routes.toml", "pkvrt", "kernels", "calibration")
TEXT_SUFFIXES = {".py", ".pyi", ".toml", ".json", ".md", ".rst", ".txt", ".cfg", ".ini", ".yaml",
                 ".yml", ".sh", ".csv", ".cu", ".cuh", ".h", ".hpp", ".c", ".cc", ".cpp"}
# Build outputs and caches under the scanned folders, skipped when git cannot say what is ignored.
BUILD_DIRS = {"__pycache__", "_cubins", ".pytest_cache", ".hypothesis"}


def labels_in(text: str) -> list[tuple[int, str]]:
    """(line number, the offending line) for every line of ``text`` with a label."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        hit = LABEL.search(line)
        if hit is None and not CODE_LINE.match(line):
            hit = next((m for m in BARE_REF.finditer(line) if not HEX_TOKEN.match(line, m.start())),
                       None)
        if hit is not None:
            found.append((n, line.strip()))
    return found


def _git_files(paths) -> list[str] | None:
    """The files git tracks under ``paths`` plus the untracked ones it does not ignore; None
    without git or outside a git checkout (a copied work tree)."""
    try:
        proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                               "--", *paths], cwd=ROOT, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return sorted(set(p for p in proc.stdout.decode().split("\0") if p))


def _walked_files(paths) -> list[str]:
    out = []
    for p in paths:
        path = ROOT / p
        if path.is_file():
            out.append(p)
        elif path.is_dir():
            for f in path.rglob("*"):
                rel = f.relative_to(ROOT)
                if f.is_file() and not any(part in BUILD_DIRS or part.endswith(".egg-info")
                                           for part in rel.parts):
                    out.append(rel.as_posix())
    return sorted(out)


def scanned_files() -> list[str]:
    files = _git_files(SCANNED)
    if files is None:
        files = _walked_files(SCANNED)
    keep = []
    for f in files:
        path = ROOT / f
        if not path.is_file():          # deleted in the work tree, still in git's index
            continue
        # docs/ and the single files: every text file; pkvrt/ and kernels/: by suffix
        if f.startswith("docs/") or f in SCANNED or path.suffix in TEXT_SUFFIXES:
            keep.append(f)
    return keep


def _read_text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None                     # binary (an image under docs/)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


FILES = scanned_files()


def test_the_scan_sees_the_project():
    assert "README.md" in FILES and "routes.toml" in FILES
    assert any(f.startswith("pkvrt/") and f.endswith(".py") for f in FILES)
    assert any(f.startswith("kernels/") for f in FILES)


def test_the_patterns():
    flagged = ["measured in session 14", "Sessions 8-24", "see issue 12", "(issue #7, item 3)",
               "Issues 5 and 6", "fixed in #15", "results/h200/session8/x.json", "# session 3"]
    clean = ["#include <cuda.h>", "  #pragma unroll 4", "#define PKV_X 1", "#if PKV_Y > 2",
             "color: #336699;", "&#39;s", "the session's host", "an issue with 12 rows",
             "row#3", "call 4 of the loop", "# 1. the first step"]
    assert [s for s in flagged if not labels_in(s)] == []
    assert [s for s in clean if labels_in(s)] == []


@pytest.mark.parametrize("rel", FILES)
def test_file_has_no_history_labels(rel):
    text = _read_text(ROOT / rel)
    if text is None:
        pytest.skip("not a UTF-8 text file")
    found = labels_in(text)
    assert not found, "session/issue labels (say what they mean: a date, a commit, a result " \
        "file, or the reason):\n" + "\n".join(f"{rel}:{n}: {line}" for n, line in found)


def _help_texts(parser: argparse.ArgumentParser, prog: str):
    """(``prog --help``, its text) for the parser and, recursively, every sub-command's."""
    yield f"{prog} --help", parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _help_texts(sub, f"{prog} {name}")


def test_cli_help_has_no_history_labels(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")   # one help line per sentence argparse wraps
    from pkvrt.tools.cli import build_parser

    texts = list(_help_texts(build_parser(), "pkvrt"))
    assert len(texts) > 1, "the parser built no commands"
    found = [f"{cmd}:{n}: {line}" for cmd, text in texts for n, line in labels_in(text)]
    assert not found, "session/issue labels in the CLI help:\n" + "\n".join(found)
