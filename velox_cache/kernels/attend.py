"""``attend_and_score``: the one attention entry point for every call Velox handles.

It picks the backend and returns the output plus only the scores the caller
asked for: each key's attention mass from the last ``score_rows`` queries and
the entropy of the last ``entropy_rows`` queries, never the whole
``[B, H, R, S, N]`` probabilities.

- On MLX's CPU backend: Velox's own kernel (``velox_cache.kernels.kernel``): causal
  query blocks, float32 scores, a multiply/add ``exp``, deferred normalisation;
  the scores come out of the same pass. Where Velox's native ops are built the
  kernel hands the call to one fused native primitive
  (``velox_cache.kernels.fused``, FlashAttention-style on both cores, within
  ``native.ATTENTION_TOLERANCE`` of the MLX kernel).
- On Metal and CUDA, or with ``VELOX_ATTENTION=exact``: the output is
  ``mx.fast.scaled_dot_product_attention`` itself (bit for bit what mlx-lm
  computes) and the scores come from a precise softmax over only the rows asked
  for, a block of rows at a time.
- Calls the kernel cannot take (``kernel_supports``: attention sinks, values of
  another head dim, ...) take that exact path on the CPU backend too, so they
  are never computed or scored wrongly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from . import attention, kernel, masks
from .fused import fused_attention_quantized
from .attention import Mask

ENVIRONMENT_VARIABLE = "VELOX_ATTENTION"
MODES = ("fast", "exact")
STREAMS_VARIABLE = "VELOX_ATTENTION_STREAMS"  # 2: split the kernel's elementwise work over two CPU streams
EXACT_SCORE_BLOCK = 64  # query rows per block when the exact path computes scores


@dataclass(frozen=True)
class AttentionResult:
    """What one attention call produced.

    Attributes:
        output: ``[B, H*R, S, D]`` in the queries' dtype (None when no values were given).
        key_mass: ``[B, H, N]`` float32, attention each key received from the last
            ``score_rows`` queries, summed over them and the GQA group (None when 0).
        entropy: float32 scalar, the sum over the last ``entropy_rows`` queries of every
            head's row entropy divided by ``log(N)`` (None when 0).
        entropy_rows: how many rows (batch x query heads x queries) ``entropy`` sums.
    """

    output: Optional[mx.array]
    key_mass: Optional[mx.array] = None
    entropy: Optional[mx.array] = None
    entropy_rows: int = 0


def attention_mode() -> str:
    """``fast`` (default) or ``exact``, from the ``VELOX_ATTENTION`` environment variable."""
    mode = os.environ.get(ENVIRONMENT_VARIABLE) or "fast"
    if mode not in MODES:
        raise ValueError(f"{ENVIRONMENT_VARIABLE}: {mode!r} is not one of {', '.join(MODES)}")
    return mode


def kernel_streams() -> int:
    """CPU streams the kernel uses, 1 (default) or 2, from ``VELOX_ATTENTION_STREAMS``.

    Two streams run half of each block's elementwise work in parallel (MLX runs
    elementwise ops on one thread per stream); on a contended 2-core machine it
    did not measure faster, so it is off unless asked for. The fused native
    attention, where it runs, ignores it (it has threads of its own).
    """
    streams = os.environ.get(STREAMS_VARIABLE) or "1"
    if streams not in ("1", "2"):
        raise ValueError(f"{STREAMS_VARIABLE}: {streams!r} is not 1 or 2")
    return int(streams)


def uses_kernel() -> bool:
    """True when attention runs on Velox's kernel: the CPU backend, not in exact mode."""
    return mx.default_device() == mx.cpu and attention_mode() == "fast"


