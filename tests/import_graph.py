"""The import graph of one of the project's packages, read from the source (nothing is imported).

An import inside a function counts (it still makes two modules depend on each other); one
under ``if TYPE_CHECKING:`` does not, and neither does a package importing its own submodules.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:`` (imports for annotations, never run)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skipped.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return skipped


def _module_imports(name: str, path: Path, package_name: str) -> set[str]:
    """The modules of ``package_name`` (and names in them) that module ``name`` imports, at load time or in a function."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {module for module in found if module == package_name or module.startswith(package_name + ".")}


def import_graph(package_name: str) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports (its own submodules, if a package, left out)."""
    folder = ROOT / package_name
    modules = {}
    for path in folder.rglob("*.py"):
        name = (package_name + "." + ".".join(path.relative_to(folder).with_suffix("").parts)).removesuffix(".__init__")
        modules[name] = path
    return {
        name: {
            m
            for m in _module_imports(name, path, package_name)
            if m in modules and m != name and not m.startswith(name + ".")
        }
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every module that an import path leads back to, with one such path."""

    def cycle_from(start: str) -> Optional[list[str]]:
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return trail + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
        return None

    return [cycle for cycle in map(cycle_from, sorted(graph)) if cycle]
