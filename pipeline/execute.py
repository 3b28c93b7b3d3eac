"""Execute: one document's due variants on a loaded model; rows out, no store, no side effects.

This is what the in-process engine calls in its own process and what each Ray worker
calls in its own. A variant that raises is an outcome with its error, never an
exception: the other variants of the document still run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from velox_cache.generation.reading import NotDerivable, derivable

from . import model_store
from .generation import (
    GenerationResult,
    cut_shared,
    frontier_rows,
    generate_together,
    prefill_variant,
    read_shared,
)
from .plan import WorkItem
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
    frontier: list = field(default_factory=list)  # the full variant's: one row per (compressed variant, budget)


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


def execute(model, tokenizer, item: WorkItem) -> list[VariantOutcome]:
    """Run every variant due on ``item`` with a fresh cache stack each, in order (full first).

    Compressed variants are teacher-forced on the full cache's output: this item's
    full variant's when it is due here (none when it failed), else ``item.reference``;
    a streaming variant whose prompt differs (``item.streamed``) has no reference.
    Each variant is prefilled by phases with its prompt's split.
    """
    return execute_group(model, tokenizer, [item])[0]


def execute_group(model, tokenizer, items: list[WorkItem]) -> list[list[VariantOutcome]]:
    """``execute`` for several documents at once, their variants decoding in batches; outcomes per item.

    Variant by variant (the full cache first, so that its outputs are the
    references of the others), each due document is prefilled in turn and the
    prefilled ones decode together: ``generation.decode_batch_size`` of them,
    fewer once their caches hold ``generation.decode_batch_memory_mb``. The
    outcomes are those ``execute`` gives each item alone (timings aside).
    """
    if not items:
        return []
    settings = items[0].generation
    cap = settings.decode_batch_memory_mb * 2**20
    outcomes = {item.index: {} for item in items}
    references = References(items)
    readings = SharedReadings(model, tokenizer)
    names = list(dict.fromkeys(variant.name for item in items for variant in item.variants))
    full = {variant.name for item in items for variant in item.variants if variant.cache.method == "full"}
    names.sort(key=lambda name: name not in full)  # the references first, whichever item comes first
    for name in names:
        pending = []
        for item in items:
            variant = next((v for v in item.variants if v.name == name), None)
            if variant is None:
                continue
            prefilled = _prefill(model, tokenizer, item, variant, references, outcomes, readings)
            if prefilled is not None:
                pending.append(prefilled)
            if len(pending) >= settings.decode_batch_size or sum(p.run.held_bytes for p in pending) >= cap:
                _decode(model, tokenizer, pending, references, outcomes)
                pending = []
        _decode(model, tokenizer, pending, references, outcomes)
    return [[outcomes[item.index][variant.name] for variant in item.variants] for item in items]


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
    their draft (``SharedReading.look_ahead``), so drafting costs one call, not a decode.
    """

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self._readings: dict = {}  # item index -> [Reading or the reading's error or None, variant names still due]

    @staticmethod
    def sharing(item: WorkItem) -> list:
        """The variants of ``item`` that read its bounded prompt and can share one reading.

        None unless two can, or the full variant can and the job measures a frontier.
        """
        found = [variant for variant in item.variants if derivable(variant.cache)]
        full = any(variant.cache.method == "full" for variant in found)
        return found if len(found) > 1 or (full and frontier_points(item)) else []

    def take(self, item: WorkItem, variant, references: "References"):
        """``variant``'s run from ``item``'s shared reading (read now if it is the first); None when it has none.

        Raises the reading's error, for each variant that shared it. The first run
        (the full variant's, when there is one) carries the reading's seconds and,
        where the job measures a frontier, the reading itself (``run.reading``);
        a look-ahead's call counts to the first variant that needs it.
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
        shared, ahead = entry.reading.shared, 0.0
        if variant.cache.lookahead and not shared.looked_ahead:
            reference, _ = references.of(item)
            if reference is None:  # the full variant failed: no draft; this variant reads on its own
                return None
            start = time.perf_counter()
            shared.look_ahead(reference.token_ids)
            ahead = time.perf_counter() - start
        first = variant.name == entry.first
        run = cut_shared(self.tokenizer, entry.reading, variant.cache, item.generation, with_reading=first)
        run.prefill_seconds += ahead
        if first and entry.frontier:
            run.reading = shared
        return run

    def _read(self, item: WorkItem, sharing: list) -> "_Reading":
        full_first = sharing[0].cache.method == "full"
        also_read = [config for _, _, config in frontier_points(item)] if full_first else []
        try:  # with the full variant, its own output is the look-ahead's draft: none drafted now
            reading = read_shared(self.model, self.tokenizer, item.prompt, [v.cache for v in sharing] + also_read,
                                  item.generation, draft=not full_first)
        except NotDerivable:  # e.g. a model with layers Velox leaves alone: each variant reads its own
            reading = None
        except Exception as exc:  # noqa: BLE001 - every variant of the reading fails with it
            reading = exc
        return _Reading(reading, {v.name for v in sharing}, sharing[0].name, bool(also_read))


@dataclass
class _Reading:
    """One item's reading (or its error, or None: not derivable), the variants still to cut from it."""

    reading: object  # generation.Reading, an Exception, or None
    due: set
    first: str
    frontier: bool