def kernel_supports(
    queries: mx.array, keys: mx.array, values: Optional[mx.array], mask: Mask, sinks: Optional[mx.array] = None
) -> bool:
    """True when Velox's kernel can compute this call (it then matches the fused kernel).

    It cannot take attention sinks, keys or values whose head dim differs
    from the queries', query heads that are not a multiple of the key heads,
    a causal mask over fewer keys than queries, or an array mask that does not
    broadcast to ``[B, H*R, S, N]`` with one row per query or one for all.
    """
    batch, n_q_heads, n_queries, dim = queries.shape
    n_kv_heads, n_keys = keys.shape[1], keys.shape[2]
    if sinks is not None or keys.shape[-1] != dim or (values is not None and values.shape[-1] != dim):
        return False
    if n_kv_heads == 0 or n_q_heads % n_kv_heads:
        return False
    if isinstance(mask, str):
        return mask == "causal" and n_keys >= n_queries
    if isinstance(mask, mx.array):
        if mask.ndim > 4 or mask.shape[-1] != n_keys or (mask.ndim >= 2 and mask.shape[-2] not in (1, n_queries)):
            return False
        if mask.ndim >= 3 and mask.shape[-3] not in (1, n_q_heads):
            return False
        if mask.ndim == 4 and mask.shape[0] not in (1, batch):
            return False
    return True


def attend_and_score(
    queries: mx.array,
    keys: mx.array,
    values: Optional[mx.array],
    *,
    scale: float,
    mask: Mask = None,
    sinks: Optional[mx.array] = None,
    score_rows: int = 0,
    entropy_rows: int = 0,
    key_heads: Optional[mx.array] = None,
    n_heads: int = 0,
) -> AttentionResult:
    """Attention of ``queries`` ``[B, H*R, S, D]`` over ``keys``/``values`` ``[B, H, N, D]``.

    ``mask`` is None, ``"causal"`` (lower-right aligned, as mlx-lm passes it) or
    an array broadcastable to ``[B, H*R, S, N]``, boolean or additive.
    ``sinks`` ``[H*R]`` are per-head logits that take softmax mass but attend
    to nothing (gpt-oss; as ``mx.fast.scaled_dot_product_attention``): they
    count in the output and the scores. ``values=None`` computes only the
    scores. ``key_heads`` ``[N]`` with ``n_heads``: keys/values ``[B, 1, N,
    D]`` hold pooled per-head slots (``HeadPooledSlots``), slot ``j`` of KV
    head ``key_heads[j]``, and each query head sees its own KV head's only:
    the kernel skips the others' slots, every other path masks them. See
    ``AttentionResult``.
    """
    batch, n_q_heads, n_queries, _ = queries.shape
    score_rows, entropy_rows = min(score_rows, n_queries), min(entropy_rows, n_queries)
    on_kernel = uses_kernel() and kernel_supports(queries, keys, values, mask, sinks)
    if key_heads is not None and not on_kernel:  # every other path masks the other heads' slots
        mask, key_heads = masks.with_pooled_heads(mask, key_heads, n_q_heads, n_heads), None
    if on_kernel:
        output, key_mass, entropy = kernel.blocked_attention(
            queries,
            keys,
            values,
            scale=scale,
            mask=mask,
            score_rows=score_rows,
            entropy_rows=entropy_rows,
            two_streams=kernel_streams() == 2,
            key_heads=key_heads,
            n_heads=n_heads,
        )
    else:
        output = None
        if values is not None:
            output = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        key_mass, entropy = _exact_scores(queries, keys, scale, mask, sinks, score_rows, entropy_rows)
    return AttentionResult(output, key_mass, entropy, batch * n_q_heads * entropy_rows)


