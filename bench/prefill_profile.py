"""Where a prefill chunk's time goes: the forward pass against its own matmul floor.

For one chunk of ``--chunk`` tokens of the embedded model, after ``context``
tokens are already held:

- ``linear floor``: the same linear layers alone (q, k, v, o, gate, up, down
  of every layer over a ``[1, chunk, hidden]`` input), what the chunk costs at
  the BLAS's speed; their flops over that time is the measured GEMM rate
  (measured again beside each row, as other work on the machine moves it);
- ``+ attention floor``: the linear floor plus the chunk's attention matmuls
  at that GEMM rate (2 matmuls x 2 flops x query heads x chunk x visible keys
  x head dim per layer, the keys each layer held before the chunk read from
  its cache, causal counted as seen: query ``i`` sees the held keys and
  ``i + 1`` of the chunk's);
- ``forward``: the model's forward pass over the chunk, for a full cache
  (Velox's full cache under ``fast_attention``: what ``full`` and
  ``prefill_end`` runs do before their selection) and for a streaming
  PyramidKV cache at budget ``--budget`` (what it holds while streaming:
  at most its budget, plus the chunk);
- ``floor / forward``: the share of the forward pass that is matmul work, for
  each floor;
- ``attention alone``: the chunk's attention calls by themselves (random inputs
  of each layer's shapes, causal, through the kernel the forward pass uses), and
  their flops over that time: how close attention alone comes to the GEMM rate.

With ``--perf`` (Debian's ``linux-perf``) the forward passes are also sampled
with ``perf record`` and the samples split into GEMM (OpenBLAS), thread waits
(``sched_yield`` and the scheduler: OpenBLAS's idle thread spinning beside
MLX's single-threaded elementwise ops), allocation (page clearing and faults,
malloc), MLX elementwise and other ops, Python, and the rest. Samples count
both cores, so a share is of CPU time, not of wall time.

    python bench/prefill_profile.py --contexts 0 1024 3840
    python bench/prefill_profile.py --contexts 0 3840 --perf
    python bench/prefill_profile.py --compare activations
    python bench/prefill_profile.py --compare native
    python bench/prefill_profile.py --compare attention
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

import velox_cache  # noqa: E402
from bench.common import load_default_model, prose  # noqa: E402
from velox_cache import KVCacheBuilder, KVCacheConfig  # noqa: E402
from velox_cache.cache.phases import Phase, tell  # noqa: E402
from velox_cache.kernels import fused, native  # noqa: E402
from velox_cache.kernels.attend import attend  # noqa: E402
from velox_cache.kernels.elementwise import ACTIVATIONS  # noqa: E402

CATEGORIES = [  # (name, pattern over perf's symbol column), first match wins
    ("GEMM (OpenBLAS)", r"gemm|gemv|blas_thread_server|inner_thread"),
    ("thread waits", r"sched_yield|__schedule|do_syscall_64|futex|finish_task_switch|x64_sys_call|_raw_spin"),
    ("allocation and page faults", r"clear_page|page_fault|malloc|_int_free|\bfree\b|memset|unlink_chunk|mmap|munmap"),
    ("MLX exp / fma", r"simd::exp|fmaf|exp<"),
    ("MLX other ops (elementwise, copies, reductions, compiled)", r"mlx::core|f4I|f4O|^0x"),
    ("Python", r"Py|_PyEval|gc_collect|visit_"),
]


def kinds(budget: int) -> dict:
    return {
        "full": KVCacheConfig(method="full"),
        f"pyramidkv-{budget} streaming": KVCacheConfig(method="pyramidkv", budget=budget, eviction="streaming"),
    }


def matmul_floor(model, chunk: int, repeats: int = 3) -> tuple[float, float]:
    """``(seconds, flops)`` of the linear layers of every transformer block over ``chunk`` tokens, best of ``repeats``."""
    args = model.args
    x = mx.random.normal((1, chunk, args.hidden_size))
    h = mx.random.normal((1, chunk, args.intermediate_size))
    mx.eval(x, h)
    best, flops = float("inf"), 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        flops = 0.0
        for layer in model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            calls = [(attention.q_proj, x), (attention.k_proj, x), (attention.v_proj, x), (attention.o_proj, x),
                     (mlp.gate_proj, x), (mlp.up_proj, x), (mlp.down_proj, h)]
            outputs = [linear(inputs) for linear, inputs in calls]
            mx.eval(*outputs)
            flops += sum(2.0 * chunk * inputs.shape[-1] * out.shape[-1] for (_, inputs), out in zip(calls, outputs))
        best = min(best, time.perf_counter() - start)
    return best, flops


def attention_flops(model, chunk: int, held: list[int]) -> float:
    """Flops of a chunk's two attention matmuls over every layer, ``held[l]`` keys held before it, causal as seen."""
    args = model.args
    heads = args.num_attention_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    visible = [chunk * keys + chunk * (chunk + 1) / 2 for keys in held]  # summed over the chunk's queries
    return sum(2 * 2.0 * heads * dim * keys for keys in visible)


