"""Velox's fused native attention: the whole call as one MLX primitive, where it is built.

``VeloxAttention`` (``velox_cache/kernels/native/attention.cpp``) computes what
``kernel.blocked_attention`` computes, FlashAttention-style: query blocks x key
blocks with an online softmax in float32, so no ``[S, N]`` scores reach memory;
grouped-query attention without repeating keys or values; a lower-right
aligned causal mask that skips the key blocks a query block cannot see; its
tasks (batch, KV head, query block) shared by both cores; register-blocked
SIMD tiles, no BLAS. Key mass and sampled entropy come from exact
probabilities (each scored row's final maximum and sum, in a second pass over
only those rows).

It does not round as the pure-MLX kernel does (a ~1 ulp float32 ``exp``, FMA,
another summation order): both stay within ``native.ATTENTION_TOLERANCE`` of
a float64 reference, and the pure kernel stays the reference and the fallback
(``VELOX_NATIVE=0``, ``VELOX_FUSED_ATTENTION=0`` for this primitive alone, or
a module built before the primitive existed).
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx

from . import native
from .attention import Mask

ENVIRONMENT_VARIABLE = "VELOX_FUSED_ATTENTION"  # "0": the MLX kernel, with the other native ops still on


def available() -> bool:
    """True when the native ops are in use, have the fused attention, and ``VELOX_FUSED_ATTENTION`` is not 0."""
    if os.environ.get(ENVIRONMENT_VARIABLE) == "0":
        return False
    ops = native.ops()
    return ops is not None and hasattr(ops, "attention")


def scoring_seconds() -> float:
    """Wall seconds the fused attention's calls have spent in their scoring passes (key mass, entropy) so far
    in this process, apart from their outputs; 0.0 where the primitive is not built (it only grows)."""
    ops = native.ops()
    return ops.attention_scoring_seconds() if ops is not None and hasattr(ops, "attention_scoring_seconds") else 0.0


def fused_attention(
    queries: mx.array,
    keys: mx.array,
    values: Optional[mx.array],
    *,
    scale: float,
    mask: Mask = None,
    score_rows: int = 0,
    entropy_rows: int = 0,
    key_heads: Optional[mx.array] = None,
    n_heads: int = 0,
) -> Optional[tuple]:
    """``(output, key_mass, entropy)`` as ``kernel.blocked_attention`` returns them, or None where not built.

    ``queries`` ``[B, H*R, S, D]``, ``keys``/``values`` ``[B, H, N, D]``;
    ``mask`` None, ``"causal"`` or an array broadcastable to ``[B, H*R, S, N]``
    (boolean or additive). The output comes back in the queries' dtype.
    ``key_heads`` ``[N]`` with ``n_heads``: pooled per-head slots (keys
    ``[B, 1, N, D]``, slot ``j`` of KV head ``key_heads[j]``); each query head
    attends to its own KV head's slots only, one task per head, nothing
    computed for the others' (``masks.with_pooled_heads`` is the same call
    as a mask).
    """
    if not available():
        return None
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"mask: {mask!r} is not 'causal', None or an array")
    n_queries = queries.shape[2]
    score_rows, entropy_rows = min(score_rows, n_queries), min(entropy_rows, n_queries)
    if values is None and not score_rows and not entropy_rows:
        return None, None, None
    output, key_mass, entropy = native.ops().attention(
        queries,
        keys,
        values,
        mask if isinstance(mask, mx.array) else None,
        scale=scale,
        causal=isinstance(mask, str),
        score_rows=score_rows,
        entropy_rows=entropy_rows,
        key_heads=key_heads,
        n_heads=n_heads if key_heads is not None else 0,
    )
    if output is not None and output.dtype != queries.dtype:
        output = output.astype(queries.dtype)
    return output, key_mass, entropy


def fused_attention_quantized(
    queries: mx.array,
    held,
    *,
    scale: float,
    mask: Mask = None,
    score_rows: int = 0,
    entropy_rows: int = 0,
    values: bool = True,
) -> Optional[tuple]:
    """``fused_attention`` over ``held`` (a ``velox_cache.kernels.kv_codes.QuantizedKV``: codes, then float
    tokens), each key block dequantized inside the tiles; None where the primitive is not built.

    The dequantized keys and values are ``code * scale + zero`` rounded once
    (a fused multiply-add), so the result is the attention of those float32
    keys and values within ``native.ATTENTION_TOLERANCE``. ``values=False``:
    the scores only (the output is None).
    """
    if not available() or not hasattr(native.ops(), "attention_quantized"):
        return None
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"mask: {mask!r} is not 'causal', None or an array")
    n_queries = queries.shape[2]
    score_rows, entropy_rows = min(score_rows, n_queries), min(entropy_rows, n_queries)
    arguments = held.native_arguments()
    if not values:
        arguments.update(value_codes=None, value_scales=None, value_zeros=None)
    output, key_mass, entropy = native.ops().attention_quantized(
        queries,
        held.keys,
        held.values if values else None,
        mask=mask if isinstance(mask, mx.array) else None,
        scale=scale,
        causal=isinstance(mask, str),
        score_rows=score_rows,
        entropy_rows=entropy_rows,
        **arguments,
    )
    if output is not None and output.dtype != queries.dtype:
        output = output.astype(queries.dtype)
    return output, key_mass, entropy
