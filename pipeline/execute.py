"""Execute: one document's due variants on a loaded model; rows out, no store, no side effects.

This is what the in-process engine calls in its own process and what each Ray worker
calls in its own. A variant that raises is an outcome with its error, never an
exception: the other variants of the document still run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from velox_cache.generation.reading import NotDerivable, derivable, reading_recipe

from . import model_store
from .generation import (
    GenerationResult,
    Reading,
    cut_shared,
    draft_together,
    frontier_rows,
    generate_together,
    prefill_variant,
    read_shared,
)
from .plan import FrontierPoint, WorkItem
from .schedule import DecodeAdmission, variant_order
from .platform import set_blas_threads
from .reference import Reference


@dataclass
class VariantOutcome:
    """One variant of one document: its generation result, or the error that stopped it.

    ``fidelity_note``: why a compressed variant that ran has no teacher-forced fidelity.
    """

    variant: str
    result: Optional[GenerationResult] = None
    error: Optional[str] = None
    fidelity_note: Optional[str] = None


@dataclass
class FrontierOutcome:
    """One document's frontier points measured in this item (after its variants' outcomes).

    ``points``: one dict per ``FrontierPoint`` of the item: its ``key``, ``status``
    (``done``, ``skipped`` where the variant cannot be cut from one reading, ``error``),
    ``note`` (why not done) and, when done, what ``generation.frontier_rows`` measured.
    """

    points: list = field(default_factory=list)


NO_STORED_REFERENCE = "no full-cache output of this prompt: the full variant is not in this job, or not done yet"
OWN_PROMPT = "its prompt differs from the full variant's (streamed past the model's context)"


class References:
    """Each item's full-cache output that its compressed variants are teacher-forced on, or why there is none."""

    def __init__(self, items: list[WorkItem]):
        self._reference = {item.index: item.reference for item in items}
        self._missing = {item.index: None if item.reference is not None else NO_STORED_REFERENCE for item in items}

    def of(self, item: WorkItem) -> tuple[Optional[Reference], Optional[str]]:
        """``(reference, None)`` or ``(None, why there is none)``."""
        return self._reference[item.index], self._missing[item.index]

    def made(self, item: WorkItem, reference: Reference) -> None:
        self._reference[item.index], self._missing[item.index] = reference, None

    def failed(self, item: WorkItem, error: str) -> None:
        self._reference[item.index], self._missing[item.index] = None, f"the full variant failed: {error}"


def execute(model, tokenizer, item: WorkItem) -> list:
    """Run every variant due on ``item`` with a fresh cache stack each, in order (full first).

    Compressed variants are teacher-forced on the full cache's output: this item's
    full variant's when it is due here (none when it failed), else ``item.reference``;
    a streaming variant whose prompt differs (``item.streamed``) has no reference.
    Each variant is prefilled by phases with its prompt's split. One ``VariantOutcome``
    per variant, then a ``FrontierOutcome`` when the item has frontier points due.
    """
    return execute_group(model, tokenizer, [item])[0]


def execute_group(model, tokenizer, items: list[WorkItem]) -> list[list]:
    """``execute`` for several documents at once, their variants decoding in batches; outcomes per item.

    Variant by variant (``schedule.variant_order``: the full cache first, so that
    its outputs are the references of the others), each due document is prefilled
    when the decoding batch has room for it and joins the batch
    (``schedule.DecodeAdmission``: ``generation.decode_batch_size`` rows at most,
    their caches within ``generation.decode_batch_memory_mb``); a finished row's
    place goes to the next document. The outcomes are those ``execute`` gives each
    item alone (timings aside). Frontier points are measured from the full
    variant's reading once its variant has decoded, else (no full variant due, or it
    was redone alone) from a reading of their own once the item's variants are done.
    """
    if not items:
        return []
    outcomes = {item.index: {} for item in items}
    references = References(items)
    readings = SharedReadings(model, tokenizer)
    frontiers: dict[int, FrontierOutcome] = {}
    for name in variant_order(items):
        due = [(item, variant) for item in items for variant in item.variants if variant.name == name]
        readings.draft_together(due, references, items[0].generation)
        work = _prefilled(model, tokenizer, due, references, outcomes, readings)
        _decode_stream(model, tokenizer, work, items[0].generation, references, outcomes, frontiers,
                       configs=[due[0][1].cache])
    for item in items:
        if item.frontier and item.index not in frontiers:
            frontiers[item.index] = measure_frontier(model, tokenizer, item, references)
    return [
        [outcomes[item.index][variant.name] for variant in item.variants]
        + ([frontiers[item.index]] if item.index in frontiers else [])
        for item in items
    ]


