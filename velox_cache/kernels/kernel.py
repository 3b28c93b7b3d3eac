"""Velox's attention kernel for MLX's CPU backend, built from public MLX ops.

MLX's CPU backend has no attention kernel: ``mx.fast.scaled_dot_product_attention``
falls back to a matmul, a precise softmax and a second matmul over every
``S x N`` score, upper triangle included, and its ``exp`` is a scalar
polynomial of out-of-line library calls. This kernel does the same attention
with less work:

- queries go in blocks of rows, and under a ``"causal"`` mask each block only
  multiplies the keys it can see, so the upper triangle is never computed;
- scores are float32; ``exp`` is a short Taylor polynomial raised to the power
  ``2**SQUARINGS`` by repeated squaring (multiply/add only; ``mx.compile``
  fuses it into two passes where MLX finds a C++ compiler, and it runs as
  plain ops where it does not), about 3x faster than ``mx.exp`` on x86 and as
  accurate as the fused kernel against a float64 reference;
- each row's maximum folds halves of the row together elementwise before
  reducing, since MLX's CPU max-reduction is a slow serial chain;
- where Velox's native ops are built (``velox_cache.kernels.native``), the row maximum
  and the ``exp`` run as vectorised C++ loops instead, with the same
  arithmetic: the same bits, several times faster;
- normalisation is deferred: unnormalised weights times ``[values | 1]`` give
  the output and the row sums in one matmul, and only the ``[S, D]`` output is
  divided;
- what scoring needs comes with it: each key's attention mass over the last
  rows from the same pass, block by block, and the entropy of a few sampled
  rows from those rows alone, so no ``[S, N]`` probabilities are ever held.

Where the native ops have it, ``blocked_attention`` hands the whole call to
the fused native primitive instead (``velox_cache.kernels.fused``: the same
attention and scores, FlashAttention-style, within
``native.ATTENTION_TOLERANCE``); the MLX ops here stay the fallback and the
reference (``VELOX_NATIVE=0``, or ``fused=False``).

Shapes: ``B`` batch, ``H`` KV heads, ``R`` query heads per KV head (GQA group),
``S`` queries, ``N`` keys, ``D`` head dim. Within a block the score rows are
ordered (query, group): ``[B, H, rows * R, keys]``.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from . import fused as fused_kernel
from . import masks, native
from .attention import Mask

SQUARINGS = 5  # exp(x) = p(x / 2**5) ** (2**5), p the degree-6 Taylor polynomial of exp
TAYLOR_DEGREE = 6
CUTOFF = -64.0  # arguments below count as exp(-64) (masked keys too): the polynomial stays monotone above
BLOCK_ELEMENTS = 2**19  # scores per block (2 MiB of float32): a block's intermediates stay in cache
MIN_BLOCK_ROWS = 16
MIN_SPLIT_ROWS = 2  # query rows from which a block's elementwise work is split over two streams
ONES_COLUMN_ROWS = 64  # from this many score rows per call, row sums come from the values matmul
MAX_HALVINGS, MIN_HALF = 4, 64  # row_max folds rows in halves down to at least this length
MIN_HALVING_ELEMENTS = 2**16  # below this many scores (decode steps) folding costs more than it saves
_TAYLOR = [1.0 / math.factorial(i) for i in range(TAYLOR_DEGREE + 1)]


def _exp_of_shifted(scores: mx.array, row_max: mx.array) -> mx.array:
    """``exp((scores - row_max) * 2**SQUARINGS)`` with multiply/add only; scores come pre-divided.

    Relative error at most 2.1e-6 for arguments in [-3, 0] and 1.2e-5 in
    [-12, 0] (float32 rounding, doubled by each squaring, sets the floor);
    arguments below ``CUTOFF`` give a negligible ~1e-26, never a denormal.
    """
    t = mx.maximum(scores - row_max, CUTOFF / 2**SQUARINGS)
    y = _TAYLOR[-1]
    for coefficient in reversed(_TAYLOR[:-1]):
        y = y * t + coefficient
    for _ in range(SQUARINGS):
        y = y * y
    return y


pure_shifted_exp = mx.compile(_exp_of_shifted, shapeless=True)


def shifted_exp(scores: mx.array, row_max: mx.array) -> mx.array:
    """``_exp_of_shifted``: natively where Velox's native ops are built, else compiled MLX (same bits)."""
    ops = native.ops()
    return ops.shifted_exp(scores, row_max) if ops is not None else pure_shifted_exp(scores, row_max)


def fast_exp(x: mx.array) -> mx.array:
    """``exp(x)`` for ``x <= 0`` in float32 with multiply/add only (see ``_exp_of_shifted``)."""
    return shifted_exp(x.astype(mx.float32) / 2**SQUARINGS, mx.array(0.0))


