"""Compressed summaries against the full cache's, on the main job's own topics and prompts.

For the first ``--documents`` topics of ``jobs/summarize.yaml`` that fit the
model's context, one shared reading (``pipeline.generation.prefill_shared``)
gives the full variant and every variant asked for (all at ``prefill_end``);
each decodes its summary (greedy, the job's ``max_tokens``) and is
teacher-forced on the full summary. Prints per variant: mean ROUGE-L against
the full summary, how many summaries are identical, mean and worst
teacher-forced agreement, ROUGE-L by prompt length, and the seconds spent
(the reading once, each variant's cut and decode).

A variant is ``NAME`` or ``NAME:FIELD=VALUE,FIELD=VALUE`` over ``KVCacheConfig``
fields (``method`` included); with no variants, the job's own compressed ones.

    python bench/summaries.py --documents 24
    python bench/summaries.py --documents 24 --variant py:method=pyramidkv,budget=128 \\
        --variant py-look16:method=pyramidkv,budget=128,lookahead=16
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from bench.common import config_overrides  # noqa: E402
from pipeline.generation import generate_together, prefill_shared  # noqa: E402
from pipeline.model_store import context_length, load_model  # noqa: E402
from pipeline.prompting import PromptTooLong, build_prompt  # noqa: E402
from pipeline.reference import Reference  # noqa: E402
from pipeline.similarity import rouge_l  # noqa: E402
from pipeline.source import iter_documents, open_dataset  # noqa: E402
from pipeline.spec import load_spec  # noqa: E402
from velox_cache import KVCacheConfig  # noqa: E402

MAIN_JOB = Path(__file__).resolve().parent.parent / "jobs" / "summarize.yaml"
LENGTHS = [(0, 200), (200, 600), (600, 10**9)]


def parse_variant(text: str) -> tuple[str, KVCacheConfig]:
    """``NAME:FIELD=VALUE,...`` -> (name, config at prefill_end unless it says otherwise)."""
    name, _, fields = text.partition(":")
    values = config_overrides([f for f in fields.split(",") if f]) if fields else {}
    values.setdefault("eviction", "prefill_end")
    return name, KVCacheConfig.from_dict(values, where=f"--variant {name}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", type=Path, default=MAIN_JOB)
    parser.add_argument("--documents", type=int, default=24)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME[:FIELD=VALUE,...]")
    args = parser.parse_args(argv)
    spec = load_spec(args.job)
    if args.variant:
        variants = [parse_variant(v) for v in args.variant]
    else:
        variants = [(v.name, dataclasses.replace(v.cache, eviction="prefill_end"))
                    for v in spec.variants if v.cache.method != "full"]
    model, tokenizer = load_model(spec.model)
    context = context_length(model)
    configs = [KVCacheConfig(method="full")] + [config for _, config in variants]
    rows = {name: [] for name, _ in variants}
    seconds = {"reading": 0.0, **{name: 0.0 for name, _ in variants}}
    done = 0
    for document in iter_documents(spec, open_dataset(spec)):
        if done == args.documents:
            break
        try:
            prompt = build_prompt(spec, tokenizer, document, context_length=context)
        except PromptTooLong:
            continue
        runs = prefill_shared(model, tokenizer, prompt, configs, spec.generation)
        # the reading with its look-ahead and draft, paid once for every run cut from it
        seconds["reading"] += max(run.reading_seconds for run in runs) + max(run.draft_seconds or 0 for run in runs)
        full = generate_together(model, tokenizer, runs[:1])[0]
        reference = Reference.of_output(full.token_ids, full.logprobs)
        for run in runs[1:]:
            run.refer_to(reference)
        results = generate_together(model, tokenizer, runs[1:])
        for (name, _), run, result in zip(variants, runs[1:], results):
            own = run.prefill_seconds - run.reading_seconds  # the reading is counted once, above
            seconds[name] += own + result.decode_seconds + (result.fidelity.seconds if result.fidelity else 0)
            rows[name].append({
                "tokens": len(prompt.tokens),
                "rouge": rouge_l(result.output, full.output),
                "identical": result.token_ids == full.token_ids,
                "agreement": result.fidelity.agreement if result.fidelity else float("nan"),
            })
        done += 1
        print(f"# {document.document_id}: {len(prompt.tokens)} tokens, "
              + ", ".join(f"{name} {rows[name][-1]['rouge']:.2f}" for name, _ in variants), flush=True)
        del runs
        mx.clear_cache()
    print(f"\n{done} topics of {args.job.name}; ROUGE-L and agreement against the full cache's own summary\n")
    buckets = " | ".join(f"ROUGE-L {lo}-{hi if hi < 10**9 else ''} tokens" for lo, hi in LENGTHS)
    print(f"| variant | ROUGE-L | identical | agreement (mean / worst) | {buckets} | seconds |")
    print("|---|---|---|---|" + "---|" * len(LENGTHS) + "---|")
    for name, _ in variants:
        got = rows[name]
        by_length = []
        for lo, hi in LENGTHS:
            inside = [r["rouge"] for r in got if lo <= r["tokens"] < hi]
            by_length.append(f"{sum(inside) / len(inside):.3f} ({len(inside)})" if inside else "-")
        agreement = [r["agreement"] for r in got]
        print(f"| {name} | {sum(r['rouge'] for r in got) / len(got):.3f} | {sum(r['identical'] for r in got)} | "
              f"{sum(agreement) / len(agreement):.3f} / {min(agreement):.3f} | {' | '.join(by_length)} | {seconds[name]:.1f} |")
    print(f"\nthe shared reading: {seconds['reading']:.1f} s")


if __name__ == "__main__":
    main()
