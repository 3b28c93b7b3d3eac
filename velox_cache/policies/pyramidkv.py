"""PyramidKV: per-layer budgets that taper with depth, fixed at build time."""

from ..budgets.allocators import PyramidBudget
from ..cache.base import EvictingKVCache
from ..cache.signals import CumulativeMass


class PyramidKVCache(EvictingKVCache):
    """One layer of PyramidKV.

    Its budget is ``config.resolved_budget``, which ``KVCacheBuilder.for_model``
    fills in from ``pyramid_budgets`` (the ``PyramidBudget`` allocator);
    without it (``KVCacheFactory.create``) the layer keeps the average
    ``budget`` like a uniform layer.

    As in the PyramidKV paper, the layer compresses once when prefill ends,
    keeping what the prompt's last ``window`` queries attend to (max-pooled
    over ``kernel``), then keeps its budget during decoding by cumulative
    attention mass (H2O). ``eviction='continuous'`` with
    ``selection='cumulative'`` evicts by H2O mass after every chunk instead
    (bounded memory during prefill, at a cost in recall).
    """

    method = "pyramidkv"
    allocator = PyramidBudget
    default_eviction = "prefill_end"
    default_selection = "window"
    signal = CumulativeMass

    @property
    def pyramid_kept_bytes(self) -> int:
        """Alias of ``kept_bytes`` (the original library's name)."""
        return self.kept_bytes
