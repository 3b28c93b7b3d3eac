"""Streaming compressed prefill (FINCH): bounded memory, probes without a trace, positions, equality."""

import contextlib
import math

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

import velox_cache
from velox_cache import (
    KVCacheBuilder,
    KVCacheConfig,
    KVCacheFactory,
    phases,
    prefill_phases,
)
from velox_cache.kernels.rope import RotaryShift

from tests.velox_cache.policies import SCORINGS
from tests.velox_cache.policies import STREAMING_METHODS as STREAMING

CHUNK = 32


def _streaming_stack(model, method, budget, scoring, headroom=1.0):
    config = KVCacheConfig(method=method, budget=budget, eviction="streaming", scoring=scoring, stream_headroom=headroom)
    return KVCacheBuilder.for_model(model, config)


def _streaming_cache(method, budget, scoring="key_proxy", headroom=1.0):
    config = KVCacheConfig(method=method, budget=budget, eviction="streaming", scoring=scoring, stream_headroom=headroom)
    return KVCacheFactory.create(config)


def _context(model, scoring):
    return velox_cache.observe(model) if scoring == "observed" else contextlib.nullcontext()


@pytest.fixture(scope="module")
def parts(tiny_model):
    _, tokenizer = tiny_model
    return {
        "prefix": tokenizer.encode("<|im_start|>user\n"),
        "document": tokenizer.encode("Streaming reads the document chunk by chunk and keeps a budget. " * 5),
        "instruction": tokenizer.encode("\nSummarize the text above.<|im_end|>\n<|im_start|>assistant\n"),
    }


