"""A variant's store figures alone and in a shared reading, measured interleaved per document.

``bench/store_figures.py`` runs whole jobs one after the other, so a drift of the machine
between them reads as a difference of the code. Here one process loads the model once and,
for each of the first ``--documents`` topics of the main job that fit the context (its
frontier left out), runs the document the way ``velox-batch run`` does (``pipeline.execute``
on a ``WorkItem``): once with every variant due (they share one reading) and once per
variant alone, then again, ``--repeats`` times in turn, before the next document. Each
(document, variant, way) keeps its least ``prefill_seconds``; ``peak_memory_bytes`` is the
first run's (it does not drift with the clock). A compressed variant alone is forced on the
shared run's full output, as a rerun of it with ``--variant`` is forced on the stored one.
Prints per variant the summed seconds both ways and their ratio, the mean peak both ways
and their ratio, the worst document's peak ratio, and how many outputs are identical. Not
a test: nothing here asserts on time. Run it alone on the machine.

    python -m pipeline.platform bench/shared_vs_alone.py --documents 24 --repeats 3
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.execute import VariantOutcome, execute  # noqa: E402
from pipeline.model_store import context_length, load_model  # noqa: E402
from pipeline.plan import WorkItem, ordered_variants, prepare_documents  # noqa: E402
from pipeline.reference import Reference  # noqa: E402
from pipeline.source import iter_documents, open_dataset  # noqa: E402
from pipeline.spec import load_spec  # noqa: E402
from pipeline.spec.model import FrontierSpec  # noqa: E402

MAIN_JOB = ROOT / "jobs" / "summarize.yaml"


def fitting_items(spec, tokenizer, context: int, count: int) -> list[WorkItem]:
    """A ``WorkItem`` with every variant due for each of the first ``count`` documents whose prompt fits."""
    items = []
    for document in iter_documents(spec, open_dataset(spec)):
        if len(items) == count:
            break
        prepared, _ = prepare_documents(spec, tokenizer, document, context)
        if prepared.status != "ready":
            continue
        prompt = prepared.prompt
        items.append(WorkItem(len(items), document.document_id, list(prompt.tokens), ordered_variants(spec),
                              spec.generation, document_start=prompt.document_start, document_end=prompt.document_end))
    return items


def results(outcomes: list) -> dict:
    """Each variant's ``GenerationResult`` of one document's outcomes (a failed variant stops the bench)."""
    found = {}
    for outcome in outcomes:
        if isinstance(outcome, VariantOutcome):
            if outcome.error:
                raise SystemExit(f"{outcome.variant}: {outcome.error}")
            found[outcome.variant] = outcome.result
    return found


def measure(model, tokenizer, item: WorkItem, repeats: int) -> dict:
    """``{(variant, way): (least prefill seconds, first peak bytes, output)}`` of one document, ways interleaved."""
    figures: dict = {}

    def keep(way: str, found: dict) -> None:
        for name, result in found.items():
            key = (name, way)
            if key in figures:
                seconds, peak, output = figures[key]
                figures[key] = (min(seconds, result.prefill_seconds), peak, output)
            else:
                figures[key] = (result.prefill_seconds, result.peak_memory_bytes, result.output)

    reference = None
    for repeat in range(repeats):
        shared = results(execute(model, tokenizer, item))
        keep("shared", shared)
        if reference is None:
            full = shared["full"]
            reference = Reference.of_output(full.token_ids, full.logprobs)
        for variant in item.variants:
            alone = replace(item, variants=[variant], reference=None if variant.cache.method == "full" else reference)
            keep("alone", results(execute(model, tokenizer, alone)))
    return figures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=24)
    parser.add_argument("--job", type=Path, default=MAIN_JOB)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way per document; the least seconds")
    parser.add_argument("--detail", action="store_true", help="also print each document's figures")
    args = parser.parse_args(argv)
    spec = replace(load_spec(str(args.job)), frontier=FrontierSpec())
    model, tokenizer = load_model(spec.model)
    items = fitting_items(spec, tokenizer, context_length(model), args.documents)
    execute(model, tokenizer, items[0])  # warm-up, not counted
    figures = {}
    start = time.perf_counter()
    for item in items:
        figures[item.document_id] = found = measure(model, tokenizer, item, args.repeats)
        print(f"# {item.document_id} ({len(item.prompt_tokens)} tokens): {time.perf_counter() - start:.0f} s",
              flush=True)
        if args.detail:
            for variant in item.variants:
                (alone, alone_peak, _), (shared, shared_peak, _) = (found[(variant.name, way)] for way in
                                                                     ("alone", "shared"))
                print(f"#   {variant.name}: prefill s {alone:.3f} / {shared:.3f}, peak MiB {alone_peak / 2**20:.1f} / "
                      f"{shared_peak / 2**20:.1f} (alone / shared)", flush=True)
    print(f"\n{len(items)} topics of {args.job.name} that fit, no frontier; least of {args.repeats} per document "
          "and way, the ways interleaved per document\n")
    print("| variant | prefill s alone | shared | shared / alone | peak MiB alone | shared | shared / alone | "
          "worst document | identical outputs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for variant in items[0].variants:
        name = variant.name
        ways = {way: [figures[doc][(name, way)] for doc in figures] for way in ("alone", "shared")}
        seconds = {way: sum(f[0] for f in found) for way, found in ways.items()}
        peaks = {way: sum(f[1] for f in found) / len(found) / 2**20 for way, found in ways.items()}
        worst = max((s[1] / a[1] for a, s in zip(ways["alone"], ways["shared"])), key=lambda ratio: abs(ratio - 1))
        same = sum(a[2] == s[2] for a, s in zip(ways["alone"], ways["shared"]))
        print(f"| {name} | {seconds['alone']:.1f} | {seconds['shared']:.1f} | "
              f"{seconds['shared'] / seconds['alone']:.3f} | {peaks['alone']:.0f} | {peaks['shared']:.0f} | "
              f"{peaks['shared'] / peaks['alone']:.3f} | {worst:.3f} | {same} of {len(items)} |")


if __name__ == "__main__":
    main()