def row_max(scores: mx.array) -> mx.array:
    """Maximum over the last axis, keepdims: natively where built, else ``pure_row_max``."""
    ops = native.ops()
    return ops.row_max(scores) if ops is not None else pure_row_max(scores)


def pure_row_max(scores: mx.array) -> mx.array:
    """Maximum over the last axis, keepdims, from public MLX ops.

    MLX's CPU max-reduction runs a serial chain; folding halves together with
    elementwise ``maximum`` first does most of the work at elementwise speed.
    """
    odd_columns = None
    for _ in range(MAX_HALVINGS if scores.size >= MIN_HALVING_ELEMENTS else 0):
        length = scores.shape[-1]
        half = length // 2
        if half < MIN_HALF:
            break
        if length % 2:
            last = scores[..., -1:]
            odd_columns = last if odd_columns is None else mx.maximum(odd_columns, last)
        scores = mx.maximum(scores[..., :half], scores[..., half : 2 * half])
    result = scores.max(axis=-1, keepdims=True)
    return result if odd_columns is None else mx.maximum(result, odd_columns)


def block_rows(n_queries: int, n_keys: int, n_q_heads: int) -> int:
    """Query rows per block so that one block's scores stay within ``BLOCK_ELEMENTS``."""
    rows = BLOCK_ELEMENTS // max(1, n_q_heads * n_keys)
    return max(MIN_BLOCK_ROWS, min(n_queries, rows))


