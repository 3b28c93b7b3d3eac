"""What a decode holds, measured from the arrays themselves (each once), for tests that bound it."""

import mlx.core as mx

from velox_cache.cache.restoring import Restorable, state_arrays
from velox_cache.generation.decoding_batch import DecodingBatch


def arrays_held(cache) -> list:
    """Every array ``cache`` keeps: a Velox cache's or batch's ``state``; mlx-lm's caches' key and value buffers."""
    if isinstance(cache, Restorable):
        return state_arrays(cache)
    buffers = [getattr(cache, name, None) for name in ("keys", "values")]
    return [array for array in buffers if isinstance(array, mx.array)] or state_arrays(cache)


def bytes_held(caches) -> int:
    """Bytes of the distinct arrays ``caches`` keep (a batch's ``state`` lists its rows' own arrays too)."""
    arrays = {id(array): array for cache in caches for array in arrays_held(cache)}
    return sum(array.nbytes for array in arrays.values())


class MeasuredModel:
    """``model``, measuring after every call what the decode holds: the batched layers it was called with (if any)
    and the caches of ``live()`` (the rows not done); ``held`` lists ``(bytes, rows in the call)``."""

    def __init__(self, model, live):
        self.model, self.live, self.held = model, live, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, tokens, cache=None):
        out = self.model(tokens, cache=cache)
        batches = [layer for layer in cache if isinstance(layer, DecodingBatch)]
        self.held.append((bytes_held(batches + [c for row in self.live() for c in row.caches]), tokens.shape[0]))
        return out
