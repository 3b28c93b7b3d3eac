"""The ``documents`` row of one document × variant, and its ``frontier`` rows: built here only, from the plan
and the outcome.

The store writes the row it is given (adding only when it wrote it and that it is now
the variant's latest row); ``pipeline.persist`` decides which row to write and when.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Optional

from .plan import DocumentPlan, PreparedDocument, VariantPlan
from .store.migrations import ACCOUNTING
from .reference import rounded_logprobs

if TYPE_CHECKING:
    from .generation import GenerationResult


def stored_budget(config, prepared: PreparedDocument) -> Optional[int]:
    """The budget a row records: tokens, a share of the prompt resolved for this prompt."""
    if config.method == "full":
        return None
    if config.budget_fraction is None:
        return config.budget
    return config.resolved_for(prepared.prompt_tokens).budget if prepared.prompt_tokens is not None else None


def document_row(
    plan: DocumentPlan,
    entry: VariantPlan,
    run_id: int,
    *,
    status: str,
    error: Optional[str] = None,
    result: Optional[GenerationResult] = None,
    rouge_l_vs_full: Optional[float] = None,
    fidelity_note: Optional[str] = None,
) -> dict:
    """The ``documents`` row of ``entry`` (one variant of ``plan``'s document) in run ``run_id``.

    ``status`` ``done`` takes the generation ``result`` (and its ROUGE-L against the full
    cache's output); ``skipped`` and ``error`` take the ``error`` that says why.
    """
    prepared = plan.prepared_for(entry.variant)
    document, config = prepared.document, entry.variant.cache
    row = {
        "doc_key": entry.key,
        "document_id": document.document_id,
        "content_hash": document.content_hash,
        "prompt_hash": prepared.prompt_hash,
        "settings_hash": plan.settings_hash,
        "variant": entry.variant.name,
        "method": config.method,
        "budget": stored_budget(config, prepared),
        "scoring": None if config.method == "full" else config.scoring,
        "eviction": None if config.method == "full" else config.eviction,
        "kv_bits": config.kv_bits,
        "run_id": run_id,
        "status": status,
    }
    if status != "done":
        return {**row, "error": error, "prompt_tokens": prepared.prompt_tokens}
    fidelity = result.fidelity
    return {
        **row,
        "output": result.output,
        "prompt_tokens": result.prompt_tokens,
        "truncated": int(prepared.prompt.truncated),
        "output_tokens": result.output_tokens,
        "prefill_seconds": result.prefill_seconds,
        "reading_seconds": result.reading_seconds,
        "draft_seconds": result.draft_seconds,
        "decode_seconds": result.decode_seconds,
        "decode_batch_size": result.decode_batch_size,
        "prefill_tokens_per_second": result.prefill_tokens_per_second,
        "decode_tokens_per_second": result.decode_tokens_per_second,
        "peak_memory_bytes": result.peak_memory_bytes,
        "stop_reason": result.stop_reason,
        "rouge_l_vs_full": rouge_l_vs_full,
        "agreement_vs_full": fidelity.agreement if fidelity else None,
        "nll_gap_vs_full": fidelity.nll_gap if fidelity else None,
        "fidelity_seconds": fidelity.seconds if fidelity else None,
        "fidelity_note": None if fidelity else fidelity_note,
        "output_token_ids": json.dumps(result.token_ids),
        "output_logprobs": json.dumps(rounded_logprobs(result.logprobs)),
        **result.totals(),
        "accounting": ACCOUNTING,
    }


def frontier_rows(plan: DocumentPlan, run_id: int, points: list[dict]) -> list[dict]:
    """The ``frontier`` rows of ``plan``'s document: one per measured (or skipped, or failed) point.

    ``points`` are ``execute.FrontierOutcome.points``: each names its ``FrontierPoint`` by key.
    """
    by_key = {point.key: point for point in plan.work.frontier}
    prepared = plan.prepared
    rows = []
    for measured in points:
        point = by_key[measured["key"]]
        row = {
            "frontier_key": point.key,
            "run_id": run_id,
            "document_id": prepared.document.document_id,
            "prompt_hash": prepared.prompt_hash,
            "settings_hash": plan.settings_hash,
            "variant": point.variant.name,
            "method": point.variant.cache.method,
            "budget": str(point.budget),
            "kv_bits": point.kv_bits,
            "prompt_tokens": prepared.prompt_tokens,
            "status": measured["status"],
            "note": measured.get("note"),
        }
        if measured["status"] == "done":
            figures = {k: v for k, v in measured.items() if k not in ("key", "status", "note", "variant", "method", "budget")}
            row.update(figures, accounting=ACCOUNTING)
        rows.append(row)
    return rows
