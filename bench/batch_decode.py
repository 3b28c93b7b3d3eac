"""Batched decoding: decode tokens/s at batch sizes 1..32, against batch 1 in the same run.

``throughput``: one prompt of real prose is prefilled once per row kind (full
cache at 1k and 4k tokens; pyramidkv at budgets 128 and 512 on a 2k prompt,
observed scoring), then B copies of that stack decode ``--steps`` greedy
tokens together (``velox_cache.decode.decode_rows``; B = 1 is the
one-at-a-time loop). Prints tokens/s and the speed-up over B = 1 of the same
kind. Rows are copies of one prefilled stack, so every B decodes the same
work per row. Not a test: nothing here asserts on time.

``job``: the main job's first ``--documents`` topics (prompted as
``jobs/summarize.yaml``), ``--max-tokens`` greedy tokens each, decoded in
batches of ``--batch-size``: ``mlx_lm.batch_generate`` with plain caches
against Velox's full variant, one compressed variant and the three-variant
job (``velox-batch run`` on a fresh store, in-process), as documents per hour.

    python bench/batch_decode.py throughput --batch-sizes 1 2 4 8 16 32
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
from velox_cache.decode import DecodeRow, decode_rows  # noqa: E402
from velox_cache.sampling import TokenSampler  # noqa: E402

KINDS = {  # name: (prompt tokens, config)
    "full-1k": (1024, KVCacheConfig(method="full")),
    "full-4k": (4096, KVCacheConfig(method="full")),
    "pyramidkv-128": (2048, KVCacheConfig(method="pyramidkv", budget=128, scoring="observed")),
    "pyramidkv-512": (2048, KVCacheConfig(method="pyramidkv", budget=512, scoring="observed")),
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


def decode_rate(model, caches, logits, config, batch: int, steps: int) -> float:
    """Tokens/s of ``batch`` copies of ``caches`` decoding ``steps`` tokens each."""
    rows = []
    for _ in range(batch):
        sampler = TokenSampler()
        rows.append(DecodeRow(snapshot(caches), sampler, sampler.logprobs(logits), steps + 1))
    mx.eval([c.state for row in rows for c in row.caches])
    mx.clear_cache()
    with _context(model, config):
        start = time.perf_counter()
        decode_rows(model, rows)
        seconds = time.perf_counter() - start
    return batch * steps / seconds  # steps model calls per row after the first token


def throughput(args) -> None:
    model, tokenizer = load_default_model()
    print("| rows | B | tokens/s | speed-up over B=1 |")
    print("|---|---|---|---|")
    for kind in args.kinds:
        length, config = KINDS[kind]
        caches, logits = prefilled(model, tokenizer, length, config)
        decode_rate(model, caches, logits, config, 1, 2)  # warm-up
        base = None
        for batch in args.batch_sizes:
            rate = decode_rate(model, caches, logits, config, batch, args.steps)
            base = base or rate
            print(f"| {kind} | {batch} | {rate:.1f} | {rate / base:.2f}x |", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rate = commands.add_parser("throughput", help="decode tokens/s by batch size")
    rate.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    rate.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    rate.add_argument("--steps", type=int, default=16, help="decode steps per row")
    rate.set_defaults(run=throughput)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    from pipeline.platform import ensure_fast_blas

    ensure_fast_blas()
    main()
