"""The ARCHITECTURE.md invariants, parametrised over every policy and both scorings."""

import contextlib

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

import velox_cache
from velox_cache import KVCacheBuilder, KVCacheConfig, KVCacheFactory, Phase
from velox_cache.policies import POLICIES

from tests.velox_cache.policies import (
    EVICTING,
    EVICTING_METHODS,
    POLICY_CONFIGS,
    SCORINGS,
    STREAMING_METHODS,
)

B, H, GROUP, D = 1, 2, 2, 16


def test_every_policy_has_a_row():
    assert set(EVICTING_METHODS) == set(POLICIES) - {"full"}, "add the new policy to tests/velox_cache/policies.py"


def _scored(cache, keys, values, scoring):
    """One attention call the way an mlx-lm model makes it (plus the observer when observed)."""
    n_new = keys.shape[2]
    mask = cache.make_mask(n_new, return_array=True)
    out_keys, out_values = cache.update_and_fetch(keys, values)
    if mask is not None:
        assert mask.shape[-1] == out_keys.shape[2], "array mask must cover the returned keys"
    if scoring == "observed":
        queries = mx.random.normal((B, H * GROUP, n_new, D))
        cache.observe_attention(queries, out_keys, out_values, D**-0.5, mask)
    return out_keys, out_values


def drive(cache, chunks, decode_steps, scoring, check):
    offset = 0
    for n_new in list(chunks) + [1] * decode_steps:
        keys = mx.random.normal((B, H, n_new, D))
        values = mx.random.normal((B, H, n_new, D))
        kept_before = cache.tokens_kept
        out_keys, out_values = _scored(cache, keys, values, scoring)
        # as mlx_lm.generate_step: the state is evaluated after each prompt chunk, never while decoding
        mx.eval(out_keys, out_values, *(cache.state if n_new > 1 else []))
        offset += n_new
        check(cache, n_new, keys, out_keys, kept_before, offset)


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("method", EVICTING)
def test_offset_budget_and_returned_keys(method, scoring):
    mx.random.seed(1)
    cache = KVCacheFactory.create(KVCacheConfig(**POLICY_CONFIGS[method], budget=24, n_sink=2, scoring=scoring))

    def check(cache, n_new, keys, out_keys, kept_before, offset):
        assert cache.offset == offset, "offset is the absolute number of tokens seen"
        if n_new > 1:
            assert out_keys.shape[2] == kept_before + n_new
            assert mx.array_equal(out_keys[:, :, -n_new:], keys), "new tokens last, in order"
        else:
            assert (mx.abs(out_keys - keys).sum(axis=-1) == 0).any(axis=-1).all(), "new token returned"
            singles = offset - sum(chunks)  # single-token calls so far: the first is the prompt's last token
            assert cache.progress.prefilling == (singles == 1), "decoding starts at the first generated token"
        if cache.eviction == "continuous" or not cache.progress.prefilling:
            assert out_keys.shape[2] <= cache.layer_budget or n_new > 1
            assert cache.tokens_kept <= cache.layer_budget
        held = cache.positions[..., : cache.tokens_kept]
        assert ((held == 0).any(axis=-1) & (held == 1).any(axis=-1)).all(), "sinks never evicted"

    chunks = [10, 17, 30, 5]
    drive(cache, chunks, 40, scoring, check)


def _kept_arrays(part, name="cache"):
    """Every array a cache or one of its per-sequence parts keeps, with where it is kept."""
    from velox_cache.generation.snapshot import PER_SEQUENCE

    for field, value in vars(part).items():
        if field == "_pending_keys":
            continue  # the input keys of a call still awaiting its observation, not kept state
        values = value if isinstance(value, (list, tuple)) else [value]
        for item in values:
            if isinstance(item, mx.array):
                yield f"{name}.{field}", item
            elif isinstance(item, PER_SEQUENCE):
                yield from _kept_arrays(item, f"{name}.{field}")


