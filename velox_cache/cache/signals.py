"""Ranking signals: what makes one held token worth more than another (higher = keep).

One small class per signal. Each says how many of a call's last query rows it
needs (``rows``), how it folds their attention mass into the slots' scores
(``fold``; ``folds`` names it, add or replace, for batched decoding) and what
the eviction ranking is (``ranking``: the scores, or the positions when
``by_position``).

Two helpers feed them: ``fold_heads`` sums attention that ran on more heads
than a cache holds (multi-head latent attention, repeated heads) onto the
cache's heads, and ``key_proxy_attention`` scores without queries, each new
key standing in for its query (the ``key_proxy`` scoring).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..kernels.attend import AttentionResult, attend_and_score
from .slots import TokenSlots


def fold_heads(mass: mx.array, heads: int) -> mx.array:
    """Sum per-head mass ``[B, H', ...]`` onto ``heads`` heads when attention ran on more (MLA, repeats)."""
    if mass.shape[1] == heads:
        return mass
    return mass.reshape(mass.shape[0], heads, -1, *mass.shape[2:]).sum(axis=2)


def key_proxy_attention(
    new_keys: mx.array, held_keys: mx.array, *, scale: Optional[float], score_rows: int, entropy_rows: int
) -> Optional[AttentionResult]:
    """The attention of a call's last new keys, standing in for their queries, on ``held_keys``.

    ``scale`` defaults to ``D ** -0.5``; returns None when neither scores nor entropy are asked for.
    """
    rows = max(score_rows, entropy_rows)
    if not rows:
        return None
    return attend_and_score(
        new_keys[:, :, -rows:],
        held_keys,
        None,
        scale=scale if scale is not None else new_keys.shape[-1] ** -0.5,
        mask="causal" if rows > 1 else None,
        score_rows=score_rows,
        entropy_rows=entropy_rows,
    )


class CumulativeMass:
    """H2O: the attention mass every query so far gave a token (heavy hitters)."""

    name = "cumulative"
    folds = "add"  # how ``fold`` combines mass with the scores (batched decoding applies the same)
    by_position = False  # ``ranking`` is the slots' positions rather than their scores

    @staticmethod
    def rows(n_queries: int) -> int:
        return n_queries

    @staticmethod
    def fold(slots: TokenSlots, mass: mx.array) -> None:
        slots.add_scores(mass)

    @staticmethod
    def ranking(slots: TokenSlots) -> mx.array:
        return slots.held_scores()


class CurrentAttention:
    """TOVA: the attention of the latest query only (memoryless)."""

    name = "current"
    folds = "replace"
    by_position = False

    @staticmethod
    def rows(n_queries: int) -> int:
        return 1

    @staticmethod
    def fold(slots: TokenSlots, mass: mx.array) -> None:
        slots.add_scores(mass, replace=True)

    @staticmethod
    def ranking(slots: TokenSlots) -> mx.array:
        return slots.held_scores()


class Recency:
    """StreamingLLM: the later a token's position, the more it is worth; no attention needed."""

    name = "recency"
    folds = None
    by_position = True

    @staticmethod
    def rows(n_queries: int) -> int:
        return 0

    @staticmethod
    def fold(slots: TokenSlots, mass: mx.array) -> None:
        """Recency needs no attention: nothing to fold."""

    @staticmethod
    def ranking(slots: TokenSlots) -> mx.array:
        return slots.held_positions().astype(mx.float32)

