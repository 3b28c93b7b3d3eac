"""Persist: the driver's store writes for planned and executed work, one transaction per row.

Only the driver calls these, under the run lock, whatever engine ran the work; each
document × variant's ``documents`` row and its ``layer_stats`` are written together
(``Store.save_document``), so a run killed at any point leaves each either fully
stored or not at all.
"""

from __future__ import annotations

import json
from typing import Optional

from .execute import LOGPROB_DECIMALS, VariantOutcome
from .plan import DocumentPlan, VariantPlan
from .similarity import rouge_l
from .store import Store


def settle(store: Store, run_id: int, plan: DocumentPlan, entry: VariantPlan) -> str:
    """Record a variant that is not run (``unchanged``, ``skipped``, ``failed``); returns that outcome."""
    if entry.state == "unchanged":
        if not entry.stored_is_latest:
            store.make_latest(entry.stored_row)
        return "unchanged"
    prepared = plan.prepared_for(entry.variant)
    status = "skipped" if entry.state == "skipped" else "error"
    store.save_document(
        {**entry.row, "run_id": run_id, "status": status, "error": prepared.error, "prompt_tokens": prepared.prompt_tokens},
        [],
    )
    return entry.state


def save_outcome(store: Store, run_id: int, plan: DocumentPlan, outcome: VariantOutcome) -> tuple[str, Optional[float]]:
    """Store one executed variant; returns ``("done" | "failed", decode tokens/s or None)``.

    A compressed variant gets its ROUGE-L against the stored full-cache output of the
    same prompt (and its teacher-forced fidelity, measured where it ran); a full-cache
    output sets ROUGE-L on compressed rows stored before it.
    """
    entry = plan.entry(outcome.variant)
    row = {**entry.row, "run_id": run_id}
    prepared = plan.prepared_for(entry.variant)
    if outcome.result is None:
        store.save_document({**row, "status": "error", "error": outcome.error, "prompt_tokens": prepared.prompt_tokens}, [])
        return "failed", None
    result = outcome.result
    document_id, prompt_hash, settings_hash = row["document_id"], row["prompt_hash"], row["settings_hash"]
    is_full = row["method"] == "full"
    similarity = None
    if not is_full:
        full = store.full_reference(document_id, prompt_hash, settings_hash)
        similarity = rouge_l(result.output, full["output"]) if full is not None else None
    fidelity = result.fidelity
    store.save_document(
        {
            **row,
            "status": "done",
            "output": result.output,
            "prompt_tokens": result.prompt_tokens,
            "truncated": int(prepared.prompt.truncated),
            "output_tokens": result.output_tokens,
            "prefill_seconds": result.prefill_seconds,
            "decode_seconds": result.decode_seconds,
            "prefill_tokens_per_second": result.prefill_tokens_per_second,
            "decode_tokens_per_second": result.decode_tokens_per_second,
            "peak_memory_bytes": result.peak_memory_bytes,
            "stop_reason": result.stop_reason,
            "rouge_l_vs_full": similarity,
            "agreement_vs_full": fidelity.agreement if fidelity else None,
            "nll_gap_vs_full": fidelity.nll_gap if fidelity else None,
            "fidelity_seconds": fidelity.seconds if fidelity else None,
            "output_token_ids": json.dumps(result.token_ids),
            "output_logprobs": json.dumps([round(p, LOGPROB_DECIMALS) for p in result.logprobs]),
            **result.totals(),
        },
        result.layer_stats,
    )
    if is_full:
        for other_row, output in store.compressed_outputs(document_id, prompt_hash, settings_hash):
            store.set_similarity(other_row, rouge_l(output, result.output))
    return "done", result.decode_tokens_per_second
