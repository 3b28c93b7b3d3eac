"""``DecodingBatch``: the mlx-lm cache protocol every batched layer shares (one token per row per call)."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from ..cache.restoring import Restorable, state_arrays

from .unsupported import BatchUnsupported


class DecodingBatch(Restorable, _BaseCache):
    """Base of the batched layers: each row's position in ``_offset`` ``int32 [B]``, ``layer`` its index,
    ``_attended`` whether the last call's attention reached the layer.

    A batch's ``state`` is its own buffers, then the arrays of its rows' own caches
    (``rows_state``: they keep them until they leave, and ``extract`` writes into them), so
    that ``from_state(state, meta_state)`` restores the batch and its rows
    (``velox_cache.cache.restoring``).
    """

    layer: int = 0
    _offset: mx.array
    _attended: bool = True

    @property
    def offset(self) -> mx.array:
        """Each row's position for its next token, ``int32 [B]`` (mlx-lm's RoPE takes one per row)."""
        return self._offset

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """None: one token per row, and the layer masks its own padding when attention reaches it."""
        if N != 1:
            raise BatchUnsupported(f"layer {self.layer}: a batch takes one token per row per call, got {N}")
        return None

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False

    @property
    def attended(self) -> bool:
        """False when the last call's attention did not reach ``observe_attention``."""
        return self._attended

    def rows_state(self) -> list:
        """The arrays the rows' own caches hold (in ``state``, after the batch's own)."""
        return [array for cache in self.row_caches() for array in state_arrays(cache)]

    def row_caches(self) -> list:
        """The rows' own caches, in the order ``state`` lists their arrays."""
        return list(self.rows)

    @property
    def step_arrays(self) -> list:
        """What a decoding loop evaluates with each step's tokens, so that no lazy graph outlives the step
        (the state a step changes and attention does not read: the scores, and counts kept on the device)."""
        return [self.scores]

    def join_kind(self) -> tuple:
        """What rows must share to decode in one batch of this class (bits, groups, heads, dims, dtypes)."""
        raise NotImplementedError

    def join_refusal(self, other) -> Optional[str]:
        """Why ``other``'s rows cannot join this batch (None: they can)."""
        if type(other) is not type(self):
            return f"layer {self.layer}: rows of another kind ({type(other).__name__}) join a MixedBatch, not this layer"
        mine, theirs = self.join_kind(), other.join_kind()
        return None if mine == theirs else f"layer {self.layer}: rows differ: {mine} and {theirs}"

    def check_joinable(self, other) -> None:
        """Raise ``BatchUnsupported`` (this batch unchanged) when ``other``'s rows cannot join it (``join_refusal``)."""
        refusal = self.join_refusal(other)
        if refusal is not None:
            raise BatchUnsupported(refusal)
