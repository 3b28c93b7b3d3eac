"""PyramidKV: H2O scoring with per-layer budgets that taper with depth, fixed at build time."""

from ..base import EvictingKVCache


class PyramidKVCache(EvictingKVCache):
    """One layer of PyramidKV.

    Its budget is ``config.resolved_budget``, which ``KVCacheBuilder.for_model``
    fills in from ``pyramid_budgets``; without it (``KVCacheFactory.create``)
    the layer keeps the average ``budget`` like a uniform H2O layer.
    """

    method = "pyramidkv"
    score_signal = "cumulative"

    @property
    def pyramid_kept_bytes(self) -> int:
        """Alias of ``kept_bytes`` (the original library's name)."""
        return self.kept_bytes
