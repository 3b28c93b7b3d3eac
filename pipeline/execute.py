"""Execute: one document's due variants on a loaded model; rows out, no store, no side effects.

This is what the in-process engine calls in its own process and what each Ray worker
calls in its own. A variant that raises is an outcome with its error, never an
exception: the other variants of the document still run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from . import model_store
from .generation import GenerationResult, generate_together, prefill_variant
from .plan import WorkItem
from .platform import set_blas_threads
from .reference import Reference


@dataclass
class VariantOutcome:
    """One variant of one document: its generation result, or the error that stopped it."""

    variant: str
    result: Optional[GenerationResult] = None
    error: Optional[str] = None


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
    references = {item.index: item.reference for item in items}
    names = list(dict.fromkeys(variant.name for item in items for variant in item.variants))
    full = {variant.name for item in items for variant in item.variants if variant.cache.method == "full"}
    names.sort(key=lambda name: name not in full)  # the references first, whichever item comes first
    for name in names:
        pending = []
        for item in items:
            variant = next((v for v in item.variants if v.name == name), None)
            if variant is None:
                continue
            run = _prefill(model, tokenizer, item, variant, references, outcomes)
            if run is not None:
                pending.append((item, variant, run))
            if len(pending) >= settings.decode_batch_size or sum(r.held_bytes for _, _, r in pending) >= cap:
                _decode(model, tokenizer, pending, references, outcomes)
                pending = []
        _decode(model, tokenizer, pending, references, outcomes)
    return [[outcomes[item.index][variant.name] for variant in item.variants] for item in items]


def _prefill(model, tokenizer, item, variant, references, outcomes):
    is_full = variant.cache.method == "full"
    prompt = item.prompt_for(variant)
    own_prompt = item.streamed is not None and prompt is item.streamed
    try:
        return prefill_variant(
            model, tokenizer, prompt.tokens, variant.cache, item.generation,
            reference=None if is_full or own_prompt else references[item.index],
            document_span=(prompt.document_start, prompt.document_end),
        )
    except Exception as exc:  # one bad document must not stop the night's run
        outcomes[item.index][variant.name] = VariantOutcome(variant.name, error=f"{type(exc).__name__}: {exc}")
        if is_full:
            references[item.index] = None
        return None


def _decode(model, tokenizer, pending, references, outcomes) -> None:
    if not pending:
        return
    try:
        results = generate_together(model, tokenizer, [run for _, _, run in pending])
    except Exception as exc:  # the batch failed as one: each of its variants failed
        results = [f"{type(exc).__name__}: {exc}"] * len(pending)
    for (item, variant, _), result in zip(pending, results):
        if isinstance(result, str):
            outcomes[item.index][variant.name] = VariantOutcome(variant.name, error=result)
            if variant.cache.method == "full":
                references[item.index] = None
            continue
        outcomes[item.index][variant.name] = VariantOutcome(variant.name, result=result)
        if variant.cache.method == "full":
            references[item.index] = Reference.of_output(result.token_ids, result.logprobs)


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
