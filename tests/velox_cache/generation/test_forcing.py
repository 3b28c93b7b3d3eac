"""``feed_together``: stacks fed their own tokens in one batched call predict what each predicts alone."""

import mlx.core as mx
import pytest

import velox_cache
from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases, snapshot
from velox_cache.generation.batching import BatchUnsupported
from velox_cache.generation.forcing import feed_together, first_alike

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


def test_rows_alike_are_fed_once_and_predict_the_same(tiny_model):
    """Stacks holding the same tokens, fed the same tokens, take one row of the call (a frontier's keep-all points)."""
    model, _ = tiny_model
    config = KVCacheConfig(method="pyramidkv", budget=64, scoring="observed")  # keeps all 30 tokens
    stack = _prefilled(model, config, 30, 0)
    other_prompt = _prefilled(model, config, 30, 1)  # the same counts, other keys and values
    full = _prefilled(model, KVCacheConfig(method="full"), 30, 0)  # the same tokens held by a full cache
    fed = _tokens(5, 7)
    calls = []

    def counting(tokens, cache):
        calls.append(tokens.shape[0])
        return model(tokens, cache=cache)

    with velox_cache.observe(model):
        together = feed_together(counting, [snapshot(s) for s in (stack, other_prompt, stack, full)], [fed] * 4)
        alone = model(mx.array([fed]), cache=snapshot(stack))[0]
        other_alone = model(mx.array([fed]), cache=snapshot(other_prompt))[0]
    assert calls == [2]  # stack, full and stack again hold the same: one row; other_prompt its own
    assert mx.array_equal(together[0], together[2]).item() and mx.array_equal(together[0], together[3]).item()
    assert mx.allclose(together[0], alone, atol=1e-4, rtol=1e-4).item()
    assert mx.allclose(together[1], other_alone, atol=1e-4, rtol=1e-4).item()
    assert not mx.allclose(together[0], together[1], atol=1e-4, rtol=1e-4).item()


def test_rows_fed_other_tokens_or_holding_other_counts_are_not_alike(tiny_model):
    model, _ = tiny_model
    keep_all = KVCacheConfig(method="pyramidkv", budget=64, scoring="observed")
    evicting = KVCacheConfig(method="pyramidkv", budget=16, scoring="observed")
    stacks = [_prefilled(model, keep_all, 40, 0), _prefilled(model, keep_all, 40, 0), _prefilled(model, evicting, 40, 0)]
    assert first_alike(stacks, [[5, 6], [5, 7], [5, 6]]) == [0, 1, 2]
    assert first_alike(stacks, [[5, 6]] * 3) == [0, 0, 2]
