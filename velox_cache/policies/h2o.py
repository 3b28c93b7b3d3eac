"""H2O: cumulative attention mass (heavy hitters) plus a protected recent window."""

from ..budgets.allocators import UniformBudget
from ..cache.base import EvictingKVCache
from ..cache.signals import CumulativeMass


class H2OCache(EvictingKVCache):
    """Evicts the tokens with the least cumulative attention mass, continuously, at a uniform budget."""

    method = "h2o"
    allocator = UniformBudget
    default_eviction = "continuous"
    signal = CumulativeMass
