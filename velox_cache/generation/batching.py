"""``BatchedLayer``: one layer's caches of B prefilled sequences, decoding together.

Each row is one sequence's cache for this layer (a Velox evicting cache that
has finished prefill, or a full cache: Velox's ``FullKVCache`` or mlx-lm's
``KVCache``), with its own counts (``stored``, ``offset``, tokens seen) and
its own budget. The held tokens sit right-padded in one buffer
``[B, H, T, D]``, each (row, head) with its own count; a validity mask keeps
padded slots out of attention, out of the scores and out of the eviction
ranking.

A row with per-head budgets (``HeadPooledSlots``: one flattened head x token
buffer, each KV head its own count) is unflattened onto the head axis, each
head's slots in their order; ``flat`` ``[B, H, T]`` remembers the slot each
token has (or will have, once appended) in the row's own flattened buffer, so
that ``extract`` writes it back in the order decoding alone leaves. At its
budget (``heads x budget`` slots) such a row puts each head's token into that
head's own lowest-ranked slot, and a head whose every slot is protected gives
up its oldest non-sink token (``HeadPooledSlots.replace_lowest``).

A decode step is one vectorised write per layer: each row at its budget puts
each head's new token into that head's lowest-ranked slot (sinks and the recent window
protected, as ``TokenSlots.replace_lowest``), each row below it (and every
full row) into its next free slot. Attention runs on the layer's own mask, so
the model's attention must be routed (``velox_cache.observe`` or
``velox_cache.fast_attention``): the mask the model builds from its first
layer cannot fit layers whose rows hold other counts.

``extract(row)`` writes a row's state back into its own cache object, with
the buffers, counts and positions that decoding it alone would have left
(buffer growth simulated as the row's cache grows), so its accounting and
later use are the same.

Rows holding quantized tokens (``kv_bits``) batch in layers of their own kind
(``QuantizedFullBatch``, ``QuantizedSlotsBatch``); ``batch_layers`` gives a
layer whose rows are of several kinds a ``MixedBatch`` (one batched layer per
kind, one model call). What a kind is (its holder, whether it can join a batch
and why not, the buffers a batch holds for it, what it holds decoding alone) is
declared once, in ``KINDS``; ``decode_footprint`` reads it to bound what rows of
any mix hold.

What cannot batch is a ``BatchUnsupported`` error, raised before any row's
cache is touched: caches mid-prefill or mid-probe, cache kinds other than the
above (sliding-window, state-space, mlx-lm's quantized cache, shared-KV layers),
unequal shapes or dtypes, multi-token calls, attention that did not reach the layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from ..cache.base import EvictingKVCache
from ..cache.quantized_holes import SLOT_PARTS
from ..cache.quantized_tokens import GROUP_STEP, slot_bytes
from ..cache.restoring import state_arrays
from ..cache.signals import Recency, Signal, fold_heads
from ..cache.slots import GROWTH_STEP, decode_capacity, protect, recent_limit
from ..kernels.attend import attend_and_score
from .decoding_batch import DecodingBatch
from .mixed_batch import MixedBatch
from .quantized_batching import STEP as QUANTIZED_WINDOW_STEP
from .quantized_batching import QuantizedFullBatch
from .quantized_slots_batch import QuantizedSlotsBatch, quantized_slots
from .row_columns import by_group, column, row_groups
from .unsupported import BatchUnsupported, check_batched_call

FULL_STEP = KVCache.step  # mlx-lm's KVCache grows by this many slots



@dataclass
class _Row:
    """One row's cache for this layer, its counts when it joined and its settings."""

    cache: object
    evicting: bool
    stored: int
    offset: int
    seen: int
    capacity: int  # the buffer length decoding alone would have now
    budget: Optional[int] = None  # None: keeps every token (a full cache)
    n_sink: int = 0
    recent: int = 0
    signal: type = Recency
    observed: bool = False
    scale: Optional[float] = None
    pooled: bool = False  # per-head budgets: ``stored`` and ``capacity`` count the flattened slots

    @classmethod
    def of(cls, cache, layer: int) -> "_Row":
        """Raises ``BatchUnsupported`` unless ``cache`` is of a kind ``BatchedLayer`` holds and can join now."""
        kind = row_kind(cache)
        if kind.holder is not BatchedLayer:
            reason = kind.refusal(cache) if kind.holder is None else (
                "a cache holding quantized tokens (kv_bits) batches only with its own kind")
            raise BatchUnsupported(f"layer {layer}: {reason}")
        refusal = kind.refusal(cache)
        if refusal is not None:
            raise BatchUnsupported(f"layer {layer}: {refusal}")
        if not kind.evicting:
            return cls(cache, False, cache.offset, cache.offset, cache.offset, cache.keys.shape[2])
        slots, budget = cache.slots, cache.layer_budget
        return cls(
            cache,
            True,
            slots.stored,
            slots.offset,
            slots.tokens_seen,
            slots.capacity,
            budget=budget,
            n_sink=slots.n_sink,
            recent=int(recent_limit(slots.recent, budget, slots.n_sink)),
            signal=slots.signal,
            observed=cache.scoring == "observed",
            scale=cache.attention_scale,
            pooled=slots.heads_pooled,
        )

    @property
    def scores_decode(self) -> bool:
        """True when this row's signal folds each decode step's attention."""
        return self.evicting and self.signal.rows(1) > 0


