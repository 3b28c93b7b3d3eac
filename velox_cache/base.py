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

from typing import Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from . import attention
from .accounting import CacheAccounting
from .attend import AttentionResult, attend_and_score
from .config import KVCacheConfig
from .observe import is_observing

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
            raise RuntimeError(
                "scoring='observed' but the model is not observed: run it inside "
                "`with velox_cache.observe(model):` or set scoring='key_proxy'"
            )
        n_new = keys.shape[2]
        if self.keys is None:
            self._start(keys, values)
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
        else:
            self._score_with_key_proxy(keys, held[0])
            if n_new > 1 and self._evicting_now():
                self._evict_to(self._budget_in_force())
        return held

    def observe_attention(self, queries, keys, values, scale, mask) -> mx.array:
        """Attention for this layer's step with the real queries, scoring tokens on the way.

        Called by ``velox_cache.observe`` (and ``fast_attention``) in place of
        the model's attention with the arrays ``update_and_fetch`` returned.
        With observed scoring, the scores come from the same pass as the
        output (``attend_and_score``); otherwise this is plain attention.
        """
        if self.scoring != "observed":
            return attend_and_score(queries, keys, values, scale=scale, mask=mask).output
        self._awaiting_observation = False
        n_queries = queries.shape[2]
        result = attend_and_score(
            queries,
            keys,
            values,
            scale=scale,
            mask=mask,
            score_rows=self._rows_for_scores(n_queries),
            entropy_rows=self._rows_for_concentration(n_queries),
        )
        self._use_scores(result)
        self._remember_window(queries)
        if n_queries > 1 and self._evicting_now():
            self._evict_to(self._budget_in_force())
        return result.output

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """The attention mask for ``N`` new tokens over the keys the next call returns."""
        if window_size is not None:
            raise NotImplementedError(
                f"{type(self).__name__} does not support sliding-window attention layers"
            )
        if N == 1:
            return None
        if return_array:
            return create_causal_mask(N, self._stored)
        return "causal"

    @property
    def state(self):
        arrays = [self.keys, self.values, self.scores, self.positions]
        arrays += [self._window_queries, self._window_positions, self._entropy_sum]
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

    def _rows_for_concentration(self, n_queries: int) -> int:
        """How many of this call's last query rows sample the concentration signal."""
        if self._prefilling and self.measures_concentration:
            return min(n_queries, CONCENTRATION_ROWS)
        return 0

    def _rows_for_scores(self, n_queries: int) -> int:
        """How many of this call's last query rows feed the token scores."""
        if self.score_signal == "recency":
            return 0
        if self._prefilling and self._selects_by_window:
            return 0  # the window decides at prefill end; earlier chunks need no scores
        return 1 if self.score_signal == "current" else n_queries

    def _score_with_key_proxy(self, new_keys: mx.array, held_keys: mx.array) -> None:
        """Score by each new key standing in for its query (no queries needed)."""
        self._remember_window(new_keys)
        n_new = new_keys.shape[2]
        score_rows, entropy_rows = self._rows_for_scores(n_new), self._rows_for_concentration(n_new)
        rows = max(score_rows, entropy_rows)
        if rows:
            proxies = new_keys[:, :, -rows:]
            result = attend_and_score(
                proxies,
                held_keys,
                None,
                scale=new_keys.shape[-1] ** -0.5,
                mask="causal" if rows > 1 else None,
                score_rows=score_rows,
                entropy_rows=entropy_rows,
            )
            self._use_scores(result)

    def _use_scores(self, result: AttentionResult) -> None:
        """Fold one call's key mass into the scores and its sampled entropy into the concentration."""
        if result.entropy is not None:
            self._entropy_sum = result.entropy if self._entropy_sum is None else self._entropy_sum + result.entropy
            self._entropy_rows += result.entropy_rows
        if result.key_mass is None:
            return
        mass = result.key_mass  # [B, H, N]
        pad = self.scores.shape[-1] - mass.shape[-1]
        if pad:
            mass = mx.pad(mass, [(0, 0), (0, 0), (0, pad)])
        if self.score_signal == "current":
            self.scores = mass
        else:
            self.scores = self.scores + mass

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
        scale = keys.shape[-1] ** -0.5
        probs = attention.attention_probs(self._window_queries, keys, scale, visible)
        return attention.max_pool(attention.key_mass(probs), self.config.kernel)

    def _end_prefill(self) -> None:
        self._prefilling = False
        self._on_prefill_end()
        if self._selects_by_window and self._window_queries is not None:
            scores = self._window_selection_scores()  # [B, H, stored]
            self.scores = mx.pad(scores, [(0, 0), (0, 0), (0, self.keys.shape[2] - self._stored)])
        self._window_queries = self._window_positions = None
        self._evict_to(self._budget_in_force())
