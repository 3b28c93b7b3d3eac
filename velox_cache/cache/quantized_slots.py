"""``QuantizedTokenSlots``: an evicting layer's held tokens at ``kv_bits`` once decoding starts.

Until ``quantize`` (called when prefill ends, after the prompt's eviction)
this is ``TokenSlots`` exactly: prefill, selection, probes and a shared
reading's cut see float keys, so a cut stack equals its own prefill's and is
quantized the same way afterwards. ``quantize`` turns the held tokens, in slot
order, into whole key groups of ``group`` tokens (keys per channel, values per
token: ``velox_cache.kernels.kv_codes``); the rest (fewer than a group) stays
in float, in the window.

Slots are then the quantized region ``[0, quantized)`` followed by the window
``[quantized, quantized + tail)``; ``scores``, ``positions`` and ``live``
cover both in that order. A decode token joins the window. At budget it
evicts the lowest-ranked held token exactly as ``TokenSlots`` ranks them
(the window's tokens included), which leaves a *hole*: its codes (or float
row) stay, ``live`` marks it dead, attention masks it and the ranking never
picks it again. When a call finds a whole group in the window (before it
appends: the tokens a call appends are attended in float), that group is
quantized and written into the quantized region's holes, each head its own
(every head evicts one token per step, so a head's holes are as many as its
window's tokens quantized so far, wherever they sit), the region growing
where a head has fewer holes than a group (the other heads' extra slots
dead). Kept tokens are never re-quantized: eviction moves nothing, a group's
scales stay while any of its tokens is held (then they go). A multi-token
call while decoding (teacher forcing) widens the window for its tokens and
is attended whole; the lowest-ranked tokens then become holes.

Uniform heads only; decodes alone or in a batch of its kind (``velox_cache.generation.quantized_slots_batch``).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ..kernels import kv_codes
from ..kernels.attend import AttentionResult, attend_quantized
from ..kernels.kv_codes import QuantizedKV
from .quantized_holes import SLOT_PARTS, forget_dead_groups, quantized_group, write_into_holes
from .quantized_tokens import GROUP_STEP, grown, padded, slot_bytes, written
from .slots import TokenSlots, protect, recent_limit


class QuantizedTokenSlots(TokenSlots):
    """``TokenSlots`` that hold their tokens at ``bits`` once ``quantize`` is called (see the module doc)."""

    def __init__(self, signal, n_sink: int, recent: int, bits: int, group: int):
        super().__init__(signal, n_sink, recent)
        kv_codes.levels(bits)
        self.bits, self.group = bits, group
        self.quantized_count: Optional[int] = None  # None: not quantized yet (float TokenSlots)
        self.key_codes = self.key_groups = self.key_scales = self.key_zeros = None
        self.value_codes = self.value_scales = self.value_zeros = None
        self.live: Optional[mx.array] = None  # [B, H, quantized + window slots] bool: False for a hole
        self.groups = 0
        self.tail = 0  # window slots used (live or evicted)
        self.kept = 0  # tokens each head holds once quantized (every head evicts one per step at budget)
        self.value_group = 0

    @property
    def quantized(self) -> bool:
        """True once the held tokens are quantized (decoding has started)."""
        return self.quantized_count is not None

    # ----- the switch ----------------------------------------------------------------------

    def quantize(self, budget: int) -> None:
        """Quantize the held tokens' whole groups (slot order); the rest becomes the float window.

        The group is ``group`` tokens, at most a quarter of ``budget`` (at least 2),
        so that a window never holds much of a small layer's budget.
        """
        if self.quantized or self.empty:
            return
        dim = self.values.shape[-1]
        self.value_group = min(self.group, dim) if dim % min(self.group, dim) == 0 else dim
        self.group = max(2, min(self.group, budget // 4))
        keys, values = self.held()
        n = self.stored // self.group * self.group
        batch, heads = keys.shape[:2]
        self.key_codes, self.key_scales, self.key_zeros = kv_codes.quantize_keys(keys[:, :, :n], self.group, self.bits)
        self.value_codes, self.value_scales, self.value_zeros = kv_codes.quantize_values(
            values[:, :, :n], self.value_group, self.bits
        )
        self.groups = n // self.group
        numbers = mx.repeat(mx.arange(self.groups, dtype=mx.int32), self.group)
        self.key_groups = mx.array(mx.broadcast_to(numbers[None, None], (batch, heads, n)))
        self.tail = self.stored - n
        self.live = mx.concatenate(
            [mx.ones((batch, heads, self.stored), mx.bool_), mx.zeros((batch, heads, self.group - self.tail), mx.bool_)],
            axis=2,
        )
        self.keys = grown(keys[:, :, n:], None, self.group - self.tail)  # the window: a group's slots
        self.values = grown(values[:, :, n:], None, self.group - self.tail)
        scores, positions = self.held_scores(), self.held_positions()
        self.scores = mx.concatenate([scores, mx.zeros((batch, heads, self.group - self.tail))], axis=2)
        self.positions = mx.concatenate(
            [positions, mx.zeros((batch, heads, self.group - self.tail), mx.int32)], axis=2
        )
        self.quantized_count = n
        self.kept = self.stored

    # ----- layout hooks --------------------------------------------------------------------

    @property
    def kept_per_head(self) -> int:
        return self.kept if self.quantized else self.stored

    def at_budget(self, budget: int) -> bool:
        return self.kept_per_head == budget

    @property
    def capacity(self) -> int:
        if not self.quantized:
            return super().capacity
        return self.quantized_count + self.keys.shape[2]

    def held(self):
        if not self.quantized:
            return super().held()
        groups = self.groups
        live = self.live[:, :, : self.stored] if self.kept < self.stored else None
        view = QuantizedKV(
            self.key_codes, self.key_scales[:, :, :groups], self.key_zeros[:, :, :groups], self.key_groups,
            self.value_codes, self.value_scales, self.value_zeros, self.keys[:, :, : self.tail],
            self.values[:, :, : self.tail], self.bits, self.value_group, live,
        )
        return view, view

    def attend(self, queries: mx.array, keys, values, **options) -> AttentionResult:
        if not isinstance(keys, QuantizedKV):
            return super().attend(queries, keys, values, **options)
        return attend_quantized(queries, keys, **options)  # its ``live`` masks the holes

    @property
    def arrays(self) -> list:
        if not self.quantized:
            return super().arrays
        names = ("key_codes", "key_groups", "key_scales", "key_zeros", "value_codes", "value_scales",
                 "value_zeros", "live", "keys", "values", "scores", "positions")
        return [getattr(self, name) for name in names]

    @property
    def kept_bytes(self) -> int:
        """Bytes held for the tokens: every quantized slot's codes, group number and value scales (holes
        included: they stay until a group fills them), the groups' key scales, the window's used slots."""
        if not self.quantized:
            per_slot = (self.keys.nbytes + self.values.nbytes) // max(1, self.keys.shape[2])
            return per_slot * self.stored
        per_token = sum(slot_bytes(a) for a in (self.key_codes, self.key_groups, self.value_codes,
                                               self.value_scales, self.value_zeros))
        per_group = slot_bytes(self.key_scales) + slot_bytes(self.key_zeros)
        per_float = slot_bytes(self.keys) + slot_bytes(self.values)
        return per_token * self.quantized_count + per_group * self.groups + per_float * self.tail

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer held for keys and values (codes, scales, holes, the window's spare slots)."""
        if not self.quantized:
            return self.keys.nbytes + self.values.nbytes
        return sum(a.nbytes for a in self.arrays[:-2])

    def batch_parts(self, budget: int) -> list[tuple[int, int]]:
        """``[(slots, bytes of one slot across heads)]`` a decoding batch holds for this layer: its quantized region
        (the group scales shared out per slot), at most ``budget`` live tokens plus two groups of holes (a bound: a
        flush fills holes before it grows the region), then its float window."""
        meta = sum(slot_bytes(a) for a in (self.scores, self.positions, self.live))
        per_code = sum(slot_bytes(getattr(self, name)) for name in SLOT_PARTS)
        per_code += -(-(slot_bytes(self.key_scales) + slot_bytes(self.key_zeros)) // self.group) + meta
        per_float = slot_bytes(self.keys) + slot_bytes(self.values) + meta
        return [(max(self.quantized_count, budget + 2 * self.group), per_code), (self.keys.shape[2], per_float)]

    # ----- eviction and decode tokens ----------------------------------------------------------

    def protected_ranking(self, budget: int) -> mx.array:
        if not self.quantized:
            return super().protected_ranking(budget)
        recent = int(recent_limit(self.recent, budget, self.n_sink))
        ranking = protect(self.signal.ranking(self), self.held_positions(), n_sink=self.n_sink, recent=recent,
                          offset=self.offset)
        return mx.where(self.live[:, :, : self.stored], ranking, mx.inf)

    def evict_to(self, budget: int) -> Optional[mx.array]:
        if not self.quantized:
            return super().evict_to(budget)
        excess = self.kept - budget
        if excess > 0:  # after a multi-token call (teacher forcing): the lowest-ranked become holes
            ranking = self.protected_ranking(budget)
            victims = mx.argpartition(ranking, kth=excess - 1, axis=-1)[..., :excess]
            self.live = mx.put_along_axis(self.live, victims, mx.array(False), axis=-1)
            self.kept = budget
        return None

    def replace_lowest(self, keys: mx.array, values: mx.array, budget: int) -> None:
        if not self.quantized:
            return super().replace_lowest(keys, values, budget)
        victim = mx.argmin(self.protected_ranking(budget), axis=-1, keepdims=True)  # [B, H, 1]
        self.live = mx.put_along_axis(self.live, victim, mx.array(False), axis=-1)
        self.kept -= 1
        self.append(keys, values, self.offset, 0)

    def append(self, keys: mx.array, values: mx.array, first_position: int, spare: int) -> None:
        """New tokens join the float window; whole groups already in it are quantized first (so the tokens
        a call appends are attended in float, as the window's are)."""
        if not self.quantized:
            return super().append(keys, values, first_position, spare)
        while self.tail >= self.group:
            self._flush()
        n = keys.shape[2]
        start, stop = self.tail, self.tail + n
        if stop > self.keys.shape[2]:  # a multi-token call: the window grows by whole groups
            extra = -(-(stop - self.keys.shape[2]) // self.group) * self.group
            self.keys, self.values = grown(self.keys, None, extra), grown(self.values, None, extra)
            self.scores, self.positions = grown(self.scores, None, extra), grown(self.positions, None, extra)
            self.live = grown(self.live, None, extra)
        q = self.quantized_count
        self.keys[:, :, start:stop] = keys
        self.values[:, :, start:stop] = values
        self.scores[:, :, q + start : q + stop] = 0
        self.positions[:, :, q + start : q + stop] = mx.arange(first_position, first_position + n, dtype=mx.int32)
        self.live[:, :, q + start : q + stop] = True
        self.tail, self.stored, self.kept = stop, self.stored + n, self.kept + n

    def _flush(self) -> None:
        """The window's first group quantized and written into each head's first holes, then after the region."""
        q, g = self.quantized_count, self.group
        one = np.ones(1, bool)
        quantized = quantized_group(self.keys[:, :, :g], self.values[:, :, :g], mx.array([self.groups]), self.bits,
                                    self.value_group)
        self.key_scales = written(self.key_scales, quantized.key_scales, self.groups, GROUP_STEP)
        self.key_zeros = written(self.key_zeros, quantized.key_zeros, self.groups, GROUP_STEP)
        self.groups += 1
        region = {name: padded(getattr(self, name), q + g) for name in SLOT_PARTS}  # room to grow by a group
        new = dict(quantized.slots)
        for name in ("scores", "positions", "live"):
            region[name], new[name] = padded(getattr(self, name)[:, :, :q], q + g), getattr(self, name)[:, :, q : q + g]
        rest = {name: getattr(self, name)[:, :, q + g :] for name in ("scores", "positions", "live")}
        region, counts = write_into_holes(region, mx.array([q]), new, one)
        self.quantized_count = counts.item()
        region = {name: array[:, :, : self.quantized_count] for name, array in region.items()}
        for name in SLOT_PARTS:
            setattr(self, name, region[name])
        kept = forget_dead_groups(self.key_groups, region["live"], counts, mx.array([self.groups]), self.key_scales,
                                  self.key_zeros, one)
        if kept.dropped.item():
            self.groups = kept.groups.item()
            self.key_groups = kept.key_groups
            self.key_scales, self.key_zeros = kept.key_scales[:, :, : self.groups], kept.key_zeros[:, :, : self.groups]
        self.tail -= g
        self.stored = self.quantized_count + self.tail
        self.keys, self.values = grown(self.keys[:, :, g:], None, g), grown(self.values[:, :, g:], None, g)
        for name in ("scores", "positions", "live"):  # the window keeps its size
            setattr(self, name, grown(mx.concatenate([region[name], rest[name]], axis=2), None, g))

    # ----- what a quantized layer cannot do (it only decodes) -------------------------------------

    def _refuse(self, what: str):
        raise RuntimeError(f"{what}: a quantized layer only decodes (its tokens were quantized when prefill ended)")

    def keep(self, indices):
        if self.quantized:
            self._refuse("keep")
        super().keep(indices)

    def replace(self, slot, keys, values, position):
        if self.quantized:
            self._refuse("replace")
        super().replace(slot, keys, values, position)

    def truncate(self, stored, capacity):
        if self.quantized:
            self._refuse("a probe")
        super().truncate(stored, capacity)

    def rerotate(self, shift, new_positions):
        if self.quantized:
            self._refuse("compact_positions")
        super().rerotate(shift, new_positions)

    def adopt(self, other):
        if self.quantized or getattr(other, "quantized", False):
            self._refuse("adopt")
        super().adopt(other)
