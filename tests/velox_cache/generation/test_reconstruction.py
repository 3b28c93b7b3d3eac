"""Reconstruction ranking (KVzip): the document re-read after a request to repeat it ranks the prompt."""

import math

import mlx.core as mx
import pytest

from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases
from velox_cache.cache import phases
from velox_cache.config import ConfigError
from velox_cache.generation.routing import attention_routing

REPEAT = [11, 12, 13, 14]
CHUNK = 16


def _prompt(tokenizer):
    tokens = tokenizer.encode("A reconstruction re-reads the document to find what it cannot lose. " * 4)
    return tokens[:-8], tokens[-8:]


def _prefill(model, config, document, instruction, *, repeat=REPEAT, tell_decode=True):
    caches = KVCacheBuilder.for_model(model, config)
    events = []
    with attention_routing(model, [config]):
        prefill_phases(model, caches, document=document, instruction=instruction, chunk_size=CHUNK, repeat=repeat,
                       tell_decode=tell_decode, after_call=lambda event, stack: events.append(event))
    return caches, events


@pytest.mark.parametrize("scoring", ["observed", "key_proxy"])
def test_the_document_is_re_read_piece_by_piece_and_leaves_no_trace(tiny_model, scoring):
    model, tokenizer = tiny_model
    document, instruction = _prompt(tokenizer)
    length = len(document) + len(instruction)
    config = KVCacheConfig(method="snapkv", budget=12, selection="reconstruction", scoring=scoring)
    caches, events = _prefill(model, config, document, instruction, tell_decode=False)
    assert events.count("reconstruction") == math.ceil(len(document) / CHUNK)
    for cache in caches:
        assert cache.offset == length and cache.slots.stored == length and cache.seen_per_head == length
        peak = cache.selector.peak
        assert peak.shape == (1, cache.kv_heads, length)
        assert 0 < peak.min().item() and peak.max().item() <= 1.0


def test_the_ranking_keeps_other_tokens_than_the_window_alone(tiny_model):
    model, tokenizer = tiny_model
    prompt = _prompt(tokenizer)
    kept = {}
    for selection in ("window", "reconstruction"):
        config = KVCacheConfig(method="snapkv", budget=12, kernel=1, selection=selection)
        caches, _ = _prefill(model, config, *prompt)
        kept[selection] = [c.slots.held_positions().tolist() for c in caches]
        assert all(c.slots.stored == 12 for c in caches)
    assert kept["window"] != kept["reconstruction"]


def test_a_reconstruction_without_the_request_to_repeat_is_refused_naming_it(tiny_model):
    model, tokenizer = tiny_model
    config = KVCacheConfig(method="pyramidkv", budget=12, selection="reconstruction")
    with pytest.raises(ValueError, match="repeat"):
        _prefill(model, config, *_prompt(tokenizer), repeat=())


def test_streaming_cannot_rank_by_reconstruction():
    with pytest.raises(ConfigError, match="selection"):
        KVCacheConfig(method="pyramidkv", eviction="streaming", selection="reconstruction")


@pytest.mark.parametrize("dropped", [phases.reconstruction, phases.look_ahead, phases.drafting])
def test_a_cache_that_ranks_nothing_is_given_back_array_for_array(tiny_model, dropped):
    """mlx-lm's KVCache (the full stack of a shared reading) holds after a dropped call what it held before."""
    model, tokenizer = tiny_model
    document, instruction = _prompt(tokenizer)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="full"))
    prefill_phases(model, caches, document=document, instruction=instruction, chunk_size=CHUNK)
    before = [(c.offset, mx.array(c.keys), mx.array(c.values)) for c in caches]
    with dropped(caches):
        model(mx.array([REPEAT + document[: 2 * CHUNK]]), cache=caches)  # grows the buffers past their step
    for cache, (offset, keys, values) in zip(caches, before):
        assert cache.offset == offset
        assert mx.array_equal(cache.keys, keys).item() and mx.array_equal(cache.values, values).item()
