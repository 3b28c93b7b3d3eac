"""Batched decoding: B prefilled stacks decode together and leave what decoding each alone leaves."""


import mlx.core as mx
import pytest

import velox_cache
from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases, snapshot
from velox_cache.cache.accounting import layer_stats
from velox_cache.generation.batching import BatchedLayer, BatchUnsupported
from velox_cache.generation.decode import DecodeRow, decode_rows
from velox_cache.generation.sampling import TokenSampler

from tests.velox_cache.policies import POLICY_CONFIGS, POLICY_TABLE, SCORINGS

LENGTHS = (70, 45, 18)  # the last row stays below a budget of 24
MAX_TOKENS = (9, 4, 7)  # one row stops early


def _prompt(length: int, seed: int) -> list[int]:
    return mx.random.randint(3, 200, (length,), key=mx.random.key(seed)).tolist()


def _routing(model, config: KVCacheConfig):
    if config.method != "full" and config.scoring == "observed":
        return velox_cache.observe(model)
    return velox_cache.fast_attention(model)


def _row(model, tokens, config, max_tokens, eos=(), **sampling) -> DecodeRow:
    caches = KVCacheBuilder.for_model(model, config, prompt_tokens=len(tokens))
    with _routing(model, config):
        logits = prefill_phases(
            model, caches, document=tokens[:-6], instruction=tokens[-6:], chunk_size=16, max_new_tokens=max_tokens
        )
    sampler = TokenSampler(tokens, **sampling)
    return DecodeRow(caches, sampler, sampler.logprobs(logits), max_tokens, frozenset(eos))


def _decode(model, configs, *, batch, pipelined=True, eos=None, **sampling):
    rows = [
        _row(model, _prompt(length, i), config, limit, (eos or {}).get(i, ()), seed=i, **sampling)
        for i, (length, limit, config) in enumerate(zip(LENGTHS, MAX_TOKENS, configs))
    ]
    with _routing(model, configs[0]):
        decode_rows(model, rows, batch=batch, pipelined=pipelined)
    return rows


def _stats(row):
    return [layer_stats(i, cache) for i, cache in enumerate(row.caches)]


def _assert_same(alone, together):
    for one, batched in zip(alone, together):
        assert batched.tokens == one.tokens
        assert batched.stop_reason == one.stop_reason
        assert batched.token_logprobs == pytest.approx(one.token_logprobs, abs=1e-4)
        assert _stats(batched) == _stats(one)
        for a, b in zip(one.caches, batched.caches):
            if hasattr(a, "slots"):
                assert a.slots.capacity == b.slots.capacity
                assert mx.array_equal(a.positions, b.positions).item()
                assert mx.allclose(a.keys, b.keys, atol=1e-4).item()
                assert mx.allclose(a.scores, b.scores, atol=1e-4).item()
            else:
                assert a.keys.shape == b.keys.shape and mx.allclose(a.keys, b.keys, atol=1e-4).item()


def _configs(fields, scoring):
    return [KVCacheConfig(**{**fields, "budget": 24, "scoring": scoring}) for _ in LENGTHS]


@pytest.mark.parametrize("attention", ["fast", "exact"])
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("policy", [name for name, _ in POLICY_TABLE])
def test_batched_greedy_decoding_equals_one_at_a_time(tiny_model, policy, scoring, attention, monkeypatch):
    monkeypatch.setenv("VELOX_ATTENTION", attention)
    model, _ = tiny_model
    configs = _configs(POLICY_CONFIGS[policy], scoring)
    alone = _decode(model, configs, batch=False, pipelined=False)  # today's loop, one step at a time
    together = _decode(model, configs, batch=True)
    assert max(row.batch_size for row in together) == len(LENGTHS)
    _assert_same(alone, together)


