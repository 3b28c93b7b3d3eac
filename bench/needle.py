"""Quality benchmark: needle-in-a-haystack accuracy and summary fidelity under compression.

A seeded generator hides a key/value fact ("The access code of the Orion
archive is 418207.") at a chosen depth in real prose (CPython's
``pydoc_data.topics``) and asks for it after the document. The evaluator runs
the embedded SmolLM2 with the full cache and with every policy at budgets of
50% and 25% of the prompt, with both scorings, in one run, and prints accuracy
per policy x budget x scoring. It then summarises a few documents with every
configuration and prints the mean ROUGE-L against the full-cache summary, and
the teacher-forced top-1 agreement with the full cache (1.0 = identical).

    python bench/needle.py --cases 8 --tokens 1000
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from bench.common import config_overrides, load_default_model, prose, scoring_context  # noqa: E402
from pipeline.generation import prefill  # noqa: E402
from pipeline.similarity import rouge_l  # noqa: E402
from velox_cache import KVCacheBuilder, KVCacheConfig  # noqa: E402
from velox_cache.policies import POLICIES  # noqa: E402

NAMES = ["Orion", "Juniper", "Cobalt", "Meridian", "Falcon", "Saffron", "Glacier", "Tundra", "Quartz", "Harbor"]
QUESTION = "What is the access code of the {name} archive? Answer with the number only."


@dataclass
class NeedleCase:
    name: str
    code: str
    depth: float
    messages: list
    document: str = ""  # the haystack with the needle (the user message is document, blank line, question)
    question: str = ""


def make_needle_case(tokenizer, *, seed: int, n_tokens: int, depth: float) -> NeedleCase:
    """A haystack of about ``n_tokens`` prose tokens with one fact hidden at ``depth`` (0..1)."""
    rng = random.Random(seed)
    name = rng.choice(NAMES)
    code = "".join(rng.choice("0123456789") for _ in range(6))
    haystack = prose(n_tokens, tokenizer, start=seed * 7 % 50)
    sentences = haystack.split(". ")
    at = max(1, min(len(sentences) - 1, int(len(sentences) * depth)))
    needle = f"The access code of the {name} archive is {code}"
    document = ". ".join(sentences[:at] + [needle] + sentences[at:])
    question = QUESTION.format(name=name)
    content = f"{document}\n\n{question}"
    return NeedleCase(name, code, depth, [{"role": "user", "content": content}], document, question)


def greedy(model, prompt_ids, caches, scoring, max_tokens, prefill_step=256):
    """Chunked prefill and greedy decode; returns the generated token ids."""
    out = []
    with scoring_context(model, scoring):
        token = mx.argmax(prefill(model, prompt_ids, caches, prefill_step), axis=-1).item()
        while len(out) < max_tokens and token not in (0, 2):
            out.append(token)
            token = mx.argmax(model(mx.array([[token]]), cache=caches)[:, -1], axis=-1).item()
    return out


def teacher_forced_agreement(model, prompt_ids, reference_ids, caches, scoring, prefill_step=256):
    """Share of the reference continuation's tokens that the cache's top-1 prediction matches."""
    if not reference_ids:
        return 1.0
    with scoring_context(model, scoring):
        predictions = [mx.argmax(prefill(model, prompt_ids, caches, prefill_step), axis=-1).item()]
        for token in reference_ids[:-1]:
            predictions.append(mx.argmax(model(mx.array([[token]]), cache=caches)[:, -1], axis=-1).item())
    return sum(p == r for p, r in zip(predictions, reference_ids)) / len(reference_ids)


def configurations(prompt_tokens: int, policies, scorings, fractions, extra=None):
    yield "full", None, None, KVCacheConfig(method="full")
    for policy in policies:
        for fraction in fractions:
            budget = max(8, int(prompt_tokens * fraction))
            for scoring in scorings:
                yield policy, fraction, scoring, KVCacheConfig(method=policy, budget=budget, scoring=scoring, **(extra or {}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1000, help="haystack length in tokens")
    parser.add_argument("--policies", nargs="+", default=[p for p in POLICIES if p != "full"])
    parser.add_argument("--scorings", nargs="+", default=["observed", "key_proxy"])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--summaries", type=int, default=3, help="documents for the ROUGE-L part (0: skip)")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="extra KVCacheConfig fields")
    args = parser.parse_args(argv)

    model, tokenizer = load_default_model()
    started = time.time()
    cases = [
        make_needle_case(tokenizer, seed=i, n_tokens=args.tokens, depth=0.1 + 0.8 * i / max(1, args.cases - 1))
        for i in range(args.cases)
    ]
    prompts = [tokenizer.apply_chat_template(c.messages, add_generation_prompt=True) for c in cases]
    extras = config_overrides(args.set)
    mean_len = sum(map(len, prompts)) // len(prompts)
    results = {}
    for case, prompt in zip(cases, prompts):
        for policy, fraction, scoring, config in configurations(
            len(prompt), args.policies, args.scorings, args.fractions, extras
        ):
            # as a job builds them: budgets fitted to the prompt and the tokens to generate (fit_budgets)
            caches = KVCacheBuilder.for_model(model, config, prompt_tokens=len(prompt), new_tokens=24)
            answer = tokenizer.decode(greedy(model, prompt, caches, scoring, max_tokens=24))
            results.setdefault((policy, fraction, scoring), []).append(case.code in answer)
    full_accuracy = sum(results[("full", None, None)]) / len(cases)
    print(f"Needle in a haystack: {len(cases)} cases, prompts ~{mean_len} tokens, SmolLM2-135M, greedy\n")
    print("| policy | budget | scoring | accuracy | vs full |")
    print("|---|---|---|---|---|")
    for (policy, fraction, scoring), hits in results.items():
        accuracy = sum(hits) / len(hits)
        relative = f"{accuracy / full_accuracy:.2f}" if full_accuracy else "-"
        budget = "100%" if fraction is None else f"{fraction:.0%}"
        print(f"| {policy} | {budget} | {scoring or '-'} | {accuracy:.2f} | {relative} |", flush=True)

    if args.summaries:
        summary_fidelity(model, tokenizer, args)
    print(f"\n(took {time.time() - started:.0f} s)")


def summary_fidelity(model, tokenizer, args):
    from pydoc_data.topics import topics

    names = [n for n in sorted(topics) if 300 < len(tokenizer.encode(topics[n])) < 900][: args.summaries]
    extras = config_overrides(args.set)
    rows = {}
    for name in names:
        content = f"{topics[name]}\n\nSummarize the documentation above in two sentences."
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        reference = None
        for policy, fraction, scoring, config in configurations(
            len(prompt), args.policies, args.scorings, args.fractions, extras
        ):
            output = greedy(model, prompt, KVCacheBuilder.for_model(model, config), scoring, max_tokens=40)
            if policy == "full":
                reference = output
                continue
            agreement = teacher_forced_agreement(
                model, prompt, reference, KVCacheBuilder.for_model(model, config), scoring
            )
            score = rouge_l(tokenizer.decode(output), tokenizer.decode(reference))
            rows.setdefault((policy, fraction, scoring), []).append((score, agreement))
    print(f"\nSummary fidelity to the full cache ({len(names)} documents, 40 greedy tokens)\n")
    print("| policy | budget | scoring | mean ROUGE-L | teacher-forced top-1 agreement |")
    print("|---|---|---|---|---|")
    for (policy, fraction, scoring), values in rows.items():
        rouge = sum(v[0] for v in values) / len(values)
        agreement = sum(v[1] for v in values) / len(values)
        print(f"| {policy} | {fraction:.0%} | {scoring} | {rouge:.3f} | {agreement:.3f} |", flush=True)


if __name__ == "__main__":
    from pipeline.platform import ensure_fast_blas

    ensure_fast_blas()  # OpenBLAS preloaded, its kernels chosen from the CPU (re-executes once)
    main()
