"""``build_report``: one self-contained HTML page of a run's numbers.

Charts (``charts.py``) are embedded as inline SVG, so the page opens offline in
any browser. Every section degrades to a sentence when it has nothing to show (an
empty store, a run without compressed variants, a run whose documents all
failed), never to a broken page.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from .charts import (
    bytes_chart,
    concentration_chart,
    fidelity_chart,
    frontier_chart,
    history_chart,
    inline_svg,
    layer_chart,
    prefill_chart,
    variant_colours,
)
from .data import FIDELITY_LABELS, FIDELITY_SHORT, byte_unit, load_run, scored, timed

MISSING = "–"
_FIRST_RUN = "velox-batch run jobs/summarize.yaml"


@dataclass
class Report:
    """A rendered report: the page, the run it shows, its chart ids and its notices."""

    html: str
    run_id: Optional[int] = None
    charts: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)


def write_report(db, output, *, run_id: Optional[int] = None) -> Report:
    """Build the report of ``run_id`` (default: the latest run that stored documents) and write it to ``output``."""
    report = build_report(db, run_id=run_id)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(report.html, encoding="utf-8")
    return report


def build_report(db, *, run_id: Optional[int] = None) -> Report:
    """The HTML report of one run of the store at ``db``; raises ``FileNotFoundError`` or ``ReportError``."""
    page = _Page(title="Velox report")
    data = load_run(db, run_id)
    if data is None:
        return page.only_message(f"The store {db} has no runs yet. Run a job first: {_FIRST_RUN}")
    run_id, run, fidelity = data.run_id, data.run, data.fidelity
    variants, documents, layers, history = data.variants, data.documents, data.layers, data.history
    page.run_id = run_id
    page.title = f"Velox report: run {run_id} of {run['job_name']}"
    colours = variant_colours([v["variant"] for v in variants] + [h["variant"] for h in history])

    page.add(_run_header(run, data.later, fidelity))
    if not variants:
        page.notice(f"Run {run_id} stored no finished documents, so there is nothing to chart for it.")
    compressed = [v for v in variants if v["method"] != "full"]
    if variants and not compressed:
        page.notice(
            f"Run {run_id} has no compressed variants (only {', '.join(v['variant'] for v in variants)}), "
            "so there is no compression to show: per-layer budgets, bytes kept and fidelity are left out."
        )
    if variants:
        page.section("Variants", _variant_table(variants, fidelity))
    if compressed:
        page.section(
            "Per-layer budgets",
            page.chart("chart-layer-budgets", lambda: layer_chart(layers, colours))
            if layers
            else _message(f"Run {run_id} stored no per-layer rows for its compressed variants."),
            page.chart("chart-concentration", lambda: concentration_chart(layers, colours))
            if any(row["method"] == "squeeze" for row in layers)
            else _message("No squeeze variant in this run: per-layer concentration is measured by squeeze only."),
        )
        page.section(
            "Memory and fidelity",
            _side_by_side(
                page.chart("chart-bytes", lambda: bytes_chart(variants)),
                page.chart("chart-fidelity", lambda: fidelity_chart(documents, fidelity, colours))
                if scored(documents)
                else _message("No compressed document has a fidelity value yet (its full-cache output is missing)."),
            ),
            _STEP_NOTE if any(v["method"] == "full" and (v["mean_compression_ratio"] or 1) < 1 for v in variants) else "",
        )
    if data.frontier:
        own = {v["variant"]: str(v["budget"]) for v in compressed}
        page.section(
            "Compression frontier",
            page.chart("chart-frontier", lambda: frontier_chart(data.frontier, own, colours)),
            _FRONTIER_NOTE,
            _details(f"Per variant and budget ({len(data.frontier)} rows)", _frontier_table(data.frontier)),
        )
    if variants:
        page.section(
            "Speed",
            page.chart("chart-prefill", lambda: prefill_chart(documents, colours))
            if timed(documents)
            else _message(f"Run {run_id} stored no prefill timings."),
        )
    if history:
        page.section(
            "Across runs",
            page.chart("chart-history", lambda: history_chart(history, fidelity, colours, run_id)),
            _details(f"Per run and variant ({len(history)} rows)", _history_table(history, fidelity)),
        )
    page.section("Failed and skipped documents", _problem_table(data.problems) if data.problems else _no_problems(run))
    if documents:
        summary = f"Every finished document × variant ({len(documents)} rows)"
        page.section("Documents", _details(summary, _document_table(documents, fidelity)))
    return page.render()


# ----- the page -------------------------------------------------------------------------------

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1100px; padding: 0 1rem; color: #222; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.2rem; margin-top: 2rem; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.6rem; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1rem 0; } figure svg { max-width: 100%; height: auto; }
.charts { display: flex; flex-wrap: wrap; gap: 1rem; align-items: flex-start; }
.charts figure { flex: 1 1 460px; margin: 0.5rem 0; }
.notice { background: #fff6d6; border: 1px solid #e8d27c; padding: 0.6rem 0.9rem; }
.meta { color: #555; }
"""


