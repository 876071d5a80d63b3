"""The CLI's help: every option of the commands in pkvrt/tools/ documented, and neither the help
texts nor the docstrings of those modules carry work-log labels ("session 14", "issue 15",
"#13", "call 4"): they say what the code does, or name dates, commits and result files."""

from __future__ import annotations

import argparse
import ast
import importlib
import re

import pytest

from pkvrt.tools import cli

COMMANDS = ("routes", "plan", "bench", "calibrate", "doctor")   # report.py has its own owner
MODULES = ("pkvrt.tools", "pkvrt.tools.cli", "pkvrt.tools.bench", "pkvrt.tools.plan_cmd",
           "pkvrt.tools.doctor", "pkvrt.tools.calibrate", "pkvrt.tools.calibrate_host",
           "pkvrt.tools.sweeps")
LABEL = re.compile(r"\b(?:sessions?|issues?|calls?)\s*#?\d+|#\d+", re.I)


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Command path ("bench serving") -> its parser, for the commands of COMMANDS."""
    out = {}

    def walk(parser, path):
        out[path] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}".strip())

    top = cli.build_parser()
    walk(top, "")
    return {k: v for k, v in out.items() if k.split(" ")[0] in COMMANDS}


@pytest.mark.parametrize("path", sorted(parsers()))
def test_every_option_has_help(path):
    parser = parsers()[path]
    missing = [a.option_strings or a.dest for a in parser._actions
               if not a.help and not isinstance(a, argparse._HelpAction)]
    assert missing == [], f"pkvrt {path}: options without help"


@pytest.mark.parametrize("path", sorted(parsers()))
def test_help_texts_have_no_work_log_labels(path):
    text = parsers()[path].format_help()
    assert LABEL.findall(text) == [], f"pkvrt {path} --help"


@pytest.mark.parametrize("name", MODULES)
def test_docstrings_have_no_work_log_labels(name):
    module = importlib.import_module(name)
    tree = ast.parse(open(module.__file__, encoding="utf-8").read())
    docs = [ast.get_docstring(n) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    found = [(m, d.splitlines()[0]) for d in docs if d for m in LABEL.findall(d)]
    assert found == []


def test_the_label_pattern():
    for text in ("session 14", "Session 6", "issue 15", "issue #13", "#13 item 3", "call 4",
                 "calls 3"):
        assert LABEL.search(text), text
    for text in ("8 calls back to back", "run() calls per plan", "2026-12-01", "sm_90", "B8-32K"):
        assert not LABEL.search(text), text