@pytest.mark.parametrize("batch", [False, True])
def test_greedy_rows_take_the_tokens_and_logprobs_the_log_softmax_gives(tiny_model, batch, monkeypatch):
    """Plain greedy rows pick with ``greedy_choice`` (native where built): the very bits of argmax(log_softmax)."""
    model, _ = tiny_model
    configs = _configs(POLICY_CONFIGS["pyramidkv"], "observed")
    chosen = _decode(model, configs, batch=batch)
    monkeypatch.setattr(TokenSampler, "plain_greedy", property(lambda sampler: False))  # log-softmax, then argmax
    sampled = _decode(model, configs, batch=batch)
    for one, other in zip(chosen, sampled):
        assert one.tokens == other.tokens and one.stop_reason == other.stop_reason
        assert one.token_logprobs == other.token_logprobs


def test_mixed_squeeze_and_pyramid_rows_and_a_row_stopping_at_eos(tiny_model):
    model, _ = tiny_model
    configs = [
        KVCacheConfig(method="squeeze", budget=24, scoring="observed"),
        KVCacheConfig(method="pyramidkv", budget=24, scoring="observed"),
        KVCacheConfig(method="squeeze", budget=16, scoring="observed"),
    ]
    first = _decode(model, configs, batch=False)
    eos = {0: (first[0].tokens[2],)}  # row 0 stops at its third token
    alone = _decode(model, configs, batch=False, pipelined=False, eos=eos)
    assert alone[0].stop_reason == "eos"
    _assert_same(alone, _decode(model, configs, batch=True, eos=eos))
    _assert_same(alone, _decode(model, configs, batch=True, pipelined=False, eos=eos))


@pytest.mark.parametrize("batch", [False, True])
def test_pipelined_decoding_never_feeds_a_cache_the_eos_it_stopped_at(tiny_model, batch):
    model, _ = tiny_model
    configs = [KVCacheConfig(method=method, budget=24, scoring="observed") for method in ("pyramidkv", "full", "h2o")]
    first = _decode(model, configs, batch=False, pipelined=False)
    eos = {0: (first[0].tokens[3],), 1: (first[1].tokens[1],)}  # rows 0 and 1 stop at EOS, at different steps
    unpipelined = _decode(model, configs, batch=batch, pipelined=False, eos=eos)
    pipelined = _decode(model, configs, batch=batch, pipelined=True, eos=eos)
    assert [row.stop_reason for row in pipelined] == ["eos", "eos", "max_tokens"]
    _assert_same(unpipelined, pipelined)
    for length, row in zip(LENGTHS, pipelined):  # every generated token was fed but the last one at max_tokens
        fed = len(row.tokens) - (row.stop_reason == "max_tokens")
        offsets = {cache.offset for cache in row.caches}
        assert offsets == {length + fed}


def test_full_rows_batch_and_grow_as_mlx_lm_caches_do(tiny_model):
    model, _ = tiny_model
    configs = [KVCacheConfig(method="full") for _ in LENGTHS]
    _assert_same(_decode(model, configs, batch=False), _decode(model, configs, batch=True))


def test_sampled_rows_draw_the_same_tokens_in_a_batch(tiny_model):
    model, _ = tiny_model
    configs = _configs(POLICY_CONFIGS["pyramidkv"], "observed")
    settings = dict(temperature=0.8, top_k=20, repetition_penalty=1.2)
    alone = _decode(model, configs, batch=False, **settings)
    _assert_same(alone, _decode(model, configs, batch=True, **settings))
    assert len({tuple(row.tokens) for row in alone}) > 1


def test_a_cache_still_in_prefill_cannot_batch(tiny_model):
    model, _ = tiny_model
    config = KVCacheConfig(method="pyramidkv", budget=24)
    caches = KVCacheBuilder.for_model(model, config, prompt_tokens=40)
    with velox_cache.fast_attention(model):
        model(mx.array([_prompt(40, 0)]), cache=caches)
    with pytest.raises(BatchUnsupported, match="prefill"):
        BatchedLayer([caches[0], caches[0]])


def test_unrouted_batches_decode_alone_with_the_same_tokens(tiny_model):
    model, _ = tiny_model
    configs = _configs(POLICY_CONFIGS["h2o"], "key_proxy")
    alone = _decode(model, configs, batch=False)
    rows = [_row(model, _prompt(n, i), c, m, seed=i) for i, (n, m, c) in enumerate(zip(LENGTHS, MAX_TOKENS, configs))]
    decode_rows(model, rows, batch=True)  # no routing context: the batch cannot mask its padding
    assert all(row.batch_size == 1 for row in rows)
    _assert_same(alone, rows)


