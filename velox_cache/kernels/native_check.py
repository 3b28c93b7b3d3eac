"""Does a built native module compute what the pure-MLX ops compute? ``self_check`` says.

It sits beside the ops it compares (``kernel``, ``elementwise``) and the
native module, so that ``native`` never imports back up into the kernels that
dispatch to it. ``python -m velox_cache.kernels.native.build`` runs it in a
fresh interpreter after a build.
"""

from __future__ import annotations

import platform

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import elementwise, kernel, native


def self_check() -> str:
    """Compare the native ops with the pure-MLX ones on awkward inputs; '' when they agree, else what differs.

    ``row_max`` and ``shifted_exp`` must match bit for bit (masked ``-inf``
    keys, fully masked rows, strided rows and broadcast shifts included);
    ``swiglu`` within ``native.SWIGLU_TOLERANCE`` (relative) of a float64 reference;
    ``rope`` within ``native.ROPE_TOLERANCE`` of ``mx.fast.rope``; ``rms_norm``
    bit for bit ``mx.fast.rms_norm``'s; the fused
    ``attention`` within twice ``native.ATTENTION_TOLERANCE`` of the MLX
    kernel (output, key mass, entropy; causal and boolean-masked calls); ``greedy_choice``
    the tokens and log-probabilities of MLX's log-softmax and argmax (bit for bit on x86).
    """
    module, problem = native.built()
    if module is None:
        return problem or "not loaded"
    problems = []
    with mx.stream(mx.cpu):
        scores = mx.random.normal((2, 3, 37, 301), key=mx.random.key(0)) * 3
        scores = mx.where(mx.random.uniform(shape=scores.shape, key=mx.random.key(1)) < 0.2, -mx.inf, scores)
        scores = mx.concatenate([scores, mx.full((2, 3, 1, 301), -mx.inf)], axis=2)  # a fully masked row
        strided = scores[:, :, 5:30]
        for name, x in (("contiguous", scores), ("strided", strided)):
            pure_max, native_max = kernel.pure_row_max(x), module.row_max(x)
            if not mx.array_equal(pure_max, native_max, equal_nan=True).item():
                problems.append(f"row_max differs ({name} rows)")
            shift = native_max / 2**kernel.SQUARINGS
            pure = kernel.pure_shifted_exp(x / 2**kernel.SQUARINGS, shift)
            native_exp = module.shifted_exp(x / 2**kernel.SQUARINGS, shift)
            if not mx.array_equal(pure, native_exp, equal_nan=True).item():
                problems.append(f"shifted_exp differs ({name} rows)")
        gate = mx.random.normal((4, 96, 1536), key=mx.random.key(2)) * 6
        x = mx.random.normal(gate.shape, key=mx.random.key(3))
        gate64, x64 = np.array(gate, dtype=np.float64), np.array(x, dtype=np.float64)
        expected = gate64 / (1 + np.exp(-gate64)) * x64
        got = np.array(module.swiglu(gate, x), dtype=np.float64)
        normal = np.abs(expected) >= 1e-30
        error = float((np.abs(got - expected)[normal] / np.abs(expected[normal])).max())
        if not error <= native.SWIGLU_TOLERANCE:
            problems.append(f"swiglu differs by {error:.2e} relative (tolerance {native.SWIGLU_TOLERANCE:.0e})")
        x = mx.random.normal((1, 40, 3, 64), key=mx.random.key(4)).transpose(0, 2, 1, 3)  # strided rows
        for traditional in (True, False):
            rope = nn.RoPE(48, traditional=traditional, base=10000.0)
            expected = mx.fast.rope(x, 48, traditional=traditional, base=10000.0, scale=1.0, offset=9000)
            got = elementwise.rope(rope, x, 9000)
            error = (mx.abs(got - expected).max() / mx.abs(x).max()).item()
            if got.shape != x.shape or not error <= native.ROPE_TOLERANCE:
                problems.append(f"rope (traditional={traditional}) differs by {error:.2e} (tolerance {native.ROPE_TOLERANCE:.0e})")
        if hasattr(module, "rms_norm"):
            x = mx.random.normal((3, 7, 576), key=mx.random.key(10)) * 5
            weight = mx.random.normal((576,), key=mx.random.key(11))
            if not mx.array_equal(module.rms_norm(x[:, 1:], weight, 1e-5), mx.fast.rms_norm(x[:, 1:], weight, 1e-5)).item():
                problems.append("rms_norm differs from mx.fast.rms_norm")
        if hasattr(module, "attention"):
            problems += _attention_problems(module)
        if hasattr(module, "greedy_choice"):
            problems += _greedy_problems(module)
    return "; ".join(problems)


def _greedy_problems(module) -> list[str]:
    """The greedy choice against MLX's log-softmax and argmax: the same bits on x86, else the same tokens."""
    logits = mx.random.normal((3, 5003), key=mx.random.key(9)) * 8
    logits = mx.concatenate([logits, mx.round(logits[:1])])  # ties
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    expected_tokens = mx.argmax(logprobs, axis=-1)
    expected = mx.take_along_axis(logprobs, expected_tokens[:, None], axis=-1)[:, 0]
    tokens, values = module.greedy_choice(logits)
    exact = platform.machine() in ("x86_64", "AMD64")
    same = mx.array_equal(values, expected).item() if exact else mx.allclose(values, expected, atol=1e-5).item()
    if not mx.array_equal(tokens, expected_tokens).item() or not same:
        return ["greedy_choice differs from argmax of the log-softmax"]
    return []


def _attention_problems(module) -> list[str]:
    """The fused attention against the MLX kernel (``fused=False``) on a causal chunk and a boolean mask."""
    queries = mx.random.normal((1, 6, 40, 32), key=mx.random.key(5)) * 2
    keys = mx.random.normal((1, 2, 150, 32), key=mx.random.key(6)) * 2
    values = mx.random.normal((1, 2, 150, 32), key=mx.random.key(7))
    allowed = (mx.random.uniform(shape=(1, 1, 40, 150), key=mx.random.key(8)) < 0.7) | (mx.arange(150) == 0)
    bound = 2 * native.ATTENTION_TOLERANCE
    problems = []
    for name, mask in (("causal", "causal"), ("boolean mask", allowed)):
        options = dict(scale=32**-0.5, score_rows=12, entropy_rows=3)
        output, mass, entropy = module.attention(queries, keys, values, None if isinstance(mask, str) else mask,
                                                 causal=isinstance(mask, str), **options)
        expected = kernel.blocked_attention(queries, keys, values, mask=mask, fused=False, **options)
        errors = [mx.abs(output - expected[0]).max().item() / mx.abs(values).max().item(),
                  mx.abs(mass - expected[1]).max().item(), abs(entropy.item() - expected[2].item()) / (6 * 3)]
        if not max(errors) <= bound:
            problems.append(f"attention ({name}) differs by {max(errors):.2e} (tolerance {bound:.0e})")
    return problems
