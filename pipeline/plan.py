"""Plan: which document × variant work is due, decided from the input and store reads only.

Both engines run the same plan. Each document's prompt is built once on the driver
(its token ids key the work); a document × variant already stored as done with the
same key is ``unchanged`` and never dispatched; one without a prompt (too long,
empty, undecodable) is settled as ``skipped`` or ``failed`` without running. What
is left becomes one ``WorkItem`` per document: the prompt and the variants due on
it, the full cache first, which is all a worker needs; compressed variants are
teacher-forced on the full cache's output, made in the same item or read from the
store here.

Streaming variants (``eviction: streaming``) read documents past the model's
context, so their prompt is bounded by ``limits.max_prompt_tokens`` only; where
that makes it differ from the other variants' (cut to the context, or refused),
they get their own prompt, prompt hash and key (``DocumentPlan.streamed``), and a
work item carries both prompts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Iterator, Optional

from .prompting import Prompt, PromptTooLong, build_prompt, tokens_hash
from .reference import Reference
from .source import Document, iter_documents
from .spec import GenerationSpec, JobSpec, Variant, quantization_settings, variant_hash


@dataclass
class PreparedDocument:
    """A document's prompt, or why it has none, and what keys its work."""

    document: Document
    basis: str  # the prompt tokens' hash, or the content hash of a document without a prompt
    prompt: Optional[Prompt] = None
    prompt_hash: Optional[str] = None
    prompt_tokens: Optional[int] = None
    status: str = "ready"  # ready, skipped or error
    error: Optional[str] = None


@dataclass
class VariantPlan:
    """One document × variant: its key and what to do (its row: ``pipeline.rows.document_row``).

    ``state`` is ``due`` (to run), ``unchanged`` (stored as done before; ``stored_row``
    is that row, ``stored_is_latest`` whether it is already its variant's latest),
    ``skipped`` or ``failed`` (no prompt; ``prepared.error`` says why).
    """

    variant: Variant
    key: str
    state: str
    stored_row: Optional[int] = None
    stored_is_latest: bool = True


@dataclass
class WorkItem:
    """What a worker needs for one document: its prompt tokens and the variants due on it.

    ``prompt_tokens[document_start:document_end]`` is the document (``document_end``
    None: the whole prompt; before it the prefix, after it the instruction).
    ``streamed`` is the streaming variants' prompt when it differs from
    ``prompt_tokens`` (which the others' context then cut); None otherwise.
    """

    index: int  # the document's position in this run's input
    document_id: str
    prompt_tokens: list[int]
    variants: list[Variant]  # the full cache first
    generation: GenerationSpec
    reference: Optional[Reference] = None  # the stored full-cache output, when the full variant is not due
    document_start: int = 0
    document_end: Optional[int] = None
    streamed: Optional[Prompt] = None
    frontier: list = field(default_factory=list)  # [FrontierPoint] not measured yet under its key

    @property
    def prompt(self) -> Prompt:
        """``prompt_tokens`` with its split."""
        return Prompt(self.prompt_tokens, document_start=self.document_start, document_end=self.document_end)

    def prompt_for(self, variant: Variant) -> Prompt:
        """The prompt ``variant`` reads."""
        if self.streamed is not None and streams(variant):
            return self.streamed
        return self.prompt


@dataclass
class FrontierPoint:
    """One compressed variant's policy at one budget on one document's prompt: one ``frontier`` row.

    ``key`` names what produces it (the document, its prompt, the model and generation
    settings, the variant's own settings and the budget): a point is measured when no
    row of its key is stored as done or skipped.
    """

    variant: Variant  # as it reads this prompt
    budget: object  # tokens, or a share of the prompt ("25%")
    key: str
    kv_bits: Optional[int] = None  # what its kept tokens are quantized to (None: float)


def frontier_key(document_id: str, basis: str, settings_hash: str, variant: Variant, budget,
                 kv_bits: Optional[int] = None) -> str:
    """What decides one frontier point: prompt tokens, model and generation, the variant's settings, the budget
    and how its kept tokens are quantized (named only where ``kv_bits`` is not the variant's own, so that other
    points keep their keys: the bits, and the group size and float window they run with)."""
    parts = [document_id, basis, settings_hash, variant_hash(variant), str(budget)]
    if kv_bits != variant.cache.kv_bits:
        parts.append(f"kv_bits={kv_bits}")
        if kv_bits is not None:
            parts.append(quantization_settings(variant.at_point(budget, kv_bits)))
    raw = json.dumps(parts)
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


