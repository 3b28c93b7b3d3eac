"""``build_report``: one self-contained HTML page of a run's numbers.

Charts are drawn with matplotlib (Agg canvas, no pyplot state) and embedded as
inline SVG, so the page opens offline in any browser. Every section degrades to
a sentence when it has nothing to show (an empty store, a run without
compressed variants, a run whose documents all failed), never to a broken page.

Fidelity to the full cache is teacher-forced agreement (``agreement_vs_full``)
where the store has it for the run, else ROUGE-L of the two outputs
(``rouge_l_vs_full``).
"""

from __future__ import annotations

import html
import io
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from . import store

FIDELITY_LABELS = {
    "agreement_vs_full": "teacher-forced top-1 agreement with the full cache (0–1)",
    "rouge_l_vs_full": "ROUGE-L against the full-cache output (0–1)",
}
FIDELITY_SHORT = {"agreement_vs_full": "agreement", "rouge_l_vs_full": "ROUGE-L"}
MISSING = "–"


class ReportError(ValueError):
    """The report cannot be made (for example: the run asked for does not exist)."""


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
    no_runs = f"The store {db} has no runs yet. Run a job first: velox-batch run jobs/summarize.yaml"
    if not store.has_runs_table(db):
        return page.only_message(no_runs)
    ids = store.report_run_ids(db)
    if run_id is None:
        if ids["latest"] is None:
            return page.only_message(no_runs)
        run_id = ids["latest_with_rows"] if ids["latest_with_rows"] is not None else ids["latest"]
    run = store.report_run(db, run_id)
    if run is None:
        raise ReportError(f"--run: no run {run_id} in {db} (latest: {ids['latest']})")
    page.run_id = run_id
    page.title = f"Velox report: run {run_id} of {run['job_name']}"
    fidelity = store.fidelity_column(db, run_id)
    variants = store.report_variants(db, run_id, fidelity)
    documents = store.report_documents(db, run_id, fidelity)
    layers = store.report_layers(db, run_id)
    problems = store.report_problems(db, run_id)
    history = store.report_history(db, run["job_name"], fidelity)
    colours = _colours([v["variant"] for v in variants] + [h["variant"] for h in history])

    page.add(_run_header(run, store.report_later_runs(db, run_id, run["job_name"]), fidelity))
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
            page.chart("chart-layer-budgets", lambda: _layer_chart(layers, colours))
            if layers
            else _message(f"Run {run_id} stored no per-layer rows for its compressed variants."),
            page.chart("chart-concentration", lambda: _concentration_chart(layers, colours))
            if any(row["method"] == "squeeze" for row in layers)
            else _message("No squeeze variant in this run: per-layer concentration is measured by squeeze only."),
        )
        page.section(
            "Memory and fidelity",
            _side_by_side(
                page.chart("chart-bytes", lambda: _bytes_chart(variants)),
                page.chart("chart-fidelity", lambda: _fidelity_chart(documents, fidelity, colours))
                if _scored(documents)
                else _message("No compressed document has a fidelity value yet (its full-cache output is missing)."),
            ),
            _STEP_NOTE if any(v["method"] == "full" and (v["mean_compression_ratio"] or 1) < 1 for v in variants) else "",
        )
    if variants:
        page.section(
            "Speed",
            page.chart("chart-prefill", lambda: _prefill_chart(documents, colours))
            if _timed(documents)
            else _message(f"Run {run_id} stored no prefill timings."),
        )
    if history:
        page.section(
            "Across runs",
            page.chart("chart-history", lambda: _history_chart(history, fidelity, colours, run_id)),
            _details(f"Per run and variant ({len(history)} rows)", _history_table(history, fidelity)),
        )
    page.section("Failed and skipped documents", _problem_table(problems) if problems else _no_problems(run))
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
        return f'<figure id="{chart_id}" aria-label="{html.escape(title)}">{_svg(figure, salt=chart_id)}</figure>'

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


def _byte_unit(values) -> tuple[str, int]:
    largest = max((v for v in values if v is not None), default=0)
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return name, size
    return "B", 1


