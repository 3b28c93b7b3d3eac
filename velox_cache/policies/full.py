"""The full cache: mlx-lm's ``KVCache`` with Velox accounting (the quality baseline), and its quantized form."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..budgets.allocators import UniformBudget
from ..cache.accounting import CacheAccounting
from ..cache.phases import Phase
from ..cache.quantized_tokens import QuantizedTokens
from ..cache.restoring import Restorable
from ..config import KVCacheConfig
from ..kernels.attend import attend_quantized
from ..kernels.masks import fit_mask
from ..kernels.observe import is_routed


class FullKVCache(Restorable, CacheAccounting, KVCache):
    """Keeps every token; logits are exactly those of mlx-lm's ``KVCache``.

    ``state`` is mlx-lm's ``(keys, values, offset)``; ``meta_state`` adds the config and layer
    (``velox_cache.cache.restoring``). ``from_state(state)`` without it restores as mlx-lm's
    ``KVCache`` does, with the default config.
    """

    method = "full"
    allocator = UniformBudget  # never consulted: the full cache keeps everything

    def __init__(self, config: Optional[KVCacheConfig] = None, layer_id: Optional[int] = None):
        super().__init__()
        self.config = config or KVCacheConfig(method="full")
        self.layer_id = layer_id

    @property
    def state(self):
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, value):
        self._restore_state(value)

    def _restore_state(self, value) -> None:
        """A live cache takes ``(keys, values, offset)`` as mlx-lm's ``KVCache`` does; ``from_state`` waits for the meta."""
        if "config" in vars(self) and "_restoring_meta" not in vars(self):
            self.keys, self.values, self.offset = value
        else:
            Restorable._restore_state(self, value)

    @classmethod
    def _from_state_alone(cls, state):
        cache = cls.__new__(cls)
        cache.keys, cache.values, cache.offset = state
        cache.config, cache.layer_id = KVCacheConfig(method="full"), None
        return cache

    @property
    def layer_budget(self) -> int:
        """Unbounded: the number of tokens seen."""
        return self.offset

    @property
    def held_slots(self) -> int:
        """The tokens seen: the rest of the buffer is mlx-lm's room to grow (``spare_bytes``), not kept."""
        return self.offset

    @property
    def tokens_kept(self) -> int:
        return self.offset

    @property
    def concentration(self) -> float:
        return 0.0


