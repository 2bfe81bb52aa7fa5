"""The modules of ``mla_vllm`` import each other one way, and not from inside functions.

Read from the source with ``ast`` (nothing is imported): every ``import
mla_vllm.x`` / ``from mla_vllm.x import ...`` / ``from mla_vllm import x``
anywhere in a module, inside functions and ``TYPE_CHECKING`` blocks included,
plus the package's lazy ``_LAZY`` table, is an edge. The graph must have no
cycle, and no module may import another of this package inside a function
(that is how a cycle hides).
"""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "mla_vllm"
PACKAGE = "mla_vllm"


def _module_name(path: Path) -> str:
    return PACKAGE if path.name == "__init__.py" else f"{PACKAGE}.{path.stem}"


MODULES = {_module_name(p): p for p in sorted(SRC.glob("*.py"))}


def _target(name: str) -> str | None:
    """The package module that importing ``name`` runs (None: not ours)."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else PACKAGE


def _imports(tree: ast.Module) -> list[tuple[str, bool]]:
    """``(module, inside_a_function)`` of each import of this package in ``tree``."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            if isinstance(child, ast.Import):
                for alias in child.names:
                    target = _target(alias.name)
                    if target is not None:
                        found.append((target, in_function))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                target = _target(child.module)
                if target == PACKAGE:  # from mla_vllm import x: x may be a module
                    for alias in child.names:
                        sub = f"{PACKAGE}.{alias.name}"
                        found.append((sub if sub in MODULES else PACKAGE, in_function))
                elif target is not None:
                    found.append((target, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def _lazy_table(tree: ast.Module) -> list[str]:
    """The module names in the package's ``_LAZY = {name: "mla_vllm.x"}`` table."""
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            return [
                v.value
                for v in node.value.values
                if isinstance(v, ast.Constant) and isinstance(v.value, str)
            ]
    return []


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    """Edges between the package's modules, and the imports made inside functions."""
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    hidden: list[str] = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for target, in_function in _imports(tree):
            if target != name:
                edges[name].add(target)
            if in_function:
                hidden.append(f"{name} -> {target}")
        if name == PACKAGE:
            edges[name].update(_lazy_table(tree))
    return edges, hidden


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``edges`` as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_checker_finds_cycles_and_hidden_imports() -> None:
    """The checker itself: a cycle through a function-level import is seen."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    source = "from mla_vllm.x import y\n\ndef f():\n    from mla_vllm import backend\n"
    found = _imports(ast.parse(source))
    assert found == [("mla_vllm.x", False), ("mla_vllm.backend", True)]


def test_every_module_is_seen() -> None:
    edges, _ = _graph()
    assert {"mla_vllm", "mla_vllm.backend", "mla_vllm.config", "mla_vllm.installer"} <= set(edges)
    assert "mla_vllm.backend" in edges["mla_vllm.installer"]  # a real edge is found
    for targets in edges.values():
        assert targets <= set(edges), f"an import of a module that does not exist: {targets}"


def test_imports_run_one_way() -> None:
    edges, _ = _graph()
    cycle = _cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_of_this_package_inside_a_function() -> None:
    _, hidden = _graph()
    assert hidden == []


@pytest.mark.parametrize("module", ["mla_vllm", "mla_vllm.config", "mla_vllm.plugin"])
def test_light_modules_do_not_import_vllm(module: str) -> None:
    """``mla_vllm``, its configuration and its plugin entry point load without vLLM."""
    import subprocess
    import sys

    code = (
        "import sys; import importlib; importlib.import_module(sys.argv[1]); "
        "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')); "
        "assert not bad, bad[:5]"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, module], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_lazy_names_stay_functions_after_their_modules_load() -> None:
    """``mla_vllm.install`` is the function on every access, also once its module has
    been imported (a submodule of the same name would replace it on the package)."""
    import mla_vllm

    first = mla_vllm.install
    importlib.import_module("mla_vllm.installer")
    importlib.import_module("mla_vllm.stats")
    importlib.import_module("mla_vllm.calibration")
    for name in ("install", "uninstall", "get_stats", "reset_stats", "calibrate"):
        assert callable(getattr(mla_vllm, name)), name
        assert not isinstance(getattr(mla_vllm, name), types.ModuleType), name
    assert mla_vllm.install is first
