"""Fidelity benchmark: how closely each policy tracks the full cache on real summaries.

For each corpus document (CPython's reference-manual topics of 1k-4k prompt
tokens, prompted exactly as the main job ``jobs/summarize.yaml`` prompts them:
system message, chat template, the instruction after the document, the prompt
split into prefix / document / instruction so that streaming timing runs the
instruction as its probe), the full cache generates a greedy
summary; every policy at every budget then generates its own and is
teacher-forced on the full output from a snapshot of its cache taken when
prefill ended (``pipeline.generation.generate(..., reference=...)``). Prints,
per policy x heads x timing x budget, the mean and the worst document's top-1
agreement (1.0 = identical behaviour) and log-likelihood gap (nats per token).

    python bench/fidelity.py --documents 8 --fractions 0.5 0.25 0.1 --timings default streaming
    python bench/fidelity.py --policies pyramidkv squeeze --heads uniform adaptive --fractions 0.5 0.25 0.1
    python bench/fidelity.py --documents 2 --policies pyramidkv --min-tokens 1000 --max-tokens 1500
    python bench/fidelity.py --policies pyramidkv squeeze --timings prefill_end \
        --choice default --choice look16:lookahead=16,kernel=7

Each ``--choice`` (a ranking or allocation choice: ``lookahead``, ``kernel``,
``mass_weight``, ``beta``, ``fit_budgets``, ...) runs every policy x budget; the
last column is what each configuration cost beyond the reading (its cut or own
prefill, and decode, summed); the prefill-end configurations of one choice share
one reading per document (cut stacks equal their own prefill's), whose seconds
(drafts and re-reading included) are printed per choice.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import config_overrides, load_default_model  # noqa: E402
from pipeline.generation import (  # noqa: E402
    Reference,
    cut_shared,
    generate,
    generate_together,
    read_shared,
)
from pipeline.prompting import build_prompt  # noqa: E402
from pipeline.source import Document  # noqa: E402
from pipeline.spec import GenerationSpec, load_spec  # noqa: E402
from velox_cache import KVCacheConfig  # noqa: E402
from velox_cache.generation.reading import derivable  # noqa: E402
from velox_cache.policies import POLICIES  # noqa: E402

MAIN_JOB = Path(__file__).resolve().parent.parent / "jobs" / "summarize.yaml"


def corpus_prompts(tokenizer, *, count: int, min_tokens: int, max_tokens: int):
    """``(topic, Prompt)`` for the first ``count`` topics whose prompt fits the range, split as the main job's."""
    from pydoc_data.topics import topics

    spec = load_spec(MAIN_JOB)
    found = []
    if count == 0:
        return found
    for name in sorted(topics):
        prompt = build_prompt(spec, tokenizer, Document(name, {"text": topics[name]}, "-"))
        if min_tokens <= len(prompt.tokens) <= max_tokens:
            found.append((name, prompt))
        if len(found) == count:
            break
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--min-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=4000)
    parser.add_argument("--policies", nargs="+", default=[p for p in POLICIES if p != "full"])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25, 0.1])
    parser.add_argument("--timings", nargs="+", default=["default"], help="eviction timings: default, continuous, prefill_end, streaming")
    parser.add_argument("--heads", nargs="+", default=["default"], help="head budgets: default (the policy's), uniform, adaptive")
    parser.add_argument("--output-tokens", type=int, default=40)
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="extra KVCacheConfig fields")
    parser.add_argument("--choice", action="append", default=[], metavar="NAME[:FIELD=VALUE,...]",
                        help="a ranking or allocation choice to compare (repeatable; default: the policies' own)")
    parser.add_argument("--needles", type=int, default=0, metavar="CASES",
                        help="also each choice's needle accuracy: CASES needles in ~1k tokens, every policy x budget")
    parser.add_argument("--stream-needles", type=int, default=0, metavar="CASES",
                        help="also CASES needles in ~4k tokens, streamed at a budget of 512 (as bench/streaming.py needle)")
    args = parser.parse_args(argv)
    extra = config_overrides(args.set)
    choices = [_choice(text) for text in args.choice] or [("default", {})]

    model, tokenizer = load_default_model()
    settings = GenerationSpec(max_tokens=args.output_tokens, temperature=0.0, seed=0, prefill_step_size=256)
    documents = corpus_prompts(tokenizer, count=args.documents, min_tokens=args.min_tokens, max_tokens=args.max_tokens)
    started = time.time()
    rows: dict = {}
    seconds: dict = {}
    reading_seconds = {choice: 0.0 for choice, _ in choices}
    for name, prompt in documents:
        full = generate(model, tokenizer, prompt, KVCacheConfig(method="full"), settings)
        reference = Reference(full.token_ids, full.logprobs)
        for choice, choice_fields in choices:
            keyed = {}
            for policy in args.policies:
                for heads in args.heads:
                    for timing in args.timings:
                        for fraction in args.fractions:
                            budget = max(8, int(len(prompt.tokens) * fraction))
                            fields = dict(method=policy, budget=budget, scoring="observed", **extra, **choice_fields)
                            if timing != "default":
                                fields["eviction"] = timing
                            if heads != "default":
                                fields["head_budgets"] = heads
                            keyed[(choice, policy, heads, timing, fraction)] = KVCacheConfig(**fields)
            # the prefill-end configs of one choice share one reading (cut stacks equal their own prefill's);
            # the rest (streaming, continuous) prefill on their own
            shared = {key: config for key, config in keyed.items() if derivable(config)}
            results = {}
            if shared:
                reading = read_shared(model, tokenizer, prompt, list(shared.values()), settings)
                reading_seconds[choice] += reading.seconds + reading.look_ahead_seconds + (reading.draft_seconds or 0)
                runs = [cut_shared(tokenizer, reading, config, settings) for config in shared.values()]
                for run in runs:
                    run.refer_to(reference)
                results.update(zip(shared, generate_together(model, tokenizer, runs)))
            for key, config in keyed.items():
                if key not in results:
                    results[key] = generate(model, tokenizer, prompt, config, settings, reference=reference)
            for key, result in results.items():
                rows.setdefault(key, []).append((name, result.fidelity))
                own = result.prefill_seconds - (result.reading_seconds or 0) + (result.draft_seconds or 0)
                seconds[key] = seconds.get(key, 0.0) + own + result.decode_seconds  # a shared reading: below
        print(f"# {name}: {len(prompt.tokens)} prompt tokens, {len(reference.token_ids)} reference tokens", flush=True)

    print(f"\nFidelity to the full cache: {len(documents)} documents of {args.min_tokens}-{args.max_tokens} prompt "
          f"tokens, {args.output_tokens} greedy tokens, SmolLM2-135M {' '.join(args.set)}\n")
    print("| choice | policy | heads | timing | budget | mean agreement | worst agreement (document) | mean NLL gap "
          "| worst NLL gap | prefill + decode s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, values in rows.items():
        choice, policy, heads, timing, fraction = key
        agreements = [f.agreement for _, f in values]
        gaps = [f.nll_gap for _, f in values]
        worst = min(values, key=lambda v: v[1].agreement)
        print(
            f"| {choice} | {policy} | {heads} | {timing} | {fraction:.0%} | {sum(agreements) / len(agreements):.3f} | "
            f"{worst[1].agreement:.3f} ({worst[0]}) | {sum(gaps) / len(gaps):.3f} | {max(gaps):.3f} | "
            f"{seconds[key]:.1f} |",
            flush=True,
        )
    if args.needles or args.stream_needles:
        needles(model, tokenizer, args, choices, extra)
    print("\n| choice | shared reading s (every prefill-end config of the choice, drafts and re-reading included) |")
    print("|---|---|")
    for choice, total in reading_seconds.items():
        print(f"| {choice} | {total:.1f} |")
    print(f"\n(took {time.time() - started:.0f} s)")


def needles(model, tokenizer, args, choices, extra) -> None:
    """Each choice's needle accuracy, in the same run: ~1k-token haystacks at every policy x budget
    (the choice's timing), and ~4k-token ones streamed at a budget of 512 (``bench/streaming.py needle``)."""
    from bench.needle import make_needle_case
    from bench.streaming import split_prompt

    settings = GenerationSpec(max_tokens=24, temperature=0.0, seed=0, prefill_step_size=256)
    runs = [(1000, args.needles, None), (4096, args.stream_needles, "streaming")]
    hits: dict = {}
    for length, count, eviction in runs:
        for i in range(count):
            depth = 0.1 + 0.8 * i / max(1, count - 1)
            case = make_needle_case(tokenizer, seed=i, n_tokens=max(64, length - 64), depth=depth)
            prompt = split_prompt(tokenizer, case.document, case.question)
            full = generate(model, tokenizer, prompt, KVCacheConfig(method="full"), settings)
            hits.setdefault((length, "full", "-", None), []).append(case.code in full.output)
            for choice, choice_fields in choices:
                for policy in args.policies:
                    for fraction in (args.fractions if eviction is None else [None]):
                        budget = 512 if fraction is None else max(8, int(len(prompt.tokens) * fraction))
                        fields = dict(method=policy, budget=budget, scoring="observed", **extra, **choice_fields)
                        if eviction is not None:
                            fields.update(eviction=eviction, selection="window")
                        config = KVCacheConfig(**fields)
                        result = generate(model, tokenizer, prompt, config, settings)
                        hits.setdefault((length, choice, policy, fraction), []).append(case.code in result.output)
    print("\n| haystack | choice | policy | budget | needles found |")
    print("|---|---|---|---|---|")
    for (length, choice, policy, fraction), found in hits.items():
        budget = "100%" if choice == "full" else ("512, streaming" if fraction is None else f"{fraction:.0%}")
        print(f"| ~{length} tokens | {choice} | {policy} | {budget} | {sum(found)} / {len(found)} |", flush=True)


def _choice(text: str) -> tuple[str, dict]:
    """``NAME:FIELD=VALUE,...`` -> (name, KVCacheConfig fields)."""
    name, _, fields = text.partition(":")
    return name, config_overrides([f for f in fields.split(",") if f])


if __name__ == "__main__":
    from pipeline.platform import ensure_fast_blas

    ensure_fast_blas()  # OpenBLAS preloaded, its kernels chosen from the CPU (re-executes once)
    main()
