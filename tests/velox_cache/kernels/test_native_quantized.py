"""Velox's native quantized matmul against a float64 reference of the dequantized math, and its routing.

The reference is ``x @ w.T`` in float64 where ``w`` holds the float32 weights
(``fl32(q * scale + bias)``); each output must be within
``quantized.tolerance(in_features) * sum_k |x_k w_k|`` of it (the float32
summation bound of the loops' order). Where the native module is not built,
the tests of the fallback still run.
"""

import hashlib
import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from velox_cache.kernels import native, quantized

needs_native = pytest.mark.skipif(
    native.ops() is None or not hasattr(native.ops(), "quantized_matmul"),
    reason=f"native quantized matmul: {native.status()}",
)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(autouse=True)
def native_on(monkeypatch):
    """Whatever the shell says, these tests start with the native path allowed."""
    monkeypatch.delenv(quantized.ENVIRONMENT_VARIABLE, raising=False)


# (rows, out features, in features, bits, group size, scales' dtype)
CASES = {
    "decode-4bit": (1, 37, 64, 4, 32, "float16"),
    "rows-4bit": (3, 40, 96, 4, 32, "float16"),
    "rows-4bit-g64-f32": (9, 33, 128, 4, 64, "float32"),
    "batch-4bit-g128-bf16": (17, 50, 256, 4, 128, "bfloat16"),
    "decode-8bit": (1, 29, 64, 8, 32, "float16"),
    "rows-8bit-g64-f32": (12, 45, 192, 8, 64, "float32"),
    "many-rows-4bit": (33, 70, 160, 4, 32, "float16"),
    "shared-4bit": (5, 300, 4096, 4, 32, "float16"),  # big enough for the threads to share it
}


def _inputs(rows, out_features, in_features, bits, group_size, scale_dtype, seed=0):
    x = mx.random.normal((rows, in_features), key=mx.random.key(seed))
    w = mx.random.normal((out_features, in_features), key=mx.random.key(seed + 1)) * 0.1
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    dtype = getattr(mx, scale_dtype)
    return x, wq, scales.astype(dtype), biases.astype(dtype)


def _weights(wq, scales, biases, group_size, bits) -> np.ndarray:
    """The float32 weights, fl32(q * scale + bias), as float64."""
    packed = np.array(wq).astype(np.uint64)
    per_word = 32 // bits
    q = (packed[..., None] >> (bits * np.arange(per_word, dtype=np.uint64))) & ((1 << bits) - 1)
    q = q.reshape(packed.shape[0], -1).astype(np.float64)
    s = np.repeat(np.array(scales.astype(mx.float32), dtype=np.float64), group_size, axis=1)
    b = np.repeat(np.array(biases.astype(mx.float32), dtype=np.float64), group_size, axis=1)
    return (q * s + b).astype(np.float32).astype(np.float64)


def _reference(x, wq, scales, biases, group_size, bits):
    w = _weights(wq, scales, biases, group_size, bits)
    x64 = np.array(x.astype(mx.float32), dtype=np.float64).reshape(-1, w.shape[1])
    return x64 @ w.T, np.abs(x64) @ np.abs(w).T


def _relative_errors(got, x, wq, scales, biases, group_size, bits) -> float:
    """The largest |got - reference| / (tolerance * sum |x w|) over the outputs: <= 1 passes."""
    expected, bound = _reference(x, wq, scales, biases, group_size, bits)
    got = np.array(got.astype(mx.float32), dtype=np.float64).reshape(expected.shape)
    limit = quantized.tolerance(x.shape[-1]) * bound
    return float((np.abs(got - expected) / np.maximum(limit, 1e-300)).max())


@needs_native
@pytest.mark.parametrize("case", sorted(CASES))
def test_native_matmul_is_within_the_float32_summation_bound_of_float64(case):
    rows, out_features, in_features, bits, group_size, scale_dtype = CASES[case]
    x, wq, scales, biases = _inputs(*CASES[case])
    got = native.ops().quantized_matmul(x, wq, scales, biases, group_size=group_size, bits=bits)
    assert got.shape == (rows, out_features) and got.dtype == mx.float32
    assert _relative_errors(got, x, wq, scales, biases, group_size, bits) <= 1.0


