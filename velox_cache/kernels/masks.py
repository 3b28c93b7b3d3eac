"""Array masks shared by every layer, and why per-layer budgets need care with them.

Some mlx-lm models (gemma2, phi3small, deepseek_v3, glm4_moe_lite,
kimi_linear, ...) ask the first attention layer's cache for one array mask
(``make_mask(N, return_array=True)``) and hand it to every layer. With
per-layer budgets a later layer may hold a different number of keys than the
layer that built the mask. ``SharedMaskRecord`` (one per cache stack) lets
each layer notice that before attention runs: observed attention rebuilds the
causal mask for the layer's own key count, and anything else is a clear
``MaskMismatchError`` instead of a broadcast error deep in the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from . import attention


class MaskMismatchError(ValueError):
    """A mask built for another layer's key count reached a layer that holds a different number."""


@dataclass
class SharedMaskRecord:
    """The last array mask a Velox cache of one stack built: who, for which call, how many keys."""

    maker: Optional[int] = None
    offset: int = -1
    n_queries: int = 0
    n_keys: int = 0

    def record(self, maker: Optional[int], offset: int, n_queries: int, n_keys: int) -> None:
        self.maker, self.offset, self.n_queries, self.n_keys = maker, offset, n_queries, n_keys

    def width_for_call(self, layer_id: Optional[int], offset: int, n_queries: int) -> Optional[int]:
        """Key count of the array mask another layer built for this very call, else None."""
        if self.maker is None or self.maker == layer_id:
            return None
        if self.offset != offset or self.n_queries != n_queries:
            return None
        return self.n_keys


def is_plain_causal(mask) -> bool:
    """True for a boolean mask that is one ``[S, N]`` matrix for every batch row and head."""
    return isinstance(mask, mx.array) and mask.dtype == mx.bool_ and all(d == 1 for d in mask.shape[:-2])


def fit_mask(mask, n_queries: int, n_keys: int):
    """``mask`` for this layer's ``n_keys``: unchanged when it fits, else the causal mask rebuilt.

    Only a plain boolean causal mask (what ``create_causal_mask`` builds for a
    global-attention layer of one sequence) can be rebuilt; any other mismatch
    is a ``MaskMismatchError``.
    """
    if not isinstance(mask, mx.array) or mask.shape[-1] == n_keys:
        return mask
    if is_plain_causal(mask):
        return attention.causal_mask(n_queries, n_keys)
    raise MaskMismatchError(
        f"attention mask covers {mask.shape[-1]} keys but this layer holds {n_keys}, and it is not "
        "a plain causal mask that could be rebuilt for this layer"
    )


def pooled_heads_mask(key_heads: mx.array, n_q_heads: int, n_heads: int) -> mx.array:
    """``[1, H*R, 1, T]`` bool: query head ``q`` sees the pooled slots of KV head ``q // R`` only.

    ``key_heads`` ``[T]`` names each slot's KV head (``HeadPooledSlots``'
    layout: every head's slots in one ``[B, 1, T, D]`` buffer).
    """
    kv_head_of_query = mx.arange(n_q_heads, dtype=mx.int32) // (n_q_heads // n_heads)
    return (kv_head_of_query[:, None, None] == key_heads[None, None, :])[None]


def with_pooled_heads(mask, key_heads: mx.array, n_q_heads: int, n_heads: int) -> mx.array:
    """``mask`` (None, boolean or additive array) restricted to each query head's own pooled slots."""
    own = pooled_heads_mask(key_heads, n_q_heads, n_heads)
    if mask is None:
        return own
    if isinstance(mask, str):
        raise ValueError("key_heads: pooled slots take no causal mask (their slots are not in position order)")
    if mask.dtype == mx.bool_:
        return mask & own
    return mx.where(own, mask, -mx.inf)
