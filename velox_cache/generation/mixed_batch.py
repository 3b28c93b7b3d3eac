"""``MixedBatch``: one layer's rows of several kinds decoding in one model call.

Rows whose tokens are held differently (float slots, a full cache's quantized
codes, an evicting cache's quantized region) batch in layers of their own kind
(``BatchedLayer``, ``QuantizedFullBatch``, ``QuantizedSlotsBatch``). A mixed
batch holds one such *part* per kind and the batch order of its rows: each
call hands every part its own rows' keys and values, and each part's attention
its rows' queries; the outputs come back in batch order. A row decodes exactly
as it does in a batch of its own kind.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import mlx.core as mx
import numpy as np

from .decoding_batch import DecodingBatch
from .unsupported import BatchUnsupported


class PartsHeld(NamedTuple):
    """What each part's ``update_and_fetch`` returned, in part order (the keys the model's attention passes back)."""

    keys: list
    values: list


class MixedBatch(DecodingBatch):
    """One layer's parts (batched layers of one kind each) and where each batch row sits among them."""

    _derived = ("_rows_of", "_back")  # the routing, from ``members`` (``_orders``)

    def _rebuild(self) -> None:
        self._orders()

    def __init__(self, parts: list, members: Optional[list] = None):
        """``members[i]``: ``(part, row in that part)`` of batch row ``i`` (default: the parts' rows in order)."""
        self.parts = list(parts)
        self.layer = self.parts[0].layer
        self.members = members or [(p, i) for p, part in enumerate(self.parts) for i in range(len(part.rows))]
        self._orders()

    @classmethod
    def of(cls, layers_by_row: list, layer: int) -> "MixedBatch":
        """One part per kind from ``layers_by_row``: ``[(kind, cache)]`` in batch order."""
        kinds = list(dict.fromkeys(kind for kind, _ in layers_by_row))
        parts = [kind([cache for k, cache in layers_by_row if k is kind], layer) for kind in kinds]
        counters = [0] * len(kinds)
        members = []
        for kind, _ in layers_by_row:
            part = kinds.index(kind)
            members.append((part, counters[part]))
            counters[part] += 1
        return cls(parts, members)

    def _orders(self) -> None:
        """Each part's batch rows (``[rows]`` indices) and the order that puts the parts' outputs back."""
        rows = [[] for _ in self.parts]
        for index, (part, _) in enumerate(self.members):
            rows[part].append(index)
        self._rows_of = [mx.array(r, mx.int32) for r in rows]
        self._back = mx.array(np.argsort(np.concatenate(rows), kind="stable"), mx.int32)

    def _in_batch_order(self, per_part: list) -> mx.array:
        return mx.concatenate(per_part)[self._back]

    # ----- mlx-lm cache protocol ----------------------------------------------------------

    @property
    def offset(self) -> mx.array:
        return self._in_batch_order([part.offset for part in self.parts])

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[0] != len(self.members):
            raise BatchUnsupported(f"layer {self.layer}: {keys.shape[0]} rows for a batch of {len(self.members)}")
        held = [part.update_and_fetch(keys[rows], values[rows]) for part, rows in zip(self.parts, self._rows_of)]
        parts = PartsHeld([k for k, _ in held], [v for _, v in held])
        return parts, parts

    def observe_attention(self, queries, keys, values, scale, mask, sinks=None) -> mx.array:
        """Each part's attention on its own rows' queries; the outputs in batch order."""
        if not isinstance(keys, PartsHeld):
            raise BatchUnsupported(f"layer {self.layer}: attention over keys other than the held ones cannot batch")
        outputs = [
            part.observe_attention(queries[rows], k, v, scale, mask, sinks=sinks)
            for part, rows, k, v in zip(self.parts, self._rows_of, keys.keys, keys.values)
        ]
        return self._in_batch_order(outputs)

    @property
    def step_arrays(self) -> list:
        return [array for part in self.parts for array in part.step_arrays]

    @property
    def state(self):
        return [array for part in self.parts for array in part.state]

    @state.setter
    def state(self, value):
        self._restore_state(value)

    def size(self) -> int:
        return max(part.size() for part in self.parts)

    @property
    def attended(self) -> bool:
        return all(part.attended for part in self.parts)

    @property
    def rows(self) -> list:
        return [self.parts[part].rows[i] for part, i in self.members]

    # ----- rows in and out ---------------------------------------------------------------------

    def extract(self, index: int) -> list:
        part, row = self.members[index]
        return self.parts[part].extract(row)

    def filter(self, indices: list[int]) -> None:
        """Only batch rows ``indices`` stay; a part left with none goes."""
        kept = [self.members[i] for i in indices]
        parts, numbering = [], {}
        for p, part in enumerate(self.parts):
            rows = sorted(row for q, row in kept if q == p)
            if not rows:
                continue
            part.filter(rows)
            numbering.update({(p, row): (len(parts), new_row) for new_row, row in enumerate(rows)})
            parts.append(part)
        self.parts, self.members = parts, [numbering[member] for member in kept]
        self._orders()

    def join_refusal(self, other) -> Optional[str]:
        for part in _parts_of(other):
            mine = self._part_like(part)
            if mine is not None:
                refusal = mine.join_refusal(part)
                if refusal is not None:
                    return refusal
        return None

    def join(self, other) -> None:
        """``other``'s rows (a batched layer of any kind, or a mixed one) after this batch's own."""
        self.check_joinable(other)
        other_members = other.members if isinstance(other, MixedBatch) else [(0, i) for i in range(len(other.rows))]
        placed = []
        for part in _parts_of(other):
            mine = self._part_like(part)
            if mine is None:
                self.parts.append(part)
                placed.append((len(self.parts) - 1, 0))
            else:
                placed.append((self.parts.index(mine), len(mine.rows)))
                mine.join(part)
        self.members = self.members + [(placed[p][0], placed[p][1] + row) for p, row in other_members]
        self._orders()

    def _part_like(self, part):
        return next((mine for mine in self.parts if type(mine) is type(part)), None)

    def checkpoint(self) -> tuple:
        return tuple(part.checkpoint() for part in self.parts)

    def restore(self, checkpoint: tuple) -> None:
        for part, saved in zip(self.parts, checkpoint):
            part.restore(saved)


def _parts_of(layer) -> list:
    return layer.parts if isinstance(layer, MixedBatch) else [layer]
