"""TOVA: rank tokens by the current step's attention only (memoryless)."""

from ..base import EvictingKVCache


class TOVACache(EvictingKVCache):
    """Evicts the token the latest query attends to least, continuously."""

    method = "tova"
    score_signal = "current"
