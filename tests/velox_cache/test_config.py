"""KVCacheConfig validation and the original library's field names."""

import pytest

from velox_cache import ConfigError, KVCacheConfig


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(method="lru"), "method"),
        (dict(budget=4, n_sink=4), "budget"),
        (dict(budget="256"), "budget"),
        (dict(budget=True), "budget"),
        (dict(n_sink=-1), "n_sink"),
        (dict(beta=0.5), "beta"),
        (dict(strength=2), "strength"),
        (dict(scoring="magic"), "scoring"),
        (dict(eviction="sometimes"), "eviction"),
        (dict(kv_dtype="int8"), "kv_dtype"),
        (dict(kernel=4), "kernel"),
        (dict(stream_kernel=6), "stream_kernel"),
        (dict(stream_kernel=0), "stream_kernel"),
        (dict(lookahead=-1), "lookahead"),
        (dict(stream_lookahead=-2), "stream_lookahead"),
        (dict(method="h2o", lookahead=4), "lookahead"),
        (dict(method="pyramidkv", eviction="continuous", lookahead=4), "lookahead"),
        (dict(window=0), "window"),
        (dict(resolved_budget=2), "resolved_budget"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        KVCacheConfig(**kwargs)


def test_original_field_names_are_aliases():
    config = KVCacheConfig(method="pyramidkv", pyramid_budget=128, pyramid_n_sink=2, pyramid_resolved_budget=64)
    assert (config.budget, config.n_sink, config.resolved_budget) == (128, 2, 64)
    assert config.pyramid_budget == 128 and config.pyramid_resolved_budget == 64
    squeeze = KVCacheConfig(method="squeeze", squeeze_budget=96, squeeze_n_sink=8, squeeze_resolved_budget=None)
    assert (squeeze.squeeze_budget, squeeze.squeeze_n_sink, squeeze.squeeze_resolved_budget) == (96, 8, None)
    squeeze.squeeze_budget = 50
    assert squeeze.budget == 50


def test_conflicting_alias_is_an_error():
    with pytest.raises(ConfigError, match="pyramid_budget"):
        KVCacheConfig(budget=100, pyramid_budget=200)


def test_from_dict_suggests_the_field_meant():
    with pytest.raises(ConfigError, match=r"cache.bugdet: unknown field \(did you mean 'budget'\?\)"):
        KVCacheConfig.from_dict({"method": "squeeze", "bugdet": 100})
    with pytest.raises(ConfigError, match=r"^cache.budget"):
        KVCacheConfig.from_dict({"budget": -3})
    assert KVCacheConfig.from_dict({"method": "snapkv", "snapkv_window": 16}).window == 16


@pytest.mark.parametrize("value", ["0%", "150%", "25", "%", "a%", "-5%"])
def test_bad_percentage_budgets_name_the_field(value):
    with pytest.raises(ConfigError, match="^budget"):
        KVCacheConfig(budget=value)


@pytest.mark.parametrize(
    "value, prompt_tokens, expected", [("25%", 1000, 250), ("12.5%", 64, 8), ("100%", 300, 300), ("1%", 10, 5)]
)
def test_percentage_budgets_resolve_per_prompt(value, prompt_tokens, expected):
    config = KVCacheConfig(method="pyramidkv", budget=value)
    assert config.budget_fraction == pytest.approx(float(value[:-1]) / 100)
    assert config.resolved_for(prompt_tokens).budget == expected  # at least n_sink + 1
    assert KVCacheConfig(budget=256).resolved_for(10).budget == 256


def test_a_percentage_budget_is_resolved_by_the_builder(tiny_model):
    from velox_cache import KVCacheBuilder, KVCacheFactory, pyramid_budgets

    model, _ = tiny_model
    config = KVCacheConfig(method="pyramidkv", budget="25%")
    caches = KVCacheBuilder.for_model(model, config, prompt_tokens=400)
    assert [c.layer_budget for c in caches] == pyramid_budgets(4, 100, 4, 3.0)
    assert KVCacheFactory.create(KVCacheConfig(method="h2o", budget="50%"), prompt_tokens=64).layer_budget == 32
    with pytest.raises(ConfigError, match="budget.*prompt_tokens"):
        KVCacheBuilder.for_model(model, config)
    assert len(KVCacheBuilder.for_model(model, KVCacheConfig(method="full", budget="25%"))) == 4


@pytest.mark.parametrize("value", [-0.1, 1.5, "half"])
def test_mass_weight_outside_zero_to_one_names_the_field(value):
    with pytest.raises(ConfigError, match="mass_weight"):
        KVCacheConfig(method="pyramidkv", mass_weight=value)


@pytest.mark.parametrize(
    "recent, budget, expected", [(None, 400, 50), (7, 400, 7), ("25%", 400, 100), ("25%", "50%", 50), ("100%", 9, 9)]
)
def test_the_recent_window_is_tokens_or_a_share_of_the_budget(recent, budget, expected):
    config = KVCacheConfig(method="pyramidkv", budget=budget, recent=recent).resolved_for(400)
    assert config.recent_window == expected


@pytest.mark.parametrize("value", ["0%", "150%", "25", -1, 2.5])
def test_bad_recent_windows_name_the_field(value):
    with pytest.raises(ConfigError, match="^recent"):
        KVCacheConfig(recent=value)


def test_mass_weight_defaults_per_policy_and_an_explicit_value_wins():
    from velox_cache import KVCacheFactory

    def weight(**fields):
        return KVCacheFactory.create(KVCacheConfig(budget=64, **fields)).mass_weight

    assert weight(method="squeeze") == 0.3, "squeeze blends at prefill end (measured: bench/RESULTS.md, Fidelity)"
    assert weight(method="squeeze", eviction="streaming") == 0.0, "not under streaming (needles)"
    assert weight(method="pyramidkv") == weight(method="snapkv") == 0.0, "the window alone keeps needles"
    assert weight(method="squeeze", mass_weight=0.0) == 0.0
    assert weight(method="pyramidkv", mass_weight=0.5) == 0.5


WINDOW_POLICIES = ["snapkv", "pyramidkv", "squeeze"]


@pytest.mark.parametrize("method", WINDOW_POLICIES)
def test_the_ranking_defaults_are_the_best_measured_per_timing(method):
    """At prefill end: token by token with a 16-token look-ahead; streaming: pooled over 31, no draft."""
    from velox_cache import KVCacheFactory

    config = KVCacheConfig(method=method, budget=128)
    assert (config.kernel, config.lookahead, config.stream_kernel, config.stream_lookahead) == (None, 16, 31, 0)
    prefill_end = KVCacheFactory.create(config)
    assert (prefill_end.eviction, prefill_end.lookahead) == ("prefill_end", 16)
    assert prefill_end.selector.pooling == 31, "no draft has joined the window yet"
    prefill_end.selector.widen(prefill_end.lookahead)  # what a look-ahead does (phases.look_ahead)
    assert prefill_end.selector.pooling == 1
    streamed = KVCacheFactory.create(KVCacheConfig(method=method, budget=128, eviction="streaming"))
    assert (streamed.selector.pooling, streamed.lookahead) == (31, 0)
    streamed.selector.widen(16)
    assert streamed.selector.pooling == 31


@pytest.mark.parametrize("method", WINDOW_POLICIES)
def test_a_prefill_end_ranking_named_does_not_follow_the_config_into_streaming(method):
    """A copy that streams (a job's ``eviction: auto`` past the context) ranks by the streaming ranking."""
    import dataclasses

    from velox_cache import KVCacheFactory

    named = KVCacheConfig(method=method, budget=128, kernel=1, lookahead=16, stream_headroom=2)
    streamed = KVCacheFactory.create(dataclasses.replace(named, eviction="streaming"))
    assert (streamed.eviction, streamed.selector.pooling, streamed.lookahead) == ("streaming", 31, 0)
    chosen = dataclasses.replace(named, stream_kernel=15, stream_lookahead=4, eviction="streaming")
    assert (KVCacheFactory.create(chosen).selector.pooling, KVCacheFactory.create(chosen).lookahead) == (15, 4)
    back = KVCacheFactory.create(dataclasses.replace(named, eviction="prefill_end"))
    assert (back.selector.pooling, back.lookahead) == (1, 16)


def test_a_config_that_streams_and_names_a_ranking_streams_with_it():
    from velox_cache import KVCacheFactory

    config = KVCacheConfig(method="pyramidkv", budget=64, eviction="streaming", kernel=7, lookahead=4)
    assert (config.stream_kernel, config.stream_lookahead) == (7, 4)
    cache = KVCacheFactory.create(config)
    assert (cache.selector.pooling, cache.lookahead) == (7, 4)


@pytest.mark.parametrize("method", ["full", "h2o", "tova", "streaming"])
def test_policies_that_rank_by_no_window_get_no_look_ahead(method):
    config = KVCacheConfig(method=method, budget=64)
    assert config.lookahead == 0 and config.stream_lookahead == 0
    assert KVCacheConfig(method="h2o", budget=64, eviction="prefill_end", selection="window").lookahead == 16
    assert KVCacheConfig(method="squeeze", budget=64, selection="reconstruction").lookahead == 0
