"""StreamingLLM: attention sinks plus the most recent tokens."""

from ..budgets.allocators import UniformBudget
from ..cache.base import EvictingKVCache
from ..cache.signals import Recency


class StreamingLLMCache(EvictingKVCache):
    """Keeps the ``n_sink`` first tokens and the most recent ones; no attention scores needed."""

    method = "streaming"
    allocator = UniformBudget
    default_eviction = "continuous"
    signal = Recency
