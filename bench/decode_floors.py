"""The decode step against its floors on this machine, float32 weights against the model as it ships.

For each weights mode (``float32``: the GGUF dequantized; ``quantized``: its
4-bit / 8-bit blocks on Velox's native quantized matmul; with
``--mlx-quantized`` also the same blocks on MLX's own ``quantized_matmul``),
the embedded model decodes ``--steps`` greedy tokens on plain mlx-lm caches
(inside ``velox_cache.fast_attention``: Velox's fused attention and native ops;
``--unrouted``: mlx-lm's own):
one row after ``--context`` tokens of prose, and ``--rows`` rows after
``--batch-context`` tokens. Each row prints the median step, the linear
layers alone (each layer once on random rows, the whole model's worth), the
bytes of weights one step reads, and the step's floor measured in the same
run:

- one row: those bytes at the memory bandwidth of a float32 GEMV over
  ``--gemv-mb`` of weights (what a step that only streams its weights costs);
- many rows: the larger of that and the linear layers' FLOPs at the rate of a
  2,048-square float32 GEMM (the GEMM floor).

Ratios are against float32 in the same run. Nothing here asserts on time.

    python -m pipeline.platform bench/decode_floors.py
    python -m pipeline.platform bench/decode_floors.py --steps 8 --rows 32 --mlx-quantized
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

import velox_cache  # noqa: E402
from bench.common import prose  # noqa: E402
from velox_cache.kernels import quantized  # noqa: E402


def _median_seconds(run, repeats: int) -> float:
    run()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth(megabytes: int, repeats: int = 5) -> float:
    """Bytes/s of a float32 GEMV streaming ``megabytes`` of weights (one row times a [N, 4096] matrix)."""
    columns = 4096
    rows = megabytes * 2**20 // (4 * columns)
    weights = mx.random.normal((rows, columns))
    x = mx.random.normal((1, columns))
    mx.eval(weights, x)
    seconds = _median_seconds(lambda: mx.eval(x @ weights.T), repeats)
    weights = None  # freed before the next probe
    mx.clear_cache()
    return rows * columns * 4 / seconds


def gemm_rate(size: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of a float32 ``size``-square GEMM."""
    a, b = mx.random.normal((size, size)), mx.random.normal((size, size))
    mx.eval(a, b)
    return 2 * size**3 / _median_seconds(lambda: mx.eval(a @ b), repeats)


def linear_layers(model) -> list[tuple[str, nn.Module]]:
    """Every layer a step multiplies by: the linear layers, and the output layer (a tied embedding's ``as_linear``)."""
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, (nn.Linear, nn.QuantizedLinear))]
    if not any(name.endswith("lm_head") for name, _ in found):
        found.append(("model.embed_tokens", model.model.embed_tokens))
    return found


def weight_bytes(layers) -> int:
    total = 0
    for _, module in layers:
        total += module.weight.nbytes
        for part in ("scales", "biases"):
            if isinstance(module.get(part), mx.array):
                total += module[part].nbytes
    return total


def layer_flops(layers, rows: int) -> float:
    flops = 0.0
    for _, module in layers:
        out_features = module.weight.shape[0]
        in_features = module.scales.shape[1] * module.group_size if "scales" in module else module.weight.shape[1]
        flops += 2.0 * rows * out_features * in_features
    return flops


def linears_seconds(layers, rows: int, repeats: int) -> float:
    """Each layer once on random rows, evaluated together: the linear work of one step."""
    inputs = []
    for _, module in layers:
        in_features = module.scales.shape[1] * module.group_size if "scales" in module else module.weight.shape[1]
        inputs.append(mx.random.normal((rows, in_features)))
    mx.eval(inputs)

    def run():
        outputs = [module.as_linear(x) if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)) else module(x)
                   for (_, module), x in zip(layers, inputs)]
        mx.eval(outputs)

    return _median_seconds(run, repeats)


