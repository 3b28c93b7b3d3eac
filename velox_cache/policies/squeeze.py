"""SqueezeAttention: per-layer budgets measured from the prompt, re-allocated once by a coordinator."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..budgets.allocators import PromptSize, UniformBudget
from ..budgets.coordinator import SqueezeCoordinator
from ..cache.base import EvictingKVCache
from ..cache.signals import CumulativeMass
from ..config import KVCacheConfig
from ..kernels.attend import AttentionResult

CONCENTRATION_ROWS = 8  # query rows per prefill call sampled for the concentration measure


class SqueezeBudget(UniformBudget):
    """One layer's share of a ``SqueezeCoordinator``'s schedule, and the measure that feeds it.

    While prefilling, the layer measures how concentrated its attention is:
    the normalised entropy of ``CONCENTRATION_ROWS`` sampled query rows of
    every prefill chunk (probes excepted). The shared coordinator turns all
    layers' concentrations into budgets once (``squeeze_budgets``), at the
    first ``settle`` of any layer, and freezes them. Until then a layer may
    keep the largest budget the schedule could give it. Without a
    coordinator the layer keeps the average ``budget``; ``resolved_budget``
    overrides.
    """

    name = "squeeze"

    def __init__(self, config, layer_id: Optional[int] = None, coordinator: Optional[SqueezeCoordinator] = None):
        super().__init__(config, layer_id)
        if coordinator is not None:
            if not isinstance(coordinator, SqueezeCoordinator):
                raise TypeError(f"coordinator: expected a SqueezeCoordinator, got {type(coordinator).__name__}")
            if layer_id is None:
                raise ValueError("layer_id: required when a coordinator is given")
        self.coordinator = coordinator
        self.layer_id = layer_id
        self._entropy_sum: Optional[mx.array] = None
        self._entropy_rows = 0

    @staticmethod
    def shared_coordinator(config, layer_ids: list, size: Optional[PromptSize] = None) -> SqueezeCoordinator:
        return SqueezeCoordinator(
            len(layer_ids), config.budget, config.n_sink, config.strength, layer_ids=layer_ids, size=size
        )

    def budget(self) -> int:
        if self.config.resolved_budget:
            return self.config.resolved_budget
        if self.coordinator is None:
            return self.config.budget
        if self.coordinator.published:
            return self.coordinator.budget(self.layer_id)
        return self.coordinator.cap

    def settle(self) -> None:
        if self.coordinator is not None and not self.coordinator.published:
            self.coordinator.publish()

    def adopt(self, source) -> None:
        """Take over ``source``'s concentration measure (a ``SqueezeBudget`` that measured the same prompt)."""
        if not isinstance(source, SqueezeBudget):
            raise ValueError(f"squeeze needs a reading that measured concentration; this one's budgets were {source.name}")
        self._entropy_sum = None if source._entropy_sum is None else mx.array(source._entropy_sum)
        self._entropy_rows = source._entropy_rows

    def _measuring(self) -> bool:
        return not (self.coordinator is not None and self.coordinator.published)

    def concentration_rows(self, n_queries: int) -> int:
        return min(n_queries, CONCENTRATION_ROWS) if self._measuring() else 0

    def observe(self, result: AttentionResult) -> None:
        if result.entropy is None or not self._measuring():
            return
        self._entropy_sum = result.entropy if self._entropy_sum is None else self._entropy_sum + result.entropy
        self._entropy_rows += result.entropy_rows

    @property
    def arrays(self) -> list:
        return [] if self._entropy_sum is None else [self._entropy_sum]

    @property
    def concentration(self) -> float:
        """Measured attention concentration over the prompt, 0 (broad) to 1 (one token)."""
        if not self._entropy_rows:
            return 0.0
        return 1.0 - self._entropy_sum.item() / self._entropy_rows


class SqueezeAttentionCache(EvictingKVCache):
    """One layer of SqueezeAttention (budgets: ``SqueezeBudget``).

    When the schedule is published depends on the timing:

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
    """

    method = "squeeze"
    allocator = SqueezeBudget
    default_eviction = "prefill_end"
    default_selection = "window"
    signal = CumulativeMass

    def __init__(
        self,
        config: KVCacheConfig,
        layer_id: Optional[int] = None,
        coordinator: Optional[SqueezeCoordinator] = None,
    ):
        super().__init__(config, layer_id, coordinator)
        if coordinator is not None:
            coordinator.register(layer_id, self)

    @property
    def coordinator(self) -> Optional[SqueezeCoordinator]:
        return self.allocation.coordinator

    @classmethod
    def default_mass_weight(cls, eviction: str) -> float:
        """0.3 under ``prefill_end``, 0 otherwise (measured: bench/RESULTS.md, "Fidelity").

        At prefill end the blend tracks the full cache's summaries better and keeps
        as many needles; under streaming it lost a 4k needle that the probe alone
        found, and for PyramidKV it loses needles at a 10% budget.
        """
        return 0.3 if eviction == "prefill_end" else 0.0

    @property
    def squeeze_kept_bytes(self) -> int:
        """Alias of ``kept_bytes`` (the original library's name)."""
        return self.kept_bytes
