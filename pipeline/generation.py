"""One document through one cache variant: fresh cache stack, prefill by phases, decode.

The prompt's prefix and document are prefilled in chunks of
``prefill_step_size``, then its instruction; the caches are told each phase
(``velox_cache.prefill_phases``). Streaming variants also run the instruction
as a probe after every document chunk but the last.

``generate`` does one variant start to end. ``prefill_variant`` and
``generate_together`` split it, so that several prefilled variants decode in
one batch (``velox_cache.generation.decode``) with the same outputs as alone.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases, snapshot
from velox_cache.cache.accounting import layer_stats
from velox_cache.generation.batching import BatchUnsupported
from velox_cache.generation.decode import DecodeRow, decode_rows
from velox_cache.generation.forcing import feed_together
from velox_cache.generation.prefill import repeat_request
from velox_cache.generation.reading import FULL, SharedReading, reading_recipe
from velox_cache.generation.routing import attention_routing
from velox_cache.generation.sampling import TokenSampler

from .prompting import Prompt
from .reference import Reference
from .schedule import decode_within
from .sampling import TokenChoice
from .spec import GenerationSpec


@dataclass
class Fidelity:
    """How closely a compressed cache tracks the full cache on the full cache's own output.

    ``agreement``: share of the reference tokens that the compressed cache's top-1
    prediction matches when fed the reference (teacher forcing; 1.0 = identical
    behaviour). ``nll_gap``: mean log-likelihood the reference loses under the
    compressed cache, in nats per token (0 = none lost).
    """

    agreement: float
    nll_gap: float
    seconds: float


@dataclass
class GenerationResult:
    output: str
    prompt_tokens: int
    output_tokens: int
    prefill_seconds: float
    decode_seconds: float
    peak_memory_bytes: int
    stop_reason: str  # "eos" or "max_tokens"
    layer_stats: list[dict] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each generated token, under this cache
    fidelity: Optional[Fidelity] = None
    decode_batch_size: int = 1  # the most sequences it decoded beside in one step, itself included
    reading_seconds: Optional[float] = None  # the part of prefill_seconds shared with other variants (one reading)
    draft_seconds: Optional[float] = None  # drafting its look-ahead's tokens (None: none drafted for it)

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.output_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def totals(self) -> dict:
        kept = sum(row["kept_bytes"] for row in self.layer_stats)
        full = sum(row["full_seq_bytes"] for row in self.layer_stats)
        spare = sum(row.get("spare_bytes") or 0 for row in self.layer_stats)
        ratio = full / kept if kept else None
        return {"kept_bytes": kept, "spare_bytes": spare, "full_seq_bytes": full, "compression_ratio": ratio}


@dataclass
class PrefilledVariant:
    """One document through one variant, prefilled: its decode row, and what finishing it needs."""

    row: DecodeRow
    config: KVCacheConfig
    prompt_tokens: int
    prefill_seconds: float  # reading the prompt, the look-ahead's call and (cut from a reading) the cut; no draft
    prefill_peak_bytes: int  # its own prefill's peak above what the process held when it started
    first_logprobs: mx.array
    reference: Optional[Reference] = None
    prefill_end: Optional[list] = None  # a snapshot of the caches when prefill ended (for teacher forcing)
    reading_seconds: Optional[float] = None  # the part of prefill_seconds shared with other variants (``read_shared``)
    reading: Optional["Reading"] = None  # kept for the frontier until it is measured (``frontier_rows``)
    draft_seconds: Optional[float] = None  # drafting the look-ahead's tokens, apart from prefill_seconds
    layer_stats: list = field(default_factory=list)  # accounting of the caches when prefill ended

    def refer_to(self, reference: Optional[Reference]) -> None:
        """Teacher-force on ``reference`` after decoding (None: no fidelity; its snapshot is dropped)."""
        self.reference = reference
        if reference is None:
            self.prefill_end = None


def generate(
    model,
    tokenizer,
    prompt,
    config: KVCacheConfig,
    settings: GenerationSpec,
    *,
    reference: Optional[Reference] = None,
    document_span: Optional[tuple] = None,
) -> GenerationResult:
    """Generate for one prompt (a ``Prompt``, or token ids) with a fresh cache stack, decoding alone.

    Token ids are all document unless ``document_span`` ``(start, end)`` marks the
    document in them (``end`` None: to the end).

    With a ``reference`` (the full cache's output for the same prompt), the
    cache stack is snapshotted when prefill ends and, after the free-running
    generation, the snapshot is fed the reference tokens to measure
    ``fidelity``: one extra forward pass, no second prefill; the free-running
    output, its timings and its accounting are those of the original stack.
    """
    run = prefill_variant(model, tokenizer, prompt, config, settings, reference=reference, document_span=document_span)
    return generate_together(model, tokenizer, [run], batch=False)[0]


def prefill_variant(
    model,
    tokenizer,
    prompt,
    config: KVCacheConfig,
    settings: GenerationSpec,
    *,
    reference: Optional[Reference] = None,
    document_span: Optional[tuple] = None,
) -> PrefilledVariant:
    """A fresh cache stack for ``prompt``, prefilled by phases, ready to decode (see ``generate``)."""
    if not isinstance(prompt, Prompt):
        start, end = document_span or (0, None)
        prompt = Prompt(list(prompt), document_start=start, document_end=end)
    prompt_tokens = prompt.tokens
    caches = KVCacheBuilder.for_model(model, config, prompt_tokens=len(prompt_tokens), new_tokens=settings.max_tokens)
    sampler = TokenChoice(settings, prompt_tokens)
    clock = _DraftClock()
    with OwnPeak() as peak, attention_routing(model, [config]):
        start = time.perf_counter()
        logits = prefill_phases(
            model,
            caches,
            prefix=prompt.prefix,
            document=prompt.document,
            instruction=prompt.instruction,
            chunk_size=settings.prefill_step_size,
            max_new_tokens=settings.max_tokens,
            stop_tokens=frozenset(tokenizer.eos_token_ids),
            repeat=_repeat_for(tokenizer, [config]),
            after_call=clock,
        )
        first_logprobs = sampler.logprobs(logits)
        mx.eval(first_logprobs)
        prefill_seconds = time.perf_counter() - start - (clock.seconds or 0.0)
    row = DecodeRow(caches, sampler, first_logprobs, settings.max_tokens, frozenset(tokenizer.eos_token_ids))
    return PrefilledVariant(
        row,
        config,
        prompt_tokens=len(prompt_tokens),
        prefill_seconds=prefill_seconds,
        prefill_peak_bytes=peak.bytes,
        first_logprobs=first_logprobs,
        reference=reference,
        prefill_end=snapshot(caches) if reference is not None else None,
        draft_seconds=clock.seconds,
        layer_stats=layer_rows(caches),
    )


class _DraftClock:
    """``prefill_phases``' ``after_call``: the seconds its look-ahead's draft took (``seconds``; None: no draft),
    from the prompt's last logits evaluated (``"read"``) to the draft made."""

    def __init__(self):
        self.last = time.perf_counter()
        self.seconds: Optional[float] = None

    def __call__(self, event: str, caches) -> None:
        now = time.perf_counter()
        if event == "draft":
            self.seconds = now - self.last
        self.last = now


@dataclass
class Reading:
    """One prompt read once (``read_shared``): the ``SharedReading`` and what it cost.

    ``seconds``: the forward pass over the prompt; ``look_ahead_seconds``: the call that fed
    the draft (0 until fed; ``SharedReadings`` sets it when the full variant's output is the
    draft); ``draft_seconds``: drafting, when the reading drafted (None: it did not).
    ``peak_bytes``: the reading's own peak; ``held_bytes``: what each member held when it
    ended (the full stack and each recording), which ``own_peak`` takes off for the others.
    ``variants``: how many of its configs are variants' rows (the others: frontier points).
    """

    shared: SharedReading
    prompt: Prompt
    seconds: float
    peak_bytes: int
    variants: int = 0
    held_bytes: dict = field(default_factory=dict)  # reading_recipe (None: the full stack) -> bytes held at the end
    look_ahead_seconds: float = 0.0
    draft_seconds: Optional[float] = None
    draft_peak_bytes: int = 0  # drafting and feeding the draft: its peak above what the reading held then

    def own_peak(self, config: KVCacheConfig) -> int:
        """``config``'s own prefill peak: the reading's, less what it held for the other configs read
        (and, for a config that looks ahead, its member plus the draft's peak, when the reading drafted)."""
        own = self.held_bytes.get(reading_recipe(config), 0)
        drafting = own + self.draft_peak_bytes if config.lookahead else 0
        return max(own, drafting, self.peak_bytes - (sum(self.held_bytes.values()) - own))

    def draft_alone(self) -> None:
        """Draft greedily from the full stack (``SharedReading.draft``) and feed it; its seconds and peak recorded."""
        with OwnPeak() as drafting:
            start = time.perf_counter()
            tokens = self.shared.draft()
            self.draft_seconds = time.perf_counter() - start
            self.feed_draft(tokens)
        self.draft_peak_bytes = drafting.bytes

    def feed_draft(self, tokens) -> None:
        """Feed the draft (``SharedReading.look_ahead``), timed in ``look_ahead_seconds``."""
        start = time.perf_counter()
        self.shared.look_ahead(tokens)
        self.look_ahead_seconds = time.perf_counter() - start


def read_shared(
    model, tokenizer, prompt: Prompt, configs: list[KVCacheConfig], settings: GenerationSpec, *, draft: bool = True,
    variants: Optional[int] = None,
) -> Reading:
    """Read ``prompt`` once for ``configs`` (``SharedReading.prefill``); cut each run with ``cut_shared``.

    ``draft=False``: configs with a ``lookahead`` wait for their draft
    (``Reading.feed_draft``), the full variant's own output once decoded.
    ``variants``: how many of ``configs`` (the first ones) are variants' rows, the rest frontier
    points (default: all). Raises ``NotDerivable`` when the configs cannot share.
    """
    with OwnPeak() as peak:
        start = time.perf_counter()
        reading = SharedReading.prefill(
            model, configs, prefix=prompt.prefix, document=prompt.document,
            instruction=prompt.instruction, chunk_size=settings.prefill_step_size, max_new_tokens=settings.max_tokens,
            stop_tokens=frozenset(tokenizer.eos_token_ids), repeat=_repeat_for(tokenizer, configs), draft=False,
        )
        mx.eval(reading.logits)
        result = Reading(reading, prompt, time.perf_counter() - start, 0,
                         variants=len(configs) if variants is None else variants)
    result.peak_bytes = peak.bytes
    result.held_bytes = {reading_recipe(config): reading.held_bytes(config) for config in [FULL, *configs]}
    if draft and not reading.looked_ahead:
        result.draft_alone()
    return result


def draft_together(model, readings: list[Reading], *, budget_bytes: int, max_rows: int) -> None:
    """Each reading's look-ahead draft, their full stacks decoding the greedy drafts together, then fed.

    The tokens each reading's own ``SharedReading.draft`` gives (greedy, ``look_ahead_steps``
    of them, stopping before a stop token), decoded as rows of one batch the way a job
    decodes (``pipeline.schedule.DecodeAdmission``: ``max_rows`` at most, caches within
    ``budget_bytes``), so a group's drafts cost a few batched steps instead of a step per
    token per document. Each full stack keeps its draft: only its recordings are cut
    after this (no full variant is cut from these readings). ``draft_seconds``: each
    reading's share of the batch; ``look_ahead_seconds``: feeding its draft.
    """
    readings = [reading for reading in readings if not reading.shared.looked_ahead]
    if not readings:
        return
    rows = []
    for reading in readings:
        shared = reading.shared
        if any(config.method == "full" for config in shared.configs):
            raise ValueError("readings: a reading that serves the full variant drafts from its output, not here")
        sampler = TokenSampler()
        rows.append(DecodeRow(shared.full(), sampler, sampler.logprobs(shared.logits), shared.look_ahead_steps,
                              shared.stop_tokens))
    with attention_routing(model, [FULL]):
        decode_within(model, rows, budget_bytes=budget_bytes, max_rows=max_rows)
    for reading, row in zip(readings, rows):
        reading.draft_seconds = row.decode_seconds
        reading.feed_draft(row.tokens)


def cut_shared(tokenizer, reading: Reading, config: KVCacheConfig, settings: GenerationSpec) -> PrefilledVariant:
    """``config``'s run cut from ``reading``: what ``prefill_variant`` gives it alone (tokens, caches, accounting).

    ``prefill_seconds``: the reading's seconds (less its scoring passes, measured by the
    fused attention, where ``config``'s own prefill scores no rows while reading:
    ``SharedReading.scores_while_reading``), its look-ahead's call when ``config`` looks
    ahead, and the cut; ``reading_seconds``: the shared part of it (the reading
    and the look-ahead), where the reading serves other variants' rows too (frontier points
    alone do not make it shared: their seconds are their cuts and forcing); ``draft_seconds``: the reading's draft, when it drafted for
    ``config``; ``prefill_peak_bytes``: the reading's peak less what it held for the
    other configs (``Reading.own_peak``). A compressed run keeps a snapshot for
    teacher forcing until told its reference (``refer_to``).
    """
    start = time.perf_counter()
    shared = reading.shared
    caches = shared.full() if config.method == "full" else shared.derive(config)
    sampler = TokenChoice(settings, reading.prompt.tokens)
    first_logprobs = sampler.logprobs(shared.logits)
    mx.eval(first_logprobs)
    scored = 0.0 if shared.scores_while_reading(config) else shared.scoring_seconds  # spent for the others read
    common = reading.seconds - scored + (reading.look_ahead_seconds if config.lookahead else 0.0)
    eos = frozenset(tokenizer.eos_token_ids)
    return PrefilledVariant(
        DecodeRow(caches, sampler, first_logprobs, settings.max_tokens, eos),
        config,
        prompt_tokens=len(reading.prompt.tokens),
        prefill_seconds=common + time.perf_counter() - start,
        prefill_peak_bytes=reading.own_peak(config),
        first_logprobs=first_logprobs,
        prefill_end=None if config.method == "full" else snapshot(caches),
        reading_seconds=common if reading.variants > 1 else None,  # shared with other variants' rows
        draft_seconds=reading.draft_seconds if config.lookahead else None,
        layer_stats=layer_rows(caches),
    )


def prefill_shared(
    model, tokenizer, prompt: Prompt, configs: list[KVCacheConfig], settings: GenerationSpec, *,
    also_read: list[KVCacheConfig] = (),
) -> list[PrefilledVariant]:
    """One ``PrefilledVariant`` per config, all cut from one reading of ``prompt`` now (``read_shared``, ``cut_shared``).

    Look-ahead drafts come from the reading's full stack. ``also_read``: configs to
    cut later (``frontier_rows``); the first run then keeps the reading (``reading``)
    until it is done with.
    """
    reading = read_shared(model, tokenizer, prompt, [*configs, *also_read], settings, variants=len(configs))
    runs = [cut_shared(tokenizer, reading, config, settings) for config in configs]
    if also_read:
        runs[0].reading = reading
    return runs


def frontier_rows(model, reading: Reading, points: list, reference: Reference, settings: GenerationSpec) -> list:
    """The compression frontier of one document, from its ``reading`` (``read_shared``).

    ``points``: ``[(variant name, budget, config at that budget)]``. Each config's stack is
    cut from the reading, its bytes taken there (when prefill ends, as a document row's),
    then teacher-forced on ``reference`` (all in one batched call, as
    ``teacher_force_together``): one row per point with its agreement, NLL gap and bytes.
    ``seconds``: its share of cutting its variant's points (one ranking per layer serves
    every budget), of the look-ahead's call where it is fed here (the full output is the
    draft, where the reading has none yet; a call fed for the variants is theirs) and of
    the forcing.
    """
    shared = reading.shared
    ahead = 0.0  # a call fed before (for the variants cut from the reading) is in their seconds already
    if not shared.looked_ahead:
        reading.feed_draft(reference.token_ids)  # the full output is the draft (timed for the variants cut after)
        ahead = reading.look_ahead_seconds
    sampler = TokenChoice(settings, reading.prompt.tokens)
    first_logprobs = sampler.logprobs(shared.logits)
    stacks, layers, cut_seconds = [], [], []
    for _, _, config in points:
        start = time.perf_counter()
        stack = shared.derive(config)
        cut_seconds.append(time.perf_counter() - start)
        stacks.append(stack)
        layers.append(layer_rows(stack))
    del shared
    choices = [TokenChoice(settings, reading.prompt.tokens) for _ in points]
    with attention_routing(model, [config for _, _, config in points]):
        fidelities = teacher_force_together(
            model, [(stack, first_logprobs, reference, choice) for stack, choice in zip(stacks, choices)]
        )
    cuts: dict = {}  # each variant's cuts share one ranking per layer (the first cut makes it): shared equally
    for (name, _, _), cut in zip(points, cut_seconds):
        cuts.setdefault(name, []).append(cut)
    rows = []
    for (name, budget, config), rows_of_layers, fidelity in zip(points, layers, fidelities):
        cut = sum(cuts[name]) / len(cuts[name])
        kept = sum(row["kept_bytes"] for row in rows_of_layers)
        full = sum(row["full_seq_bytes"] for row in rows_of_layers)
        rows.append({
            "variant": name,
            "method": config.method,
            "budget": str(budget),
            "prompt_tokens": len(reading.prompt.tokens),
            "kept_share": kept / full if full else None,  # of the prompt's keys and values, in bytes
            "kept_bytes": kept,
            "full_seq_bytes": full,
            "compression_ratio": full / kept if kept else None,
            "agreement_vs_full": fidelity.agreement,
            "nll_gap_vs_full": fidelity.nll_gap,
            "seconds": cut + ahead / len(points) + fidelity.seconds,
        })
    return rows


def _repeat_for(tokenizer, configs) -> list[int]:
    """The request to repeat the document, where a config ranks by reconstruction (KVzip); else none."""
    return repeat_request(tokenizer) if any(c.selection == "reconstruction" for c in configs) else []


class OwnPeak:
    """``with OwnPeak() as peak:`` the block's peak memory above what the process held when it began (``peak.bytes``).

    Before it: nothing of other documents still computing or waiting to be collected,
    and MLX's buffer cache emptied, so that the figure is the block's own wherever it runs.
    """

    def __enter__(self) -> "OwnPeak":
        gc.collect()
        mx.synchronize()
        mx.clear_cache()
        self.held_before = mx.get_active_memory()  # the weights, and whatever other documents' rows hold now
        mx.reset_peak_memory()
        self.bytes = 0
        return self

    def __exit__(self, *exc) -> None:
        self.bytes = mx.get_peak_memory() - self.held_before


def generate_together(
    model, tokenizer, runs: list[PrefilledVariant], *, batch: bool = True,
    more: Optional[Callable[[list], list]] = None, configs: Optional[list[KVCacheConfig]] = None,
) -> list[GenerationResult]:
    """Decode prefilled variants (together when ``batch``, see ``velox_cache.generation.decode``), then finish each.

    Each result is what decoding it alone gives (tokens, accounting, and
    ``peak_memory_bytes``: see ``peak_memory``); its ``decode_seconds`` is its
    share of the batch's steps. ``more`` (continuous batching): called with the
    rows decoding whenever they change, returns more prefilled variants to join
    them (``decode_rows``' ``refill``); their results follow ``runs``'. ``configs``:
    the caches' configs when ``runs`` does not show them all (the attention is routed
    for them).
    """
    runs = list(runs)

    def refill(rows):
        joining = list(more(rows))
        runs.extend(joining)
        return [run.row for run in joining]

    configs = list(configs or []) + [run.config for run in runs]
    with attention_routing(model, configs):
        decode_rows(model, [run.row for run in runs], batch=batch, refill=refill if more is not None else None)
    weights = weights_bytes(model)
    forced = [run for run in runs if run.reference is not None]
    fidelities = dict(zip(map(id, forced), _teacher_force_runs(model, forced)))
    return [_finish(tokenizer, run, weights, fidelities.get(id(run))) for run in runs]


def weights_bytes(model) -> int:
    """Bytes of the model's parameters, as held."""
    return sum(array.nbytes for _, array in tree_flatten(model.parameters()))


def peak_memory(weights: int, prefill_peak: int, held_after_decode: int) -> int:
    """One document x variant's peak memory, whatever was decoding beside it and wherever it sat in a batch.

    The model's ``weights``, plus the larger of its own prefill's peak above
    what the process held when that prefill started (its caches, activations
    and attention scores; other documents' rows excluded) and the bytes its
    caches hold when decoding ends (measured from the arrays).
    """
    return weights + max(prefill_peak, held_after_decode)


def _teacher_force_runs(model, runs: list[PrefilledVariant]) -> list[Fidelity]:
    """Each run's snapshot fed its reference, all in one batched call (``teacher_force_together``)."""
    if not runs:
        return []
    with attention_routing(model, [run.config for run in runs]):
        fidelities = teacher_force_together(
            model, [(run.prefill_end, run.first_logprobs, run.reference, run.row.sampler) for run in runs]
        )
    for run in runs:
        run.prefill_end = None
    return fidelities


def _finish(tokenizer, run: PrefilledVariant, weights: int, fidelity: Optional[Fidelity]) -> GenerationResult:
    row = run.row
    held = sum(getattr(cache, "nbytes", 0) for cache in row.caches)
    return GenerationResult(
        output=tokenizer.decode(row.tokens),
        prompt_tokens=run.prompt_tokens,
        output_tokens=len(row.tokens),
        prefill_seconds=run.prefill_seconds,
        decode_seconds=row.decode_seconds,
        peak_memory_bytes=peak_memory(weights, run.prefill_peak_bytes, held),
        stop_reason=row.stop_reason,
        layer_stats=run.layer_stats,
        token_ids=row.tokens,
        logprobs=row.token_logprobs,
        fidelity=fidelity,
        decode_batch_size=row.batch_size,
        reading_seconds=run.reading_seconds,
        draft_seconds=run.draft_seconds,
    )


def teacher_force(
    model, caches, first_logprobs: mx.array, reference: Reference, *, choice: Optional[TokenChoice] = None
) -> Fidelity:
    """Feed ``reference`` to ``caches`` (as they were when prefill ended) and compare predictions.

    ``first_logprobs`` ``[1, V]`` are the prefill's last-position log-probabilities,
    which predict the first reference token; each reference token then predicts the next.
    The reference goes in as one forward pass (the cost of a few decode steps, not
    one per token), so the caches hold it whole while it is scored: what is measured
    is the prompt the cache kept at the end of prefill, not decode-time eviction
    (as kvpress measures; issue #11 found growing instead of evicting during decode
    changes no agreement figure).
    """
    start = time.perf_counter()
    tokens = list(reference.token_ids)
    logits = model(mx.array([tokens[:-1]]), cache=caches)[0] if len(tokens) > 1 else None
    fidelity = _compare(first_logprobs, logits, reference, choice)
    return replace(fidelity, seconds=time.perf_counter() - start)


def teacher_force_together(model, items: list[tuple]) -> list[Fidelity]:
    """``teacher_force`` for many stacks at once: ``items`` are ``(caches, first_logprobs, reference, choice)``.

    Every stack takes its reference in one batched model call
    (``velox_cache.generation.forcing.feed_together``), one stack or many, so a document's
    figures do not depend on how many were forced beside it; stacks that cannot
    be fed together are forced one at a time. The call's seconds are shared
    equally by its stacks.
    """
    start = time.perf_counter()
    fed = [i for i, (_, _, reference, _) in enumerate(items) if len(reference.token_ids) > 1]
    try:
        logits = feed_together(
            model, [items[i][0] for i in fed], [list(items[i][2].token_ids)[:-1] for i in fed]
        ) if fed else []
    except BatchUnsupported:
        return [teacher_force(model, caches, first, reference, choice=choice) for caches, first, reference, choice in items]
    by_item = dict(zip(fed, logits))
    fidelities = [
        _compare(first, by_item.get(i), reference, choice) for i, (_, first, reference, choice) in enumerate(items)
    ]
    seconds = (time.perf_counter() - start) / max(1, len(items))
    return [replace(fidelity, seconds=seconds) for fidelity in fidelities]


def _compare(first_logprobs: mx.array, logits: Optional[mx.array], reference: Reference, choice) -> Fidelity:
    """Agreement and log-likelihood gap of the predictions (``first_logprobs``, then ``logits`` ``[n - 1, V]``)."""
    tokens = list(reference.token_ids)
    n = len(tokens)
    if n == 0:
        return Fidelity(agreement=1.0, nll_gap=0.0, seconds=0.0)
    # row i predicts reference token i: the free-running output's logits processors (repetition penalty) apply
    chosen, token_logprobs = (choice or TokenSampler()).forced_choices(first_logprobs, logits, tokens)
    matches = (chosen == mx.array(tokens)).sum().item()
    gap = sum(reference.logprobs) - token_logprobs.sum().item()
    return Fidelity(agreement=matches / n, nll_gap=gap / n, seconds=0.0)


def prefill(model, prompt_tokens, caches, step: int) -> mx.array:
    """Run the prompt through ``model`` in chunks of ``step`` tokens; returns the last logits ``[1, V]``.

    Exactly like ``mlx_lm.generate_step``, phases not told: all but the last
    token in chunks (evaluating the cache state after each), then the last
    token alone, which ends prefill (the caches' fallback inference).
    """
    prompt = mx.array(prompt_tokens)
    for begin in range(0, prompt.size - 1, step):
        model(prompt[None, begin : min(begin + step, prompt.size - 1)], cache=caches)
        mx.eval([c.state for c in caches])
    return model(prompt[None, -1:], cache=caches)[:, -1, :]


def layer_rows(caches: list) -> list[dict]:
    """The ``layer_stats`` rows of a cache stack as it is now (a row's are taken when prefill ends)."""
    return [_layer_row(i, cache) for i, cache in enumerate(caches)]


def _layer_row(layer: int, cache) -> dict:
    """One ``layer_stats`` row for any entry of the cache list (Velox or kept as the model made it)."""
    row = layer_stats(layer, cache)
    row.pop("offset")
    if row["method"] is None:
        row.pop("method")  # a layer Velox left alone: the store fills in the document's method
    return row
