"""Rows with per-head budgets (``head_budgets='adaptive'``) decode in a batch and leave what decoding alone leaves."""

import mlx.core as mx
import pytest

import velox_cache
from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases, snapshot
from velox_cache.cache.accounting import layer_stats
from velox_cache.generation.batching import BatchedLayer
from velox_cache.generation.decode import DecodeRow, decode_rows
from velox_cache.generation.forcing import feed_together
from velox_cache.generation.sampling import TokenSampler


def _adaptive(method: str, budget: int = 24, **fields) -> KVCacheConfig:
    return KVCacheConfig(method=method, budget=budget, scoring="observed", head_budgets="adaptive", **fields)


def _uniform(method: str, budget: int = 24) -> KVCacheConfig:
    return KVCacheConfig(method=method, budget=budget, scoring="observed")


FULL = KVCacheConfig(method="full")

# (config, prompt length, max tokens): policies, budgets, prompt lengths and stops that differ row by row
BATCHES = {
    "adaptive": [
        (_adaptive("pyramidkv"), 70, 9),
        (_adaptive("squeeze"), 45, 4),
        (_adaptive("snapkv"), 58, 7),
        (_adaptive("pyramidkv", budget=16, head_floor=0.0), 33, 12),  # floor 0: some heads hold very few
    ],
    "mixed": [
        (_adaptive("squeeze"), 70, 9),
        (_uniform("pyramidkv"), 45, 5),
        (FULL, 30, 7),
        (_adaptive("snapkv"), 52, 11),
        (_uniform("snapkv", budget=16), 40, 3),
    ],
    "below-budget": [  # a row that appends (per head) before it reaches its budget, beside ones at budget
        (_adaptive("snapkv", budget=24), 18, 12),
        (_adaptive("pyramidkv"), 64, 8),
        (_uniform("h2o"), 20, 10),
    ],
}


def _prompt(length: int, seed: int) -> list[int]:
    return mx.random.randint(3, 200, (length,), key=mx.random.key(seed)).tolist()


def _row(model, tokens, config, max_tokens, eos=(), **sampling) -> DecodeRow:
    caches = KVCacheBuilder.for_model(model, config, prompt_tokens=len(tokens))
    with velox_cache.observe(model):
        logits = prefill_phases(
            model, caches, document=tokens[:-6], instruction=tokens[-6:], chunk_size=16, max_new_tokens=max_tokens
        )
    sampler = TokenSampler(tokens, **sampling)
    return DecodeRow(caches, sampler, sampler.logprobs(logits), max_tokens, frozenset(eos))


def _decode(model, batch_rows, *, batch, pipelined=True, eos=None, **sampling):
    rows = [
        _row(model, _prompt(length, i), config, limit, (eos or {}).get(i, ()), seed=i, **sampling)
        for i, (config, length, limit) in enumerate(batch_rows)
    ]
    with velox_cache.observe(model):
        decode_rows(model, rows, batch=batch, pipelined=pipelined)
    return rows


def _assert_same(alone, together):
    for one, batched in zip(alone, together):
        assert batched.tokens == one.tokens
        assert batched.stop_reason == one.stop_reason
        assert batched.token_logprobs == pytest.approx(one.token_logprobs, abs=1e-4)
        assert [layer_stats(i, c) for i, c in enumerate(batched.caches)] == [
            layer_stats(i, c) for i, c in enumerate(one.caches)
        ]
        for a, b in zip(one.caches, batched.caches):
            if not hasattr(a, "slots"):
                assert a.keys.shape == b.keys.shape and mx.allclose(a.keys, b.keys, atol=1e-4).item()
                continue
            assert a.slots.heads_pooled == b.slots.heads_pooled
            assert (a.slots.stored, a.slots.offset, a.slots.tokens_seen) == (b.slots.stored, b.slots.offset, b.slots.tokens_seen)
            assert a.slots.capacity == b.slots.capacity
            assert mx.array_equal(a.positions, b.positions).item()
            assert mx.allclose(a.keys, b.keys, atol=1e-4).item()
            assert mx.allclose(a.values, b.values, atol=1e-4).item()
            assert mx.allclose(a.scores, b.scores, atol=1e-4).item()
            if a.slots.heads_pooled:
                assert mx.array_equal(a.slots.heads, b.slots.heads).item()
                assert a.slots.head_counts() == b.slots.head_counts()


