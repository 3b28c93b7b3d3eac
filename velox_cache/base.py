"""``EvictingKVCache``: the eviction mechanics every budgeted policy shares.

A policy is three independent choices (see ARCHITECTURE.md): how many tokens a
layer keeps (``_budget_in_force``), when eviction happens (``eviction``:
continuously or once at the end of prefill) and which signal ranks tokens
(``score_signal`` plus ``prefill_selection``). Subclasses set class attributes
and, where needed, override the budget; the mechanics live here.

Buffers: ``keys``/``values`` ``[B, H, T, D]``, ``scores`` ``[B, H, T]``
(float32, higher = keep) and ``positions`` ``[B, H, T]`` (absolute position of
each slot). Only the first ``_stored`` slots are valid.

The end of prefill is the first single-token call after tokens were seen (what
``mlx_lm.generate_step`` does with the prompt's last token).
"""

from __future__ import annotations

import warnings
from typing import Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from . import attention
from .accounting import CacheAccounting
from .config import KVCacheConfig
from .masks import MaskMismatchError, SharedMaskRecord, fit_mask, is_plain_causal
from .observe import is_observing, shared_softmax_default

CONCENTRATION_ROWS = 8  # query rows per chunk sampled for the concentration signal
GROWTH_STEP = 256  # buffer growth granularity, as mlx-lm's KVCache


