"""What a report shows, read from the store: one run's rows, and how fidelity is measured.

Fidelity to the full cache is teacher-forced agreement (``agreement_vs_full``)
where the store has it for the run, else ROUGE-L of the two outputs
(``rouge_l_vs_full``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .. import store

FIDELITY_LABELS = {
    "agreement_vs_full": "teacher-forced top-1 agreement with the full cache (0–1)",
    "rouge_l_vs_full": "ROUGE-L against the full-cache output (0–1)",
}
FIDELITY_SHORT = {"agreement_vs_full": "agreement", "rouge_l_vs_full": "ROUGE-L"}


class ReportError(ValueError):
    """The report cannot be made (for example: the run asked for does not exist)."""


@dataclass
class RunData:
    """One run's rows as the report shows them (done rows only, except ``problems``)."""

    run_id: int
    run: dict  # the ``runs`` row, without the spec text
    later: list[int]  # ids of the same job's newer runs
    fidelity: str  # the column fidelity is read from
    variants: list[dict]
    documents: list[dict]
    layers: list[dict]
    problems: list[dict]
    history: list[dict]  # per run of the same job and variant
    frontier: list[dict]  # per compressed variant and budget, over the job's latest full rows


def load_run(db, run_id: Optional[int] = None) -> Optional[RunData]:
    """The rows of ``run_id`` (default: the newest run that stored documents, else the newest run).

    None when the store has no runs; raises ``ReportError`` when ``run_id`` is not
    one of its runs, and ``FileNotFoundError`` when there is no store at ``db``.
    """
    if not store.has_runs_table(db):
        return None
    ids = store.report_run_ids(db)
    if run_id is None:
        if ids["latest"] is None:
            return None
        run_id = ids["latest_with_rows"] if ids["latest_with_rows"] is not None else ids["latest"]
    run = store.report_run(db, run_id)
    if run is None:
        raise ReportError(f"--run: no run {run_id} in {db} (latest: {ids['latest']})")
    fidelity = store.fidelity_column(db, run_id)
    return RunData(
        run_id=run_id,
        run=run,
        later=store.report_later_runs(db, run_id, run["job_name"]),
        fidelity=fidelity,
        variants=store.report_variants(db, run_id, fidelity),
        documents=store.report_documents(db, run_id, fidelity),
        layers=store.report_layers(db, run_id),
        problems=store.report_problems(db, run_id),
        history=store.report_history(db, run["job_name"], fidelity),
        frontier=store.report_frontier(db, run["job_name"]),
    )


def scored(documents: list[dict]) -> list[dict]:
    """The compressed documents with a fidelity value and a compression ratio."""
    return [d for d in documents if d["method"] != "full" and d["fidelity"] is not None and d["compression_ratio"]]


def timed(documents: list[dict]) -> list[dict]:
    """The documents with a prefill speed and a prompt length."""
    return [d for d in documents if d["prefill_tokens_per_second"] and d["prompt_tokens"]]


def byte_unit(values) -> tuple[str, int]:
    """``(name, size)`` of the largest binary unit that the largest of ``values`` reaches."""
    largest = max((v for v in values if v is not None), default=0)
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return name, size
    return "B", 1
