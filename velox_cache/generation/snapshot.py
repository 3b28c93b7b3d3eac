"""``snapshot(caches)``: an independent copy of a prompt cache stack, as it is now.

MLX arrays are immutable graph nodes, but Python array objects can be updated in
place (``cache.keys[..., a:b, :] = new``, which mlx-lm's ``KVCache`` does). A
snapshot therefore copies every cache object and rebinds each array it holds to
a fresh array handle, so that whatever later happens to either stack (decode
steps, evictions, in-place writes) leaves the other untouched. Shared objects
that are frozen by then (a published ``SqueezeCoordinator``, the config) are
shared, not copied.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from ..budgets.allocators import UniformBudget
from ..cache.phases import LayerPhase
from ..cache.quantized_tokens import QuantizedTokens
from ..cache.selection import WindowSelector
from ..cache.slots import TokenSlots
from ..cache.timing import Continuous

# A cache and the per-sequence parts it owns: each is copied, with the arrays it holds.
PER_SEQUENCE = (_BaseCache, TokenSlots, WindowSelector, LayerPhase, Continuous, UniformBudget, QuantizedTokens)


def snapshot(caches: list) -> list:
    """Independent copies of ``caches`` (any mix of Velox and mlx-lm caches).

    Take it when prefill has ended (after the prompt's last token): the copy can
    then decode a different continuation, for example teacher-forcing a
    reference output, at the cost of no second prefill.
    """
    return [_copy_cache(cache) for cache in caches]


def restore(caches: list, saved: list) -> None:
    """Put every cache of ``caches`` back as it was when ``saved = snapshot(caches)`` was taken.

    The cache objects stay the same objects (whoever holds them sees the old
    state again); ``saved`` is used up: its parts now belong to ``caches``.
    """
    for cache, copy_ in zip(caches, saved):
        state = vars(cache)
        state.clear()
        state.update(vars(copy_))


def _copy_cache(cache):
    clone = copy.copy(cache)
    for name, value in vars(cache).items():
        vars(clone)[name] = _copy_value(value)
    return clone


def _copy_value(value):
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, PER_SEQUENCE):
        return _copy_cache(value)
    if isinstance(value, list):
        return [_copy_value(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_copy_value(item) for item in value)
    return value
