"""Allocators: how many tokens each layer keeps (the first of a policy's three choices).

An allocator class says, for a whole stack, which budget each compressed layer
gets (``layer_budgets``: None leaves a layer at the config's average) and
which object the layers share (``shared_coordinator``); one instance per
layer then answers ``budget()`` while its sequence runs. Allocators that
measure the prompt (SqueezeAttention's, in ``policies/squeeze.py``) are fed
each prefill chunk's attention result (``observe``) and settle their budgets
before the first selection (``settle``).
"""

from __future__ import annotations

from typing import Optional

from .schedules import pyramid_budgets


class UniformBudget:
    """Every layer keeps the config's ``budget`` (or the ``resolved_budget`` given to it)."""

    name = "uniform"

    def __init__(self, config, layer_id: Optional[int] = None, coordinator=None):
        self.config = config

    @staticmethod
    def layer_budgets(config, n_layers: int) -> list:
        """Per-layer budgets for a stack of ``n_layers`` compressed layers (None: the config's budget)."""
        return [None] * n_layers

    @staticmethod
    def shared_coordinator(config, layer_ids: list):
        """The object the stack's layers share (None: they need none)."""
        return None

    def budget(self) -> int:
        """Tokens per head this layer may keep now."""
        return self.config.resolved_budget or self.config.budget

    def concentration_rows(self, n_queries: int) -> int:
        """How many of a prefill chunk's last query rows to sample for ``observe`` (0: none)."""
        return 0

    def observe(self, result) -> None:
        """A prefill chunk's ``AttentionResult`` (probes excepted)."""

    def settle(self) -> None:
        """A selection is about to evict to budget (or prefill ended): the budget must be final."""

    def adopt(self, source) -> None:
        """Take over what ``source`` (another layer's allocator, same prompt) measured while prefilling: nothing here."""

    @property
    def arrays(self) -> list:
        """Arrays held per sequence (evaluated with the cache's ``state``)."""
        return []

    @property
    def concentration(self) -> float:
        """Measured attention concentration, 0 (broad) to 1 (one token); 0 when not measured."""
        return 0.0


class PyramidBudget(UniformBudget):
    """Budgets that taper with depth, fixed when the stack is built (``pyramid_budgets``)."""

    name = "pyramid"

    @staticmethod
    def layer_budgets(config, n_layers: int) -> list:
        if not n_layers:
            return []
        return pyramid_budgets(n_layers, config.budget, config.n_sink, config.beta)
