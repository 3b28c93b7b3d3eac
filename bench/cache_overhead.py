"""Prefill and decode cost of every Velox policy relative to plain mlx-lm ``KVCache``.

Runs the embedded SmolLM2 (float32 on CPU; use the fast BLAS: `make bench`) and
prints, per prompt length, policy, budget and scoring, prefill time and decode
time per token as ratios to plain ``KVCache`` measured in the same run, plus
peak memory. Not a test: nothing here asserts on time.

    python bench/cache_overhead.py --lengths 1024 4096 --budgets 256 512
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_lm.models.cache import KVCache  # noqa: E402

from bench.common import load_default_model, prose, timed_run  # noqa: E402
from velox_cache import KVCacheBuilder, KVCacheConfig  # noqa: E402
from velox_cache.policies import POLICIES  # noqa: E402


def policy_config(policy: str, budget: int, scoring: str) -> KVCacheConfig:
    """``name`` or ``name:continuous`` (continuous H2O eviction instead of the default timing)."""
    method, _, timing = policy.partition(":")
    extra = {"eviction": "continuous", "selection": "cumulative"} if timing == "continuous" else {}
    return KVCacheConfig(method=method, budget=budget, scoring=scoring, **extra)


def best_of(repeats: int, run):
    """The fastest prefill and decode over ``repeats`` runs (timing noise only ever adds time)."""
    results = [run() for _ in range(repeats)]
    return min(r[0] for r in results), min(r[1] for r in results), max(r[2] for r in results)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    parser.add_argument(
        "--policies",
        nargs="+",
        default=[p for p in POLICIES if p != "full"] + ["pyramidkv:continuous"],
        help="policy names; NAME:continuous evicts by H2O mass after every chunk",
    )
    parser.add_argument("--scorings", nargs="+", default=["key_proxy", "observed"])
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration; the fastest counts")
    args = parser.parse_args(argv)

    model, tokenizer = load_default_model()
    print("| prompt | policy | budget | scoring | prefill s | prefill ratio | decode ms/token | decode ratio | peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        prompt = tokenizer.encode(prose(length, tokenizer))
        timed_run(model, prompt[:300], [KVCache() for _ in model.layers], scoring="key_proxy")  # warm-up
        base_prefill, base_decode, base_peak = best_of(
            args.repeats, lambda: timed_run(
                model, prompt, [KVCache() for _ in model.layers], scoring="key_proxy", decode_steps=args.decode_steps
            )
        )
        print(f"| {length} | plain KVCache | - | - | {base_prefill:.2f} | 1.00 | {base_decode * 1e3:.1f} | 1.00 | {base_peak / 2**20:.0f} |", flush=True)
        for policy in args.policies:
            for budget in args.budgets:
                for scoring in args.scorings:
                    config = policy_config(policy, budget, scoring)
                    prefill, decode, peak = best_of(
                        args.repeats, lambda: timed_run(
                            model, prompt, KVCacheBuilder.for_model(model, config), scoring=scoring,
                            decode_steps=args.decode_steps,
                        )
                    )
                    print(
                        f"| {length} | {policy} | {budget} | {scoring} | {prefill:.2f} | "
                        f"{prefill / base_prefill:.2f} | {decode * 1e3:.1f} | {decode / base_decode:.2f} | "
                        f"{peak / 2**20:.0f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
