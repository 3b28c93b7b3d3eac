"""Stacks built for a known prompt get budgets fitted to it (``fit_budgets``), every allocator alike."""

import pytest

from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases, pyramid_budgets
from velox_cache.budgets.schedules import fit_budgets
from velox_cache.generation.routing import attention_routing


def _budgets(stack):
    return [cache.layer_budget for cache in stack]


def test_pyramid_budgets_are_fitted_to_the_prompt_and_not_without_one(tiny_model):
    model, _ = tiny_model
    config = KVCacheConfig(method="pyramidkv", budget=32)
    n = len(model.layers)
    assert _budgets(KVCacheBuilder.for_model(model, config, prompt_tokens=20, new_tokens=6)) == fit_budgets(
        pyramid_budgets(n, 32), 20, 6
    )
    assert _budgets(KVCacheBuilder.for_model(model, config)) == pyramid_budgets(n, 32)
    unfitted = KVCacheConfig(method="pyramidkv", budget=32, fit_budgets=False)
    assert _budgets(KVCacheBuilder.for_model(model, unfitted, prompt_tokens=20, new_tokens=6)) == pyramid_budgets(n, 32)


def test_uniform_budgets_are_capped_at_what_a_layer_can_hold(tiny_model):
    model, _ = tiny_model
    stack = KVCacheBuilder.for_model(model, KVCacheConfig(method="snapkv", budget=64), prompt_tokens=20, new_tokens=6)
    assert _budgets(stack) == [26] * len(model.layers)


@pytest.mark.parametrize("prompt_length", [20, 60])
def test_the_squeeze_schedule_is_fitted_when_it_is_published(tiny_model, prompt_length):
    model, tokenizer = tiny_model
    tokens = (tokenizer.encode("Squeeze measures every layer before it publishes. " * 10) * 3)[:prompt_length]
    config = KVCacheConfig(method="squeeze", budget=32, strength=1.0)
    stack = KVCacheBuilder.for_model(model, config, prompt_tokens=prompt_length, new_tokens=4)
    with attention_routing(model, [config]):
        prefill_phases(model, stack, document=tokens, chunk_size=16, max_new_tokens=4)
    coordinator = stack[0].coordinator
    assert max(coordinator.budgets) <= prompt_length + 4
    assert sum(coordinator.budgets) == min(32 * len(stack), (prompt_length + 4) * len(stack))
    if prompt_length <= 32:
        assert min(coordinator.budgets) >= prompt_length  # the prompt fits the budget: nothing compressed
        assert all(cache.slots.stored == prompt_length for cache in stack)