def _prefilled(model, tokenizer, due: list, references: "References", outcomes, readings) -> Iterator["_Prefilled"]:
    """Each ``(item, variant)`` of ``due`` prefilled when pulled, in order (one that fails is an outcome, not yielded)."""
    for item, variant in due:
        prefilled = _prefill(model, tokenizer, item, variant, references, outcomes, readings)
        if prefilled is not None:
            yield prefilled


@dataclass
class _Prefilled:
    """One item's variant, prefilled and waiting to decode."""

    item: WorkItem
    variant: object
    run: object  # generation.PrefilledVariant
    fidelity_note: Optional[str]


class SharedReadings:
    """Each item's variants that can share one reading (the full cache and ``prefill_end`` variants of one
    prompt): read the first time one of them is due, then each variant's run cut when it is due.

    Variants with a ``lookahead`` are cut after the full variant decoded: its output is
    their draft (``Reading.feed_draft``), so drafting costs one call, not a decode, where
    that output is the draft their own prefill makes (``output_is_draft``); otherwise the
    reading drafts greedily itself, and where no full variant is read, the group's
    readings draft together in one batch (``draft_together``) before any is cut.
    """

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self._readings: dict = {}  # item index -> [Reading or the reading's error or None, variant names still due]

    @staticmethod
    def sharing(item: WorkItem) -> list:
        """The variants of ``item`` that read its bounded prompt and can share one reading.

        None unless two can, or the full variant can and the item measures a frontier
        point, or none is the full variant and one looks ahead (its reading's draft then
        decodes in a batch with the group's: ``draft_together``).
        """
        found = [variant for variant in item.variants if derivable(variant.cache)]
        full = any(variant.cache.method == "full" for variant in found)
        measured = any(derivable(point.variant.cache) for point in item.frontier)
        drafted = not full and any(variant.cache.lookahead for variant in found)
        return found if len(found) > 1 or (full and measured) or drafted else []

    def draft_together(self, due: list, references: "References", settings) -> None:
        """The drafts of ``due``'s ``(item, variant)`` readings that have no full-cache output to draft from,
        decoded in one batch (``generation.draft_together``; each reading is read now if it was not)."""
        waiting = []
        for item, variant in due:
            if not variant.cache.lookahead:
                continue
            if item.index not in self._readings:
                sharing = self.sharing(item)
                if variant not in sharing:
                    continue
                self._readings[item.index] = self._read(item, sharing)
            reading = self._readings[item.index].reading
            if not isinstance(reading, Reading) or reading.shared.looked_ahead or _serves_full(reading):
                continue
            if any(reading is other for other in waiting):
                continue
            if self._draft_from(item, reading, references) is None:  # else the full variant's output is the draft
                waiting.append(reading)
        try:
            draft_together(self.model, waiting, budget_bytes=settings.decode_batch_memory_mb * 2**20,
                           max_rows=settings.decode_batch_size)
        except Exception:  # noqa: BLE001 - their full stacks may hold part of a draft: each variant reads on its own
            for entry in self._readings.values():
                if any(entry.reading is reading for reading in waiting):
                    entry.reading = None

    def take(self, item: WorkItem, variant, references: "References"):
        """``variant``'s run from ``item``'s shared reading (read now if it is the first); None when it has none.

        Raises the reading's error, for each variant that shared it. Each run's
        ``prefill_seconds`` carries the reading (``cut_shared``); the full variant's run
        carries the reading itself (``run.reading``) where the item measures a frontier.
        """
        if item.index not in self._readings:
            sharing = self.sharing(item)
            if variant not in sharing:
                return None
            self._readings[item.index] = self._read(item, sharing)
        entry = self._readings[item.index]
        if variant.name not in entry.due:
            return None
        entry.due.discard(variant.name)
        if not entry.due:
            del self._readings[item.index]
        if isinstance(entry.reading, Exception):
            raise entry.reading
        if entry.reading is None:
            return None
        if variant.cache.lookahead and not entry.reading.shared.looked_ahead:
            reference = self._draft_from(item, entry.reading, references)
            if reference is not None:
                entry.reading.feed_draft(reference.token_ids)
            elif _serves_full(entry.reading):  # its full stack decoded (or failed): this variant reads on its own
                return None
            else:  # no draft was decoded for it (``draft_together``): it drafts alone now
                entry.reading.draft_alone()
        run = cut_shared(self.tokenizer, entry.reading, variant.cache, item.generation)
        if entry.frontier and variant.cache.method == "full":
            run.reading = entry.reading
        return run

    def _read(self, item: WorkItem, sharing: list) -> "_Reading":
        full_first = sharing[0].cache.method == "full"
        also_read = [point_config(point) for point in item.frontier if derivable(point.variant.cache)] if full_first else []
        configs = [v.cache for v in sharing] + also_read
        # no draft now where the full variant's output is the draft (it comes after decoding), nor where no full
        # variant is read: the group's drafts decode together (``draft_together``)
        later = output_is_draft(item.generation, configs) if any(c.method == "full" for c in configs) else True
        try:
            reading = read_shared(self.model, self.tokenizer, item.prompt, configs, item.generation, draft=not later,
                                  variants=len(sharing))
        except NotDerivable:  # e.g. a model with layers Velox leaves alone: each variant reads its own
            reading = None
        except Exception as exc:  # noqa: BLE001 - every variant of the reading fails with it
            reading = exc
        return _Reading(reading, {v.name for v in sharing}, bool(also_read))


    @staticmethod
    def _draft_from(item: WorkItem, reading: "Reading", references: "References") -> Optional[Reference]:
        """The full variant's output where it is the draft ``reading``'s configs would make (else None)."""
        reference, _ = references.of(item)
        return reference if reference is not None and output_is_draft(item.generation, reading.shared.configs) else None


