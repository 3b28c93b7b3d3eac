"""Moving a float window's oldest group into the holes of quantized regions, for B rows at once.

An evicting layer at ``kv_bits`` (``QuantizedTokenSlots``, and its batched form
``velox_cache.generation.quantized_slots_batch``) holds a *region* of quantized
slots per row, right-padded to the widest row, with a ``live`` mask: an evicted
token leaves a hole there. When a row's float window holds a whole group, the
group is quantized (``quantized_group``) and its slots written into each head's
first holes, in slot order, then after the row's region where a head has fewer
holes than a group (``write_into_holes``); afterwards the key scales of groups no
live token uses are dropped (``forget_dead_groups``). Rows not named in ``rows``
are left exactly as they were; one row alone is the case ``B = 1``.

Functional: every array comes back new, nothing is written in place (a batch's
checkpoints keep the old handles).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..kernels import kv_codes

SLOT_PARTS = ("key_codes", "key_groups", "value_codes", "value_scales", "value_zeros")  # one per quantized slot


class QuantizedGroup(NamedTuple):
    """A window group's codes per slot (``SLOT_PARTS``) and its key scales ``[B, H, 1, D]``."""

    slots: dict
    key_scales: mx.array
    key_zeros: mx.array


def quantized_group(keys: mx.array, values: mx.array, number: mx.array, bits: int, value_group: int) -> QuantizedGroup:
    """``keys``/``values`` ``[B, H, g, D]`` (one whole group per row) quantized; row ``b``'s group is ``number[b]``."""
    batch, heads, group = keys.shape[:3]
    key_codes, key_scales, key_zeros = kv_codes.quantize_keys(keys, group, bits)
    value_codes, value_scales, value_zeros = kv_codes.quantize_values(values, value_group, bits)
    numbers = mx.broadcast_to(number.astype(mx.int32).reshape(-1, 1, 1), (batch, heads, group))
    parts = dict(key_codes=key_codes, key_groups=numbers, value_codes=value_codes, value_scales=value_scales,
                 value_zeros=value_zeros)
    return QuantizedGroup(parts, key_scales, key_zeros)


def write_into_holes(region: dict, counts: mx.array, new: dict, rows: np.ndarray) -> tuple[dict, mx.array]:
    """``new``'s ``g`` slots of each row in ``rows`` written into that row's region.

    ``region``: name -> ``[B, H, W, ...]`` (the slots' parts, and ``live``); row ``b``
    uses its first ``counts[b]`` slots (``int32 [B]``), a hole being a used slot that is
    not live. ``new``: the same names, ``[B, H, g, ...]``. Window slot ``j`` of a head
    goes to its ``j``-th hole in slot order, or, past its holes, after the row's used
    slots, which grow by what its head with the fewest holes lacks: the caller makes
    ``W`` wide enough (at most ``g`` more than the most a row uses). Returns the region
    and each row's new count (on the device: nothing here waits for the arrays).
    """
    live = region["live"]
    batch, heads, width = live.shape
    group = new["live"].shape[2]
    slot = mx.arange(width, dtype=mx.int32)[None, None]
    used = counts.astype(mx.int32).reshape(-1, 1, 1)
    hole = ~live & (slot < used)
    holes = hole.sum(axis=-1, keepdims=True).astype(mx.int32)  # [B, H, 1]
    chosen = mx.array(rows.reshape(-1, 1, 1), mx.bool_)
    grow = mx.maximum(0, group - holes.min(axis=1, keepdims=True))  # [B, 1, 1]
    new_counts = mx.where(chosen, used + grow, used).reshape(-1)
    order = mx.where(hole, 0, width) + slot  # holes first, in slot order
    if width < group:
        order = mx.concatenate([order, mx.full((batch, heads, group - width), 2 * width + group, mx.int32)], axis=2)
    first_holes = mx.argsort(order, axis=-1)[..., :group].astype(mx.int32)
    j = mx.arange(group, dtype=mx.int32)
    target = mx.where(j < holes, first_holes, used + j - holes)  # [B, H, g]: where window slot j goes
    target = mx.where(chosen, target, 0)  # the other rows' writes are discarded: keep them in bounds
    written = {}
    for name, array in region.items():
        values = new[name]
        index = target if values.ndim == 3 else mx.broadcast_to(target[..., None], values.shape)
        put = mx.put_along_axis(array, index, values, axis=2)
        written[name] = put if rows.all() else mx.where(chosen.reshape(-1, *[1] * (array.ndim - 1)), put, array)
    return written, new_counts


class GroupScales(NamedTuple):
    """Key groups after ``forget_dead_groups``: the slots' group numbers, the scales, each row's group count."""

    key_groups: mx.array
    key_scales: mx.array  # the kept groups first, in order (the buffer keeps its width)
    key_zeros: mx.array
    groups: mx.array  # int32 [B]
    dropped: mx.array  # bool [B]: rows that dropped a group


def forget_dead_groups(key_groups: mx.array, live: mx.array, counts: mx.array, groups: mx.array,
                       key_scales: mx.array, key_zeros: mx.array, rows: np.ndarray) -> GroupScales:
    """The key scales of groups no live token of a row in ``rows`` uses dropped, the others renumbered (order kept).

    ``key_groups``, ``live``: ``[B, H, W]`` (row ``b`` uses ``counts[b]`` slots); ``groups[b]``:
    row ``b``'s groups. Computed on the device for every row at once: the scales come back
    as wide as they went in, each row's kept groups first.
    """
    batch, heads, width = live.shape
    total = key_scales.shape[2]
    number = mx.arange(total, dtype=mx.int32)
    held = live & (mx.arange(width, dtype=mx.int32)[None, None] < counts.astype(mx.int32).reshape(-1, 1, 1))
    in_use = ((key_groups[..., None] == number) & held[..., None]).any(axis=(1, 2))  # [B, G]
    existing = number[None] < groups.astype(mx.int32)[:, None]
    in_use = mx.where(mx.array(rows.reshape(-1, 1), mx.bool_), in_use & existing, existing)
    renumber = mx.maximum(mx.cumsum(in_use.astype(mx.int32), axis=1) - 1, 0)  # a hole's number no longer matters
    key_groups = mx.take_along_axis(mx.broadcast_to(renumber[:, None], (batch, heads, total)), key_groups, axis=2)
    order = mx.argsort(mx.where(in_use, number, total + number), axis=1).astype(mx.int32)  # kept groups first
    index = mx.broadcast_to(order[:, None, :, None], key_scales.shape)
    kept = in_use.astype(mx.int32).sum(axis=1)
    return GroupScales(key_groups, mx.take_along_axis(key_scales, index, axis=2),
                       mx.take_along_axis(key_zeros, index, axis=2), kept, kept < groups)