def _generate(model, caches, parts, scoring, steps=8, **options):
    """Prefill by phases, then greedy decode; returns every step's logits."""
    with _context(model, scoring):
        logits = prefill_phases(model, caches, chunk_size=CHUNK, **parts, **options)
        outputs = [logits]
        token = mx.argmax(logits, axis=-1)
        for _ in range(steps):
            logits = model(token[None], cache=caches)[:, -1]
            outputs.append(logits)
            token = mx.argmax(logits, axis=-1)
            mx.eval(token)
    return outputs


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("method", STREAMING)
def test_budget_covering_the_prompt_gives_the_full_cache_logits(tiny_model, parts, method, scoring):
    model, _ = tiny_model
    # Like with like: under observation mlx-lm's own caches also run on Velox's attention
    # (its fast exp differs from MLX's fused attention by ~1e-4 relative, ARCHITECTURE.md).
    expected = _generate(model, [KVCache() for _ in model.layers], parts, scoring)
    caches = _streaming_stack(model, method, 2048, scoring)
    got = _generate(model, caches, parts, scoring)
    n_prompt = sum(len(p) for p in parts.values())
    assert all(c.offset == n_prompt + 8 and c.tokens_kept == n_prompt + 8 for c in caches)
    for want, have in zip(expected, got):
        assert mx.allclose(want, have, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("method", ["pyramidkv", "squeeze"])
def test_memory_stays_within_budget_chunk_and_probe_after_every_call(tiny_model, parts, method, scoring):
    model, _ = tiny_model
    caches = _streaming_stack(model, method, 24, scoring)
    probe = len(parts["instruction"])
    seen = []

    def check(event, stack):
        seen.append(event)
        for cache in stack:
            assert cache.tokens_kept <= cache.layer_budget + CHUNK + probe, event
            if event == "probe_dropped":
                assert cache.tokens_kept <= cache.layer_budget
            assert cache.kept_bytes + cache.spare_bytes == cache.keys.nbytes + cache.values.nbytes

    _generate(model, caches, parts, scoring, steps=12, after_call=check)
    assert seen.count("probe") == len(range(0, len(parts["prefix"]) + len(parts["document"]), CHUNK)) - 1
    assert all(c.tokens_kept <= c.layer_budget for c in caches)
    assert all(c.tokens_seen == c.offset * c.keys.shape[0] * c.keys.shape[1] for c in caches)
    assert sum(c.layer_budget for c in caches) == 24 * len(caches)


@pytest.mark.parametrize("method", ["pyramidkv", "squeeze"])
def test_headroom_widens_what_probes_keep_and_the_instruction_brings_it_back_to_budget(tiny_model, parts, method):
    model, _ = tiny_model
    config = KVCacheConfig(method=method, budget=24, eviction="streaming", scoring="observed", stream_headroom=1.5)
    caches = KVCacheBuilder.for_model(model, config)
    probe = len(parts["instruction"])
    after_probes = []

    def check(event, stack):
        for cache in stack:
            assert cache.tokens_kept <= math.ceil(1.5 * cache.layer_budget) + CHUNK + probe, event
        if event == "probe_dropped":
            after_probes.append([cache.tokens_kept for cache in stack])

    _generate(model, caches, parts, "observed", steps=4, after_call=check)
    widened = [math.ceil(1.5 * c.layer_budget) for c in caches]
    assert all(all(k <= w for k, w in zip(kept, widened)) for kept in after_probes)
    assert after_probes[-1] == widened, "a probe keeps budget x headroom"
    assert all(c.tokens_kept == c.layer_budget for c in caches), "decoding starts at the budget itself"


def test_headroom_over_the_whole_document_is_selection_at_prefill_end(tiny_model, parts):
    model, _ = tiny_model
    n_prompt = sum(len(p) for p in parts.values())
    # the same ranking both ways: the prompt's window pooled over 31, no draft (streaming's defaults)
    at_end = KVCacheConfig(method="pyramidkv", budget=24, eviction="prefill_end", scoring="observed", lookahead=0)
    streaming = KVCacheConfig(
        method="pyramidkv", budget=24, eviction="streaming", scoring="observed", stream_headroom=n_prompt / 8
    )
    expected = _generate(model, KVCacheBuilder.for_model(model, at_end), parts, "observed")
    got = _generate(model, KVCacheBuilder.for_model(model, streaming), parts, "observed")
    for want, have in zip(expected, got):
        assert mx.allclose(want, have, atol=1e-5, rtol=1e-5)


def _snapshot(cache):
    return {
        "offset": cache.offset,
        "tokens_kept": cache.tokens_kept,
        "stats": cache.stats(),
        "keys": cache.keys[:, :, : cache.tokens_kept],
        "values": cache.values[:, :, : cache.tokens_kept],
        "positions": cache.positions[..., : cache.tokens_kept],
    }


def _chunk_and_probe(cache, n_chunk, n_probe, scoring, probe=True):
    mx.random.seed(4)
    keys = mx.random.normal((1, 2, n_chunk, 16))
    probe_keys = mx.random.normal((1, 2, n_probe, 16))

    def call(new):
        mask = cache.make_mask(new.shape[2])
        held_keys, held_values = cache.update_and_fetch(new, new)
        if scoring == "observed":
            cache.observe_attention(mx.random.normal((1, 4, new.shape[2], 16)), held_keys, held_values, 0.25, mask)

    phases.tell([cache], "document")
    call(keys)
    mx.eval(cache.state)
    before = _snapshot(cache)
    if probe:
        with phases.probe([cache]):
            call(probe_keys)
            assert cache.offset == before["offset"] + n_probe
            assert cache.tokens_kept == before["tokens_kept"] + n_probe
    mx.eval(cache.state)
    return before, _snapshot(cache)


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("eviction", ["streaming", "prefill_end", "continuous"])
def test_a_probe_leaves_no_trace_when_nothing_is_evicted(eviction, scoring):
    config = KVCacheConfig(method="pyramidkv", budget=512, eviction=eviction, scoring=scoring,
                           selection="cumulative" if eviction == "continuous" else None)
    before, after = _chunk_and_probe(KVCacheFactory.create(config), 40, 9, scoring)
    assert before["offset"] == after["offset"] and before["tokens_kept"] == after["tokens_kept"]
    assert before["stats"] == after["stats"], "accounting as before the probe"
    for name in ("keys", "values", "positions"):
        assert mx.array_equal(before[name], after[name]), name


@pytest.mark.parametrize("scoring", SCORINGS)
def test_a_probe_ranks_and_evicts_then_leaves_only_document_tokens(scoring):
    cache = _streaming_cache("snapkv", 16, scoring)
    before, after = _chunk_and_probe(cache, 40, 9, scoring)
    assert after["offset"] == before["offset"] == 40
    assert after["tokens_kept"] == 16
    assert after["stats"]["tokens_seen"] == before["stats"]["tokens_seen"]
    assert after["stats"]["full_seq_bytes"] == before["stats"]["full_seq_bytes"]
    assert after["stats"]["kept_bytes"] == cache.keys.nbytes + cache.values.nbytes == 16 * 2 * 2 * 16 * 4
    kept = after["positions"]
    assert (kept < 40).all(), "no probe token survives"
    held = before["keys"]
    gathered = mx.take_along_axis(held, kept[..., None], axis=2)
    assert mx.array_equal(gathered, after["keys"]), "kept keys are document keys, unchanged"
    assert ((kept == 0).any(axis=-1) & (kept == 3).any(axis=-1)).all(), "sinks kept"


def test_without_a_probe_each_chunk_is_ranked_by_its_own_last_queries_before_the_next():
    cache = _streaming_cache("pyramidkv", 16)
    keys = mx.random.normal((1, 2, 40, 16))
    phases.tell([cache], "document")
    cache.update_and_fetch(keys[:, :, :24], keys[:, :, :24])
    assert cache.tokens_kept == 24, "nothing evicted before the next chunk or a probe"
    held, _ = cache.update_and_fetch(keys[:, :, 24:], keys[:, :, 24:])
    assert held.shape[2] == 16 + 16 and cache.tokens_kept == 32
    assert mx.array_equal(held[:, :, -16:], keys[:, :, 24:]), "the new chunk comes back whole, last"
    phases.tell([cache], "decode")
    assert cache.tokens_kept == 16


def test_a_probe_is_trimmed_from_plain_caches_and_refused_where_it_cannot_be():
    from mlx_lm.models.cache import ArraysCache

    velox = _streaming_cache("pyramidkv", 64)
    plain = KVCache()
    keys = mx.random.normal((1, 2, 10, 16))
    for cache in (velox, plain):
        cache.update_and_fetch(keys, keys)
    with pytest.raises(TypeError, match=r"caches\[1\].*ArraysCache"):
        with phases.probe([velox, ArraysCache(2)]):
            pass
    assert velox.phase is not phases.Phase.PROBE, "a refused probe never began"
    with phases.probe([velox, plain]):
        for cache in (velox, plain):
            cache.update_and_fetch(keys[:, :, :3], keys[:, :, :3])
    assert velox.offset == plain.offset == 10
    assert velox.tokens_kept == plain.keys[:, :, : plain.offset].shape[2] == 10


@pytest.mark.parametrize("scoring", SCORINGS)
def test_squeeze_publishes_its_schedule_at_the_first_probe_from_the_first_chunk(tiny_model, parts, scoring):
    model, _ = tiny_model
    caches = _streaming_stack(model, "squeeze", 24, scoring)
    coordinator = caches[0].coordinator
    history = []

    def check(event, stack):
        history.append((event, coordinator.published, [c.concentration for c in stack]))

    _generate(model, caches, parts, scoring, steps=3, after_call=check)
    assert [h[:2] for h in history[:3]] == [("document", False), ("probe", False), ("probe_dropped", True)]
    first_chunk = history[0][2]
    assert all(h[2] == first_chunk for h in history), "measured on the first chunk only, then frozen"
    assert coordinator.concentrations == first_chunk
    assert sum(coordinator.budgets) == 24 * len(caches) and len(set(coordinator.budgets)) > 1
    assert [c.layer_budget for c in caches] == coordinator.budgets
    assert all(c.tokens_kept <= c.layer_budget for c in caches)


def test_squeeze_with_a_one_chunk_document_publishes_when_decoding_starts(tiny_model, parts):
    model, _ = tiny_model
    caches = _streaming_stack(model, "squeeze", 24, "key_proxy")
    events = []
    with_short = {**parts, "document": parts["document"][:20]}
    _generate(model, caches, with_short, "key_proxy", steps=1, after_call=lambda e, s: events.append(e))
    assert "probe" not in events, "the last chunk needs no probe: the instruction follows"
    assert caches[0].coordinator.published
    assert all(c.tokens_kept <= c.layer_budget for c in caches)


@pytest.mark.parametrize("scoring", SCORINGS)
def test_past_the_context_positions_are_compacted_and_stay_inside_it(tiny_model, parts, scoring):
    model, _ = tiny_model
    context = 160
    caches = _streaming_stack(model, "pyramidkv", 16, scoring)
    n_prompt = sum(len(p) for p in parts.values())
    assert n_prompt > 2 * context

    def check(event, stack):
        for cache in stack:
            assert cache.offset <= context, "every position used so far inside the context"
            if event == "instruction":
                assert cache.offset + 6 <= context, "room left for the tokens to generate"
            held = cache.positions[..., : cache.tokens_kept]
            assert (held < cache.offset).all()

    outputs = _generate(model, caches, parts, scoring, steps=6, max_new_tokens=6, context_length=context,
                        after_call=check)
    assert all(mx.isfinite(o).all().item() for o in outputs)
    assert all(c.offset < n_prompt for c in caches), "offset counts from the compacted positions"
    assert all(c.offset <= context for c in caches)
    assert all(c.tokens_seen == (n_prompt + 6) * c.keys.shape[0] * c.keys.shape[1] for c in caches)
    assert all(c.compression_ratio > 1 for c in caches)


def test_compaction_moves_held_keys_to_contiguous_positions_and_keeps_their_content(tiny_model):
    model, _ = tiny_model
    shift = RotaryShift.from_model(model)
    cache = _streaming_cache("pyramidkv", 12)
    mx.random.seed(5)
    raw = mx.random.normal((1, 2, 50, 16))
    rotated = shift.shift(raw, mx.broadcast_to(mx.arange(50, dtype=mx.int32), (1, 2, 50)))  # key t at position t
    phases.tell([cache], "document")
    cache.update_and_fetch(rotated[:, :, :40], rotated[:, :, :40])
    with phases.probe([cache]):  # ranks and evicts: gaps between the kept positions
        cache.update_and_fetch(rotated[:, :, 40:], rotated[:, :, 40:])
    held_positions = cache.positions[..., : cache.tokens_kept]
    assert not mx.array_equal(held_positions, mx.arange(cache.tokens_kept)[None, None])
    cache.compact_positions(shift)
    kept = cache.tokens_kept
    assert cache.offset == kept
    assert mx.array_equal(cache.positions[..., :kept], mx.broadcast_to(mx.arange(kept), (1, 2, kept)))
    unrotated = shift.shift(cache.keys[:, :, :kept], -cache.positions[..., :kept])
    expected = mx.take_along_axis(raw, held_positions[..., None], axis=2)
    assert mx.allclose(unrotated, expected, atol=1e-4), "the same keys, rotated at their new positions"


def test_a_context_too_small_for_budget_chunk_and_probe_is_a_clear_error(tiny_model, parts):
    model, _ = tiny_model
    caches = _streaming_stack(model, "pyramidkv", 64, "key_proxy")
    with pytest.raises(velox_cache.ContextError, match="context_length"):
        _generate(model, caches, parts, "key_proxy", steps=0, context_length=80)


@pytest.mark.parametrize("changes, field", [
    ({"method": "streaming", "eviction": "streaming"}, "eviction"),
    ({"method": "pyramidkv", "eviction": "streaming", "selection": "cumulative"}, "selection"),
])
def test_streaming_misconfigurations_name_the_field(changes, field):
    with pytest.raises(velox_cache.ConfigError, match=field):
        KVCacheConfig(**changes)


@pytest.mark.parametrize("method", STREAMING)
def test_an_array_mask_covers_the_keys_after_the_chunks_selection(method):
    """A document chunk first evicts the last chunk to budget: the mask made before it must count that."""
    cache = _streaming_cache(method, 12)
    mx.random.seed(6)
    for n_new in (20, 16, 16):
        keys = mx.random.normal((1, 2, n_new, 16))
        mask = cache.make_mask(n_new, return_array=True)
        held, _ = cache.update_and_fetch(keys, keys)
        assert mask.shape[-1] == held.shape[2]
    assert cache.tokens_kept < cache.offset, "the selections evicted"
