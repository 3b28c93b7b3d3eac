"""Ranking signals: what makes one held token worth more than another (higher = keep).

One small class per signal. Each says how many of a call's last query rows it
needs (``rows``), how their attention mass combines with the slots' scores
(``combine``, pure: ``fold`` applies it to one sequence's slots, batched decoding
to B rows at once) and what the eviction ranking is (``rank``, pure: the scores,
or the positions; ``ranking`` applies it to the held slots).

Two helpers feed them: ``fold_heads`` sums attention that ran on more heads
than a cache holds (multi-head latent attention, repeated heads) onto the
cache's heads, and ``key_proxy_attention`` scores without queries, each new
key standing in for its query (the ``key_proxy`` scoring).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..kernels.attend import AttentionResult, attend_and_score, attend_quantized
from ..kernels.kv_codes import QuantizedKV
from .slots import TokenSlots


def fold_heads(mass: mx.array, heads: int) -> mx.array:
    """Sum per-head mass ``[B, H', ...]`` onto ``heads`` heads when attention ran on more (MLA, repeats)."""
    if mass.shape[1] == heads:
        return mass
    return mass.reshape(mass.shape[0], heads, -1, *mass.shape[2:]).sum(axis=2)


def key_proxy_attention(
    new_keys: mx.array, held_keys: mx.array, *, scale: Optional[float], score_rows: int, entropy_rows: int
) -> Optional[AttentionResult]:
    """The attention of a call's last new keys, standing in for their queries, on ``held_keys``
    (float keys, or a quantized layer's ``QuantizedKV``).

    ``scale`` defaults to ``D ** -0.5``; returns None when neither scores nor entropy are asked for.
    """
    rows = max(score_rows, entropy_rows)
    if not rows:
        return None
    if isinstance(held_keys, QuantizedKV):  # a quantized layer decoding: its codes read in place
        return attend_quantized(
            new_keys[:, :, -rows:],
            held_keys,
            scale=scale if scale is not None else new_keys.shape[-1] ** -0.5,
            mask="causal" if rows > 1 else None,
            score_rows=score_rows,
            entropy_rows=entropy_rows,
            values=False,
        )
    return attend_and_score(
        new_keys[:, :, -rows:],
        held_keys,
        None,
        scale=scale if scale is not None else new_keys.shape[-1] ** -0.5,
        mask="causal" if rows > 1 else None,
        score_rows=score_rows,
        entropy_rows=entropy_rows,
    )


class Signal:
    """What every signal shares: ``fold`` and ``ranking`` apply its pure ``combine`` and ``rank`` to one sequence's slots."""

    name = ""

    @staticmethod
    def rows(n_queries: int) -> int:
        """How many of a call's last query rows the signal needs."""
        raise NotImplementedError

    @staticmethod
    def combine(scores: mx.array, mass: mx.array) -> mx.array:
        """The scores after one call's attention ``mass`` (same shape)."""
        raise NotImplementedError

    @staticmethod
    def rank(scores: mx.array, positions: mx.array) -> mx.array:
        """The eviction ranking of slots with these ``scores`` and ``positions`` (higher = keep): the scores."""
        return scores

    @classmethod
    def fold(cls, slots: TokenSlots, mass: mx.array) -> None:
        slots.combine_scores(mass, cls.combine)

    @classmethod
    def ranking(cls, slots: TokenSlots) -> mx.array:
        return cls.rank(slots.held_scores(), slots.held_positions())


class CumulativeMass(Signal):
    """H2O: the attention mass every query so far gave a token (heavy hitters)."""

    name = "cumulative"

    @staticmethod
    def rows(n_queries: int) -> int:
        return n_queries

    @staticmethod
    def combine(scores: mx.array, mass: mx.array) -> mx.array:
        return scores + mass


class CurrentAttention(Signal):
    """TOVA: the attention of the latest query only (memoryless)."""

    name = "current"

    @staticmethod
    def rows(n_queries: int) -> int:
        return 1

    @staticmethod
    def combine(scores: mx.array, mass: mx.array) -> mx.array:
        return mass


class Recency(Signal):
    """StreamingLLM: the later a token's position, the more it is worth; no attention needed."""

    name = "recency"

    @staticmethod
    def rows(n_queries: int) -> int:
        return 0

    @staticmethod
    def combine(scores: mx.array, mass: mx.array) -> mx.array:
        return scores

    @staticmethod
    def fold(slots: TokenSlots, mass: mx.array) -> None:
        """Recency needs no attention: nothing to fold."""

    @staticmethod
    def rank(scores: mx.array, positions: mx.array) -> mx.array:
        return positions.astype(mx.float32)
