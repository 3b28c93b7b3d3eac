"""The policy registry: every config method has one class; a base class or a duplicate is refused."""

import pytest

from velox_cache.cache.base import EvictingKVCache
from velox_cache.config import METHODS
from velox_cache.policies import POLICIES, H2OCache
from velox_cache.policies.registry import PolicyRegistry


def test_every_method_has_exactly_its_class():
    assert tuple(POLICIES) == METHODS
    assert all(policy.method == method for method, policy in POLICIES.items())


def test_the_evicting_base_is_not_a_policy():
    assert EvictingKVCache.method is None
    with pytest.raises(TypeError, match="names its own `method`"):
        PolicyRegistry(METHODS).register(EvictingKVCache)


def test_a_policy_that_forgets_its_method_does_not_replace_the_one_it_inherits_from():
    class Forgetful(H2OCache):
        """Inherits ``method = 'h2o'`` without naming its own."""

    registry = PolicyRegistry(METHODS)
    registry.register(H2OCache)
    with pytest.raises(TypeError, match="Forgetful"):
        registry.register(Forgetful)
    assert registry["h2o"] is H2OCache


def test_a_duplicate_or_unknown_method_is_refused():
    class AnotherH2O(H2OCache):
        method = "h2o"

    class Unknown(H2OCache):
        method = "not-a-method"

    registry = PolicyRegistry(METHODS)
    registry.register(H2OCache)
    with pytest.raises(ValueError, match="already H2OCache"):
        registry.register(AnotherH2O)
    with pytest.raises(ValueError, match="not in velox_cache.config.METHODS"):
        registry.register(Unknown)
    with pytest.raises(ValueError, match="no policy class registered for full"):
        registry.check_complete()


def test_a_policy_whose_timing_differs_from_the_configs_defaults_is_refused():
    """The config fills its ranking's defaults by each method's timing (``DEFAULT_TIMINGS``): they must agree."""
    from velox_cache.config import DEFAULT_TIMINGS

    class Eager(H2OCache):
        method = "h2o"
        default_eviction = "prefill_end"
        default_selection = "window"

    with pytest.raises(ValueError, match="DEFAULT_TIMINGS"):
        PolicyRegistry(METHODS, DEFAULT_TIMINGS).register(Eager)
    for method, policy in POLICIES.items():
        declared = (getattr(policy, "default_eviction", "continuous"), getattr(policy, "default_selection", "cumulative"))
        assert declared == DEFAULT_TIMINGS[method]
