"""``QuantizedTokens``: one layer's tokens at ``kv_bits``: codes of whole key groups, then the newest in float.

New tokens join a full-precision window (the ``tail``). ``settle`` quantizes
the window's oldest tokens a whole key group (``group`` tokens) at a time,
keeping at least the ``window`` newest in float: keys per channel over the
group, values per token (``velox_cache.kernels.kv_codes``). Groups are counted
from the sequence's first token, so what is held depends only on how many
tokens were seen when ``settle`` ran: a stack read in float and settled later
holds exactly what one settled at the same count holds.

Buffers grow in place as mlx-lm's ``KVCache`` does (``STEP`` slots at a time,
spare slots zero); ``mark``/``restore`` drop the tokens appended since a mark
(a probe's, a look-ahead's), which must all still be in the float window;
the buffers are then array for array what the mark found.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ..kernels import kv_codes
from ..kernels.kv_codes import QuantizedKV

STEP = 256  # buffer growth, in tokens (as mlx-lm's KVCache)
GROUP_STEP = 16  # key-scale buffer growth, in groups


@dataclass(frozen=True)
class TokensMark:
    """Where the tokens stood (``QuantizedTokens.mark``): what ``restore`` goes back to."""

    quantized: int
    tail: int
    capacity: int  # of the float window's buffer


class QuantizedTokens:
    """Keys and values of one layer at ``bits`` (8 or 4): quantized groups of ``group`` tokens, then a float window.

    ``group`` is also the number of features per value scale (the head dim where it is wider or does not divide it).
    """

    def __init__(self, bits: int, group: int, window: int):
        kv_codes.levels(bits)  # refuses other widths
        self.bits, self.group, self.window = bits, group, window
        self.value_group = 0  # known at the first append: min(group, head dim)
        self.key_codes: Optional[mx.array] = None  # [B, H, capacity, D * bits / 8]
        self.key_groups: Optional[mx.array] = None  # [B, H, capacity] int32
        self.key_scales: Optional[mx.array] = None  # [B, H, group capacity, D]
        self.key_zeros: Optional[mx.array] = None
        self.value_codes: Optional[mx.array] = None
        self.value_scales: Optional[mx.array] = None  # [B, H, capacity, D / value_group]
        self.value_zeros: Optional[mx.array] = None
        self.tail_keys: Optional[mx.array] = None  # [B, H, tail capacity, D], the float window
        self.tail_values: Optional[mx.array] = None
        self.quantized = 0  # tokens held as codes
        self.groups = 0  # key groups held
        self.tail = 0  # tokens held in float

    @property
    def empty(self) -> bool:
        return self.tail_keys is None

    @property
    def count(self) -> int:
        """Tokens held (quantized and float)."""
        return self.quantized + self.tail

    @property
    def kv_heads(self) -> int:
        return 0 if self.empty else self.tail_keys.shape[1]

    # ----- changes ---------------------------------------------------------------------------

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Add ``keys``/``values`` ``[B, H, n, D]`` after the held tokens, in the float window."""
        if self.empty:
            self._start(keys, values)
        n = keys.shape[2]
        end = self.tail + n
        if end > self.tail_keys.shape[2]:
            spare = -end % STEP
            self.tail_keys = grown(self.tail_keys[:, :, : self.tail], keys, spare)
            self.tail_values = grown(self.tail_values[:, :, : self.tail], values, spare)
        else:
            self.tail_keys[:, :, self.tail : end] = keys
            self.tail_values[:, :, self.tail : end] = values
        self.tail = end

    def settle(self) -> None:
        """Quantize the float window's oldest whole groups, keeping at least ``window`` tokens in float."""
        groups = (self.tail - self.window) // self.group
        if groups <= 0:
            return
        n = groups * self.group
        keys, values = self.tail_keys[:, :, :n], self.tail_values[:, :, :n]
        key_codes, key_scales, key_zeros = kv_codes.quantize_keys(keys, self.group, self.bits)
        value_codes, value_scales, value_zeros = kv_codes.quantize_values(values, self.value_group, self.bits)
        batch, heads = keys.shape[:2]
        numbers = mx.arange(self.groups, self.groups + groups, dtype=mx.int32)
        key_groups = mx.broadcast_to(mx.repeat(numbers, self.group)[None, None], (batch, heads, n))
        start, stop = self.quantized, self.quantized + n
        self.key_codes = written(self.key_codes, key_codes, start, STEP)
        self.key_groups = written(self.key_groups, key_groups, start, STEP)
        self.value_codes = written(self.value_codes, value_codes, start, STEP)
        self.value_scales = written(self.value_scales, value_scales, start, STEP)
        self.value_zeros = written(self.value_zeros, value_zeros, start, STEP)
        self.key_scales = written(self.key_scales, key_scales, self.groups, GROUP_STEP)
        self.key_zeros = written(self.key_zeros, key_zeros, self.groups, GROUP_STEP)
        self.quantized, self.groups = stop, self.groups + groups
        rest = self.tail - n
        room = max(rest, self.window + self.group)  # the window then fills to its next group without growing
        self.tail_keys = grown(self.tail_keys[:, :, n : self.tail], None, room - rest)
        self.tail_values = grown(self.tail_values[:, :, n : self.tail], None, room - rest)
        self.tail = rest

    def mark(self) -> TokensMark:
        return TokensMark(self.quantized, self.tail, 0 if self.empty else self.tail_keys.shape[2])

    def restore(self, mark: TokensMark) -> None:
        """Drop every token appended since ``mark`` (they must all still be in the float window)."""
        if self.quantized != mark.quantized:
            raise RuntimeError("restore: tokens appended since the mark were quantized; they cannot be dropped")
        if self.empty:
            return
        self.tail_keys = self.tail_keys[:, :, : mark.capacity]
        self.tail_values = self.tail_values[:, :, : mark.capacity]
        if mark.capacity > mark.tail:  # spare slots are zeros, as the mark found them
            self.tail_keys[:, :, mark.tail :] = 0
            self.tail_values[:, :, mark.tail :] = 0
        self.tail = mark.tail

    def adopt_float(self, keys: mx.array, values: mx.array) -> None:
        """Hold ``keys``/``values`` ``[B, H, n, D]`` (a float cache's tokens) in the float window, sharing no array."""
        self.__init__(self.bits, self.group, self.window)
        self.append(mx.array(keys), mx.array(values))

    # ----- reading -----------------------------------------------------------------------------

    def held(self) -> QuantizedKV:
        """The held tokens as attention reads them (views of the buffers' valid parts)."""
        q, groups = self.quantized, self.groups
        keys, values = self.tail_keys[:, :, : self.tail], self.tail_values[:, :, : self.tail]
        if q == 0:
            batch, heads, _, dim = keys.shape
            codes = mx.zeros((batch, heads, 0, dim * self.bits // 8), mx.uint8)
            return QuantizedKV(
                codes, mx.zeros((batch, heads, 0, dim)), mx.zeros((batch, heads, 0, dim)),
                mx.zeros((batch, heads, 0), mx.int32), codes, mx.zeros((batch, heads, 0, dim // self.value_group)),
                mx.zeros((batch, heads, 0, dim // self.value_group)), keys, values, self.bits, self.value_group,
            )
        return QuantizedKV(
            self.key_codes[:, :, :q], self.key_scales[:, :, :groups], self.key_zeros[:, :, :groups],
            self.key_groups[:, :, :q], self.value_codes[:, :, :q], self.value_scales[:, :, :q],
            self.value_zeros[:, :, :q], keys, values, self.bits, self.value_group,
        )

    @property
    def arrays(self) -> list:
        """Every buffer held (for ``state``)."""
        names = ("key_codes", "key_groups", "key_scales", "key_zeros", "value_codes", "value_scales", "value_zeros",
                 "tail_keys", "tail_values")
        return [getattr(self, name) for name in names if getattr(self, name) is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer, spare room included."""
        return sum(a.nbytes for a in self.arrays)

    @property
    def kept_bytes(self) -> int:
        """Bytes of what the held tokens need: their codes, group numbers and value scales, the scales of
        their key groups, and the float window's keys and values."""
        if self.empty:
            return 0
        return self.code_bytes_per_token() * self.quantized + self._group_and_float_bytes()

    def code_bytes_per_token(self) -> int:
        """Bytes one quantized token holds (codes, group number, value scales), all heads and rows."""
        return sum(slot_bytes(a) for a in (self.key_codes, self.key_groups, self.value_codes,
                                           self.value_scales, self.value_zeros) if a is not None)

    def _group_and_float_bytes(self) -> int:
        per_group = sum(slot_bytes(a) for a in (self.key_scales, self.key_zeros) if a is not None)
        return per_group * self.groups + self.float_bytes_per_token() * self.tail

    def float_bytes_per_token(self) -> int:
        """Bytes one token's keys and values take in float (all heads and rows), at the window's dtype."""
        return 0 if self.empty else slot_bytes(self.tail_keys) + slot_bytes(self.tail_values)

    def _start(self, keys: mx.array, values: mx.array) -> None:
        dim = keys.shape[-1]
        self.value_group = min(self.group, values.shape[-1])
        if values.shape[-1] % self.value_group:
            self.value_group = values.shape[-1]  # one scale per token
        if self.bits == 4 and dim % 2:
            raise ValueError(f"kv_bits: 4 bits pack two features a byte; the head dim {dim} is odd")
        batch, heads = keys.shape[:2]
        self.tail_keys = mx.zeros((batch, heads, 0, dim), keys.dtype)
        self.tail_values = mx.zeros((batch, heads, 0, values.shape[-1]), values.dtype)


# Buffer helpers shared with ``velox_cache.cache.quantized_slots``, ``quantized_holes`` and the quantized batches
# (``velox_cache.generation.quantized_batching``, ``quantized_slots_batch``).


def slot_bytes(array: mx.array) -> int:
    """Bytes of one slot of ``array``'s axis 2 (its token or group axis)."""
    return array.itemsize * math.prod(size for axis, size in enumerate(array.shape) if axis != 2)


def grown(kept: mx.array, new: Optional[mx.array], spare: int) -> mx.array:
    """``kept``, then ``new`` (if any), then ``spare`` zero slots, along axis 2 (a fresh array)."""
    parts = [kept] + ([new] if new is not None else [])
    if spare:
        parts.append(mx.zeros((*kept.shape[:2], spare, *kept.shape[3:]), kept.dtype))
    return mx.concatenate(parts, axis=2) if len(parts) > 1 else mx.array(parts[0])


def padded(array: mx.array, width: int) -> mx.array:
    """``array`` right-padded with zero (False) slots to ``width`` along axis 2 (as it is when already that wide)."""
    missing = width - array.shape[2]
    return array if missing <= 0 else grown(array, None, missing)


def written(buffer: Optional[mx.array], new: mx.array, start: int, step: int) -> mx.array:
    """``buffer`` with ``new`` written at ``start`` along axis 2: in place when it has room, else grown by ``step``s."""
    stop = start + new.shape[2]
    if buffer is not None and stop <= buffer.shape[2]:
        buffer[:, :, start:stop] = new
        return buffer
    kept = buffer[:, :, :start] if buffer is not None else new[:, :, :0]
    return grown(kept, new.astype(new.dtype), -stop % step)