def _dequantized(wq, scales, biases, group_size, bits):
    """mx.dequantize in float32: the scales cast first (with 16-bit scales it computes, and rounds, in 16 bits)."""
    return mx.dequantize(wq, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)


@needs_native
def test_sixteen_bit_scales_give_the_float32_weights_exactly():
    """One-hot rows read single weights back: each is fl32(q * scale + bias), as mx.dequantize in float32 gives."""
    _, wq, scales, biases = _inputs(1, 24, 64, 4, 32, "float16")
    special = mx.array([0.0, -0.0, 6e-8, -3e-5, 2**-14, -2.5, 65504.0, 1 / 3], dtype=mx.float16)  # subnormals too
    scales = mx.concatenate([special.reshape(4, 2), scales[4:]])
    biases = mx.concatenate([special[::-1].reshape(4, 2), biases[4:]])
    identity = mx.eye(64)
    got = native.ops().quantized_matmul(identity, wq, scales, biases, group_size=32, bits=4)
    expected = _dequantized(wq, scales, biases, 32, 4)
    assert mx.array_equal(got.T, expected).item()
    assert np.array_equal(np.array(expected, dtype=np.float64), _weights(wq, scales, biases, 32, 4))


@needs_native
@pytest.mark.parametrize("bits, group_size, scale_dtype", [(4, 32, "float16"), (4, 128, "bfloat16"),
                                                          (8, 32, "float16"), (8, 64, "bfloat16")])
def test_native_dequantize_gives_the_float32_weights_exactly(bits, group_size, scale_dtype):
    _, wq, scales, biases = _inputs(1, 37, 256, bits, group_size, scale_dtype)
    got = native.ops().dequantize(wq, scales, biases, group_size=group_size, bits=bits)
    assert got.dtype == mx.float32 and got.shape == (37, 256)
    assert np.array_equal(np.array(got, dtype=np.float64), _weights(wq, scales, biases, group_size, bits))
    assert mx.array_equal(got, _dequantized(wq, scales, biases, group_size, bits)).item()


@needs_native
def test_many_rows_multiply_the_dequantized_weights_with_mlxs_gemm_bit_for_bit():
    """From GEMM_ROWS rows on, the product is the float32 weights' own: what a float32 model's Linear computes."""
    rows = quantized.GEMM_ROWS
    x, wq, scales, biases = _inputs(rows, 70, 160, 4, 32, "float16")
    weights = _dequantized(wq, scales, biases, 32, 4)
    got = quantized.quantized_matmul(x, wq, scales, biases, group_size=32, bits=4)
    assert mx.array_equal(got, x @ weights.T).item()
    below = quantized.quantized_matmul(x[: rows - 1], wq, scales, biases, group_size=32, bits=4)
    assert mx.array_equal(below, native.ops().quantized_matmul(x[: rows - 1], wq, scales, biases, group_size=32,
                                                               bits=4)).item()


@needs_native
def test_strided_and_batched_inputs_and_the_output_dtype():
    x, wq, scales, biases = _inputs(6, 40, 96, 4, 32, "float16")
    variants = {
        "strided last axis": mx.random.normal((96, 6), key=mx.random.key(9)).T,
        "every other feature": mx.random.normal((6, 192), key=mx.random.key(10))[:, ::2],
        "permuted leading axes": mx.random.normal((3, 2, 96), key=mx.random.key(11)).transpose(1, 0, 2),
        "broadcast rows": mx.broadcast_to(x[:1], (4, 96)),
    }
    for name, variant in variants.items():
        got = native.ops().quantized_matmul(variant, wq, scales, biases, group_size=32, bits=4)
        packed = native.ops().quantized_matmul(mx.array(np.array(variant)), wq, scales, biases, group_size=32, bits=4)
        assert got.shape == variant.shape[:-1] + (40,), name
        assert mx.array_equal(got, packed).item(), name
    low = native.ops().quantized_matmul(x.astype(mx.bfloat16), wq, scales.astype(mx.bfloat16),
                                        biases.astype(mx.bfloat16), group_size=32, bits=4)
    assert low.dtype == mx.bfloat16
    x32 = x.astype(mx.bfloat16).astype(mx.float32)
    exact = native.ops().quantized_matmul(x32, wq, scales.astype(mx.bfloat16), biases.astype(mx.bfloat16),
                                          group_size=32, bits=4)
    assert exact.dtype == mx.float32
    assert mx.array_equal(low, exact.astype(mx.bfloat16)).item()


