"""TOVA: rank tokens by the current step's attention only (memoryless)."""

from ..budgets.allocators import UniformBudget
from ..cache.base import EvictingKVCache
from ..cache.signals import CurrentAttention


class TOVACache(EvictingKVCache):
    """Evicts the token the latest query attends to least, continuously."""

    method = "tova"
    allocator = UniformBudget
    default_eviction = "continuous"
    signal = CurrentAttention
