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

from dataclasses import dataclass
from typing import Optional

from .schedules import fit_budgets, pyramid_budgets


@dataclass(frozen=True)
class PromptSize:
    """The one prompt a stack's budgets are fitted to (``fit_budgets``): its tokens and those to generate.

    ``new_tokens`` None: unknown (no layer's budget is capped). ``floor``: the
    least budget a layer may get (``n_sink + 1``).
    """

    prompt_tokens: int
    new_tokens: Optional[int] = None
    floor: int = 1

    def fit(self, budgets: list) -> list:
        return [max(self.floor, b) for b in fit_budgets(budgets, self.prompt_tokens, self.new_tokens)]


class UniformBudget:
    """Every layer keeps the config's ``budget`` (or the ``resolved_budget`` given to it)."""

    name = "uniform"

    def __init__(self, config, layer_id: Optional[int] = None, coordinator=None):
        self.config = config

    @staticmethod
    def layer_budgets(config, n_layers: int, size: Optional[PromptSize] = None) -> list:
        """Per-layer budgets for a stack of ``n_layers`` compressed layers (None: the config's budget).

        ``size``: the prompt to fit them to (``PromptSize.fit``; None: not fitted).
        Uniform budgets are capped at what a layer can hold; nothing else changes.
        """
        if size is None or not n_layers:
            return [None] * n_layers
        fitted = size.fit([config.budget] * n_layers)
        return [None if b == config.budget else b for b in fitted]

    @staticmethod
    def shared_coordinator(config, layer_ids: list, size: Optional[PromptSize] = None):
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
    def layer_budgets(config, n_layers: int, size: Optional[PromptSize] = None) -> list:
        if not n_layers:
            return []
        budgets = pyramid_budgets(n_layers, config.budget, config.n_sink, config.beta)
        return budgets if size is None else size.fit(budgets)
