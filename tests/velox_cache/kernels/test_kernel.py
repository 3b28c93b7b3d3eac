"""Velox's CPU attention kernel against MLX's fused attention, and the one entry point.

Tolerance: the kernel computes in float32 with a multiply/add exp (relative
error ~1e-5) and matches ``mx.fast.scaled_dot_product_attention`` over float32
inputs within 2e-5 absolute; for half-precision inputs, within one rounding of
the output dtype (float16 1e-3, bfloat16 8e-3).
"""

import math

import mlx.core as mx
import pytest

from velox_cache import attend_and_score
from velox_cache.kernels.attention import attention_probs, key_mass, normalized_entropy
from velox_cache.kernels.kernel import blocked_attention, fast_exp, row_max

pytestmark = pytest.mark.usefixtures("op_path")  # each test on the native ops and on the pure-MLX ones

TOLERANCE = {mx.float32: 2e-5, mx.float16: 1e-3, mx.bfloat16: 8e-3}

# (kv heads, group, queries, keys, head dim, mask); blocks of 16 query rows
CASES = {
    "causal-group1": (2, 1, 40, 40, 16, "causal"),
    "causal-group3-chunk": (3, 3, 37, 101, 32, "causal"),  # chunk shorter than keys, no multiple of 16
    "causal-group4-chunk": (2, 4, 16, 80, 16, "causal"),
    "single-query": (3, 3, 1, 77, 64, None),
    "single-query-causal": (2, 4, 1, 50, 16, "causal"),
    "no-mask-prefill": (1, 3, 20, 45, 16, None),
    "bool-mask": (2, 3, 21, 53, 16, "bool"),
    "bool-mask-per-head": (2, 2, 18, 33, 16, "bool-heads"),
    "additive-mask": (3, 1, 19, 47, 16, "additive"),
    "additive-mask-3d": (2, 4, 17, 40, 16, "additive-3d"),
}


