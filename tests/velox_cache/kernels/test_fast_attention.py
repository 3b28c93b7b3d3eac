"""``fast_attention``/``observe`` route every attention call through Velox, and put it back."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

import velox_cache
from velox_cache import KVCacheBuilder, KVCacheConfig
from velox_cache.kernels import kernel
from velox_cache.kernels.kernel import blocked_attention
from velox_cache.kernels.observe import _wrap, is_observing

pytestmark = pytest.mark.usefixtures("op_path")  # each test on the native ops and on the pure-MLX ones


def _logits(model, prompt, caches, chunk=32, steps=4):
    outputs = []
    for start in range(0, prompt.size - 1, chunk):
        outputs.append(model(prompt[None, start : min(start + chunk, prompt.size - 1)], cache=caches)[:, -1])
        mx.eval([c.state for c in caches])
    token = prompt[-1:]
    for _ in range(steps):
        logits = model(token[None], cache=caches)[:, -1]
        outputs.append(logits)
        token = mx.argmax(logits, axis=-1)
    return outputs


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return blocked_attention(*args, **kwargs)

    monkeypatch.setattr(kernel, "blocked_attention", counting)
    return calls


@pytest.mark.parametrize("context", ["fast_attention", "observe"])
@pytest.mark.parametrize("cache", ["plain", "full"])
def test_plain_caches_run_on_the_kernel(tiny_model, kernel_calls, context, cache):
    model, tokenizer = tiny_model
    prompt = mx.array(tokenizer.encode("Plain caches get the fast kernel too. " * 3))
    expected = _logits(model, prompt, [KVCache() for _ in model.layers])
    assert not kernel_calls
    caches = [KVCache() for _ in model.layers] if cache == "plain" else KVCacheBuilder.for_model(
        model, KVCacheConfig(method="full")
    )
    with getattr(velox_cache, context)(model):
        got = _logits(model, prompt, caches)
    assert {shape[2] for shape in kernel_calls} >= {32, 1}, "prefill chunks and decode steps"
    assert all(mx.allclose(a, b, atol=1e-4, rtol=1e-4).item() for a, b in zip(expected, got))


@pytest.mark.parametrize("cache", ["plain", "full"])
def test_exact_mode_is_the_fused_kernel_bit_for_bit(tiny_model, kernel_calls, monkeypatch, cache):
    monkeypatch.setenv("VELOX_ATTENTION", "exact")
    model, tokenizer = tiny_model
    prompt = mx.array(tokenizer.encode("Bit for bit, please. " * 4))
    expected = _logits(model, prompt, [KVCache() for _ in model.layers])
    caches = [KVCache() for _ in model.layers] if cache == "plain" else KVCacheBuilder.for_model(
        model, KVCacheConfig(method="full")
    )
    with velox_cache.fast_attention(model):
        got = _logits(model, prompt, caches)
    assert not kernel_calls
    assert all(mx.array_equal(a, b).item() for a, b in zip(expected, got))


def test_fast_attention_restores_the_model_even_on_error(tiny_model):
    import mlx_lm.models.llama as llama

    model, _ = tiny_model
    original = llama.scaled_dot_product_attention
    with pytest.raises(ZeroDivisionError):
        with velox_cache.fast_attention(model):
            assert llama.scaled_dot_product_attention is not original
            assert not is_observing(), "fast_attention alone does not switch caches to observed scoring"
            with velox_cache.observe(model):
                assert is_observing()
                1 / 0
    assert llama.scaled_dot_product_attention is original
    assert not is_observing()


def test_sinks_and_quantized_caches_keep_the_original_attention():
    seen = []

    def original(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
        seen.append((cache, sinks))
        return "original"

    class QuantizedCache:
        bits, group_size = 8, 64

    attention = _wrap(original)
    q = mx.zeros((1, 2, 1, 8))
    assert attention(q, q[:, :1], q[:, :1], cache=QuantizedCache(), scale=1.0) == "original"
    assert attention(q, q[:, :1], q[:, :1], cache=None, scale=1.0, sinks=mx.zeros((2,))) == "original"
    assert attention(q, q[:, :1], q[:, :1], cache=None, scale=1.0).shape == q.shape
    assert len(seen) == 2