def _check_state_reaches_everything(cache, *_):
    state = {id(a) for a in cache.state}
    missing = [where for where, array in _kept_arrays(cache) if id(array) not in state]
    assert not missing, f"kept outside state: {missing}"


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("method", EVICTING)
def test_every_kept_array_is_reachable_from_state(method, scoring):
    """mlx-lm evaluates ``state`` after each chunk: an array kept outside it grows a lazy graph."""
    mx.random.seed(4)
    cache = KVCacheFactory.create(KVCacheConfig(**POLICY_CONFIGS[method], budget=24, n_sink=2, scoring=scoring))
    drive(cache, [10, 17, 30], 6, scoring, _check_state_reaches_everything)


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("method", STREAMING_METHODS)
def test_a_streaming_probe_keeps_nothing_outside_state(method, scoring):
    mx.random.seed(5)
    config = KVCacheConfig(method=method, budget=24, n_sink=2, eviction="streaming", scoring=scoring)
    cache = KVCacheFactory.create(config)
    drive(cache, [10, 17, 30], 0, scoring, _check_state_reaches_everything)
    cache.begin_phase(Phase.PROBE)
    _scored(cache, mx.random.normal((B, H, 5, D)), mx.random.normal((B, H, 5, D)), scoring)
    _check_state_reaches_everything(cache)
    assert cache.phase is Phase.PROBE and any(a is cache.progress.probe_scores for a in cache.state)


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("method", EVICTING)
def test_kept_bytes_is_the_nbytes_of_what_is_held(method, scoring):
    cache = KVCacheFactory.create(KVCacheConfig(**POLICY_CONFIGS[method], budget=16, scoring=scoring))

    def check(cache, *_):
        held = cache.slots.stored
        assert cache.kept_bytes == cache.keys[:, :, :held].nbytes + cache.values[:, :, :held].nbytes
        assert cache.kept_bytes + cache.spare_bytes == cache.keys.nbytes + cache.values.nbytes == cache.nbytes
        assert cache.full_seq_bytes == cache.offset * B * H * 2 * D * cache.keys.itemsize
        assert cache.tokens_seen == cache.offset * B * H

    drive(cache, [40, 9], 30, scoring, check)
    assert cache.compression_ratio == pytest.approx(cache.full_seq_bytes / cache.kept_bytes)
    assert cache.compression_ratio > 3


def test_a_full_cache_keeps_every_token_at_a_ratio_of_one_its_growth_room_apart():
    cache = KVCacheFactory.create(KVCacheConfig(method="full"))
    keys = mx.random.normal((B, H, 300, D))  # mlx-lm's KVCache grows by 256: room for 512
    cache.update_and_fetch(keys, keys)
    assert cache.keys.shape[2] == 512 and cache.offset == 300
    assert cache.kept_bytes == keys.nbytes * 2 == cache.full_seq_bytes and cache.compression_ratio == 1.0
    assert cache.spare_bytes == 212 * B * H * D * 4 * 2 and cache.nbytes == cache.kept_bytes + cache.spare_bytes
    assert cache.stats()["spare_bytes"] == cache.spare_bytes


def _context(model, scoring):
    """Plain mlx-lm runs unpatched; Velox caches run inside Velox's attention (observed or not)."""
    if scoring == "plain":
        return contextlib.nullcontext()
    return velox_cache.observe(model) if scoring == "observed" else velox_cache.fast_attention(model)


def _logits(model, prompt, caches, chunk, steps, scoring):
    context = _context(model, scoring)
    outputs = []
    with context:
        for start in range(0, prompt.size - 1, chunk):
            outputs.append(model(prompt[None, start : min(start + chunk, prompt.size - 1)], cache=caches)[:, -1])
            mx.eval([c.state for c in caches])
        token = prompt[-1:]
        for _ in range(steps):
            logits = model(token[None], cache=caches)[:, -1]
            outputs.append(logits)
            token = mx.argmax(logits, axis=-1)
            mx.eval(token)
    return outputs


