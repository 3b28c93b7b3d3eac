"""``QuantizedFullBatch``: one layer's full caches at ``kv_bits`` of B sequences, decoding together.

Each row's prompt was quantized when its decoding started
(``velox_cache.policies.full.QuantizedFullKVCache``); its generated tokens stay in
its float window, so nothing is quantized while the batch decodes and a row
holds, token for token, what decoding it alone would. The batch holds every
row's codes, group numbers and scales right-padded to the widest row, and a
float window ``[B, H, W, D]`` each row fills from its own count. One step is
one write per layer (every row's token at its own next window slot) and one
call of the fused attention over the codes (``attend_quantized``), padding
masked by each row's counts.

The layer protocol is ``BatchedLayer``'s (``velox_cache.generation.batching``):
``extract``, ``join``, ``filter``, ``checkpoint`` and ``restore``, so
``decode_rows`` drives either kind.
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np

from ..cache.quantized_tokens import STEP as TOKENS_STEP
from ..cache.quantized_tokens import padded
from ..kernels.attend import attend_quantized
from ..kernels.kv_codes import QuantizedKV
from .decoding_batch import DecodingBatch
from .unsupported import BatchUnsupported, check_batched_call

STEP = 256  # window growth, in tokens

_CODE_PARTS = ("key_codes", "key_groups", "value_codes", "value_scales", "value_zeros")  # per quantized token
_GROUP_PARTS = ("key_scales", "key_zeros")  # per key group


class QuantizedFullBatch(DecodingBatch):
    """One layer's ``QuantizedFullKVCache`` rows decoding one token per row per call (see the module doc)."""

    _derived = ("_offset",)  # every row keeps every token: its codes and its window (``_rebuild``)

    def _rebuild(self) -> None:
        self._offset = mx.array(self.quantized + self.tails, mx.int32)

    def __init__(self, caches: list, layer: int = 0):
        self.layer = layer
        for cache in caches:
            if not getattr(cache, "decoding", False):
                raise BatchUnsupported(f"layer {layer}: a quantized full cache joins a batch once decoding started")
        views = [cache.tokens.held() for cache in caches]
        kinds = {(v.bits, v.value_group, v.keys.shape[1], v.keys.shape[3], v.keys.dtype) for v in views}
        if len(kinds) > 1:
            raise BatchUnsupported(f"layer {layer}: quantized rows differ in bits, groups, heads or dtypes")
        self.bits, self.value_group = views[0].bits, views[0].value_group
        self.caches = list(caches)
        self.quantized = np.array([v.quantized for v in views], np.int64)
        self.groups = np.array([v.key_scales.shape[2] for v in views], np.int64)
        self.tails = np.array([v.keys.shape[2] for v in views], np.int64)
        self._offset = mx.array([cache.offset for cache in caches], mx.int32)
        width, groups = int(self.quantized.max()), int(self.groups.max())
        for name in _CODE_PARTS:
            setattr(self, name, mx.concatenate([padded(getattr(v, name), width) for v in views]))
        for name in _GROUP_PARTS:
            setattr(self, name, mx.concatenate([padded(getattr(v, name), groups) for v in views]))
        room = int(self.tails.max()) + STEP
        self.keys = mx.concatenate([padded(v.keys, room) for v in views])
        self.values = mx.concatenate([padded(v.values, room) for v in views])
        self._attended = True

    # ----- mlx-lm cache protocol ----------------------------------------------------------

    @property
    def step_arrays(self) -> list:
        """Nothing is scored (a full cache ranks nothing): the offsets."""
        return [self._offset]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Each row's new token at its own next window slot; returns every held token as one ``QuantizedKV``."""
        check_batched_call(self.layer, keys, len(self.caches), self._attended)
        self._attended = False
        if int(self.tails.max()) + 1 > self.keys.shape[2]:
            self.keys, self.values = padded(self.keys, self.keys.shape[2] + STEP), padded(self.values, self.values.shape[2] + STEP)
        slot = mx.array(self.tails, mx.int32)[:, None, None, None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(slot, keys.shape), keys.astype(self.keys.dtype), axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(slot, values.shape),
                                        values.astype(self.values.dtype), axis=2)
        self.tails = self.tails + 1
        self._offset = self._offset + 1
        held = self._held()
        return held, held

    def _held(self) -> QuantizedKV:
        window = int(self.tails.max())
        codes = mx.arange(self.key_codes.shape[2], dtype=mx.int32)[None] < mx.array(self.quantized, mx.int32)[:, None]
        floats = mx.arange(window, dtype=mx.int32)[None] < mx.array(self.tails, mx.int32)[:, None]
        live = mx.broadcast_to(mx.concatenate([codes, floats], axis=1)[:, None], (len(self.caches), self.keys.shape[1],
                                                                                  codes.shape[1] + window))
        return QuantizedKV(self.key_codes, self.key_scales, self.key_zeros, self.key_groups, self.value_codes,
                           self.value_scales, self.value_zeros, self.keys[:, :, :window], self.values[:, :, :window],
                           self.bits, self.value_group, live)

    def observe_attention(self, queries, keys, values, scale, mask, sinks=None) -> mx.array:
        """The step's attention over every row's codes and window (padding masked)."""
        if not isinstance(keys, QuantizedKV):
            raise BatchUnsupported(f"layer {self.layer}: attention over keys other than the held ones cannot batch")
        self._attended = True
        return attend_quantized(queries, keys, scale=scale, sinks=sinks).output

    @property
    def state(self):
        own = [getattr(self, name) for name in (*_CODE_PARTS, *_GROUP_PARTS)] + [self.keys, self.values]
        return own + self.rows_state()

    @state.setter
    def state(self, value):
        self._restore_state(value)

    def size(self) -> int:
        return int((self.quantized + self.tails).max())

    @property
    def rows(self) -> list:
        """The rows' own caches, in batch order (as ``BatchedLayer.rows`` counts them)."""
        return self.caches

    # ----- rows in and out ---------------------------------------------------------------------

    def extract(self, index: int) -> list:
        """Row ``index``'s window back into its own cache (its codes never changed), as decoding alone leaves it."""
        cache, tail = self.caches[index], int(self.tails[index])
        tokens = cache.tokens
        room = tokens.tail_keys.shape[2]  # alone, the window grows to whole steps of STEP when it fills
        room = room if tail <= room else -(-tail // TOKENS_STEP) * TOKENS_STEP
        tokens.tail_keys = mx.contiguous(padded(self.keys[index : index + 1, :, :tail], room))
        tokens.tail_values = mx.contiguous(padded(self.values[index : index + 1, :, :tail], room))
        tokens.tail = tail
        cache.offset = int(np.array(self._offset)[index])
        return [tokens.tail_keys, tokens.tail_values]

    def join_kind(self) -> tuple:
        return (self.bits, self.value_group, self.keys.shape[1], self.keys.shape[3], self.keys.dtype)

    def join(self, other: "QuantizedFullBatch") -> None:
        """``other``'s rows join after this batch's own (continuous batching), every array padded to the wider."""
        self.check_joinable(other)
        for names, axis_width in ((_CODE_PARTS, max(self.key_codes.shape[2], other.key_codes.shape[2])),
                                  (_GROUP_PARTS, max(self.key_scales.shape[2], other.key_scales.shape[2])),
                                  (("keys", "values"), max(self.keys.shape[2], other.keys.shape[2]))):
            for name in names:
                setattr(self, name, mx.concatenate([padded(getattr(self, name), axis_width),
                                                    padded(getattr(other, name), axis_width)]))
        self.caches += other.caches
        self.quantized = np.concatenate([self.quantized, other.quantized])
        self.groups = np.concatenate([self.groups, other.groups])
        self.tails = np.concatenate([self.tails, other.tails])
        self._offset = mx.concatenate([self._offset, other._offset])

    def filter(self, indices: list[int]) -> None:
        """Only rows ``indices`` stay (finished rows leave; ``extract`` them first), each buffer no wider than they
        need: the codes and groups to the widest row's, the window to a ``STEP`` past the longest."""
        take = mx.array(indices, mx.int32)
        self.caches = [self.caches[i] for i in indices]
        self.quantized, self.groups, self.tails = self.quantized[indices], self.groups[indices], self.tails[indices]
        window = min(self.keys.shape[2], int(self.tails.max()) + STEP)
        widths = {**dict.fromkeys(_CODE_PARTS, int(self.quantized.max())),
                  **dict.fromkeys(_GROUP_PARTS, int(self.groups.max())), "keys": window, "values": window}
        for name, width in widths.items():
            setattr(self, name, getattr(self, name)[take, :, :width])
        self._offset = self._offset[take]

    def checkpoint(self) -> tuple:
        """What ``restore`` needs to undo the calls made after it (handles and counts; nothing copied)."""
        return self.keys, self.values, self._offset, self.tails.copy(), self._attended

    def restore(self, checkpoint: tuple) -> None:
        self.keys, self.values, self._offset, tails, self._attended = checkpoint
        self.tails = tails.copy()
