"""Ranking signals: what makes one held token worth more than another (higher = keep).

One small class per signal. Each says how many of a call's last query rows it
needs (``rows``), how it folds their attention mass into the slots' scores
(``fold``) and what the eviction ranking is (``ranking``).
"""

from __future__ import annotations

import mlx.core as mx

from .slots import TokenSlots


class CumulativeMass:
    """H2O: the attention mass every query so far gave a token (heavy hitters)."""

    name = "cumulative"

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

    @staticmethod
    def rows(n_queries: int) -> int:
        return 0

    @staticmethod
    def fold(slots: TokenSlots, mass: mx.array) -> None:
        """Recency needs no attention: nothing to fold."""

    @staticmethod
    def ranking(slots: TokenSlots) -> mx.array:
        return slots.held_positions().astype(mx.float32)


SIGNALS = {signal.name: signal for signal in (CumulativeMass, CurrentAttention, Recency)}
