"""Every spec the checks accept builds its stacks: each variant's and each frontier point's (issue 54, item 1)."""

import itertools

import pytest

from pipeline.runner import EXIT_BAD_INPUT
from pipeline.spec import SpecError, parse_spec
from tests.pipeline.helpers import invoke

METHODS = ("h2o", "tova", "snapkv", "streaming", "pyramidkv", "squeeze")
# Each field a compressed variant or the frontier can set, with the values that change what is built.
VARIANT_FIELDS = {
    "eviction": (None, "continuous", "prefill_end", "streaming", "auto"),
    "selection": (None, "cumulative", "window", "reconstruction"),
    "kv_bits": (None, 8, 4),
    "head_budgets": (None, "adaptive"),
    "scoring": (None, "key_proxy"),
    "n_sink": (None, 8),
    "budget": (9, "10%"),
}
FRONTIER_FIELDS = {
    "budgets": ([], [5, 64, "25%"]),
    "bits": ([], [None, 8, 4]),
}


def _spec(method, variant_fields, frontier):
    variant = {"name": "v", "method": method, **{k: v for k, v in variant_fields.items() if v is not None}}
    return {
        "name": "t",
        "model": "m",
        "input": {"path": "x.parquet", "id_column": "id", "text_column": "text"},
        "variants": [{"name": "full", "method": "full"}, variant],
        "frontier": frontier,
    }


def _combinations(method):
    names, frontier_names = list(VARIANT_FIELDS), list(FRONTIER_FIELDS)
    for values in itertools.product(*VARIANT_FIELDS.values()):
        for frontier_values in itertools.product(*FRONTIER_FIELDS.values()):
            yield _spec(method, dict(zip(names, values)), dict(zip(frontier_names, frontier_values)))


@pytest.mark.parametrize("method", METHODS)
def test_every_accepted_combination_builds_each_variants_and_frontier_points_stacks(method, tiny_model):
    from velox_cache import KVCacheBuilder

    model, _ = tiny_model
    accepted = refused = 0
    for raw in _combinations(method):
        try:
            spec = parse_spec(raw)
        except SpecError:
            refused += 1
            continue
        accepted += 1
        variant = spec.variants[1]
        configs = [variant.for_document(True).cache, variant.for_document(False).cache]
        bits_levels = spec.frontier.bits or [variant.cache.kv_bits]
        configs += [variant.for_document(True).at_point(budget, bits)
                    for budget in spec.frontier.budgets for bits in bits_levels]
        for config in configs:  # a ConfigError here is a spec the checks let through that cannot run
            assert KVCacheBuilder.for_model(model, config, prompt_tokens=200, new_tokens=8), raw
    assert accepted and refused, (accepted, refused)


@pytest.mark.parametrize(
    "frontier, variant_fields, message",
    [
        ({"budgets": [64, 4]}, {}, "frontier.budgets[1]: variant 'pyramidkv-128' must keep at least 5 tokens"),
        ({"budgets": [8]}, {"n_sink": 8}, "frontier.budgets[0]: variant 'pyramidkv-128' must keep at least 9 tokens"),
        ({"budgets": [64], "bits": [None, 8]}, {"head_budgets": "adaptive"},
         "frontier.bits[1]: variant 'pyramidkv-128' cannot be measured at 8"),
    ],
)
def test_a_frontier_point_no_variant_can_run_is_refused_at_load_naming_the_field_and_variant(
        job, frontier, variant_fields, message):
    compressed = {"name": "pyramidkv-128", "method": "pyramidkv", "budget": 128, **variant_fields}
    result = invoke("run", job({"frontier": frontier, "variants": [{"method": "full"}, compressed]}))
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert message in result.output and "Traceback" not in result.output and "unexpected error" not in result.output
