"""StreamingLLM: attention sinks plus the most recent tokens."""

from ..allocators import UniformBudget
from ..base import EvictingKVCache
from ..signals import Recency


class StreamingLLMCache(EvictingKVCache):
    """Keeps the ``n_sink`` first tokens and the most recent ones; no attention scores needed."""

    method = "streaming"
    allocator = UniformBudget
    default_eviction = "continuous"
    signal = Recency
