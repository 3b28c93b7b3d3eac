"""Streaming compressed prefill (FINCH): cost against length, needles past the context, squeeze's schedule.

Three measurements on the embedded SmolLM2 (float32 on CPU; preload OpenBLAS
as `make bench` does). Not tests: nothing here asserts on time.

* ``cost``: prefill time, prompt tokens/s, decode time per token and peak MLX
  memory against prompt length, for streaming PyramidKV and SqueezeAttention,
  PyramidKV at prefill end, plain mlx-lm ``KVCache`` on mlx-lm's attention
  (``plain``) and Velox's ``full`` cache on Velox's attention (the job's full
  variant); all but streaming only where the prompt fits the model's context.
  Ratios are to plain at the same length, and to the same variant at
  ``--reference`` tokens.
* ``needle``: a six-digit code hidden at spread depths of prose documents of
  each length, asked for after the document; accuracy of every variant, and
  relative to the full cache where the full cache can run.
* ``schedule``: the squeeze schedule streaming publishes (from the first
  chunk) against the one prefill-end publishes (from the whole prompt).

    python bench/streaming.py cost --lengths 1024 2048 4096 8192 16384
    python bench/streaming.py needle --lengths 4096 8192 16384 --cases 5
    python bench/streaming.py needle --lengths 4096 --cases 5 --variants full --job jobs/summarize.yaml
    python bench/streaming.py schedule --tokens 2048 --documents 3
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from bench.common import config_overrides, load_default_model, prose, scoring_context  # noqa: E402
from bench.needle import make_needle_case  # noqa: E402
from pipeline.prompting import build_prompt  # noqa: E402
from pipeline.source import Document  # noqa: E402
from pipeline.spec import parse_spec  # noqa: E402
from velox_cache import KVCacheBuilder, KVCacheConfig, model_context, prefill_phases  # noqa: E402

INSTRUCTION = "Summarize the documentation above in two sentences."


def split_prompt(tokenizer, text: str, instruction: str):
    """Chat prompt ``text``, blank line, ``instruction``, split as the job runner splits it."""
    template = "{text}\n\n" + instruction.replace("{", "{{").replace("}", "}}")
    spec = parse_spec({
        "name": "bench", "model": "unused",
        "input": {"path": "unused", "id_column": "id", "text_column": "text", "prompt_template": template},
    })
    return build_prompt(spec, tokenizer, Document("bench", {"text": text}, "-"))


def variants(budget: int, names: list[str], overrides: dict = None) -> dict:
    """Name -> cache config (None: plain mlx-lm ``KVCache`` on mlx-lm's own attention).

    ``overrides`` (``--set``) are extra ``KVCacheConfig`` fields for the compressed variants.
    """
    extra = {"budget": budget, **(overrides or {})}  # --set budget=N wins over --budget
    table = {
        "plain": None,
        "full": KVCacheConfig(method="full"),  # what the job runner's full variant runs (Velox attention)
        "prefill_end:pyramidkv": KVCacheConfig(method="pyramidkv", **extra),
        "prefill_end:squeeze": KVCacheConfig(method="squeeze", **extra),
        "streaming:pyramidkv": KVCacheConfig(method="pyramidkv", eviction="streaming", **extra),
        "streaming:squeeze": KVCacheConfig(method="squeeze", eviction="streaming", **extra),
    }
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(table)}")
    return {name: table[name] for name in names}


def job_variants(path: str, overrides: dict) -> dict:
    """``job:NAME`` -> a job spec's compressed variant as the job streams a document past the context."""
    from pipeline.spec import load_spec

    streamed = {}
    for variant in load_spec(path).variants:
        if variant.cache.method != "full":
            streamed[f"job:{variant.name}"] = dataclasses.replace(
                variant.for_document(False).cache, **overrides, eviction="streaming"
            )
    return streamed


def build_caches(model, config, scoring, prompt_tokens=None, new_tokens=None):
    """The variant's caches; with ``prompt_tokens`` (and ``new_tokens``) budgets fitted as a job fits them."""
    if config is None:
        return [KVCache() for _ in model.layers]
    if config.method == "full":
        return KVCacheBuilder.for_model(model, config)
    return KVCacheBuilder.for_model(model, dataclasses.replace(config, scoring=scoring),
                                    prompt_tokens=prompt_tokens, new_tokens=new_tokens)


def context_for(config, scoring: str) -> str:
    """What ``scoring_context`` runs a variant under: mlx-lm untouched for plain, Velox attention otherwise."""
    if config is None:
        return "plain"
    return "key_proxy" if config.method == "full" else scoring


def is_streaming(config) -> bool:
    return config is not None and config.eviction == "streaming"


def fits(model, prompt, new_tokens: int) -> bool:
    context = model_context(model)
    return context is None or len(prompt.tokens) + new_tokens <= context


def run_once(model, prompt, caches, *, scoring, chunk, decode_steps):
    """Prefill by phases then greedy decode.

    Returns (prefill s, median decode s/token, peak bytes above the start, generated tokens).
    """
    gc.collect()  # squeeze stacks are reference cycles (coordinator <-> caches): free the last run's arrays
    mx.clear_cache()
    start_memory = mx.get_active_memory()
    mx.reset_peak_memory()
    tokens = []
    with scoring_context(model, scoring):
        start = time.perf_counter()
        logits = prefill_phases(model, caches, prefix=prompt.prefix, document=prompt.document,
                                instruction=prompt.instruction, chunk_size=chunk, max_new_tokens=decode_steps + 1)
        token = mx.argmax(logits, axis=-1)
        mx.eval(token)
        prefill = time.perf_counter() - start
        steps = []
        for _ in range(decode_steps):
            tokens.append(token.item())
            if tokens[-1] in (0, 2):
                break
            start = time.perf_counter()
            token = mx.argmax(model(token[None], cache=caches)[:, -1], axis=-1)
            mx.eval(token)
            steps.append(time.perf_counter() - start)
    decode = statistics.median(steps) if steps else float("nan")
    return prefill, decode, mx.get_peak_memory() - start_memory, tokens


# ----- cost ------------------------------------------------------------------------------------


def cost(args):
    model, tokenizer = load_default_model()
    chosen = variants(args.budget, args.variants, config_overrides(args.set))
    warm = split_prompt(tokenizer, prose(300, tokenizer), INSTRUCTION)
    run_once(model, warm, [KVCache() for _ in model.layers], scoring="plain", chunk=args.chunk, decode_steps=2)
    results = {}
    print(f"Prefill cost, SmolLM2-135M, budget {args.budget}, chunks of {args.chunk}, {args.scoring} scoring\n")
    print("| prompt tokens | variant | prefill s | prompt tok/s | vs plain | decode ms/token "
          "| peak MiB above weights |")
    print("|---|---|---|---|---|---|---|")
    for length in args.lengths:
        prompt = split_prompt(tokenizer, prose(length, tokenizer), INSTRUCTION)
        for name, config in chosen.items():
            if not is_streaming(config) and not fits(model, prompt, args.decode_steps + 1):
                print(f"| {len(prompt.tokens)} | {name} | beyond the context | - | - | - | - |", flush=True)
                continue
            runs = [
                run_once(model, prompt, build_caches(model, config, args.scoring),
                         scoring=context_for(config, args.scoring), chunk=args.chunk, decode_steps=args.decode_steps)
                for _ in range(args.repeats)
            ]
            prefill = min(r[0] for r in runs)
            decode = min(r[1] for r in runs)
            peak = max(r[2] for r in runs)
            results[(length, name)] = (prefill, peak)
            plain = results.get((length, "plain"))
            ratio = f"{prefill / plain[0]:.2f}" if plain and name != "plain" else "-"
            print(f"| {len(prompt.tokens)} | {name} | {prefill:.2f} | {len(prompt.tokens) / prefill:.0f} | {ratio} | "
                  f"{decode * 1000:.1f} | {peak / 2**20:.0f} |", flush=True)
    print()
    for name in chosen:
        reference = results.get((args.reference, name))
        longest = max((n for n in args.lengths if (n, name) in results), default=None)
        if reference and longest and longest != args.reference:
            time_ratio = results[(longest, name)][0] / reference[0]
            memory_change = results[(longest, name)][1] / reference[1] - 1 if reference[1] else float("nan")
            print(f"{name}: prefill {longest} / {args.reference} tokens = {time_ratio:.2f}x "
                  f"(linear: {longest / args.reference:.1f}x); peak memory above weights {memory_change:+.0%}")


# ----- needle ----------------------------------------------------------------------------------


def needle(args):
    model, tokenizer = load_default_model()
    chosen = variants(args.budget, args.variants, config_overrides(args.set))
    if args.job:
        chosen.update(job_variants(args.job, config_overrides(args.set)))
    started = time.time()
    hits = {}
    for length in args.lengths:
        for i in range(args.cases):
            depth = 0.1 + 0.8 * i / max(1, args.cases - 1)
            case = make_needle_case(tokenizer, seed=i, n_tokens=max(64, length - 64), depth=depth)
            prompt = split_prompt(tokenizer, case.document, case.question)
            for name, config in chosen.items():
                if not is_streaming(config) and not fits(model, prompt, args.max_tokens):
                    continue
                caches = build_caches(model, config, args.scoring, len(prompt.tokens), args.max_tokens)
                _, _, _, tokens = run_once(model, prompt, caches,
                                           scoring=context_for(config, args.scoring), chunk=args.chunk,
                                           decode_steps=args.max_tokens)
                found = case.code in tokenizer.decode(tokens)
                hits.setdefault((length, name), []).append(found)
                print(f"  {length} tokens, depth {depth:.0%}, {name}: {'found' if found else 'missed'}",
                      file=sys.stderr, flush=True)
    print(f"\nNeedle in a haystack, SmolLM2-135M, budget {args.budget}, chunks of {args.chunk}, "
          f"{args.scoring} scoring, {args.cases} cases per length\n")
    print("| prompt tokens | variant | accuracy | vs full |")
    print("|---|---|---|---|")
    for (length, name), found in hits.items():
        accuracy = sum(found) / len(found)
        full = hits.get((length, "full")) or hits.get((length, "plain"))
        relative = f"{accuracy / (sum(full) / len(full)):.2f}" if full and sum(full) else "-"
        print(f"| ~{length} | {name} | {accuracy:.2f} | {relative} |")
    print(f"\n(took {time.time() - started:.0f} s)")


# ----- schedule --------------------------------------------------------------------------------


def schedule(args):
    overrides = config_overrides(args.set)
    model, tokenizer = load_default_model()
    print(f"Squeeze schedules, budget {args.budget}, chunks of {args.chunk}: streaming (first chunk) vs "
          "prefill end (whole prompt)\n")
    print("| document | tokens | correlation | mean abs difference / budget | largest layer change |")
    print("|---|---|---|---|---|")
    for d in range(args.documents):
        prompt = split_prompt(tokenizer, prose(args.tokens, tokenizer, start=d * 11), INSTRUCTION)
        budgets = {}
        for eviction in ("prefill_end", "streaming"):
            config = KVCacheConfig(method="squeeze", budget=args.budget, eviction=eviction, scoring=args.scoring,
                                   **overrides)
            caches = KVCacheBuilder.for_model(model, config)
            with scoring_context(model, args.scoring):
                prefill_phases(model, caches, prefix=prompt.prefix, document=prompt.document,
                               instruction=prompt.instruction, chunk_size=args.chunk)
            budgets[eviction] = caches[0].coordinator.budgets
        whole, first = budgets["prefill_end"], budgets["streaming"]
        difference = [abs(a - b) for a, b in zip(whole, first)]
        print(f"| {d} | {len(prompt.tokens)} | {_correlation(whole, first):.2f} | "
              f"{statistics.mean(difference) / args.budget:.2f} | {max(difference)} |", flush=True)


def _correlation(a, b) -> float:
    mean_a, mean_b = statistics.mean(a), statistics.mean(b)
    cov = sum((x - mean_a) * (y - mean_b) for x, y in zip(a, b))
    var_a = sum((x - mean_a) ** 2 for x in a)
    var_b = sum((y - mean_b) ** 2 for y in b)
    return cov / (var_a * var_b) ** 0.5 if var_a and var_b else float("nan")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub, budget=512):
        sub.add_argument("--budget", type=int, default=budget, help="average tokens kept per layer")
        sub.add_argument("--chunk", type=int, default=256, help="prefill chunk (prefill_step_size)")
        sub.add_argument("--scoring", choices=["observed", "key_proxy"], default="observed")
        sub.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                         help="extra KVCacheConfig fields for the compressed variants, e.g. mass_weight=0")

    sub = commands.add_parser("cost", help="prefill time and peak memory against prompt length")
    common(sub)
    sub.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    sub.add_argument("--variants", nargs="+",
                     default=["plain", "full", "prefill_end:pyramidkv", "streaming:pyramidkv", "streaming:squeeze"])
    sub.add_argument("--reference", type=int, default=4096, help="length the longest run is compared with")
    sub.add_argument("--decode-steps", type=int, default=8)
    sub.add_argument("--repeats", type=int, default=1, help="runs per configuration; the fastest counts")
    sub.set_defaults(run=cost)

    sub = commands.add_parser("needle", help="needle accuracy at each length, full cache as reference")
    common(sub)
    sub.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    sub.add_argument("--cases", type=int, default=5)
    sub.add_argument("--variants", nargs="*", default=["full", "streaming:pyramidkv", "streaming:squeeze"])
    sub.add_argument("--max-tokens", type=int, default=24)
    sub.add_argument("--job", metavar="SPEC", help="also a job spec's compressed variants as it streams a document past "
                     "the context (Variant.for_document: eviction auto streams), each at its own budget "
                     "unless --set budget=N")
    sub.set_defaults(run=needle)

    sub = commands.add_parser("schedule", help="squeeze's streaming schedule against its prefill-end schedule")
    common(sub, budget=128)
    sub.add_argument("--tokens", type=int, default=2048)
    sub.add_argument("--documents", type=int, default=3)
    sub.set_defaults(run=schedule)

    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    from pipeline.platform import ensure_fast_blas

    ensure_fast_blas()  # OpenBLAS preloaded, its kernels chosen from the CPU (re-executes once)
    main()
