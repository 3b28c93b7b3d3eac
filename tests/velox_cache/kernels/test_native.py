"""Velox's native CPU ops against the pure-MLX ops they replace, and the switch between them.

``row_max`` and ``shifted_exp`` must give the pure-MLX kernel's bits exactly, so
attention is identical on both paths; ``swiglu`` must be at least as accurate
as mlx-lm's own. Where the native module is not built these tests skip, and
``test_the_native_ops_are_built_where_they_can_be`` fails if the setup could
have built them and did not.
"""

import platform

import mlx.core as mx
import numpy as np
import pytest

import velox_cache
from velox_cache.kernels import elementwise, kernel, native, native_check
from velox_cache.kernels.native import build

needs_native = pytest.mark.skipif(native.ops() is None, reason=f"native ops: {native.status()}")


def test_the_native_ops_are_built_where_they_can_be():
    if platform.system() != "Linux" or build.missing_tools():
        pytest.skip("this machine cannot build them; the pure-MLX path runs")
    assert native.status() == "loaded"


def test_velox_native_0_turns_them_off(monkeypatch):
    monkeypatch.setenv("VELOX_NATIVE", "0")
    assert native.ops() is None
    assert native.status().startswith("off")


def _scores(shape, seed=0, masked=0.2):
    scores = mx.random.normal(shape, key=mx.random.key(seed)) * 3
    drop = mx.random.uniform(shape=shape, key=mx.random.key(seed + 1)) < masked
    return mx.where(drop, -mx.inf, scores)


@needs_native
def test_self_check_passes():
    assert native_check.self_check() == ""


