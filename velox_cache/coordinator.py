"""``SqueezeCoordinator``: turns every layer's measured concentration into budgets, once."""

from __future__ import annotations

from typing import Optional

from .budgets import squeeze_budget_cap, squeeze_budgets


class SqueezeCoordinator:
    """Shared by one model's squeeze caches; publishes the per-layer budget schedule once.

    The first layer to reach the end of prefill calls ``publish``: by then
    every layer has measured the whole prompt. The schedule is frozen
    afterwards.
    """

    def __init__(self, n_layers: int, avg: int, n_sink: int = 4, strength: float = 0.5):
        self.n_layers = n_layers
        self.avg = avg
        self.n_sink = n_sink
        self.strength = strength
        self._layers: dict = {}
        self.budgets: Optional[list[int]] = None
        self.concentrations: Optional[list[float]] = None

    def register(self, layer_id: int, cache) -> None:
        if not 0 <= layer_id < self.n_layers:
            raise ValueError(f"layer_id: {layer_id} is outside 0..{self.n_layers - 1}")
        if layer_id in self._layers:
            raise ValueError(f"layer_id: {layer_id} is already registered with this coordinator")
        if self.published:
            raise RuntimeError("this coordinator has published its schedule; build a fresh one")
        self._layers[layer_id] = cache

    @property
    def published(self) -> bool:
        return self.budgets is not None

    @property
    def cap(self) -> int:
        """The largest budget the schedule can give any layer."""
        return squeeze_budget_cap(self.n_layers, self.avg, self.strength)

    def publish(self) -> list[int]:
        """Compute and freeze the schedule from every registered layer's concentration."""
        if self.published:
            return self.budgets
        missing = sorted(set(range(self.n_layers)) - set(self._layers))
        if missing:
            raise RuntimeError(f"squeeze schedule needs every layer; layers {missing} never registered")
        self.concentrations = [self._layers[i].concentration for i in range(self.n_layers)]
        self.budgets = squeeze_budgets(self.concentrations, self.avg, self.n_sink, self.strength)
        return self.budgets

    def budget(self, layer_id: int) -> int:
        """This layer's budget from the published schedule."""
        if not self.published:
            raise RuntimeError("the squeeze schedule is published at the end of prefill")
        return self.budgets[layer_id]
