"""Faster stand-ins for mlx-lm's elementwise activations on MLX's CPU backend.

MLX's CPU ``exp`` is scalar, with every ``fma`` of its polynomial an
out-of-line library call: mlx-lm's ``swiglu`` (``silu(gate) * x``, compiled)
takes ~13 ms over one SmolLM2 layer's ``[256, 1536]`` chunk, as long as that
layer's matmuls. ``mx.power`` is several times faster and as accurate (its
SiLU differs from ``nn.silu``'s by ~1e-7 relative), so ``swiglu`` here is
``gate / (1 + e ** -gate) * x``. Where Velox's native ops are built
(``velox_cache.native``) a vectorised C++ loop does it instead, several times
faster again and more accurate (2e-7 relative to float64, against this one's
9e-7 and ``nn.silu``'s 1.6e-6).

``ACTIVATIONS`` maps each mlx-lm module global that ``observe`` and
``fast_attention`` replace (where the attention runs on Velox's kernel) to
its stand-in.
"""

from __future__ import annotations

import math
from functools import partial

import mlx.core as mx

from . import native


@partial(mx.compile, shapeless=True)
def power_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x`` (mlx-lm's ``swiglu``), with the exponential as ``mx.power``."""
    return gate / (1 + mx.power(math.e, -gate)) * x


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``: natively where Velox's native ops are built, else ``power_swiglu``."""
    ops = native.ops()
    return ops.swiglu(gate, x) if ops is not None else power_swiglu(gate, x)


ACTIVATIONS = {"swiglu": swiglu}