class EvictingKVCache(CacheAccounting, _BaseCache):
    """One attention layer's KV cache that keeps at most ``layer_budget`` tokens per head."""

    method = "h2o"
    default_eviction = "continuous"
    score_signal = "cumulative"  # "cumulative" (H2O), "current" (TOVA) or "recency"
    default_selection = "cumulative"  # or "window": pooled scores of the prompt's last queries
    measures_concentration = False

    def __init__(self, config: KVCacheConfig, layer_id: Optional[int] = None):
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config: expected a KVCacheConfig, got {type(config).__name__}")
        self.config = config
        self.layer_id = layer_id
        self.keys = None
        self.values = None
        self.scores = None
        self.positions = None
        self.offset = 0
        self._stored = 0
        self._prefilling = True
        self._scoring: Optional[str] = None
        self._awaiting_observation = False
        self._window_queries = None  # [B, H*R, W, D], the latest queries (or proxy keys)
        self._window_positions = None  # [W]
        self._entropy_sum = None
        self._entropy_rows = 0
        self.attention_scale: Optional[float] = None  # the model's softmax scale, when the builder knows it
        self.shared_mask = SharedMaskRecord()  # shared by a stack from ``KVCacheBuilder.for_model``
        self.scoring_fallback: Optional[str] = None  # why observed scoring fell back to the key proxy
        self._pending_keys = None  # new keys of a call still awaiting its observation
        self._observed_scale: Optional[float] = None
        self._mask_reaches_attention = False  # observed attention got the model's causal array mask
        self._window_from_probs = False  # window attention cannot be recomputed from stored queries
        self._window_probs = None  # [B, H, W, N] the window rows' attention, kept when it cannot

    # ----- the three choices --------------------------------------------------------------

    def _budget_in_force(self) -> int:
        """Tokens per head this layer may keep now."""
        return self.config.resolved_budget or self.config.budget

    @property
    def layer_budget(self) -> int:
        """This layer's budget in force (resolved per layer by ``KVCacheBuilder.for_model``)."""
        return self._budget_in_force()

    @property
    def eviction(self) -> str:
        """``continuous`` or ``prefill_end``."""
        return self.config.eviction or self.default_eviction

    @property
    def prefill_selection(self) -> str:
        """What ranks tokens at the end of prefill: ``cumulative`` or ``window``."""
        return self.config.selection or self.default_selection

    @property
    def _selects_by_window(self) -> bool:
        return self.prefill_selection == "window" and self.eviction == "prefill_end"

    @property
    def scoring(self) -> Optional[str]:
        """``observed`` or ``key_proxy``; decided at the first call when the config leaves it open."""
        return self._scoring or self.config.scoring

    def _on_prefill_end(self) -> None:
        """Hook for policies that learn their budget at the end of prefill."""

    # ----- mlx-lm cache protocol ----------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store this call's keys/values and return the retained ones plus all new ones, new last.

        A multi-token chunk comes back whole and in order after the retained
        tokens; eviction runs after its attention has been scored. A single
        decode token takes the slot of the lowest-scoring token once the
        layer is at budget (decode uses no mask, so slot order is free).
        """
        if self._awaiting_observation:
            self._missed_observation()
        n_new = keys.shape[2]
        if self.keys is None:
            self._start(keys, values)
        if n_new > 1:
            self._check_shared_mask(n_new)
        if keys.dtype != self.keys.dtype or values.dtype != self.values.dtype:
            keys, values = keys.astype(self.keys.dtype), values.astype(self.values.dtype)
        if n_new == 1 and self._prefilling and self.offset > 0:
            self._end_prefill()
        if n_new == 1 and self._evicting_now():
            budget = self._budget_in_force()
            self._evict_to(budget)
            if self._stored == budget:
                self._replace_lowest(keys, values)
            else:
                self._append(keys, values)
        else:
            self._append(keys, values)
        self.offset += n_new
        held = self._held()
        if self.scoring == "observed":
            self._awaiting_observation = True
            self._pending_keys = keys
        else:
            self._score_with_key_proxy(keys, held[0])
            if n_new > 1 and self._evicting_now():
                self._evict_to(self._budget_in_force())
        return held

    def observe_attention(self, queries, keys, values, scale, mask, sinks=None) -> mx.array:
        """Attention for this layer's step with the real queries, scoring tokens on the way.

        Called by ``velox_cache.observe`` in place of the model's attention with
        the arrays ``update_and_fetch`` returned (or keys derived from them, as
        multi-head latent attention does). On the CPU backend the softmax that
        scores tokens is the one that computes the output, so observed scoring
        costs no second softmax. ``sinks`` (per-head logits that take softmax
        mass, as in gpt-oss) count in both. An array mask built for another
        layer's key count is rebuilt for this layer's (``masks.fit_mask``).
        """
        self._awaiting_observation = False
        self._pending_keys = None
        self._observed_scale = scale
        n_queries, n_keys = queries.shape[2], keys.shape[2]
        if isinstance(mask, mx.array):
            self._mask_reaches_attention = is_plain_causal(mask)
            mask = fit_mask(mask, n_queries, n_keys)
        # Keys derived from the stored ones (MLA), an additive mask (position scores) or sinks: the
        # window's attention is kept as computed, since stored queries and keys cannot reproduce it.
        derived = keys.shape[1] != self.keys.shape[1] or keys.shape[-1] != self.keys.shape[-1]
        additive = isinstance(mask, mx.array) and mask.dtype != mx.bool_
        self._window_from_probs = derived or additive or sinks is not None
        rows = self._rows_to_score(n_queries)
        if rows == n_queries and shared_softmax_default():
            probs = attention.attention_probs(queries, keys, scale, mask, sinks=sinks)
            output = attention.attend(probs, values, queries.dtype)
        else:
            output = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
            probs = None
            if rows:
                row_mask = mask[..., -rows:, :] if isinstance(mask, mx.array) else mask
                probs = attention.attention_probs(queries[:, :, -rows:], keys, scale, row_mask, sinks=sinks)
        if probs is not None:
            self._use_probs(probs, n_queries)
        if self._window_from_probs:
            self._remember_window_probs(probs)
        else:
            self._remember_window(queries)
        if n_queries > 1 and self._evicting_now():
            self._evict_to(self._budget_in_force())
        return output

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """The attention mask for ``N`` new tokens over the keys the next call returns."""
        if window_size is not None:
            raise NotImplementedError(
                f"layer {self.layer_id}: {type(self).__name__} does not support sliding-window attention "
                "layers (a model should give them a RotatingKVCache in make_cache)"
            )
        if N == 1:
            return None
        if return_array:
            self.shared_mask.record(self.layer_id, self.offset, N, self._stored + N)
            return create_causal_mask(N, self._stored)
        return "causal"

    @property
    def state(self):
        arrays = [self.keys, self.values, self.scores, self.positions]
        arrays += [self._window_queries, self._window_positions, self._entropy_sum, self._window_probs]
        return [a for a in arrays if a is not None]

    @state.setter
    def state(self, value):
        raise NotImplementedError(f"{type(self).__name__} cannot be restored from a saved state")

    def is_trimmable(self) -> bool:
        """False: trimming cannot bring evicted tokens back."""
        return False

    @classmethod
    def merge(cls, caches):
        raise TypeError(
            f"{cls.__name__} cannot be merged into an mlx-lm batch cache: run one sequence per "
            "cache stack (a batch cache would silently grow without bound)"
        )

    def keys_and_values(self):
        """The held keys and values (``[B, H, kept, D]``), for models that share one layer's KV with others."""
        return self._held()

    def empty(self) -> bool:
        return self.keys is None

    def size(self) -> int:
        return self._stored

    # ----- accounting ---------------------------------------------------------------------

    @property
    def tokens_kept(self) -> int:
        """Tokens currently held per head."""
        return self._stored

    @property
    def concentration(self) -> float:
        """Measured attention concentration over the prompt, 0 (broad) to 1 (one token)."""
        if not self._entropy_rows:
            return 0.0
        return 1.0 - self._entropy_sum.item() / self._entropy_rows

    # ----- mechanics ----------------------------------------------------------------------

    def _start(self, keys: mx.array, values: mx.array) -> None:
        if self.scoring is None:
            self._scoring = "observed" if is_observing() else "key_proxy"
        batch, heads, _, _ = keys.shape
        self.keys = mx.zeros((batch, heads, 0, keys.shape[-1]), self._dtype(keys))
        self.values = mx.zeros((batch, heads, 0, values.shape[-1]), self._dtype(values))
        self.scores = mx.zeros((batch, heads, 0), mx.float32)
        self.positions = mx.zeros((batch, heads, 0), mx.int32)

    def _dtype(self, array: mx.array):
        return getattr(mx, self.config.kv_dtype) if self.config.kv_dtype else array.dtype

    def _evicting_now(self) -> bool:
        return self.eviction == "continuous" or not self._prefilling

    def _held(self):
        if self.keys.shape[2] == self._stored:
            return self.keys, self.values
        return self.keys[:, :, : self._stored], self.values[:, :, : self._stored]

    def _append(self, keys: mx.array, values: mx.array) -> None:
        """Write new tokens after the held ones: in place when the buffer has room, else grow it."""
        batch, heads, n_new, _ = keys.shape
        new_positions = mx.broadcast_to(
            mx.arange(self.offset, self.offset + n_new, dtype=mx.int32), (batch, heads, n_new)
        )
        start, end = self._stored, self._stored + n_new
        if end <= self.keys.shape[2]:
            self.keys[:, :, start:end] = keys
            self.values[:, :, start:end] = values
            self.scores[:, :, start:end] = 0
            self.positions[:, :, start:end] = new_positions
        else:
            spare = self._spare_slots(n_new)
            kept_keys, kept_values = self._held()
            self.keys = self._concat(kept_keys, keys, spare)
            self.values = self._concat(kept_values, values, spare)
            self.scores = self._concat(self.scores[..., :start], mx.zeros((batch, heads, n_new)), spare)
            self.positions = self._concat(self.positions[..., :start], new_positions, spare)
        self._stored = end

    def _spare_slots(self, n_new: int) -> int:
        """Empty slots to add when the buffer grows, so that the next appends write in place."""
        end = self._stored + n_new
        if n_new == 1:  # decoding below budget: room up to the budget
            return max(0, min(self._budget_in_force(), end + GROWTH_STEP) - end)
        if not self._evicting_now():  # a prefill that keeps everything: grow in steps, like KVCache
            return -end % GROWTH_STEP
        return 0  # the chunk is evicted down to budget right after

    @staticmethod
    def _concat(kept, new, spare):
        """``kept`` then ``new`` then ``spare`` empty slots, along the token axis (2)."""
        parts = [kept, new] if kept.shape[2] else [new]
        if spare:
            parts.append(mx.zeros((*new.shape[:2], spare, *new.shape[3:]), new.dtype))
        return mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]

    def _protected_scores(self) -> mx.array:
        """Eviction ranking over the held slots ``[B, H, stored]``; protected tokens rank +inf."""
        stored = self._stored
        positions = self.positions[..., :stored]
        if self.score_signal == "recency":
            scores = positions.astype(mx.float32)
        else:
            scores = self.scores[..., :stored]
        budget = self._budget_in_force()
        recent = min(self.config.recent_window, budget - self.config.n_sink - 1)
        protected = positions < self.config.n_sink
        if recent > 0:
            protected = protected | (positions >= self.offset - recent)
        return mx.where(protected, mx.inf, scores)

    def _evict_to(self, target: int) -> None:
        """Keep the ``target`` best-ranked held tokens of every head, in position order."""
        if self._stored <= target:
            return
        ranking = self._protected_scores()
        keep = mx.argpartition(-ranking, kth=target - 1, axis=-1)[..., :target]
        keep = mx.sort(keep, axis=-1)  # [B, H, target]
        keys, values = self._held()
        self.keys = mx.take_along_axis(keys, keep[..., None], axis=2)
        self.values = mx.take_along_axis(values, keep[..., None], axis=2)
        self.scores = mx.take_along_axis(self.scores[..., : self._stored], keep, axis=-1)
        self.positions = mx.take_along_axis(self.positions[..., : self._stored], keep, axis=-1)
        self._stored = target

    def _replace_lowest(self, keys: mx.array, values: mx.array) -> None:
        """Write one new token into each head's lowest-ranked slot (buffer already at budget)."""
        victim = mx.argmin(self._protected_scores(), axis=-1, keepdims=True)  # [B, H, 1]
        if self.keys.shape[2] != self._stored:
            self.keys, self.values = self._held()
            self.scores = self.scores[..., : self._stored]
            self.positions = self.positions[..., : self._stored]
        slot = victim[..., None]  # [B, H, 1, 1]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(slot, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(slot, values.shape), values, axis=2)
        self.scores = mx.put_along_axis(self.scores, victim, mx.array(0.0), axis=-1)
        self.positions = mx.put_along_axis(self.positions, victim, mx.array(self.offset, mx.int32), axis=-1)

    def _rows_to_score(self, n_queries: int) -> int:
        """How many of this call's last query rows need attention probabilities."""
        rows = self._rows_for_scores(n_queries)
        if self._prefilling and self.measures_concentration:
            rows = max(rows, min(n_queries, CONCENTRATION_ROWS))
        if self._prefilling and self._selects_by_window and self._window_from_probs:
            rows = max(rows, min(n_queries, self.config.window))
        return rows

    def _rows_for_scores(self, n_queries: int) -> int:
        """How many of this call's last query rows feed the token scores."""
        if self.score_signal == "recency":
            return 0
        if self._prefilling and self._selects_by_window:
            return 0  # the window decides at prefill end; earlier chunks need no scores
        return 1 if self.score_signal == "current" else n_queries

    def _score_with_key_proxy(self, new_keys: mx.array, held_keys: mx.array) -> None:
        self._remember_window(new_keys)
        rows = self._rows_to_score(new_keys.shape[2])
        if rows:
            probs = attention.key_proxy_probs(new_keys, held_keys, rows=rows, scale=self.attention_scale)
            self._use_probs(probs, new_keys.shape[2])

    def _missed_observation(self) -> None:
        """The previous call's attention never reached ``observe_attention``: fail clearly or fall back."""
        if not is_observing():
            raise RuntimeError(
                "scoring='observed' but the model is not observed: run it inside "
                "`with velox_cache.observe(model):` or set scoring='key_proxy'"
            )
        self.scoring_fallback = "attention call not observed"
        warnings.warn(
            f"layer {self.layer_id}: its attention did not go through velox_cache.observe (the model "
            "computes attention itself, or with arguments the observer does not handle); this layer "
            "scores tokens with the key proxy from now on",
            RuntimeWarning,
            stacklevel=3,
        )
        self._scoring = "key_proxy"
        self._awaiting_observation = False
        self._window_queries = self._window_positions = self._window_probs = None
        pending, self._pending_keys = self._pending_keys, None
        self._score_with_key_proxy(pending, self._held()[0])
        if pending.shape[2] > 1 and self._evicting_now():
            self._evict_to(self._budget_in_force())

    def _check_shared_mask(self, n_new: int) -> None:
        """Fail clearly when the model's one array mask, built by another layer, will not fit this one."""
        width = self.shared_mask.width_for_call(self.layer_id, self.offset, n_new)
        n_keys = self._stored + n_new
        if width is None or width == n_keys:
            return
        if self.scoring == "observed" and is_observing() and self._mask_reaches_attention:
            return  # observe_attention rebuilds the causal mask for this layer's keys
        raise MaskMismatchError(
            f"layer {self.layer_id}: the model builds one array mask for every layer from layer "
            f"{self.shared_mask.maker}'s cache ({width} keys) but this layer holds {n_keys} after "
            "eviction; per-layer budgets cannot share it. Run this multi-token call inside "
            "`velox_cache.observe(model)` with scoring='observed' (for models that pass the mask to "
            "scaled_dot_product_attention), or use equal budgets (method='h2o'/'snapkv') or one prompt "
            "per cache stack with eviction='prefill_end'"
        )

    def _use_probs(self, probs: mx.array, n_queries: int) -> None:
        """Fold attention probabilities ``[B, H, R, rows, N]`` of the last rows into scores."""
        rows = probs.shape[3]
        if self._prefilling and self.measures_concentration:
            sample = probs[:, :, :, -min(rows, CONCENTRATION_ROWS) :]
            entropy = attention.normalized_entropy(sample)
            self._entropy_sum = entropy if self._entropy_sum is None else self._entropy_sum + entropy
            self._entropy_rows += sample.size // sample.shape[-1]
        scored_rows = self._rows_for_scores(n_queries)
        if not scored_rows:
            return
        mass = self._fold_heads(attention.key_mass(probs[:, :, :, -scored_rows:]))  # [B, H, N]
        pad = self.scores.shape[-1] - mass.shape[-1]
        if pad:
            mass = mx.pad(mass, [(0, 0), (0, 0), (0, pad)])
        if self.score_signal == "current":
            self.scores = mass
        else:
            self.scores = self.scores + mass

    def _fold_heads(self, mass: mx.array) -> mx.array:
        """Sum per-head mass ``[B, H', N]`` onto this cache's heads when attention ran on more (MLA, repeats)."""
        heads = self.keys.shape[1]
        if mass.shape[1] == heads:
            return mass
        return mass.reshape(mass.shape[0], heads, -1, mass.shape[-1]).sum(axis=2)

    def _remember_window_probs(self, probs: Optional[mx.array]) -> None:
        """Keep the attention the prompt's latest ``window`` queries paid ``[B, H, W, N]``, as computed."""
        if not (self._prefilling and self._selects_by_window) or probs is None:
            return
        window = self.config.window
        rows = probs[:, :, :, -window:].sum(axis=2)  # [B, H', rows, N]
        rows = rows.reshape(rows.shape[0], self.keys.shape[1], -1, *rows.shape[2:]).sum(axis=2)  # [B, H, rows, N]
        if self._window_probs is not None and rows.shape[2] < window:
            earlier = self._window_probs  # earlier queries never saw this call's keys: zero mass
            earlier = mx.pad(earlier, [(0, 0), (0, 0), (0, 0), (0, rows.shape[-1] - earlier.shape[-1])])
            rows = mx.concatenate([earlier, rows], axis=2)[:, :, -window:]
        self._window_probs = rows

    def _remember_window(self, queries: mx.array) -> None:
        """Keep the latest ``window`` queries of the prompt for window-based selection."""
        if not (self._prefilling and self._selects_by_window):
            return
        window = self.config.window
        n_new = queries.shape[2]
        first = self.offset - n_new
        positions = mx.arange(first, self.offset, dtype=mx.int32)
        if self._window_queries is None or n_new >= window:
            self._window_queries = queries[:, :, -window:]
            self._window_positions = positions[-window:]
        else:
            self._window_queries = mx.concatenate([self._window_queries, queries], axis=2)[:, :, -window:]
            self._window_positions = mx.concatenate([self._window_positions, positions])[-window:]

    def _window_selection_scores(self) -> mx.array:
        """SnapKV: attention of the prompt's last queries on every held key, max-pooled ``[B, H, N]``."""
        keys, _ = self._held()
        held_positions = self.positions[..., : self._stored]
        visible = held_positions[:, :, None, None, :] <= self._window_positions[None, None, None, :, None]
        scale = self._window_scale(keys.shape[-1])
        probs = attention.attention_probs(self._window_queries, keys, scale, visible)
        return attention.max_pool(attention.key_mass(probs), self.config.kernel)

    def _window_scale(self, dim: int) -> float:
        """The softmax scale of window queries: the one observed, else the model's, else ``dim ** -0.5``."""
        if self.scoring == "observed" and self._observed_scale is not None:
            return self._observed_scale
        return self.attention_scale if self.attention_scale is not None else dim**-0.5

    def _end_prefill(self) -> None:
        self._prefilling = False
        self._on_prefill_end()
        scores = None
        if self._selects_by_window and self._window_probs is not None:
            scores = attention.max_pool(self._window_probs.sum(axis=2), self.config.kernel)
        elif self._selects_by_window and self._window_queries is not None:
            scores = self._window_selection_scores()  # [B, H, stored]
        if scores is not None:
            self.scores = mx.pad(scores, [(0, 0), (0, 0), (0, self.keys.shape[2] - self._stored)])
        self._window_queries = self._window_positions = self._window_probs = None
        self._evict_to(self._budget_in_force())
