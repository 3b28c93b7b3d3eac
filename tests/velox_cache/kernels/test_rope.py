"""Re-rotating a key rotated at position p by d equals rotating it at p + d."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from velox_cache.kernels.rope import RopeError, RotaryShift

B, H, T, D = 1, 3, 6, 16

ROPES = {
    "traditional": lambda: nn.RoPE(D, traditional=True, base=10000.0),
    "non-traditional": lambda: nn.RoPE(D, traditional=False, base=500000.0),
    "position-scaled": lambda: nn.RoPE(D, traditional=False, base=10000.0, scale=0.25),
    "partial-dims": lambda: nn.RoPE(D // 2, traditional=False, base=10000.0),
    "llama3": lambda: initialize_rope(
        D, base=500000.0, traditional=False, max_position_embeddings=8192,
        scaling_config={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    ),
    "yarn": lambda: initialize_rope(
        D, base=10000.0, traditional=True, max_position_embeddings=4096,
        scaling_config={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5},
    ),
}


def _rotate_at(rope, keys, positions):
    """Each token rotated at its own absolute position with the model's module."""
    rows = [rope(keys[:, :, t : t + 1], offset=int(p)) for t, p in enumerate(positions)]
    return mx.concatenate(rows, axis=2)


@pytest.mark.parametrize("name", ROPES)
@pytest.mark.parametrize("delta", [5, -7, 0])
def test_shift_composes_with_the_models_rotation(name, delta):
    rope = ROPES[name]()
    mx.random.seed(0)
    keys = mx.random.normal((B, H, T, D))
    positions = [10, 11, 15, 20, 31, 40]
    rotated = _rotate_at(rope, keys, positions)
    shifted = RotaryShift.from_module(rope).shift(rotated, mx.full((B, H, T), delta, dtype=mx.int32))
    expected = _rotate_at(rope, keys, [p + delta for p in positions])
    assert mx.allclose(shifted, expected, atol=1e-4), float(mx.abs(shifted - expected).max())


def test_each_head_and_token_moves_by_its_own_delta():
    rope = ROPES["traditional"]()
    keys = mx.random.normal((B, H, T, D))
    rotated = rope(keys, offset=100)  # token t at 100 + t
    delta = mx.random.randint(-50, 50, (B, H, T))
    shifted = RotaryShift.from_module(rope).shift(rotated, delta)
    for h in range(H):
        for t in range(T):
            expected = rope(keys[:, h : h + 1, t : t + 1], offset=100 + t + int(delta[0, h, t]))
            assert mx.allclose(shifted[:, h : h + 1, t : t + 1], expected, atol=1e-4)


def test_dynamic_ntk_is_refused_with_a_reason():
    rope = initialize_rope(D, base=10000.0, traditional=False, max_position_embeddings=2048,
                           scaling_config={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(RopeError, match="do not compose"):
        RotaryShift.from_module(rope)


def test_from_model_finds_the_rope_of_smollm2_shaped_llama(tiny_model):
    model, _ = tiny_model
    shift = RotaryShift.from_model(model)
    assert shift.dims == model.layers[0].self_attn.rope.dims
    assert shift.traditional == model.layers[0].self_attn.rope.traditional