def _mask_rows(mask: mx.array, n_kv_heads: int, group: int, n_queries: int, n_keys: int) -> mx.array:
    """An array mask broadcastable to ``[B, H*R, S, N]`` as ``[B|1, H|1, S, R|1, N]`` float32 additive."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    batch, heads = mask.shape[:2]
    mask = mx.broadcast_to(mask, (batch, heads, n_queries, n_keys))
    if heads == 1:
        mask = mask.reshape(batch, 1, 1, n_queries, n_keys)
    else:
        mask = mask.reshape(batch, n_kv_heads, group, n_queries, n_keys)
    mask = mask.transpose(0, 1, 3, 2, 4)
    if mask.dtype == mx.bool_:
        return mx.where(mask, 0.0, -mx.inf)
    return mask.astype(mx.float32)


def blocked_attention(
    queries: mx.array,
    keys: mx.array,
    values: Optional[mx.array],
    *,
    scale: float,
    mask: Mask = None,
    score_rows: int = 0,
    entropy_rows: int = 0,
    rows_per_block: Optional[int] = None,
    two_streams: bool = False,
    fused: bool = True,
    key_heads: Optional[mx.array] = None,
    n_heads: int = 0,
):
    """Attention of ``queries`` ``[B, H*R, S, D]`` over ``keys``/``values`` ``[B, H, N, D]``.

    Returns ``(output, key_mass, entropy)``: the output ``[B, H*R, S, D]`` in
    the queries' dtype (None without ``values``); the attention mass each key
    received from the last ``score_rows`` queries, summed over them and the
    GQA group, ``[B, H, N]`` float32 (None when 0); and the sum over the last
    ``entropy_rows`` queries (and the group) of each row's entropy divided by
    ``log(N)`` (a float32 scalar, None when 0).

    ``mask`` is None, ``"causal"`` (lower-right aligned: the queries are the
    last ``S`` of the ``N`` positions) or an array broadcastable to
    ``[B, H*R, S, N]``, boolean (True = attend) or additive. ``two_streams``
    runs half of each block's elementwise work on a second CPU stream.

    ``fused`` (default): the fused native primitive computes the call where
    it is built (``rows_per_block`` and ``two_streams`` then do not apply);
    False: always the MLX ops below.

    ``key_heads`` ``[N]`` with ``n_heads``: keys/values hold pooled per-head
    slots ``[B, 1, N, D]``, slot ``j`` belonging to KV head ``key_heads[j]``;
    query head ``q`` attends to KV head ``q // (H*R / n_heads)``'s slots only
    (the fused primitive skips the others'; the MLX ops mask them).
    """
    if fused:
        result = fused_kernel.fused_attention(
            queries,
            keys,
            values,
            scale=scale,
            mask=mask,
            score_rows=score_rows,
            entropy_rows=entropy_rows,
            key_heads=key_heads,
            n_heads=n_heads,
        )
        if result is not None:
            return result
    if key_heads is not None:
        mask = masks.with_pooled_heads(mask, key_heads, queries.shape[1], n_heads)
    batch, n_q_heads, n_queries, dim = queries.shape
    n_kv_heads, n_keys = keys.shape[1], keys.shape[2]
    group = n_q_heads // n_kv_heads
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"mask: {mask!r} is not 'causal', None or an array")
    score_rows, entropy_rows = min(score_rows, n_queries), min(entropy_rows, n_queries)
    # [B, H, S, R, D], scaled so that scores come out divided by 2**SQUARINGS
    q = (_float32(queries) * (scale / 2**SQUARINGS)).reshape(batch, n_kv_heads, group, n_queries, dim)
    call = _Call(
        q=q.transpose(0, 1, 3, 2, 4),
        keys_t=_float32(keys).swapaxes(-1, -2),  # [B, H, D, N]
        values=None if values is None else _float32(values),
        values_1=_with_ones(values) if values is not None and n_queries * group >= ONES_COLUMN_ROWS else None,
        causal=isinstance(mask, str),
        array_mask=_mask_rows(mask, n_kv_heads, group, n_queries, n_keys) if isinstance(mask, mx.array) else None,
        score_from=n_queries - score_rows if score_rows else n_queries,
        second_stream=_second_stream() if two_streams else None,
    )
    block = rows_per_block or block_rows(n_queries, n_keys, n_q_heads)
    outputs, masses, entropy = [], [], None
    for stop in range(n_queries, 0, -block):
        start = max(0, stop - block)
        if values is None and stop <= call.score_from:
            continue
        out, block_masses = _attend_block(call, start, stop)
        outputs.append(out)
        masses += block_masses
    if entropy_rows:
        entropy = _sampled_entropy(call, n_queries - entropy_rows, n_queries)

    output = None
    if values is not None:
        out = mx.concatenate(outputs[::-1], axis=2) if len(outputs) > 1 else outputs[0]  # [B, H, S*R, D]
        out = out.reshape(batch, n_kv_heads, n_queries, group, dim).transpose(0, 1, 3, 2, 4)
        output = out.reshape(batch, n_q_heads, n_queries, dim).astype(queries.dtype)
    key_mass = sum(masses[1:], masses[0]) if masses else None
    return output, key_mass, entropy


@dataclass(frozen=True)
class _Call:
    """One attention call's prepared inputs, shared by its query blocks."""

    q: mx.array  # [B, H, S, R, D] float32, pre-scaled
    keys_t: mx.array  # [B, H, D, N] float32
    values: Optional[mx.array]  # [B, H, N, D] float32
    values_1: Optional[mx.array]  # [B, H, N, D+1] float32: values and a column of ones (long calls)
    causal: bool
    array_mask: Optional[mx.array]  # [B|1, H|1, S, R|1, N] additive float32
    score_from: int  # first query row whose attention feeds the key mass
    second_stream: Optional[mx.Stream] = None  # where half of each block's elementwise work runs

    @property
    def n_queries(self) -> int:
        return self.q.shape[2]

    @property
    def n_keys(self) -> int:
        return self.keys_t.shape[-1]


_streams = threading.local()


def _second_stream() -> mx.Stream:
    """This thread's second CPU stream (MLX streams belong to the thread that made them)."""
    if getattr(_streams, "stream", None) is None:
        _streams.stream = mx.new_stream(mx.cpu)
    return _streams.stream


def _float32(array: mx.array) -> mx.array:
    return array if array.dtype == mx.float32 else array.astype(mx.float32)


def _with_ones(values: mx.array) -> mx.array:
    """``[values | 1]``: one matmul then gives the weighted values and the row sums."""
    ones = mx.ones((*values.shape[:-1], 1), mx.float32)
    return mx.concatenate([_float32(values), ones], axis=-1)


def _attend_block(call: _Call, start: int, stop: int):
    """Output rows and key-mass parts for the queries ``[start, stop)``.

    With a second stream, the block's score rows are halved after the scores
    matmul, and the second half's elementwise work (row maximum, exp) runs on
    that stream, in parallel: MLX runs elementwise ops on one thread per stream.
    """
    batch, n_kv_heads, n_queries, group, dim = call.q.shape
    rows = stop - start
    q_block = call.q[:, :, start:stop].reshape(batch, n_kv_heads, rows * group, dim)
    parts = _score_parts(call, q_block, start, stop)
    split = (rows // 2) * group if call.second_stream is not None and rows >= MIN_SPLIT_ROWS else 0
    halves = [(start, start + split // group, None), (start + split // group, stop, call.second_stream)]
    outs, masses = [], []
    for first, last, stream in halves if split else halves[1:2]:
        lo, hi = (first - start) * group, (last - start) * group
        with mx.stream(stream) if stream is not None else contextlib.nullcontext():
            weights = _weights([(scores[:, :, lo:hi], first_key) for scores, first_key in parts])
        out, row_sum = _weighted_values(call, weights, dim)
        outs.append(out)
        if last > call.score_from:
            masses += _key_masses(call, weights, row_sum, first, last)
    out = None if outs[0] is None else (mx.concatenate(outs, axis=2) if len(outs) > 1 else outs[0])
    return out, masses


def _weights(parts):
    """Unnormalised attention weights ``exp(scores - row max)`` of a row range, part by part."""
    block_max = None
    for scores, _ in parts:
        part_max = row_max(scores)
        block_max = part_max if block_max is None else mx.maximum(block_max, part_max)
    return [(shifted_exp(scores, block_max), first_key) for scores, first_key in parts]


def _weighted_values(call: _Call, weights, dim: int):
    """``(output [B, H, rows*R, D] or None, row sums [B, H, rows*R, 1])``."""
    out = None
    if call.values_1 is not None:
        for w, first_key in weights:
            part = w @ call.values_1[:, :, first_key : first_key + w.shape[-1]]
            out = part if out is None else out + part
        row_sum = out[..., dim:]
        return out[..., :dim] / row_sum, row_sum
    row_sum = sum(w.sum(axis=-1, keepdims=True) for w, _ in weights)
    if call.values is not None:
        for w, first_key in weights:
            part = w @ call.values[:, :, first_key : first_key + w.shape[-1]]
            out = part if out is None else out + part
        out = out / row_sum
    return out, row_sum


def _key_masses(call: _Call, weights, row_sum, start: int, stop: int) -> list:
    """Attention mass ``[B, H, N]`` per part from the queries ``[start, stop)`` at or after ``score_from``."""
    batch, n_kv_heads = row_sum.shape[:2]
    rows = stop - start
    scored = mx.arange(start, stop)[:, None] >= call.score_from
    row_weight = mx.where(scored, 1.0 / row_sum.reshape(batch, n_kv_heads, rows, -1), 0.0)
    row_weight = row_weight.reshape(batch, n_kv_heads, 1, -1)
    masses = []
    for w, first_key in weights:
        mass = (row_weight @ w).squeeze(2)  # [B, H, part]
        masses.append(mx.pad(mass, [(0, 0), (0, 0), (first_key, call.n_keys - first_key - mass.shape[-1])]))
    return masses


def _score_parts(call: _Call, q_block: mx.array, start: int, stop: int):
    """Scores of one block as ``[(scores [B, H, rows*R, part], first key), ...]``.

    Under a causal mask the block sees keys up to its last query's position;
    the keys before its first query's position need no mask, so only the
    square on the diagonal gets one.
    """
    batch, n_kv_heads, n_rows, _ = q_block.shape
    rows, group = stop - start, n_rows // (stop - start)
    first_position = call.n_keys - call.n_queries  # position of query 0
    if call.causal:
        n_visible = first_position + stop
        split = first_position + start
        parts = [(q_block @ call.keys_t[..., :split], 0)] if split else []
        query_position = mx.arange(split, n_visible)[:, None, None]
        key_position = mx.arange(split, n_visible)[None, None]
        diagonal_mask = mx.where(key_position <= query_position, 0.0, -mx.inf)  # [rows, 1, rows]
        scores = (q_block @ call.keys_t[..., split:n_visible]).reshape(batch, n_kv_heads, rows, group, rows)
        parts.append(((scores + diagonal_mask).reshape(batch, n_kv_heads, n_rows, rows), split))
        return parts
    scores = q_block @ call.keys_t
    if call.array_mask is not None:
        mask = call.array_mask[:, :, start:stop] * 2.0**-SQUARINGS  # [B|1, H|1, rows, R|1, N]
        scores = scores.reshape(batch, n_kv_heads, rows, group, call.n_keys) + mask
        scores = scores.reshape(batch, n_kv_heads, n_rows, call.n_keys)
    return [(scores, 0)]


def _sampled_entropy(call: _Call, start: int, stop: int) -> mx.array:
    """Sum over queries ``[start, stop)`` and the group of each row's entropy / log(N).

    A few rows, scored on their own: tying them to a big block's buffers would
    keep those alive until the whole graph is evaluated. With ``w = exp(x)``
    and ``p = w / l``: ``-sum p log p = log l - sum(w x) / l``.
    """
    if call.n_keys < 2:
        return mx.array(0.0)
    batch, n_kv_heads, _, group, dim = call.q.shape
    q_rows = call.q[:, :, start:stop].reshape(batch, n_kv_heads, (stop - start) * group, dim)
    parts = _score_parts(call, q_rows, start, stop)
    sample_max = None
    for scores, _ in parts:
        part_max = scores.max(axis=-1, keepdims=True)
        sample_max = part_max if sample_max is None else mx.maximum(sample_max, part_max)
    row_sum = weighted = 0.0
    for scores, _ in parts:
        w = shifted_exp(scores, sample_max)
        x = mx.maximum(scores - sample_max, CUTOFF / 2**SQUARINGS) * 2**SQUARINGS  # exp's argument
        row_sum = row_sum + w.sum(axis=-1, keepdims=True)
        weighted = weighted + (w * x).sum(axis=-1, keepdims=True)
    entropy = mx.log(row_sum) - weighted / row_sum
    return entropy.sum() / math.log(call.n_keys)
