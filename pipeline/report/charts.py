"""The report's charts: matplotlib figures (Agg canvas, no pyplot state) embedded as inline SVG.

matplotlib is imported inside the functions that draw, so importing the report
(or the CLI) does not load it.
"""

from __future__ import annotations

import io
import math
import re

from .data import FIDELITY_LABELS, FIDELITY_SHORT, byte_unit, scored, timed


def _new_figure(width: float, height: float, *, rows: int = 1, cols: int = 1, **subplot_options):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, cols, squeeze=False, **subplot_options)
    return figure, [ax for row in axes for ax in row]


def inline_svg(figure, *, salt: str) -> str:
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


def variant_colours(names: list[str]) -> dict[str, str]:
    """One colour per name, in the order first seen (matplotlib's tab10, repeating after ten)."""
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


def layer_chart(layers: list[dict], colours: dict):
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


def concentration_chart(layers: list[dict], colours: dict):
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


def bytes_chart(variants: list[dict]):
    unit, size = byte_unit([v["mean_full_seq_bytes"] for v in variants] + [v["mean_kept_bytes"] for v in variants])
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


def fidelity_chart(documents: list[dict], fidelity: str, colours: dict):
    figure, (ax,) = _new_figure(6.5, 3.6)
    for variant, points in _by_variant(scored(documents)).items():
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


def prefill_chart(documents: list[dict], colours: dict):
    figure, (ax,) = _new_figure(6.5, 3.6)
    for variant, points in _by_variant(timed(documents)).items():
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


def history_chart(history: list[dict], fidelity: str, colours: dict, shown_run: int):
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


def frontier_chart(frontier: list[dict], own_budgets: dict, colours: dict):
    """Mean agreement against the mean share of the prompt kept, one curve per compressed variant.

    Each point is one budget of ``frontier.budgets`` (labelled); the variant's own
    budget (``own_budgets``: variant -> its budget as the job spec gives it) is ringed.
    """
    figure, (ax,) = _new_figure(6.5, 3.8)
    for variant, points in _by_variant(frontier).items():
        shares = [100 * p["kept_share"] for p in points]
        agreements = [p["mean_agreement"] for p in points]
        ax.plot(shares, agreements, "o-", markersize=4, color=colours[variant], label=variant)
        for share, agreement, point in zip(shares, agreements, points):
            ax.annotate(point["budget"], (share, agreement), textcoords="offset points", xytext=(3, -9), fontsize=7)
            if point["budget"] == own_budgets.get(variant):
                ax.plot([share], [agreement], "o", markersize=11, markerfacecolor="none", color=colours[variant])
    from matplotlib.ticker import FormatStrFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_title("Compression frontier (ringed: each variant's own budget)")
    ax.set_xlabel("share of the prompts' keys and values kept (%, all documents)")
    ax.set_ylabel("mean teacher-forced agreement\nwith the full cache (0–1)")
    ax.set_ylim(-0.02, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return figure
