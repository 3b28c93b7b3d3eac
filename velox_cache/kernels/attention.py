"""Exact attention arithmetic for scoring: probabilities, mass, pooling, concentration.

Shapes: ``B`` batch, ``H`` KV heads, ``R`` query heads per KV head (GQA group),
``S`` queries, ``N`` keys, ``D`` head dim.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import mlx.core as mx

Mask = Union[None, str, mx.array]


def causal_mask(n_queries: int, n_keys: int) -> mx.array:
    """Lower-right aligned boolean mask ``[S, N]``: query i sees keys ``j <= N - S + i``."""
    query_index = mx.arange(n_keys - n_queries, n_keys)[:, None]
    return query_index >= mx.arange(n_keys)[None]


def attention_probs(
    queries: mx.array, keys: mx.array, scale: float, mask: Mask, sinks: Optional[mx.array] = None
) -> mx.array:
    """Softmax attention probabilities ``[B, H, R, S, N]`` (float32) for GQA inputs.

    ``queries`` is ``[B, H*R, S, D]`` and ``keys`` ``[B, H, N, D]``; ``mask`` is
    None, ``"causal"`` or an array broadcastable to ``[B, H*R, S, N]`` (boolean
    or additive), as mlx-lm passes it to attention. ``sinks`` ``[H*R]`` are
    per-head logits that take part in the softmax but attend to nothing (as
    ``mx.fast.scaled_dot_product_attention(..., sinks=)``): rows then sum to
    less than 1.
    """
    batch, n_q_heads, n_queries, dim = queries.shape
    n_kv_heads, n_keys = keys.shape[1], keys.shape[2]
    group = n_q_heads // n_kv_heads
    q = (queries * scale).reshape(batch, n_kv_heads, group, n_queries, dim)
    logits = (q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)).astype(mx.float32)  # [B, H, R, S, N]
    if isinstance(mask, str):
        logits = mx.where(causal_mask(n_queries, n_keys), logits, -mx.inf)
    elif mask is not None:
        if mask.ndim in (3, 4):  # [B or 1, H*R or 1, S, N] -> [B or 1, H or 1, R or 1, S, N]
            mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
            heads = mask.shape[1]
            mask = mask.reshape(mask.shape[0], max(1, heads // group), min(group, heads), *mask.shape[2:])
        if mask.dtype == mx.bool_:
            logits = mx.where(mask, logits, -mx.inf)
        else:
            logits = logits + mask.astype(mx.float32)
    if sinks is not None:
        sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, n_kv_heads, group, 1, 1), (*logits.shape[:-1], 1))
        return mx.softmax(mx.concatenate([logits, sink], axis=-1), axis=-1, precise=True)[..., :-1]
    return mx.softmax(logits, axis=-1, precise=True)


def key_mass(probs: mx.array) -> mx.array:
    """Attention mass each key received ``[B, H, N]``, summed over queries and the GQA group."""
    return probs.sum(axis=(2, 3))


def max_pool(scores: mx.array, kernel: int) -> mx.array:
    """Max over a centred window of ``kernel`` positions along the last axis (same length)."""
    if kernel <= 1:
        return scores
    half = kernel // 2
    length = scores.shape[-1]
    pad = [(0, 0)] * (scores.ndim - 1) + [(half, half)]
    padded = mx.pad(scores, pad, constant_values=-mx.inf)
    # spans[i] = max(padded[i : i + span]) for span = 1, 2, 4, ...: log2(kernel) maximums, not kernel - 1
    spans, span = padded, 1
    while 2 * span <= kernel:
        spans = mx.maximum(spans[..., :-span], spans[..., span:])
        span *= 2
    # a window of ``kernel`` is two overlapping spans: its first ``span`` positions and its last
    return mx.maximum(spans[..., 0:length], spans[..., kernel - span : kernel - span + length])


def normalized_entropy(probs: mx.array) -> mx.array:
    """Sum over rows of each row's entropy divided by ``log(N)``: 0 = one key, 1 = uniform."""
    n_keys = probs.shape[-1]
    if n_keys < 2:
        return mx.array(0.0)
    entropy = -(probs * mx.log(mx.maximum(probs, 1e-30))).sum(axis=-1)
    return entropy.sum() / math.log(n_keys)


PEAK_BLOCK_ROWS = 64  # query rows per block of ``key_peak``: its probabilities stay [B, H, R, 64, N]


def key_peak(
    queries: mx.array, keys: mx.array, scale: float, mask: Mask, sinks: Optional[mx.array] = None
) -> mx.array:
    """The largest attention any query (and any head of its GQA group) paid each key ``[B, H, N]`` (KVzip's score).

    Arguments as ``attention_probs``; computed a block of query rows at a time
    (a causal block sees the keys up to its last query: lower-right aligned
    again), so no ``[S, N]`` probabilities are held at once.
    """
    n_queries, n_keys = queries.shape[2], keys.shape[2]
    peak = None
    for start in range(0, n_queries, PEAK_BLOCK_ROWS):
        stop = min(n_queries, start + PEAK_BLOCK_ROWS)
        visible = n_keys - n_queries + stop if isinstance(mask, str) else n_keys
        rows_mask = mask[..., start:stop, :] if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] > 1 else mask
        probs = attention_probs(queries[:, :, start:stop], keys[:, :, :visible], scale, rows_mask, sinks)
        block = probs.max(axis=(2, 3))  # [B, H, visible]
        if visible < n_keys:
            block = mx.pad(block, [(0, 0), (0, 0), (0, n_keys - visible)])
        peak = block if peak is None else mx.maximum(peak, block)
    return peak
