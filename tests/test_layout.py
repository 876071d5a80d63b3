"""The package layout is the architecture: who may import whom, checked from the source.

A step flows routes.toml -> ``pkvrt.policy`` (route, plan) -> ``pkvrt.runtime`` (staging, graphs)
-> ``pkvrt.launch`` (kernels); ``pkvrt.measure`` (workloads, harness, results) and ``pkvrt.tools``
(the CLI) sit around it. Each package's docstring says what it may import; this test reads every
import statement (function-level ones included) and fails on one that crosses a rule, so the
layering cannot erode silently.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "pkvrt"

# package -> pkvrt modules it may import (prefixes); None = anything in pkvrt
ALLOWED = {
    "policy": ("pkvrt._buildspec", "pkvrt._paths", "pkvrt.policy"),
    "launch": ("pkvrt._buildspec", "pkvrt._paths", "pkvrt.launch"),
    "runtime": ("pkvrt._buildspec", "pkvrt._paths", "pkvrt.policy", "pkvrt.launch", "pkvrt.runtime"),
    "measure": ("pkvrt._buildspec", "pkvrt._paths", "pkvrt.policy", "pkvrt.launch", "pkvrt.runtime",
                "pkvrt.measure", "pkvrt.reference"),
    "tools": None,
}
NO_TORCH = ("policy",)   # the policy runs where torch is not needed: `pkvrt plan`, the router


def pkvrt_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``: ``from pkvrt.x import y`` gives both
    ``pkvrt.x`` and ``pkvrt.x.y`` (y may be a module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            if node.module.startswith("pkvrt"):
                out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def modules_of(package: str) -> list[pathlib.Path]:
    return sorted((PKG / package).glob("*.py"))


def test_every_module_is_in_a_package_or_a_known_leaf():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "_build.py", "_buildspec.py", "_paths.py",
                   "reference.py"], "a new top-level module: put it in the package its role names"
    assert sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").is_file()) == \
        sorted(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_follow_the_layering(package):
    allowed = ALLOWED[package]
    bad = []
    for path in modules_of(package):
        for line, mod in pkvrt_imports(path):
            if package in NO_TORCH and (mod == "torch" or mod.startswith("torch.")):
                bad.append(f"{path.name}:{line} imports {mod}")
            if allowed is not None and mod.startswith("pkvrt.") and not mod.startswith(allowed):
                bad.append(f"{path.name}:{line} imports {mod}")
    assert not bad, f"pkvrt/{package}/ may import only {allowed}:\n" + "\n".join(bad)


@pytest.mark.parametrize("leaf", ["_buildspec.py", "_paths.py", "reference.py"])
def test_leaf_modules_import_nothing_of_pkvrt(leaf):
    assert [m for _, m in pkvrt_imports(PKG / leaf) if m.startswith("pkvrt")] == []


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_docstring_names_its_modules(package):
    doc = ast.get_docstring(ast.parse((PKG / package / "__init__.py").read_text())) or ""
    assert "May import" in doc, f"pkvrt/{package}/__init__.py: say what the package may import"
    missing = [p.stem for p in modules_of(package)
               if p.name != "__init__.py" and f"pkvrt.{package}.{p.stem}" not in doc]
    assert not missing, f"pkvrt/{package}/__init__.py does not name {missing}"


def test_the_readme_layout_table_names_every_package():
    readme = (PKG.parent / "README.md").read_text()
    table = readme[readme.index("## Layout"):]
    for package in ALLOWED:
        assert f"`pkvrt/{package}/`" in table


def test_a_crossing_import_is_caught(tmp_path):
    """The checker itself: a policy module importing the runtime is reported."""
    f = tmp_path / "x.py"
    f.write_text("def g():\n    from pkvrt.runtime import Runtime\n    import torch\n")
    mods = [m for _, m in pkvrt_imports(f)]
    assert "pkvrt.runtime" in mods and "pkvrt.runtime.Runtime" in mods and "torch" in mods
    assert not "pkvrt.runtime".startswith(ALLOWED["policy"])
