"""A few checks on the real embedded SmolLM2 with short inputs."""

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

import velox_cache
from bench.needle import greedy, make_needle_case
from velox_cache import KVCacheBuilder, KVCacheConfig
from velox_cache.kernels import kernel
from velox_cache.kernels.kernel import blocked_attention

pytestmark = pytest.mark.integration


def test_stream_generate_with_chunked_prefill_on_smollm2(smollm2):
    model, tokenizer = smollm2
    content = "Python lists are mutable sequences. " * 30 + "\nWhat are Python lists?"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="pyramidkv", budget=96))
    with velox_cache.observe(model):
        responses = list(
            mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=8, prompt_cache=caches, prefill_step_size=64)
        )
    assert len(prompt) > 200 and responses[-1].generation_tokens >= 1
    assert [c.layer_budget for c in caches] == velox_cache.pyramid_budgets(30, 96, 4, 3.0)
    assert all(c.tokens_kept <= c.layer_budget for c in caches)
    assert "".join(r.text for r in responses).strip()


def test_snapkv_keeps_the_needle_at_half_the_prompt(smollm2):
    model, tokenizer = smollm2
    case = make_needle_case(tokenizer, seed=3, n_tokens=500, depth=0.4)
    prompt = tokenizer.apply_chat_template(case.messages, add_generation_prompt=True)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="snapkv", budget=len(prompt) // 2))
    answer = tokenizer.decode(greedy(model, prompt, caches, "observed", max_tokens=24))
    assert case.code in answer
    assert all(c.tokens_kept <= len(prompt) // 2 for c in caches)


def _greedy(model, prompt, caches, max_tokens=16):
    steps = generate_step(prompt, model, max_tokens=max_tokens, prompt_cache=caches, prefill_step_size=32)
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize(
    "content",
    [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in two sentences what a Python list is.",
    ],
)
def test_full_cache_on_velox_attention_generates_what_plain_mlx_lm_does(smollm2, content, monkeypatch):
    """Greedy output of Velox's `full` cache on the CPU kernel equals plain mlx-lm's, token for token."""
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    expected = _greedy(model, mx.array(prompt), None)
    calls = []
    monkeypatch.setattr(kernel, "blocked_attention", lambda *a, **k: calls.append(1) or blocked_attention(*a, **k))
    with velox_cache.fast_attention(model):
        got = _greedy(model, mx.array(prompt), KVCacheBuilder.for_model(model, KVCacheConfig(method="full")))
    assert calls, "the kernel ran"
    assert got == expected


def test_streaming_pyramidkv_keeps_the_needle_read_chunk_by_chunk(smollm2):
    from bench.streaming import split_prompt
    from velox_cache import prefill_phases

    model, tokenizer = smollm2
    case = make_needle_case(tokenizer, seed=3, n_tokens=600, depth=0.3)
    prompt = split_prompt(tokenizer, case.document, case.question)
    config = KVCacheConfig(method="pyramidkv", budget=160, eviction="streaming")
    caches = KVCacheBuilder.for_model(model, config)
    probes = []
    with velox_cache.observe(model):
        logits = prefill_phases(model, caches, prefix=prompt.prefix, document=prompt.document,
                                instruction=prompt.instruction, chunk_size=128,
                                after_call=lambda event, stack: probes.append(event == "probe"))
        answer = greedy_continue(model, logits, caches, tokenizer, max_tokens=16)
    assert sum(probes) >= 4, "the document was read in chunks, each ranked by the probe"
    assert case.code in answer
    assert all(c.tokens_kept <= c.layer_budget for c in caches)


def greedy_continue(model, logits, caches, tokenizer, max_tokens):
    out = []
    token = mx.argmax(logits, axis=-1)
    while len(out) < max_tokens and token.item() not in tokenizer.eos_token_ids:
        out.append(token.item())
        token = mx.argmax(model(token[None], cache=caches)[:, -1], axis=-1)
    return tokenizer.decode(out)