@dataclass
class _Page:
    title: str
    run_id: Optional[int] = None
    parts: list[str] = field(default_factory=list)
    charts: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)

    def add(self, fragment: str) -> None:
        self.parts.append(fragment)

    def notice(self, text: str) -> None:
        self.messages.append(text)
        self.parts.append(f'<p class="notice">{html.escape(text)}</p>')

    def section(self, heading: str, *fragments: str) -> None:
        anchor = re.sub(r"[^a-z]+", "-", heading.lower()).strip("-")
        self.parts.append(f'<section id="{anchor}"><h2>{html.escape(heading)}</h2>{"".join(fragments)}</section>')

    def chart(self, chart_id: str, draw: Callable) -> str:
        figure = draw()
        self.charts.append(chart_id)
        title = figure.get_suptitle() or figure.axes[0].get_title()
        svg = inline_svg(figure, salt=chart_id)
        return f'<figure id="{chart_id}" aria-label="{html.escape(title)}">{svg}</figure>'

    def only_message(self, text: str) -> Report:
        self.notice(text)
        return self.render()

    def render(self) -> Report:
        body = "\n".join(self.parts)
        page = (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(self.title)}</title><style>{STYLE}</style></head>\n"
            f"<body><h1>{html.escape(self.title)}</h1>\n{body}\n</body></html>\n"
        )
        return Report(page, self.run_id, list(self.charts), list(self.messages))


_STEP_NOTE = (
    '<p class="meta">The full cache (mlx-lm\'s KVCache) allocates in steps of 256 tokens, '
    "so it holds more bytes than the sequence needs: its ratio is below 1.</p>"
)


def _message(text: str) -> str:
    return f'<p class="notice">{html.escape(text)}</p>'


def _side_by_side(*fragments: str) -> str:
    return f'<div class="charts">{"".join(fragments)}</div>'


def _details(summary: str, content: str) -> str:
    return f"<details><summary>{html.escape(summary)}</summary>{content}</details>"


def _no_problems(run: dict) -> str:
    counted = (run["documents_skipped"] or 0) + (run["documents_failed"] or 0)
    if not counted:
        return _message(f"None: no document of run {run['id']} failed or was skipped.")
    return _message(
        f"Run {run['id']} counted {run['documents_skipped'] or 0} skipped and {run['documents_failed'] or 0} failed "
        "document × variant rows, but a later run tried those documents again and holds their rows now "
        "(the store keeps one row per document × variant); see the newer runs."
    )


def _run_header(run: dict, later: list[int], fidelity: str) -> str:
    counts = ", ".join(
        f"{run[f'documents_{name}'] or 0} {name}" for name in ("done", "unchanged", "skipped", "failed")
    )
    lines = [
        f"Job <b>{html.escape(run['job_name'] or '')}</b>, model {html.escape(run['model'] or '')}, "
        f"run {run['id']}: {html.escape(run['status'] or '')}, started {html.escape(run['started_at'] or '')}"
        f"{', ended ' + html.escape(run['ended_at']) if run['ended_at'] else ''}.",
        f"Document × variant rows: {counts}. Device: {html.escape(run['device'] or MISSING)}.",
        f"Fidelity to the full cache is {html.escape(FIDELITY_LABELS[fidelity])}.",
    ]
    if later:
        lines.append(
            f"Newer runs of this job: {', '.join(map(str, later))} (see one with --run ID; a run whose "
            "documents were all unchanged stores no rows of its own, so the default is the newest run that did)."
        )
    return "".join(f'<p class="meta">{line}</p>' for line in lines)


