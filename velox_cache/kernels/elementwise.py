"""Faster stand-ins for mlx-lm's elementwise activations on MLX's CPU backend.

MLX's CPU ``exp`` is scalar, with every ``fma`` of its polynomial an
out-of-line library call: mlx-lm's ``swiglu`` (``silu(gate) * x``, compiled)
takes ~13 ms over one SmolLM2 layer's ``[256, 1536]`` chunk, as long as that
layer's matmuls. ``mx.power`` is several times faster and as accurate (its
SiLU differs from ``nn.silu``'s by ~1e-7 relative), so ``swiglu`` here is
``gate / (1 + e ** -gate) * x``. Where Velox's native ops are built
(``velox_cache.kernels.native``) a vectorised C++ loop does it instead, several times
faster again and more accurate (2e-7 relative to float64, against this one's
9e-7 and ``nn.silu``'s 1.6e-6).

``rope`` stands in for ``mlx.nn.RoPE.__call__`` where the native ops are
built: ``mx.fast.rope`` on MLX's CPU backend recomputes its sines and cosines
on every call (~1.9 ms per SmolLM2 layer for a 256-token chunk's queries and
keys); the native op applies a table computed once per chunk for all layers,
with the same multiplies and adds and the same table: ``mx.fast.rope``'s bits.

``rms_norm`` stands in for ``mlx.nn.RMSNorm.__call__`` where the native ops are
built: the same bits as ``mx.fast.rms_norm`` on the CPU in one graph node
instead of ~13 (a decode step of SmolLM2 had ~1,650 nodes, ~730 of them its 61 norms).

``ACTIVATIONS`` maps each mlx-lm module global that ``observe`` and
``fast_attention`` replace (where the attention runs on Velox's kernel) to
its stand-in; ``METHODS`` each class method they replace.
"""

from __future__ import annotations

import functools
import math
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from . import native


@partial(mx.compile, shapeless=True)
def power_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x`` (mlx-lm's ``swiglu``), with the exponential as ``mx.power``."""
    return gate / (1 + mx.power(math.e, -gate)) * x


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``: natively where Velox's native ops are built, else ``power_swiglu``."""
    ops = native.ops()
    return ops.swiglu(gate, x) if ops is not None else power_swiglu(gate, x)


def rope(module: nn.RoPE, x: mx.array, offset: int = 0) -> mx.array:
    """``nn.RoPE.__call__``: the native op for a whole-number offset where built, else ``mx.fast.rope``.

    Batched decoding passes one offset per row (an array): that stays on ``mx.fast.rope``.
    """
    ops = native.ops()
    if ops is None or type(offset) is not int or x.ndim < 2 or module.dims % 2 or module.dims > x.shape[-1]:
        return mx.fast.rope(x, module.dims, traditional=module.traditional, base=module.base, scale=module.scale,
                            offset=offset)
    cos, sin = rope_table(offset, x.shape[-2], module.dims, float(module.base), float(module.scale))
    return ops.rope(x, cos, sin, module.dims, module.traditional)


@functools.lru_cache(maxsize=8)  # one chunk's table serves every layer's queries and keys
def rope_table(offset: int, length: int, dims: int, base: float, scale: float) -> tuple[mx.array, mx.array]:
    """``(cos, sin)`` ``[length, dims / 2]`` float32 of positions ``offset ..``, as ``mx.fast.rope`` computes them.

    The same float32 frequencies, angles and MLX ``cos``/``sin``, so the native
    op gives ``mx.fast.rope``'s bits; lazy, so building it never waits on the device.
    """
    half = dims // 2
    frequencies = mx.exp(-mx.arange(half, dtype=mx.float32) * (math.log(base) / half))
    angles = (mx.arange(offset, offset + length, dtype=mx.float32) * scale)[:, None] * frequencies
    return mx.cos(angles), mx.sin(angles)


def rms_norm(module: nn.RMSNorm, x: mx.array) -> mx.array:
    """``nn.RMSNorm.__call__``: one native op for float32 where built, else ``mx.fast.rms_norm``.

    On MLX's CPU backend ``mx.fast.rms_norm`` is composed of ~13 graph nodes
    (casts, square, sum, mean, rsqrt, broadcasts, multiplies), twice per layer
    and step; the native op computes the same arithmetic in the same order
    (the same bits) as one.
    """
    ops = native.ops()
    weight = module["weight"]
    if ops is None or not hasattr(ops, "rms_norm") or x.dtype != mx.float32 or weight.dtype != mx.float32 or x.ndim < 1:
        return mx.fast.rms_norm(x, weight, module.eps)
    return ops.rms_norm(x, weight, module.eps)


ACTIVATIONS = {"swiglu": swiglu}
METHODS = {(nn.RoPE, "__call__"): rope, (nn.RMSNorm, "__call__"): rms_norm}