def _pooled_layers(rows) -> int:
    return sum(cache.slots.heads_pooled for row in rows for cache in row.caches if hasattr(cache, "slots"))


@pytest.mark.parametrize("attention", ["fast", "exact"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_adaptive_rows_decode_together_as_alone(tiny_model, monkeypatch, name, attention):
    monkeypatch.setenv("VELOX_ATTENTION", attention)
    model, _ = tiny_model
    alone = _decode(model, BATCHES[name], batch=False, pipelined=False)
    together = _decode(model, BATCHES[name], batch=True)
    assert _pooled_layers(together) > 0
    assert max(row.batch_size for row in together) == len(BATCHES[name])
    _assert_same(alone, together)


def test_adaptive_rows_unequal_across_heads_in_the_batch(tiny_model):
    """The pinned case is real: some pooled layer's heads hold unequal counts when the batch forms."""
    model, _ = tiny_model
    rows = [_row(model, _prompt(n, i), c, m, seed=i) for i, (c, n, m) in enumerate(BATCHES["adaptive"])]
    counts = [cache.slots.head_counts() for row in rows for cache in row.caches if cache.slots.heads_pooled]
    assert any(len(set(per_head)) > 1 for per_head in counts)
    layer = BatchedLayer([row.caches[0] for row in rows])
    assert layer.counts.head_stored.tolist() == [row.caches[0].slots.head_counts() for row in rows]


def test_sampled_adaptive_rows_draw_the_same_tokens_in_a_batch(tiny_model):
    model, _ = tiny_model
    settings = dict(temperature=0.8, top_k=20, repetition_penalty=1.2)
    alone = _decode(model, BATCHES["mixed"], batch=False, pipelined=False, **settings)
    _assert_same(alone, _decode(model, BATCHES["mixed"], batch=True, **settings))
    assert len({tuple(row.tokens) for row in alone}) > 1


@pytest.mark.parametrize("pipelined", [True, False])
def test_adaptive_rows_stopping_at_eos_leave_what_alone_leaves(tiny_model, pipelined):
    model, _ = tiny_model
    first = _decode(model, BATCHES["mixed"], batch=False, pipelined=False)
    eos = {0: (first[0].tokens[2],), 3: (first[3].tokens[5],)}  # two adaptive rows stop at EOS, at different steps
    alone = _decode(model, BATCHES["mixed"], batch=False, pipelined=False, eos=eos)
    assert alone[0].stop_reason == "eos" and alone[3].stop_reason == "eos"
    _assert_same(alone, _decode(model, BATCHES["mixed"], batch=True, pipelined=pipelined, eos=eos))


def test_adaptive_rows_decode_on_alone_after_batching(tiny_model):
    """What ``extract`` writes back is a working cache: decoding on alone from it continues as before."""
    model, _ = tiny_model
    spec = BATCHES["adaptive"][:2]
    alone = _decode(model, [(c, n, m + 4) for c, n, m in spec], batch=False, pipelined=False)
    rows = _decode(model, spec, batch=True)
    for row in rows:
        row.max_tokens += 4
        row.stop_reason = None
        row.pending = row.tokens[-1]
        row.sampler.accept(row.tokens[-1])
    with velox_cache.observe(model):
        decode_rows(model, rows, batch=False, pipelined=False)
    _assert_same(alone, rows)


# Tokens fed to each row of BATCHES["mixed"]: at least two for an evicting row (a single token fed alone to a
# cache at its budget takes an evicted token's slot before attention; ``feed_together`` evicts nothing).
FED = (9, 3, 6, 2, 4)


def test_adaptive_stacks_are_fed_together_as_alone(tiny_model):
    model, _ = tiny_model
    stacks = [_row(model, _prompt(n, i), c, 12).caches for i, (c, n, _) in enumerate(BATCHES["mixed"])]
    sequences = [_prompt(fed, 100 + i) for i, fed in enumerate(FED)]
    with velox_cache.observe(model):
        alone = [model(mx.array([tokens]), cache=snapshot(stack))[0] for stack, tokens in zip(stacks, sequences)]
        together = feed_together(model, [snapshot(stack) for stack in stacks], sequences)
    for one, batched in zip(alone, together):
        assert mx.allclose(one, batched, atol=1e-4, rtol=1e-4).item()
        assert mx.array_equal(mx.argmax(one, axis=-1), mx.argmax(batched, axis=-1)).item()
