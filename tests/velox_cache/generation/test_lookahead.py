"""Look-ahead: tokens drafted after the prompt join the window that ranks it, then leave no trace."""

import mlx.core as mx
import pytest

from velox_cache import KVCacheBuilder, KVCacheConfig, KVCacheFactory, prefill_phases
from velox_cache.config import ConfigError
from velox_cache.generation.prefill import draft
from velox_cache.generation.routing import attention_routing

WINDOW = 4


def _prompt(tokenizer):
    tokens = tokenizer.encode("Drafted tokens show what the answer will read in the document. " * 4)
    return tokens[:-8], tokens[-8:]


def _prefill(model, config, document, instruction, *, tell_decode=True, stop_tokens=()):
    caches = KVCacheBuilder.for_model(model, config, prompt_tokens=len(document) + len(instruction))
    events = []
    with attention_routing(model, [config]):
        logits = prefill_phases(model, caches, document=document, instruction=instruction, chunk_size=16,
                                max_new_tokens=8, tell_decode=tell_decode, stop_tokens=stop_tokens,
                                after_call=lambda event, stack: events.append(event))
    return caches, logits, events


def _full_greedy(model, document, instruction, steps):
    caches, logits, _ = _prefill(model, KVCacheConfig(method="full"), document, instruction)
    tokens = []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        tokens.append(token.item())
        logits = model(token[None], cache=caches)[:, -1]
    return tokens


@pytest.mark.parametrize("scoring", ["observed", "key_proxy"])
def test_the_window_holds_the_prompts_last_queries_then_the_drafted_ones(tiny_model, scoring):
    model, tokenizer = tiny_model
    document, instruction = _prompt(tokenizer)
    length = len(document) + len(instruction)
    config = KVCacheConfig(method="snapkv", budget=12, window=WINDOW, lookahead=3, scoring=scoring)
    caches, _, events = _prefill(model, config, document, instruction, tell_decode=False)
    assert events[-1] == "look_ahead"
    for cache in caches:
        assert cache.selector.positions.tolist() == list(range(length - WINDOW, length + 3))
        # nothing of the draft stays: offset, counts and held tokens are the prompt's
        assert cache.offset == length and cache.seen_per_head == length and cache.slots.stored == length
        assert cache.slots.held_positions().max().item() == length - 1


def test_the_draft_is_the_full_caches_greedy_start_and_stops_before_a_stop_token(tiny_model):
    model, tokenizer = tiny_model
    document, instruction = _prompt(tokenizer)
    expected = _full_greedy(model, document, instruction, 5)
    config = KVCacheConfig(method="pyramidkv", budget=12, lookahead=5)
    caches = KVCacheBuilder.for_model(model, config)
    with attention_routing(model, [config]):
        logits = prefill_phases(model, caches, document=document, instruction=instruction, chunk_size=16,
                                tell_decode=False)
        assert draft(model, caches, logits, 5) == expected
        stop = expected[1]
        assert draft(model, caches, logits, 5, stop_tokens={stop}) == expected[: expected.index(stop)]


def test_drafted_queries_change_what_the_selection_keeps_and_decoding_starts_at_the_prompts_end(tiny_model):
    model, tokenizer = tiny_model
    document, instruction = _prompt(tokenizer)
    plain = KVCacheConfig(method="snapkv", budget=10, window=WINDOW, kernel=1, lookahead=0)
    ahead = KVCacheConfig(method="snapkv", budget=10, window=WINDOW, kernel=1, lookahead=6)
    kept = {}
    for config in (plain, ahead):
        caches, logits, _ = _prefill(model, config, document, instruction)
        kept[config.lookahead] = [c.slots.held_positions().tolist() for c in caches]
        assert all(c.offset == len(document) + len(instruction) for c in caches)
    assert kept[0] != kept[6]


def test_a_stack_without_lookahead_drafts_nothing(tiny_model):
    model, tokenizer = tiny_model
    _, _, events = _prefill(model, KVCacheConfig(method="snapkv", budget=12, lookahead=0), *_prompt(tokenizer))
    assert "look_ahead" not in events
    _, _, events = _prefill(model, KVCacheConfig(method="snapkv", budget=12, eviction="streaming"), *_prompt(tokenizer))
    assert "look_ahead" not in events, "streaming drafts nothing by default"


def test_the_default_look_ahead_drafts_at_prefill_end(tiny_model):
    model, tokenizer = tiny_model
    document, instruction = _prompt(tokenizer)
    caches, _, events = _prefill(model, KVCacheConfig(method="pyramidkv", budget=12, window=WINDOW), document,
                                 instruction, tell_decode=False)
    assert events[-1] == "look_ahead"
    length = len(document) + len(instruction)
    assert all(c.selector.positions.tolist() == list(range(length - WINDOW, length + 16)) for c in caches)
    assert all(c.selector.pooling == 1 for c in caches), "with the draft in the window: token by token"


def test_under_mlx_lm_generate_the_default_look_ahead_stays_off(tiny_model):
    """Nothing drafts when no phases are told: the window holds the prompt's queries alone, as with lookahead 0."""
    import mlx_lm

    model, tokenizer = tiny_model
    prompt = tokenizer.encode("Drafted tokens show what the answer will read in the document. " * 6)
    outputs, windows = [], []
    for lookahead in (None, 0):
        config = KVCacheConfig(method="pyramidkv", budget=12, window=WINDOW, lookahead=lookahead)
        caches = KVCacheBuilder.for_model(model, config)
        with attention_routing(model, [config]):
            outputs.append(mlx_lm.generate(model, tokenizer, prompt, max_tokens=6, prompt_cache=caches,
                                           prefill_step_size=16))
        windows.append([c.slots.held_positions().tolist() for c in caches])
        assert caches[0].lookahead == (16 if lookahead is None else 0)
        assert caches[0].selector.kernel is None and caches[0].selector.extra == 0  # pooled over 31: no draft
    assert outputs[0] == outputs[1] and windows[0] == windows[1]


@pytest.mark.parametrize("fields", [{"method": "h2o", "eviction": "prefill_end"}, {"method": "tova"}])
def test_lookahead_without_a_window_ranking_is_refused_naming_the_field(fields):
    with pytest.raises(ConfigError, match="lookahead"):
        KVCacheFactory.create(KVCacheConfig(**fields, budget=16, lookahead=4))


def test_a_negative_lookahead_is_refused():
    with pytest.raises(ConfigError, match="lookahead"):
        KVCacheConfig(method="snapkv", lookahead=-1)


def test_no_look_ahead_where_a_layer_velox_leaves_alone_cannot_drop_the_draft():
    """Sliding-window or state-space layers cannot give drafted tokens back: the default look-ahead stays off."""
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    from velox_cache.cache import phases

    velox = KVCacheFactory.create(KVCacheConfig(method="pyramidkv", budget=16))
    assert phases.look_ahead_steps([KVCache(), velox]) == 16
    assert phases.look_ahead_steps([RotatingKVCache(max_size=8), velox]) == 0
    assert phases.look_ahead_steps([ArraysCache(2), velox]) == 0
