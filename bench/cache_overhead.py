"""Prefill and decode cost of Velox caches relative to plain mlx-lm ``KVCache``.

Runs the embedded SmolLM2 (float32 on CPU; use the fast BLAS: `make bench`) and
prints, per prompt length, policy, budget and scoring, prefill time and decode
time per token, and their speed-ups over plain mlx-lm (``KVCache``, no Velox
context; speed-up = plain time / this time) measured in the same run, plus
peak memory. Every Velox row runs inside
``velox_cache.fast_attention`` or ``velox_cache.observe``, so on the CPU
backend it uses Velox's attention kernel (``VELOX_ATTENTION=exact`` turns it
off). ``plain+fast`` is plain ``KVCache`` inside ``fast_attention`` (the
one-line speed-up for mlx-lm users); ``full`` is Velox's full cache. Not a
test: nothing here asserts on time.

    python bench/cache_overhead.py --lengths 1024 4096 8192 --policies plain+fast full pyramidkv squeeze \\
        --budgets 512 --scorings observed --repeats 2
    python bench/cache_overhead.py --lengths 4096 --policies pyramidkv pyramidkv+adaptive --scorings observed
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_lm.models.cache import KVCache  # noqa: E402

from bench.common import config_overrides, load_default_model, prose, timed_run  # noqa: E402
from velox_cache import KVCacheBuilder, KVCacheConfig  # noqa: E402
from velox_cache.policies import POLICIES  # noqa: E402

UNBUDGETED = ("plain+fast", "full")  # rows with no budget and no scoring choice
DEFAULT_POLICIES = list(UNBUDGETED) + [p for p in POLICIES if p != "full"] + ["pyramidkv:continuous"]


def policy_config(policy: str, budget: int, scoring: str, overrides: dict = None) -> KVCacheConfig:
    """``name[:continuous][+uniform|+adaptive]``: the policy, its timing, its head budgets.

    ``:continuous`` evicts by H2O mass after every chunk instead of the default
    timing; ``+adaptive`` gives each KV head its own budget (``head_budgets``).
    ``overrides``: extra ``KVCacheConfig`` fields (``--set``).
    """
    name, _, heads = policy.partition("+")
    method, _, timing = name.partition(":")
    extra = {"eviction": "continuous", "selection": "cumulative"} if timing == "continuous" else {}
    if heads:
        extra["head_budgets"] = heads
    return KVCacheConfig(method=method, budget=budget, scoring=scoring, **{**extra, **(overrides or {})})


def _velox_caches(config: KVCacheConfig):
    return lambda model: KVCacheBuilder.for_model(model, config)


def variants(policies, budgets, scorings, overrides=None):
    """``(policy, budget, scoring, make_caches(model), context scoring)`` for every row after the baseline."""
    for policy in policies:
        if policy == "plain+fast":
            yield policy, "-", "-", lambda model: [KVCache() for _ in model.layers], "fast"
        elif policy == "full":
            yield policy, "-", "-", _velox_caches(KVCacheConfig(method="full")), "fast"
        else:
            for budget in budgets:
                for scoring in scorings:
                    config = policy_config(policy, budget, scoring, overrides)
                    yield policy, budget, scoring, _velox_caches(config), scoring


def best_of(repeats: int, run):
    """The fastest prefill and decode over ``repeats`` runs (timing noise only ever adds time)."""
    results = [run() for _ in range(repeats)]
    return min(r[0] for r in results), min(r[1] for r in results), max(r[2] for r in results)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192], help="prompt tokens")
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    parser.add_argument(
        "--policies",
        nargs="+",
        default=DEFAULT_POLICIES,
        help="plain+fast, full, policy names; NAME:continuous evicts by H2O mass after every chunk, "
        "NAME+adaptive gives each KV head its own budget",
    )
    parser.add_argument("--scorings", nargs="+", default=["key_proxy", "observed"])
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--prefill-step", type=int, default=256, help="prefill chunk in tokens")
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration; the fastest counts")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="extra KVCacheConfig fields for the budgeted policies, e.g. mass_weight=0")
    args = parser.parse_args(argv)
    for policy in args.policies:
        if policy not in UNBUDGETED and policy.partition("+")[0].partition(":")[0] not in POLICIES:
            parser.error(f"--policies: unknown policy {policy!r}")

    overrides = config_overrides(args.set)
    model, tokenizer = load_default_model()
    timing = {"prefill_step": args.prefill_step, "decode_steps": args.decode_steps}
    print(
        "| prompt | policy | budget | scoring | prefill s | prefill speed-up | decode ms/token | decode speed-up "
        "| peak MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        prompt = tokenizer.encode(prose(length, tokenizer))
        timed_run(model, prompt[:300], [KVCache() for _ in model.layers], scoring="plain")  # warm-up
        timed_run(model, prompt[:300], [KVCache() for _ in model.layers], scoring="fast")
        base_prefill, base_decode, base_peak = best_of(
            args.repeats, lambda: timed_run(model, prompt, [KVCache() for _ in model.layers], scoring="plain", **timing)
        )
        print(
            f"| {length} | plain KVCache | - | - | {base_prefill:.2f} | 1.00x | {base_decode * 1e3:.1f} | 1.00x | "
            f"{base_peak / 2**20:.0f} |",
            flush=True,
        )
        rows = variants(args.policies, args.budgets, args.scorings, overrides)
        for policy, budget, scoring, make_caches, context in rows:
            prefill, decode, peak = best_of(
                args.repeats, lambda: timed_run(model, prompt, make_caches(model), scoring=context, **timing)
            )
            print(
                f"| {length} | {policy} | {budget} | {scoring} | {prefill:.2f} | "
                f"{base_prefill / prefill:.2f}x | {decode * 1e3:.1f} | {base_decode / decode:.2f}x | "
                f"{peak / 2**20:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    from pipeline.platform import ensure_fast_blas

    ensure_fast_blas()  # OpenBLAS preloaded, its kernels chosen from the CPU (re-executes once)
    main()