def test_prefill_end_snapshot_is_untouched_by_batched_decoding(tiny_model):
    model, _ = tiny_model
    configs = _configs(POLICY_CONFIGS["snapkv"], "observed")
    rows = [_row(model, _prompt(n, i), c, m, seed=i) for i, (n, m, c) in enumerate(zip(LENGTHS, MAX_TOKENS, configs))]
    kept = [snapshot(row.caches) for row in rows]
    before = [[mx.array(c.keys) for c in stack] for stack in kept]
    with velox_cache.observe(model):
        decode_rows(model, rows, batch=True)
    for stack, keys in zip(kept, before):
        assert all(mx.array_equal(c.keys, k).item() for c, k in zip(stack, keys))


@pytest.mark.parametrize("config", [KVCacheConfig(method="squeeze", budget=24), KVCacheConfig(method="full")])
def test_batch_generate_gives_each_prompt_what_it_gets_alone(tiny_model, config):
    model, tokenizer = tiny_model
    prompts = [_prompt(n, i) for i, n in enumerate(LENGTHS)] + ["a short text prompt"]
    options = dict(max_tokens=6, prefill_step_size=16, temperature=0.7, seeds=[1, 2, 3, 4])
    alone = velox_cache.batch_generate(model, tokenizer, prompts, config, batch_size=1, **options)
    together = velox_cache.batch_generate(model, tokenizer, prompts, config, batch_size=3, **options)
    assert together.texts == alone.texts and together.token_ids == alone.token_ids
    assert alone.batch_sizes == [1] * 4 and together.batch_sizes[:3] == [3, 3, 3]
    assert all(len(ids) == 6 for ids, reason in zip(alone.token_ids, alone.stop_reasons) if reason == "max_tokens")


def test_batch_generate_names_a_bad_argument(tiny_model):
    model, tokenizer = tiny_model
    with pytest.raises(ValueError, match="seeds"):
        velox_cache.batch_generate(model, tokenizer, [[5, 6]], KVCacheConfig(method="h2o"), seeds=[1, 2])
    with pytest.raises(ValueError, match="prompts\\[1\\]"):
        velox_cache.batch_generate(model, tokenizer, [[5, 6], []], KVCacheConfig(method="h2o"))


def test_a_batch_refuses_multi_token_calls_and_trimming(tiny_model):
    model, _ = tiny_model
    rows = [_row(model, _prompt(n, i), KVCacheConfig(method="h2o", budget=24), 3) for i, n in enumerate(LENGTHS)]
    layer = BatchedLayer([row.caches[0] for row in rows])
    assert not layer.is_trimmable()
    with pytest.raises(BatchUnsupported, match="one token per row"):
        layer.make_mask(3)
    keys = mx.zeros((len(rows), layer.keys.shape[1], 2, layer.keys.shape[3]))
    with velox_cache.fast_attention(model), pytest.raises(BatchUnsupported, match="one token per row"):
        layer.update_and_fetch(keys, keys)


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_batch_that_cannot_go_on_after_some_steps_leaves_every_row_where_decoding_alone_would(
    tiny_model, monkeypatch, pipelined
):
    """A ``BatchUnsupported`` in a later step (in a middle layer): the rows go on alone, nothing out of step."""
    model, _ = tiny_model
    configs = _configs(POLICY_CONFIGS["pyramidkv"], "observed")
    alone = _decode(model, configs, batch=False)
    original, calls = BatchedLayer.update_and_fetch, {"n": 0}

    def failing_on_the_third_step(self, keys, values):
        if self.layer == 1:
            calls["n"] += 1
            if calls["n"] == 3:
                raise BatchUnsupported("injected: this step cannot batch")
        return original(self, keys, values)

    monkeypatch.setattr(BatchedLayer, "update_and_fetch", failing_on_the_third_step)
    together = _decode(model, configs, batch=True, pipelined=pipelined)
    assert calls["n"] == 3, "the batch ran two steps, then the rows went on alone"
    _assert_same(alone, together)
