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


def quantized_group(keys: mx.array, values: mx.array, number: np.ndarray, bits: int, value_group: int) -> QuantizedGroup:
    """``keys``/``values`` ``[B, H, g, D]`` (one whole group per row) quantized; row ``b``'s group is ``number[b]``."""
    batch, heads, group = keys.shape[:3]
    key_codes, key_scales, key_zeros = kv_codes.quantize_keys(keys, group, bits)
    value_codes, value_scales, value_zeros = kv_codes.quantize_values(values, value_group, bits)
    numbers = mx.broadcast_to(mx.array(np.asarray(number).reshape(-1, 1, 1), mx.int32), (batch, heads, group))
    parts = dict(key_codes=key_codes, key_groups=numbers, value_codes=value_codes, value_scales=value_scales,
                 value_zeros=value_zeros)
    return QuantizedGroup(parts, key_scales, key_zeros)


def write_into_holes(region: dict, counts: np.ndarray, new: dict, rows: np.ndarray) -> tuple[dict, np.ndarray]:
    """``new``'s ``g`` slots of each row in ``rows`` written into that row's region.

    ``region``: name -> ``[B, H, W, ...]`` (the slots' parts, and ``live``); row ``b``
    uses its first ``counts[b]`` slots, a hole being a used slot that is not live.
    ``new``: the same names, ``[B, H, g, ...]``. Window slot ``j`` of a head goes to
    its ``j``-th hole in slot order, or, past its holes, after the row's region, which
    grows by what its head with the fewest holes lacks. Returns the region (padded
    to the widest row) and each row's new count.
    """
    live = region["live"]
    batch, heads, width = live.shape
    group = new["live"].shape[2]
    slot = mx.arange(width, dtype=mx.int32)[None, None]
    used = mx.array(counts.reshape(-1, 1, 1), mx.int32)
    hole = ~live & (slot < used)
    holes = hole.sum(axis=-1, keepdims=True).astype(mx.int32)  # [B, H, 1]
    fewest = np.array(holes.min(axis=1)).reshape(-1)
    new_counts = np.where(rows, counts + np.maximum(0, group - fewest), counts)
    new_width = max(width, int(new_counts.max()))
    order = mx.where(hole, 0, width) + slot  # holes first, in slot order
    if width < group:
        order = mx.concatenate([order, mx.full((batch, heads, group - width), 2 * width + group, mx.int32)], axis=2)
    first_holes = mx.argsort(order, axis=-1)[..., :group].astype(mx.int32)
    j = mx.arange(group, dtype=mx.int32)
    target = mx.where(j < holes, first_holes, used + j - holes)  # [B, H, g]: where window slot j goes
    chosen = None if rows.all() else mx.array(rows.reshape(-1, 1, 1), mx.bool_)
    if chosen is not None:
        target = mx.where(chosen, target, 0)  # the other rows' writes are discarded: keep them in bounds
    written = {}
    for name, array in region.items():
        array = padded(array, new_width)
        values = new[name]
        index = target if values.ndim == 3 else mx.broadcast_to(target[..., None], values.shape)
        put = mx.put_along_axis(array, index, values, axis=2)
        written[name] = put if chosen is None else mx.where(chosen.reshape(-1, *[1] * (array.ndim - 1)), put, array)
    return written, new_counts


class GroupScales(NamedTuple):
    """Key groups after ``forget_dead_groups``: the slots' group numbers, the scales kept, each row's group count."""

    key_groups: mx.array
    key_scales: mx.array
    key_zeros: mx.array
    groups: np.ndarray
    dropped: np.ndarray  # [B] bool: rows that dropped a group


def forget_dead_groups(key_groups: mx.array, live: mx.array, counts: np.ndarray, groups: np.ndarray,
                       key_scales: mx.array, key_zeros: mx.array, rows: np.ndarray) -> GroupScales:
    """The key scales of groups no live token of a row in ``rows`` uses dropped, the others renumbered (order kept).

    ``key_groups``, ``live``: ``[B, H, W]`` (row ``b`` uses ``counts[b]`` slots); ``groups[b]``:
    row ``b``'s groups. A row that drops nothing keeps its arrays as they are; otherwise the
    scales come back ``[B, H, most groups kept, D]``.
    """
    numbers, alive = np.array(key_groups), np.array(live)
    width = numbers.shape[2]
    kept_groups = []
    for row in range(numbers.shape[0]):
        in_use = np.zeros(int(groups[row]), bool)
        if rows[row]:
            used_slots = alive[row] & (np.arange(width) < counts[row])[None]
            in_use[np.unique(numbers[row][used_slots])] = True
        else:
            in_use[:] = True
        kept_groups.append(np.nonzero(in_use)[0])
    dropped = np.array([len(kept) < n for kept, n in zip(kept_groups, groups)])
    if not dropped.any():
        return GroupScales(key_groups, key_scales, key_zeros, groups, dropped)
    total = key_scales.shape[2]
    renumber = np.zeros((len(kept_groups), total), np.int32)
    kept_index = np.zeros((len(kept_groups), max(len(k) for k in kept_groups)), np.int32)
    for row, kept in enumerate(kept_groups):
        renumber[row, kept] = np.arange(len(kept))
        kept_index[row, : len(kept)] = kept
    table = mx.broadcast_to(mx.array(renumber)[:, None], (*key_groups.shape[:2], total))
    key_groups = mx.take_along_axis(table, key_groups, axis=2)  # a hole's number no longer matters
    index = mx.broadcast_to(mx.array(kept_index)[:, None, :, None], (*key_scales.shape[:2], kept_index.shape[1],
                                                                      key_scales.shape[3]))
    new_groups = np.array([len(kept) for kept in kept_groups])
    return GroupScales(key_groups, mx.take_along_axis(key_scales, index, axis=2),
                       mx.take_along_axis(key_zeros, index, axis=2), new_groups, dropped)


def padded(array: mx.array, width: int) -> mx.array:
    """``array`` right-padded with zeros (False) to ``width`` along axis 2."""
    missing = width - array.shape[2]
    if missing <= 0:
        return array
    return mx.concatenate([array, mx.zeros((*array.shape[:2], missing, *array.shape[3:]), array.dtype)], axis=2)
