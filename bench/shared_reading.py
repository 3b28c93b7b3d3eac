"""One reading against one prefill per variant: the main job's prefill, documents per hour and peak memory.

For the first ``--documents`` topics of the main job that fit the context (prompted as
``jobs/summarize.yaml`` builds them), prefills the job's full variant and its compressed
variants at ``prefill_end`` two ways, one after the other for each topic: each variant on its
own (``pipeline.generation.prefill_variant``, what a job without sharing does), and all of
them from one reading (``prefill_shared``: the full stack plus each compressed stack cut from
it). Prints seconds, documents per hour of prefill and each way's largest peak memory above
the weights; checks on the way that every cut stack keeps what its own prefill keeps.
Then, per variant, the store's ``prefill_seconds`` alone against cut from the reading
(``--repeats``: each topic's least of that many runs, both ways interleaved topic by topic,
so that the machine's drift between whole runs does not enter the ratio).
Decoding is the same either way and is left out. Not a test: nothing here asserts on time.

    python bench/shared_reading.py --documents 24
    python bench/shared_reading.py --documents 24 --repeats 2
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from pipeline.generation import prefill_shared, prefill_variant  # noqa: E402
from pipeline.model_store import context_length, load_model  # noqa: E402
from pipeline.prompting import PromptTooLong, build_prompt  # noqa: E402
from pipeline.source import iter_documents, open_dataset  # noqa: E402
from pipeline.spec import load_spec  # noqa: E402

MAIN_JOB = Path(__file__).resolve().parent.parent / "jobs" / "summarize.yaml"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=24)
    parser.add_argument("--job", default=str(MAIN_JOB))
    parser.add_argument("--repeats", type=int, default=1, help="runs of both ways per topic; each topic's least seconds")
    args = parser.parse_args(argv)
    spec = load_spec(args.job)
    model, tokenizer = load_model(spec.model)
    context = context_length(model)
    configs = [
        v.cache if v.cache.method == "full" else dataclasses.replace(v.cache, eviction="prefill_end")
        for v in spec.variants
    ]
    seconds = {"one per variant": 0.0, "one reading": 0.0}
    peaks = {"one per variant": 0, "one reading": 0}
    done, tokens = 0, 0
    variant_names = [variant.name for variant in spec.variants]  # configs[i] is variant_names[i]'s
    least = {}  # (topic, variant name, way) -> the least prefill_seconds stored
    for document in iter_documents(spec, open_dataset(spec)):
        if done == args.documents:
            break
        try:
            prompt = build_prompt(spec, tokenizer, document, context_length=context)
        except PromptTooLong:
            continue
        for _ in range(args.repeats - 1):  # the extra runs only lower the least seconds
            for name, run in zip(variant_names, [prefill_variant(model, tokenizer, prompt, c, spec.generation) for c in configs]):
                _keep_least(least, (done, name, "alone"), run.prefill_seconds)
            for name, run in zip(variant_names, prefill_shared(model, tokenizer, prompt, configs, spec.generation)):
                _keep_least(least, (done, name, "shared"), run.prefill_seconds)
        start = time.perf_counter()
        alone = [prefill_variant(model, tokenizer, prompt, config, spec.generation) for config in configs]
        seconds["one per variant"] += time.perf_counter() - start
        peaks["one per variant"] = max(peaks["one per variant"], *(run.prefill_peak_bytes for run in alone))
        kept_alone = [[c.slots.held_positions().tolist() for c in run.row.caches if hasattr(c, "slots")] for run in alone]
        for name, run in zip(variant_names, alone):
            _keep_least(least, (done, name, "alone"), run.prefill_seconds)
        del alone
        start = time.perf_counter()
        shared = prefill_shared(model, tokenizer, prompt, configs, spec.generation)
        seconds["one reading"] += time.perf_counter() - start
        peaks["one reading"] = max(peaks["one reading"], *(run.prefill_peak_bytes for run in shared))
        kept_shared = [[c.slots.held_positions().tolist() for c in run.row.caches if hasattr(c, "slots")] for run in shared]
        for name, run in zip(variant_names, shared):
            _keep_least(least, (done, name, "shared"), run.prefill_seconds)
        if kept_shared != kept_alone:
            raise SystemExit(f"{document.document_id}: a cut stack keeps other tokens than its own prefill")
        del shared
        mx.clear_cache()
        done += 1
        tokens += len(prompt.tokens)
        print(f"# {document.document_id}: {len(prompt.tokens)} tokens", flush=True)
    print(f"\nPrefill of {done} topics ({tokens:,} prompt tokens), variants {', '.join(variant_names)} "
          "(compressed at prefill_end)\n")
    print("| way | seconds | documents per hour | largest prefill peak above the weights (MiB) |")
    print("|---|---|---|---|")
    for way in seconds:
        print(f"| {way} | {seconds[way]:.1f} | {3600 * done / seconds[way]:.0f} | {peaks[way] / 2**20:.0f} |")
    print(f"\none reading: {seconds['one per variant'] / seconds['one reading']:.2f}x the documents per hour")
    print(f"\nprefill_seconds as stored, each topic's least of {args.repeats} run(s), ways interleaved topic by topic\n")
    print("| variant | alone | shared | shared / alone | topics within 10% |")
    print("|---|---|---|---|---|")
    for name in variant_names:
        pairs = [(least[(i, name, "alone")], least[(i, name, "shared")]) for i in range(done)]
        alone, shared = sum(a for a, _ in pairs), sum(s for _, s in pairs)
        within = sum(abs(s / a - 1) <= 0.10 for a, s in pairs)
        print(f"| {name} | {alone:.1f} | {shared:.1f} | {shared / alone:.2f} | {within} of {done} |")


def _keep_least(least: dict, key: tuple, seconds: float) -> None:
    least[key] = min(least.get(key, seconds), seconds)


if __name__ == "__main__":
    main()
