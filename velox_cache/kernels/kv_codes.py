"""Quantized keys and values: the codes a cache holds at ``kv_bits`` and how attention reads them.

The layout is KIVI's. Keys have a few channels far larger than the rest, so
they are quantized **per channel** over a group of ``group`` consecutive
tokens (one scale and one zero per token group and feature); values are
quantized **per token** over groups of ``group`` features. Both are affine,
``x ~ code * scale + zero`` with ``code`` in ``0 .. 2**bits - 1``,
``zero`` the group's minimum and ``scale = (max - min) / (2**bits - 1)``:
every value is within ``scale / 2`` of its own. Codes are ``uint8``; at 4 bits
two share a byte, the even feature in the low nibble.

Each quantized key names its group (``key_groups``, one ``int32`` per token), so
a cache can gather, drop or reorder held tokens (eviction) by moving codes and
group numbers, never re-quantizing a kept token: a group's scales stay where
they are while any of its tokens is held.

``QuantizedKV`` is what a quantized cache hands its attention: the quantized
tokens first, then the newest tokens in full precision (the window a group
fills before it is quantized). ``velox_cache.kernels.attend.attend_quantized``
computes attention over it; the fused native primitive dequantizes one key
block at a time inside its tiles, so no full-precision copy of the cache is
ever made there (``dequantized`` makes one: the reference, and the path
where the native ops are not built).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

BITS = (8, 4)


def levels(bits: int) -> int:
    """The largest code at ``bits`` (255, 15)."""
    if bits not in BITS:
        raise ValueError(f"bits: {bits!r} is not one of {', '.join(map(str, BITS))}")
    return (1 << bits) - 1


def _affine(x: mx.array, axis: int, bits: int):
    """Codes (uint8, one per element), scales and zeros of ``x`` quantized over ``axis`` (kept, size 1)."""
    low = mx.min(x, axis=axis, keepdims=True)
    high = mx.max(x, axis=axis, keepdims=True)
    scale = (high - low) / levels(bits)
    safe = mx.where(scale > 0, scale, 1.0)  # a constant group: every code 0, its value the zero itself
    codes = mx.clip(mx.round((x - low) / safe), 0, levels(bits)).astype(mx.uint8)
    return codes, scale, low


def pack(codes: mx.array, bits: int) -> mx.array:
    """One code per byte (``uint8`` ``[..., D]``) as stored: unchanged at 8 bits, two a byte at 4 (``[..., D / 2]``)."""
    if bits == 8:
        return codes
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(codes: mx.array, bits: int) -> mx.array:
    """Stored codes back to one per byte ``[..., D]`` (``pack``'s inverse)."""
    if bits == 8:
        return codes
    low, high = codes & 15, codes >> 4
    return mx.stack([low, high], axis=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])


