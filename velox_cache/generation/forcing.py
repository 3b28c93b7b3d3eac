"""``feed_together``: prefilled stacks each fed their own tokens, in one batched model call.

Teacher forcing feeds a compressed cache the full cache's output and reads the
model's prediction at every position (``pipeline.generation.teacher_force``).
One stack at a time that is one model call per stack; here B stacks (any mix
of policies, budgets and prompt lengths, as in ``velox_cache.generation.batching``) take
one call together. Per layer, each row's held keys sit right-padded to the
longest count ``W``, its new tokens after them at ``W .. W + n``, and the
layer's own mask lets query ``i`` of row ``r`` see the ``stored[r]`` held
tokens and new tokens ``0 .. i``: what the row's own cache would show it. A
row with per-head budgets (``HeadPooledSlots``) holds each head's tokens on
the head axis (as ``BatchedLayer`` does), each query head seeing its KV head's. No
token is evicted during the call (as when one stack is fed alone: a
multi-token call is attended whole before any eviction). Rows alike (stacks
holding the same keys and values at the same offsets, fed the same tokens, as
a frontier's points whose budgets keep the whole prompt) are computed once.

The stacks are used up (feed snapshots): what they hold afterwards is not
defined. The model's attention must be routed (``velox_cache.observe`` or
``velox_cache.fast_attention``): the mask differs per layer.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from ..kernels.attend import attend_and_score
from ..kernels.observe import is_routed
from .batching import BatchUnsupported, HeldRows, held_counts

PAD_TOKEN = 0  # fed after a shorter row's tokens; its outputs are never read


class ForcedLayer(_BaseCache):
    """One layer of B stacks taking one multi-token call together (see the module doc)."""

    def __init__(self, caches: list, layer: int = 0):
        self.layer = layer
        held = HeldRows.of(caches, layer)
        rows, self.width, self.keys, self.values = held.rows, held.width, held.keys, held.values
        per_head = held.head_stored if (held.head_stored != held.head_stored[:, :1]).any() else held.head_stored[:, :1]
        self._stored = mx.array(per_head, mx.int32)  # [B, H] each (row, head)'s held tokens, or [B, 1] when heads agree
        self._offset = mx.array([row.offset for row in rows], mx.int32)
        self.attended = False

    @property
    def offset(self) -> mx.array:
        """Each row's position for its first new token, ``int32 [B]``."""
        return self._offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """The held keys and values, then this call's (``[B, H, W + n, D]``)."""
        if keys.shape[0] != self.keys.shape[0]:
            raise BatchUnsupported(f"layer {self.layer}: {keys.shape[0]} rows for a batch of {self.keys.shape[0]}")
        if not is_routed():
            raise BatchUnsupported(
                "feeding stacks together needs the model's attention routed through Velox: run it inside "
                "`velox_cache.observe(model)` or `velox_cache.fast_attention(model)`"
            )
        keys = mx.concatenate([self.keys, keys.astype(self.keys.dtype)], axis=2)
        values = mx.concatenate([self.values, values.astype(self.values.dtype)], axis=2)
        return keys, values

    def observe_attention(self, queries, keys, values, scale, mask, sinks=None) -> mx.array:
        """Each row's queries over its own held tokens and the new tokens up to their own (padding masked)."""
        self.attended = True
        n_new = queries.shape[2]
        slot = mx.arange(self.width + n_new, dtype=mx.int32)[None, None, None]  # [1, 1, 1, T]
        query = mx.arange(n_new, dtype=mx.int32)[None, None, :, None]  # [1, 1, n, 1]
        stored = self._stored
        if stored.shape[1] not in (1, queries.shape[1]):  # each query head sees its KV head's held tokens
            stored = mx.repeat(stored, queries.shape[1] // stored.shape[1], axis=1)
        held = slot < stored[:, :, None, None]  # [B, H*R or 1, 1, T]
        new = (slot >= self.width) & (slot - self.width <= query)  # [1, 1, n, T]
        return attend_and_score(queries, keys, values, scale=scale, mask=held | new, sinks=sinks).output

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """None: each layer masks its own rows when attention reaches it."""
        return None

    @property
    def state(self):
        return [self.keys, self.values]

    @state.setter
    def state(self, value):
        raise NotImplementedError("a ForcedLayer cannot be restored from a saved state")

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False


def feed_together(model, stacks: list[list], sequences: Sequence[Sequence[int]]) -> list[mx.array]:
    """Feed ``sequences[r]`` to ``stacks[r]``, all rows in one model call; returns each row's logits ``[n_r, V]``.

    Row ``r``'s logits are what ``model(mx.array([sequences[r]]), cache=stacks[r])[0]``
    gives (up to float rounding). Every sequence must hold at least one token.
    Raises ``BatchUnsupported`` (before any model call where it can tell) when
    the stacks cannot be fed together; feed them one at a time then.
    """
    if not stacks or len(stacks) != len(sequences):
        raise ValueError(f"sequences: {len(sequences)} sequences for {len(stacks)} stacks")
    if any(len(tokens) == 0 for tokens in sequences):
        raise ValueError("sequences: every sequence needs at least one token")
    depth = {len(stack) for stack in stacks}
    if len(depth) > 1:
        raise BatchUnsupported(f"rows have stacks of different depths {sorted(depth)}: not the same model")
    first = first_alike(stacks, sequences)
    distinct = sorted(set(first))
    layers = [ForcedLayer([stacks[row][layer] for row in distinct], layer) for layer in range(len(stacks[0]))]
    longest = max(len(sequences[row]) for row in distinct)
    tokens = mx.array([list(sequences[row]) + [PAD_TOKEN] * (longest - len(sequences[row])) for row in distinct])
    logits = model(tokens, cache=layers)
    if not all(layer.attended for layer in layers):
        raise BatchUnsupported("the model's attention did not reach the batched caches (not routable)")
    place = {row: i for i, row in enumerate(distinct)}
    return [logits[place[first[row]], : len(t)] for row, t in enumerate(sequences)]


def first_alike(stacks: list[list], sequences: Sequence[Sequence[int]]) -> list[int]:
    """For each row, the first row alike (itself where none is): the same tokens fed to a stack holding the same.

    Alike: at every layer the same offset and, head by head, the same held keys and
    values in the same order. Such rows' logits are the same numbers, so one of
    them is fed. Compared where the fed tokens and every layer's counts agree (a
    stack that cannot be batched raises ``BatchUnsupported``, as feeding it would).
    """
    counts = [(tuple(sequence), tuple(held_counts(cache, layer) for layer, cache in enumerate(stack)))
              for stack, sequence in zip(stacks, sequences)]
    first, distinct = [], []
    for row, signature in enumerate(counts):
        alike = next((d for d in distinct if counts[d] == signature and _same_held(stacks[d], stacks[row])), None)
        if alike is None:
            distinct.append(row)
        first.append(row if alike is None else alike)
    return first


def _same_held(one: list, other: list) -> bool:
    """Whether two stacks hold, layer by layer and head by head, the same keys and values in the same order."""
    checks = []
    for layer, (a, b) in enumerate(zip(one, other)):
        held_a, held_b = HeldRows.of([a], layer), HeldRows.of([b], layer)
        if held_a.keys.shape != held_b.keys.shape or held_a.values.shape != held_b.values.shape \
                or (held_a.head_stored != held_b.head_stored).any():
            return False
        checks += [mx.array_equal(held_a.keys, held_b.keys), mx.array_equal(held_a.values, held_b.values)]
    return bool(mx.all(mx.stack(checks)).item()) if checks else True