@pytest.mark.parametrize("attention", ["fast", "exact"])
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("method", list(POLICIES))
def test_budget_above_length_gives_plain_kvcache_logits(tiny_model, method, scoring, attention, monkeypatch):
    """Exact attention matches plain mlx-lm to float32 noise; Velox's CPU kernel within 1e-4."""
    monkeypatch.setenv("VELOX_ATTENTION", attention)
    model, tokenizer = tiny_model
    prompt = mx.array(tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4))
    expected = _logits(model, prompt, [KVCache() for _ in model.layers], 48, 24, "plain")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, budget=2048, scoring=scoring))
    got = _logits(model, prompt, caches, 48, 24, scoring)
    tolerance = 1e-5 if attention == "exact" else 1e-4
    for want, have in zip(expected, got):
        assert mx.allclose(want, have, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("method", EVICTING)
def test_stream_generate_with_small_prefill_steps(tiny_model, method, scoring):
    model, tokenizer = tiny_model
    prompt = tokenizer.encode("Compress me, please. " * 12)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(**POLICY_CONFIGS[method], budget=40, scoring=scoring))
    context = velox_cache.observe(model) if scoring == "observed" else contextlib.nullcontext()
    with context:
        responses = list(
            mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=12, prompt_cache=caches, prefill_step_size=64)
        )
    generated = responses[-1].generation_tokens  # may stop early at the tiny model's EOS
    assert generated >= 1
    assert all(c.offset >= len(prompt) + generated - 1 for c in caches)
    assert all(c.tokens_kept <= c.layer_budget for c in caches)
    assert sum(c.layer_budget for c in caches) == 40 * len(caches)


@pytest.mark.parametrize("method", EVICTING)
def test_long_decode_keeps_memory_flat(tiny_model, method):
    model, _ = tiny_model
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(**POLICY_CONFIGS[method], budget=32, scoring="key_proxy"))
    generator = generate_step(mx.array([5] * 40), model, max_tokens=1000, prompt_cache=caches)
    for step, _ in enumerate(generator):
        if step == 100:
            mx.clear_cache()
            baseline = mx.get_active_memory()
    mx.clear_cache()
    assert mx.get_active_memory() - baseline < 256 * 1024
    assert all(c.tokens_kept == c.layer_budget for c in caches)


def test_pyramid_stack_follows_the_schedule(tiny_model):
    model, _ = tiny_model
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="pyramidkv", budget=64, beta=3.0))
    assert [c.layer_budget for c in caches] == velox_cache.pyramid_budgets(4, 64, 4, 3.0)
    assert KVCacheFactory.create(KVCacheConfig(method="pyramidkv", budget=64)).layer_budget == 64
    assert isinstance(caches[0], velox_cache.PyramidKVCache) and caches[0].pyramid_kept_bytes == 0


@pytest.mark.parametrize("scoring", SCORINGS)
def test_squeeze_measures_the_whole_prompt_and_publishes_once(tiny_model, scoring):
    model, tokenizer = tiny_model
    prompt = tokenizer.encode("Squeeze this prompt down to size. " * 8)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="squeeze", budget=48, scoring=scoring))
    coordinator = caches[0].coordinator
    assert all(c.coordinator is coordinator for c in caches)
    context = velox_cache.observe(model) if scoring == "observed" else contextlib.nullcontext()
    with context:
        for start in range(0, len(prompt) - 1, 64):
            model(mx.array(prompt[start : min(start + 64, len(prompt) - 1)])[None], cache=caches)
            mx.eval([c.state for c in caches])
            assert not coordinator.published
            assert all(c.tokens_kept == c.offset for c in caches), "nothing evicted before the schedule"
        token = mx.array(prompt[-1:])
        for step in range(5):
            token = mx.argmax(model(token[None], cache=caches)[:, -1], axis=-1)
            if step == 0:
                assert not coordinator.published, "the prompt's last token is still the prompt's"
            if step == 1:  # the first generated token ends prefill
                schedule = list(coordinator.budgets)
        assert coordinator.budgets == schedule, "frozen after publication"
    assert sum(schedule) == 48 * len(caches) and len(set(schedule)) > 1
    assert [c.layer_budget for c in caches] == schedule
    assert all(c.tokens_kept <= c.layer_budget for c in caches)
    assert all(0 < c.concentration < 1 for c in caches)
    assert caches[0].squeeze_kept_bytes == caches[0].kept_bytes