def attention_alone(model, chunk: int, held: list[int], repeats: int = 3) -> float:
    """Seconds of the chunk's attention calls by themselves (every layer, causal, output only), best of ``repeats``.

    Random queries, keys and values of each layer's shapes, through the kernel the forward pass uses (the fused
    primitive where it is on): what attention costs outside the model, against the ``+ attention`` floor.
    """
    args = model.args
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    calls = []
    for keys in held:
        q = mx.random.normal((1, heads, chunk, dim))
        k, v = mx.random.normal((1, kv_heads, keys + chunk, dim)), mx.random.normal((1, kv_heads, keys + chunk, dim))
        calls.append((q, k, v))
    mx.eval(calls)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for q, k, v in calls:
            mx.eval(attend(q, k, v, scale=dim**-0.5, mask="causal"))
        best = min(best, time.perf_counter() - start)
    return best


def chunk_forward(model, tokens: list[int], config: KVCacheConfig, context: int, chunk: int) -> tuple[float, list]:
    """``(seconds, keys each layer held before it)`` of one model call over ``chunk`` tokens after ``context``
    tokens were prefilled in chunks."""
    caches = KVCacheBuilder.for_model(model, config, prompt_tokens=len(tokens))
    router = velox_cache.observe if config.method != "full" else velox_cache.fast_attention
    with router(model):
        tell(caches, Phase.DOCUMENT)
        for start in range(0, context, chunk):
            model(mx.array(tokens[start : start + chunk])[None], cache=caches)
            mx.eval([c.state for c in caches])
        mx.clear_cache()
        held = [c.size() for c in caches]
        start = time.perf_counter()
        model(mx.array(tokens[context : context + chunk])[None], cache=caches)
        mx.eval([c.state for c in caches])
        return time.perf_counter() - start, held


@contextlib.contextmanager
def mlx_lm_activations():
    """mlx-lm's own activations inside the routing contexts (Velox's stand-ins off), for a before/after."""
    saved = dict(ACTIVATIONS)
    ACTIVATIONS.clear()
    try:
        yield
    finally:
        ACTIVATIONS.update(saved)


@contextlib.contextmanager
def switched_off(variable: str):
    """``variable=0`` for the block: ``VELOX_NATIVE`` (the pure-MLX ops in place of the native ones) or
    ``VELOX_FUSED_ATTENTION`` (the MLX attention kernel in place of the fused one), for a before/after."""
    saved = os.environ.get(variable)
    os.environ[variable] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[variable]
        else:
            os.environ[variable] = saved


def pure_mlx_ops():
    return switched_off(native.ENVIRONMENT_VARIABLE)


def mlx_attention_kernel():
    return switched_off(fused.ENVIRONMENT_VARIABLE)


