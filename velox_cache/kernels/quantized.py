"""Quantized linear layers on Velox's native CPU matmul, where it is built.

MLX's CPU ``quantized_matmul`` is scalar code: on a 2-core AMD EPYC it took 4.6x
the float32 time for one row and 65x for 32 (576 x 1536, 4 bits, groups of 32;
issue 43). ``VeloxQuantizedMatmul`` (``native/quantized.cpp``,
``native/quantized_loops.cpp``) computes the same ``x @ dequantize(w).T`` over
MLX's affine layout in place: each chunk of a weight row is dequantized into
vectors (``q * scale + bias``, one FMA: with 16-bit scales, as a GGUF's, the
very float32 weight ``mx.dequantize`` gives) and multiplied into up to 8 rows
of ``x`` at once, AVX-512 / AVX2 / portable loops picked at load time, output
features shared by the cores.

It sums in another order than a float32 GEMM on the dequantized weights:
it stays within ``tolerance(in_features)`` of a float64 reference of the
same math. Each output is summed in one order whatever the batch or the
threads, so a row's result does not depend on the rows beside it.

From ``GEMM_ROWS`` rows on (prefill chunks), unpacking the weights again for
every few rows costs more than a float32 GEMM: the call then dequantizes the
weights natively (``VeloxDequantize``, the same float32 values) and multiplies
them with MLX's matmul, so a prefill on quantized weights computes what it
computes on the float32 weights, bit for bit, and holds the float32 copy of
one layer at a time only.

``route(model)`` (``load_model`` does it for quantized weights on the CPU) and
the ``native_quantized(model)`` context make a model's ``QuantizedLinear``
layers (and a quantized embedding used as the output layer) call
``quantized_matmul``, which takes the native path where it can and
``mx.quantized_matmul`` everywhere else: another device, another mode than
affine, other bits or group sizes, no native module, or
``VELOX_QUANTIZED=0`` (``VELOX_NATIVE=0`` turns every native op off).
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from . import native

ENVIRONMENT_VARIABLE = "VELOX_QUANTIZED"  # "0": mx.quantized_matmul even where the native one is built
GEMM_ROWS = 64  # rows from which the weights are dequantized and multiplied by a float32 GEMM
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


def tolerance(in_features: int) -> float:
    """The bound on ``|native - reference| / sum_k |x_k w_k|`` for one output.

    The reference is the float64 product of ``x`` and the float32 dequantized
    weights (``fl32(q * scale + bias)``, which the loops compute exactly). Each
    of a row's vector lanes sums at most ``in_features / 8`` products (4 lanes
    and two accumulators in the portable loops), then a few lane sums: the
    float32 summation bound ``(n + 4) * 2**-24``.
    """
    return (in_features / 8 + 4) * 2.0**-24


def available() -> bool:
    """True when the native ops are in use, have the quantized matmul, and ``VELOX_QUANTIZED`` is not 0."""
    if os.environ.get(ENVIRONMENT_VARIABLE) == "0":
        return False
    ops = native.ops()
    return ops is not None and hasattr(ops, "quantized_matmul")


def kernel_path() -> str:
    """What routed quantized layers compute with on this CPU: ``native-<instruction set>`` (Velox's loops) or
    ``mlx`` (``mx.quantized_matmul``); each gives other bits, so the store keys its rows by it."""
    if not available():
        return "mlx"
    return f"native-{native.ops().quantized_instruction_set()}"


def refusal(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: Optional[mx.array],
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
    transpose: bool = True,
) -> str:
    """Why the native matmul does not take this call ('' when it does)."""
    if not available():
        return f"native quantized matmul not in use ({ENVIRONMENT_VARIABLE}=0 or native ops: {native.status()})"
    if mx.default_device() != mx.cpu:
        return "not on the CPU"
    if mode != "affine" or biases is None:
        return f"mode {mode!r} (only affine, with biases)"
    if not transpose:
        return "transpose=False"
    if bits not in BITS or group_size not in GROUP_SIZES:
        return f"bits {bits}, group_size {group_size} (bits {BITS}, group sizes {GROUP_SIZES})"
    if w.dtype != mx.uint32 or w.ndim != 2 or scales.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        return "weights not 2-D uint32, or scales not float32 / float16 / bfloat16"
    if biases.dtype != scales.dtype or not mx.issubdtype(x.dtype, mx.floating):
        return "biases' dtype differs from the scales', or x is not floating"
    return ""


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: Optional[mx.array] = None,
    *,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
    transpose: bool = True,
    gemm_rows: Optional[int] = None,
) -> mx.array:
    """``mx.quantized_matmul(x, w, scales, biases, ...)``, on Velox's native loops where they take the call.

    ``gemm_rows``: from this many rows of ``x`` on, the natively dequantized
    float32 weights times MLX's float32 matmul instead (default ``GEMM_ROWS``).
    """
    if refusal(x, w, scales, biases, group_size=group_size, bits=bits, mode=mode, transpose=transpose):
        return mx.quantized_matmul(
            x, w, scales=scales, biases=biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode
        )
    ops = native.ops()
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if rows >= (GEMM_ROWS if gemm_rows is None else gemm_rows):
        weights = ops.dequantize(w, scales, biases, group_size=group_size, bits=bits)
        out = x.astype(mx.float32) @ weights.T
        dtype = mx.result_type(x.dtype, scales.dtype)
        return out if dtype == mx.float32 else out.astype(dtype)
    return ops.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits)


class NativeQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose matmul is ``quantized_matmul`` (what ``route`` turns a layer into)."""

    def __call__(self, x):
        x = quantized_matmul(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        if "bias" in self:
            x = x + self["bias"]
        return x


class NativeQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` (tied output layers) is ``quantized_matmul``.

    Its rows come out in float32, as the float32 weights hold them: the
    scales are cast first (``mx.dequantize`` computes in the scales' dtype, and
    a GGUF's are float16, which rounds most values).
    """

    def __call__(self, x):
        biases = self.get("biases")
        return mx.dequantize(
            self["weight"][x],
            scales=self["scales"][x].astype(mx.float32),
            biases=biases[x].astype(mx.float32) if biases is not None else None,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )

    def as_linear(self, x):
        return quantized_matmul(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )


ROUTED = {nn.QuantizedLinear: NativeQuantizedLinear, nn.QuantizedEmbedding: NativeQuantizedEmbedding}


def route(model: nn.Module) -> list[tuple[nn.Module, type]]:
    """Make the model's quantized linear layers (and quantized embeddings' ``as_linear``) call ``quantized_matmul``.

    Only layers of exactly mlx's classes change (their class becomes the
    subclass above; weights, ``isinstance`` and ``dequantize_model`` are
    unchanged). Returns ``(layer, former class)`` for each, which ``unroute``
    takes back.
    """
    changed = []
    for _, module in model.named_modules():
        routed = ROUTED.get(type(module))
        if routed is not None:
            changed.append((module, type(module)))
            module.__class__ = routed
    return changed


def unroute(changed: list[tuple[nn.Module, type]]) -> None:
    """Give the layers ``route`` changed their former classes back."""
    for module, former in changed:
        module.__class__ = former


@contextlib.contextmanager
def native_quantized(model: nn.Module):
    """Inside: the model's quantized layers run ``quantized_matmul``; after, the classes they had."""
    changed = route(model)
    try:
        yield model
    finally:
        unroute(changed)