@dataclass
class DocumentPlan:
    """One document of the input: its prompt and one ``VariantPlan`` per variant of the job.

    ``full_outputs`` maps the prompt hash of each prompt that compressed variants due
    here read, and that no full variant due here reads, to the stored full-cache
    output of that prompt (None when there is none): what their ROUGE-L is measured
    against. A prompt a due full variant reads is compared with that variant's output.
    """

    index: int
    prepared: PreparedDocument
    settings_hash: str
    variants: list[VariantPlan] = field(default_factory=list)
    work: Optional[WorkItem] = None  # None when nothing is due
    streamed: Optional[PreparedDocument] = None  # the streaming variants' prompt, when it differs
    full_outputs: dict[str, Optional[str]] = field(default_factory=dict)
    frontier_stored: list[str] = field(default_factory=list)  # keys of this prompt's points stored under today's settings

    def entry(self, variant_name: str) -> VariantPlan:
        return next(entry for entry in self.variants if entry.variant.name == variant_name)

    def prepared_for(self, variant: Variant) -> PreparedDocument:
        """The prepared prompt ``variant`` reads."""
        if self.streamed is not None and streams(variant):
            return self.streamed
        return self.prepared


def streams(variant: Variant) -> bool:
    """True for variants that read documents in bounded memory, past the model's context."""
    return variant.cache.method != "full" and variant.cache.eviction == "streaming"


def doc_key(document_id: str, basis: str, settings_hash: str, variant: Variant) -> str:
    """What decides one document × variant's output: prompt tokens, model and generation, variant."""
    raw = json.dumps([document_id, basis, settings_hash, variant_hash(variant)])
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def full_first(variants) -> list[Variant]:
    """``variants``, the full-cache ones first (compressed variants are compared with their output), each kind
    in its own order: the one rule for which variant runs first, in a plan and in a group's execution."""
    return sorted(variants, key=lambda v: v.cache.method != "full")


def ordered_variants(spec: JobSpec) -> list[Variant]:
    """The job's variants, the full cache first (``full_first``)."""
    return full_first(spec.variants)


def prepare_document(
    spec: JobSpec, tokenizer, document: Document, context: Optional[int], *, streamed_reads_it: bool = False
) -> PreparedDocument:
    """Build one document's prompt once, for every variant (of one kind: see ``prepare_documents``).

    ``streamed_reads_it``: a streaming variant reads this document whole, which a
    refusal for length then says.
    """
    if document.error:
        return PreparedDocument(document, f"content:{document.content_hash}", status="error", error=document.error)
    try:
        prompt = build_prompt(spec, tokenizer, document, context_length=context)
    except PromptTooLong as exc:
        prompt_hash = tokens_hash(exc.tokens)
        status = "skipped" if spec.limits.on_too_long == "skip" else "error"
        error = str(exc) + ("; streaming variants (eviction: streaming) read it" if streamed_reads_it else "")
        return PreparedDocument(
            document, prompt_hash, prompt_hash=prompt_hash, prompt_tokens=len(exc.tokens), status=status, error=error
        )
    prompt_hash = tokens_hash(prompt.tokens)
    return PreparedDocument(document, prompt_hash, prompt=prompt, prompt_hash=prompt_hash, prompt_tokens=len(prompt.tokens))


def prepare_documents(
    spec: JobSpec, tokenizer, document: Document, context: Optional[int]
) -> tuple[PreparedDocument, Optional[PreparedDocument]]:
    """``(prepared, streamed)``: the prompt within the context, and the streaming variants' own when it differs."""
    if not any(streams(variant) or variant.auto_eviction for variant in spec.variants):
        return prepare_document(spec, tokenizer, document, context), None
    whole = prepare_document(spec, tokenizer, document, None)
    prepared = prepare_document(spec, tokenizer, document, context, streamed_reads_it=whole.status == "ready")
    same = whole.basis == prepared.basis and whole.status == prepared.status  # a refused prompt has the same hash
    return prepared, (None if same else whole)


