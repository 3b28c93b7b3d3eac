"""Quantized kept tokens (``kv_bits``): the bytes held, one row's decode speed and its peak, against float.

For each cache kind (the full cache at ``--lengths`` tokens of real prose;
pyramidkv at budget 128 on a 2k prompt, observed scoring) and each of float,
8 and 4 bits, the stack reads its own prompt (in float: quantization starts
when decoding does) and decodes ``--steps`` greedy tokens alone. Prints per
row: the keys and values held when decoding started (``kept_bytes`` summed
over layers, measured from the arrays held) and their share of the float
row's, decode tokens/s and its ratio to float, the peak memory while
decoding (weights included, reset after prefill) and whether the greedy
tokens equal float's (how many match before the first that differs). Kinds
run one after another in one process, float first; nothing asserts on time.

    python -m pipeline.platform bench/kv_bits.py
    python -m pipeline.platform bench/kv_bits.py --lengths 1024 4096 8192 --steps 64
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

import velox_cache  # noqa: E402
from bench.common import load_default_model, prose  # noqa: E402
from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases  # noqa: E402
from velox_cache.generation.decode import DecodeRow, decode_rows  # noqa: E402
from velox_cache.generation.sampling import TokenSampler  # noqa: E402


def kinds(lengths: list[int]) -> list[tuple[str, int, dict]]:
    """``(name, prompt tokens, config fields)`` of every row kind, float first within each."""
    found = [(f"full-{length // 1024}k" if length % 1024 == 0 else f"full-{length}", length, {"method": "full"})
             for length in lengths]
    found.append(("pyramidkv-128", 2048, {"method": "pyramidkv", "budget": 128, "scoring": "observed"}))
    return found


def measure(model, tokenizer, length: int, fields: dict, steps: int) -> dict:
    """One row read and decoded alone: bytes when decoding started, tokens/s, decode peak, tokens."""
    config = KVCacheConfig(**fields)
    tokens = tokenizer.encode(prose(length, tokenizer))[:length]
    caches = KVCacheBuilder.for_model(model, config, prompt_tokens=len(tokens), new_tokens=steps)
    context = velox_cache.observe(model) if config.scoring == "observed" else velox_cache.fast_attention(model)
    with context:
        logits = prefill_phases(model, caches, document=tokens, max_new_tokens=steps)
        sampler = TokenSampler()
        row = DecodeRow(caches, sampler, sampler.logprobs(logits), steps + 1)  # the first from the prefill's logits
        kept = sum(cache.kept_bytes for cache in caches)  # prefill_phases told decode: the codes are made
        mx.eval([cache.state for cache in caches])
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        start = time.perf_counter()
        decode_rows(model, [row])
        seconds = time.perf_counter() - start
        peak = mx.get_peak_memory()
    return {"kept": kept, "rate": steps / seconds, "peak": peak, "tokens": list(row.tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8000],
                        help="the full cache's prompt lengths (the model's context is 8,192)")
    parser.add_argument("--steps", type=int, default=48, help="greedy tokens decoded per row (after the first)")
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    args = parser.parse_args()
    model, tokenizer = load_default_model()
    print("| row | kv_bits | kept MiB | share of float | decode tokens/s | vs float | decode peak MiB | tokens as float |")
    print("|---|---|---|---|---|---|---|---|")
    for name, length, fields in kinds(args.lengths):
        base = None
        for bits in [None, *args.bits]:
            result = measure(model, tokenizer, length, {**fields, "kv_bits": bits}, args.steps)
            base = base or result
            same = next((i for i, (a, b) in enumerate(zip(base["tokens"], result["tokens"])) if a != b),
                        len(result["tokens"]))
            print(f"| {name} | {bits or 'float'} | {result['kept'] / 2**20:.2f} | {result['kept'] / base['kept']:.3f} "
                  f"| {result['rate']:.1f} | {result['rate'] / base['rate']:.2f}x | {result['peak'] / 2**20:.0f} "
                  f"| {same} of {len(result['tokens'])} |", flush=True)
            del result
            gc.collect()
            mx.clear_cache()


if __name__ == "__main__":
    main()
