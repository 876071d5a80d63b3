"""The package layout is the architecture: who may import whom, checked from the source.

A step flows routes.toml -> ``pkvrt.policy`` (route, plan) -> ``pkvrt.runtime`` (staging, graphs)
-> ``pkvrt.launch`` (kernels); ``pkvrt.measure`` (workloads, harness, results), ``pkvrt.tools``
(the CLI) and ``pkvrt.integrations`` (other libraries' models on the runtime) sit around it. Each package's docstring says what it may import; this test reads every
import statement (function-level ones included) and fails on one that crosses a rule, so the
layering cannot erode silently.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from pkvrt._paths import CHECKOUT

PKG = CHECKOUT / "pkvrt"

# package -> pkvrt modules it may import (prefixes); None = anything in pkvrt
ALLOWED = {
    "policy": ("pkvrt._buildspec", "pkvrt._paths", "pkvrt.policy"),
    "launch": ("pkvrt._buildspec", "pkvrt._paths", "pkvrt.launch"),
    "runtime": ("pkvrt._buildspec", "pkvrt._paths", "pkvrt.policy", "pkvrt.launch", "pkvrt.runtime"),
    "measure": ("pkvrt._buildspec", "pkvrt._paths", "pkvrt.policy", "pkvrt.launch", "pkvrt.runtime",
                "pkvrt.measure", "pkvrt.reference"),
    "integrations": ("pkvrt._paths", "pkvrt.runtime", "pkvrt.reference", "pkvrt.integrations"),
    "tools": None,
}
# the policy runs where no GPU stack is needed (`pkvrt plan`, the router): not even indirectly
NOT_LOADED_BY_POLICY = ("torch", "cuda", "flashinfer", "matplotlib")


def pkvrt_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``: ``from pkvrt.x import y`` gives both
    ``pkvrt.x`` and ``pkvrt.x.y`` (y may be a module); a relative import gives ``"."``, and a
    module named as a string to ``import_module`` gives that string."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                out.append((node.lineno, "."))
            elif node.module:
                if node.module != "pkvrt":   # `from pkvrt import x` is x's import, not pkvrt's
                    out.append((node.lineno, node.module))
                if node.module.startswith("pkvrt"):
                    out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) \
                == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            out.append((node.lineno, str(node.args[0].value)))
    return out


def modules_of(package: str) -> list[pathlib.Path]:
    return sorted((PKG / package).rglob("*.py"))


def test_every_module_is_in_a_package_or_a_known_leaf():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "_build.py", "_buildspec.py", "_paths.py",
                   "reference.py"], "a new top-level module: put it in the package its role names"
    folders = sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*")
                     if p.is_dir() and not p.name.startswith(("_", ".")) and any(p.glob("*.py")))
    assert folders == sorted(ALLOWED), "a package folder outside the layering (or without __init__.py)"
    for package in ALLOWED:
        assert (PKG / package / "__init__.py").is_file()


def test_pyproject_ships_every_package():
    """setuptools lists the packages by hand: a new one missing there would be left out of the wheel."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())
    assert sorted(project["tool"]["setuptools"]["packages"]) == sorted(
        ["pkvrt"] + [f"pkvrt.{p}" for p in ALLOWED])


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_follow_the_layering(package):
    allowed = ALLOWED[package]
    bad = []
    for path in modules_of(package):
        for line, mod in pkvrt_imports(path):
            where = f"{path.relative_to(PKG)}:{line} imports {mod!r}"
            if mod == ".":
                bad.append(where + " (relative imports: name the module, pkvrt.<package>.<module>)")
            elif allowed is not None and mod == "pkvrt":
                bad.append(where + " (`import pkvrt` reaches everything through its lazy names)")
            elif allowed is not None and mod.startswith("pkvrt.") and not mod.startswith(allowed):
                bad.append(where)
    assert not bad, f"pkvrt/{package}/ may import only {allowed}:\n" + "\n".join(bad)


def test_the_policy_loads_no_gpu_stack():
    """Indirect imports too: every policy module imported in a fresh interpreter."""
    mods = [f"pkvrt.policy.{p.stem}" for p in modules_of("policy") if p.stem != "__init__"]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            f"print(sorted(n for n in sys.modules if n.split('.')[0] in {NOT_LOADED_BY_POLICY!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=CHECKOUT).stdout.strip()
    assert out == "[]", f"importing the policy loaded {out}"


@pytest.mark.parametrize("leaf", ["_buildspec.py", "_paths.py", "reference.py"])
def test_leaf_modules_import_nothing_of_pkvrt(leaf):
    assert [m for _, m in pkvrt_imports(PKG / leaf) if m.startswith("pkvrt")] == []


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_docstring_names_its_modules_and_its_rule(package):
    doc = ast.get_docstring(ast.parse((PKG / package / "__init__.py").read_text())) or ""
    assert "May import" in doc, f"pkvrt/{package}/__init__.py: say what the package may import"
    missing = [p.stem for p in modules_of(package)
               if p.name != "__init__.py" and f"pkvrt.{package}.{p.stem}" not in doc]
    assert not missing, f"pkvrt/{package}/__init__.py does not name {missing}"
    rule = doc[doc.index("May import"):]
    others = [p for p in ALLOWED if p != package and (ALLOWED[package] is not None and
                                                      f"pkvrt.{p}" not in ALLOWED[package])]
    unsaid = [p for p in others if p not in rule]
    assert not unsaid, f"pkvrt/{package}/__init__.py: its rule does not say it never imports {unsaid}"


def test_the_readme_layout_table_names_every_package():
    readme = (CHECKOUT / "README.md").read_text()
    table = readme[readme.index("## Layout"):]
    for package in ALLOWED:
        assert f"`pkvrt/{package}/`" in table
    for leaf in ("_paths.py", "_buildspec.py", "reference.py"):
        assert f"`pkvrt/{leaf}`" in table


def test_a_crossing_import_is_caught(tmp_path):
    """The checker itself: each way of reaching another layer is reported."""
    f = tmp_path / "x.py"
    f.write_text("import pkvrt\nfrom . import sibling\nfrom pkvrt import Runtime\n"
                 "def g():\n    from pkvrt.runtime import Runtime\n    import torch\n"
                 "    importlib.import_module('pkvrt.launch.ops')\n")
    mods = [m for _, m in pkvrt_imports(f)]
    for want in ("pkvrt", ".", "pkvrt.Runtime", "pkvrt.runtime", "pkvrt.runtime.Runtime", "torch",
                 "pkvrt.launch.ops"):
        assert want in mods
    assert not "pkvrt.runtime".startswith(ALLOWED["policy"])
