"""SqueezeAttention: H2O scoring with per-layer budgets measured from the prompt."""

from __future__ import annotations

from typing import Optional

from ..base import EvictingKVCache
from ..config import KVCacheConfig
from ..coordinator import SqueezeCoordinator


class SqueezeAttentionCache(EvictingKVCache):
    """One layer of SqueezeAttention.

    Over the whole prompt (every prefill chunk) the layer measures how
    concentrated its attention is. When decoding starts the shared
    ``SqueezeCoordinator`` turns all layers' concentrations into budgets once
    (``squeeze_budgets``) and freezes them. By default nothing is evicted
    before that (``eviction='prefill_end'``), so no layer can lose a token its
    final budget would keep; each layer then keeps what the prompt's last
    ``window`` queries attend to (max-pooled over ``kernel``) and holds its
    budget during decoding by cumulative attention mass (H2O). With
    ``eviction='continuous'`` a layer evicts by H2O mass after every chunk,
    keeping until the schedule exists the largest budget it could give.

    Without a coordinator (``KVCacheFactory.create``) the layer keeps the
    average ``budget``, like a uniform H2O layer; ``resolved_budget`` overrides.
    """

    method = "squeeze"
    default_eviction = "prefill_end"
    default_selection = "window"
    score_signal = "cumulative"
    measures_concentration = True

    def __init__(
        self,
        config: KVCacheConfig,
        layer_id: Optional[int] = None,
        coordinator: Optional[SqueezeCoordinator] = None,
    ):
        super().__init__(config, layer_id)
        if coordinator is not None:
            if not isinstance(coordinator, SqueezeCoordinator):
                raise TypeError(f"coordinator: expected a SqueezeCoordinator, got {type(coordinator).__name__}")
            if layer_id is None:
                raise ValueError("layer_id: required when a coordinator is given")
            coordinator.register(layer_id, self)
        self.coordinator = coordinator

    def _budget_in_force(self) -> int:
        if self.config.resolved_budget:
            return self.config.resolved_budget
        if self.coordinator is None:
            return self.config.budget
        if self.coordinator.published:
            return self.coordinator.budget(self.layer_id)
        return self.coordinator.cap

    def _on_prefill_end(self) -> None:
        if self.coordinator is not None and not self.coordinator.published:
            self.coordinator.publish()

    @property
    def squeeze_kept_bytes(self) -> int:
        """Alias of ``kept_bytes`` (the original library's name)."""
        return self.kept_bytes
