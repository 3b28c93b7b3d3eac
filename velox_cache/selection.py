"""Selectors: rank held tokens by the attention of chosen queries, pooled over neighbours.

Two choices use them. At the end of prefill (SnapKV, PyramidKV) the prompt's
last ``window`` queries rank every held token. In streaming prefill the
*probe* (the instruction that follows the document, run on top of each chunk
and then dropped) ranks every held and new token with all of its queries.
Both max-pool the mass over ``kernel`` neighbouring slots, so that a fact
split into several tokens (six digits) survives whole.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import attention


def pooled_mass(probs: mx.array, kernel: int) -> mx.array:
    """Attention mass per key ``[B, H, N]`` of ``probs`` ``[B, H, R, S, N]``, max-pooled over ``kernel``."""
    return attention.max_pool(attention.key_mass(probs), kernel)


class WindowSelector:
    """Remembers the latest ``window`` queries (or proxy keys) and ranks held keys by their pooled attention."""

    def __init__(self, window: int, kernel: int):
        self.window = window
        self.kernel = kernel
        self.queries: Optional[mx.array] = None  # [B, H*R, W, D]
        self.positions: Optional[mx.array] = None  # [W], the position of each query

    @property
    def arrays(self) -> list:
        return [a for a in (self.queries, self.positions) if a is not None]

    @property
    def ready(self) -> bool:
        return self.queries is not None

    def clear(self) -> None:
        self.queries = self.positions = None

    def remember(self, queries: mx.array, first_position: int) -> None:
        """Add a call's queries ``[B, H*R, S, D]`` at positions ``first_position ..``; keep the last ``window``."""
        window = self.window
        n_new = queries.shape[2]
        positions = mx.arange(first_position, first_position + n_new, dtype=mx.int32)
        if self.queries is None or n_new >= window:
            self.queries = queries[:, :, -window:]
            self.positions = positions[-window:]
        else:
            self.queries = mx.concatenate([self.queries, queries], axis=2)[:, :, -window:]
            self.positions = mx.concatenate([self.positions, positions])[-window:]

    def scores(self, keys: mx.array, key_positions: mx.array) -> mx.array:
        """SnapKV: the remembered queries' attention on ``keys`` ``[B, H, N, D]``, max-pooled ``[B, H, N]``.

        A query sees the keys at or before its own position (``key_positions`` ``[B, H, N]``).
        """
        visible = key_positions[:, :, None, None, :] <= self.positions[None, None, None, :, None]
        scale = keys.shape[-1] ** -0.5
        probs = attention.attention_probs(self.queries, keys, scale, visible)
        return pooled_mass(probs, self.kernel)

    def probe_scores(self, key_mass: mx.array, n_keys: int) -> mx.array:
        """The probe's attention mass ``[B, H, N]`` on the first ``n_keys`` keys (the non-probe ones), pooled."""
        return attention.max_pool(key_mass[..., :n_keys], self.kernel)