@needs_native
@pytest.mark.parametrize("length", [1, 7, 16, 63, 300, 1024])
def test_row_max_is_exact_including_masked_and_nan_rows(length):
    scores = _scores((2, 3, 9, length))
    scores = mx.concatenate([scores, mx.full((2, 3, 1, length), -mx.inf)], axis=2)  # fully masked row
    scores[0, 0, 0, length // 2] = mx.nan
    got, expected = native.ops().row_max(scores), kernel.pure_row_max(scores)
    assert got.shape == expected.shape == (2, 3, 10, 1)
    assert mx.array_equal(got, expected, equal_nan=True).item()
    assert mx.isnan(got[0, 0, 0]).item() and not mx.isnan(got[0, 0, 1]).item()


@needs_native
def test_shifted_exp_gives_the_pure_kernels_bits_on_strided_rows_and_broadcast_shifts():
    scores = _scores((2, 3, 40, 301)) / 2**kernel.SQUARINGS
    rows = scores[:, :, 3:29]  # a slice: rows are not contiguous across heads
    for shift in (kernel.pure_row_max(rows), mx.array(0.0), kernel.pure_row_max(rows)[:1]):
        got, expected = native.ops().shifted_exp(rows, shift), kernel.pure_shifted_exp(rows, shift)
        assert got.shape == rows.shape
        assert mx.array_equal(got, expected, equal_nan=True).item()


@needs_native
def test_swiglu_is_closer_to_float64_than_mlx_lms_own():
    from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

    gate = mx.concatenate([mx.random.normal((8192,), key=mx.random.key(0)) * 8,
                           mx.array([-1e4, -100.0, -88.0, -87.0, 0.0, 87.0, 89.0, 1e4])])
    x = mx.random.normal(gate.shape, key=mx.random.key(1))
    gate64, x64 = np.array(gate, dtype=np.float64), np.array(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        truth = gate64 / (1 + np.exp(-gate64)) * x64

    normal = np.abs(truth) >= 1e-30  # below, float32 has no relative precision to speak of

    def relative_error(values):
        difference = np.abs(np.array(values, dtype=np.float64) - truth)
        return float((difference[normal] / np.abs(truth[normal])).max())

    got = native.ops().swiglu(gate, x)
    assert relative_error(got) <= native.SWIGLU_TOLERANCE
    assert relative_error(got) <= relative_error(mlx_lm_swiglu(gate, x))
    assert np.abs(np.array(got, dtype=np.float64) - truth)[~normal].max() <= 1e-30


@needs_native
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_swiglu_keeps_half_precision_inputs_dtype(dtype):
    gate, x = (mx.random.normal((3, 5, 64), key=mx.random.key(i)).astype(dtype) for i in (2, 3))
    got = native.ops().swiglu(gate, x)
    assert got.dtype == dtype and got.shape == gate.shape
    assert mx.allclose(got.astype(mx.float32), elementwise.power_swiglu(gate, x).astype(mx.float32),
                       atol=1e-2, rtol=1e-2).item()


@needs_native
def test_ops_run_on_the_stream_they_are_built_on():
    scores = _scores((1, 3, 64, 256))
    with mx.stream(mx.new_stream(mx.cpu)):
        got = native.ops().shifted_exp(scores / 32, native.ops().row_max(scores) / 32)
    assert mx.array_equal(got, kernel.pure_shifted_exp(scores / 32, kernel.pure_row_max(scores) / 32)).item()


@needs_native
@pytest.mark.parametrize("mask", ["causal", None, "array"])
@pytest.mark.parametrize("streams", [1, 2])
def test_the_mlx_kernel_is_bit_identical_on_both_paths(monkeypatch, mask, streams):
    """The MLX-ops kernel (``fused=False``) gives the same bits with native row_max/shifted_exp as without.

    The fused primitive is another computation; test_native_attention.py holds it to a tolerance.
    """
    queries = mx.random.normal((1, 9, 70, 32), key=mx.random.key(4)) * 2
    keys = mx.random.normal((1, 3, 150, 32), key=mx.random.key(5)) * 2
    values = mx.random.normal((1, 3, 150, 32), key=mx.random.key(6))
    if mask == "array":
        mask = mx.random.uniform(shape=(1, 1, 70, 150), key=mx.random.key(7)) < 0.8
    kwargs = dict(scale=32**-0.5, mask=mask, score_rows=20, entropy_rows=4, two_streams=streams == 2, fused=False)
    native_result = kernel.blocked_attention(queries, keys, values, **kwargs)
    monkeypatch.setenv("VELOX_NATIVE", "0")
    pure_result = kernel.blocked_attention(queries, keys, values, **kwargs)
    for got, expected in zip(native_result, pure_result):
        assert mx.array_equal(got, expected).item()


@needs_native
def test_a_model_decodes_the_same_greedy_tokens_on_both_paths(tiny_model, monkeypatch):
    model, _ = tiny_model
    prompt = mx.array([[5, 17, 3, 99, 42, 8, 23, 61, 7, 30]])

    def greedy():
        caches = velox_cache.KVCacheBuilder.for_model(model, velox_cache.KVCacheConfig(method="full"))
        tokens, logits_seen = [], []
        with velox_cache.fast_attention(model):
            logits = model(prompt, cache=caches)
            for _ in range(12):
                logits_seen.append(logits[0, -1])
                token = logits[0, -1].argmax().item()
                tokens.append(token)
                logits = model(mx.array([[token]]), cache=caches)
        return tokens, mx.stack(logits_seen)

    native_tokens, native_logits = greedy()
    monkeypatch.setenv("VELOX_NATIVE", "0")
    pure_tokens, pure_logits = greedy()
    assert native_tokens == pure_tokens
    assert mx.allclose(native_logits, pure_logits, atol=1e-4, rtol=1e-4).item()


@needs_native
@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("dims,scale", [(64, 1.0), (32, 1.0), (64, 0.25)])
def test_rope_matches_mlx_fast_rope_at_any_position(traditional, dims, scale):
    import mlx.nn as nn

    module = nn.RoPE(dims, traditional=traditional, base=100000.0, scale=scale)
    x = mx.random.normal((1, 200, 9, 64), key=mx.random.key(8)).transpose(0, 2, 1, 3)  # as queries: strided rows
    for offset in (0, 100, 16000):
        expected = mx.fast.rope(x, dims, traditional=traditional, base=100000.0, scale=scale, offset=offset)
        got = elementwise.rope(module, x, offset)
        assert got.shape == expected.shape and got.dtype == expected.dtype
        assert (mx.abs(got - expected).max() / mx.abs(x).max()).item() <= native.ROPE_TOLERANCE
        assert mx.array_equal(got, expected).item()
        if dims < 64:
            assert mx.array_equal(got[..., dims:], x[..., dims:]).item()


@needs_native
@pytest.mark.parametrize("features", [1, 7, 64, 576, 1536])
def test_rms_norm_gives_mlx_fast_rms_norms_bits(features):
    import mlx.nn as nn

    module = nn.RMSNorm(features, eps=1e-5)
    module.weight = mx.random.normal((features,), key=mx.random.key(10))
    x = mx.random.normal((2, 40, features), key=mx.random.key(11)) * 30
    for rows in (x, x[:, ::3], x.transpose(1, 0, 2), x * 1e-3):  # strided rows, tiny values
        got = elementwise.rms_norm(module, rows)
        assert got.shape == rows.shape and got.dtype == mx.float32
        assert mx.array_equal(got, mx.fast.rms_norm(rows, module.weight, 1e-5)).item()


def test_rms_norm_leaves_other_dtypes_to_mlx():
    import mlx.nn as nn

    module = nn.RMSNorm(32)
    x = mx.random.normal((3, 32), key=mx.random.key(12)).astype(mx.float16)
    got, expected = elementwise.rms_norm(module, x), mx.fast.rms_norm(x, module.weight, module.eps)
    assert got.dtype == expected.dtype and mx.array_equal(got, expected).item()


def test_rope_with_one_offset_per_row_is_mlx_fast_rope():
    import mlx.nn as nn

    module = nn.RoPE(16, traditional=True)
    x = mx.random.normal((2, 3, 1, 16), key=mx.random.key(9))
    offsets = mx.array([5, 40])
    expected = mx.fast.rope(x, 16, traditional=True, base=10000.0, scale=1.0, offset=offsets)
    assert mx.array_equal(elementwise.rope(module, x, offsets), expected).item()


def test_a_module_built_for_another_mlx_is_never_called(monkeypatch):
    if native.ops() is None:
        pytest.skip(f"native ops: {native.status()}")
    monkeypatch.setattr(native._ops, "mlx_version", "0.0.0")
    native._loaded.cache_clear()
    try:
        assert native.ops() is None
        assert native.status().startswith("built for mlx 0.0.0")
    finally:
        monkeypatch.undo()
        native._loaded.cache_clear()
    assert native.ops() is not None


@pytest.mark.parametrize("optional, exit_status", [(True, 0), (False, 1)])
def test_a_build_that_cannot_run_says_why_and_fails_only_when_required(monkeypatch, capsys, optional, exit_status):
    monkeypatch.setattr(build.platform, "system", lambda: "Linux")
    monkeypatch.setattr(build, "missing_tools", lambda: ["cmake"])
    assert build.main(["--optional"] if optional else []) == exit_status
    error = capsys.readouterr().err
    assert "missing cmake" in error and "apt-get install g++ cmake" in error
    assert ("pure-MLX" in error) == optional


@needs_native
def test_inputs_whose_last_axis_is_strided_are_read_correctly():
    x = mx.random.normal((3, 64, 40), key=mx.random.key(10)).swapaxes(-1, -2)  # last axis strided
    assert mx.array_equal(native.ops().row_max(x), kernel.pure_row_max(x)).item()
    assert mx.array_equal(native.ops().shifted_exp(x / 32, mx.array(0.0)), kernel.pure_shifted_exp(x / 32, mx.array(0.0))).item()
    assert mx.allclose(native.ops().swiglu(x, x), elementwise.power_swiglu(x, x), rtol=1e-6, atol=1e-6).item()
