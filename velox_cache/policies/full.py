"""The full cache: mlx-lm's ``KVCache`` with Velox accounting (the quality baseline)."""

from __future__ import annotations

from typing import Optional

from mlx_lm.models.cache import KVCache

from ..budgets.allocators import UniformBudget
from ..cache.accounting import CacheAccounting
from ..config import KVCacheConfig


class FullKVCache(CacheAccounting, KVCache):
    """Keeps every token; logits are exactly those of mlx-lm's ``KVCache``."""

    method = "full"
    allocator = UniformBudget  # never consulted: the full cache keeps everything

    def __init__(self, config: Optional[KVCacheConfig] = None, layer_id: Optional[int] = None):
        super().__init__()
        self.config = config or KVCacheConfig(method="full")
        self.layer_id = layer_id

    @property
    def layer_budget(self) -> int:
        """Unbounded: the number of tokens seen."""
        return self.offset

    @property
    def held_slots(self) -> int:
        """The tokens seen: the rest of the buffer is mlx-lm's room to grow (``spare_bytes``), not kept."""
        return self.offset

    @property
    def tokens_kept(self) -> int:
        return self.offset

    @property
    def concentration(self) -> float:
        return 0.0
