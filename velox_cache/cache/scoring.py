"""``LayerScoring``: how an evicting cache turns a call's attention into token scores.

Two scorings (ARCHITECTURE.md, "Scoring signals"):

- ``observed``: ``velox_cache.observe`` routes the model's attention to
  ``observe_attention`` with the real queries; the scores come from the same
  pass as the output (``attend_and_score``). A call whose attention never
  arrives is noticed at the next call: a clear error outside any routing
  context, otherwise a warning and the key proxy for that layer from then on.
- ``key_proxy``: each new key stands in for its query
  (``signals.key_proxy_attention``); works everywhere, weaker.

Either way the result feeds the policy's signal (``signal.fold``), the
allocator's measure (``allocation.observe``), a probe's ranking, or the
window the selector remembers. This is a mixin of ``EvictingKVCache``: it
works on the cache's ``slots``, ``progress``, ``timing``, ``selector`` and
``allocation``.
"""

from __future__ import annotations

import warnings
from typing import Optional

import mlx.core as mx

from ..kernels.attend import AttentionResult
from ..kernels.attention import key_peak
from ..kernels.masks import MaskMismatchError, fit_mask, is_plain_causal
from ..kernels.observe import is_observing, is_routed
from .phases import PROBE
from .signals import fold_heads, key_proxy_attention


