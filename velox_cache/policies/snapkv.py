"""SnapKV: one-shot compression at the end of prefill from the prompt's last queries."""

from ..budgets.allocators import UniformBudget
from ..cache.base import EvictingKVCache
from ..cache.signals import CumulativeMass


class SnapKVCache(EvictingKVCache):
    """Keeps the tokens that the last ``window`` prompt queries attend to, max-pooled over ``kernel``.

    Pooling keeps neighbouring tokens together (a number split into single
    digits survives whole). During decoding the pooled scores keep
    accumulating attention mass and the budget holds by replacing the
    lowest-ranked token.
    """

    method = "snapkv"
    allocator = UniformBudget
    default_eviction = "prefill_end"
    signal = CumulativeMass
    default_selection = "window"