def attend_quantized(
    queries: mx.array,
    held,
    *,
    scale: float,
    mask: Mask = None,
    sinks: Optional[mx.array] = None,
    score_rows: int = 0,
    entropy_rows: int = 0,
    values: bool = True,
) -> AttentionResult:
    """``attend_and_score`` over quantized keys and values (``held``: a ``kv_codes.QuantizedKV``).

    ``values=False`` computes only the scores (``attend_and_score`` with ``values=None``).

    On Velox's kernel with the native ops built, the fused primitive reads the
    codes and dequantizes one key block at a time inside its tiles: no float
    copy of the cache is made. Everywhere else (no native build, Metal and
    CUDA, ``VELOX_ATTENTION=exact``, sinks) the held tokens are dequantized
    first and attended as floats (``QuantizedKV.dequantized``: a float copy
    for the call). Held tokens none of which is quantized yet (a prompt still
    being read) take ``attend_and_score`` on the float ones, exactly.
    """
    batch, n_q_heads, n_queries, _ = queries.shape
    if held.live is not None:
        mask = _live_only(mask, held.live, n_q_heads, n_queries)
    if held.quantized == 0:
        return attend_and_score(
            queries, held.keys, held.values if values else None, scale=scale, mask=mask, sinks=sinks,
            score_rows=score_rows, entropy_rows=entropy_rows,
        )
    if not values and not score_rows and not entropy_rows:
        return AttentionResult(None)
    score_rows, entropy_rows = min(score_rows, n_queries), min(entropy_rows, n_queries)
    if uses_kernel() and kernel_supports(queries, held, held, mask, sinks):  # it reads shapes only
        result = fused_attention_quantized(
            queries, held, scale=scale, mask=mask, score_rows=score_rows, entropy_rows=entropy_rows, values=values
        )
        if result is not None:
            return AttentionResult(*result, batch * n_q_heads * entropy_rows)
    keys, held_values = held.dequantized()
    return attend_and_score(
        queries, keys.astype(queries.dtype), held_values.astype(queries.dtype) if values else None, scale=scale,
        mask=mask, sinks=sinks, score_rows=score_rows, entropy_rows=entropy_rows,
    )


def _live_only(mask: Mask, live: mx.array, n_q_heads: int, n_queries: int) -> mx.array:
    """``mask`` (None, causal, boolean or additive) with the dead slots of ``live`` ``[B, H, N]`` masked too."""
    batch, heads, n_keys = live.shape
    visible = mx.repeat(live, n_q_heads // heads, axis=1)[:, :, None]  # [B, H*R, 1, N]
    if mask is None:
        return visible
    if isinstance(mask, str):
        causal = mx.arange(n_keys)[None] <= (n_keys - n_queries + mx.arange(n_queries))[:, None]
        return visible & causal
    if mask.dtype == mx.bool_:
        return visible & mask
    return mx.where(visible, mask, -mx.inf)


def attend(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Mask = None) -> mx.array:
    """Only the attention output (what a model's attention call needs)."""
    return attend_and_score(queries, keys, values, scale=scale, mask=mask).output


def _exact_scores(queries, keys, scale, mask, sinks, score_rows: int, entropy_rows: int):
    """Key mass and sampled entropy from a precise softmax over the last rows, block by block."""
    n_queries, n_keys = queries.shape[2], keys.shape[2]
    first = n_queries - max(score_rows, entropy_rows)
    block = max(EXACT_SCORE_BLOCK, entropy_rows)
    key_mass = entropy = None
    for stop in range(n_queries, first, -block):
        start = max(first, stop - block)
        # a causal block sees the keys up to its last query: lower-right aligned again
        visible = n_keys - n_queries + stop if isinstance(mask, str) else n_keys
        rows_mask = _rows_of(mask, start, stop)
        probs = attention.attention_probs(queries[:, :, start:stop], keys[:, :, :visible], scale, rows_mask, sinks)
        if stop > n_queries - score_rows:
            mass = attention.key_mass(probs[:, :, :, max(0, n_queries - score_rows - start) :])  # [B, H, visible]
            mass = mx.pad(mass, [(0, 0), (0, 0), (0, n_keys - visible)]) if visible < n_keys else mass
            key_mass = mass if key_mass is None else key_mass + mass
        if stop == n_queries and entropy_rows:
            entropy = attention.normalized_entropy(probs[:, :, :, -entropy_rows:])
    return key_mass, entropy


def _rows_of(mask: Mask, start: int, stop: int) -> Mask:
    """The mask of query rows ``[start, stop)`` (a causal mask stays causal: it is lower-right aligned)."""
    if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] > 1:
        return mask[..., start:stop, :]
    return mask
