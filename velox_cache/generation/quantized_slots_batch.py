"""``QuantizedSlotsBatch``: one layer's evicting caches at ``kv_bits`` of B sequences, decoding together.

Each row is an evicting cache whose held tokens were quantized when its prefill
ended (``velox_cache.cache.quantized_slots.QuantizedTokenSlots``), and every
step does to each row what decoding it alone does, in the same order: a row at
its budget makes its lowest-ranked live token a hole (the same ranking: its
signal, sinks and recent window protected); a row whose float window holds a
whole group quantizes it into its heads' holes (``velox_cache.cache.quantized_holes``,
the code the row alone runs); the new token joins the row's window.

The batch holds every row's quantized region right-padded to the widest
(``[B, H, Q, ...]``), the key scales padded to the most groups, and the float
windows ``[B, H, W, D]``; ``scores``, ``positions`` and ``live`` cover the
region then the window (``[B, H, Q + W]``), padding never live. Attention is
one call of the fused primitive over the codes (``attend_quantized``), holes
and padding masked by ``live``; observed rows fold its key mass into their
scores, key-proxy rows the proxy's. Nothing is written in place, so a
checkpoint is the arrays' handles.

A step never waits for the device: the counts that depend on attention (each
row's used region slots, its groups) stay device arrays, and the buffers are
sized from bounds known on the host. A row's region never needs more than its
budget plus a group (a group flushed when a head holds ``L`` live region tokens
needs ``L + g`` slots, and ``L`` is below the budget), so the region buffer is
that wide from the start; the key scales grow when a row's count of groups could
outgrow them (its bound read back then, once). Where Velox's native ops are
built, the due rows' flush is one op (``window_flush``, bit for bit the MLX ops'
result).

The layer protocol is ``BatchedLayer``'s: ``extract`` writes a row back into
its own slots as decoding alone leaves them (buffer sizes included),
``join``, ``filter``, ``checkpoint``, ``restore``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..cache.quantized_holes import SLOT_PARTS, forget_dead_groups, quantized_group, write_into_holes
from ..cache.quantized_tokens import GROUP_STEP, padded
from ..cache.signals import fold_heads
from ..cache.slots import protect, recent_limit
from ..kernels import native
from ..kernels.attend import attend_quantized
from ..kernels.kv_codes import QuantizedKV
from .decoding_batch import DecodingBatch
from .row_columns import by_group, column, row_groups
from .unsupported import BatchUnsupported, check_batched_call

_META = ("scores", "positions", "live")  # over the region, then the window
_HOST = ("tail", "kept", "seen", "groups_bound")  # per row, known without the device
_DEVICE = ("quantized", "groups", "scale_room")  # per row, int32 device arrays (they follow attention)
_SETTINGS = ("group_size", "window", "budget", "region_bound")  # per row, fixed while it decodes


def quantized_slots(cache) -> bool:
    """True for an evicting cache whose held tokens are quantized (it batches as ``QuantizedSlotsBatch``)."""
    return bool(getattr(getattr(cache, "slots", None), "quantized", False))


class QuantizedSlotsBatch(DecodingBatch):
    """One layer's quantized evicting rows decoding one token per row per call (see the module doc)."""

    _derived = ("_n_sink", "_recent", "_ranked", "_folded", "_scale")  # ``_settings``, from the rows' caches
    _by_value = ("_offset",)  # each row's next position (on the device, one int a row)

    def _rebuild(self) -> None:
        self._settings()

    def __init__(self, caches: list, layer: int = 0):
        self.layer = layer
        for cache in caches:
            refusal = cache.batch_refusal() if quantized_slots(cache) else "not an evicting cache at kv_bits"
            if refusal is not None:
                raise BatchUnsupported(f"layer {layer}: {refusal}")
        slots = [cache.slots for cache in caches]
        kinds = {(s.bits, s.value_group, s.keys.shape[1], s.keys.shape[3], s.keys.dtype) for s in slots}
        if len(kinds) > 1:
            raise BatchUnsupported(f"layer {layer}: quantized rows differ in bits, groups, heads or dtypes")
        self.bits, self.value_group = slots[0].bits, slots[0].value_group
        self.caches = list(caches)
        quantized = np.array([s.quantized_count for s in slots], np.int64)
        self.quantized = mx.array(quantized, mx.int32)
        self.groups = mx.array([s.groups for s in slots], mx.int32)
        self.scale_room = mx.array([s.key_scales.shape[2] for s in slots], mx.int32)  # alone, its scales' buffer
        self.tail = np.array([s.tail for s in slots], np.int64)
        self.kept = np.array([s.kept for s in slots], np.int64)
        self.seen = np.array([s.tokens_seen for s in slots], np.int64)
        self.groups_bound = np.array([s.groups for s in slots], np.int64)
        self.group_size = np.array([s.group for s in slots], np.int64)
        self.window = np.array([s.keys.shape[2] for s in slots], np.int64)  # alone, the window's buffer
        self.budget = np.array([cache.layer_budget for cache in caches], np.int64)
        self.region_bound = np.maximum(quantized, self.budget + self.group_size)  # the most region slots it can use
        self._offset = mx.array([s.offset for s in slots], mx.int32)
        width, window = int(self.region_bound.max()), int(self.window.max())
        groups = int(self.groups_bound.max()) + GROUP_STEP
        for name in SLOT_PARTS:
            setattr(self, name, mx.concatenate([padded(getattr(s, name), width) for s in slots]))
        self.key_scales = mx.concatenate([padded(s.key_scales[:, :, : s.groups], groups) for s in slots])
        self.key_zeros = mx.concatenate([padded(s.key_zeros[:, :, : s.groups], groups) for s in slots])
        self.keys = mx.concatenate([padded(s.keys, window) for s in slots])
        self.values = mx.concatenate([padded(s.values, window) for s in slots])
        for name in _META:
            setattr(self, name, mx.concatenate([
                mx.concatenate([padded(getattr(s, name)[:, :, :q], width), padded(getattr(s, name)[:, :, q:], window)],
                               axis=2)
                for s, q in zip(slots, quantized)
            ]))
        self._settings()
        self._attended = True

    def _settings(self) -> None:
        """Per-row settings as columns, and which rows each signal ranks and folds."""
        caches = self.caches
        self._n_sink = column([cache.slots.n_sink for cache in caches], mx.int32)
        self._recent = column([recent_limit(c.slots.recent, c.layer_budget, c.slots.n_sink) for c in caches], mx.int32)
        self._ranked = row_groups(caches, lambda cache: cache.slots.signal)
        self._folded = {
            observed: row_groups(caches, lambda c: c.slots.signal if c.slots.signal.rows(1) > 0
                                 and (c.scoring == "observed") == observed else None)
            for observed in (True, False)
        }
        self._scale = next((c.attention_scale for c in caches if c.attention_scale is not None), None)

    # ----- mlx-lm cache protocol ----------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Each row evicts (at budget), moves a whole window group into its holes (when due), then appends."""
        check_batched_call(self.layer, keys, len(self.caches), self._attended)
        keys, values = keys.astype(self.keys.dtype), values.astype(self.values.dtype)
        at_budget = self.kept >= self.budget
        if at_budget.any():
            self._evict_lowest(at_budget)
        flushing = self.tail >= self.group_size
        while flushing.any():  # more than once only after a multi-token call widened a window
            for group in np.unique(self.group_size[flushing]):
                self._flush(flushing & (self.group_size == group), int(group))
            flushing = self.tail >= self.group_size
        self._append(keys, values)
        held = self._held()
        if self._folded[False]:
            scale = self._scale if self._scale is not None else keys.shape[-1] ** -0.5
            proxy = attend_quantized(keys, held, scale=scale, score_rows=1, values=False)
            self._fold(proxy.key_mass, observed=False)
        self._attended = False
        return held, held

    def observe_attention(self, queries, keys, values, scale, mask, sinks=None) -> mx.array:
        """The step's attention over every row's codes and window (holes and padding masked), scoring on the way."""
        if not isinstance(keys, QuantizedKV):
            raise BatchUnsupported(f"layer {self.layer}: attention over keys other than the held ones cannot batch")
        self._attended = True
        score = bool(self._folded[True])
        result = attend_quantized(queries, keys, scale=scale, sinks=sinks, score_rows=int(score))
        if score:
            self._fold(result.key_mass, observed=True)
        return result.output

    @property
    def state(self):
        names = (*SLOT_PARTS, "key_scales", "key_zeros", "keys", "values", *_META, *_DEVICE)
        return [getattr(self, name) for name in names] + self.rows_state()

    @property
    def step_arrays(self) -> list:
        """The scores, and the counts a flush leaves on the device (attention does not read them: unevaluated,
        each flush's counts would hold the arrays of the one before)."""
        return [self.scores, *(getattr(self, name) for name in _DEVICE)]

    @state.setter
    def state(self, value):
        self._restore_state(value)

    def size(self) -> int:
        return int((np.array(self.quantized) + self.tail).max())

    @property
    def rows(self) -> list:
        """The rows' own caches, in batch order."""
        return self.caches

    # ----- one step's mechanics ------------------------------------------------------------------

    @property
    def _region(self) -> int:
        return self.key_codes.shape[2]

    def _evict_lowest(self, at_budget: np.ndarray) -> None:
        """Rows ``at_budget``: their lowest-ranked live token becomes a hole (``QuantizedTokenSlots.replace_lowest``)."""
        ranking = by_group(self._ranked, lambda signal: signal.rank(self.scores, self.positions), self.scores)
        ranking = protect(ranking, self.positions, n_sink=self._n_sink, recent=self._recent,
                          offset=self._offset[:, None, None])
        victim = mx.argmin(mx.where(self.live, ranking, mx.inf), axis=-1, keepdims=True)
        evicted = mx.put_along_axis(self.live, victim, mx.array(False), axis=-1)
        self.live = evicted if at_budget.all() else mx.where(column(at_budget, mx.bool_), evicted, self.live)
        self.kept = self.kept - at_budget

    def _flush(self, rows: np.ndarray, group: int) -> None:
        """Rows ``rows`` (window groups of ``group`` tokens): the window's first group into their holes.

        Usually one row of the batch is due: the native op updates its rows in each array in place; the MLX
        ops work on the due rows taken out of the batch and put back.
        """
        self._scale_room_for(rows)
        index = np.nonzero(rows)[0]
        names = (*SLOT_PARTS, "key_scales", "key_zeros", "keys", "values", *_META, *_DEVICE)
        flush = _native_flush(self.keys.dtype)
        if flush is not None:  # native (window_flush.cpp): the same bits as _flushed, each array updated in place
            flushed = flush([getattr(self, name) for name in names], mx.array(index.astype(np.int32)), group,
                            self.bits, self.value_group)
            for name, array in zip(names, flushed):
                setattr(self, name, array)
        else:
            self._flush_taken(index, names, group)
        self.groups_bound[index] += 1
        self.tail[index] -= group

    def _flush_taken(self, index: np.ndarray, names: tuple, group: int) -> None:
        """The flush in MLX ops (``_flushed``), on rows ``index`` taken out of the batch and put back."""
        take = mx.array(index, mx.int32)
        flushed = _flushed({name: getattr(self, name)[take] for name in names}, group=group, width=self._region,
                           bits=self.bits, value_group=self.value_group)
        for name, part in flushed.items():
            array = getattr(self, name)
            for place, row in enumerate(index):  # a slice update per row: a copy, not a scatter element by element
                array = mx.slice_update(array, part[place : place + 1], mx.array([int(row)]), axes=(0,))
            setattr(self, name, array)

    def _scale_room_for(self, rows: np.ndarray) -> None:
        """Key-scale buffers wide enough for one more group of each row in ``rows``: when a row's bound says they
        may not be, its true count is read back (the one wait on the device) and the buffers grow if needed."""
        if int(self.groups_bound[rows].max()) < self.key_scales.shape[2]:
            return
        self.groups_bound = np.array(self.groups).astype(np.int64)
        width = int(self.groups_bound.max()) + GROUP_STEP
        if width > self.key_scales.shape[2]:
            self.key_scales, self.key_zeros = padded(self.key_scales, width), padded(self.key_zeros, width)

    def _append(self, keys: mx.array, values: mx.array) -> None:
        """Each row's new token at its window's next slot (float, live, scored 0, at the row's position)."""
        if int(self.tail.max()) + 1 > self.keys.shape[2]:
            self._relayout(self._region, int(self.tail.max()) + 1)
        slot = column(self.tail, mx.int32)
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(slot[..., None], keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(slot[..., None], values.shape), values, axis=2)
        index = mx.broadcast_to(slot + self._region, (*self.live.shape[:2], 1))
        self.scores = mx.put_along_axis(self.scores, index, mx.array(0.0), axis=-1)
        self.positions = mx.put_along_axis(self.positions, index, mx.broadcast_to(self._offset[:, None, None],
                                                                                  index.shape), axis=-1)
        self.live = mx.put_along_axis(self.live, index, mx.array(True), axis=-1)
        self.tail, self.kept, self.seen = self.tail + 1, self.kept + 1, self.seen + 1
        self._offset = self._offset + 1

    def _held(self) -> QuantizedKV:
        """Every row's codes, then the windows whole (no slice to copy); ``live`` masks holes and padding."""
        return QuantizedKV(self.key_codes, self.key_scales, self.key_zeros, self.key_groups, self.value_codes,
                           self.value_scales, self.value_zeros, self.keys, self.values, self.bits, self.value_group,
                           self.live)

    def _fold(self, mass: mx.array, *, observed: bool) -> None:
        """Fold one step's key mass ``[B, H', N]`` into the scores of the rows scored this way, by their signal."""
        mass = fold_heads(mass, self.scores.shape[1])
        mass = padded(mass, self.scores.shape[2])
        self.scores = by_group(self._folded[observed], lambda signal: signal.combine(self.scores, mass), self.scores)

    def _relayout(self, region: int, window: int) -> None:
        """Region and window buffers resized to ``region`` and ``window`` slots (cut or padded with dead slots)."""
        old = self._region
        for name in SLOT_PARTS:
            setattr(self, name, padded(getattr(self, name)[:, :, :region], region))
        for name in ("keys", "values"):
            setattr(self, name, padded(getattr(self, name)[:, :, :window], window))
        for name in _META:
            array = getattr(self, name)
            setattr(self, name, mx.concatenate([padded(array[:, :, :min(old, region)], region),
                                                padded(array[:, :, old : old + window], window)], axis=2))

    # ----- rows in and out ---------------------------------------------------------------------

    def extract(self, index: int) -> list:
        """Row ``index`` written back into its own slots, buffers as decoding it alone leaves them."""
        slots = self.caches[index].slots
        row = slice(index, index + 1)
        quantized, groups, room = (int(np.array(getattr(self, name))[index]) for name in _DEVICE)
        window = int(self.window[index])
        for name in SLOT_PARTS:
            setattr(slots, name, mx.contiguous(getattr(self, name)[row, :, :quantized]))
        for name in ("key_scales", "key_zeros"):
            setattr(slots, name, mx.contiguous(padded(getattr(self, name)[row, :, :groups], room)))
        slots.keys = mx.contiguous(padded(self.keys[row, :, :window], window))
        slots.values = mx.contiguous(padded(self.values[row, :, :window], window))
        region = self._region
        for name in _META:
            array = getattr(self, name)[row]
            setattr(slots, name, mx.contiguous(mx.concatenate(
                [array[:, :, :quantized], padded(array[:, :, region : region + window], window)], axis=2)))
        slots.quantized_count, slots.groups = quantized, groups
        slots.tail, slots.kept = int(self.tail[index]), int(self.kept[index])
        slots.stored = quantized + slots.tail
        slots.offset, slots.tokens_seen = int(np.array(self._offset)[index]), int(self.seen[index])
        return slots.arrays

    def join_kind(self) -> tuple:
        return (self.bits, self.value_group, self.keys.shape[1], self.keys.shape[3], self.keys.dtype)

    def join(self, other: "QuantizedSlotsBatch") -> None:
        """``other``'s rows join after this batch's own (continuous batching), every buffer padded to the wider."""
        self.check_joinable(other)
        region, window = max(self._region, other._region), max(self.keys.shape[2], other.keys.shape[2])
        groups = max(self.key_scales.shape[2], other.key_scales.shape[2])
        for batch in (self, other):
            batch._relayout(region, window)
        for name in (*SLOT_PARTS, "keys", "values", *_META, *_DEVICE):
            setattr(self, name, mx.concatenate([getattr(self, name), getattr(other, name)]))
        for name in ("key_scales", "key_zeros"):
            setattr(self, name, mx.concatenate([padded(getattr(self, name), groups), padded(getattr(other, name), groups)]))
        for name in (*_HOST, *_SETTINGS):
            setattr(self, name, np.concatenate([getattr(self, name), getattr(other, name)]))
        self._offset = mx.concatenate([self._offset, other._offset])
        self.caches = self.caches + other.caches
        self._settings()

    def filter(self, indices: list[int]) -> None:
        """Only rows ``indices`` stay (finished rows leave; ``extract`` them first), each buffer no wider than they
        need: the region to their bound, the window to the widest row's, the key scales to ``GROUP_STEP`` past the
        most groups any of them may hold."""
        take = mx.array(indices, mx.int32)
        for name in (*SLOT_PARTS, "key_scales", "key_zeros", "keys", "values", *_META, *_DEVICE):
            setattr(self, name, getattr(self, name)[take])
        for name in (*_HOST, *_SETTINGS):
            setattr(self, name, getattr(self, name)[indices])
        self._offset = self._offset[take]
        self.caches = [self.caches[i] for i in indices]
        groups = min(self.key_scales.shape[2], int(self.groups_bound.max()) + GROUP_STEP)
        self.key_scales, self.key_zeros = self.key_scales[:, :, :groups], self.key_zeros[:, :, :groups]
        self._relayout(int(self.region_bound.max()), int(max(self.window.max(), self.tail.max())))
        self._settings()

    def checkpoint(self) -> tuple:
        """What ``restore`` needs to undo the calls made after it (handles and counts; nothing copied)."""
        names = (*SLOT_PARTS, "key_scales", "key_zeros", "keys", "values", *_META, *_DEVICE, "_offset", "_attended")
        return {name: getattr(self, name) for name in names}, {name: getattr(self, name).copy() for name in _HOST}

    def restore(self, checkpoint: tuple) -> None:
        arrays, counts = checkpoint
        for name, value in {**arrays, **counts}.items():
            setattr(self, name, value)