def measure(args) -> None:
    model, tokenizer = load_default_model()
    longest = max(args.contexts) + args.chunk
    tokens = tokenizer.encode(prose(longest, tokenizer))[:longest]
    floor, linear_flops = matmul_floor(model, args.chunk)
    gemm_rate = linear_flops / floor
    print(f"linear floor of a {args.chunk}-token chunk: {floor * 1000:.0f} ms "
          f"({linear_flops / 1e9:.1f} GFLOP at {gemm_rate / 1e9:.0f} GFLOP/s, the GEMM rate)")
    print(f"Velox's native ops: {native.status()}; fused attention: {'on' if fused.available() else 'off'}")
    compare = {"activations": mlx_lm_activations, "native": pure_mlx_ops, "attention": mlx_attention_kernel}.get(
        args.compare)
    baseline = {"activations": "mlx-lm's activations", "native": "pure-MLX ops",
                "attention": "MLX attention kernel"}.get(args.compare)
    print("| cache | tokens held before the chunk | forward ms | linear floor ms | linear floor / forward "
          "| linear + attention floor ms | floor / forward | attention alone ms | attention alone GFLOP/s |" + (f" forward ms, {baseline} | speed-up |" if compare else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if compare else ""))
    for name, config in kinds(args.budget).items():
        for context in args.contexts:
            chunk_forward(model, tokens, config, context, args.chunk)  # warm-up
            if args.stamps:
                print(f"START {time.clock_gettime(time.CLOCK_MONOTONIC):.6f}", flush=True)
            runs = [chunk_forward(model, tokens, config, context, args.chunk) for _ in range(args.repeats)]
            if args.stamps:
                print(f"END {time.clock_gettime(time.CLOCK_MONOTONIC):.6f} {name} {context}", flush=True)
            seconds, held = min(runs)
            floor, linear_flops = matmul_floor(model, args.chunk)  # again beside the row: the load may have moved
            gemm_rate = linear_flops / floor
            flops = attention_flops(model, args.chunk, held)
            with_attention = floor + flops / gemm_rate
            alone = attention_alone(model, args.chunk, held)
            line = (f"| {name} | {context} | {seconds * 1000:.0f} | {floor * 1000:.0f} | {floor / seconds:.0%} "
                    f"| {with_attention * 1000:.0f} | {with_attention / seconds:.0%} | {alone * 1000:.0f} "
                    f"| {flops / alone / 1e9:.0f} |")
            if compare:
                with compare():
                    before = min(chunk_forward(model, tokens, config, context, args.chunk)[0]
                                 for _ in range(args.repeats))
                line += f" {before * 1000:.0f} | {before / seconds:.2f}x |"
            print(line, flush=True)


def profile(args) -> None:
    """Run ``measure`` under ``perf record`` and print each forward pass's split by category."""
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch, "perf.data")
        command = ["perf", "record", "-k", "CLOCK_MONOTONIC", "-F", "1999", "-g", "-o", str(data), "--",
                   sys.executable, __file__, "--stamps", "--chunk", str(args.chunk), "--budget", str(args.budget),
                   "--repeats", str(args.repeats), "--contexts", *map(str, args.contexts)]
        printed = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        print("\n".join(line for line in printed.splitlines() if not line.startswith(("START", "END"))))
        starts = re.findall(r"^START (\S+)$", printed, re.M)
        ends = re.findall(r"^END (\S+) (.+) (\d+)$", printed, re.M)
        names = [name for name, _ in CATEGORIES] + ["other"]
        print("\n| cache | tokens held | " + " | ".join(names) + " |")
        print("|---|---|" + "---|" * len(names))
        for start, (end, name, context) in zip(starts, ends):
            report = subprocess.run(
                ["perf", "report", "-i", str(data), "--time", f"{start},{end}", "--no-children", "--sort", "symbol",
                 "-g", "none", "--stdio"], check=True, capture_output=True, text=True).stdout
            shares = dict.fromkeys(names, 0.0)
            for percent, symbol in re.findall(r"^\s+([\d.]+)%\s+\[[.k]\]\s+(.+?)\s*$", report, re.M):
                category = next((n for n, pattern in CATEGORIES if re.search(pattern, symbol)), "other")
                shares[category] += float(percent)
            print(f"| {name} | {context} | " + " | ".join(f"{shares[n]:.0f}%" for n in names) + " |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[0, 1024, 3840],
                        help="tokens held before the measured chunk")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--budget", type=int, default=512, help="the streaming cache's budget")
    parser.add_argument("--repeats", type=int, default=3, help="forward passes timed per row (best taken)")
    parser.add_argument("--perf", action="store_true", help="also split each forward pass by perf samples")
    parser.add_argument("--compare", choices=["activations", "native", "attention"],
                        help="also time each row with mlx-lm's own activations (velox_cache.kernels.elementwise off), "
                             "with Velox's pure-MLX ops in place of its native ones (VELOX_NATIVE=0), or with the "
                             "MLX attention kernel in place of the fused one (VELOX_FUSED_ATTENTION=0)")
    parser.add_argument("--stamps", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    (profile if args.perf else measure)(args)


if __name__ == "__main__":
    from pipeline.platform import ensure_fast_blas

    ensure_fast_blas()  # the perf child inherits the same environment
    main()
