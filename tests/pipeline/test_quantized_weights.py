"""The embedded model as it ships: its GGUF blocks are MLX quantized weights, with no loss.

The float32 weights Velox loads are exactly ggml's dequantization of the GGUF's
blocks (read here with numpy alone, ``gguf_blocks``); the quantized weights
(``VELOX_WEIGHTS=quantized``) are MLX's affine layout at ``group_size=32``
(Q4_1: 4 bits with the minimum as bias; Q8_0: 8 bits) and dequantize to the
same float32 values; on the CPU their layers run Velox's native matmul, and
greedy decoding gives the float32 weights' tokens.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from pipeline import model_import, model_store
from tests.pipeline import gguf_blocks
from velox_cache.kernels import quantized

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]


@pytest.fixture(scope="module")
def gguf_tensors():
    path = model_store.embedded_gguf_path()
    return {model_import.mlx_name(name): entry for name, entry in gguf_blocks.tensors(path).items()}


@pytest.fixture(scope="module")
def float32_model():
    return model_store.load_model(weights="float32")


@pytest.fixture(scope="module")
def quantized_model():
    return model_store.load_model(weights="quantized")


def test_the_float32_weights_are_ggmls_dequantization_of_every_block(gguf_tensors, float32_model):
    parameters = dict(tree_flatten(float32_model[0].parameters()))
    kinds = {}
    for name, (kind, shape, data) in gguf_tensors.items():
        expected = gguf_blocks.dequantized(kind, shape, data)
        got = parameters[name]
        assert got.dtype == mx.float32, name
        assert np.array_equal(np.array(got), expected), name
        kinds[kind] = kinds.get(kind, 0) + 1
    assert kinds[gguf_blocks.Q4_1] == 30 * 7 and kinds[gguf_blocks.Q8_0] == 1  # every linear layer, the embedding


def test_the_quantized_weights_are_mlx_affine_groups_of_32_that_dequantize_to_the_float32_weights(
    float32_model, quantized_model
):
    float32 = dict(tree_flatten(float32_model[0].parameters()))
    layers = [(name, module) for name, module in quantized_model[0].named_modules()
              if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    assert len(layers) == 30 * 7 + 1
    for name, layer in layers:
        assert (layer.mode, layer.group_size, layer.bits) == ("affine", 32, 8 if "embed" in name else 4), name
        assert layer.scales.dtype == layer.biases.dtype == mx.float16, name
        weights = mx.dequantize(layer.weight, layer.scales.astype(mx.float32), layer.biases.astype(mx.float32),
                                group_size=32, bits=layer.bits)
        assert mx.array_equal(weights, float32[f"{name}.weight"]).item(), name
        if mx.default_device() == mx.cpu:
            assert type(layer) in (quantized.NativeQuantizedLinear, quantized.NativeQuantizedEmbedding), name


def test_the_quantized_embedding_gives_the_float32_rows(float32_model, quantized_model):
    tokens = mx.array([[1, 2, 400, 49151, 17]])
    assert mx.array_equal(quantized_model[0].model.embed_tokens(tokens), float32_model[0].model.embed_tokens(tokens)).item()


def _greedy(model, tokenizer, prompt: str, max_tokens: int = 24) -> list[int]:
    from mlx_lm.generate import generate_step

    messages = [{"role": "user", "content": prompt}]
    tokens = mx.array(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return [int(token) for token, _ in generate_step(tokens, model, max_tokens=max_tokens)]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_on_quantized_weights_equal_the_float32_weights(float32_model, quantized_model, prompt):
    model, tokenizer = float32_model
    expected = _greedy(model, tokenizer, prompt)
    assert _greedy(quantized_model[0], tokenizer, prompt) == expected


def test_one_row_pipelines_its_steps_on_quantized_weights_and_not_on_float32(float32_model, quantized_model, monkeypatch):
    """A 4-bit step is short on the CPU: building the next while it computes pays (bench/RESULTS.md, "Pipelined
    decode"); with float32 weights it does not. The tokens are the same either way."""
    import velox_cache
    from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases
    from velox_cache.generation import decode
    from velox_cache.generation.sampling import TokenSampler

    chosen = []
    alone = decode.decode_alone

    def recording(model, row, pipelined):
        chosen.append(pipelined)
        return alone(model, row, pipelined=pipelined)

    monkeypatch.setattr(decode, "decode_alone", recording)
    tokens = {}
    for name, (model, tokenizer) in (("float32", float32_model), ("quantized", quantized_model)):
        prompt = tokenizer.encode("The capital of France is")
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="full"))
        with velox_cache.fast_attention(model):
            logits = prefill_phases(model, caches, document=prompt)
            sampler = TokenSampler(prompt)
            row = decode.DecodeRow(caches, sampler, sampler.logprobs(logits), max_tokens=8)
            decode.decode_rows(model, [row])
        tokens[name] = row.tokens
    assert [decode.has_quantized_layers(m) for m, _ in (float32_model, quantized_model)] == [False, True]
    assert chosen == [mx.default_device() == mx.gpu, True] and tokens["quantized"] == tokens["float32"]
