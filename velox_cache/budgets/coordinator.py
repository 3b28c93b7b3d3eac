"""``SqueezeCoordinator``: turns every layer's measured concentration into budgets, once."""

from __future__ import annotations

from typing import Optional, Sequence

from .schedules import squeeze_budget_cap, squeeze_budgets


class SqueezeCoordinator:
    """Shared by one model's squeeze caches; publishes the per-layer budget schedule once.

    The first layer to reach the end of prefill calls ``publish``: by then
    every layer has measured the whole prompt. The schedule is frozen
    afterwards; with a ``size`` (``allocators.PromptSize``) it is fitted to
    that prompt (``fit_budgets``). ``layer_ids`` names the layers it coordinates (default
    ``0 .. n_layers - 1``); ``KVCacheBuilder.for_model`` passes the indices
    of the compressed layers in the model's cache list.
    """

    def __init__(
        self,
        n_layers: int,
        avg: int,
        n_sink: int = 4,
        strength: float = 0.5,
        *,
        layer_ids: Optional[Sequence[int]] = None,
        size=None,
    ):
        self.layer_ids = list(range(n_layers)) if layer_ids is None else list(layer_ids)
        if len(self.layer_ids) != n_layers or len(set(self.layer_ids)) != n_layers:
            raise ValueError(f"layer_ids: expected {n_layers} distinct ids, got {self.layer_ids}")
        self.n_layers = n_layers
        self.avg = avg
        self.n_sink = n_sink
        self.strength = strength
        self.size = size  # a ``PromptSize``: the schedule is fitted to that prompt (None: not fitted)
        self._layers: dict = {}
        self.budgets: Optional[list[int]] = None
        self.concentrations: Optional[list[float]] = None

    def register(self, layer_id: int, cache) -> None:
        if layer_id not in self.layer_ids:
            raise ValueError(f"layer_id: {layer_id} is not one of this coordinator's layers {self.layer_ids}")
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
        missing = sorted(set(self.layer_ids) - set(self._layers))
        if missing:
            raise RuntimeError(f"squeeze schedule needs every layer; layers {missing} never registered")
        self.concentrations = [self._layers[i].concentration for i in self.layer_ids]
        budgets = squeeze_budgets(self.concentrations, self.avg, self.n_sink, self.strength)
        self.budgets = budgets if self.size is None else self.size.fit(budgets)
        return self.budgets

    def budget(self, layer_id: int) -> int:
        """This layer's budget from the published schedule."""
        if not self.published:
            raise RuntimeError("the squeeze schedule is published at the end of prefill")
        return self.budgets[self.layer_ids.index(layer_id)]
