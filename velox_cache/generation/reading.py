"""One reading, many caches: prefill a prompt once, then cut any number of prefill-end stacks from it.

Under ``prefill_end`` nothing is evicted before decoding starts, so every such
stack's forward pass is the full cache's: the same hidden states, keys and
values. What differs is what each policy ranks by (the prompt's last queries,
cumulative mass, squeeze's concentration), and the selection at the end.
``SharedReading.prefill`` runs the prompt once through a full stack and one
*recording* stack per group of configs that rank by the same things
(``reading_recipe``), all fed by the same model calls; ``derive(config)`` then
builds the config's own stack, lets every layer adopt its group's recording
(``EvictingKVCache.adopt_prefill``) and tells it ``decode``: the selection runs
with the config's own budgets. A derived stack equals the stack the config
builds by its own prefill, array for array; the full stack is the full
variant's own.

Streaming and continuous eviction change the forward pass (they evict while
reading), and layers Velox does not compress (sliding-window, state-space)
cannot be shared: such configs and models raise ``NotDerivable``.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Iterable, Optional, Sequence

import mlx.core as mx

from ..builder import KVCacheBuilder
from ..cache import phases
from ..cache.base import EvictingKVCache
from ..cache.choices import PolicyChoices
from ..config import KVCacheConfig
from ..kernels.fused import scoring_seconds
from ..policies import POLICIES
from .prefill import draft as draft_tokens
from .prefill import look_ahead, model_context, prefill_phases
from .routing import attention_routing

FULL = KVCacheConfig(method="full")


class NotDerivable(ValueError):
    """A stack that cannot be cut from a shared reading; the message says why."""


def reading_recipe(config: KVCacheConfig) -> Optional[tuple]:
    """What a config's prefill computes besides keys and values (None for the full cache).

    Configs with equal recipes share one recording: the same ranking signal,
    scoring, selection, window, pooling kernel and key dtype. Raises
    ``NotDerivable`` for a config that evicts while reading.
    """
    if config.method == "full":
        return None
    policy = POLICIES[config.method]
    choices = PolicyChoices.resolve(policy, config)
    if choices.eviction != "prefill_end":
        raise NotDerivable(
            f"eviction: {config.method} with {choices.eviction!r} evicts while reading, so its forward pass is "
            "its own; only prefill_end stacks can be cut from a shared reading"
        )
    return (policy.signal, config.scoring, choices.selection, config.window, config.kernel, config.kv_dtype, config.lookahead)


def derivable(config: KVCacheConfig) -> bool:
    """True when ``config``'s stack can be cut from a shared reading (``reading_recipe`` raises nothing)."""
    try:
        reading_recipe(config)
    except NotDerivable:
        return False
    return True


def _recording_config(configs: list[KVCacheConfig]) -> KVCacheConfig:
    """A config that computes what every config of one recipe needs while reading, and evicts nothing.

    Squeeze's concentration is measured when one of them is squeeze; cumulative
    mass is gathered when one of them blends it into its ranking.
    """
    base = configs[0]
    weights = [PolicyChoices.resolve(POLICIES[c.method], c).mass_weight for c in configs]
    method = "squeeze" if any(c.method == "squeeze" for c in configs) else base.method
    return dataclasses.replace(
        base,
        method=method,
        budget=max(base.n_sink + 1, 2),
        resolved_budget=None,
        eviction="prefill_end",
        selection=PolicyChoices.resolve(POLICIES[base.method], base).selection,
        mass_weight=max(weights),
        head_budgets="uniform",
    )


class _ReadingLayer:
    """One layer of a shared reading: every member (the full cache, each recording) fed the same calls.

    The model sees the first member's keys and values (all members hold the
    same); each recording scores by the call's real queries in
    ``observe_attention`` and the first one's output goes on.
    """

    def __init__(self, members: list):
        self.caches = members  # phases.leaves reaches each member
        self.recording = [m for m in members if isinstance(m, EvictingKVCache)]

    @property
    def offset(self):
        return self.caches[0].offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        fetched = [member.update_and_fetch(keys, values) for member in self.caches]
        return fetched[0]

    def observe_attention(self, queries, keys, values, scale, mask, sinks=None) -> mx.array:
        outputs = [m.observe_attention(queries, keys, values, scale, mask, sinks=sinks) for m in self.recording]
        return outputs[0]

    def make_mask(self, *args, **kwargs):
        masks = [member.make_mask(*args, **kwargs) for member in self.caches]
        return masks[-1]  # a recording's (each records its stack's shared mask)

    @property
    def state(self):
        return [array for member in self.caches for array in member.state]

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return self.caches[0].empty()


