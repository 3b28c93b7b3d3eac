"""One reading, many caches: every stack cut from a shared reading equals the stack its config prefills itself."""

import mlx.core as mx
import pytest

from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases
from velox_cache.cache import phases
from velox_cache.generation.reading import NotDerivable, SharedReading
from velox_cache.generation.routing import attention_routing

BUDGETS = (24, "25%")
POLICIES = {
    "snapkv": {"method": "snapkv"},
    "pyramidkv": {"method": "pyramidkv"},
    "squeeze": {"method": "squeeze"},
    "h2o-prefill-end": {"method": "h2o", "eviction": "prefill_end"},
}
CONFIGS = [
    KVCacheConfig(**fields, budget=budget, scoring=scoring, head_budgets=heads)
    for fields in POLICIES.values()
    for scoring in ("observed", "key_proxy")
    for heads in (("uniform", "adaptive") if scoring == "observed" else ("uniform",))
    for budget in BUDGETS
    if not (heads == "adaptive" and fields.get("eviction") == "prefill_end")  # h2o ranks by mass, not a window
]
# drafted tokens join the window (a reading drafts the most any config asks for; each takes its own share)
CONFIGS += [
    KVCacheConfig(method="pyramidkv", budget=24, lookahead=3),
    KVCacheConfig(method="squeeze", budget="25%", lookahead=5, head_budgets="adaptive"),
    KVCacheConfig(method="snapkv", budget=24, lookahead=5, scoring="key_proxy"),
    # ranked by a reconstruction (KVzip): the document re-read once for all of them
    KVCacheConfig(method="pyramidkv", budget=24, selection="reconstruction"),
    KVCacheConfig(method="squeeze", budget="25%", selection="reconstruction", lookahead=3, head_budgets="adaptive"),
    KVCacheConfig(method="snapkv", budget=24, selection="reconstruction", scoring="key_proxy"),
]
REPEAT = [5, 6, 7]
STEPS = 6


def _prompt(tokenizer):
    text = "A shared reading serves every cache that keeps the prompt until it ends. " * 5
    tokens = tokenizer.encode(text)
    return tokens[:-12], tokens[-12:]


def _own(model, config, document, instruction):
    caches = KVCacheBuilder.for_model(model, config, prompt_tokens=len(document) + len(instruction), new_tokens=STEPS)
    with attention_routing(model, [config]):
        logits = prefill_phases(model, caches, document=document, instruction=instruction, chunk_size=32,
                                max_new_tokens=STEPS, repeat=REPEAT)
    return caches, logits


def _greedy(model, config, caches, logits):
    tokens = []
    with attention_routing(model, [config]):
        for _ in range(STEPS):
            token = mx.argmax(logits, axis=-1)
            tokens.append(token.item())
            logits = model(token[None], cache=caches)[:, -1]
    return tokens


def _held(cache):
    slots = cache.slots
    keys, values = slots.held()
    return keys, values, slots.held_scores(), slots.held_positions(), slots.stored, slots.offset, slots.tokens_seen


@pytest.fixture(scope="module")
def reading(tiny_model):
    model, tokenizer = tiny_model
    document, instruction = _prompt(tokenizer)
    return SharedReading.prefill(model, [KVCacheConfig(method="full"), *CONFIGS], document=document,
                                 instruction=instruction, chunk_size=32, max_new_tokens=STEPS, repeat=REPEAT)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.method}-{c.eviction or ''}-{c.selection or ''}-{c.scoring}-{c.head_budgets}-{c.budget}-{c.lookahead}")
