"""StreamingLLM: attention sinks plus the most recent tokens."""

from ..base import EvictingKVCache
from ..signals import Recency


class StreamingLLMCache(EvictingKVCache):
    """Keeps the ``n_sink`` first tokens and the most recent ones; no attention scores needed."""

    method = "streaming"
    signal = Recency
