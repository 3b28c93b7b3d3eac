"""``EvictingKVCache``: one layer's budgeted cache; it runs mlx-lm's cache protocol and delegates.

A policy is three independent choices (ARCHITECTURE.md), each an object the
cache holds: how many tokens the layer keeps (``allocation``, from
``velox_cache.budgets.allocators``), when eviction happens (``timing``, from
``velox_cache.cache.timing``) and which signal ranks tokens (``signal``, from
``velox_cache.cache.signals``; at prefill end and in streaming prefill the
``WindowSelector`` of ``velox_cache.cache.selection``). The held arrays, the
sequence's counts and the eviction mechanics live in ``TokenSlots``
(``velox_cache.cache.slots``); where the sequence stands (prefilling, the phase
told, a running probe) in ``velox_cache.cache.phases.LayerPhase``. Scoring (the
observed attention or the key proxy) is ``velox_cache.cache.scoring``.

Prefill phases are told by the caller; a cache that is never told one infers
the end of prefill from the call pattern of ``mlx_lm.generate_step``: the first
single-token call not preceded by a read of ``state`` is the first generated
token (``LayerPhase.starts_decoding``).

``offset`` is the position the next token gets. It is the number of tokens
seen, except after ``compact_positions``: then the held keys were re-rotated
to positions ``0 .. held - 1`` and ``offset`` counts from there. ``tokens_seen``
always counts every token passed in (probes excepted).
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from ..budgets.allocators import UniformBudget
from ..config import ConfigError, KVCacheConfig
from ..kernels.masks import SharedMaskRecord
from ..kernels.observe import is_routed
from .accounting import CacheAccounting
from .choices import PolicyChoices
from .head_slots import HeadPooledSlots
from .phases import LOOK_AHEAD, PROBE, LayerPhase, Phase, ProbeMark
from .quantized_slots import QuantizedTokenSlots
from .restoring import CannotRestore, Restorable
from .scoring import LayerScoring
from .selection import WindowSelector, blend_with_mass
from .signals import CumulativeMass
from .slots import TokenSlots
from .timing import make_timing


class EvictingKVCache(Restorable, LayerScoring, CacheAccounting, _BaseCache):
    """One attention layer's KV cache that keeps at most ``layer_budget`` tokens per head.

    Subclasses (one per policy, ``velox_cache.policies``) declare the three
    choices: ``allocator`` (a class from ``velox_cache.budgets.allocators``),
    ``default_eviction`` (the timing) with ``default_selection``, and ``signal``.
    This class is the mechanics, not a policy: its ``method`` is None and the
    registry (``velox_cache.policies.POLICIES``) refuses a class that does not
    name its own.
    """

    method: Optional[str] = None
    allocator = UniformBudget
    default_eviction = "continuous"
    default_selection = "cumulative"  # or "window": pooled scores of the prompt's last queries
    signal = CumulativeMass

    def __init__(self, config: KVCacheConfig, layer_id: Optional[int] = None, coordinator=None):
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config: expected a KVCacheConfig, got {type(config).__name__}")
        if config.budget_fraction is not None:
            raise ConfigError(
                f"budget: {config.budget!r} is a share of the prompt; resolve it first "
                "(KVCacheBuilder.for_model(..., prompt_tokens=N) or config.resolved_for(N))"
            )
        self.config = config
        self.layer_id = layer_id
        choices = PolicyChoices.resolve(type(self), config)
        self.eviction, self.prefill_selection, self.mass_weight = choices.eviction, choices.selection, choices.mass_weight
        self.head_budgets = choices.head_budgets
        self.lookahead = choices.lookahead  # tokens drafted when the prompt ends (the timing's own)
        self.allocation = self.allocator(config, layer_id, coordinator)
        if config.kv_bits:
            self.slots = QuantizedTokenSlots(self.signal, config.n_sink, config.recent_window, config.kv_bits,
                                             config.kv_group)
        else:
            self.slots = TokenSlots(self.signal, config.n_sink, config.recent_window)
        self.timing = make_timing(self.eviction, self.prefill_selection)
        self.selector = WindowSelector(config.window, choices.kernel)
        if self.lookahead and not self.timing.ranks_by_window:
            raise ConfigError(
                f"lookahead: drafted tokens join the window that ranks the prompt; {self.method} with eviction "
                f"{self.eviction!r} and selection {self.prefill_selection!r} ranks by no window "
                "(use selection 'window' or eviction 'streaming')"
            )
        self.progress = LayerPhase()
        self.shared_mask = SharedMaskRecord()  # shared by a stack from ``KVCacheBuilder.for_model``
        LayerScoring.__init__(self)

    @property
    def layer_budget(self) -> int:
        """This layer's budget in force (resolved per layer by ``KVCacheBuilder.for_model``)."""
        return self.allocation.budget()

    @classmethod
    def default_mass_weight(cls, eviction: str) -> float:
        """The policy's share of cumulative mass in a window's or probe's ranking under ``eviction``."""
        return 0.0

    @classmethod
    def default_head_budgets(cls, eviction: str) -> str:
        """``uniform`` or ``adaptive``: how the policy splits a layer's budget over its heads under ``eviction``."""
        return "uniform"

    def adopt_prefill(self, source: "EvictingKVCache") -> None:
        """Take over ``source``'s prefill, as if this layer had read the prompt itself; prefill has not ended.

        ``source`` is the same layer of a stack that read the same prompt in the
        same calls under ``prefill_end``, with the same signal, scoring, window,
        kernel, selection and key dtype, still prefilling (``velox_cache.generation
        .reading`` groups configs so): nothing was evicted, so its held tokens,
        scores, remembered window and measure are this layer's. Telling ``decode``
        then selects by this layer's own budget. Shares no array with ``source``.
        """
        if not source.progress.prefilling or not self.progress.prefilling:
            raise RuntimeError(f"layer {self.layer_id}: a prefill is adopted before either layer ends it")
        if (self.eviction, source.eviction) != ("prefill_end", "prefill_end"):
            raise ValueError(f"layer {self.layer_id}: only prefill_end layers share a reading, not {self.eviction}")
        if source.signal is not self.signal:
            raise ValueError(f"layer {self.layer_id}: signal {source.signal.__name__} read, {self.signal.__name__} asked")
        self.slots.adopt(source.slots)
        self.selector.adopt(source.selector)
        self.allocation.adopt(source.allocation)
        self.adopt_scoring(source)
        self.progress = copy.copy(source.progress)

    @property
    def uses_probes(self) -> bool:
        """True under the streaming timing: a probe's attention ranks the held tokens."""
        return self.timing.uses_probes

    def batch_refusal(self) -> Optional[str]:
        """Why this cache cannot decode in a batch now (None: it can; see ``velox_cache.generation.batching``)."""
        slots, progress = self.slots, self.progress
        if slots.empty or progress.prefilling or progress.in_probe:
            return "a cache still in prefill (or in a probe) cannot decode in a batch"
        if self.awaiting_observation:
            return "the cache's last call is still waiting for its attention"
        if not self._evicting_now():
            return "a cache that does not evict while decoding cannot batch"
        if slots.kept_per_head > self.layer_budget:
            return f"holds {slots.kept_per_head} tokens per head over its budget of {self.layer_budget}"
        return None

    @property
    def concentration(self) -> float:
        """Measured attention concentration, 0 (broad) to 1 (one token); 0 for policies that do not measure it."""
        return self.allocation.concentration

    # ----- phases -------------------------------------------------------------------------

    @property
    def phase(self) -> Optional[Phase]:
        """The phase told last (``PROBE`` while one runs); None when never told."""
        return self.progress.current

    def begin_phase(self, phase) -> None:
        """The next calls belong to ``phase`` (a ``velox_cache.cache.phases.Phase`` or its name).

        ``decode`` ends prefill (prefill-end policies compress now). A probe
        ends with ``end_probe`` (or when another phase is told).
        """
        phase, progress = Phase.parse(phase), self.progress
        if progress.in_probe and phase is not Phase.PROBE:
            self.end_probe()
        if phase is Phase.PROBE:
            self.begin_probe()
        elif progress.tell(phase):
            self._end_prefill()

    def begin_probe(self, kind: str = PROBE) -> None:
        """The next calls are a probe of ``kind`` (``velox_cache.cache.phases.PROBE_KINDS``), dropped by ``end_probe``.

        A look-ahead's queries join the window that ranks the held tokens when
        prefill ends (``velox_cache.cache.phases.look_ahead``); the window widens
        by ``lookahead`` to hold them beside the prompt's own. A
        reconstruction's attention peaks are kept for that ranking
        (``velox_cache.cache.phases.reconstruction``).
        """
        self.progress.start_probe(ProbeMark.of(self.slots), kind)
        if kind == LOOK_AHEAD and self.timing.ranks_by_window:
            self.selector.widen(self.lookahead)

    @property
    def reconstructs(self) -> bool:
        """True when this layer ranks the prompt by reconstructing it (``selection: reconstruction``)."""
        return self.timing.reconstructs

    def end_probe(self) -> None:
        """Drop the probe's keys and values (offset and accounting as before it).

        Under the streaming timing the held tokens are first ranked by the
        probe's attention and evicted to budget.
        """
        if not self.progress.in_probe:
            return
        mark, scores = self.progress.finish_probe()
        self._forget_pending_observation()
        mark.restore(self.slots)
        if scores is not None and self.timing.on_probe_end():
            self._rank_and_evict(scores)

    def compact_positions(self, shift) -> None:
        """Re-rotate the held keys to positions ``0 .. held - 1`` (``shift``: a ``velox_cache.kernels.rope.RotaryShift``).

        Afterwards ``offset`` is the number held: the next token sits right
        after the kept ones, so a document longer than the model's context can
        be read. Order is kept; relative distances between kept tokens shrink.
        """
        if self.slots.empty:
            return
        if self.progress.in_probe:
            raise ValueError("compact_positions: not while a probe runs")
        if self.timing.selection_due():
            self._select_by_window()
        self.selector.clear()  # remembered query positions are from before the move
        self.slots.compact(shift)

    # ----- mlx-lm cache protocol ----------------------------------------------------------

    @property
    def offset(self) -> int:
        return self.slots.offset

    @offset.setter
    def offset(self, value: int) -> None:
        self.slots.offset = value

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store this call's keys/values and return the retained ones plus all new ones, new last.

        A multi-token chunk comes back whole and in order after the retained
        tokens; eviction runs after its attention has been scored. A single
        decode token takes the slot of the lowest-scoring token once the
        layer is at budget (decode uses no mask, so slot order is free).
        """
        self._check_last_observation()
        progress, n_new = self.progress, keys.shape[2]
        if self.slots.empty:
            self._start(keys, values)
        if n_new > 1:
            self._check_shared_mask(n_new)
        if progress.starts_decoding(n_new, self.slots.offset):
            self._end_prefill()  # never told: the first generated token, as mlx_lm.generate feeds it
        document_chunk = self.progress.in_document_chunk
        self._select_if_due()
        slots = self.slots  # bound only now: a selection above may have pooled the heads into new slots
        if slots.heads_pooled and not is_routed():
            raise RuntimeError(
                f"layer {self.layer_id}: per-head budgets (head_budgets='adaptive') need the model's attention "
                "routed through Velox: run it inside `velox_cache.observe(model)` or `velox_cache.fast_attention(model)`"
            )
        if keys.dtype != slots.keys.dtype or values.dtype != slots.values.dtype:
            keys, values = keys.astype(slots.keys.dtype), values.astype(slots.values.dtype)
        budget = self.allocation.budget()
        if n_new == 1 and self._evicting_now():
            self._evict_to(budget)
            if slots.at_budget(budget):
                slots.replace_lowest(keys, values, budget)
            else:
                self._append(keys, values, budget)
        else:
            self._append(keys, values, budget)
        slots.offset += n_new
        if not progress.in_probe:
            slots.tokens_seen += n_new
        held = slots.held()
        self._score_call(keys, held[0])
        if document_chunk:
            self.timing.on_chunk_end()
        return held

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """The attention mask for ``N`` new tokens over the keys the next call returns."""
        if window_size is not None:
            raise NotImplementedError(
                f"layer {self.layer_id}: {type(self).__name__} does not support sliding-window attention "
                "layers (a model should give them a RotatingKVCache in make_cache)"
            )
        if N == 1:
            return None
        self._select_if_due()  # before the keys the mask covers are counted
        if return_array:
            self.shared_mask.record(self.layer_id, self.offset, N, self.slots.stored + N)
            return create_causal_mask(N, self.slots.stored)
        return "causal"

    @property
    def state(self):
        """Every array held. A read marks the sequence as still in its prompt (``LayerPhase.starts_decoding``)."""
        self.progress.state_read = True
        return self._state_list()

    @state.setter
    def state(self, value):
        """Rebind the arrays (``from_state(state, meta_state)``: see ``velox_cache.cache.restoring``)."""
        self._restore_state(value)

    def _state_list(self) -> list:
        arrays = self.slots.arrays + self.selector.arrays + self.allocation.arrays
        if self.progress.probe_scores is not None:
            arrays.append(self.progress.probe_scores)
        return arrays

    def _check_saveable(self) -> None:
        if self._awaiting_observation:
            raise CannotRestore(
                f"layer {self.layer_id}: its last call is still waiting for its attention (the new keys it will "
                "score are in no state); save it after the model call"
            )

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

    # ----- the held arrays and their accounting -------------------------------------------

    keys = property(lambda self: self.slots.keys, doc="Key buffer ``[B, H, T, D]`` (the first ``tokens_kept`` slots are valid).")
    values = property(lambda self: self.slots.values, doc="Value buffer ``[B, H, T, D]``.")
    scores = property(lambda self: self.slots.scores, doc="Ranking scores ``[B, H, T]`` (higher = keep).")
    positions = property(lambda self: self.slots.positions, doc="The position each slot's key is rotated at ``[B, H, T]``.")
    held_slots = property(lambda self: self.slots.stored, doc="Buffer slots holding a token (all heads' under per-head budgets).")
    tokens_kept = property(
        lambda self: self.slots.kept_per_head, doc="Tokens currently held per head (the mean, under per-head budgets)."
    )
    kv_heads = property(lambda self: self.slots.kv_heads, doc="Key/value heads of the layer.")
    seen_per_head = property(
        lambda self: self.slots.tokens_seen,
        doc="Tokens passed to ``update_and_fetch`` per head (probes excepted; not reset by compaction).",
    )

    kv_bits = property(lambda self: self.config.kv_bits, doc="Bits per held key and value code once decoding (None: float).")

    @property
    def kept_bytes(self) -> int:
        """Bytes of the keys and values of the tokens held (codes, scales and window under ``kv_bits``)."""
        if getattr(self.slots, "quantized", False):
            return self.slots.kept_bytes
        return super().kept_bytes

    @property
    def nbytes(self) -> int:
        if getattr(self.slots, "quantized", False):
            return self.slots.nbytes
        return super().nbytes

    # ----- mechanics ----------------------------------------------------------------------

    def _evicting_now(self) -> bool:
        return not self.progress.in_probe and self.timing.evicts(self.progress.prefilling)

    def _append(self, keys: mx.array, values: mx.array, budget: int) -> None:
        grows_in_steps = not self._evicting_now() and self.timing.grows_in_steps(self.progress.prefilling)
        spare = self.slots.spare_for(keys.shape[2], budget=budget, in_steps=grows_in_steps)
        self.slots.append(keys, values, self.slots.offset, spare)

    def _evict_to(self, budget: int) -> None:
        """Keep the ``budget`` best-ranked held tokens of every head (the selector's window mass in step)."""
        before = self.slots.stored
        keep = self.slots.evict_to(budget)
        if keep is not None:
            self.selector.keep(keep, before)

    def _rank_and_evict(self, ranking: mx.array) -> None:
        """Settle the budget, rank the held slots by ``ranking`` (blended with mass) and evict to budget.

        Under ``head_budgets='adaptive'`` the layer's heads are pooled first
        (``HeadPooledSlots``): one selection over all of them.
        """
        self.allocation.settle()
        self.slots.set_scores(blend_with_mass(ranking, self.slots.held_scores(), self.mass_weight))
        if self.head_budgets == "adaptive" and not self.slots.heads_pooled:
            self._pool_heads()
        self._evict_to(self._selection_budget())

    def _selection_budget(self) -> int:
        """The budget a selection evicts to: the layer's, widened by ``stream_headroom`` while prefill reads on."""
        budget = self.allocation.budget()
        if self.progress.prefilling:
            return math.ceil(budget * self.config.stream_headroom)
        return budget

    def _pool_heads(self) -> None:
        """From here on each KV head keeps its own number of tokens (``velox_cache.cache.head_slots``)."""
        if self.scoring != "observed":
            raise RuntimeError(
                f"layer {self.layer_id}: head_budgets='adaptive' needs observed scoring (run the model inside "
                "`velox_cache.observe(model)`), this layer scores by the key proxy"
            )
        if self.selector.mass is not None:
            raise RuntimeError(
                f"layer {self.layer_id}: head_budgets='adaptive' needs attention over the held keys themselves; "
                "this model derives its keys from them or adds sinks or position scores"
            )
        self.slots = HeadPooledSlots.pooled(self.slots, self.config.head_floor)

    def _select_by_window(self) -> None:
        """SnapKV: rank the held slots by the remembered window's pooled attention and evict to budget."""
        if not self.selector.ready:
            return
        slots = self.slots
        keys, _ = slots.held()
        ranking = self.selector.scores(keys, slots.held_positions(), scale=self._window_scale(), slots=slots)
        self._rank_and_evict(ranking)

    def _select_if_due(self) -> None:
        """Streaming: the last chunk's window selection, when the next document chunk is about to come."""
        if self.progress.in_document_chunk and self.timing.selection_due():
            self._select_by_window()

    def _end_prefill(self) -> None:
        self.progress.prefilling = False
        by_window = self.timing.on_prefill_end()
        self.allocation.settle()
        if by_window:
            self._select_by_window()
        self.selector.clear()
        self._evict_to(self.allocation.budget())
        if self.config.kv_bits:
            self.slots.quantize(self.allocation.budget())
