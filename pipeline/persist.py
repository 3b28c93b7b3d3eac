"""Persist: the driver's store writes for planned and executed work, one transaction per row.

Only the driver calls these, under the run lock, whatever engine ran the work; each
document × variant's ``documents`` row (``pipeline.rows.document_row``) and its
``layer_stats`` are written together (``Store.save_document``), so a run killed at any
point leaves each either fully stored or not at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .plan import DocumentPlan, VariantPlan
from .rows import document_row, frontier_rows
from .similarity import rouge_l
from .store import Store

if TYPE_CHECKING:
    from .execute import FrontierOutcome, VariantOutcome


def settle(store: Store, run_id: int, plan: DocumentPlan, entry: VariantPlan) -> str:
    """Record a variant that is not run (``unchanged``, ``skipped``, ``failed``); returns that outcome."""
    if entry.state == "unchanged":
        if not entry.stored_is_latest:
            store.make_latest(entry.stored_row)
        return "unchanged"
    status = "skipped" if entry.state == "skipped" else "error"
    store.save_document(document_row(plan, entry, run_id, status=status, error=plan.prepared_for(entry.variant).error), [])
    return entry.state


def settle_frontier(store: Store, plan: DocumentPlan) -> None:
    """Make the frontier points stored under today's settings the latest of their document × variant × budget × bits
    (settings that revert to earlier ones find their rows stored, and those rows are the current ones again)."""
    store.make_frontier_latest(plan.frontier_stored)


def save_outcomes(
    store: Store, run_id: int, plan: DocumentPlan, outcomes: list[VariantOutcome | FrontierOutcome]
) -> dict[str, tuple[str, Optional[float]]]:
    """Store one work item's executed variants, in order (the full cache first), then its frontier points.

    Returns ``{variant: ("done" | "failed", decode tokens/s or None)}``. A compressed
    variant gets its ROUGE-L against the full-cache output of the same prompt (and its
    teacher-forced fidelity, measured where it ran): the output a full variant of this
    item just made, else the stored one the plan read; a full-cache output sets
    ROUGE-L on compressed rows stored before it.
    """
    full_outputs = dict(plan.full_outputs)
    results = {}
    for outcome in outcomes:
        if not hasattr(outcome, "variant"):  # the item's frontier points, after its variants
            store.save_frontier(frontier_rows(plan, run_id, outcome.points))
            continue
        entry = plan.entry(outcome.variant)
        prompt_hash = plan.prepared_for(entry.variant).prompt_hash
        if outcome.result is None:
            store.save_document(document_row(plan, entry, run_id, status="error", error=outcome.error), [])
            results[outcome.variant] = ("failed", None)
            continue
        result = outcome.result
        is_full = entry.variant.cache.method == "full"
        similarity = None
        if not is_full:
            if prompt_hash not in full_outputs:  # this item's full variant failed: whatever else is stored
                full_outputs[prompt_hash] = _stored_full_output(store, plan, prompt_hash)
            full = full_outputs[prompt_hash]
            similarity = rouge_l(result.output, full) if full is not None else None
        row = document_row(
            plan, entry, run_id, status="done", result=result, rouge_l_vs_full=similarity,
            fidelity_note=outcome.fidelity_note,
        )
        store.save_document(row, result.layer_stats)
        if is_full:
            full_outputs[prompt_hash] = result.output
            for other_row, output in store.compressed_outputs(row["document_id"], prompt_hash, plan.settings_hash):
                store.set_similarity(other_row, rouge_l(output, result.output))
        results[outcome.variant] = ("done", result.decode_tokens_per_second)
    return results


def _stored_full_output(store: Store, plan: DocumentPlan, prompt_hash: str) -> Optional[str]:
    stored = store.full_reference(plan.prepared.document.document_id, prompt_hash, plan.settings_hash)
    return None if stored is None else stored["output"]