def test_a_derived_stack_equals_its_own_prefill_array_for_array(tiny_model, reading, config):
    model, tokenizer = tiny_model
    own, own_logits = _own(model, config, *_prompt(tokenizer))
    derived = reading.derive(config)
    assert mx.array_equal(reading.logits, own_logits).item()
    for mine, theirs in zip(phases.leaves(derived), phases.leaves(own)):
        assert type(mine) is type(theirs) and mine.layer_budget == theirs.layer_budget
        assert mine.slots.heads_pooled == theirs.slots.heads_pooled
        for a, b in zip(_held(mine), _held(theirs)):
            assert (mx.array_equal(a, b).item() if isinstance(a, mx.array) else a == b)
    if config.method == "squeeze":
        assert derived[0].coordinator.budgets == own[0].coordinator.budgets
    assert _greedy(model, config, derived, reading.logits) == _greedy(model, config, own, own_logits)


def test_the_full_stack_is_the_full_variants_own_and_the_reading_can_be_cut_again(tiny_model, reading):
    model, tokenizer = tiny_model
    full = KVCacheConfig(method="full")
    own, own_logits = _own(model, full, *_prompt(tokenizer))
    for mine, theirs in zip(reading.full(), own):
        assert mine.offset == theirs.offset
        assert mx.array_equal(mine.keys, theirs.keys).item() and mx.array_equal(mine.values, theirs.values).item()
    first, again = reading.derive(CONFIGS[0]), reading.derive(CONFIGS[0])
    assert all(mx.array_equal(a.slots.held()[0], b.slots.held()[0]).item() for a, b in zip(first, again))


@pytest.mark.parametrize(
    "config, why",
    [
        (KVCacheConfig(method="pyramidkv", budget=24, eviction="streaming"), "'streaming' evicts while reading"),
        (KVCacheConfig(method="h2o", budget=24), "'continuous' evicts while reading"),
    ],
)
def test_a_config_that_evicts_while_reading_is_refused_by_name(tiny_model, config, why):
    model, tokenizer = tiny_model
    document, instruction = _prompt(tokenizer)
    with pytest.raises(NotDerivable, match=why):
        SharedReading.prefill(model, [config], document=document, instruction=instruction)


def test_a_reading_with_nothing_to_cut_is_refused_by_name(tiny_model):
    model, tokenizer = tiny_model
    document, instruction = _prompt(tokenizer)
    with pytest.raises(NotDerivable, match="no compressed config"):
        SharedReading.prefill(model, [KVCacheConfig(method="full")], document=document, instruction=instruction)


def test_a_config_the_reading_did_not_record_is_refused(reading):
    with pytest.raises(NotDerivable, match="did not record"):
        reading.derive(KVCacheConfig(method="snapkv", budget=24, window=8))


@pytest.mark.parametrize("fields", [{"method": "pyramidkv"}, {"method": "squeeze", "head_budgets": "adaptive"},
                                    {"method": "snapkv", "selection": "reconstruction"}], ids=lambda f: f["method"])
def test_every_budget_of_a_policy_is_ranked_once_and_each_equals_its_own_prefill(tiny_model, monkeypatch, fields):
    import velox_cache.cache.selection as selection

    model, tokenizer = tiny_model
    document, instruction = _prompt(tokenizer)
    configs = [KVCacheConfig(**fields, budget=budget) for budget in (16, 24, "50%")]
    shared = SharedReading.prefill(model, configs, document=document, instruction=instruction, chunk_size=32,
                                   max_new_tokens=STEPS, repeat=REPEAT)
    ranked, rank = [], selection.WindowSelector._scores
    monkeypatch.setattr(selection.WindowSelector, "_scores", lambda *a, **k: ranked.append(1) or rank(*a, **k))
    derived = [shared.derive(config) for config in configs]
    monkeypatch.undo()
    assert 0 < len(ranked) <= len(derived[0])  # at most once per layer, for all three budgets
    for config, stack in zip(configs, derived):
        own, _ = _own(model, config, document, instruction)
        for mine, theirs in zip(phases.leaves(stack), phases.leaves(own)):
            assert mine.layer_budget == theirs.layer_budget
            for a, b in zip(_held(mine), _held(theirs)):
                assert (mx.array_equal(a, b).item() if isinstance(a, mx.array) else a == b)
