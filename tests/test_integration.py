"""A few checks on the real embedded SmolLM2 with short inputs."""

import mlx_lm
import pytest

import velox_cache
from bench.needle import greedy, make_needle_case
from velox_cache import KVCacheBuilder, KVCacheConfig

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
