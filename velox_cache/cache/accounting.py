"""Byte and token accounting shared by every Velox cache, measured from the arrays held."""

from __future__ import annotations


class CacheAccounting:
    """Mixin: accounting properties and ``stats()`` for a cache that holds ``keys``/``values``.

    Subclasses provide ``method``, ``offset``, ``tokens_kept``, ``layer_budget``,
    ``concentration`` and ``layer_id``; ``seen_per_head`` defaults to ``offset``
    (a cache that re-rotates positions counts what it saw separately).
    """

    @property
    def seen_per_head(self) -> int:
        """Tokens seen per head (every position passed to ``update_and_fetch``)."""
        return self.offset

    @property
    def kv_heads(self) -> int:
        """Key/value heads of the layer (the key buffer's head axis unless the cache says otherwise)."""
        return self.keys.shape[1]

    @property
    def held_slots(self) -> int:
        """Slots of the key buffer's token axis that hold a token (the rest is room to grow into)."""
        return self.keys.shape[2]

    @property
    def kept_bytes(self) -> int:
        """Bytes of the keys and values of the tokens held: the buffers' ``nbytes`` per slot x ``held_slots``."""
        if self.keys is None or not self.keys.shape[2]:
            return 0
        per_slot = (self.keys.nbytes + self.values.nbytes) // self.keys.shape[2]
        return per_slot * self.held_slots

    @property
    def spare_bytes(self) -> int:
        """Bytes of buffer slots allocated ahead and holding no token yet (``nbytes - kept_bytes``)."""
        return self.nbytes - self.kept_bytes

    @property
    def full_seq_bytes(self) -> int:
        """Bytes that keys and values of every token seen would take at the held dtype."""
        if self.keys is None:
            return 0
        batch, key_dim, heads = self.keys.shape[0], self.keys.shape[-1], self.kv_heads
        value_dim = self.values.shape[-1]
        per_token = key_dim * self.keys.itemsize + value_dim * self.values.itemsize
        return self.seen_per_head * batch * heads * per_token

    @property
    def compression_ratio(self) -> float:
        """``full_seq_bytes / kept_bytes``; above 1 means memory saved."""
        kept = self.kept_bytes
        return self.full_seq_bytes / kept if kept else 1.0

    @property
    def tokens_seen(self) -> int:
        """Token positions ever passed to ``update_and_fetch``, summed over batch and heads."""
        if self.keys is None:
            return 0
        return self.seen_per_head * self.keys.shape[0] * self.kv_heads

    @property
    def nbytes(self) -> int:
        """mlx-lm's cache size protocol: the bytes of the buffers held, spare room included."""
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def stats(self) -> dict:
        """One row of per-layer accounting (what the job runner stores)."""
        return {
            "layer": self.layer_id,
            "cache_kind": type(self).__name__,
            "method": self.method,
            "scoring": getattr(self, "scoring", None),
            "layer_budget": self.layer_budget,
            "offset": self.offset,
            "tokens_seen": self.tokens_seen,
            "tokens_kept": self.tokens_kept,
            "kept_bytes": self.kept_bytes,
            "spare_bytes": self.spare_bytes,
            "full_seq_bytes": self.full_seq_bytes,
            "compression_ratio": self.compression_ratio,
            "concentration": self.concentration,
        }


def layer_stats(index: int, cache) -> dict:
    """One accounting row for entry ``index`` of a model's cache list, whatever its kind.

    A Velox cache reports its own ``stats()``. A cache Velox left as the model
    made it (``RotatingKVCache``, ``ArraysCache``, ...) reports its ``nbytes``
    as both ``kept_bytes`` and ``full_seq_bytes`` (ratio 1: Velox saved nothing
    there) and no budget. A ``CacheList`` holding a Velox cache reports that
    cache's budget and tokens, and adds its other members' bytes to both sides.
    ``cache_kind`` names the class (``CacheList(ArraysCache,PyramidKVCache)``).
    """
    from .model_caches import cache_kind

    members = getattr(cache, "caches", None)
    velox = [m for m in members if isinstance(m, CacheAccounting)] if members is not None else []
    if isinstance(cache, CacheAccounting):
        row = cache.stats()
    elif velox:
        row = velox[0].stats()
        other = sum(m.nbytes for m in members if m is not velox[0])
        row["kept_bytes"] += other
        row["full_seq_bytes"] += other
        row["compression_ratio"] = row["full_seq_bytes"] / row["kept_bytes"] if row["kept_bytes"] else 1.0
    else:
        held = cache.nbytes
        row = {
            "method": None,
            "scoring": None,
            "layer_budget": None,
            "offset": getattr(cache, "offset", None),
            "tokens_seen": None,
            "tokens_kept": None,
            "kept_bytes": held,
            "spare_bytes": 0,
            "full_seq_bytes": held,
            "compression_ratio": 1.0,
            "concentration": None,
        }
    return {**row, "layer": index, "cache_kind": cache_kind(cache)}
