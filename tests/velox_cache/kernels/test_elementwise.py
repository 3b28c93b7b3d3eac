"""Velox's stand-ins for mlx-lm's activations: the same values, and in place only inside the routing contexts."""

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.llama as llama
import pytest
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

import velox_cache
from velox_cache.kernels import elementwise

pytestmark = pytest.mark.usefixtures("op_path")  # each test on the native ops and on the pure-MLX ones


def test_swiglu_matches_mlx_lms_over_the_whole_range():
    gate = mx.concatenate([mx.random.normal((4096,), key=mx.random.key(0)) * 8, mx.array([-1e4, -90.0, 0.0, 90.0, 1e4])])
    x = mx.random.normal(gate.shape, key=mx.random.key(1))
    got, expected = elementwise.swiglu(gate, x), mlx_lm_swiglu(gate, x)
    assert not mx.isnan(got).any().item()
    assert mx.allclose(got, expected, rtol=1e-6, atol=1e-6).item()


@pytest.mark.parametrize("context", ["fast_attention", "observe"])
def test_routing_puts_the_stand_ins_in_and_takes_them_out(tiny_model, context):
    model, _ = tiny_model
    original_rope, original_norm = nn.RoPE.__call__, nn.RMSNorm.__call__
    with getattr(velox_cache, context)(model):
        assert llama.swiglu is elementwise.swiglu
        assert nn.RoPE.__call__ is elementwise.rope
        assert nn.RMSNorm.__call__ is elementwise.rms_norm
    assert llama.swiglu is mlx_lm_swiglu
    assert nn.RoPE.__call__ is original_rope
    assert nn.RMSNorm.__call__ is original_norm


def test_exact_mode_keeps_mlx_lms_activations(tiny_model, monkeypatch):
    monkeypatch.setenv("VELOX_ATTENTION", "exact")
    model, _ = tiny_model
    original_rope, original_norm = nn.RoPE.__call__, nn.RMSNorm.__call__
    with velox_cache.fast_attention(model):
        assert llama.swiglu is mlx_lm_swiglu
        assert nn.RoPE.__call__ is original_rope
        assert nn.RMSNorm.__call__ is original_norm


def test_the_stand_ins_leave_even_on_error(tiny_model):
    model, _ = tiny_model
    with pytest.raises(ZeroDivisionError):
        with velox_cache.fast_attention(model), velox_cache.observe(model):
            1 / 0
    assert llama.swiglu is mlx_lm_swiglu
