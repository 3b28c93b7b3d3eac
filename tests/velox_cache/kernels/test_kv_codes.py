"""Quantized keys and values (``kv_codes``) and attention over them (``attend_quantized``, the fused primitive).

The fused primitive's quantized path must be the attention of the dequantized
keys and values: within ``native.ATTENTION_TOLERANCE`` of a float64
reference computed from the same codes (each ``code * scale + zero`` taken
exactly in float64), and within 1e-2 relative of dequantize-then-attend.
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.velox_cache.kernels.test_native_attention import CASES as CASES_OF
from tests.velox_cache.kernels.test_native_attention import _errors, _inputs, _reference
from velox_cache.kernels import kv_codes, native
from velox_cache.kernels.attend import attend_and_score, attend_quantized
from velox_cache.kernels.kv_codes import QuantizedKV

needs_native = pytest.mark.skipif(
    native.ops() is None or not hasattr(native.ops(), "attention_quantized"),
    reason=f"native quantized attention: {native.status()}",
)


@pytest.mark.parametrize("bits", kv_codes.BITS)
def test_each_value_is_within_half_a_step_of_its_own(bits):
    rng = np.random.default_rng(1)
    keys = mx.array((rng.normal(size=(2, 3, 96, 16)) * np.linspace(0.1, 20, 16)).astype(np.float32))
    values = mx.array(rng.normal(size=(2, 3, 50, 16)).astype(np.float32))
    codes, scales, zeros = kv_codes.quantize_keys(keys, 32, bits)
    assert codes.dtype == mx.uint8 and codes.shape == (2, 3, 96, 16 * bits // 8) and scales.shape == (2, 3, 3, 16)
    groups = mx.broadcast_to((mx.arange(96) // 32).astype(mx.int32), (2, 3, 96))
    back = kv_codes.dequantize_keys(codes, scales, zeros, groups, bits)
    step = mx.repeat(scales, 32, axis=2)  # each key's own group's scale, per channel
    assert (mx.abs(back - keys) <= step / 2 + 1e-5).all().item()
    codes, scales, zeros = kv_codes.quantize_values(values, 8, bits)
    assert scales.shape == (2, 3, 50, 2)
    back = kv_codes.dequantize_values(codes, scales, zeros, bits)
    step = mx.repeat(scales, 8, axis=-1)
    assert (mx.abs(back - values) <= step / 2 + 1e-5).all().item()


def test_packing_round_trips_and_constant_groups_are_exact():
    codes = mx.array(np.random.default_rng(0).integers(0, 16, size=(1, 2, 5, 8)).astype(np.uint8))
    assert mx.array_equal(kv_codes.unpack(kv_codes.pack(codes, 4), 4), codes).item()
    assert kv_codes.pack(codes, 4).shape == (1, 2, 5, 4)
    constant = mx.full((1, 1, 4, 8), 3.25)
    codes, scales, zeros = kv_codes.quantize_keys(constant, 4, 4)
    back = kv_codes.dequantize_keys(codes, scales, zeros, mx.zeros((1, 1, 4), mx.int32), 4)
    assert mx.array_equal(back, constant).item()


def test_bits_other_than_8_or_4_are_refused():
    with pytest.raises(ValueError, match="bits"):
        kv_codes.quantize_values(mx.zeros((1, 1, 2, 8)), 8, 3)


def _held(keys, values, n_quantized, bits, group, value_group, keep=None):
    """The first ``n_quantized`` tokens quantized (groups of ``group``), the rest float; ``keep`` gathers
    quantized tokens afterwards (as eviction does: codes and group numbers move, scales stay)."""
    batch, heads = keys.shape[:2]
    key_codes, key_scales, key_zeros = kv_codes.quantize_keys(keys[:, :, :n_quantized], group, bits)
    value_codes, value_scales, value_zeros = kv_codes.quantize_values(values[:, :, :n_quantized], value_group, bits)
    groups = mx.broadcast_to((mx.arange(n_quantized) // group).astype(mx.int32), (batch, heads, n_quantized))
    if keep is not None:
        index = mx.array(keep)
        key_codes, value_codes = key_codes[:, :, index], value_codes[:, :, index]
        value_scales, value_zeros, groups = value_scales[:, :, index], value_zeros[:, :, index], groups[:, :, index]
    return QuantizedKV(key_codes, key_scales, key_zeros, groups, value_codes, value_scales, value_zeros,
                       keys[:, :, n_quantized:], values[:, :, n_quantized:], bits, value_group)


def _float64_of(held):
    """Keys and values from the codes, each ``code * scale + zero`` exact in float64, then the float tokens."""
    codes = np.array(kv_codes.unpack(held.key_codes, held.bits), np.float64)
    groups = np.array(held.key_groups)
    scales = np.take_along_axis(np.array(held.key_scales, np.float64), groups[..., None], axis=2)
    zeros = np.take_along_axis(np.array(held.key_zeros, np.float64), groups[..., None], axis=2)
    keys = codes * scales + zeros
    codes = np.array(kv_codes.unpack(held.value_codes, held.bits), np.float64)
    batch, heads, tokens, dim = codes.shape
    grouped = codes.reshape(batch, heads, tokens, -1, held.value_group)
    values = grouped * np.array(held.value_scales, np.float64)[..., None] + np.array(held.value_zeros, np.float64)[..., None]
    values = values.reshape(batch, heads, tokens, dim)
    return (np.concatenate([keys, np.array(held.keys, np.float64)], axis=2),
            np.concatenate([values, np.array(held.values, np.float64)], axis=2))


# (case of test_native_attention, quantized tokens, bits, key group, value group, kept quantized tokens)
QUANTIZED_CASES = {
    "decode-8": ("decode", 64, 8, 32, 64, None),
    "decode-4-all-quantized": ("decode", 64, 4, 16, 32, None),  # 77 keys: 64 quantized, 13 float
    "decode-batch-rows-mask": ("decode-batch-rows", 128, 8, 64, 32, None),
    "few-rows-causal": ("few-rows-odd-dim", 60, 4, 20, 10, None),
    "chunk-causal-straddling": ("chunk-causal-group3", 90, 8, 30, 16, None),  # a key block half codes, half floats
    "chunk-many-blocks": ("chunk-causal-many-blocks", 512, 4, 64, 64, None),
    "bool-mask": ("bool-mask-rows", 48, 8, 16, 16, None),
    "evicted-and-reordered": ("decode", 64, 8, 16, 64, [0, 3, 5, 17, 33, 2, 40, 63, 62, 48]),
}


@needs_native
@pytest.mark.parametrize("case", list(QUANTIZED_CASES))
def test_fused_quantized_path_is_the_attention_of_the_dequantized_cache(case):
    base, n_quantized, bits, group, value_group, keep = QUANTIZED_CASES[case]
    queries, keys, values, mask = _inputs(*CASES_OF[base], seed=3)
    held = _held(keys, values, n_quantized, bits, group, value_group, keep)
    exact_keys, exact_values = _float64_of(held)
    batch, n_q_heads, n_queries, dim = queries.shape
    scale = dim**-0.5
    if isinstance(mask, mx.array) and keep is not None:
        mask = None
    for score_rows, entropy_rows in ((0, 0), (n_queries, min(n_queries, 8))):
        got = attend_quantized(queries, held, scale=scale, mask=mask, score_rows=score_rows, entropy_rows=entropy_rows)
        got = (got.output, got.key_mass, got.entropy)
        expected = _reference(queries, exact_keys, exact_values, scale, mask, score_rows, entropy_rows)
        assert max(_errors(got, expected, exact_values, batch * n_q_heads * entropy_rows)) <= native.ATTENTION_TOLERANCE
        dequantized_keys, dequantized_values = held.dequantized()
        plain = attend_and_score(queries, dequantized_keys, dequantized_values, scale=scale, mask=mask,
                                 score_rows=score_rows, entropy_rows=entropy_rows)
        relative = mx.abs(got[0] - plain.output).max() / mx.abs(plain.output).max()
        assert relative.item() <= 1e-2


def test_every_path_gives_the_dequantized_attention(op_path):
    """Native where built, and the pure-MLX path (which dequantizes first): the same attention either way."""
    queries, keys, values, _ = _inputs(1, 3, 3, 5, 100, 32, None, seed=4)
    held = _held(keys, values, 64, 8, 32, 32)
    got = attend_quantized(queries, held, scale=0.2, mask="causal", score_rows=5, entropy_rows=2)
    expected = _reference(queries, *_float64_of(held), 0.2, "causal", 5, 2)
    assert max(_errors((got.output, got.key_mass, got.entropy), expected, values, 9 * 2)) <= native.ATTENTION_TOLERANCE


def test_nothing_quantized_yet_is_plain_float_attention():
    queries, keys, values, _ = _inputs(1, 2, 2, 7, 30, 16, None, seed=5)
    held = _held(keys, values, 0, 8, 16, 16)
    got = attend_quantized(queries, held, scale=0.25, mask="causal")
    assert mx.array_equal(got.output, attend_and_score(queries, keys, values, scale=0.25, mask="causal").output).item()


@needs_native
def test_scores_only_calls_read_the_codes_too():
    queries, keys, values, _ = _inputs(1, 3, 3, 4, 90, 16, None, seed=6)
    held = _held(keys, values, 64, 4, 32, 16)
    arguments = held.native_arguments()
    _, mass, entropy = native.ops().attention_quantized(
        queries, held.keys, None, arguments["key_codes"], arguments["key_scales"], arguments["key_zeros"],
        arguments["key_groups"], None, None, None, None, scale=0.25, causal=True, score_rows=4, entropy_rows=4, bits=4,
    )
    expected = _reference(queries, *_float64_of(held), 0.25, "causal", 4, 4)
    assert np.abs(np.array(mass, np.float64) - expected[1]).max() <= native.ATTENTION_TOLERANCE


@needs_native
def test_the_native_call_names_what_is_wrong():
    queries, keys, values, _ = _inputs(1, 2, 2, 1, 40, 16, None)
    held = _held(keys, values, 32, 8, 16, 16)
    arguments = held.native_arguments()
    with pytest.raises(ValueError, match="key_groups"):
        native.ops().attention_quantized(queries, held.keys, held.values, **{**arguments, "key_groups": arguments["key_groups"][:, :, :5]}, mask=None, scale=1.0)
    with pytest.raises(ValueError, match="bits"):
        native.ops().attention_quantized(queries, held.keys, held.values, **{**arguments, "bits": 5}, mask=None, scale=1.0)
    with pytest.raises(ValueError, match="value_group"):
        native.ops().attention_quantized(queries, held.keys, held.values, **{**arguments, "value_group": 3}, mask=None, scale=1.0)


@needs_native
@pytest.mark.parametrize("instruction_set", ["baseline", "avx2", "avx512"])
def test_every_instruction_set_reads_the_codes_alike(instruction_set):
    """Each set's tiles (other lane counts: the codes read straight or dequantized per block) in a fresh process."""
    import os
    import subprocess
    import sys

    best = native.ops().attention_instruction_set()
    runnable = {"baseline": ["baseline"], "avx2": ["baseline", "avx2"], "avx512": ["baseline", "avx2", "avx512"]}
    if instruction_set not in runnable.get(best, ["baseline"]):
        pytest.skip(f"this CPU runs {best}")
    probe = (
        "import mlx.core as mx\n"
        "from velox_cache.kernels import native\n"
        "from tests.velox_cache.kernels.test_kv_codes import QUANTIZED_CASES, CASES_OF, _held, _float64_of\n"
        "from tests.velox_cache.kernels.test_native_attention import _inputs, _reference, _errors\n"
        "from velox_cache.kernels.attend import attend_quantized\n"
        "print(native.ops().attention_instruction_set())\n"
        "for case, (base, n, bits, group, value_group, keep) in QUANTIZED_CASES.items():\n"
        "    q, k, v, mask = _inputs(*CASES_OF[base], seed=3)\n"
        "    mask = None if keep is not None and isinstance(mask, mx.array) else mask\n"
        "    held = _held(k, v, n, bits, group, value_group, keep)\n"
        "    got = attend_quantized(q, held, scale=0.2, mask=mask, score_rows=1, entropy_rows=1)\n"
        "    exact = _float64_of(held)\n"
        "    rows = q.shape[0] * q.shape[1]\n"
        "    print(max(_errors((got.output, got.key_mass, got.entropy), _reference(q, *exact, 0.2, mask, 1, 1), exact[1], rows)))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=root,
                            env={**os.environ, "VELOX_NATIVE_ISA": instruction_set})
    assert result.returncode == 0, result.stderr[-2000:]
    chosen, *errors = result.stdout.split()
    assert chosen == instruction_set
    assert len(errors) == len(QUANTIZED_CASES) and all(float(e) <= native.ATTENTION_TOLERANCE for e in errors), errors
