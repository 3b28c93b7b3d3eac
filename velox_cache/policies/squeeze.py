"""SqueezeAttention: per-layer budgets measured from the prompt, re-allocated once by a coordinator."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..attend import AttentionResult
from ..base import EvictingKVCache
from ..config import KVCacheConfig
from ..coordinator import SqueezeCoordinator
from ..signals import CumulativeMass

CONCENTRATION_ROWS = 8  # query rows per prefill call sampled for the concentration measure


class SqueezeAttentionCache(EvictingKVCache):
    """One layer of SqueezeAttention.

    While prefilling, the layer measures how concentrated its attention is:
    the normalised entropy of ``CONCENTRATION_ROWS`` sampled query rows of
    every prefill call (probes excepted). The shared ``SqueezeCoordinator``
    turns all layers' concentrations into budgets once (``squeeze_budgets``)
    and freezes them:

    * ``prefill_end`` (default): when decoding starts, from the whole prompt.
      Nothing is evicted before that, so no layer can have lost a token its
      final budget would keep; each layer then keeps what the prompt's last
      ``window`` queries attend to (max-pooled over ``kernel``).
    * ``streaming``: at the first selection after a document chunk (the end
      of the first probe), from the first chunk. Memory must stay bounded
      from there on, so the schedule cannot wait for the whole document; a
      document that fits in one chunk is measured whole, as under
      ``prefill_end``.
    * ``continuous``: when decoding starts; until then each layer evicts by
      H2O mass to the largest budget the schedule could give it.

    During decoding the budget holds by cumulative attention mass (H2O).
    Without a coordinator (``KVCacheFactory.create``) the layer keeps the
    average ``budget``; ``resolved_budget`` overrides.
    """

    method = "squeeze"
    default_eviction = "prefill_end"
    default_selection = "window"
    signal = CumulativeMass

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
        self._entropy_sum: Optional[mx.array] = None
        self._entropy_rows = 0

    def _budget_in_force(self) -> int:
        if self.config.resolved_budget:
            return self.config.resolved_budget
        if self.coordinator is None:
            return self.config.budget
        if self.coordinator.published:
            return self.coordinator.budget(self.layer_id)
        return self.coordinator.cap

    def _publish(self) -> None:
        if self.coordinator is not None and not self.coordinator.published:
            self.coordinator.publish()

    def _on_prefill_end(self) -> None:
        self._publish()

    @property
    def default_mass_weight(self) -> float:
        """0.3 under ``prefill_end``, 0 otherwise (measured: README, "Fidelity").

        At prefill end the blend tracks the full cache's summaries better and keeps
        as many needles; under streaming it lost a 4k needle that the probe alone
        found, and for PyramidKV it loses needles at a 10% budget.
        """
        return 0.3 if self.eviction == "prefill_end" else 0.0

    def _before_selection(self) -> None:
        self._publish()

    # ----- the concentration measure ------------------------------------------------------

    def _measuring(self) -> bool:
        published = self.coordinator is not None and self.coordinator.published
        return self._prefilling and self._probe is None and not published

    def _rows_for_concentration(self, n_queries: int) -> int:
        return min(n_queries, CONCENTRATION_ROWS) if self._measuring() else 0

    def _observe_entropy(self, result: AttentionResult) -> None:
        if result.entropy is None or not self._measuring():
            return
        self._entropy_sum = result.entropy if self._entropy_sum is None else self._entropy_sum + result.entropy
        self._entropy_rows += result.entropy_rows

    def _extra_state(self) -> list:
        return [] if self._entropy_sum is None else [self._entropy_sum]

    @property
    def concentration(self) -> float:
        """Measured attention concentration over the prompt, 0 (broad) to 1 (one token)."""
        if not self._entropy_rows:
            return 0.0
        return 1.0 - self._entropy_sum.item() / self._entropy_rows

    @property
    def squeeze_kept_bytes(self) -> int:
        """Alias of ``kept_bytes`` (the original library's name)."""
        return self.kept_bytes
