"""Per-row settings of a decoding batch as columns, and signals applied to the rows that use them.

Shared by the batched layers (``batching.BatchedLayer``, ``quantized_slots_batch.QuantizedSlotsBatch``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def column(values, dtype) -> mx.array:
    """One value per row (a list or a NumPy array) as ``[B, 1, 1]``, to broadcast over heads and slots."""
    return mx.array(np.asarray(values).reshape(-1, 1, 1), dtype)


def row_groups(rows: list, key) -> list:
    """``[(value, rows mask [B, 1, 1] or None for all rows)]`` for each value ``key(row)`` takes (None: left out)."""
    values = [key(row) for row in rows]
    groups = []
    for value in dict.fromkeys(v for v in values if v is not None):
        mask = [v is value for v in values]
        groups.append((value, None if all(mask) else column(mask, mx.bool_)))
    return groups


def by_group(groups: list, compute, otherwise: mx.array) -> mx.array:
    """``compute(value)`` on each group's rows, ``otherwise`` on the rest."""
    result = otherwise
    for value, mask in groups:
        computed = compute(value)
        result = computed if mask is None else mx.where(mask, computed, result)
    return result