def _variant_table(variants: list[dict], fidelity: str) -> str:
    unit, size = _byte_unit([v["mean_full_seq_bytes"] for v in variants] + [v["mean_kept_bytes"] for v in variants])
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


# ----- charts ---------------------------------------------------------------------------------


def _new_figure(width: float, height: float, *, rows: int = 1, cols: int = 1, **subplot_options):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, cols, squeeze=False, **subplot_options)
    return figure, [ax for row in axes for ax in row]


def _svg(figure, *, salt: str) -> str:
    """The figure as an inline ``<svg>`` element, text kept as text; ids made unique on the page.

    Ids that are referenced (clip paths, markers) are already unique through the hash salt;
    the others (``legend_1``, ``axes_1``...) repeat in every figure, so they get ``salt`` as prefix.
    """
    import matplotlib

    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt}):
        figure.savefig(buffer, format="svg", metadata={"Date": None})
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg") :]
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    referenced = set(re.findall(r"#([^\s\"')]+)", svg))
    return re.sub(
        r'\sid="([^"]+)"', lambda m: m.group(0) if m.group(1) in referenced else f' id="{salt}-{m.group(1)}"', svg
    )


def _colours(names: list[str]) -> dict[str, str]:
    from matplotlib import colormaps

    palette = colormaps["tab10"].colors
    unique = list(dict.fromkeys(names))
    return {name: _hex(palette[i % len(palette)]) for i, name in enumerate(unique)}


def _hex(rgb) -> str:
    return "#" + "".join(f"{round(c * 255):02x}" for c in rgb[:3])


