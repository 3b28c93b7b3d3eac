"""Documents per hour against a memory budget for caches: the full variant against a compressed one, long topics.

For the first ``--documents`` topics of the main job whose prompt is at least
``--min-tokens`` long and fits the model's context (prompted as ``jobs/summarize.yaml``
builds them), each variant (``--variants``, the job's own configs: the full cache and
pyramidkv-128 by default) is prefilled once per topic (``pipeline.generation.prefill_variant``,
what a job running that variant alone does, drafts included). Then, for each budget of
``--budgets`` MiB, copies of the prefilled stacks decode the job's ``max_tokens`` greedy
tokens the way the job decodes them: rows join the batch while its caches stay within the
budget until every row is done (``pipeline.schedule.DecodeAdmission``, growth and padding
included), at most ``--max-rows`` at once, a finished row's place going to the next.

``--copies`` puts each topic in the stream that many times (prefilled once, decoded as
that many rows; the main job has only a few topics of 4-8k tokens). Prints, per variant
and budget: the most rows that decoded together, decode tokens per second, and documents
per hour of prefill plus decode (each document's prefill is the one measured for its
topic: it does not depend on the budget); then the compressed variant's decode tokens per second
over the full variant's at each budget. ``--chart`` writes that as a Mermaid chart (the
README's). ``--peer-python`` runs OpenVINO GenAI (``bench/openvino_peer.py``, in a venv of its own:
``python3 -m venv /tmp/ovenv && /tmp/ovenv/bin/pip install openvino-genai``) on the same prompt texts
and copies, its KV cache at each budget of 1 GiB and more, float32 compute and KV, without eviction
and with its own eviction at the compressed variant's budget; documents per hour beside Velox's. Not a
test: nothing here asserts on time.

    python bench/memory_budget.py --documents 8 --copies 4 --budgets 256 512 1024 2048 4096
    python bench/memory_budget.py --documents 8 --copies 4 --budgets 1024 --peer-python /tmp/ovenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from pipeline.generation import prefill_variant  # noqa: E402
from pipeline.model_store import context_length, embedded_gguf_path, load_model  # noqa: E402
from pipeline.prompting import PromptTooLong, build_prompt  # noqa: E402
from pipeline.sampling import TokenChoice  # noqa: E402
from pipeline.schedule import decode_within  # noqa: E402
from pipeline.source import iter_documents, open_dataset  # noqa: E402
from pipeline.spec import load_spec  # noqa: E402
from velox_cache import snapshot  # noqa: E402
from velox_cache.generation.decode import DecodeRow  # noqa: E402
from velox_cache.generation.routing import attention_routing  # noqa: E402

MAIN_JOB = Path(__file__).resolve().parent.parent / "jobs" / "summarize.yaml"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--min-tokens", type=int, default=4096)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096], help="MiB of caches")
    parser.add_argument("--max-rows", type=int, default=32)
    parser.add_argument("--copies", type=int, default=1,
                        help="each topic enters the stream this many times (prefilled once; the main job has few 4-8k topics)")
    parser.add_argument("--variants", nargs="+", default=["full", "pyramidkv-128"])
    parser.add_argument("--job", default=str(MAIN_JOB))
    parser.add_argument("--chart", help="write the Mermaid chart of the ratio here")
    parser.add_argument("--peer-python", help="the OpenVINO GenAI venv's python: run the peer on the same prompts "
                                              "(bench/openvino_peer.py; budgets of 1 GiB and more)")
    args = parser.parse_args(argv)
    spec = load_spec(args.job)
    variants = {variant.name: variant for variant in spec.variants}
    unknown = [name for name in args.variants if name not in variants]
    if unknown:
        raise SystemExit(f"--variants: {', '.join(unknown)} not in {args.job} (it has {', '.join(variants)})")
    model, tokenizer = load_model(spec.model)
    context = context_length(model)
    settings = spec.generation
    prompts = _long_prompts(spec, tokenizer, context, args)
    print(f"# {len(prompts)} topics of {min(len(p.tokens) for p in prompts):,}-"
          f"{max(len(p.tokens) for p in prompts):,} tokens x {args.copies} copies, {settings.max_tokens} tokens each",
          flush=True)
    figures = {}  # (variant, budget MiB) -> (most rows, decode tokens/s, documents/hour)
    for name in args.variants:
        config = variants[name].cache
        start = time.perf_counter()
        runs = [prefill_variant(model, tokenizer, prompt, config, settings) for prompt in prompts]
        prefill = time.perf_counter() - start
        print(f"# {name}: prefill {prefill:.1f} s", flush=True)
        for budget in args.budgets:
            rows, seconds = _decode(model, runs, prompts, settings, config, budget * 2**20, args.max_rows, args.copies)
            tokens = sum(len(row.tokens) for row in rows)
            figures[name, budget] = (max(row.batch_size for row in rows), tokens / seconds,
                                     3600 * len(rows) / (prefill * args.copies + seconds))
            print(f"# {name} at {budget} MiB: {figures[name, budget][0]} rows, {tokens / seconds:.1f} tok/s", flush=True)
            del rows  # before the next budget's copies
            mx.clear_cache()
        del runs
        mx.clear_cache()
    print("\n| variant | budget (MiB) | most rows together | decode tokens/s | documents/hour |")
    print("|---|---|---|---|---|")
    for (name, budget), (rows, rate, per_hour) in figures.items():
        print(f"| {name} | {budget} | {rows} | {rate:.1f} | {per_hour:.0f} |")
    full, compressed = args.variants[0], args.variants[-1]
    ratios = [figures[compressed, b][1] / figures[full, b][1] for b in args.budgets]
    print(f"\n{compressed} decode tokens/s over {full}'s: "
          + ", ".join(f"{b} MiB {r:.2f}x" for b, r in zip(args.budgets, ratios)))
    if args.peer_python:
        _peer(args, prompts, tokenizer, variants, figures)
    if args.chart:
        Path(args.chart).write_text(_chart(args.budgets, figures, args.variants))
        print(f"chart: {args.chart}")


def _peer(args, prompts, tokenizer, variants, figures) -> None:
    """OpenVINO GenAI's ``ContinuousBatchingPipeline`` on the same prompt texts and copies, its KV cache at each
    budget (whole GiB: its ``cache_size``), without eviction beside the full variant and with its own eviction at the
    compressed variant's budget beside it; documents/hour of its ``generate`` (prefill and decode, load apart)."""
    texts = [tokenizer.decode(prompt.tokens) for prompt in prompts] * args.copies
    full, compressed = args.variants[0], args.variants[-1]
    rows = []
    for budget in [b for b in args.budgets if b >= 1024]:
        for name, eviction in ((full, None), (compressed, variants[compressed].cache.budget)):
            request = {"gguf": str(embedded_gguf_path()), "cache_gib": budget / 1024, "max_rows": args.max_rows,
                       "threads": 2, "max_tokens": load_spec(args.job).generation.max_tokens, "prompts": texts,
                       "eviction_budget": eviction}
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
                json.dump(request, file)
            out = subprocess.run([args.peer_python, str(Path(__file__).with_name("openvino_peer.py")), file.name],
                                 capture_output=True, text=True, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            per_hour = 3600 * result["documents"] / result["seconds"]
            rows.append((name, eviction, budget, result["seconds"], per_hour, figures[name, budget][2]))
            print(f"# peer beside {name} at {budget} MiB: {result['seconds']:.1f} s", flush=True)
    print("\n| beside | peer eviction | budget (MiB) | peer seconds | peer documents/hour | Velox documents/hour | Velox / peer |")
    print("|---|---|---|---|---|---|---|")
    for name, eviction, budget, seconds, peer, velox in rows:
        print(f"| {name} | {eviction or 'none'} | {budget} | {seconds:.1f} | {peer:.0f} | {velox:.0f} | {velox / peer:.2f} |")


def _long_prompts(spec, tokenizer, context, args) -> list:
    prompts = []
    for document in iter_documents(spec, open_dataset(spec)):
        if len(prompts) == args.documents:
            break
        try:
            prompt = build_prompt(spec, tokenizer, document, context_length=context)
        except PromptTooLong:
            continue
        if len(prompt.tokens) >= args.min_tokens:
            prompts.append(prompt)
    if not prompts:
        raise SystemExit(f"no topic of {args.job}'s input has {args.min_tokens} tokens and fits the context")
    return prompts


def _decode(model, runs, prompts, settings, config, budget_bytes: int, max_rows: int, copies: int) -> tuple[list, float]:
    """Copies of ``runs``' stacks (``copies`` of each, in turn) decoded as the job decodes them; ``(rows, seconds)``."""
    rows = [DecodeRow(snapshot(run.row.caches), TokenChoice(settings, prompt.tokens), run.first_logprobs,
                      run.row.max_tokens, run.row.eos) for _ in range(copies) for run, prompt in zip(runs, prompts)]
    mx.eval([cache.state for row in rows for cache in row.caches])
    start = time.perf_counter()
    with attention_routing(model, [config]):
        rows = decode_within(model, rows, budget_bytes=budget_bytes, max_rows=max_rows)
    return rows, time.perf_counter() - start


def _chart(budgets, figures, variants) -> str:
    """A Mermaid ``xychart-beta``: decode tokens/s against the budget, one line per variant (in ``variants`` order)."""
    lines = ["```mermaid", "xychart-beta", '    title "Decode tokens/s against the memory budget for caches"',
             f"    x-axis \"MiB of caches\" [{', '.join(str(b) for b in budgets)}]", '    y-axis "tokens/s"']
    for name in variants:
        lines.append(f"    line [{', '.join(f'{figures[name, b][1]:.1f}' for b in budgets)}]")
    lines.append("```")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
