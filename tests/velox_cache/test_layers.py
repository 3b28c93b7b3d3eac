"""velox_cache's folders are its layers: imports run downward only, and nothing goes round.

generation/ -> builder.py -> policies/ -> cache/ -> kernels/ and budgets/ (config.py below them all);
the package's own ``__init__`` re-exports from every layer.
"""

import pytest

from tests.import_graph import cycles, import_graph

# What each layer may import besides itself (ARCHITECTURE.md, "velox_cache in layers").
MAY_IMPORT = {
    "config": set(),
    "kernels": set(),
    "budgets": {"config"},
    "cache": {"config", "kernels", "budgets"},
    "policies": {"config", "kernels", "budgets", "cache"},
    "builder": {"config", "kernels", "budgets", "cache", "policies"},
    "generation": {"config", "kernels", "budgets", "cache", "policies", "builder"},
}

GRAPH = import_graph("velox_cache")


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "velox_cache"


def test_no_import_cycle_in_velox_cache():
    assert cycles(GRAPH) == []


def test_every_module_belongs_to_a_layer():
    strays = [m for m in GRAPH if layer_of(m) not in MAY_IMPORT and m != "velox_cache"]
    assert strays == [], "put each module in the folder of its layer (or add the layer to MAY_IMPORT)"


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_a_layer_imports_only_the_layers_below_it(layer):
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if layer_of(module) == layer
        for target in targets
        if layer_of(target) not in MAY_IMPORT[layer] | {layer}
    )
    assert upward == []