class QuantizedFullKVCache(FullKVCache):
    """The full cache at ``config.kv_bits``: every token kept, quantized once its key group is whole (KIVI).

    While the prompt is read every token stays in float, so prefill computes
    exactly what ``FullKVCache`` computes (and a stack cut from a shared
    reading's float full stack is this cache's own, ``from_float``). When
    decoding starts (the phase told, or the first single-token call outside a
    probe) the held tokens are quantized a group of ``kv_group_size`` at a
    time (``velox_cache.cache.quantized_tokens``), the newest ``kv_window``
    and the rest of a group kept in float. Generated tokens join that float
    window and stay there: nothing is quantized while decoding, so a row
    holds the same alone and in a batch
    (``velox_cache.generation.quantized_batching``), at the cost of the
    generated tokens' float bytes. Keys are quantized per channel, values per
    token.

    Attention must run through Velox (``velox_cache.fast_attention`` or
    ``observe``): the model's own attention cannot read codes.
    """

    def __init__(self, config: Optional[KVCacheConfig] = None, layer_id: Optional[int] = None):
        super().__init__(config, layer_id)
        if not self.config.kv_bits:
            raise ValueError("config: a QuantizedFullKVCache needs kv_bits (8 or 4)")
        self.tokens = QuantizedTokens(self.config.kv_bits, self.config.kv_group, self.config.kv_window)
        self.decoding = False
        self._probe_marks: list = []  # (tokens mark, offset) of each probe running

    kv_bits = property(lambda self: self.config.kv_bits, doc="Bits per held key and value code (8 or 4).")

    @classmethod
    def from_float(cls, config: KVCacheConfig, source, layer_id: Optional[int] = None) -> "QuantizedFullKVCache":
        """The cache that reading the same prompt at ``config.kv_bits`` leaves, from ``source``'s float tokens
        (a ``FullKVCache`` or mlx-lm ``KVCache`` that read it, not yet decoding). Shares no array with it."""
        cache = cls(config, layer_id)
        if source.keys is not None and source.offset:
            cache.tokens.adopt_float(source.keys[:, :, : source.offset], source.values[:, :, : source.offset])
        cache.offset = source.offset
        return cache

    # ----- phases (``velox_cache.cache.phases``) ----------------------------------------------

    lookahead = 0
    uses_probes = False
    reconstructs = False

    def begin_phase(self, phase) -> None:
        """``decode``: quantize the prompt's whole groups now; other phases change nothing."""
        if Phase.parse(phase) is Phase.DECODE and not self._probe_marks:
            self._start_decoding()

    def begin_probe(self, kind: str = "probe") -> None:
        """The next calls are dropped by ``end_probe`` (nothing is quantized meanwhile)."""
        self._probe_marks.append((self.tokens.mark(), self.offset))

    def end_probe(self) -> None:
        if self._probe_marks:
            mark, offset = self._probe_marks.pop()
            self.tokens.restore(mark)
            self.offset = offset

    def _start_decoding(self) -> None:
        self.decoding = True
        self.tokens.settle()

    # ----- mlx-lm cache protocol --------------------------------------------------------------

    def update_and_fetch(self, keys, values):
        """Hold the new tokens and return every held one as a ``velox_cache.kernels.kv_codes.QuantizedKV``
        (twice: for the keys and the values the model passes on to its attention)."""
        if not is_routed():
            raise RuntimeError(
                f"layer {self.layer_id}: kv_bits caches hold codes the model's own attention cannot read; run the "
                "model inside `velox_cache.fast_attention(model)` or `velox_cache.observe(model)`"
            )
        if keys.shape[2] == 1 and not self.decoding and not self._probe_marks:
            self._start_decoding()  # never told: the first generated token, as mlx_lm.generate feeds it
        self.tokens.append(keys, values)
        self.offset += keys.shape[2]
        held = self.tokens.held()
        return held, held

    def observe_attention(self, queries, keys, values, scale, mask, sinks=None):
        """The attention Velox routes here: over the codes and the float window (``attend_quantized``)."""
        if isinstance(mask, mx.array):
            mask = fit_mask(mask, queries.shape[2], keys.shape[2])
        return attend_quantized(queries, keys, scale=scale, mask=mask, sinks=sinks).output

    @property
    def state(self):
        return self.tokens.arrays

    @state.setter
    def state(self, value):
        self._restore_state(value)

    _restore_state = Restorable._restore_state  # its state holds codes: restored by the layout meta_state names
    _from_state_alone = Restorable.__dict__["_from_state_alone"]

    def is_trimmable(self) -> bool:
        return False

    @classmethod
    def merge(cls, caches):
        raise TypeError(
            f"{cls.__name__} cannot be merged into an mlx-lm batch cache (it holds codes, not keys): decode such rows "
            "with velox_cache's decode_rows or batch_generate, which batch them as QuantizedFullBatch"
        )

    def empty(self) -> bool:
        return self.tokens.empty

    # ----- accounting (what the codes, scales and window really take) ----------------------------

    @property
    def kv_heads(self) -> int:
        return self.tokens.kv_heads

    @property
    def kept_bytes(self) -> int:
        """Bytes the held tokens take: codes, group numbers, scales and zeros, and the float window."""
        return self.tokens.kept_bytes

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes

    @property
    def full_seq_bytes(self) -> int:
        """Bytes every token seen would take in float (the window's dtype): what the codes are compared to."""
        return self.offset * self.tokens.float_bytes_per_token()

    @property
    def tokens_seen(self) -> int:
        return self.offset * self.kv_heads * (0 if self.tokens.empty else self.tokens.tail_keys.shape[0])