def frontier_points(item: WorkItem) -> list:
    """``[(variant name, budget, config at that budget)]``: the frontier this item's reading measures."""
    return [
        (variant.name, budget, replace(variant.cache, budget=budget, resolved_budget=None))
        for variant, budget in item.frontier
        if derivable(variant.cache)
    ]


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


def _decode(model, tokenizer, pending: list[_Prefilled], references: References, outcomes) -> None:
    """Decode ``pending`` together; when that fails, each again alone (a fresh prefill), so one bad row fails alone."""
    if not pending:
        return
    try:
        results = generate_together(model, tokenizer, [p.run for p in pending])
    except Exception as exc:
        if len(pending) == 1:
            _failed(pending[0].item, pending[0].variant, f"{type(exc).__name__}: {exc}", references, outcomes)
            return
        again = [(p.item, p.variant) for p in pending]
        pending.clear()  # the failed batch's caches go before the rows are prefilled again
        for item, variant in again:
            prefilled = _prefill(model, tokenizer, item, variant, references, outcomes)
            if prefilled is not None:
                _decode(model, tokenizer, [prefilled], references, outcomes)
        return
    for prefilled, result in zip(pending, results):
        item, variant = prefilled.item, prefilled.variant
        note = prefilled.fidelity_note if result.fidelity is None else None
        outcome = VariantOutcome(variant.name, result=result, fidelity_note=note)
        outcomes[item.index][variant.name] = outcome
        if variant.cache.method == "full":
            reference = Reference.of_output(result.token_ids, result.logprobs)
            references.made(item, reference)
            if prefilled.run.reading is not None:
                try:
                    outcome.frontier = frontier_rows(model, prefilled.run, frontier_points(item), reference,
                                                     item.generation)
                except Exception as exc:  # noqa: BLE001 - the full output stands; the store says why no frontier
                    prefilled.run.reading = None
                    outcome.fidelity_note = f"frontier: {type(exc).__name__}: {exc}"


def _failed(item, variant, error: str, references: References, outcomes) -> None:
    outcomes[item.index][variant.name] = VariantOutcome(variant.name, error=error)
    if variant.cache.method == "full":
        references.failed(item, error)


def failed_outcomes(item: WorkItem, error: str) -> list[VariantOutcome]:
    """Every variant of ``item`` failed with ``error`` (what a driver records when no worker could run it)."""
    return [VariantOutcome(variant.name, error=error) for variant in item.variants]


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