def quantize_keys(keys: mx.array, group: int, bits: int):
    """Keys ``[B, H, n * group, D]`` quantized per channel over each run of ``group`` tokens.

    Returns ``(codes [B, H, n * group, D * bits / 8], scales [B, H, n, D], zeros [B, H, n, D])`` (float32).
    """
    batch, heads, tokens, dim = keys.shape
    if tokens % group:
        raise ValueError(f"keys: {tokens} tokens are not whole groups of {group}")
    grouped = keys.astype(mx.float32).reshape(batch, heads, tokens // group, group, dim)
    codes, scale, zero = _affine(grouped, 3, bits)
    codes = pack(codes.reshape(batch, heads, tokens, dim), bits)
    return codes, scale.squeeze(3), zero.squeeze(3)


def quantize_values(values: mx.array, group: int, bits: int):
    """Values ``[B, H, T, D]`` quantized per token over each run of ``group`` features (``group`` divides D).

    Returns ``(codes [B, H, T, D * bits / 8], scales [B, H, T, D / group], zeros [B, H, T, D / group])``.
    """
    batch, heads, tokens, dim = values.shape
    if dim % group:
        raise ValueError(f"values: head dim {dim} is not whole groups of {group} features")
    grouped = values.astype(mx.float32).reshape(batch, heads, tokens, dim // group, group)
    codes, scale, zero = _affine(grouped, 4, bits)
    return pack(codes.reshape(batch, heads, tokens, dim), bits), scale.squeeze(4), zero.squeeze(4)


def dequantize_keys(codes, scales, zeros, groups, bits: int) -> mx.array:
    """Float32 keys ``[B, H, N, D]`` from codes and each key's group's scales and zeros."""
    index = mx.broadcast_to(groups[..., None], (*groups.shape, scales.shape[-1]))
    scale = mx.take_along_axis(scales, index, axis=2)
    zero = mx.take_along_axis(zeros, index, axis=2)
    return unpack(codes, bits).astype(mx.float32) * scale + zero


def dequantize_values(codes, scales, zeros, bits: int) -> mx.array:
    """Float32 values ``[B, H, T, D]`` from codes and each token's per-group scales and zeros."""
    unpacked = unpack(codes, bits).astype(mx.float32)
    batch, heads, tokens, dim = unpacked.shape
    groups = scales.shape[-1]
    grouped = unpacked.reshape(batch, heads, tokens, groups, dim // groups)
    return (grouped * scales[..., None] + zeros[..., None]).reshape(batch, heads, tokens, dim)


@dataclass(frozen=True)
class QuantizedKV:
    """One layer's held keys and values as attention reads them: quantized tokens, then float ones.

    Attributes:
        key_codes: ``uint8 [B, H, Nq, D * bits / 8]``.
        key_scales, key_zeros: ``float32 [B, H, groups, D]``: per (token group, feature).
        key_groups: ``int32 [B, H, Nq]``: each quantized key's group.
        value_codes: ``uint8 [B, H, Nq, D * bits / 8]``.
        value_scales, value_zeros: ``float32 [B, H, Nq, D / value_group]``.
        keys, values: ``[B, H, Nt, D]``: the newest tokens in full precision (Nt may be 0).
        bits: 8 or 4. value_group: features per value scale.
        live: ``bool [B, H, N]`` or None: False for a slot whose token was evicted (a hole attention skips).
    """

    key_codes: mx.array
    key_scales: mx.array
    key_zeros: mx.array
    key_groups: mx.array
    value_codes: mx.array
    value_scales: mx.array
    value_zeros: mx.array
    keys: mx.array
    values: mx.array
    bits: int
    value_group: int
    live: Optional[mx.array] = None

    @property
    def shape(self) -> tuple:
        """``(B, H, N, D)``: the keys' shape, as a float key array's (N counts both parts)."""
        batch, heads, tail, dim = self.keys.shape
        return (batch, heads, self.quantized + tail, dim)

    @property
    def quantized(self) -> int:
        """How many tokens (per head) come from codes."""
        return self.key_codes.shape[2]

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """``(keys, values)`` float32 ``[B, H, N, D]``: every token in full precision (a copy of the whole cache)."""
        keys = dequantize_keys(self.key_codes, self.key_scales, self.key_zeros, self.key_groups, self.bits)
        values = dequantize_values(self.value_codes, self.value_scales, self.value_zeros, self.bits)
        return (
            mx.concatenate([keys, self.keys.astype(mx.float32)], axis=2),
            mx.concatenate([values, self.values.astype(mx.float32)], axis=2),
        )

    def native_arguments(self) -> dict:
        """The keyword arguments of the native ``attention_quantized`` that describe these arrays."""
        return dict(
            key_codes=self.key_codes,
            key_scales=self.key_scales,
            key_zeros=self.key_zeros,
            key_groups=self.key_groups,
            value_codes=self.value_codes,
            value_scales=self.value_scales,
            value_zeros=self.value_zeros,
            bits=self.bits,
            value_group=self.value_group,
        )


def held_bytes(arrays: Optional[list]) -> int:
    """Bytes of the arrays given (None entries skipped)."""
    return sum(a.nbytes for a in arrays or () if a is not None)