def test_squeeze_concentration_covers_every_chunk():
    def concentration(second_chunk_scale):
        mx.random.seed(3)
        cache = KVCacheFactory.create(KVCacheConfig(method="squeeze", budget=64, scoring="key_proxy"))
        first = mx.random.normal((1, 2, 32, 16))
        cache.update_and_fetch(first, first)
        second = mx.random.normal((1, 2, 32, 16)) * second_chunk_scale
        cache.update_and_fetch(second, second)
        return cache.concentration

    assert concentration(1.0) != pytest.approx(concentration(8.0), abs=1e-3)


def test_observe_restores_the_model_even_on_error(tiny_model):
    import mlx_lm.models.llama as llama

    model, _ = tiny_model
    original = llama.scaled_dot_product_attention
    with pytest.raises(ZeroDivisionError):
        with velox_cache.observe(model):
            assert llama.scaled_dot_product_attention is not original
            1 / 0
    assert llama.scaled_dot_product_attention is original


def test_observe_works_on_qwen2(tmp_path):
    from pipeline.model_store import load_model
    from tests.tiny_model import build_tiny_model_dir

    model, tokenizer = load_model(str(build_tiny_model_dir(tmp_path / "qwen2", model_type="qwen2")), weights="float32")
    prompt = mx.array(tokenizer.encode("Observed attention on another architecture. " * 3))
    expected = _logits(model, prompt, [KVCache() for _ in model.layers], 32, 5, "plain")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="h2o", budget=1024, scoring="observed"))
    got = _logits(model, prompt, caches, 32, 5, "observed")
    assert all(mx.allclose(a, b, atol=1e-4) for a, b in zip(expected, got))
    assert caches[0].scores.sum().item() > 0, "observed attention mass reached the cache"


def test_unobservable_model_is_a_clear_error():
    import mlx.nn as nn

    class Opaque(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(2, 2)]

    with pytest.raises(velox_cache.ObservationError, match="cannot be observed"):
        with velox_cache.observe(Opaque()):
            pass


def test_observed_scoring_without_observe_is_a_clear_error():
    cache = KVCacheFactory.create(KVCacheConfig(method="h2o", budget=16, scoring="observed"))
    keys = mx.zeros((1, 2, 4, 16))
    cache.update_and_fetch(keys, keys)
    with pytest.raises(RuntimeError, match="observe"):
        cache.update_and_fetch(keys, keys)


@pytest.mark.parametrize("method", EVICTING)
def test_misuse_is_a_clear_error(method):
    settings = POLICY_CONFIGS[method]
    with pytest.raises(velox_cache.ConfigError, match="budget"):
        KVCacheConfig(**settings, budget=3, n_sink=4)
    with pytest.raises(TypeError, match="config"):
        POLICIES[settings["method"]]({"budget": 16})
    with pytest.raises(TypeError, match="config"):
        KVCacheBuilder.for_model(object(), settings)
    cache = KVCacheFactory.create(KVCacheConfig(**settings, budget=16))
    with pytest.raises(TypeError, match="batch"):
        cache.merge([cache, cache])
    assert cache.is_trimmable() is False
    with pytest.raises(NotImplementedError, match="sliding-window"):
        cache.make_mask(4, window_size=2)


@pytest.mark.parametrize("scoring", SCORINGS)
def test_kv_dtype_sets_the_stored_dtype(tiny_model, scoring):
    model, tokenizer = tiny_model
    prompt = mx.array(tokenizer.encode("Half precision keys and values. " * 4))
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="h2o", budget=32, kv_dtype="float16", scoring=scoring))
    outputs = _logits(model, prompt, caches, 32, 4, scoring)
    assert all(c.keys.dtype == mx.float16 and c.values.dtype == mx.float16 for c in caches)
    assert all(c.kept_bytes == c.keys.size * 2 * 2 for c in caches)
    assert all(mx.isfinite(o).all().item() for o in outputs)
