"""Timings answer a layer's events; allocators give its budget. Both are plain objects, tested alone."""

import pytest

from velox_cache import KVCacheConfig, pyramid_budgets
from velox_cache.budgets.allocators import PyramidBudget, UniformBudget
from velox_cache.cache.timing import make_timing
from velox_cache.policies.squeeze import SqueezeBudget


@pytest.mark.parametrize(
    "eviction, selection, evicts_while_prefilling, ranks_by_window",
    [
        ("continuous", "cumulative", True, False),
        ("prefill_end", "window", False, True),
        ("prefill_end", "cumulative", False, False),
        ("streaming", "window", False, True),
    ],
)
def test_every_timing_evicts_while_decoding(eviction, selection, evicts_while_prefilling, ranks_by_window):
    timing = make_timing(eviction, selection)
    assert timing.evicts(prefilling=False)
    assert timing.evicts(prefilling=True) is evicts_while_prefilling
    assert timing.on_prefill_end() is ranks_by_window


def test_streaming_selects_each_chunk_once_unless_a_probe_ranked_it():
    timing = make_timing("streaming", "window")
    assert not timing.selection_due()
    timing.on_chunk_end()
    assert timing.selection_due() and not timing.selection_due(), "due once"
    timing.on_chunk_end()
    assert timing.on_probe_end(), "the probe's ranking evicts"
    assert not timing.selection_due(), "the probe did the chunk's selection"


@pytest.mark.parametrize("eviction", ["continuous", "prefill_end"])
def test_only_streaming_is_ranked_by_probes(eviction):
    timing = make_timing(eviction, "window")
    timing.on_chunk_end()
    assert not timing.uses_probes and not timing.on_probe_end() and not timing.selection_due()


def test_allocators_give_the_stack_its_budgets():
    config = KVCacheConfig(method="pyramidkv", budget=64, n_sink=4)
    assert PyramidBudget.layer_budgets(config, 6) == pyramid_budgets(6, 64, 4, config.beta)
    assert UniformBudget.layer_budgets(config, 6) == [None] * 6
    assert UniformBudget.shared_coordinator(config, [0, 1]) is None
    assert UniformBudget(KVCacheConfig(method="h2o", budget=64, resolved_budget=80)).budget() == 80


def test_squeeze_allocator_keeps_the_cap_until_settled():
    config = KVCacheConfig(method="squeeze", budget=32)
    coordinator = SqueezeBudget.shared_coordinator(config, [0])
    allocation = SqueezeBudget(config, 0, coordinator)
    coordinator.register(0, allocation)
    assert allocation.budget() == coordinator.cap and allocation.concentration_rows(100) > 0
    allocation.settle()
    assert coordinator.published and allocation.budget() == coordinator.budget(0)
    assert allocation.concentration_rows(100) == 0, "the measure stops once the schedule is published"