def _inputs(kv_heads, group, n_queries, n_keys, dim, mask_kind, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    queries = (mx.random.normal((1, kv_heads * group, n_queries, dim)) * 2).astype(dtype)
    keys = (mx.random.normal((1, kv_heads, n_keys, dim)) * 2).astype(dtype)
    values = mx.random.normal((1, kv_heads, n_keys, dim)).astype(dtype)
    causal = mx.arange(n_keys - n_queries, n_keys)[:, None] >= mx.arange(n_keys)[None]
    mask = {
        None: None,
        "causal": "causal",
        "bool": causal & (mx.random.uniform(shape=(n_queries, n_keys)) > 0.3) | (mx.arange(n_keys) == 0),
        "bool-heads": (mx.random.uniform(shape=(1, kv_heads * group, n_queries, n_keys)) > 0.5)
        | (mx.arange(n_keys) == 0),
        "additive": mx.where(causal, 0.0, -mx.inf) + mx.random.normal((n_queries, n_keys)),
        "additive-3d": mx.random.normal((kv_heads * group, n_queries, n_keys)).astype(dtype),
    }[mask_kind]
    return queries, keys, values, mask


def _sdpa(queries, keys, values, scale, mask):
    """The fused kernel on float32 copies of the inputs (the reference)."""
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        mask = mask.astype(mx.float32)
    up = [a.astype(mx.float32) for a in (queries, keys, values)]
    return mx.fast.scaled_dot_product_attention(*up, scale=scale, mask=mask)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_fused_attention(case, dtype):
    queries, keys, values, mask = _inputs(*CASES[case], dtype=dtype)
    scale = queries.shape[-1] ** -0.5
    expected = _sdpa(queries, keys, values, scale, mask)
    for rows_per_block in (16, None):
        output, _, _ = blocked_attention(queries, keys, values, scale=scale, mask=mask, rows_per_block=rows_per_block)
        assert output.dtype == dtype and output.shape == queries.shape
        error = mx.abs(output.astype(mx.float32) - expected).max().item()
        assert error <= TOLERANCE[dtype], f"max abs error {error:.2e}"


@pytest.mark.parametrize("case", list(CASES))
def test_scores_come_from_the_same_pass(case):
    """Key mass of the last rows and sampled entropy match an exact softmax."""
    queries, keys, values, mask = _inputs(*CASES[case])
    n_queries = queries.shape[2]
    scale = queries.shape[-1] ** -0.5
    score_rows, entropy_rows = max(1, n_queries // 2 + 1), min(n_queries, 8)
    _, mass, entropy = blocked_attention(
        queries, keys, values, scale=scale, mask=mask, score_rows=score_rows, entropy_rows=entropy_rows,
        rows_per_block=16,
    )
    probs = attention_probs(queries, keys, scale, mask)  # [B, H, R, S, N]
    assert mx.allclose(mass, key_mass(probs[:, :, :, -score_rows:]), atol=1e-5).item()
    assert entropy.item() == pytest.approx(normalized_entropy(probs[:, :, :, -entropy_rows:]).item(), abs=1e-4)
    scores_only = blocked_attention(queries, keys, None, scale=scale, mask=mask, score_rows=score_rows)
    assert scores_only[0] is None and mx.allclose(scores_only[1], mass, atol=1e-6).item()


def test_causal_mask_is_lower_right_aligned():
    """A chunk's first query sees every earlier key and itself, not the chunk's later keys."""
    queries, keys, values, _ = _inputs(1, 2, 4, 10, 16, None)
    _, mass, _ = blocked_attention(queries[:, :, :1], keys[:, :, :7], values[:, :, :7], scale=0.25, mask="causal",
                                   score_rows=1)
    _, mass_chunk, _ = blocked_attention(queries, keys, values, scale=0.25, mask="causal", score_rows=4)
    assert mass.shape == (1, 1, 7) and mx.all(mass > 0).item()
    assert mx.all(mass_chunk > 0).item(), "the last query sees every key"


def test_fast_exp_accuracy():
    x = -mx.linspace(0, 12, 20001)
    relative = mx.abs(fast_exp(x) - mx.exp(x)) / mx.exp(x)
    assert mx.max(relative).item() < 2e-5
    assert mx.max(relative[: 5001]).item() < 4e-6  # arguments in [-3, 0]
    assert fast_exp(mx.array([-mx.inf, -1000.0])).max().item() < 1e-20


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_attend_and_score_returns_only_what_was_asked(mode, monkeypatch):
    monkeypatch.setenv("VELOX_ATTENTION", mode)
    queries, keys, values, _ = _inputs(3, 3, 37, 101, 32, None)
    scale = 32**-0.5
    plain = attend_and_score(queries, keys, values, scale=scale, mask="causal")
    assert plain.key_mass is None and plain.entropy is None
    scored = attend_and_score(queries, keys, values, scale=scale, mask="causal", score_rows=37, entropy_rows=8)
    probs = attention_probs(queries, keys, scale, "causal")
    assert mx.allclose(scored.key_mass, key_mass(probs), atol=1e-4).item()
    assert scored.entropy_rows == 9 * 8
    assert scored.entropy.item() == pytest.approx(normalized_entropy(probs[:, :, :, -8:]).item(), abs=1e-4)
    fused = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask="causal")
    if mode == "exact":
        assert mx.array_equal(plain.output, fused).item(), "exact mode is the fused kernel, bit for bit"
    else:
        assert mx.allclose(plain.output, fused, atol=2e-5).item()


def test_unknown_attention_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv("VELOX_ATTENTION", "fastest")
    queries, keys, values, _ = _inputs(1, 1, 2, 4, 8, None)
    with pytest.raises(ValueError, match="VELOX_ATTENTION"):
        attend_and_score(queries, keys, values, scale=1.0)


def test_entropy_of_uniform_attention_is_one():
    keys = mx.zeros((1, 1, 64, 8))
    result = attend_and_score(mx.ones((1, 2, 4, 8)), keys, None, scale=1.0, entropy_rows=4)
    assert result.entropy.item() / result.entropy_rows == pytest.approx(1.0, abs=1e-5)
    assert math.isclose(result.entropy_rows, 8)


def test_two_streams_give_the_same_attention(monkeypatch):
    queries, keys, values, _ = _inputs(3, 3, 37, 101, 32, None)
    one = attend_and_score(queries, keys, values, scale=0.2, mask="causal", score_rows=20)
    monkeypatch.setenv("VELOX_ATTENTION_STREAMS", "2")
    two = attend_and_score(queries, keys, values, scale=0.2, mask="causal", score_rows=20)
    # the same arithmetic; only the GEMM's rounding may differ, as OpenBLAS's AVX-512
    # kernels block a half block's rows differently from a whole block's
    assert mx.allclose(one.output, two.output, rtol=1e-6, atol=1e-6).item()
    assert mx.allclose(one.key_mass, two.key_mass, atol=1e-6).item()
    monkeypatch.setenv("VELOX_ATTENTION_STREAMS", "3")
    with pytest.raises(ValueError, match="VELOX_ATTENTION_STREAMS"):
        attend_and_score(queries, keys, values, scale=0.2)


@pytest.mark.parametrize("length", [1, 63, 128, 129, 1001, 4097])
def test_row_max_is_the_maximum(length):
    scores = mx.random.normal((2, 3, length))
    assert mx.array_equal(row_max(scores), scores.max(axis=-1, keepdims=True)).item()


@pytest.mark.parametrize("mask_kind", ["causal", "bool-per-sequence"])
def test_batch_of_two(mask_kind):
    mx.random.seed(4)
    queries = mx.random.normal((2, 6, 20, 16))
    keys, values = mx.random.normal((2, 2, 50, 16)), mx.random.normal((2, 2, 50, 16))
    mask = "causal" if mask_kind == "causal" else (mx.random.uniform(shape=(2, 1, 20, 50)) > 0.4) | (mx.arange(50) == 0)
    output, mass, _ = blocked_attention(queries, keys, values, scale=0.25, mask=mask, score_rows=20, rows_per_block=16)
    assert mx.allclose(output, _sdpa(queries, keys, values, 0.25, mask), atol=2e-5).item()
    assert mx.allclose(mass, key_mass(attention_probs(queries, keys, 0.25, mask)), atol=1e-5).item()