# ----- tables ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Column:
    key: str
    header: str
    digits: Optional[int] = None  # decimals for a float column; None: shown as stored
    scale: float = 1.0  # shown value = stored value / scale


def _cell(value, column: _Column) -> str:
    if value is None:
        return f"<td>{MISSING}</td>"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        text = f"{value / column.scale:.{column.digits}f}" if column.digits is not None else str(value)
        return f'<td class="num">{text}</td>'
    return f"<td>{html.escape(str(value))}</td>"


def _table(table_id: str, columns: list[_Column], rows: list[dict]) -> str:
    head = "".join(f"<th>{html.escape(column.header)}</th>" for column in columns)
    body = "".join(f"<tr>{''.join(_cell(row[c.key], c) for c in columns)}</tr>" for row in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'



def _variant_table(variants: list[dict], fidelity: str) -> str:
    unit, size = byte_unit([v["mean_full_seq_bytes"] for v in variants] + [v["mean_kept_bytes"] for v in variants])
    columns = [
        _Column("variant", "variant"),
        _Column("method", "method"),
        _Column("budget", "budget (tokens)"),
        _Column("documents", "documents"),
        _Column("mean_kept_bytes", f"mean kept ({unit})", 2, size),
        _Column("mean_full_seq_bytes", f"mean full sequence ({unit})", 2, size),
        _Column("mean_compression_ratio", "mean compression ratio (×)", 2),
        _Column("mean_fidelity", f"mean {FIDELITY_SHORT[fidelity]}", 3),
        _Column("mean_prefill_tps", "mean prefill (tokens/s)", 1),
        _Column("mean_decode_tps", "mean decode (tokens/s)", 1),
    ]
    return _table("variant-summary", columns, variants)


_FRONTIER_NOTE = (
    '<p class="meta">Every compressed variant\'s policy at every <code>frontier.budgets</code> budget, cut from '
    "the document's one reading and teacher-forced on the full output (the job's latest full rows). "
    "SQL: <code>select * from frontier_summary</code>.</p>"
)


def _frontier_table(frontier: list[dict]) -> str:
    columns = [
        _Column("variant", "variant"),
        _Column("budget", "budget"),
        _Column("documents", "documents"),
        _Column("kept_share", "share of the prompts kept (%)", 2, 0.01),
        _Column("mean_kept_share", "mean share per document (%)", 2, 0.01),
        _Column("mean_agreement", "mean agreement", 3),
        _Column("worst_agreement", "worst agreement", 3),
        _Column("mean_compression_ratio", "mean compression ratio (×)", 2),
    ]
    return _table("frontier-summary", columns, frontier)


def _document_table(documents: list[dict], fidelity: str) -> str:
    columns = [
        _Column("document_id", "document"),
        _Column("variant", "variant"),
        _Column("prompt_tokens", "prompt tokens"),
        _Column("output_tokens", "output tokens"),
        _Column("kept_bytes", "kept bytes"),
        _Column("full_seq_bytes", "full sequence bytes"),
        _Column("compression_ratio", "compression ratio (×)", 2),
        _Column("fidelity", FIDELITY_SHORT[fidelity], 3),
        _Column("prefill_tokens_per_second", "prefill (tokens/s)", 1),
        _Column("decode_tokens_per_second", "decode (tokens/s)", 1),
    ]
    return _table("document-table", columns, documents)


def _problem_table(problems: list[dict]) -> str:
    columns = [_Column("document_id", "document"), _Column("status", "status"), _Column("variants", "variants"),
               _Column("error", "reason")]
    return _table("problem-table", columns, problems)


def _history_table(history: list[dict], fidelity: str) -> str:
    columns = [
        _Column("run_id", "run"),
        _Column("started_at", "started"),
        _Column("variant", "variant"),
        _Column("documents", "documents"),
        _Column("mean_prefill_tps", "mean prefill (tokens/s)", 1),
        _Column("mean_decode_tps", "mean decode (tokens/s)", 1),
        _Column("mean_fidelity", f"mean {FIDELITY_SHORT[fidelity]}", 3),
    ]
    return _table("history-table", columns, history)


