"""Batched decoding: decode tokens/s at batch sizes 1..32, against batch 1 in the same run.

``throughput``: one prompt of real prose is prefilled once per row kind (full
cache at 1k and 4k tokens; pyramidkv at budgets 128 and 512 on a 2k prompt,
observed scoring, uniform or per-head budgets), then B copies of that stack decode ``--steps`` greedy
tokens together (``velox_cache.generation.decode.decode_rows``; B = 1 is the
one-at-a-time loop). Prints tokens/s and the speed-up over B = 1 of the same
kind. Rows read one copy of the prefilled stack, so every B decodes the same
work per row. Not a test: nothing here asserts on time.

``job``: the main job's first ``--documents`` topics (prompted as
``jobs/summarize.yaml``), ``--max-tokens`` greedy tokens each, decoded in
batches of ``--batch-size``: ``mlx_lm.batch_generate`` with plain caches
against Velox's full variant, one compressed variant and the three-variant
job (``velox-batch run`` on a fresh store, in-process), as documents per hour.

    python bench/batch_decode.py throughput --batch-sizes 1 2 4 8 16 32
    python bench/batch_decode.py throughput --batch-sizes 1 8 --compare-unpipelined
    python bench/batch_decode.py throughput --kinds pyramidkv-128 pyramidkv-128-kv8 --batch-sizes 1 8 32 --steps 64 --stagger 32
    python bench/batch_decode.py job --documents 24 --batch-size 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

import velox_cache  # noqa: E402
from bench.common import load_default_model, prose  # noqa: E402
from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases, snapshot  # noqa: E402
from velox_cache.generation.decode import DecodeRow, decode_rows  # noqa: E402
from velox_cache.generation.sampling import TokenSampler  # noqa: E402

KINDS = {  # name: (prompt tokens, config)
    "full-1k": (1024, KVCacheConfig(method="full")),
    "full-4k": (4096, KVCacheConfig(method="full")),
    "pyramidkv-128": (2048, KVCacheConfig(method="pyramidkv", budget=128, scoring="observed")),
    "pyramidkv-512": (2048, KVCacheConfig(method="pyramidkv", budget=512, scoring="observed")),
    "pyramidkv-128-adaptive": (2048, KVCacheConfig(method="pyramidkv", budget=128, scoring="observed", head_budgets="adaptive")),
    "pyramidkv-512-adaptive": (2048, KVCacheConfig(method="pyramidkv", budget=512, scoring="observed", head_budgets="adaptive")),
    # kept tokens quantized (kv_bits): each kind batches in a layer of its own (QuantizedFullBatch, QuantizedSlotsBatch)
    "full-1k-kv8": (1024, KVCacheConfig(method="full", kv_bits=8)),
    "full-4k-kv8": (4096, KVCacheConfig(method="full", kv_bits=8)),
    "pyramidkv-128-kv8": (2048, KVCacheConfig(method="pyramidkv", budget=128, scoring="observed", kv_bits=8)),
    "pyramidkv-128-kv4": (2048, KVCacheConfig(method="pyramidkv", budget=128, scoring="observed", kv_bits=4)),
}


def _context(model, config: KVCacheConfig):
    return velox_cache.observe(model) if config.scoring == "observed" else velox_cache.fast_attention(model)


def prefilled(model, tokenizer, length: int, config: KVCacheConfig):
    """``(caches, first logits)`` after prefilling ``length`` tokens of prose."""
    tokens = tokenizer.encode(prose(length, tokenizer))[:length]
    caches = KVCacheBuilder.for_model(model, config, prompt_tokens=len(tokens))
    with _context(model, config):
        logits = prefill_phases(model, caches, document=tokens, max_new_tokens=64)
    return caches, logits


def decode_rate(model, caches, logits, config, batch: int, steps: int, pipelined=None, stagger: int = 0) -> float:
    """Tokens/s of ``batch`` copies of ``caches`` decoding ``steps`` tokens each.

    ``stagger``: row ``i`` first takes ``i % stagger`` tokens alone (untimed) in a copy of its own, so that
    what happens every few steps of a row (a quantized window's flush) falls on different steps for different
    rows, as it does for different documents; 0: every row reads one copy and all do the same at once.
    """
    copy = snapshot(caches)  # one copy that every row reads (rows write back into it when they finish)
    rows = []
    for index in range(batch):
        sampler = TokenSampler()
        row_caches, row_logits = copy, logits
        if stagger:
            row_caches = snapshot(caches)
            with _context(model, config):
                for token in range(index % stagger):
                    row_logits = model(mx.array([[token + 3]]), cache=row_caches)[:, -1, :]
        rows.append(DecodeRow(row_caches, sampler, sampler.logprobs(row_logits), steps + 1))
        mx.eval([c.state for c in row_caches])
    mx.clear_cache()
    with _context(model, config):
        start = time.perf_counter()
        decode_rows(model, rows, pipelined=pipelined)
        seconds = time.perf_counter() - start
    return batch * steps / seconds  # steps model calls per row after the first token


def throughput(args) -> None:
    model, tokenizer = load_default_model()
    compare = args.compare_unpipelined
    print("| rows | B | tokens/s | speed-up over B=1 |" + (" unpipelined tokens/s | pipelining gain |" if compare else ""))
    print("|---|---|---|---|" + ("---|---|" if compare else ""))
    for kind in args.kinds:
        length, config = KINDS[kind]
        caches, logits = prefilled(model, tokenizer, length, config)
        decode_rate(model, caches, logits, config, 1, 2)  # warm-up
        base = None
        for batch in args.batch_sizes:
            rate = 0.0 if compare else decode_rate(model, caches, logits, config, batch, args.steps,
                                                   stagger=args.stagger)
            off = None
            if compare:  # alternating runs, best of each: the difference is a few percent
                off = 0.0
                for _ in range(args.repeats):
                    off = max(off, decode_rate(model, caches, logits, config, batch, args.steps, pipelined=False))
                    rate = max(rate, decode_rate(model, caches, logits, config, batch, args.steps, pipelined=True))
            base = base or rate
            line = f"| {kind} | {batch} | {rate:.1f} | {rate / base:.2f}x |"
            print(line + (f" {off:.1f} | {rate / off:.3f}x |" if compare else ""), flush=True)


MAIN_JOB = Path(__file__).resolve().parent.parent / "jobs" / "summarize.yaml"


def job_documents(tokenizer, count: int, context: int):
    """The first ``count`` documents of the main job's input whose prompt fits the model's context.

    Returns ``(spec, table, prompts)``: every run reads the same documents (the full
    variant skips longer ones, which the streaming variants would read).
    """
    import pyarrow as pa

    from pipeline.prompting import PromptTooLong, build_prompt
    from pipeline.source import iter_documents, open_dataset
    from pipeline.spec import load_spec

    spec = load_spec(MAIN_JOB)
    kept, prompts = [], []
    for document in iter_documents(spec, open_dataset(spec)):
        try:
            prompts.append(build_prompt(spec, tokenizer, document, context_length=context - spec.generation.max_tokens).tokens)
        except PromptTooLong:
            continue
        kept.append(document.document_id)
        if len(prompts) == count:
            break
    table = open_dataset(spec).to_table()
    rows = [i for i, topic in enumerate(table.column(spec.input.id_column).to_pylist()) if topic in set(kept)]
    return spec, table.take(pa.array(rows)), prompts


def job(args) -> None:
    import subprocess
    import tempfile

    import pyarrow.parquet as pq
    import yaml
    from mlx_lm import batch_generate

    from pipeline.model_store import context_length

    model, tokenizer = load_default_model()
    spec, table, prompts = job_documents(tokenizer, args.documents, context_length(model))
    print(f"{len(prompts)} documents, {sum(map(len, prompts))} prompt tokens, {args.max_tokens} tokens each")
    print("| run | seconds | documents/hour | vs mlx_lm.batch_generate |")
    print("|---|---|---|---|")
    base = args.baseline_seconds
    if base is None:
        start = time.perf_counter()
        batch_generate(model, tokenizer, prompts, max_tokens=args.max_tokens,
                       completion_batch_size=args.batch_size, prefill_batch_size=args.batch_size)
        base = time.perf_counter() - start
    print(f"| mlx_lm.batch_generate, plain caches | {base:.0f} | {len(prompts) * 3600 / base:.0f} | 1.00x |", flush=True)
    del model
    with tempfile.TemporaryDirectory() as scratch:
        pq.write_table(table, f"{scratch}/documents.parquet")
        raw = yaml.safe_load(MAIN_JOB.read_text())
        raw["input"]["path"] = f"{scratch}/documents.parquet"
        raw.setdefault("generation", {})["decode_batch_size"] = args.batch_size
        Path(scratch, "job.yaml").write_text(yaml.safe_dump(raw))
        for variant in args.variants:
            command = [sys.executable, "-m", "pipeline.cli", "run", f"{scratch}/job.yaml", "-q",
                       "--engine", "in-process", "--db", f"{scratch}/{variant}.db"]
            command += [] if variant == "all" else ["--variant", variant]
            start = time.perf_counter()
            subprocess.run(command, check=True, cwd=Path(__file__).resolve().parent.parent)
            seconds = time.perf_counter() - start
            name = "Velox, the three-variant job" if variant == "all" else f"Velox {variant}"
            print(f"| {name} (velox-batch run) | {seconds:.0f} | {len(prompts) * 3600 / seconds:.0f} | "
                  f"{base / seconds:.2f}x |", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rate = commands.add_parser("throughput", help="decode tokens/s by batch size")
    rate.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    rate.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    rate.add_argument("--steps", type=int, default=16, help="decode steps per row")
    rate.add_argument("--stagger", type=int, default=0,
                      help="row i first takes i %% STAGGER tokens alone, untimed (rows as different documents: "
                           "a quantized window's flush on different steps); 0: identical rows")
    rate.add_argument("--compare-unpipelined", action="store_true",
                      help="time each B pipelined and not (decode_rows(pipelined=True/False)), alternating")
    rate.add_argument("--repeats", type=int, default=3, help="runs of each with --compare-unpipelined (best taken)")
    rate.set_defaults(run=throughput)
    whole = commands.add_parser("job", help="the main job's first documents against mlx_lm.batch_generate")
    whole.add_argument("--documents", type=int, default=24)
    whole.add_argument("--max-tokens", type=int, default=40, help="as the main job's generation.max_tokens")
    whole.add_argument("--batch-size", type=int, default=8)
    whole.add_argument("--variants", nargs="+", default=["full", "pyramidkv-128", "all"],
                       help="the main job's variants to time (all: the three-variant job)")
    whole.add_argument("--baseline-seconds", type=float, default=None,
                       help="mlx_lm.batch_generate's seconds measured before (it is not run again)")
    whole.set_defaults(run=job)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    from pipeline.platform import ensure_fast_blas

    ensure_fast_blas()
    main()
