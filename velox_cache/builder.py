"""Building caches: one (``KVCacheFactory.create``) or a model's stack (``KVCacheBuilder.for_model``)."""

from __future__ import annotations

import dataclasses

from .budgets import pyramid_budgets
from .config import ConfigError, KVCacheConfig
from .coordinator import SqueezeCoordinator
from .policies import POLICIES, SqueezeAttentionCache


class KVCacheFactory:
    """Single caches with no layer context."""

    @staticmethod
    def create(config: KVCacheConfig, *, prompt_tokens: int | None = None):
        """One cache for ``config.method`` at the average budget (no pyramid, no coordinator).

        ``prompt_tokens`` resolves a percentage budget (``"25%"``).
        """
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config: expected a KVCacheConfig, got {type(config).__name__}")
        return POLICIES[config.method](_resolved(config, prompt_tokens))


class KVCacheBuilder:
    """Per-layer cache stacks for mlx-lm models."""

    @staticmethod
    def for_model(model, config: KVCacheConfig, *, prompt_tokens: int | None = None) -> list:
        """A fresh list of per-layer caches for ``model`` (pass it as ``prompt_cache=``).

        PyramidKV layers get their budgets from ``pyramid_budgets``; squeeze
        layers share one fresh ``SqueezeCoordinator``. Build a new stack per
        document: caches hold one sequence's state. ``prompt_tokens`` (the
        prompt's length) resolves a percentage budget such as ``"25%"``.
        """
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config: expected a KVCacheConfig, got {type(config).__name__}")
        config = _resolved(config, prompt_tokens)
        layers = getattr(model, "layers", None)
        if layers is None:
            raise TypeError(f"model: {type(model).__name__} has no `layers`; not an mlx-lm language model")
        n_layers = len(layers)
        policy = POLICIES[config.method]
        if config.method == "pyramidkv":
            budgets = pyramid_budgets(n_layers, config.budget, config.n_sink, config.beta)
            return [
                policy(dataclasses.replace(config, resolved_budget=budget), layer_id=i)
                for i, budget in enumerate(budgets)
            ]
        if config.method == "squeeze":
            coordinator = SqueezeCoordinator(n_layers, config.budget, config.n_sink, config.strength)
            return [SqueezeAttentionCache(config, layer_id=i, coordinator=coordinator) for i in range(n_layers)]
        return [policy(config, layer_id=i) for i in range(n_layers)]


def _resolved(config: KVCacheConfig, prompt_tokens) -> KVCacheConfig:
    if config.budget_fraction is None or config.method == "full":
        return config
    if prompt_tokens is None:
        raise ConfigError(
            f"budget: {config.budget!r} is a share of the prompt; pass prompt_tokens= (the prompt's length)"
        )
    return config.resolved_for(prompt_tokens)
