"""``EvictingKVCache``: one layer's budgeted cache, composed from the design's seams.

A policy is three independent choices (ARCHITECTURE.md): how many tokens a
layer keeps (``_budget_in_force``), when eviction happens (``timing``:
``velox_cache.timing``) and which signal ranks tokens (``signal``:
``velox_cache.signals``; at prefill end and in streaming prefill a
``WindowSelector`` from ``velox_cache.selection``). The held arrays live in
``TokenSlots`` (``velox_cache.slots``). This class runs mlx-lm's cache
protocol on top of them.

Prefill phases (``velox_cache.phases``) are told by the caller; a cache that
is never told one infers the end of prefill from the first single-token call
after tokens were seen (what ``mlx_lm.generate_step`` does with the prompt's
last token).

``offset`` is the position the next token gets. It is the number of tokens
seen, except after ``compact_positions``: then the held keys were re-rotated
to positions ``0 .. held - 1`` and ``offset`` counts from there. ``tokens_seen``
always counts every token passed in (probes excepted).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from . import attention
from .accounting import CacheAccounting
from .attend import AttentionResult, attend_and_score
from .config import ConfigError, KVCacheConfig
from .masks import MaskMismatchError, SharedMaskRecord, fit_mask, is_plain_causal
from .observe import is_observing, is_routed
from .phases import Phase
from .selection import WindowSelector
from .signals import CumulativeMass
from .slots import TokenSlots
from .timing import make_timing

GROWTH_STEP = 256  # buffer growth granularity, as mlx-lm's KVCache


@dataclass(frozen=True)
class _ProbeMark:
    """What a probe must give back: slots, buffer size, offset and tokens seen before it ran."""

    stored: int
    capacity: int
    offset: int
    tokens_seen: int


class EvictingKVCache(CacheAccounting, _BaseCache):
    """One attention layer's KV cache that keeps at most ``layer_budget`` tokens per head."""

    method = "h2o"
    default_eviction = "continuous"
    signal = CumulativeMass  # a class from velox_cache.signals
    default_selection = "cumulative"  # or "window": pooled scores of the prompt's last queries
    default_mass_weight = 0.0  # share of cumulative mass blended into a window's or probe's ranking

    def __init__(self, config: KVCacheConfig, layer_id: Optional[int] = None):
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config: expected a KVCacheConfig, got {type(config).__name__}")
        if config.budget_fraction is not None:
            raise ConfigError(
                f"budget: {config.budget!r} is a share of the prompt; resolve it first "
                "(KVCacheBuilder.for_model(..., prompt_tokens=N) or config.resolved_for(N))"
            )
        self.config = config
        self.layer_id = layer_id
        self.slots = TokenSlots()
        self.timing = make_timing(self.eviction, self.prefill_selection)
        self.selector = WindowSelector(config.window, config.kernel)
        self.offset = 0
        self._tokens_seen = 0  # per head, probes excepted
        self._prefilling = True
        self._phase: Optional[Phase] = None  # None: never told (the end of prefill is inferred)
        self._probe: Optional[_ProbeMark] = None
        self._probe_scores: Optional[mx.array] = None  # [B, H, held before the probe]
        self._pending = False  # streaming: the last chunk still awaits its selection
        self._scoring: Optional[str] = None
        self._awaiting_observation = False
        self.attention_scale: Optional[float] = None  # the model's softmax scale, when the builder knows it
        self.shared_mask = SharedMaskRecord()  # shared by a stack from ``KVCacheBuilder.for_model``
        self.scoring_fallback: Optional[str] = None  # why observed scoring fell back to the key proxy
        self._pending_keys = None  # new keys of a call still awaiting its observation
        self._observed_scale: Optional[float] = None
        self._mask_reaches_attention = False  # the model's causal array mask reached Velox's attention

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
        """``continuous``, ``prefill_end`` or ``streaming``."""
        return self.config.eviction or self.default_eviction

    @property
    def prefill_selection(self) -> str:
        """What ranks tokens at the end of prefill: ``cumulative`` or ``window``."""
        if self.config.selection:
            return self.config.selection
        return "window" if self.eviction == "streaming" else self.default_selection

    @property
    def mass_weight(self) -> float:
        """Share of cumulative mass blended into a window's or probe's ranking (``config.mass_weight``)."""
        return self.default_mass_weight if self.config.mass_weight is None else self.config.mass_weight

    @property
    def score_signal(self) -> str:
        """The ranking signal's name: ``cumulative`` (H2O), ``current`` (TOVA) or ``recency``."""
        return self.signal.name

    @property
    def scoring(self) -> Optional[str]:
        """``observed`` or ``key_proxy``; decided at the first call when the config leaves it open."""
        return self._scoring or self.config.scoring

    @property
    def uses_probes(self) -> bool:
        """True under the streaming timing: a probe's attention ranks the held tokens."""
        return self.timing.uses_probes

    # ----- policy hooks -------------------------------------------------------------------

    def _on_prefill_end(self) -> None:
        """Hook for policies that learn their budget at the end of prefill."""

    def _before_selection(self) -> None:
        """Hook run before a selection during prefill (streaming) evicts to budget."""

    def _observe_entropy(self, result: AttentionResult) -> None:
        """Hook: the sampled entropy of a call's last ``_rows_for_concentration`` rows (``result.entropy``)."""

    def _extra_state(self) -> list:
        """Arrays a policy keeps beyond the slots (evaluated with ``state``)."""
        return []

    # ----- phases -------------------------------------------------------------------------

    @property
    def phase(self) -> Optional[Phase]:
        """The phase told last (``PROBE`` while one runs); None when never told."""
        return Phase.PROBE if self._probe is not None else self._phase

    @property
    def in_document_phase(self) -> bool:
        """A document chunk (or, never told, any prefill call)."""
        return self._probe is None and self._phase in (None, Phase.DOCUMENT)

    def begin_phase(self, phase) -> None:
        """The next calls belong to ``phase`` (a ``velox_cache.phases.Phase`` or its name).

        ``decode`` ends prefill (prefill-end policies compress now). A probe
        ends with ``end_probe`` (or when another phase is told).
        """
        phase = Phase.parse(phase)
        if self._probe is not None and phase is not Phase.PROBE:
            self.end_probe()
        if phase is Phase.PROBE:
            self._begin_probe()
            if self._phase is None:
                self._phase = Phase.DOCUMENT
            return
        if phase is Phase.DECODE:
            if self._prefilling:
                self._end_prefill()
        elif not self._prefilling:
            raise ValueError(f"phase: {phase.value!r} after decoding started; build a fresh cache stack per sequence")
        self._phase = phase

    def _begin_probe(self) -> None:
        if not self._prefilling:
            raise ValueError("phase: a probe runs during prefill, not after decoding started")
        if self._probe is not None:
            raise ValueError("phase: a probe is already running; end it first")
        self._probe = _ProbeMark(self.slots.stored, self.slots.capacity, self.offset, self._tokens_seen)
        self._probe_scores = None

    def end_probe(self) -> None:
        """Drop the probe's keys and values (offset and accounting as before it).

        Under the streaming timing the held tokens are first ranked by the
        probe's attention and evicted to budget.
        """
        mark = self._probe
        if mark is None:
            return
        self._probe = None
        self._awaiting_observation = False
        self._pending_keys = None
        if not self.slots.empty:
            self.slots.truncate(mark.stored, mark.capacity)
        self.offset, self._tokens_seen = mark.offset, mark.tokens_seen
        scores, self._probe_scores = self._probe_scores, None
        if scores is not None and self.timing.uses_probes:
            self._pending = False
            self._before_selection()
            self.slots.set_scores(self._blend_with_mass(scores))
            self._evict_to(self._budget_in_force())

    def mark_pending(self) -> None:
        """Streaming: the chunk just appended is to be ranked before the next one (unless a probe does it)."""
        self._pending = True

    def select_pending(self) -> None:
        """Streaming: rank the held tokens by the last chunk's own last queries and evict to budget."""
        if not self._pending:
            return
        self._pending = False
        if not self.selector.ready:
            return
        self._before_selection()
        self._select_by_window()
        self._evict_to(self._budget_in_force())

    def compact_positions(self, shift) -> None:
        """Re-rotate the held keys to positions ``0 .. held - 1`` (``shift``: a ``velox_cache.rope.RotaryShift``).

        Afterwards ``offset`` is the number held: the next token sits right
        after the kept ones, so a document longer than the model's context can
        be read. Order is kept; relative distances between kept tokens shrink.
        """
        if self.slots.empty:
            return
        if self._probe is not None:
            raise ValueError("compact_positions: not while a probe runs")
        self.select_pending()
        self.selector.clear()  # remembered query positions are from before the move
        positions = self.slots.held_positions()
        rank = mx.argsort(mx.argsort(positions, axis=-1), axis=-1).astype(mx.int32)  # [B, H, held]
        self.slots.rerotate(shift, rank)
        self.offset = self.slots.stored

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
        if self.slots.empty:
            self._start(keys, values)
        if n_new > 1:
            self._check_shared_mask(n_new)
        if keys.dtype != self.slots.keys.dtype or values.dtype != self.slots.values.dtype:
            keys, values = keys.astype(self.slots.keys.dtype), values.astype(self.slots.values.dtype)
        if n_new == 1 and self._prefilling and self.offset > 0 and self._phase is None:
            self._end_prefill()  # never told: the prompt's last token, as mlx_lm.generate feeds it
        chunk = self._prefilling and self._probe is None
        if chunk:
            self.timing.before_chunk(self)
        if n_new == 1 and self._evicting_now():
            budget = self._budget_in_force()
            self._evict_to(budget)
            if self.slots.stored == budget:
                self._replace_lowest(keys, values)
            else:
                self._append(keys, values)
        else:
            self._append(keys, values)
        self.offset += n_new
        if self._probe is None:
            self._tokens_seen += n_new
        held = self.slots.held()
        if self.scoring == "observed":
            self._awaiting_observation = True
            self._pending_keys = keys
        else:
            self._score_with_key_proxy(keys, held[0])
            if n_new > 1 and self._evicting_now():
                self._evict_to(self._budget_in_force())
        if chunk:
            self.timing.after_chunk(self)
        return held

    def observe_attention(self, queries, keys, values, scale, mask, sinks=None) -> mx.array:
        """Attention for this layer's step with the real queries, scoring tokens on the way.

        Called by ``velox_cache.observe`` (and ``fast_attention``) in place of
        the model's attention with the arrays ``update_and_fetch`` returned
        (or keys derived from them, as multi-head latent attention does).
        With observed scoring, the scores come from the same pass as the
        output (``attend_and_score``); otherwise this is plain attention.
        ``sinks`` (per-head logits that take softmax mass, as in gpt-oss)
        count in both. An array mask built for another layer's key count is
        rebuilt for this layer's (``masks.fit_mask``).
        """
        n_queries, n_keys = queries.shape[2], keys.shape[2]
        if isinstance(mask, mx.array):
            self._mask_reaches_attention = is_plain_causal(mask)
            mask = fit_mask(mask, n_queries, n_keys)
        if self.scoring != "observed":
            return attend_and_score(queries, keys, values, scale=scale, mask=mask, sinks=sinks).output
        self._awaiting_observation = False
        self._pending_keys = None
        self._observed_scale = scale
        result = attend_and_score(
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
        # Keys derived from the stored ones (MLA), an additive mask (position scores) or sinks: the
        # remembered queries and the held keys cannot reproduce the window's attention, so keep it as computed.
        derived = keys.shape[1] != self.slots.keys.shape[1] or keys.shape[-1] != self.slots.keys.shape[-1]
        additive = isinstance(mask, mx.array) and mask.dtype != mx.bool_
        if derived or additive or sinks is not None:
            self._remember_window_mass(queries, keys, scale, mask, sinks)
        else:
            self._remember_window(queries)
        if n_queries > 1 and self._evicting_now():
            self._evict_to(self._budget_in_force())
        return result.output

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
            self.shared_mask.record(self.layer_id, self.offset, N, self.slots.stored + N)
            return create_causal_mask(N, self.slots.stored)
        return "causal"

    @property
    def state(self):
        arrays = self.slots.arrays + self.selector.arrays + self._extra_state()
        if self._probe_scores is not None:
            arrays.append(self._probe_scores)
        return arrays

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
        return self.slots.held()

    def empty(self) -> bool:
        return self.slots.empty

    def size(self) -> int:
        return self.slots.stored

    # ----- the held arrays ----------------------------------------------------------------

    @property
    def keys(self) -> Optional[mx.array]:
        """Key buffer ``[B, H, T, D]`` (the first ``tokens_kept`` slots are valid)."""
        return self.slots.keys

    @property
    def values(self) -> Optional[mx.array]:
        return self.slots.values

    @property
    def scores(self) -> Optional[mx.array]:
        """Ranking scores ``[B, H, T]`` (higher = keep)."""
        return self.slots.scores

    @property
    def positions(self) -> Optional[mx.array]:
        """The position each slot's key is rotated at ``[B, H, T]``."""
        return self.slots.positions

    # ----- accounting ---------------------------------------------------------------------

    @property
    def tokens_kept(self) -> int:
        """Tokens currently held per head."""
        return self.slots.stored

    @property
    def seen_per_head(self) -> int:
        """Tokens passed to ``update_and_fetch`` per head (probes excepted; not reset by compaction)."""
        return self._tokens_seen

    @property
    def concentration(self) -> float:
        """Measured attention concentration, 0 (broad) to 1 (one token); 0 for policies that do not measure it."""
        return 0.0

    # ----- mechanics ----------------------------------------------------------------------

    def _start(self, keys: mx.array, values: mx.array) -> None:
        if self.scoring is None:
            self._scoring = "observed" if is_observing() else "key_proxy"
        self.slots.start(keys, values, self._dtype(keys), self._dtype(values))

    def _dtype(self, array: mx.array):
        return getattr(mx, self.config.kv_dtype) if self.config.kv_dtype else array.dtype

    def _evicting_now(self) -> bool:
        if self._probe is not None:
            return False
        return self.timing.evicts_during_prefill or not self._prefilling

    def _append(self, keys: mx.array, values: mx.array) -> None:
        self.slots.append(keys, values, self.offset, self._spare_slots(keys.shape[2]))

    def _spare_slots(self, n_new: int) -> int:
        """Empty slots to add when the buffer grows, so that the next appends write in place."""
        end = self.slots.stored + n_new
        if n_new == 1:  # decoding below budget: room up to the budget
            return max(0, min(self._budget_in_force(), end + GROWTH_STEP) - end)
        if self.timing.keeps_prefill and not self._evicting_now():  # keeps everything: grow in steps, like KVCache
            return -end % GROWTH_STEP
        return 0  # evicted down to budget soon after

    def _protected_scores(self) -> mx.array:
        """Eviction ranking over the held slots ``[B, H, stored]``; protected tokens rank +inf."""
        positions = self.slots.held_positions()
        scores = self.signal.ranking(self.slots)
        budget = self._budget_in_force()
        recent = min(self.config.recent_window, budget - self.config.n_sink - 1)
        protected = positions < self.config.n_sink
        if recent > 0:
            protected = protected | (positions >= self.offset - recent)
        return mx.where(protected, mx.inf, scores)

    def _evict_to(self, target: int) -> None:
        """Keep the ``target`` best-ranked held tokens of every head, in slot order."""
        if self.slots.stored <= target:
            return
        ranking = self._protected_scores()
        keep = mx.sort(mx.argpartition(-ranking, kth=target - 1, axis=-1)[..., :target], axis=-1)  # [B, H, target]
        self.selector.keep(keep, self.slots.stored)
        self.slots.keep(keep)

    def _replace_lowest(self, keys: mx.array, values: mx.array) -> None:
        """Write one new token into each head's lowest-ranked slot (buffer already at budget)."""
        victim = mx.argmin(self._protected_scores(), axis=-1, keepdims=True)  # [B, H, 1]
        self.slots.replace(victim, keys, values, self.offset)

    def _rows_for_concentration(self, n_queries: int) -> int:
        """How many of this call's last query rows sample a policy's concentration measure (squeeze)."""
        return 0

    def _rows_for_scores(self, n_queries: int) -> int:
        """How many of this call's last query rows feed the token scores."""
        if self._probe is not None:
            return n_queries if self.timing.uses_probes else 0
        rows = self.signal.rows(n_queries)
        if rows and self._prefilling and self.timing.selects_by_window and not self.mass_weight:
            return 0  # the window (or a probe) decides; prefill chunks need no scores
        return rows

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
                scale=self.attention_scale if self.attention_scale is not None else new_keys.shape[-1] ** -0.5,
                mask="causal" if rows > 1 else None,
                score_rows=score_rows,
                entropy_rows=entropy_rows,
            )
            self._use_scores(result)

    def _missed_observation(self) -> None:
        """The previous call's attention never reached ``observe_attention``: fail clearly or fall back."""
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
        self._awaiting_observation = False
        self.selector.clear()
        pending, self._pending_keys = self._pending_keys, None
        self._score_with_key_proxy(pending, self.slots.held()[0])
        if pending.shape[2] > 1 and self._evicting_now():
            self._evict_to(self._budget_in_force())

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

    def _use_scores(self, result: AttentionResult) -> None:
        """Fold one call's key mass ``[B, H, N]`` into the scores (or, in a probe, into its ranking)."""
        self._observe_entropy(result)
        if result.key_mass is None:
            return
        key_mass = self._fold_heads(result.key_mass)
        if self._probe is not None:
            if self.timing.uses_probes:
                self._probe_scores = self.selector.probe_scores(key_mass, self._probe.stored)
            return
        self.signal.fold(self.slots, key_mass)
        if self._prefilling:
            # Evaluate now: otherwise every layer's attention blocks stay alive until the
            # chunk is evaluated, only to be summed into these scores.
            mx.eval(self.slots.scores)

    def _fold_heads(self, mass: mx.array) -> mx.array:
        """Sum per-head mass ``[B, H', ...]`` onto this cache's heads when attention ran on more (MLA, repeats)."""
        heads = self.slots.keys.shape[1]
        if mass.shape[1] == heads:
            return mass
        return mass.reshape(mass.shape[0], heads, -1, *mass.shape[2:]).sum(axis=2)

    def _remembers_window(self) -> bool:
        return self._probe is None and self._prefilling and self.timing.selects_by_window

    def _remember_window(self, queries: mx.array) -> None:
        """Keep the latest ``window`` queries of the prompt for window-based selection."""
        if self._remembers_window():
            self.selector.remember(queries, self.offset - queries.shape[2])

    def _remember_window_mass(self, queries, keys, scale, mask, sinks) -> None:
        """Keep the attention the call's last ``window`` queries paid each key, as computed ``[B, H, W, N]``."""
        if not self._remembers_window():
            return
        rows = min(self.selector.window, queries.shape[2])
        row_mask = mask
        if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] > 1:
            row_mask = mask[..., -rows:, :]
        probs = attention.attention_probs(queries[:, :, -rows:], keys, scale, row_mask, sinks)  # [B, H', R, rows, N]
        self.selector.remember_mass(self._fold_heads(probs.sum(axis=2)))

    def _window_scale(self) -> Optional[float]:
        """The window queries' softmax scale: the one observed, else the model's (None: ``D ** -0.5``)."""
        if self.scoring == "observed" and self._observed_scale is not None:
            return self._observed_scale
        return self.attention_scale

    def _select_by_window(self) -> None:
        """Replace the held slots' scores by the window's pooled attention (SnapKV)."""
        keys, _ = self.slots.held()
        scores = self.selector.scores(keys, self.slots.held_positions(), scale=self._window_scale())
        self.slots.set_scores(self._blend_with_mass(scores))

    def _blend_with_mass(self, ranking: mx.array) -> mx.array:
        """``ranking`` ``[B, H, held]`` blended with the held scores' cumulative mass (``mass_weight``).

        Both are normalised per head first; the blend keeps ``ranking``'s total,
        so that decoding's attention mass adds to it on the same scale.
        """
        weight = self.mass_weight
        if not weight:
            return ranking
        mass = self.slots.held_scores()
        total = ranking.sum(axis=-1, keepdims=True)
        return total * ((1 - weight) * _per_head_share(ranking) + weight * _per_head_share(mass))

    def _end_prefill(self) -> None:
        self._prefilling = False
        self._pending = False
        self._on_prefill_end()
        if self.timing.selects_by_window and self.selector.ready:
            self._select_by_window()
        self.selector.clear()
        self._evict_to(self._budget_in_force())


def _per_head_share(scores: mx.array) -> mx.array:
    """``scores`` ``[B, H, N]`` divided by each head's total (a head with none stays zero)."""
    return scores / mx.maximum(scores.sum(axis=-1, keepdims=True), 1e-30)