def _serves_full(reading: "Reading") -> bool:
    """True when ``reading``'s full stack is the full variant's own (so nothing else may decode on it)."""
    return any(config.method == "full" for config in reading.shared.configs)


@dataclass
class _Reading:
    """One item's reading (or its error, or None: not derivable), the variants still to cut from it."""

    reading: object  # generation.Reading, an Exception, or None
    due: set
    frontier: bool


def output_is_draft(settings, configs) -> bool:
    """True when the full variant's output is the draft each config's own prefill makes, token for token.

    A config alone drafts its ``lookahead`` tokens greedily; the full variant's output
    is the same tokens only under greedy decoding with no repetition penalty, and only
    when it is long enough (``lookahead <= max_tokens``). Otherwise a shared reading
    drafts greedily itself, so that nothing flatters a fidelity figure.
    """
    greedy = settings.temperature == 0 and settings.repetition_penalty in (None, 1, 1.0)
    return greedy and all(config.lookahead <= settings.max_tokens for config in configs)


def point_config(point: FrontierPoint):
    """The config of a frontier point: its variant's cache at the point's budget and ``kv_bits``."""
    return point.variant.at_point(point.budget, point.kv_bits)


def measure_frontier(model, tokenizer, item: WorkItem, references: References,
                     reading: Optional[Reading] = None) -> FrontierOutcome:
    """Every frontier point of ``item``: measured from ``reading`` (else a reading of its own), or why not.

    A point whose variant cannot be cut from one reading (it evicts while reading) is
    ``skipped`` with the reason; without a full-cache output to measure against, or when
    measuring fails, each point is an ``error`` (measured again next run).
    """
    points, results = [], []
    for point in item.frontier:
        why = _not_derivable(point.variant.cache)
        if why is None:
            points.append(point)
        else:
            results.append({"key": point.key, "status": "skipped", "note": why})
    reference, missing = references.of(item)
    if points and reference is None:
        return FrontierOutcome(results + [{"key": p.key, "status": "error", "note": missing} for p in points])
    try:
        if points:
            configs = [point_config(point) for point in points]
            if reading is None:
                reading = read_shared(model, tokenizer, item.prompt, configs, item.generation, variants=0,
                                      draft=not output_is_draft(item.generation, configs))
            measured = frontier_rows(model, reading, [(p.variant.name, p.budget, c) for p, c in zip(points, configs)],
                                     reference, item.generation)
            results += [{"key": p.key, "status": "done", **row} for p, row in zip(points, measured)]
    except NotDerivable as exc:  # e.g. a model with layers Velox leaves alone: no reading can serve them, ever
        results = [r for r in results if r["status"] == "skipped"]
        results += [{"key": p.key, "status": "skipped", "note": str(exc)} for p in points]
    except Exception as exc:  # noqa: BLE001 - the document's rows stand; the points say why, and are redone
        note = f"{type(exc).__name__}: {exc}"
        results = [r for r in results if r["status"] == "skipped"]
        results += [{"key": p.key, "status": "error", "note": note} for p in points]
    return FrontierOutcome(results)


def _not_derivable(config) -> Optional[str]:
    """Why ``config``'s stack cannot be cut from one reading (None: it can)."""
    try:
        reading_recipe(config)
    except NotDerivable as exc:
        return str(exc)
    return None


def _prefill(model, tokenizer, item, variant, references: References, outcomes,
             readings: Optional[SharedReadings] = None) -> Optional[_Prefilled]:
    is_full = variant.cache.method == "full"
    prompt = item.prompt_for(variant)
    own_prompt = item.streamed is not None and prompt is item.streamed
    reference, missing = (None, None) if is_full else (None, OWN_PROMPT) if own_prompt else references.of(item)
    try:
        shared = readings.take(item, variant, references) if readings is not None else None
        if shared is not None:
            shared.refer_to(reference)
            return _Prefilled(item, variant, shared, missing)
        run = prefill_variant(
            model, tokenizer, prompt.tokens, variant.cache, item.generation,
            reference=reference,
            document_span=(prompt.document_start, prompt.document_end),
        )
    except Exception as exc:  # one bad document must not stop the night's run
        _failed(item, variant, f"{type(exc).__name__}: {exc}", references, outcomes)
        return None
    return _Prefilled(item, variant, run, missing)


