"""``feed_together``: stacks fed their own tokens in one batched call predict what each predicts alone."""

import mlx.core as mx
import pytest

import velox_cache
from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases, snapshot
from velox_cache.generation.batching import BatchUnsupported
from velox_cache.generation.forcing import feed_together

CONFIGS = [  # policies, budgets, prompt lengths and fed lengths that differ row by row
    (KVCacheConfig(method="pyramidkv", budget=24, scoring="observed"), 70, 9),
    (KVCacheConfig(method="squeeze", budget=16, scoring="observed"), 45, 3),
    (KVCacheConfig(method="snapkv", budget=24, scoring="observed"), 18, 6),  # below its budget
    (KVCacheConfig(method="full"), 30, 1),
]


def _tokens(length, seed):
    return mx.random.randint(3, 200, (length,), key=mx.random.key(seed)).tolist()


def _prefilled(model, config, length, seed):
    tokens = _tokens(length, seed)
    caches = KVCacheBuilder.for_model(model, config, prompt_tokens=length)
    with velox_cache.observe(model):
        prefill_phases(model, caches, document=tokens[:-6], instruction=tokens[-6:], chunk_size=16, max_new_tokens=12)
    return caches


@pytest.mark.parametrize("attention", ["fast", "exact"])
def test_each_row_predicts_what_its_stack_predicts_alone(tiny_model, monkeypatch, attention):
    monkeypatch.setenv("VELOX_ATTENTION", attention)
    model, _ = tiny_model
    stacks = [_prefilled(model, config, length, i) for i, (config, length, _) in enumerate(CONFIGS)]
    sequences = [_tokens(fed, 100 + i) for i, (_, _, fed) in enumerate(CONFIGS)]
    with velox_cache.observe(model):
        alone = [model(mx.array([tokens]), cache=snapshot(stack))[0] for stack, tokens in zip(stacks, sequences)]
        together = feed_together(model, [snapshot(stack) for stack in stacks], sequences)
    for one, batched, tokens in zip(alone, together, sequences):
        assert batched.shape == (len(tokens), one.shape[-1])
        assert mx.allclose(one, batched, atol=1e-4, rtol=1e-4).item()
        assert mx.array_equal(mx.argmax(one, axis=-1), mx.argmax(batched, axis=-1)).item()


def test_feeding_needs_routed_attention_and_tokens(tiny_model):
    model, _ = tiny_model
    stack = _prefilled(model, CONFIGS[0][0], 40, 0)
    with pytest.raises(BatchUnsupported, match="routed"):
        feed_together(model, [snapshot(stack)], [[5, 6]])
    with velox_cache.observe(model), pytest.raises(ValueError, match="sequences"):
        feed_together(model, [snapshot(stack)], [[]])