class LayerScoring:
    """Scoring state and steps of one layer (mixed into ``EvictingKVCache``)."""

    def __init__(self):
        self._scoring: Optional[str] = None
        self.attention_scale: Optional[float] = None  # the model's softmax scale, when the builder knows it
        self.scoring_fallback: Optional[str] = None  # why observed scoring fell back to the key proxy
        self._awaiting_observation = False
        self._pending_keys = None  # new keys of a call still awaiting its observation
        self._observed_scale: Optional[float] = None
        self._mask_reaches_attention = False  # the model's causal array mask reached Velox's attention

    def adopt_scoring(self, source: "LayerScoring") -> None:
        """Score as ``source`` decided to (another layer reading the same prompt), its last call observed."""
        if source.awaiting_observation:
            raise RuntimeError(f"layer {source.layer_id}: its last call is still waiting for its attention")
        self._scoring, self.scoring_fallback = source._scoring, source.scoring_fallback
        self._observed_scale, self._mask_reaches_attention = source._observed_scale, source._mask_reaches_attention

    @property
    def awaiting_observation(self) -> bool:
        """True between a call under observed scoring and its attention reaching ``observe_attention``."""
        return self._awaiting_observation

    @property
    def scoring(self) -> Optional[str]:
        """``observed`` or ``key_proxy``; decided at the first call when the config leaves it open."""
        return self._scoring or self.config.scoring

    def observe_attention(self, queries, keys, values, scale, mask, sinks=None) -> mx.array:
        """Attention for this layer's step with the real queries, scoring tokens on the way.

        Called by ``velox_cache.observe`` (and ``fast_attention``) in place of
        the model's attention with the arrays ``update_and_fetch`` returned
        (or keys derived from them, as multi-head latent attention does).
        With observed scoring, the scores come from the same pass as the
        output (``attend_and_score``, through ``slots.attend``, which knows
        how the held heads are laid out); otherwise this is plain attention.
        ``sinks`` (per-head logits that take softmax mass, as in gpt-oss)
        count in both. An array mask built for another layer's key count is
        rebuilt for this layer's (``masks.fit_mask``).
        """
        n_queries = queries.shape[2]
        if isinstance(mask, mx.array):
            self._mask_reaches_attention = is_plain_causal(mask)
            mask = fit_mask(mask, n_queries, keys.shape[2])
        if self.scoring != "observed":
            return self.slots.attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks).output
        self._forget_pending_observation()
        self._observed_scale = scale
        result = self.slots.attend(
            queries,
            keys,
            values,
            scale=scale,
            mask=mask,
            sinks=sinks,
            score_rows=self._rows_for_scores(n_queries),
            entropy_rows=self._rows_for_concentration(n_queries),
        )
        self._use_scores(result)
        if self.progress.reconstructing and self.reconstructs:
            self._remember_peak(queries, keys, scale, mask, sinks)
        # Keys derived from the stored ones (MLA), an additive mask (position scores) or sinks: the
        # remembered queries and the held keys cannot reproduce the window's attention, so keep it as computed.
        derived = keys.shape[1] != self.slots.keys.shape[1] or keys.shape[-1] != self.slots.keys.shape[-1]
        additive = isinstance(mask, mx.array) and mask.dtype != mx.bool_
        if derived or additive or sinks is not None:
            rows = self._window_rows(n_queries)
            if rows == n_queries:
                self.selector.remember_attention(queries, keys, scale, mask, sinks, self.slots.keys.shape[1])
            elif rows:  # a look-ahead call's first rows: its drafted tokens are single calls, mask-free
                self.selector.remember_attention(queries[:, :, :rows], keys, scale, None, sinks, self.slots.keys.shape[1])
        else:
            self._remember_window(queries)
        if n_queries > 1 and self._evicting_now():
            self._evict_to(self.allocation.budget())
        return result.output

    # ----- steps called by the cache ------------------------------------------------------

    def _start(self, keys: mx.array, values: mx.array) -> None:
        if self.scoring is None:
            self._scoring = "observed" if is_observing() else "key_proxy"
        stored_as = getattr(mx, self.config.kv_dtype) if self.config.kv_dtype else None
        self.slots.start(keys, values, stored_as or keys.dtype, stored_as or values.dtype)

    def _score_call(self, new_keys: mx.array, held_keys: mx.array) -> None:
        """After a call appended ``new_keys``: await its observation, or score it by the key proxy now."""
        if self.scoring == "observed":
            self._awaiting_observation = True
            self._pending_keys = new_keys
            return
        self._score_with_key_proxy(new_keys, held_keys)
        if new_keys.shape[2] > 1 and self._evicting_now():
            self._evict_to(self.allocation.budget())

    def _check_last_observation(self) -> None:
        """The previous call's attention never reached ``observe_attention``: fail clearly or fall back."""
        if not self._awaiting_observation:
            return
        if not is_routed():
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
        pending = self._pending_keys
        self._forget_pending_observation()
        self.selector.clear()
        self._score_call(pending, self.slots.held()[0])

    def _forget_pending_observation(self) -> None:
        self._awaiting_observation = False
        self._pending_keys = None

    def _check_shared_mask(self, n_new: int) -> None:
        """Fail clearly when the model's one array mask, built by another layer, will not fit this one."""
        width = self.shared_mask.width_for_call(self.layer_id, self.offset, n_new)
        n_keys = self.slots.stored + n_new
        if width is None or width == n_keys:
            return
        if is_routed() and self._mask_reaches_attention:
            return  # observe_attention rebuilds the causal mask for this layer's keys
        raise MaskMismatchError(
            f"layer {self.layer_id}: the model builds one array mask for every layer from layer "
            f"{self.shared_mask.maker}'s cache ({width} keys) but this layer holds {n_keys} after "
            "eviction; per-layer budgets cannot share it. Run this multi-token call inside "
            "`velox_cache.observe(model)` or `velox_cache.fast_attention(model)` (for models that pass "
            "the mask to scaled_dot_product_attention), or use equal budgets (method='h2o'/'snapkv') "
            "or one prompt per cache stack with eviction='prefill_end'"
        )

    # ----- what a call's attention feeds --------------------------------------------------

    @property
    def scores_while_reading(self) -> bool:
        """True when this cache's prefill chunks score their rows (cumulative mass, the allocator's measure),
        not only the window that ranks when prefill ends."""
        by_mass = bool(self.signal.rows(2)) and not (self.timing.ranks_by_window and not self.mass_weight)
        return by_mass or self.allocation.concentration_rows(2) > 0

    def _rows_for_concentration(self, n_queries: int) -> int:
        """How many of this call's last query rows sample the allocator's measure (squeeze)."""
        return self.allocation.concentration_rows(n_queries) if self.progress.in_prefill_chunk else 0

    def _rows_for_scores(self, n_queries: int) -> int:
        """How many of this call's last query rows feed the token scores."""
        if self.progress.in_probe:
            return n_queries if self.timing.uses_probes and self.progress.probe_kind == PROBE else 0
        rows = self.signal.rows(n_queries)
        if rows and self.progress.prefilling and self.timing.ranks_by_window and not self.mass_weight:
            return 0  # the window (or a probe) decides; prefill chunks need no scores
        return rows

    def _score_with_key_proxy(self, new_keys: mx.array, held_keys: mx.array) -> None:
        """Score by each new key standing in for its query (no queries needed)."""
        self._remember_window(new_keys)
        if self.progress.reconstructing and self.reconstructs:
            scale = self.attention_scale if self.attention_scale is not None else new_keys.shape[-1] ** -0.5
            self._remember_peak(new_keys, held_keys, scale, "causal" if new_keys.shape[2] > 1 else None)
        n_new = new_keys.shape[2]
        result = key_proxy_attention(
            new_keys,
            held_keys,
            scale=self.attention_scale,
            score_rows=self._rows_for_scores(n_new),
            entropy_rows=self._rows_for_concentration(n_new),
        )
        if result is not None:
            self._use_scores(result)

    def _remember_peak(self, queries, keys, scale, mask, sinks=None) -> None:
        """A reconstruction call: the largest attention its queries paid each prompt token (KVzip), kept as a running max."""
        peak = key_peak(queries, keys, scale, mask, sinks)[..., : self.progress.probe.stored]
        self.selector.remember_peak(fold_heads(peak, self.slots.keys.shape[1]))
        mx.eval(self.selector.peak)

    def _use_scores(self, result: AttentionResult) -> None:
        """Fold one call's key mass ``[B, H, N]`` into the scores (or, in a probe, into its ranking)."""
        progress = self.progress
        if progress.in_prefill_chunk:
            self.allocation.observe(result)
        if result.key_mass is None:
            return
        key_mass = fold_heads(result.key_mass, self.slots.keys.shape[1])
        if progress.in_probe:
            if self.timing.uses_probes:
                progress.probe_scores = self.selector.probe_scores(key_mass, progress.probe.stored, self.slots)
            return
        self.signal.fold(self.slots, key_mass)
        if progress.prefilling:
            # Evaluate now, without waiting: otherwise every layer's attention blocks stay
            # alive until the chunk is evaluated, only to be summed into these scores (waiting
            # here would stall the next layer's graph behind this one's: ~7% of a squeeze prefill).
            mx.async_eval(self.slots.scores)

    def _window_rows(self, n_queries: int) -> int:
        """How many of a call's ``n_queries`` (its first ones) the window remembers.

        Every one of a prompt call's (the window keeps the latest); of a look-ahead's,
        those among the first ``lookahead`` drafted tokens (a shared reading
        drafts as many as its most demanding config asks for); none otherwise.
        """
        progress = self.progress
        if not self.timing.ranks_by_window:
            return 0
        if progress.looking_ahead:
            drafted_before = self.offset - n_queries - progress.probe.offset
            return max(0, min(n_queries, self.lookahead - drafted_before))
        return n_queries if progress.in_prefill_chunk else 0

    def _remember_window(self, queries: mx.array) -> None:
        """Keep the latest ``window`` queries of the prompt (and a look-ahead's drafted ones) for window-based selection."""
        rows = self._window_rows(queries.shape[2])
        if rows:
            self.selector.remember(queries[:, :, :rows], self.offset - queries.shape[2])

    def _window_scale(self) -> Optional[float]:
        """The window queries' softmax scale: the one observed, else the model's (None: ``D ** -0.5``)."""
        if self.scoring == "observed" and self._observed_scale is not None:
            return self._observed_scale
        return self.attention_scale
