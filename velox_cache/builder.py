"""Building caches: one (``KVCacheFactory.create``) or a model's stack (``KVCacheBuilder.for_model``).

Layer: above ``policies/`` (and what they stand on); ``generation/`` builds on it.
"""

from __future__ import annotations

import dataclasses

from .budgets.allocators import PromptSize
from .cache.model_caches import (
    UnsupportedModelError,
    architecture_name,
    attention_scale,
    compressible_slots,
    model_caches,
    refusal_reason,
)
from .config import ConfigError, KVCacheConfig
from .kernels.masks import SharedMaskRecord
from .policies import policy_class


class KVCacheFactory:
    """Single caches with no layer context."""

    @staticmethod
    def create(config: KVCacheConfig, *, prompt_tokens: int | None = None):
        """One cache for ``config.method`` at the average budget (no pyramid, no coordinator).

        ``prompt_tokens`` resolves a percentage budget (``"25%"``).
        """
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config: expected a KVCacheConfig, got {type(config).__name__}")
        return policy_class(config)(_resolved(config, prompt_tokens))


class KVCacheBuilder:
    """Per-layer cache stacks for mlx-lm models."""

    @staticmethod
    def for_model(
        model, config: KVCacheConfig, *, prompt_tokens: int | None = None, new_tokens: int | None = None
    ) -> list:
        """A fresh cache list for ``model`` (pass it as ``prompt_cache=``).

        Asks the model what each layer needs (``model.make_cache()`` where
        defined, mlx-lm's ``make_prompt_cache`` otherwise) and replaces only the
        plain global-attention ``KVCache`` entries (also the one inside a
        ``CacheList`` of a hybrid layer) with Velox caches; sliding-window,
        state-space and other caches stay as the model made them. Budgets are
        computed over the compressed layers only: PyramidKV tapers over them
        in order, squeeze layers share one fresh ``SqueezeCoordinator``.
        Each Velox cache's ``layer_id`` is its index in the returned list.
        Build a new stack per document: caches hold one sequence's state.
        The policy's allocator gives each layer its budget (PyramidKV's
        taper) and the object its layers share (squeeze's coordinator).
        ``prompt_tokens`` (the prompt's length) resolves a percentage budget
        such as ``"25%"`` and, with ``new_tokens`` (how many will be generated;
        None: unknown), fits the per-layer budgets to the prompt
        (``config.fit_budgets``, ``velox_cache.budgets.schedules.fit_budgets``).

        Raises ``UnsupportedModelError`` naming the architecture when it has
        no layer to compress (``method='full'`` then returns the model's own
        caches).
        """
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config: expected a KVCacheConfig, got {type(config).__name__}")
        config = _resolved(config, prompt_tokens)
        caches = model_caches(model)
        slots = compressible_slots(caches)
        if not slots and config.method != "full":
            raise UnsupportedModelError(
                f"{architecture_name(model)} cannot be compressed by Velox: {refusal_reason(caches)}"
            )
        policy = policy_class(config)
        size = None
        if config.fit_budgets and prompt_tokens is not None and config.method != "full":
            size = PromptSize(prompt_tokens, new_tokens, floor=config.n_sink + 1)
        budgets = policy.allocator.layer_budgets(config, len(slots), size)
        coordinator = policy.allocator.shared_coordinator(config, [s.index for s in slots], size) if slots else None
        shared = {} if coordinator is None else {"coordinator": coordinator}
        mask_record = SharedMaskRecord()
        for slot, budget in zip(slots, budgets):
            layer_config = dataclasses.replace(config, resolved_budget=budget) if budget else config
            cache = policy(layer_config, layer_id=slot.index, **shared)
            cache.attention_scale = attention_scale(model, slot.index)
            cache.shared_mask = mask_record
            _put(caches, slot, cache)
        return caches


def _put(caches: list, slot, cache) -> None:
    if slot.member is None:
        caches[slot.index] = cache
    else:
        members = list(caches[slot.index].caches)
        members[slot.member] = cache
        caches[slot.index].caches = tuple(members)


def _resolved(config: KVCacheConfig, prompt_tokens) -> KVCacheConfig:
    if config.budget_fraction is None or config.method == "full":
        return config
    if prompt_tokens is None:
        raise ConfigError(
            f"budget: {config.budget!r} is a share of the prompt; pass prompt_tokens= (the prompt's length)"
        )
    return config.resolved_for(prompt_tokens)