@needs_native
def test_a_row_gives_the_same_bits_alone_and_in_a_batch():
    x, wq, scales, biases = _inputs(*CASES["many-rows-4bit"])
    together = native.ops().quantized_matmul(x, wq, scales, biases, group_size=32, bits=4)
    for row in (0, 7, 8, 31, 32):
        alone = native.ops().quantized_matmul(x[row : row + 1], wq, scales, biases, group_size=32, bits=4)
        assert mx.array_equal(alone[0], together[row]).item(), row


@needs_native
@pytest.mark.parametrize("bad, message", [
    (dict(bits=3), "bits"),
    (dict(group_size=16), "group_size"),
    (dict(x=mx.ones((2, 63))), "x must be"),
])
def test_the_primitive_refuses_what_it_cannot_compute(bad, message):
    x, wq, scales, biases = _inputs(2, 8, 64, 4, 32, "float16")
    arguments = dict(x=x, w=wq, scales=scales, biases=biases, group_size=32, bits=4) | bad
    with pytest.raises(ValueError, match=message):
        native.ops().quantized_matmul(arguments.pop("x"), arguments.pop("w"), arguments.pop("scales"),
                                      arguments.pop("biases"), **arguments)


def _digest(array) -> str:
    return hashlib.sha256(np.array(array).tobytes()).hexdigest()[:16]