def _flushed(rows: dict, *, group: int, width: int, bits: int, value_group: int) -> dict:
    """``rows`` (each array's rows that flush; a region ``width`` slots wide) after their window's first
    ``group`` went into their holes."""
    every = np.ones(rows["keys"].shape[0], bool)
    quantized = quantized_group(rows["keys"][:, :, :group], rows["values"][:, :, :group], rows["groups"],
                                bits, value_group)
    number = mx.broadcast_to(rows["groups"].reshape(-1, 1, 1, 1), quantized.key_scales.shape)
    key_scales = mx.put_along_axis(rows["key_scales"], number, quantized.key_scales, axis=2)
    key_zeros = mx.put_along_axis(rows["key_zeros"], number, quantized.key_zeros, axis=2)
    groups = rows["groups"] + 1  # alone, its scales' buffer grows by whole steps when full
    room = mx.where(groups > rows["scale_room"], groups + (-groups) % GROUP_STEP, rows["scale_room"])
    region = {name: rows[name] for name in SLOT_PARTS}
    new = dict(quantized.slots)
    for name in _META:
        region[name], new[name] = rows[name][:, :, :width], rows[name][:, :, width : width + group]
    region, counts = write_into_holes(region, rows["quantized"], new, every)
    kept = forget_dead_groups(region["key_groups"], region["live"], counts, groups, key_scales, key_zeros, every)
    flushed = dict(region, key_groups=kept.key_groups, key_scales=kept.key_scales, key_zeros=kept.key_zeros,
                   quantized=counts, groups=kept.groups, scale_room=mx.where(kept.dropped, kept.groups, room))
    for name in ("keys", "values"):
        flushed[name] = padded(rows[name][:, :, group:], rows[name].shape[2])
    for name in _META:
        window = rows[name][:, :, width:]
        flushed[name] = mx.concatenate([region[name], padded(window[:, :, group:], window.shape[2])], axis=2)
    return flushed


def _native_flush(dtype):
    """The native ``window_flush`` where it is built and can take these windows (float32 on the CPU), else None."""
    ops = native.ops()
    if ops is None or not hasattr(ops, "window_flush") or dtype != mx.float32 or mx.default_device() != mx.cpu:
        return None
    return ops.window_flush