class RowCounts:
    """Every row's counts for one layer as ``[B]`` NumPy arrays, advanced together (no loop over rows).

    ``stored`` (valid slots), ``offset`` (the next token's position), ``seen``
    (tokens passed in) and ``capacity`` (the buffer length decoding the row alone
    would have now: ``TokenSlots``' growth rule, or mlx-lm's ``KVCache``'s for a
    full row), with each row's ``budget`` and whether it ``evicting``. Slots are
    the row's own: a row with per-head budgets counts its flattened slots
    (``per_step``, one per head, each step; ``budget`` is heads x budget).
    ``head_stored`` ``[B, H]``: the valid slots of each (row, head) in the batch's buffer.
    """

    FIELDS = ("stored", "offset", "seen", "capacity", "head_stored")

    def __init__(self, rows: list[_Row], head_stored: np.ndarray):
        heads = head_stored.shape[1]
        self.stored = np.array([row.stored for row in rows], np.int64)
        self.offset = np.array([row.offset for row in rows], np.int64)
        self.seen = np.array([row.seen for row in rows], np.int64)
        self.capacity = np.array([row.capacity for row in rows], np.int64)
        self.head_stored = head_stored.astype(np.int64)
        self.evicting = np.array([row.evicting for row in rows], bool)
        self.per_step = np.array([heads if row.pooled else 1 for row in rows], np.int64)
        self.budget = np.array(
            [row.budget * (heads if row.pooled else 1) if row.evicting else np.iinfo(np.int64).max for row in rows],
            np.int64,
        )

    def at_budget(self) -> np.ndarray:
        """``[B]`` bool: rows whose next token replaces a held one."""
        return self.evicting & (self.stored == self.budget)

    def advance(self, at_budget: np.ndarray) -> None:
        """One token per row (and head), put in place of a held one (rows ``at_budget``) or appended."""
        self.offset += 1
        self.seen += 1
        end = self.stored + self.per_step
        grown = np.where(self.evicting, decode_capacity(end, self.budget), self.stored + FULL_STEP)
        self.capacity = np.where(at_budget, self.stored, np.where(end > self.capacity, grown, self.capacity))
        self.stored = np.where(at_budget, self.stored, end)
        self.head_stored = self.head_stored + ~at_budget[:, None]

    def room(self) -> np.ndarray:
        """``[B]``: the buffer width each row would like, to append without growing again soon."""
        steps_left = np.where(
            self.evicting, np.clip((self.budget - self.stored) // self.per_step, 0, GROWTH_STEP), GROWTH_STEP
        )
        return self.head_stored.max(axis=1) + steps_left

    def row(self, index: int) -> tuple:
        """``(stored, offset, seen, capacity)`` of row ``index`` as ints."""
        return tuple(int(getattr(self, name)[index]) for name in self.FIELDS[:4])

    def keep(self, indices: list[int]) -> None:
        for name in (*self.FIELDS, "evicting", "budget", "per_step"):
            setattr(self, name, getattr(self, name)[indices])

    def extend(self, other: "RowCounts") -> None:
        """``other``'s rows after these (same heads)."""
        for name in (*self.FIELDS, "evicting", "budget", "per_step"):
            setattr(self, name, np.concatenate([getattr(self, name), getattr(other, name)]))

    def copy(self) -> tuple:
        return tuple(getattr(self, name).copy() for name in self.FIELDS)

    def restore(self, saved: tuple) -> None:
        for name, value in zip(self.FIELDS, saved):
            setattr(self, name, value)


class HeldRows(NamedTuple):
    """What B caches of one layer hold, each head right-padded to the longest: where a batched layer starts."""

    rows: list  # [_Row]: each row's counts and settings
    width: int  # the most tokens any (row, head) holds
    keys: mx.array  # [B, H, width, D]
    values: mx.array  # [B, H, width, Dv]
    scores: mx.array  # [B, H, width] float32 (zeros for a full cache)
    positions: mx.array  # [B, H, width] int32
    head_stored: np.ndarray  # [B, H]: the valid slots of each (row, head)
    flat: Optional[mx.array]  # [B, H, width] int32: each slot's index in a pooled row's own buffer (None: no such row)

    @classmethod
    def of(cls, caches: list, layer: int) -> "HeldRows":
        """Raises ``BatchUnsupported`` when the caches cannot share a batch."""
        if not caches:
            raise BatchUnsupported("a batch needs at least one row")
        rows = [_Row.of(cache, layer) for cache in caches]
        held = [_held(row) for row in rows]
        shapes = {(k.shape[1], k.shape[3], v.shape[3], k.dtype, v.dtype) for k, v, *_ in held}
        if len(shapes) > 1:
            raise BatchUnsupported(f"layer {layer}: rows differ in heads, head dims or dtypes: {sorted(map(str, shapes))}")
        head_stored = np.array([counts for *_, counts, _ in held], np.int64)  # [B, H]
        width = int(head_stored.max())
        padded = [mx.concatenate([_pad(part, width, axis=2) for part in parts]) for parts in zip(*(h[:4] for h in held))]
        flat = None
        if any(row.pooled for row in rows):
            flat = mx.concatenate([_pad(h[5], width, axis=2) for h in held])
        return cls(rows, width, *padded, head_stored, flat)


def held_counts(cache, layer: int) -> tuple[int, int, bool]:
    """``(offset, stored, pooled)`` of one layer's cache as a batch would take it, without gathering its tokens.

    Raises ``BatchUnsupported`` where it cannot join a batch.
    """
    row = _Row.of(cache, layer)
    return row.offset, row.stored, row.pooled


def _held(row: _Row):
    """``(keys, values, scores, positions, head counts [H], flat slots [1, H, T])`` one row holds now, head by head."""
    if row.evicting:
        slots = row.cache.slots
        keys, values = slots.held()
        scores, positions = slots.held_scores(), slots.held_positions()
        if row.pooled:
            return _unflattened(slots, keys, values, scores, positions)
        heads = keys.shape[1]
        flat = mx.zeros((1, heads, row.stored), mx.int32)
        return keys, values, scores, positions, [row.stored] * heads, flat
    keys, values = row.cache.keys[..., : row.stored, :], row.cache.values[..., : row.stored, :]
    batch, heads = keys.shape[:2]
    positions = mx.broadcast_to(mx.arange(row.stored, dtype=mx.int32), (batch, heads, row.stored))
    flat = mx.zeros((1, heads, row.stored), mx.int32)
    return keys, values, mx.zeros((batch, heads, row.stored), mx.float32), positions, [row.stored] * heads, flat


def _unflattened(slots, keys, values, scores, positions):
    """A pooled row's held tokens on the head axis, each head's slots in their order, padded to the longest head."""
    heads, n_heads, stored = slots.held_heads(), slots.n_heads, slots.stored
    owned = slots.membership(stored)  # [H, T]
    counts = owned.sum(axis=-1)
    rank = mx.take_along_axis(mx.cumsum(owned.astype(mx.int32), axis=-1), heads[None, :], axis=0)[0] - 1  # [T]
    width = int(counts.max().item())

    def spread(flat_part: mx.array) -> mx.array:  # [T, ...] -> [1, H, width, ...]
        out = mx.zeros((n_heads, width, *flat_part.shape[1:]), flat_part.dtype)
        out[heads, rank] = flat_part
        return out[None]

    parts = [spread(keys[0, 0]), spread(values[0, 0]), spread(scores[0, 0]), spread(positions[0, 0])]
    return (*parts, counts.tolist(), spread(mx.arange(stored, dtype=mx.int32)))


class BatchedLayer(DecodingBatch):
    """One layer's caches of B sequences, decoding one token per row per call (see the module doc)."""

    _derived = ("_n_sink", "_recent", "_pooled", "_ranked", "_folded", "_offset", "_valid")  # ``_rebuild``

    def __init__(self, caches: list, layer: int = 0):
        self.layer = layer
        held = HeldRows.of(caches, layer)
        self.rows = held.rows
        self.counts = RowCounts(self.rows, held.head_stored)
        self.keys, self.values, self.scores, self.positions = held.keys, held.values, held.scores, held.positions
        self._flat = held.flat
        self._offset = mx.array(self.counts.offset, mx.int32)
        self._settings()
        self._valid = None
        self._attended = True

    def _rebuild(self) -> None:
        """After a restore: the settings' columns, the offsets and the valid slots, from the rows and their counts."""
        self._settings()
        self._offset = mx.array(self.counts.offset, mx.int32)
        self._valid = _slot_numbers(self.keys.shape[2]) < self._head_stored()

    def row_caches(self) -> list:
        return [row.cache for row in self.rows]

    def _settings(self) -> None:
        """Per-row settings as ``[B, 1, 1]`` columns, and which rows each signal ranks and folds."""
        rows = self.rows
        self._n_sink = column([row.n_sink for row in rows], mx.int32)
        self._recent = column([row.recent for row in rows], mx.int32)
        self._pooled = column([row.pooled for row in rows], mx.bool_) if any(row.pooled for row in rows) else None
        self._ranked = row_groups(rows, lambda row: row.signal if row.evicting else None)
        self._folded = {
            observed: row_groups(rows, lambda row: row.signal if row.scores_decode and row.observed == observed else None)
            for observed in (True, False)
        }

    # ----- mlx-lm cache protocol ----------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Put each row's one new token in its slot; returns the whole buffers (the layer's mask covers the padding)."""
        check_batched_call(self.layer, keys, len(self.rows), self._attended)
        keys, values = keys.astype(self.keys.dtype), values.astype(self.values.dtype)
        counts = self.counts
        at_budget = counts.at_budget()
        self._grow_if_full(at_budget)
        stored = self._head_stored()  # before this token: each (row, head)'s next free slot, [B, H or 1, 1]
        position = self._offset[:, None, None]  # this token's
        slot = mx.broadcast_to(stored, (*self.scores.shape[:2], 1))
        if at_budget.any():
            victim = self._victims(stored, position)
            slot = mx.where(column(at_budget, mx.bool_), victim, slot) if not at_budget.all() else victim
        if self._flat is not None:  # a pooled row's appended token takes the next flat slot, head after head
            appended = column(counts.stored, mx.int32) + mx.arange(self.scores.shape[1], dtype=mx.int32)[None, :, None]
            kept = mx.take_along_axis(self._flat, slot, axis=-1)
            self._flat = mx.put_along_axis(self._flat, slot, mx.where(column(at_budget, mx.bool_), kept, appended), axis=-1)
        index = slot[..., None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(index, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(index, values.shape), values, axis=2)
        self.scores = mx.put_along_axis(self.scores, slot, mx.array(0.0), axis=-1)
        self.positions = mx.put_along_axis(self.positions, slot, mx.broadcast_to(position, slot.shape), axis=-1)
        counts.advance(at_budget)
        self._offset = self._offset + 1
        self._valid = _slot_numbers(self.keys.shape[2]) < self._head_stored()  # [B, H or 1, T]
        if self._folded[False]:
            rows = self.rows
            scale = next((row.scale for row in rows if row.scale is not None), keys.shape[-1] ** -0.5)
            proxy = attend_and_score(keys, self.keys, None, scale=scale, mask=self._valid[:, :, None], score_rows=1)
            self._fold(proxy.key_mass, observed=False)
        self._attended = False
        return self.keys, self.values

    def observe_attention(self, queries, keys, values, scale, mask, sinks=None) -> mx.array:
        """The step's attention over this layer's rows (padding masked), folding each observed row's scores."""
        if keys.shape[2] != self.keys.shape[2] or keys.shape[1] != self.keys.shape[1]:
            raise BatchUnsupported(f"layer {self.layer}: attention over keys other than the held ones cannot batch")
        self._attended = True
        score = bool(self._folded[True])
        valid = self._valid
        if valid.shape[1] > 1 and queries.shape[1] != valid.shape[1]:  # each query head sees its KV head's slots
            valid = mx.repeat(valid, queries.shape[1] // valid.shape[1], axis=1)
        result = attend_and_score(queries, keys, values, scale=scale, mask=valid[:, :, None], sinks=sinks, score_rows=int(score))
        if score:
            self._fold(result.key_mass, observed=True)
        return result.output

    @property
    def state(self):
        """Every array held: the buffers, each slot's flat index where a row has per-head budgets (``_flat``),
        then the rows' own caches' (``rows_state``)."""
        return [self.keys, self.values, self.scores, self.positions, *self._flat_kept(), *self.rows_state()]

    @state.setter
    def state(self, value):
        self._restore_state(value)

    @property
    def step_arrays(self) -> list:
        """The scores, and the flat slots of per-head rows: no later step reads them before ``extract``, so
        unevaluated each step's would hold the one before (a graph growing with every token)."""
        return [self.scores, *self._flat_kept()]

    def _flat_kept(self) -> list:
        return [] if self._flat is None else [self._flat]

    def size(self) -> int:
        return int(self.counts.head_stored.max())

    # ----- rows in and out (mlx-lm's BatchKVCache: ``extract``, ``filter``) --------------------

    def extract(self, index: int) -> list:
        """Write row ``index``'s state into its own cache, as decoding it alone would have left it.

        Returns the arrays written (lazy: evaluate them before the batch's buffers change
        or go, or they keep this step's whole buffers alive).
        """
        row = self.rows[index]
        stored, offset, seen, capacity = self.counts.row(index)
        keep = slice(index, index + 1)
        keys, values = self.keys[keep, :, :stored], self.values[keep, :, :stored]
        if not row.evicting:
            cache = row.cache
            cache.keys, cache.values = _owned(keys, capacity), _owned(values, capacity)
            cache.offset = offset
            return [cache.keys, cache.values]
        slots = row.cache.slots
        if row.pooled:
            self._extract_pooled(index, slots)
        else:
            slots.keys, slots.values = _owned(keys, capacity), _owned(values, capacity)
            slots.scores = _owned(self.scores[keep, :, :stored], capacity)
            slots.positions = _owned(self.positions[keep, :, :stored], capacity)
        slots.stored, slots.offset, slots.tokens_seen = stored, offset, seen
        return slots.arrays

    def _extract_pooled(self, index: int, slots) -> None:
        """Row ``index``'s heads back into its flattened buffer, each token in the slot decoding alone gave it."""
        stored, capacity = int(self.counts.stored[index]), int(self.counts.capacity[index])
        n_heads, width = self.keys.shape[1], self.keys.shape[2]
        valid = _slot_numbers(width)[0] < mx.array(self.counts.head_stored[index], mx.int32)[:, None]  # [H, W]
        target = mx.where(valid, self._flat[index], stored).reshape(-1)  # padding goes to one spare slot, dropped

        def flattened(part: mx.array) -> mx.array:  # [H, W, ...] -> [1, 1, capacity, ...]
            out = mx.zeros((stored + 1, *part.shape[2:]), part.dtype)
            out[target] = part.reshape(n_heads * width, *part.shape[2:])
            return _pad(out[:stored][None, None], capacity, axis=2)

        slots.keys, slots.values = flattened(self.keys[index]), flattened(self.values[index])
        slots.scores, slots.positions = flattened(self.scores[index]), flattened(self.positions[index])
        heads = mx.broadcast_to(mx.arange(n_heads, dtype=mx.int32)[:, None], (n_heads, width))
        slots.set_heads(flattened(heads)[0, 0])

    def join(self, other: "BatchedLayer") -> None:
        """``other``'s rows join this batch after its own (mlx-lm's ``BatchKVCache.extend``): continuous batching.

        ``other`` is the same layer batched from rows that have not decoded in this
        batch (``batch_layers`` of newly prefilled stacks); both buffers are padded to
        the wider one. Each row's counts, settings and slots are its own, so every row
        decodes on as it would have in either batch. Raises ``BatchUnsupported`` (and
        leaves this batch as it was) when the rows differ in heads, head dims or dtypes
        (``join_refusal``; ``join_layers`` asks every layer before any joins).
        """
        self.check_joinable(other)
        width = max(self.keys.shape[2], other.keys.shape[2])

        def joined(a: mx.array, b: mx.array) -> mx.array:
            return mx.concatenate([_pad(a, width, axis=2), _pad(b, width, axis=2)])

        if self._flat is not None or other._flat is not None:
            self._flat = joined(self._flat_or_zeros(), other._flat_or_zeros())
        self.keys, self.values = joined(self.keys, other.keys), joined(self.values, other.values)
        self.scores, self.positions = joined(self.scores, other.scores), joined(self.positions, other.positions)
        self._offset = mx.concatenate([self._offset, other._offset])
        self.rows = self.rows + other.rows
        self.counts.extend(other.counts)
        self._settings()
        self._valid = None

    def join_refusal(self, other: "BatchedLayer") -> Optional[str]:
        """Why ``other``'s rows cannot join this batch (None: they can)."""
        if not isinstance(other, BatchedLayer):
            return f"layer {self.layer}: rows of another kind ({type(other).__name__}) join a MixedBatch, not this layer"
        mine = (self.keys.shape[1], self.keys.shape[3], self.values.shape[3], self.keys.dtype, self.values.dtype)
        theirs = (other.keys.shape[1], other.keys.shape[3], other.values.shape[3], other.keys.dtype, other.values.dtype)
        if mine != theirs:
            return f"layer {self.layer}: rows differ in heads, head dims or dtypes: {mine} and {theirs}"
        return None

    def _flat_or_zeros(self) -> mx.array:
        """``[B, H, T]`` flat slots; zeros where no row is pooled (only pooled rows read theirs)."""
        return self._flat if self._flat is not None else mx.zeros(self.scores.shape, mx.int32)

    def filter(self, indices: list[int]) -> None:
        """Only rows ``indices`` stay in the batch (finished rows leave; ``extract`` them first)."""
        self.rows = [self.rows[i] for i in indices]
        self.counts.keep(indices)
        width = int(self.counts.head_stored.max())
        take = mx.array(indices, mx.int32)
        self.keys, self.values = self.keys[take, :, :width], self.values[take, :, :width]
        self.scores, self.positions = self.scores[take, :, :width], self.positions[take, :, :width]
        self._offset = self._offset[take]
        self._settings()
        if self._flat is not None:
            self._flat = self._flat[take, :, :width] if self._pooled is not None else None

    def checkpoint(self) -> tuple:
        """What ``restore`` needs to undo the calls made after it: the arrays' handles and the rows' counts.

        Nothing of the buffers is copied: the layer only ever rebinds its arrays
        (no in-place writes), so the old handles still hold the old state.
        """
        arrays = (self.keys, self.values, self.scores, self.positions, self._flat, self._offset, self._valid, self._attended)
        return arrays, self.counts.copy()

    def restore(self, checkpoint: tuple) -> None:
        """The layer as it was when ``checkpoint()`` returned ``checkpoint`` (same rows)."""
        arrays, counts = checkpoint
        self.keys, self.values, self.scores, self.positions, self._flat, self._offset, self._valid, self._attended = arrays
        self.counts.restore(counts)

    # ----- mechanics: the slots' rules (``velox_cache.cache.slots``) on B rows at once -----------

    def _grow_if_full(self, at_budget: np.ndarray) -> None:
        """Room for every row that appends: grow the buffers when one of them has no free slot left."""
        width = self.keys.shape[2]
        counts = self.counts
        appending = ~at_budget
        if not (appending & (counts.head_stored.max(axis=1) >= width)).any():
            return
        needed = int(counts.room()[appending].max())
        self.keys, self.values = _pad(self.keys, needed, axis=2), _pad(self.values, needed, axis=2)
        self.scores, self.positions = _pad(self.scores, needed, axis=2), _pad(self.positions, needed, axis=2)
        if self._flat is not None:
            self._flat = _pad(self._flat, needed, axis=2)

    def _head_stored(self) -> mx.array:
        """Valid slots per row ``[B, 1, 1]``, or per (row, head) ``[B, H, 1]`` when a row has per-head budgets."""
        if self._pooled is None:
            return column(self.counts.head_stored[:, 0], mx.int32)
        return mx.array(self.counts.head_stored[:, :, None], mx.int32)

    def _victims(self, stored: mx.array, position: mx.array) -> mx.array:
        """``[B, H, 1]``: the slot each head of each row at budget gives up (its lowest-ranked one).

        A pooled row's head whose every slot is protected gives up its oldest
        non-sink token, or its newest sink (``HeadPooledSlots.replace_lowest``).
        """
        ranking = self._protected_ranking(stored, position)
        victim = mx.argmin(ranking, axis=-1, keepdims=True)
        if self._pooled is None:
            return victim
        held = self.positions.astype(mx.float32)
        sink = self.positions < self._n_sink
        oldest = mx.where(sink, -held + 2.0 * (position.astype(mx.float32) + 1), held)
        oldest = mx.where(_slot_numbers(held.shape[-1]) >= stored, mx.inf, oldest)
        all_protected = mx.min(ranking, axis=-1, keepdims=True) == mx.inf
        return mx.where(self._pooled & all_protected, mx.argmin(oldest, axis=-1, keepdims=True), victim)

    def _protected_ranking(self, stored: mx.array, position: mx.array) -> mx.array:
        """``TokenSlots.protected_ranking`` for every row at once (``stored``, ``position``: ``[B, 1, 1]``).

        Each row's signal ranks its slots; padded slots rank +inf: never evicted.
        """
        ranking = by_group(self._ranked, lambda signal: signal.rank(self.scores, self.positions), self.scores)
        ranking = protect(ranking, self.positions, n_sink=self._n_sink, recent=self._recent, offset=position)
        return mx.where(_slot_numbers(self.positions.shape[-1]) >= stored, mx.inf, ranking)

    def _fold(self, mass: mx.array, *, observed: bool) -> None:
        """Fold one step's key mass ``[B, H', T]`` into the scores of the rows scored this way, by their signal."""
        mass = fold_heads(mass, self.scores.shape[1]) * self._valid
        self.scores = by_group(self._folded[observed], lambda signal: signal.combine(self.scores, mass), self.scores)


@functools.lru_cache(maxsize=64)
def _slot_numbers(width: int) -> mx.array:
    """``0 .. width - 1`` as ``[1, 1, width]`` (one array per width, reused)."""
    return mx.arange(width, dtype=mx.int32)[None, None]


def _pad(array: mx.array, length: int, axis: int) -> mx.array:
    """``array`` with zeros after it along ``axis`` up to ``length`` (as it is when already that long)."""
    missing = length - array.shape[axis]
    if missing <= 0:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, missing)
    return mx.pad(array, widths)


def _owned(row_slice: mx.array, capacity: int) -> mx.array:
    """A row's slice of a batch buffer, padded to ``capacity`` along the slots, in a buffer of its own.

    A slice is a view: kept as it is, it would keep the batch's whole buffer alive.
    """
    return mx.contiguous(_pad(row_slice, capacity, axis=2))


def join_layers(layers: list[BatchedLayer], joining: list[BatchedLayer]) -> None:
    """``joining``'s rows join ``layers``, layer by layer (``BatchedLayer.join``), or none does.

    Raises ``BatchUnsupported`` before any layer changes when the stacks differ in depth or
    any layer refuses: a batch is never left with rows in some layers and not in others.
    """
    if len(layers) != len(joining):
        raise BatchUnsupported(f"rows have stacks of different depths {sorted({len(layers), len(joining)})}: not the same model")
    refusal = next((r for r in map(_join_refusal, layers, joining) if r is not None), None)
    if refusal is not None:
        raise BatchUnsupported(refusal)
    for index, new in enumerate(joining):
        if not _same_kind(layers[index], new) and not isinstance(layers[index], MixedBatch):
            layers[index] = MixedBatch([layers[index]])  # a kind the batch did not hold yet: a part of its own
        layers[index].join(new)


def _same_kind(layer, new) -> bool:
    return type(layer) is type(new) and not isinstance(layer, MixedBatch)


def _join_refusal(layer, new) -> Optional[str]:
    """Why ``new``'s rows cannot join ``layer``: only rows of a kind the batch holds can refuse (heads, dtypes)."""
    if _same_kind(layer, new) or isinstance(layer, MixedBatch):
        return layer.join_refusal(new)
    return MixedBatch([layer]).join_refusal(new) if isinstance(new, MixedBatch) else None


def batch_refusal(stack: list) -> Optional[str]:
    """Why this prefilled stack cannot join any batch (a layer's cache kind or state, ``RowKind.refusal``), or None.

    Only what a row can tell on its own: rows that pass may still fail to batch
    together (unequal heads or dtypes, different models).
    """
    for layer, cache in enumerate(stack):
        refusal = row_kind(cache).refusal(cache)
        if refusal is not None:
            return f"layer {layer}: {refusal}"
    return None


def batch_layers(stacks: list[list]) -> list[BatchedLayer]:
    """One batched layer per layer for the prefilled cache stacks ``stacks`` (one per row, same model): the kind's
    holder (``RowKind.holder``) where every row is of one kind, else a ``MixedBatch`` of one part per kind."""
    if not stacks:
        raise BatchUnsupported("a batch needs at least one row")
    depth = {len(stack) for stack in stacks}
    if len(depth) > 1:
        raise BatchUnsupported(f"rows have stacks of different depths {sorted(depth)}: not the same model")
    layers = []
    for layer in range(len(stacks[0])):
        caches = [stack[layer] for stack in stacks]
        holders = [_holder(cache, layer) for cache in caches]
        if len(set(holders)) == 1:
            layers.append(holders[0](caches, layer))
        else:  # each kind in a part of its own, one model call for all
            layers.append(MixedBatch.of(list(zip(holders, caches)), layer))
    return layers


def _holder(cache, layer: int) -> type:
    kind = row_kind(cache)
    if kind.holder is None:
        raise BatchUnsupported(f"layer {layer}: {kind.refusal(cache)}")
    return kind.holder


# ----- what a row costs a decoding batch ------------------------------------------------------------


class RowFootprint(NamedTuple):
    """What one prefilled stack costs a decoding batch (``row_footprint``), fixed when it joins."""

    own_bytes: int  # its caches as they are now (it keeps them until it leaves the batch); alone: as they end
    parts: tuple = ()  # ((layer, holder, part), slots per head by its last new token, bytes of one slot across heads)
    batches: bool = True  # False: it decodes alone (``batch_refusal``), in no batch buffer: its own bytes only


def row_footprint(stack: list, new_tokens: int) -> RowFootprint:
    """``stack``'s footprint in a batch it joins now, with ``new_tokens`` still to take (see ``decode_footprint``).

    Take it before the row joins: once it decodes in a batch, its own caches' counts
    stay as they were when it joined (the batch counts for it). A row that decodes
    alone costs what its own caches hold by its last token (``RowKind.alone_bytes``).
    """
    kinds = [row_kind(cache) for cache in stack]
    if batch_refusal(stack) is not None:
        return RowFootprint(sum(kind.alone_bytes(cache, new_tokens) for kind, cache in zip(kinds, stack)), batches=False)
    parts = tuple(
        ((layer, kind.holder, part), width, size)
        for layer, (kind, cache) in enumerate(zip(kinds, stack))
        for part, (width, size) in enumerate(kind.parts(cache, new_tokens))
    )
    return RowFootprint(sum(held_bytes(cache) for cache in stack), parts)


def batch_footprint(rows: list[RowFootprint]) -> int:
    """The most bytes these rows hold decoding together: their own caches, plus the batch's buffers at their
    widest: each layer's part of each kind (``RowKind.parts``) holds its rows padded to the widest of them, at
    that row's last token, whatever the other kinds' rows hold."""
    widest: dict = {}  # (layer, holder, part) -> [rows, slots per head, bytes per slot]
    for row in rows:
        for key, width, size in row.parts:
            held = widest.setdefault(key, [0, 0, 0])
            held[0], held[1], held[2] = held[0] + 1, max(held[1], width), max(held[2], size)
    return sum(row.own_bytes for row in rows) + sum(count * width * size for count, width, size in widest.values())


def decode_footprint(stacks: list[list], new_tokens: list[int]) -> int:
    """The most bytes ``stacks`` hold decoding together as one batch until each has taken ``new_tokens[i]`` more.

    Each row's own caches as they are now (they keep their arrays until the row
    leaves the batch), plus the batch's buffers: per layer and per kind of row
    (``KINDS``: a float row, full or evicting, in ``BatchedLayer``; a quantized full
    row in ``QuantizedFullBatch``; a quantized evicting row in ``QuantizedSlotsBatch``),
    every row of that kind padded to its widest row's final width (a full row grows by
    its new tokens plus a growth step, an evicting row stops at its budget). A row that
    cannot batch (``batch_refusal``) decodes alone: what its own caches hold by its last
    token. Prefilled stacks that have not decoded in a batch yet (no array is evaluated);
    an upper bound on what ``decode_rows`` holds for them.
    """
    if len(stacks) != len(new_tokens):
        raise ValueError(f"new_tokens: {len(new_tokens)} counts for {len(stacks)} stacks")
    return batch_footprint([row_footprint(stack, new) for stack, new in zip(stacks, new_tokens)])


def held_bytes(cache) -> int:
    """Bytes of every array one layer's cache holds: its ``state``'s arrays, each once (or its ``nbytes``, where
    that counts more: a buffer whose ``state`` is a view)."""
    arrays = {id(array): array for array in state_arrays(cache)} if hasattr(cache, "state") else {}
    return max(getattr(cache, "nbytes", 0) or 0, sum(array.nbytes for array in arrays.values()))


# ----- the kinds of rows, declared once ---------------------------------------------------------------


@dataclass(frozen=True)
class RowKind:
    """One kind of layer cache, as decoding rows in a batch needs to know it (``KINDS``, ``row_kind``).

    ``holds(cache)``: whether a layer's cache is of this kind. ``holder``: the batched layer class its rows
    decode in (None: it never joins a batch). ``refusal(cache)``: why this cache cannot join a batch now
    (None: it can). ``parts(cache, new)``: ``[(slots per head, bytes of one slot across heads)]``, one per buffer
    the holder pads to its widest row, as this row needs them by its ``new``-th new token. ``alone_bytes(cache,
    new)``: the most bytes its own buffers hold decoding ``new`` tokens alone. ``evicting``: it ranks and evicts.
    """

    name: str
    holds: Callable
    holder: Optional[type]
    refusal: Callable
    parts: Callable
    alone_bytes: Callable
    evicting: bool = False


def row_kind(cache) -> RowKind:
    """The kind of ``cache`` (the first of ``KINDS`` that holds it)."""
    return next(kind for kind in KINDS if kind.holds(cache))


def _is_quantized_full(cache) -> bool:
    """A full cache at ``kv_bits`` (``QuantizedFullKVCache``)."""
    return hasattr(cache, "tokens") and bool(getattr(cache, "kv_bits", None))


def _evicting(cache) -> bool:
    return isinstance(cache, EvictingKVCache)


def _slots_refusal(cache) -> Optional[str]:
    refusal = cache.batch_refusal()
    if refusal is None and not issubclass(cache.slots.signal, Signal):
        return f"signal {cache.slots.signal.__name__} has no batched form"
    return refusal


def _float_parts(cache, new: int) -> list[tuple[int, int]]:
    """``BatchedLayer``'s one part: the slots per head the row may need and one slot's key, value, score,
    position and flat index across heads. A row grows the batch by ``RowCounts.room`` when it appends into a
    full buffer: a full row to ``held + new + GROWTH_STEP`` at most, an evicting row to its budget."""
    if _evicting(cache):
        slots = cache.slots
        keys, values = slots.keys, slots.values
        if keys is None:
            return []
        pooled = slots.heads_pooled
        heads = slots.n_heads if pooled else keys.shape[1]
        held = max(slots.head_counts(), default=0) if pooled else slots.stored
        per_step = heads if pooled else 1
        room = max(0, (cache.layer_budget * per_step - slots.stored) // per_step)  # appends left before its budget
    else:
        keys, values = cache.keys, cache.values
        if keys is None:
            return []
        heads, held, room = keys.shape[1], cache.offset, new + GROWTH_STEP  # keeps every token
    width = held + min(room, new + GROWTH_STEP) if new > 0 and room > 0 else held
    per_head = keys.shape[-1] * keys.dtype.size + values.shape[-1] * values.dtype.size + 3 * 4  # + score, position, flat
    return [(width, heads * per_head)]


def _quantized_full_parts(cache, new: int) -> list[tuple[int, int]]:
    """``QuantizedFullBatch``'s parts: the codes (a token's codes, group number and value scales), the key
    groups' scales, and the float window, which starts ``QUANTIZED_WINDOW_STEP`` wider than the widest row's and
    grows by as much when full."""
    tokens = cache.tokens
    per_group = sum(slot_bytes(a) for a in (tokens.key_scales, tokens.key_zeros) if a is not None)
    return [(tokens.quantized, tokens.code_bytes_per_token()), (tokens.groups, per_group),
            (tokens.tail + new + QUANTIZED_WINDOW_STEP, tokens.float_bytes_per_token())]


def _quantized_slots_parts(cache, new: int) -> list[tuple[int, int]]:
    """``QuantizedSlotsBatch``'s parts: the quantized region (at most the budget plus a group), the key groups'
    scales (one more group each ``group`` tokens, ``GROUP_STEP`` spare) and the float window; the scores,
    positions and liveness cover the region and the window."""
    slots = cache.slots
    meta = sum(slot_bytes(a) for a in (slots.scores, slots.positions, slots.live))
    per_code = sum(slot_bytes(getattr(slots, name)) for name in SLOT_PARTS) + meta
    per_group = slot_bytes(slots.key_scales) + slot_bytes(slots.key_zeros)
    per_float = slot_bytes(slots.keys) + slot_bytes(slots.values) + meta
    region = max(slots.quantized_count, cache.layer_budget + slots.group)
    groups = slots.groups + (slots.tail + new) // slots.group + GROUP_STEP
    return [(region, per_code), (groups, per_group), (max(slots.keys.shape[2], slots.group), per_float)]


def _full_alone(cache, new: int) -> int:
    """A full float cache alone grows as mlx-lm's ``KVCache``: by ``FULL_STEP`` slots whenever it is full."""
    keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
    if keys is None or cache.offset + new <= keys.shape[2]:
        return held_bytes(cache)
    return held_bytes(cache) + (cache.offset + new + FULL_STEP - keys.shape[2]) * (slot_bytes(keys) + slot_bytes(values))


def _slots_alone(cache, new: int) -> int:
    """An evicting cache alone grows its slots up to its budget (``decode_capacity``), never past it."""
    slots = cache.slots
    capacity = slots.capacity
    if slots.keys is None or not capacity:
        return held_bytes(cache)
    budget = cache.layer_budget * (slots.n_heads if slots.heads_pooled else 1)
    per_slot = -(-sum(array.nbytes for array in slots.arrays) // capacity)
    return held_bytes(cache) + max(0, budget - capacity) * per_slot


def _quantized_full_alone(cache, new: int) -> int:
    """A quantized full cache alone: its float window grows to whole ``QUANTIZED_WINDOW_STEP`` s of what it holds
    by its last token. (A cache not yet decoding quantizes its prompt at its first token: codes take fewer bytes
    than the float window they replace.)"""
    tokens = cache.tokens
    if tokens.empty:
        return held_bytes(cache)
    room = tokens.tail_keys.shape[2]
    needed = -(-(tokens.tail + new) // QUANTIZED_WINDOW_STEP) * QUANTIZED_WINDOW_STEP
    return held_bytes(cache) + max(0, needed - room) * tokens.float_bytes_per_token()


def _quantized_slots_alone(cache, new: int) -> int:
    """A quantized evicting cache alone: at most what a batch of its kind holds for it, or what it holds now."""
    return held_bytes(cache) + sum(width * size for width, size in _quantized_slots_parts(cache, new))


def _other_alone(cache, new: int) -> int:
    """A cache no batch holds (sliding window, state space, mlx-lm's quantized cache): what it holds now, grown
    to its window (``max_size``) where it has one."""
    keys, values, window = getattr(cache, "keys", None), getattr(cache, "values", None), getattr(cache, "max_size", None)
    if not isinstance(keys, mx.array) or not isinstance(values, mx.array) or window is None or window <= keys.shape[2]:
        return held_bytes(cache)
    return held_bytes(cache) + (window - keys.shape[2]) * (slot_bytes(keys) + slot_bytes(values))


def _no_batch(cache) -> str:
    return (f"a {type(cache).__name__} cannot decode in a batch (only Velox's evicting and full caches and "
            "mlx-lm's KVCache can, after prefill)")


KINDS = (
    RowKind("quantized evicting", quantized_slots, QuantizedSlotsBatch, lambda cache: cache.batch_refusal(),
            _quantized_slots_parts, _quantized_slots_alone, evicting=True),
    RowKind("float evicting", _evicting, BatchedLayer, _slots_refusal, _float_parts, _slots_alone,
            evicting=True),
    RowKind("quantized full", _is_quantized_full, QuantizedFullBatch,
            lambda cache: None if cache.decoding else "a quantized full cache joins a batch once decoding started",
            _quantized_full_parts, _quantized_full_alone),
    RowKind("float full", lambda cache: isinstance(cache, KVCache) and not getattr(cache, "kv_bits", None),
            BatchedLayer, lambda cache: _no_batch(cache) if cache.keys is None else None, _float_parts, _full_alone),
    RowKind("no batch", lambda cache: True, None, _no_batch, lambda cache, new: [], _other_alone),
)
