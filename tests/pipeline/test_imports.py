"""Planning, specs, persisting and choosing an engine load neither MLX nor Ray; pipeline/ has no import cycle."""

import json
import subprocess
import sys
from pathlib import Path

from tests.import_graph import cycles, import_graph

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


def test_no_import_cycle_in_pipeline():
    # a package may import its own submodules (lazily: ``make_engine``); nothing else may go round
    assert cycles(import_graph("pipeline")) == []
