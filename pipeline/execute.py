"""Execute: one document's due variants on a loaded model; rows out, no store, no side effects.

This is what the in-process engine calls in its own process and what each Ray worker
calls in its own. A variant that raises is an outcome with its error, never an
exception: the other variants of the document still run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from . import model_store
from .generation import GenerationResult, generate
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
    outcomes = []
    reference = item.reference
    for variant in item.variants:
        is_full = variant.cache.method == "full"
        prompt = item.prompt_for(variant)
        own_prompt = item.streamed is not None and prompt is item.streamed  # reads more than the full variant
        try:
            result = generate(
                model, tokenizer, prompt.tokens, variant.cache, item.generation,
                reference=None if is_full or own_prompt else reference,
                document_span=(prompt.document_start, prompt.document_end),
            )
        except Exception as exc:  # one bad document must not stop the night's run
            outcomes.append(VariantOutcome(variant.name, error=f"{type(exc).__name__}: {exc}"))
            if is_full:
                reference = None
        else:
            outcomes.append(VariantOutcome(variant.name, result=result))
            if is_full:
                reference = Reference.of_output(result.token_ids, result.logprobs)
    return outcomes


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
        if self._loaded is None:
            if self.blas_threads:
                set_blas_threads(self.blas_threads)
            try:
                self._loaded = self.load_model(self.model, weights=self.weights)
            except Exception as exc:  # the driver checked the model resolves; this worker cannot load it
                return failed_outcomes(item, f"model: {type(exc).__name__}: {exc}")
        model, tokenizer = self._loaded
        return execute(model, tokenizer, item)
