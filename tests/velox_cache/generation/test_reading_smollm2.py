"""One reading, many caches, on the real SmolLM2 and a prompt long enough for the fused attention's threads.

``test_reading.py`` pins "derived equals its own prefill" on the tiny model, whose calls run on one
thread. Here every attention call of a 512-token chunk runs as several tasks on several threads; the
key mass, the entropy and so every ranking must come out bit for bit the same whichever thread summed
what (issue 41, item 7).
"""

import mlx.core as mx
import pytest

from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases
from velox_cache.cache import phases
from velox_cache.generation.reading import SharedReading
from velox_cache.generation.routing import attention_routing

pytestmark = pytest.mark.integration

CHUNK = 512  # 512 queries x 3 heads of a group: four or more tasks per KV head on every instruction set
# squeeze at prefill end: every query's mass (its 0.3 blend), the window's, and each layer's sampled entropy
CONFIG = KVCacheConfig(method="squeeze", budget=128)


def _prompt(tokenizer):
    text = " ".join(
        f"Record {i}: the lighthouse keeper logged {i * 37 % 101} ships, wind {i * 13 % 9} knots, "
        f"and wrote that the lamp was {'steady' if i % 3 else 'flickering'}."
        for i in range(48)
    )
    tokens = tokenizer.encode(text)
    question = tokenizer.encode(" Which records mention a flickering lamp, and how many ships did they log?")
    return tokens, question


def _own(model, config, document, instruction):
    caches = KVCacheBuilder.for_model(model, config, prompt_tokens=len(document) + len(instruction))
    with attention_routing(model, [config]):
        logits = prefill_phases(model, caches, document=document, instruction=instruction, chunk_size=CHUNK)
    return caches, logits


def _held(cache):
    slots = cache.slots
    keys, values = slots.held()
    return keys, values, slots.held_scores(), slots.held_positions(), slots.stored, slots.offset, slots.tokens_seen


def test_a_derived_stack_equals_its_own_prefill_bit_for_bit_on_smollm2(smollm2):
    model, tokenizer = smollm2
    document, instruction = _prompt(tokenizer)
    assert len(document) + len(instruction) > 1000
    reading = SharedReading.prefill(model, [KVCacheConfig(method="full"), CONFIG], document=document,
                                    instruction=instruction, chunk_size=CHUNK)
    derived = reading.derive(CONFIG)
    for attempt in range(2):  # its own prefill, twice: the same bits every time
        own, own_logits = _own(model, CONFIG, document, instruction)
        assert mx.array_equal(reading.logits, own_logits).item()
        assert derived[0].coordinator.budgets == own[0].coordinator.budgets, f"own prefill {attempt + 1}"
        for layer, (mine, theirs) in enumerate(zip(phases.leaves(derived), phases.leaves(own))):
            for a, b in zip(_held(mine), _held(theirs)):
                same = mx.array_equal(a, b).item() if isinstance(a, mx.array) else a == b
                assert same, f"own prefill {attempt + 1}, layer {layer}"