def plan_document(
    spec: JobSpec,
    store,
    index: int,
    prepared: PreparedDocument,
    settings_hash: str,
    *,
    force: bool = False,
    streamed: Optional[PreparedDocument] = None,
) -> DocumentPlan:
    """Decide each variant of one prepared document from the store (which reads only)."""
    plan = DocumentPlan(index, prepared, settings_hash, streamed=streamed)
    document = prepared.document
    for variant in ordered_variants(spec):
        variant = variant.for_document(fits=prepared.status == "ready")
        own = plan.prepared_for(variant)
        key = doc_key(document.document_id, own.basis, settings_hash, variant)
        found = None if force else store.find_done(key)
        if found is not None:
            entry = VariantPlan(variant, key, "unchanged", stored_row=found[0], stored_is_latest=found[1])
        elif own.status != "ready":
            entry = VariantPlan(variant, key, "skipped" if own.status == "skipped" else "failed")
        else:
            entry = VariantPlan(variant, key, "due")
        plan.variants.append(entry)
    due = [entry.variant for entry in plan.variants if entry.state == "due"]
    frontier = _frontier_due(spec, store, plan, force)
    if due or frontier:
        bounded_due = not due or any(plan.prepared_for(variant) is prepared for variant in due)
        main = prepared if bounded_due else streamed
        other = streamed.prompt if bounded_due and streamed is not None and streamed.status == "ready" else None
        reference = None
        for stored_hash, stored in _stored_full_results(store, plan, due, frontier).items():
            plan.full_outputs[stored_hash] = None if stored is None else stored["output"]
            if stored_hash == main.prompt_hash and stored is not None and stored["token_ids"] is not None:
                reference = Reference(stored["token_ids"], stored["logprobs"])
        if main is not prepared:
            frontier = []
        plan.work = WorkItem(
            index, document.document_id, list(main.prompt.tokens), due, spec.generation, reference=reference,
            document_start=main.prompt.document_start, document_end=main.prompt.document_end, streamed=other,
            frontier=frontier,
        )
    return plan


def _frontier_due(spec: JobSpec, store, plan: DocumentPlan, force: bool) -> list[FrontierPoint]:
    """The frontier points of this document's bounded prompt not stored yet under their key (all with ``force``).

    None where the prompt does not fit the context (no full-cache output to measure
    against) or the job has no full variant.
    """
    prepared = plan.prepared
    if not spec.frontier.budgets or prepared.status != "ready" or not any(v.cache.method == "full" for v in spec.variants):
        return []
    points = [
        FrontierPoint(variant.for_document(True), budget,
                      frontier_key(prepared.document.document_id, prepared.basis, plan.settings_hash,
                                   variant.for_document(True), budget, bits),
                      bits)
        for variant in spec.variants
        if variant.cache.method != "full"
        for budget in spec.frontier.budgets
        for bits in (spec.frontier.bits or [variant.cache.kv_bits])
    ]
    settled = set() if force else store.settled_frontier([point.key for point in points])
    plan.frontier_stored = [point.key for point in points if point.key in settled]
    return [point for point in points if point.key not in settled]


def _stored_full_results(store, plan: DocumentPlan, due: list[Variant], frontier: list) -> dict[str, Optional[dict]]:
    """The stored full-cache result of each prompt that compressed variants in ``due`` (or the ``frontier``)
    read and no full variant in ``due`` reads: one store read per such prompt, so at most one per
    document unless streaming variants read a prompt of their own.
    """
    made_here = {plan.prepared_for(v).prompt_hash for v in due if v.cache.method == "full"}
    found: dict[str, Optional[dict]] = {}
    if frontier and plan.prepared.prompt_hash not in made_here:
        prepared = plan.prepared
        found[prepared.prompt_hash] = store.full_reference(prepared.document.document_id, prepared.prompt_hash,
                                                           plan.settings_hash)
    for variant in due:
        prompt_hash = plan.prepared_for(variant).prompt_hash
        if variant.cache.method != "full" and prompt_hash not in made_here and prompt_hash not in found:
            found[prompt_hash] = store.full_reference(plan.prepared.document.document_id, prompt_hash, plan.settings_hash)
    return found


def plan_documents(
    spec: JobSpec, dataset, store, tokenizer, context: Optional[int], settings_hash: str, *, force: bool = False
) -> Iterator[DocumentPlan]:
    """One ``DocumentPlan`` per input document, in input order, up to ``limits.max_documents``."""
    limit = spec.limits.max_documents
    for index, document in enumerate(iter_documents(spec, dataset)):
        if limit and index >= limit:
            return
        prepared, streamed = prepare_documents(spec, tokenizer, document, context)
        yield plan_document(spec, store, index, prepared, settings_hash, force=force, streamed=streamed)
