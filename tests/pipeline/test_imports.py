"""Planning, specs, persisting and choosing an engine load neither MLX nor Ray; pipeline/ has no import cycle.

An import inside a function counts (it still makes two modules depend on each other); one
under ``if TYPE_CHECKING:`` does not, and neither does a package importing its own submodules.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

PIPELINE = Path(__file__).resolve().parents[2] / "pipeline"
LIGHT = ["pipeline.plan", "pipeline.spec", "pipeline.persist", "pipeline.rows", "pipeline.reference", "pipeline.engines"]


def test_planning_imports_no_mlx_and_no_ray():
    code = (
        "import importlib, json, sys\n"
        f"for name in {LIGHT!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'mlx_lm', 'ray'})))\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PIPELINE.parent
    )
    assert json.loads(found.stdout) == []


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:`` (imports for annotations, never run)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skipped.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return skipped


def _module_imports(name: str, path: Path) -> set[str]:
    """The pipeline modules (and names in them) that module ``name`` imports, at load time or in a function."""
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
    return {module for module in found if module.startswith("pipeline")}


def test_no_import_cycle_in_pipeline():
    modules = {}
    for path in PIPELINE.rglob("*.py"):
        name = ("pipeline." + ".".join(path.relative_to(PIPELINE).with_suffix("").parts)).removesuffix(".__init__")
        modules[name] = path
    # a package may import its own submodules (lazily: ``make_engine``); nothing else may go round
    graph = {
        name: {m for m in _module_imports(name, path) if m in modules and m != name and not m.startswith(name + ".")}
        for name, path in modules.items()
    }

    def cycle_from(start):
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

    cycles = [cycle for cycle in map(cycle_from, sorted(modules)) if cycle]
    assert cycles == []
