"""One routing rule: which attention a model runs on for caches built from some configs."""

import pytest

from pipeline.generation import generate
from pipeline.spec import GenerationSpec
from velox_cache import KVCacheConfig, batch_generate
from velox_cache.generation.routing import attention_routing, wants_observation
from velox_cache.kernels.observe import is_observing, is_routed


@pytest.mark.parametrize(
    "scoring, method, observed",
    [("observed", "snapkv", True), (None, "snapkv", True), ("key_proxy", "snapkv", False), (None, "full", False)],
)
def test_scoring_left_open_is_observed_wherever_the_model_can_be(tiny_model, scoring, method, observed):
    model, _ = tiny_model
    config = KVCacheConfig(method=method, budget=16, scoring=scoring)
    assert wants_observation(config) is observed
    with attention_routing(model, [config]):
        assert is_routed() and is_observing() is observed


def test_one_observed_row_observes_the_whole_batch(tiny_model):
    model, _ = tiny_model
    configs = [KVCacheConfig(method="full"), KVCacheConfig(method="pyramidkv", budget=16, scoring="key_proxy"),
               KVCacheConfig(method="snapkv", budget=16)]
    with attention_routing(model, configs):
        assert is_observing()
    with attention_routing(model, configs[:2]):
        assert is_routed() and not is_observing()


def test_the_job_runner_and_the_library_score_an_open_config_alike(tiny_model):
    """``scoring=None`` (left open): the runner's ``generate`` and ``batch_generate`` both observe."""
    model, tokenizer = tiny_model
    tokens = tokenizer.encode("Routing is decided in one place, for the library and the runner. " * 3)
    config = KVCacheConfig(method="snapkv", budget=16)
    result = generate(model, tokenizer, tokens, config, GenerationSpec(max_tokens=6, prefill_step_size=16))
    assert {row["scoring"] for row in result.layer_stats} == {"observed"}
    library = batch_generate(model, tokenizer, [tokens], config, max_tokens=6, prefill_step_size=16)
    assert library.token_ids[0] == result.token_ids