def _by_variant(rows: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for row in rows:
        grouped.setdefault(row["variant"], []).append(row)
    return grouped


def _scored(documents: list[dict]) -> list[dict]:
    return [d for d in documents if d["method"] != "full" and d["fidelity"] is not None and d["compression_ratio"]]


def _timed(documents: list[dict]) -> list[dict]:
    return [d for d in documents if d["prefill_tokens_per_second"] and d["prompt_tokens"]]


def _layer_chart(layers: list[dict], colours: dict):
    grouped = _by_variant(layers)
    cols = min(3, len(grouped))
    rows = math.ceil(len(grouped) / cols)
    figure, axes = _new_figure(4.2 * cols, 3.2 * rows, rows=rows, cols=cols, sharey=True)
    for ax, (variant, points) in zip(axes, grouped.items()):
        x = [p["layer"] for p in points]
        colour = colours[variant]
        ax.plot(x, [p["mean_budget"] for p in points], "-o", color=colour, markersize=3, label="budget (mean)")
        if any(p["min_budget"] != p["max_budget"] for p in points):
            ax.fill_between(
                x, [p["min_budget"] for p in points], [p["max_budget"] for p in points],
                color=colour, alpha=0.15, label="budget (min–max over documents)",
            )
        ax.plot(x, [p["mean_tokens_kept"] for p in points], "--", color="#444", label="tokens kept (mean)")
        ax.set_title(f"{variant} ({points[0]['method']}, {points[0]['documents']} documents)", fontsize=10)
        ax.set_xlabel("layer (0 = first)")
        ax.set_ylabel("tokens per KV head")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[len(grouped) :]:
        ax.set_visible(False)
    figure.suptitle("Per-layer budget and tokens kept, per compressed variant")
    return figure


def _concentration_chart(layers: list[dict], colours: dict):
    figure, (ax,) = _new_figure(6.5, 3.2)
    for variant, points in _by_variant([row for row in layers if row["method"] == "squeeze"]).items():
        ax.plot(
            [p["layer"] for p in points], [p["mean_concentration"] for p in points], "-o",
            markersize=3, color=colours[variant], label=f"{variant} (mean of {points[0]['documents']} documents)",
        )
    ax.set_title("Squeeze: attention concentration per layer")
    ax.set_xlabel("layer (0 = first)")
    ax.set_ylabel("concentration (0 broad … 1 one token)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return figure


def _bytes_chart(variants: list[dict]):
    unit, size = _byte_unit([v["mean_full_seq_bytes"] for v in variants] + [v["mean_kept_bytes"] for v in variants])
    figure, (ax,) = _new_figure(6.5, 3.4)
    names = [v["variant"] for v in variants]
    x = range(len(variants))
    full = [(v["mean_full_seq_bytes"] or 0) / size for v in variants]
    kept = [(v["mean_kept_bytes"] or 0) / size for v in variants]
    ax.bar([i - 0.2 for i in x], full, width=0.4, color="#bbbbbb", label="full sequence (every token seen)")
    bars = ax.bar([i + 0.2 for i in x], kept, width=0.4, color="#4c72b0", label="kept (held in the cache)")
    for bar, variant in zip(bars, variants):
        if variant["mean_compression_ratio"]:
            ax.annotate(
                f"{variant['mean_compression_ratio']:.2f}×", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center", va="bottom", fontsize=8,
            )
    ax.set_xticks(list(x), names)
    ax.set_title("KV-cache bytes per document, kept vs full (label: ratio)")
    ax.set_xlabel("variant")
    ax.set_ylabel(f"bytes per document ({unit})")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return figure


def _fidelity_chart(documents: list[dict], fidelity: str, colours: dict):
    figure, (ax,) = _new_figure(6.5, 3.6)
    for variant, points in _by_variant(_scored(documents)).items():
        ax.scatter(
            [p["compression_ratio"] for p in points], [p["fidelity"] for p in points],
            s=18, alpha=0.8, color=colours[variant], label=f"{variant} ({len(points)} documents)",
        )
    ax.set_title(f"Compression vs fidelity, one point per document ({FIDELITY_SHORT[fidelity]})")
    ax.set_xlabel("compression ratio (full ÷ kept bytes, ×)")
    ax.set_ylabel(FIDELITY_LABELS[fidelity].replace(" (0–1)", "\n(0–1)"))
    ax.set_ylim(-0.02, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return figure


def _prefill_chart(documents: list[dict], colours: dict):
    figure, (ax,) = _new_figure(6.5, 3.6)
    for variant, points in _by_variant(_timed(documents)).items():
        ax.plot(
            [p["prompt_tokens"] for p in points], [p["prefill_tokens_per_second"] for p in points], "o",
            markersize=4, alpha=0.8, color=colours[variant], label=variant,
        )
    ax.set_title("Prefill speed vs prompt length, one point per document")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("prefill speed (tokens/s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return figure


def _history_chart(history: list[dict], fidelity: str, colours: dict, shown_run: int):
    run_ids = sorted({h["run_id"] for h in history})
    position = {run_id: i for i, run_id in enumerate(run_ids)}
    started = {h["run_id"]: (h["started_at"] or "")[:10] for h in history}
    figure, axes = _new_figure(min(max(6.5, 0.5 * len(run_ids)), 14), 7.2, rows=3, sharex=True)
    panels = [
        ("mean_prefill_tps", "prefill (tokens/s)", "Mean prefill speed"),
        ("mean_decode_tps", "decode (tokens/s)", "Mean decode speed"),
        ("mean_fidelity", f"{FIDELITY_SHORT[fidelity]} (0–1)", f"Mean fidelity to full ({FIDELITY_SHORT[fidelity]})"),
    ]
    for ax, (key, ylabel, title) in zip(axes, panels):
        for variant, points in _by_variant(history).items():
            points = [p for p in points if p[key] is not None]
            if points:
                ax.plot(
                    [position[p["run_id"]] for p in points], [p[key] for p in points], "-o",
                    markersize=4, color=colours[variant], label=variant,
                )
        if shown_run in position:
            ax.axvline(position[shown_run], color="#999", linestyle=":", label=f"run {shown_run} (this page)")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[2].set_ylim(-0.02, 1.05)
    step = math.ceil(len(run_ids) / 20)  # at most about 20 labelled runs
    shown = run_ids[::step]
    axes[2].set_xticks([position[r] for r in shown], [f"{r}\n{started[r]}" for r in shown], fontsize=8)
    axes[2].set_xlabel("run (id and start date, UTC)")
    figure.suptitle("Across runs of this job: speed and fidelity per run (mean over its documents)")
    return figure