def decode_seconds(model, tokenizer, rows: int, context: int, steps: int) -> float:
    """Median seconds of one greedy decode step of ``rows`` rows after ``context`` tokens each."""
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.array(tokenizer.encode(prose(context, tokenizer))[:context])[None]
    tokens = mx.broadcast_to(tokens, (rows, tokens.shape[1]))
    cache = make_prompt_cache(model)
    for start in range(0, tokens.shape[1], 256):
        logits = model(tokens[:, start : start + 256], cache=cache)
        mx.eval([c.state for c in cache])
    token = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(token)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        token = mx.argmax(model(token[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(token)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens of the one-row step")
    parser.add_argument("--rows", type=int, default=32, help="rows of the batched step")
    parser.add_argument("--batch-context", type=int, default=128, help="prompt tokens of each batched row")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed (median)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of the linear layers alone (median)")
    parser.add_argument("--gemv-mb", type=int, default=512, help="float32 weights the bandwidth GEMV streams")
    parser.add_argument("--gemm-rows", type=int, default=quantized.GEMM_ROWS,
                        help="rows from which quantized layers dequantize and run the float32 GEMM")
    parser.add_argument("--unrouted", action="store_true",
                        help="mlx-lm's own attention, norms and activations (default: inside velox_cache.fast_attention, "
                             "Velox's fused attention and native ops on the plain caches)")
    parser.add_argument("--mlx-quantized", action="store_true",
                        help="also the quantized weights on MLX's quantized_matmul (slow: few steps at many rows)")
    args = parser.parse_args(argv)
    quantized.GEMM_ROWS = args.gemm_rows

    from pipeline.model_store import load_model

    bandwidth, rate = memory_bandwidth(args.gemv_mb), gemm_rate()
    print(f"memory bandwidth (float32 GEMV, {args.gemv_mb} MB): {bandwidth / 1e9:.2f} GB/s;"
          f" float32 GEMM (2,048 square): {rate / 1e9:.1f} GFLOP/s;"
          f" native quantized matmul: {'on (' + native_isa() + ')' if quantized.available() else 'off'},"
          f" float32 GEMM from {quantized.GEMM_ROWS} rows")
    modes = [("float32", "float32", None), ("quantized", "quantized", None)]
    if args.mlx_quantized:
        modes.append(("quantized-mlx", "quantized", "0"))
    shapes = [(1, args.context), (args.rows, args.batch_context)]
    print(f"{'weights':<14} {'rows':>4} {'context':>7} {'step ms':>8} {'linears ms':>10} {'weights MB':>10}"
          f" {'floor ms':>8} {'step/floor':>10} {'linears/floor':>13} {'vs float32':>10}")
    baseline = {}
    for label, weights, switch in modes:
        model, tokenizer = load_model(weights=weights)
        previous = os.environ.get(quantized.ENVIRONMENT_VARIABLE)
        if switch is not None:
            os.environ[quantized.ENVIRONMENT_VARIABLE] = switch
        try:
            layers = linear_layers(model)
            size = weight_bytes(layers)
            for rows, context in shapes:
                steps = args.steps if label != "quantized-mlx" or rows == 1 else min(args.steps, 2)
                with contextlib.nullcontext() if args.unrouted else velox_cache.fast_attention(model):
                    step = decode_seconds(model, tokenizer, rows, context, steps)
                alone = linears_seconds(layers, rows, args.repeats if steps == args.steps else 1)
                floor = size / bandwidth if rows == 1 else max(size / bandwidth, layer_flops(layers, rows) / rate)
                baseline.setdefault(rows, step)
                print(f"{label:<14} {rows:>4} {context:>7} {step * 1e3:>8.1f} {alone * 1e3:>10.1f} {size / 1e6:>10.1f}"
                      f" {floor * 1e3:>8.1f} {step / floor:>10.2f} {alone / floor:>13.2f}"
                      f" {baseline[rows] / step:>9.2f}x")
        finally:
            if previous is None:
                os.environ.pop(quantized.ENVIRONMENT_VARIABLE, None)
            else:
                os.environ[quantized.ENVIRONMENT_VARIABLE] = previous
        del model, layers
        gc.collect()
        mx.clear_cache()
    return 0


def native_isa() -> str:
    from velox_cache.kernels import native

    return native.ops().quantized_instruction_set()


if __name__ == "__main__":
    sys.exit(main())
