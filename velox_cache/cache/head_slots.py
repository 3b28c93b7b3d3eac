"""``HeadPooledSlots``: per-head budgets that shrink memory (AdaKV's selection, really stored).

With uniform heads every KV head of a layer keeps ``budget`` tokens. Attention
is not like that: some heads concentrate on a handful of tokens, others spread
wide. AdaKV (Feng et al., 2024) keeps the layer's total (``heads x budget``)
but selects with one top-k over all heads at once, after guaranteeing every
head a floor. kvpress simulates it by masking; here the bytes follow the
per-head counts.

Layout: a flattened head x token buffer, ``[B=1, 1, T, D]``, with ``heads``
``[T]`` naming each slot's KV head (selection leaves each head's slots
together and in slot order). A layer holding ``heads x budget`` tokens takes
exactly the bytes of uniform heads at ``budget``. Each query head attends to
its KV head's slots only (a decode step names each slot's head to the
kernel; a chunk goes head by head), so the model's attention must go through Velox
(``velox_cache.observe`` or ``fast_attention``).

Everything else is ``TokenSlots`` with one (flattened) head: appends write
``heads x n`` slots, ``evict_to`` is the adaptive selection (``adaptive_keep``),
``replace_lowest`` puts a decode token into each head's own lowest-ranked
slot (per-head counts then stay as selected), ``compact`` re-rotates each
head to contiguous positions.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..kernels import attention
from ..kernels.attend import AttentionResult, attend_and_score
from ..kernels.masks import pooled_heads_mask
from .slots import TokenSlots, recent_limit


def head_membership(heads: mx.array, n_heads: int) -> mx.array:
    """``[H, T]`` bool: row h marks the slots of head h (``heads`` ``[T]``)."""
    return heads[None, :] == mx.arange(n_heads, dtype=heads.dtype)[:, None]


def adaptive_keep(ranking: mx.array, heads: mx.array, n_heads: int, budget: int, floor: int) -> mx.array:
    """Slots to keep: ``n_heads * budget`` of them, at least ``floor`` per head, the rest by ranking.

    ``ranking`` ``[T]`` (higher = keep; protected slots +inf) and ``heads``
    ``[T]`` (each slot's head). Every head first keeps its ``floor`` best
    slots (at least one); the remaining ``n_heads * (budget - floor)`` go to the best-ranked
    slots of any head (one top-k over the layer). Returns slot indices
    ``[n_heads * budget]`` grouped by head, in slot order within a head.
    """
    total = n_heads * budget
    per_head = mx.where(head_membership(heads, n_heads), ranking[None, :], -mx.inf)
    rank_in_row = mx.argsort(mx.argsort(-per_head, axis=-1), axis=-1)  # [H, T]: 0 = the head's best
    own_rank = mx.take_along_axis(rank_in_row, heads[None, :].astype(mx.int32), axis=0)[0]
    adjusted = mx.where(own_rank < min(max(floor, 1), budget), mx.inf, ranking)  # no head is left empty
    keep = mx.argpartition(-adjusted, kth=total - 1)[:total]
    order = mx.argsort(heads[keep].astype(mx.int32) * ranking.shape[0] + keep.astype(mx.int32))
    return keep[order].astype(mx.int32)


class HeadPooledSlots(TokenSlots):
    """A layer's tokens in one flattened head x token buffer; each KV head keeps its own number.

    ``floor``: the tokens every head keeps at least, as a share of the per-head
    budget (AdaKV's alpha). Built from a uniform layer's slots by ``pooled``.
    """

    def __init__(self, signal, n_sink: int, recent: int, n_heads: int, floor: float):
        super().__init__(signal, n_sink, recent)
        self.n_heads = n_heads
        self.floor = floor
        self.heads: Optional[mx.array] = None  # [T] int32: the KV head of each slot
        self._heads_changed = 0  # counts changes of ``heads`` (the attention mask is reused until then)
        self._mask_cache = None
        self._by_head_cache = None
        self._membership_cache = None
        self._counts_cache = None

    @classmethod
    def pooled(cls, slots: TokenSlots, floor: float) -> "HeadPooledSlots":
        """The held tokens of uniform ``slots`` (one sequence), flattened head by head."""
        batch, n_heads, _, dim = slots.keys.shape
        if batch != 1:
            raise ValueError(f"per-head budgets hold one sequence per cache stack, got a batch of {batch}")
        pooled = cls(slots.signal, slots.n_sink, slots.recent, n_heads, floor)
        keys, values = slots.held()
        held = slots.stored
        pooled.keys = keys.reshape(1, 1, n_heads * held, dim)
        pooled.values = values.reshape(1, 1, n_heads * held, values.shape[-1])
        pooled.scores = slots.held_scores().reshape(1, 1, n_heads * held)
        pooled.positions = slots.held_positions().reshape(1, 1, n_heads * held)
        pooled.heads = mx.repeat(mx.arange(n_heads, dtype=mx.int32), held)
        pooled.stored, pooled.offset, pooled.tokens_seen = n_heads * held, slots.offset, slots.tokens_seen
        return pooled

    heads_pooled = True
    _derived = ("_mask_cache", "_by_head_cache", "_membership_cache", "_counts_cache")  # memos, rebuilt when asked

    # ----- counts ------------------------------------------------------------------------

    @property
    def kv_heads(self) -> int:
        return self.n_heads

    @property
    def kept_per_head(self) -> int:
        """Tokens per head on average (the layer's total is always a multiple of the heads)."""
        return self.stored // self.n_heads

    def at_budget(self, budget: int) -> bool:
        return self.stored == budget * self.n_heads

    def held_heads(self) -> mx.array:
        return self.heads if self.heads.shape[0] == self.stored else self.heads[: self.stored]

    def head_counts(self) -> list:
        """Tokens each KV head holds now (``[H]`` ints; read from the device once while heads stay)."""
        key = (self._heads_changed, self.stored)
        if self._counts_cache is None or self._counts_cache[0] != key:
            self._counts_cache = (key, self.membership(self.stored).sum(axis=-1).tolist())
        return self._counts_cache[1]

    def membership(self, n_slots: int) -> mx.array:
        """``[H, n_slots]`` bool: which of the first ``n_slots`` slots each head holds (reused while heads stay)."""
        key = (self._heads_changed, n_slots)
        if self._membership_cache is None or self._membership_cache[0] != key:
            self._membership_cache = (key, head_membership(self.heads[:n_slots], self.n_heads))
        return self._membership_cache[1]

    @property
    def arrays(self) -> list:
        return super().arrays + ([self.heads] if self.heads is not None else [])

    # ----- attention ---------------------------------------------------------------------

    def heads_see(self, n_q_heads: int) -> mx.array:
        """Which held slots each query head sees ``[H*R, 1, T]``: its own KV head's."""
        return pooled_heads_mask(self.held_heads(), n_q_heads, self.n_heads)[0]

    def pool(self, mass: mx.array, kernel: int) -> mx.array:
        """``mass`` ``[1, 1, N]`` of the first N slots, max-pooled over neighbouring slots of the same head."""
        n_slots = mass.shape[-1]
        heads, owned = self.heads[:n_slots], self.membership(n_slots)
        # each head's slots side by side, in slot order: [H, N], -inf after a head's last one
        rank = mx.take_along_axis(mx.cumsum(owned.astype(mx.int32), axis=-1), heads[None, :], axis=0)[0] - 1
        side_by_side = mx.full((self.n_heads, n_slots), -mx.inf, mass.dtype)
        side_by_side[heads, rank] = mass[0, 0]
        pooled = attention.max_pool(side_by_side, kernel)
        return pooled[heads, rank].reshape(mass.shape)

    def attention_mask(self, n_queries: int, n_q_heads: int) -> mx.array:
        """Which held slots each query of the latest call sees ``[1, H*R, n_queries, T]`` (bool).

        A query head sees its KV head's slots only, at or before its own
        position (the call's queries are the last ``n_queries`` positions
        before ``offset``).
        """
        key = (self._heads_changed, self.stored, n_queries, n_q_heads, self.offset if n_queries > 1 else None)
        if self._mask_cache is not None and self._mask_cache[0] == key:
            return self._mask_cache[1]
        visible = self.heads_see(n_q_heads)
        if n_queries > 1:
            query_positions = mx.arange(self.offset - n_queries, self.offset, dtype=mx.int32)
            visible = visible & (self.held_positions()[0, 0][None, None, :] <= query_positions[None, :, None])
        mask = visible[None]
        self._mask_cache = (key, mask)
        return mask

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, *, mask=None, **options) -> AttentionResult:
        """Attention of the latest call's queries, each query head over its own KV head's slots.

        The model's ``mask`` is replaced by the layout's own. A decode token
        attends in one call that names each slot's head (``key_heads``: the
        fused kernel reads only the query head's own slots; other paths mask
        the rest). A call with attention sinks attends over the whole buffer
        with ``attention_mask``. A chunk attends
        head by head over that head's slots, which hold its new tokens last
        and in order (a plain causal mask, no wasted work), and the scores go
        back to their slots.
        """
        n_q_heads, n_queries = queries.shape[1], queries.shape[2]
        if options.get("sinks") is not None:
            return attend_and_score(queries, keys, values, mask=self.attention_mask(n_queries, n_q_heads), **options)
        if n_queries == 1:  # every head over its own slots, in one call
            return attend_and_score(queries, keys, values, key_heads=self.held_heads(), n_heads=self.n_heads, **options)
        group = n_q_heads // self.n_heads
        parts = []
        for head, slots in enumerate(self.slots_by_head()):
            queries_of_head = queries[:, head * group : (head + 1) * group]
            parts.append(attend_and_score(queries_of_head, keys[:, :, slots], values[:, :, slots], mask="causal", **options))
        output = mx.concatenate([part.output for part in parts], axis=1)
        key_mass = entropy = None
        if parts[0].key_mass is not None:
            key_mass = mx.zeros((1, 1, keys.shape[2]), mx.float32)
            key_mass[..., mx.concatenate(self.slots_by_head())] = mx.concatenate([p.key_mass for p in parts], axis=-1)
        if parts[0].entropy is not None:
            entropy = sum((part.entropy for part in parts[1:]), parts[0].entropy)
        return AttentionResult(output, key_mass, entropy, sum(part.entropy_rows for part in parts))

    def slots_by_head(self) -> list:
        """Each KV head's held slots, in slot order (``[H]`` index arrays)."""
        key = (self._heads_changed, self.stored)
        if self._by_head_cache is not None and self._by_head_cache[0] == key:
            return self._by_head_cache[1]
        heads = self.held_heads()
        order = mx.argsort(heads * self.stored + mx.arange(self.stored, dtype=mx.int32))
        bounds = [0]
        for count in self.head_counts():
            bounds.append(bounds[-1] + count)
        found = [order[start:stop] for start, stop in zip(bounds, bounds[1:])]
        self._by_head_cache = (key, found)
        return found

    # ----- changes -----------------------------------------------------------------------

    def spare_for(self, n_new: int, *, budget: int, in_steps: bool) -> int:
        return super().spare_for(n_new * self.n_heads, budget=budget * self.n_heads, in_steps=in_steps)

    def append(self, keys: mx.array, values: mx.array, first_position: int, spare: int) -> None:
        """Write each head's new tokens ``[1, H, n, D]`` after the held slots, head by head."""
        _, n_heads, n_new, dim = keys.shape
        positions = mx.arange(first_position, first_position + n_new, dtype=mx.int32)
        new_heads = mx.repeat(mx.arange(n_heads, dtype=mx.int32), n_new)
        start = self.stored
        self._write(
            keys.reshape(1, 1, n_heads * n_new, dim),
            values.reshape(1, 1, n_heads * n_new, values.shape[-1]),
            mx.tile(positions, n_heads).reshape(1, 1, n_heads * n_new),
            spare,
        )
        if self.heads.shape[0] >= self.stored:
            self.heads[start : self.stored] = new_heads
        else:
            self.heads = mx.concatenate([self.heads[:start], new_heads, mx.zeros((spare,), mx.int32)])
        self._heads_changed += 1

    def set_heads(self, heads: mx.array) -> None:
        """Each slot's KV head is now ``heads`` ``[capacity]`` (a batch wrote the buffers back; masks are rebuilt)."""
        self.heads = heads
        self._heads_changed += 1

    def keep(self, indices: mx.array) -> None:
        super().keep(indices)
        self.heads = self.heads[indices[0, 0]]
        self._heads_changed += 1

    def replace(self, slot: mx.array, keys: mx.array, values: mx.array, position: int) -> None:
        super().replace(slot, keys, values, position)
        if self.heads.shape[0] != self.stored:  # the buffers were trimmed to the held slots
            self.heads = self.held_heads()
            self._heads_changed += 1

    def truncate(self, stored: int, capacity: int) -> None:
        super().truncate(stored, capacity)
        self.heads = self.heads[:capacity]
        if capacity > stored:
            self.heads[stored:] = 0
        self._heads_changed += 1

    # ----- eviction ----------------------------------------------------------------------

    def evict_to(self, budget: int) -> Optional[mx.array]:
        """Keep ``heads x budget`` tokens: every head its floor, the rest by rank over the layer.

        Returns the kept slot indices ``[1, 1, heads x budget]`` (None when nothing was evicted).
        """
        if self.stored <= budget * self.n_heads:
            return None
        floor = int(self.floor * budget)
        keep = adaptive_keep(self.protected_ranking(budget)[0, 0], self.held_heads(), self.n_heads, budget, floor)
        keep = keep[None, None]
        self.keep(keep)
        return keep

    def replace_lowest(self, keys: mx.array, values: mx.array, budget: int) -> None:
        """Write one decode token ``[1, H, 1, D]`` into each head's own lowest-ranked slot.

        A head whose every slot is protected (its share at most ``n_sink +
        recent``) gives up its oldest non-sink token, as its recent window
        slides; a head holding only sinks, its newest sink. Never another head's slot.
        """
        members = self.membership(self.stored)  # [H, T]
        keys, values = keys.reshape(1, 1, self.n_heads, -1), values.reshape(1, 1, self.n_heads, -1)
        protectable = self.n_sink + int(recent_limit(self.recent, budget, self.n_sink))
        if min(self.head_counts()) > protectable:  # no head can have every slot protected (distinct positions)
            ranking = mx.where(members, self.protected_ranking(budget), mx.inf)  # [1, H, T]
            self.replace(mx.argmin(ranking, axis=-1, keepdims=True).swapaxes(1, 2), keys, values, self.offset)
            return
        ranking = mx.where(members, self.protected_ranking(budget)[0, 0][None, :], mx.inf)
        positions = self.held_positions()[0, 0].astype(mx.float32)[None, :]
        sink = positions < self.n_sink
        oldest = mx.where(members, mx.where(sink, -positions + 2.0 * (self.offset + 1), positions), mx.inf)
        unprotected = mx.min(ranking, axis=-1) < mx.inf  # [H]
        victims = mx.where(unprotected, mx.argmin(ranking, axis=-1), mx.argmin(oldest, axis=-1))[None, None]  # [1, 1, H]
        self.replace(victims, keys, values, self.offset)

    def compact(self, shift) -> None:
        """Re-rotate each head's keys to contiguous positions ending at ``offset - 1``; ``offset`` becomes the largest count.

        Heads that hold fewer tokens start later, so that every head's latest
        kept token sits right before the next one.
        """
        heads = self.held_heads()
        counts = mx.array(self.head_counts(), mx.int32)
        longest = counts.max().item()
        starts = mx.cumsum(counts) - counts  # where each head's slots begin in head order
        by_head = heads * (self.offset + 1) + self.held_positions()[0, 0]
        rank = mx.argsort(mx.argsort(by_head)).astype(mx.int32)  # [T]: order by (head, position)
        new_positions = rank - starts[heads] + (longest - counts[heads])
        self.rerotate(shift, new_positions[None, None])
        self.offset = longest