def _probe(environment: dict, cases) -> list[str]:
    """The instruction set, then each case's relative error and digest, in a fresh interpreter under ``environment``.

    The module reads ``VELOX_NATIVE_ISA`` and ``VELOX_QUANTIZED_THREADS`` once per process.
    """
    probe = (
        "import sys\n"
        "from velox_cache.kernels import native\n"
        "from tests.velox_cache.kernels.test_native_quantized import CASES, _inputs, _relative_errors, _digest\n"
        "print(native.ops().quantized_instruction_set())\n"
        "for case in sys.argv[1:]:\n"
        "    rows, n, k, bits, group_size, dtype = CASES[case]\n"
        "    x, wq, s, b = _inputs(*CASES[case])\n"
        "    got = native.ops().quantized_matmul(x, wq, s, b, group_size=group_size, bits=bits)\n"
        "    print(_relative_errors(got, x, wq, s, b, group_size, bits), _digest(got))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe, *cases], capture_output=True, text=True,
                            env={**os.environ, **environment}, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


@needs_native
@pytest.mark.parametrize("instruction_set", ["avx512", "avx2", "baseline"])
def test_each_instruction_set_computes_within_the_bound(instruction_set):
    cases = sorted(CASES)
    chosen, *results = _probe({"VELOX_NATIVE_ISA": instruction_set}, cases)
    if chosen != instruction_set:
        pytest.skip(f"this CPU runs {chosen}, not {instruction_set}")
    errors = [float(error) for error in results[0::2]]
    assert all(error <= 1.0 for error in errors), dict(zip(cases, errors))


@needs_native
def test_any_number_of_threads_gives_the_same_bits():
    """A call big enough to share (5 x 300 x 4,096, 4 bits) on 1 and on 3 threads."""
    _, _, on_one = _probe({"VELOX_QUANTIZED_THREADS": "1"}, ["shared-4bit"])
    _, error, on_three = _probe({"VELOX_QUANTIZED_THREADS": "3"}, ["shared-4bit"])
    assert on_one == on_three
    assert float(error) <= 1.0


# ----- the switch and the fallback: these run without the native module too -----------------------------


@pytest.mark.parametrize("switch", [quantized.ENVIRONMENT_VARIABLE, native.ENVIRONMENT_VARIABLE])
def test_either_switch_gives_mlx_quantized_matmul(monkeypatch, switch):
    monkeypatch.setenv(switch, "0")
    assert not quantized.available()
    x, wq, scales, biases = _inputs(3, 40, 96, 4, 32, "float16")
    got = quantized.quantized_matmul(x, wq, scales, biases, group_size=32, bits=4)
    expected = mx.quantized_matmul(x, wq, scales=scales, biases=biases, group_size=32, bits=4)
    assert mx.array_equal(got, expected).item()


@pytest.mark.parametrize("arguments, reason", [
    (dict(bits=3, group_size=32), "bits 3"),
    (dict(bits=6, group_size=64), "bits 6"),
    (dict(bits=4, group_size=32, transpose=False), "transpose"),
])
def test_calls_the_native_matmul_cannot_take_go_to_mlx(arguments, reason):
    bits, group_size = arguments["bits"], arguments["group_size"]
    x = mx.random.normal((2, 128), key=mx.random.key(3))
    w = mx.random.normal((128 if "transpose" in arguments else 40, 128), key=mx.random.key(4))
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    if quantized.available():
        assert reason in quantized.refusal(x, wq, scales, biases, **arguments)
    got = quantized.quantized_matmul(x, wq, scales, biases, **arguments)
    expected = mx.quantized_matmul(x, wq, scales=scales, biases=biases, **arguments)
    assert mx.array_equal(got, expected).item()


def test_other_modes_and_missing_biases_are_refused():
    x = mx.ones((1, 64))
    wq, scales, biases = mx.quantize(mx.ones((8, 64)), group_size=32, bits=4)
    if not quantized.available():
        pytest.skip("the native matmul is not in use: everything goes to MLX")
    assert "mode" in quantized.refusal(x, wq, scales, None, group_size=32, bits=4)
    assert "mode" in quantized.refusal(x, wq, scales, biases, group_size=32, bits=4, mode="mxfp4")
    with mx.stream(mx.cpu):
        assert quantized.refusal(x, wq, scales, biases, group_size=32, bits=4) == ""


# ----- routing a model ---------------------------------------------------------------------------------


def _quantized_tiny(tiny_model_dir):
    from pipeline.model_store import load_model

    model, _ = load_model(str(tiny_model_dir), weights="float32")
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def test_route_changes_the_quantized_layers_and_unroute_gives_them_back(tiny_model_dir):
    model = _quantized_tiny(tiny_model_dir)
    before = {name: type(module) for name, module in model.named_modules()}
    changed = quantized.route(model)
    assert len(changed) == sum(kind in quantized.ROUTED for kind in before.values()) > 0
    assert all(isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for module, _ in changed)
    assert quantized.route(model) == []  # already routed
    quantized.unroute(changed)
    assert {name: type(module) for name, module in model.named_modules()} == before
    with pytest.raises(RuntimeError):
        with quantized.native_quantized(model):
            assert type(model.model.layers[0].mlp.up_proj) is quantized.NativeQuantizedLinear
            raise RuntimeError("inside")
    assert {name: type(module) for name, module in model.named_modules()} == before


@needs_native
def test_a_routed_model_computes_what_mlx_quantized_matmul_does(tiny_model_dir):
    """Logits within the bound's order of MLX's own quantized model, and the same greedy tokens."""
    model = _quantized_tiny(tiny_model_dir)
    prompt = mx.array([[5, 17, 3, 99, 42, 8, 23, 61, 7, 30, 11, 64, 2, 90, 33, 47]])

    def greedy(steps=12):
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        logits = model(prompt, cache=cache)
        first = logits
        tokens = []
        for _ in range(steps):
            token = mx.argmax(logits[:, -1], axis=-1)
            tokens.append(token.item())
            logits = model(token[:, None], cache=cache)
        return first, tokens

    with mx.stream(mx.cpu):
        plain_logits, plain_tokens = greedy()
        with quantized.native_quantized(model):
            routed_logits, routed_tokens = greedy()
    assert routed_tokens == plain_tokens
    scale = mx.abs(plain_logits).max().item()
    assert mx.abs(routed_logits - plain_logits).max().item() <= 1e-4 * scale


def test_a_native_module_built_before_the_quantized_matmul_leaves_it_to_mlx(monkeypatch):
    """A module that loads but lacks the primitive (built from older sources) is not called."""

    class OlderModule:
        def row_max(self, x):
            return x.max(axis=-1, keepdims=True)

    monkeypatch.setattr(native, "ops", lambda: OlderModule())
    assert not quantized.available()
    x, wq, scales, biases = _inputs(2, 40, 96, 4, 32, "float16")
    expected = mx.quantized_matmul(x, wq, scales=scales, biases=biases, group_size=32, bits=4)
    assert mx.array_equal(quantized.quantized_matmul(x, wq, scales, biases, group_size=32, bits=4), expected).item()