def _decode_stream(model, tokenizer, work: Iterator["_Prefilled"], settings, references: References, outcomes,
                   frontiers: dict, configs: list) -> None:
    """Decode ``work`` as it is admitted (``schedule.DecodeAdmission``), then record each outcome (``_record``).

    When decoding fails, every variant it had taken is prefilled again and decoded
    alone, so one bad row fails alone; the work not taken yet decodes as before.
    """
    admission = DecodeAdmission(work, budget_bytes=settings.decode_batch_memory_mb * 2**20,
                                max_rows=settings.decode_batch_size, row_of=lambda prefilled: prefilled.run.row)
    try:
        results = generate_together(model, tokenizer, [], configs=configs,
                                    more=lambda rows: [prefilled.run for prefilled in admission(rows)],
                                    batch=settings.decode_batch_size > 1)
    except Exception as exc:
        taken, admission.taken = admission.taken, []
        if len(taken) == 1:
            _failed(taken[0].item, taken[0].variant, f"{type(exc).__name__}: {exc}", references, outcomes)
        else:
            again = [(p.item, p.variant) for p in taken]
            taken.clear()  # the failed batch's caches go before the rows are prefilled again
            for item, variant in again:
                prefilled = _prefill(model, tokenizer, item, variant, references, outcomes)
                if prefilled is not None:
                    _decode_stream(model, tokenizer, iter([prefilled]), settings, references, outcomes, frontiers,
                                   configs)
        _decode_stream(model, tokenizer, admission.rest(), settings, references, outcomes, frontiers, configs)
        return
    for prefilled, result in zip(admission.taken, results):
        _record(model, tokenizer, prefilled, result, references, outcomes, frontiers)


def _record(model, tokenizer, prefilled: _Prefilled, result, references: References, outcomes, frontiers: dict) -> None:
    """One decoded variant's outcome; a full variant's output becomes its item's reference and, where the
    variant kept its item's reading, the item's frontier is measured from it at once (then the reading goes)."""
    item, variant = prefilled.item, prefilled.variant
    note = prefilled.fidelity_note if result.fidelity is None else None
    outcomes[item.index][variant.name] = VariantOutcome(variant.name, result=result, fidelity_note=note)
    if variant.cache.method == "full":
        references.made(item, Reference.of_output(result.token_ids, result.logprobs))
        reading, prefilled.run.reading = prefilled.run.reading, None
        if reading is not None and item.frontier:
            frontiers[item.index] = measure_frontier(model, tokenizer, item, references, reading)


def _failed(item, variant, error: str, references: References, outcomes) -> None:
    outcomes[item.index][variant.name] = VariantOutcome(variant.name, error=error)
    if variant.cache.method == "full":
        references.failed(item, error)


def failed_outcomes(item: WorkItem, error: str) -> list:
    """Every variant of ``item`` failed with ``error`` (what a driver records when no worker could run it),
    and so did its frontier points."""
    frontier = [FrontierOutcome([{"key": p.key, "status": "error", "note": error} for p in item.frontier])]
    return [VariantOutcome(variant.name, error=error) for variant in item.variants] + (frontier if item.frontier else [])


@dataclass
class Executor:
    """``execute`` with a model loaded on first use, in the thread that first calls it.

    MLX streams and unevaluated arrays belong to the thread that made them, and Ray
    calls a worker's methods from another thread than its constructor, so nothing
    MLX is touched before the first call. ``weights`` is the driver's weights mode
    (part of every document's key), so every worker loads the same weights.
    ``blas_threads``, when set, caps this process's BLAS threads first. ``load_model``
    is called as ``load_model(model, weights=weights)``.
    """

    model: str
    weights: str
    blas_threads: Optional[int] = None
    load_model: Callable = model_store.load_model

    def __post_init__(self):
        self._loaded = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_loaded"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._loaded = None

    def __call__(self, item: WorkItem) -> list[VariantOutcome]:
        return self.run_group([item])[0]

    def run_group(self, items: list[WorkItem]) -> list[list[VariantOutcome]]:
        """``execute_group`` on this executor's model (loaded on first use); outcomes per item."""
        if self._loaded is None:
            if self.blas_threads:
                set_blas_threads(self.blas_threads)
            try:
                self._loaded = self.load_model(self.model, weights=self.weights)
            except Exception as exc:  # the driver checked the model resolves; this worker cannot load it
                return [failed_outcomes(item, f"model: {type(exc).__name__}: {exc}") for item in items]
        model, tokenizer = self._loaded
        return execute_group(model, tokenizer, items)
