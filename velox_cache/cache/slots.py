"""``TokenSlots``: the arrays one layer holds, where its sequence stands, and how they change.

Buffers: ``keys``/``values`` ``[B, H, T, D]``, ``scores`` ``[B, H, T]`` (float32,
higher = keep) and ``positions`` ``[B, H, T]``: the position each key's RoPE
rotation encodes. Only the first ``stored`` slots are valid; the rest is spare
room that appends write into in place.

Every change is vectorised over batch and heads: ``append`` (new tokens after
the held ones), ``keep`` (one gather of the chosen slots), ``replace`` (one
scatter into one slot per head), ``truncate`` (drop the newest slots) and
``rerotate`` (move keys to new positions; RoPE rotations compose).

Eviction mechanics live here too: the protected ranking (sinks and the recent
window rank first), ``evict_to`` (one top-k per head), ``replace_lowest`` (one
decode token into each head's lowest-ranked slot) and ``compact`` (re-rotate
to contiguous positions).

Layout hooks (``attend``, ``pool``, ``heads_see``, ``at_budget``,
``kept_per_head``) answer for uniform heads here: every head holds ``stored``
slots on its own head axis. ``velox_cache.cache.head_slots.HeadPooledSlots``
answers them for per-head budgets (one flattened head x token buffer).

Per-sequence counts: ``stored`` (valid slots), ``offset`` (the position the
next token gets) and ``tokens_seen`` (tokens passed in, probes excepted). They
are plain ints for the one sequence a stack holds; they are kept together
here, beside the buffers they describe, so that a batch of sequences of
unequal lengths can later hold one of each per row.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ..kernels import attention
from ..kernels.attend import AttentionResult, attend_and_score

GROWTH_STEP = 256  # buffer growth granularity, as mlx-lm's KVCache


# The eviction and growth rules, shared with batched decoding (``velox_cache.generation.batching``),
# which applies them to B rows at once: counts there are ``[B]`` NumPy arrays or ``[B, 1, 1]`` MLX columns.


def recent_limit(recent, budget, n_sink):
    """The protected recent window at ``budget``: at most ``budget - n_sink - 1``, so one slot can always go."""
    return np.maximum(0, np.minimum(recent, budget - n_sink - 1))


def protect(ranking: mx.array, positions: mx.array, *, n_sink, recent, offset) -> mx.array:
    """``ranking`` with protected tokens at +inf: the first ``n_sink`` positions and the ``recent`` before ``offset``."""
    protected = positions < n_sink
    if isinstance(recent, mx.array):
        protected = protected | ((recent > 0) & (positions >= offset - recent))
    elif recent > 0:
        protected = protected | (positions >= offset - recent)
    return mx.where(protected, mx.inf, ranking)


def decode_capacity(end, budget):
    """The buffer length after growing for a decode token that ends at ``end``: room up to the budget."""
    return np.maximum(end, np.minimum(budget, end + GROWTH_STEP))


class TokenSlots:
    """Keys, values, scores and positions of the tokens one cache layer holds.

    ``signal`` (a class from ``velox_cache.cache.signals``) ranks held tokens for
    eviction; the first ``n_sink`` positions and the ``recent`` latest ones
    (at most ``budget - n_sink - 1``) are never evicted.
    """

    def __init__(self, signal, n_sink: int, recent: int):
        self.signal = signal
        self.n_sink = n_sink
        self.recent = recent
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.scores: Optional[mx.array] = None
        self.positions: Optional[mx.array] = None
        self.stored = 0
        self.offset = 0
        self.tokens_seen = 0  # per head, probes excepted

    @property
    def empty(self) -> bool:
        return self.keys is None

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def kv_heads(self) -> int:
        """Key/value heads of the layer (the buffers' head axis)."""
        return 0 if self.keys is None else self.keys.shape[1]

    @property
    def kept_per_head(self) -> int:
        """Tokens each head holds."""
        return self.stored

    def at_budget(self, budget: int) -> bool:
        """True when every head holds exactly ``budget`` tokens (a decode token then replaces one)."""
        return self.stored == budget

    heads_pooled = False  # True for ``velox_cache.cache.head_slots.HeadPooledSlots`` (per-head counts)

    def heads_see(self, n_q_heads: int) -> Optional[mx.array]:
        """Where heads share one buffer axis, which held slots each query head sees ``[H*R, 1, stored]`` (None: all)."""
        return None

    def pool(self, mass: mx.array, kernel: int) -> mx.array:
        """``mass`` ``[B, H, N]`` of the first N slots, max-pooled over ``kernel`` neighbouring slots of each head."""
        return attention.max_pool(mass, kernel)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, **options) -> AttentionResult:
        """``attend_and_score`` over ``keys``/``values`` (what ``update_and_fetch`` returned), ``options`` as there."""
        return attend_and_score(queries, keys, values, **options)

    @property
    def arrays(self) -> list:
        """Every array held (for ``state``)."""
        return [a for a in (self.keys, self.values, self.scores, self.positions) if a is not None]

    def start(self, keys: mx.array, values: mx.array, key_dtype, value_dtype) -> None:
        """Empty buffers shaped like the first call's ``keys``/``values``."""
        batch, heads, _, _ = keys.shape
        self.keys = mx.zeros((batch, heads, 0, keys.shape[-1]), key_dtype)
        self.values = mx.zeros((batch, heads, 0, values.shape[-1]), value_dtype)
        self.scores = mx.zeros((batch, heads, 0), mx.float32)
        self.positions = mx.zeros((batch, heads, 0), mx.int32)
        self.stored = 0

    def adopt(self, other: "TokenSlots") -> None:
        """Hold what ``other`` holds (its arrays, counts and positions), sharing nothing with it."""
        for name in ("keys", "values", "scores", "positions"):
            value = getattr(other, name)
            setattr(self, name, None if value is None else mx.array(value))
        self.stored, self.offset, self.tokens_seen = other.stored, other.offset, other.tokens_seen

    def held(self):
        """``(keys, values)`` of the valid slots, in slot order."""
        if self.keys.shape[2] == self.stored:
            return self.keys, self.values
        return self.keys[:, :, : self.stored], self.values[:, :, : self.stored]

    def held_scores(self) -> mx.array:
        return self.scores[..., : self.stored]

    def held_positions(self) -> mx.array:
        return self.positions[..., : self.stored]

    def set_scores(self, scores: mx.array) -> None:
        """Replace the scores of the held slots with ``scores`` ``[B, H, stored]``."""
        pad = self.scores.shape[-1] - scores.shape[-1]
        self.scores = mx.pad(scores, [(0, 0), (0, 0), (0, pad)]) if pad else scores

    def add_scores(self, mass: mx.array, replace: bool = False) -> None:
        """Add ``mass`` ``[B, H, N]`` (N <= buffer length) to the first N slots' scores, or replace them."""
        self.combine_scores(mass, (lambda scores, mass: mass) if replace else mx.add)

    def combine_scores(self, mass: mx.array, combine) -> None:
        """Scores become ``combine(scores, mass)``, ``mass`` ``[B, H, N]`` padded with zeros to the buffer's length."""
        pad = self.scores.shape[-1] - mass.shape[-1]
        if pad:
            mass = mx.pad(mass, [(0, 0), (0, 0), (0, pad)])
        self.scores = combine(self.scores, mass)

    def spare_for(self, n_new: int, *, budget: int, in_steps: bool) -> int:
        """Empty slots to add when the buffer grows for ``n_new`` tokens, so that the next appends write in place.

        A decode token below budget gets room up to the budget; a chunk gets
        room to the next ``GROWTH_STEP`` when nothing is evicted soon (``in_steps``).
        """
        end = self.stored + n_new
        if n_new == 1:
            return int(decode_capacity(end, budget)) - end
        return -end % GROWTH_STEP if in_steps else 0

    def append(self, keys: mx.array, values: mx.array, first_position: int, spare: int) -> None:
        """Write new tokens after the held ones: in place when the buffer has room, else grow it by ``spare``."""
        batch, heads, n_new, _ = keys.shape
        new_positions = mx.broadcast_to(
            mx.arange(first_position, first_position + n_new, dtype=mx.int32), (batch, heads, n_new)
        )
        self._write(keys, values, new_positions, spare)

    def _write(self, keys: mx.array, values: mx.array, new_positions: mx.array, spare: int) -> None:
        """Write ``keys``/``values`` ``[B, H, n, D]`` at ``new_positions`` ``[B, H, n]`` after the held slots."""
        batch, heads, n_new, _ = keys.shape
        start, end = self.stored, self.stored + n_new
        if end <= self.keys.shape[2]:
            self.keys[:, :, start:end] = keys
            self.values[:, :, start:end] = values
            self.scores[:, :, start:end] = 0
            self.positions[:, :, start:end] = new_positions
        else:
            kept_keys, kept_values = self.held()
            self.keys = _concat(kept_keys, keys, spare)
            self.values = _concat(kept_values, values, spare)
            self.scores = _concat(self.held_scores(), mx.zeros((batch, heads, n_new)), spare)
            self.positions = _concat(self.held_positions(), new_positions, spare)
        self.stored = end

    def keep(self, indices: mx.array) -> None:
        """Keep only the slots ``indices`` ``[B, H, K]`` of every head, in that order (one gather)."""
        keys, values = self.held()
        self.keys = mx.take_along_axis(keys, indices[..., None], axis=2)
        self.values = mx.take_along_axis(values, indices[..., None], axis=2)
        self.scores = mx.take_along_axis(self.held_scores(), indices, axis=-1)
        self.positions = mx.take_along_axis(self.held_positions(), indices, axis=-1)
        self.stored = indices.shape[-1]

    def replace(self, slot: mx.array, keys: mx.array, values: mx.array, position: int) -> None:
        """Write one new token into slot ``slot`` ``[B, H, 1]`` of each head (buffer at its size)."""
        if self.keys.shape[2] != self.stored:
            self.keys, self.values = self.held()
            self.scores = self.held_scores()
            self.positions = self.held_positions()
        index = slot[..., None]  # [B, H, 1, 1]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(index, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(index, values.shape), values, axis=2)
        self.scores = mx.put_along_axis(self.scores, slot, mx.array(0.0), axis=-1)
        self.positions = mx.put_along_axis(self.positions, slot, mx.array(position, mx.int32), axis=-1)

    def truncate(self, stored: int, capacity: int) -> None:
        """Back to ``stored`` valid slots in a buffer of ``capacity``: later slots are dropped, spare ones zeroed.

        Spare slots are always zeros otherwise, so this restores the buffers a
        probe found, exactly.
        """
        self.keys = self.keys[:, :, :capacity]
        self.values = self.values[:, :, :capacity]
        self.scores = self.scores[..., :capacity]
        self.positions = self.positions[..., :capacity]
        if capacity > stored:
            self.keys[:, :, stored:] = 0
            self.values[:, :, stored:] = 0
            self.scores[..., stored:] = 0
            self.positions[..., stored:] = 0
        self.stored = stored

    def rerotate(self, shift, new_positions: mx.array) -> None:
        """Rotate each held key from its position to ``new_positions`` ``[B, H, stored]``.

        ``shift`` is a ``velox_cache.kernels.rope.RotaryShift``.
        """
        keys, values = self.held()
        delta = new_positions - self.held_positions()
        self.keys = shift.shift(keys, delta)
        self.values = values
        self.scores = self.held_scores()
        self.positions = new_positions.astype(mx.int32)


    # ----- eviction ----------------------------------------------------------------------

    def protected_ranking(self, budget: int) -> mx.array:
        """Eviction ranking over the held slots ``[B, H, stored]``; protected tokens rank +inf."""
        recent = int(recent_limit(self.recent, budget, self.n_sink))
        return protect(self.signal.ranking(self), self.held_positions(), n_sink=self.n_sink, recent=recent, offset=self.offset)

    def evict_to(self, budget: int) -> Optional[mx.array]:
        """Keep the ``budget`` best-ranked held tokens of every head, in slot order.

        Returns the kept slot indices ``[B, H, budget]`` (None when nothing was evicted).
        """
        if self.stored <= budget:
            return None
        ranking = self.protected_ranking(budget)
        keep = mx.sort(mx.argpartition(-ranking, kth=budget - 1, axis=-1)[..., :budget], axis=-1)  # [B, H, budget]
        self.keep(keep)
        return keep

    def replace_lowest(self, keys: mx.array, values: mx.array, budget: int) -> None:
        """Write one new token into each head's lowest-ranked slot (the buffer at ``budget``)."""
        victim = mx.argmin(self.protected_ranking(budget), axis=-1, keepdims=True)  # [B, H, 1]
        self.replace(victim, keys, values, self.offset)

    def compact(self, shift) -> None:
        """Re-rotate the held keys to positions ``0 .. stored - 1``, in position order; ``offset`` becomes ``stored``."""
        rank = mx.argsort(mx.argsort(self.held_positions(), axis=-1), axis=-1).astype(mx.int32)  # [B, H, held]
        self.rerotate(shift, rank)
        self.offset = self.stored


def _concat(kept: mx.array, new: mx.array, spare: int) -> mx.array:
    """``kept`` then ``new`` then ``spare`` empty slots, along the token axis (2)."""
    parts = [kept, new] if kept.shape[2] else [new]
    if spare:
        parts.append(mx.zeros((*new.shape[:2], spare, *new.shape[3:]), new.dtype))
    return mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