class SharedReading:
    """A prompt read once, from which the full stack and any prefill-end stack are cut (see the module doc).

    ``logits`` ``[1, V]``: the prompt's last position, the same for every stack cut from it.
    """

    def __init__(self, model, configs: Iterable[KVCacheConfig], prompt_tokens: int, new_tokens: Optional[int] = None):
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.new_tokens = new_tokens  # what the cut stacks' budgets are fitted to, with the prompt
        self.configs = list(configs)
        groups: dict = {}
        for config in self.configs:
            recipe = reading_recipe(config)
            if recipe is not None:
                groups.setdefault(recipe, []).append(config)
        self._recipes = list(groups)
        self._full = KVCacheBuilder.for_model(model, FULL)
        self._recordings = [
            KVCacheBuilder.for_model(model, _recording_config(group), prompt_tokens=prompt_tokens)
            for group in groups.values()
        ]
        for recording in self._recordings:
            kinds = {type(cache).__name__ for cache in phases.leaves(recording) if not isinstance(cache, EvictingKVCache)}
            if kinds:
                raise NotDerivable(
                    f"model: layers Velox does not compress ({', '.join(sorted(kinds))}) cannot be shared by a reading"
                )
        self.logits: Optional[mx.array] = None
        self.stop_tokens: frozenset = frozenset()  # where a draft stops (``draft``)
        self.scoring_seconds = 0.0  # of the reading, in the fused attention's scoring passes (``scores_while_reading``)
        self.looked_ahead = False  # the draft was fed (``look_ahead``), or none is needed

    @classmethod
    def prefill(
        cls,
        model,
        configs: Iterable[KVCacheConfig],
        *,
        document: Sequence[int],
        instruction: Sequence[int] = (),
        prefix: Sequence[int] = (),
        chunk_size: int = 256,
        max_new_tokens: int = 0,
        context_length: Optional[int] = None,
        stop_tokens: Collection[int] = (),
        repeat: Sequence[int] = (),
        draft: bool = True,
    ) -> "SharedReading":
        """Read ``prefix + document + instruction`` once for ``configs`` (any mix of ``full`` and prefill-end ones).

        Chunks and phases as ``prefill_phases``; the model's attention is routed by
        ``attention_routing`` for all of them. The prompt and ``max_new_tokens``
        must fit the model's context (a longer document streams: not derivable).
        Where configs ask for a ``lookahead``, the full stack drafts the most any
        asks for, once, and each recording's window takes its own config's share
        (``draft=False``: not now; ``look_ahead`` feeds the draft later, e.g. the
        full variant's own output once it is decoded);
        where one ranks by reconstruction, the document is re-read once after
        ``repeat`` (``prefill_phases``).
        """
        configs = list(configs)
        if all(config.method == "full" for config in configs):
            raise NotDerivable("configs: no compressed config to cut; the full cache reads the prompt on its own")
        length = len(prefix) + len(document) + len(instruction)
        context = context_length or model_context(model)
        if context is not None and length + max_new_tokens > context:
            raise NotDerivable(
                f"prompt: {length} tokens and {max_new_tokens} to generate pass the model's context of {context}; "
                "such a document is read by streaming, which cannot be shared"
            )
        reading = cls(model, configs, prompt_tokens=length, new_tokens=max_new_tokens)
        layers = [_ReadingLayer([full, *recorded]) for full, *recorded in zip(reading._full, *reading._recordings)]
        scored_before = scoring_seconds()
        with attention_routing(model, [FULL, *configs]):
            reading.logits = prefill_phases(
                model, layers, prefix=prefix, document=document, instruction=instruction, chunk_size=chunk_size,
                max_new_tokens=max_new_tokens, context_length=context_length, tell_decode=False,
                stop_tokens=stop_tokens, repeat=repeat, drafts_after=False,
            )
        reading.scoring_seconds = scoring_seconds() - scored_before
        reading.looked_ahead = not reading.look_ahead_steps
        reading.stop_tokens = frozenset(stop_tokens)
        if draft and not reading.looked_ahead:
            reading.look_ahead(reading.draft())
        phases.tell(reading._full, phases.Phase.DECODE)
        return reading

    def draft(self) -> list[int]:
        """The greedy draft the configs' own prefills make (``look_ahead_steps`` tokens), from the full stack.

        Call it before the full stack decodes (it drafts after the prompt); feed
        the result with ``look_ahead``.
        """
        with attention_routing(self.model, [FULL]):
            return draft_tokens(self.model, self._full, self.logits, self.look_ahead_steps, self.stop_tokens)

    @property
    def look_ahead_steps(self) -> int:
        """The most drafted tokens any config read asks for (``lookahead``)."""
        return max((config.lookahead for config in self.configs), default=0)

    def look_ahead(self, tokens: Sequence[int]) -> None:
        """Feed the draft after the prompt (at most ``look_ahead_steps`` of ``tokens``), once, before any cut.

        The tokens run through the recordings only (the full stack may have
        decoded meanwhile), one call per ``lookahead`` asked for, of that many
        tokens, whose windows remember their queries as each config's own
        prefill does (``velox_cache.generation.prefill.look_ahead``): with the same
        tokens (its greedy draft), cut stacks equal their own prefill's.
        """
        if self.looked_ahead:
            raise RuntimeError("look_ahead: this reading has its draft already")
        steps = sorted({recording[0].config.lookahead for recording in self._recordings} - {0})
        with attention_routing(self.model, self.configs):
            for k in steps:  # one call per length: each recording sees exactly the call its own prefill makes
                recordings = [r for r in self._recordings if r[0].config.lookahead == k]
                layers = [_ReadingLayer(list(recorded)) for recorded in zip(*recordings)]
                look_ahead(self.model, layers, list(tokens)[:k])
        self.looked_ahead = True

    @property
    def nbytes(self) -> int:
        """Bytes the recordings hold (the full stack is the full variant's own)."""
        return sum(getattr(cache, "nbytes", 0) for stack in self._recordings for cache in stack)

    def scores_while_reading(self, config: KVCacheConfig) -> bool:
        """True when ``config``'s own prefill scores the prompt's rows as it reads them (cumulative mass,
        squeeze's measure); False for the full cache and for configs ranked by their window alone, whose own
        prefill has none of the reading's ``scoring_seconds`` (spent for the other configs read)."""
        if config.method == "full":
            return False
        stack = KVCacheBuilder.for_model(self.model, config, prompt_tokens=self.prompt_tokens, new_tokens=self.new_tokens)
        return any(cache.scores_while_reading for cache in phases.leaves(stack) if isinstance(cache, EvictingKVCache))

    def held_bytes(self, config: Optional[KVCacheConfig] = None) -> int:
        """Bytes the reading holds now: for ``config`` (the full stack, or its recording) only, else every member.

        What ``config``'s own prefill holds is its member's bytes; the rest is
        held for the other configs read (``pipeline.generation`` takes it off a
        shared reading's peak to give each variant its own).
        """
        full = sum(getattr(cache, "nbytes", 0) for cache in self._full)
        recordings = [sum(getattr(cache, "nbytes", 0) for cache in stack) for stack in self._recordings]
        if config is None:
            return full + sum(recordings)
        if config.method == "full":
            return full
        return recordings[self._recipes.index(reading_recipe(config))]

    def full(self) -> list:
        """The full cache stack, as the full variant's own prefill leaves it (shared: decode a snapshot to keep it)."""
        return self._full

    def derive(self, config: KVCacheConfig) -> list:
        """The stack ``config`` builds by its own prefill of this prompt, cut from the reading, ready to decode.

        ``config`` must be one of the configs read (or share a recipe with one);
        the reading stays as it was, so any number of stacks can be cut.
        """
        if config.method == "full":
            raise NotDerivable("method: the full stack is `full()`; derive cuts compressed stacks")
        recipe = reading_recipe(config)
        if recipe not in self._recipes:
            raise NotDerivable(
                f"config: {config.method} ranks by what this reading did not record; read it with this config"
            )
        if config.lookahead and not self.looked_ahead:
            raise NotDerivable("lookahead: this reading has no draft yet; feed it first (look_ahead(tokens))")
        recording = self._recordings[self._recipes.index(recipe)]
        stack = KVCacheBuilder.for_model(self.model, config, prompt_tokens=self.prompt_tokens, new_tokens=self.new_tokens)
        for target, source in zip(phases.leaves(stack), phases.leaves(recording)):
            target.adopt_prefill(source)
        phases.tell(stack, phases.Phase.DECODE)
        mx.eval([c.state for c in stack])
        return stack
