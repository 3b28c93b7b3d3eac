"""Evicting caches at ``kv_bits``: prompt read in float, held tokens quantized when decoding starts, holes refilled."""

import mlx.core as mx
import numpy as np
import pytest

import velox_cache
from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases
from velox_cache.generation.reading import SharedReading

from tests.velox_cache.policies import POLICY_CONFIGS

BUDGET = 40  # per layer; groups of min(32, 40 // 4) = 10 tokens


def _prompt(tokenizer, n=160):
    return tokenizer.encode("Evicted codes leave holes that the next whole group fills again. " * 6)[:n]


def _decoded(model, tokenizer, fields, steps, bits=8, scoring="observed"):
    """A stack that read the prompt and decoded ``steps`` teacher-forced tokens (the same for every stack)."""
    config = KVCacheConfig(**{**fields, "budget": BUDGET, "scoring": scoring, "kv_bits": bits})
    stack = KVCacheBuilder.for_model(model, config, prompt_tokens=160)
    context = velox_cache.observe if scoring == "observed" else velox_cache.fast_attention
    with context(model):
        prefill_phases(model, stack, document=_prompt(tokenizer), max_new_tokens=steps)
        for step in range(steps):
            model(mx.array([[(7 * step) % 200 + 3]]), cache=stack)
    return stack


def _float_keys(model, tokenizer):
    full = KVCacheBuilder.for_model(model, KVCacheConfig(method="full"))
    with velox_cache.fast_attention(model):
        prefill_phases(model, full, document=_prompt(tokenizer))
    return full


@pytest.mark.parametrize("row", list(POLICY_CONFIGS))
def test_held_codes_are_the_prompts_keys_and_the_budget_holds(tiny_model, row):
    model, tokenizer = tiny_model
    stack = _decoded(model, tokenizer, POLICY_CONFIGS[row], steps=45)
    full = _float_keys(model, tokenizer)
    for cache, reference in zip(stack, full):
        slots = cache.slots
        assert slots.quantized and slots.groups > 0, "quantized when decoding started, groups flushed since"
        assert cache.tokens_kept <= cache.layer_budget
        live = np.array(slots.live[:, :, : slots.stored])
        positions = np.array(slots.held_positions())
        assert (live.sum(-1) == cache.tokens_kept).all(), "every head holds as many"
        keys = np.array(slots.held()[0].dequantized()[0])
        scales = np.array(slots.key_scales)[np.arange(1)[:, None, None], np.arange(2)[None, :, None],
                                            np.array(slots.key_groups)]
        floats = np.array(reference.keys)
        for head in range(live.shape[1]):
            held = positions[0, head][live[0, head]]
            assert len(set(held.tolist())) == len(held), "no position held twice"
            assert set(range(cache.config.n_sink)) <= set(held.tolist()), "sinks stay"
            for slot in np.nonzero(live[0, head])[0]:
                position = positions[0, head, slot]
                if position >= 160:
                    continue  # a decoded token: its key came from a compressed context
                bound = scales[0, head, slot] / 2 + 1e-4 if slot < slots.quantized_count else 0.0
                assert (np.abs(keys[0, head, slot] - floats[0, head, position]) <= bound).all(), (head, slot)


def test_recency_keeps_the_same_positions_as_float(tiny_model):
    """StreamingLLM ranks by position only: quantization must not change what it keeps."""
    model, tokenizer = tiny_model
    quantized = _decoded(model, tokenizer, {"method": "streaming"}, steps=37)
    plain = KVCacheBuilder.for_model(model, KVCacheConfig(method="streaming", budget=BUDGET, scoring="observed"))
    with velox_cache.observe(model):
        prefill_phases(model, plain, document=_prompt(tokenizer), max_new_tokens=37)
        for step in range(37):
            model(mx.array([[(7 * step) % 200 + 3]]), cache=plain)
    for a, b in zip(quantized, plain):
        live = np.array(a.slots.live[:, :, : a.slots.stored])
        held = np.sort(np.array(a.slots.held_positions())[live].reshape(-1))
        assert held.tolist() == np.sort(np.array(b.positions[..., : b.tokens_kept]).reshape(-1)).tolist()


def test_memory_stays_bounded_over_a_long_decode(tiny_model):
    model, tokenizer = tiny_model
    stack = _decoded(model, tokenizer, {"method": "h2o"}, steps=150)
    for cache in stack:
        group = cache.slots.group
        assert cache.slots.stored <= BUDGET + 2 * group
        assert cache.slots.groups <= (BUDGET + 2 * group) // group + 1, "the scales of groups no token uses go"
        float_bytes = cache.full_seq_bytes * cache.slots.stored // cache.offset  # the same slots in float
        assert cache.kept_bytes < float_bytes


@pytest.mark.parametrize("bits", [8, 4])
def test_key_proxy_scoring_reads_the_codes(tiny_model, bits):
    model, tokenizer = tiny_model
    stack = _decoded(model, tokenizer, {"method": "h2o"}, steps=25, bits=bits, scoring="key_proxy")
    assert all(c.slots.quantized and c.tokens_kept == BUDGET for c in stack)
    assert all(float(c.slots.held_scores().sum()) > 0 for c in stack)


def test_a_stack_cut_from_a_reading_is_its_own(tiny_model):
    model, tokenizer = tiny_model
    config = KVCacheConfig(method="pyramidkv", budget=BUDGET, scoring="observed", kv_bits=4, lookahead=0)
    prompt = _prompt(tokenizer)
    reading = SharedReading.prefill(model, [config], document=prompt, chunk_size=64)
    cut = reading.derive(config)
    own = KVCacheBuilder.for_model(model, config, prompt_tokens=len(prompt))
    with velox_cache.observe(model):
        prefill_phases(model, own, document=prompt, chunk_size=64)
    for a, b in zip(cut, own):
        assert a.slots.quantized and b.slots.quantized
        assert all(mx.array_equal(x, y).item() for x, y in zip(a.slots.arrays, b.slots.arrays))


def test_a_quantized_row_batches_beside_float_rows(tiny_model):
    from velox_cache.generation.decode import DecodeRow, decode_rows
    from velox_cache.generation.sampling import TokenSampler

    model, tokenizer = tiny_model

    def rows(bits_of_each):
        made = []
        for bits in bits_of_each:
            config = KVCacheConfig(method="pyramidkv", budget=BUDGET, scoring="observed", kv_bits=bits)
            stack = KVCacheBuilder.for_model(model, config, prompt_tokens=160)
            with velox_cache.observe(model):
                logits = prefill_phases(model, stack, document=_prompt(tokenizer), max_new_tokens=12)
            sampler = TokenSampler()
            made.append(DecodeRow(stack, sampler, sampler.logprobs(logits), 12))
        return made

    together = rows([None, 8, None])
    with velox_cache.observe(model):
        decode_rows(model, together)
    assert [row.batch_size for row in together] == [3, 3, 3], "the quantized row in a part of its own kind"
    for bits, row in zip([None, 8, None], together):
        alone = rows([bits])
        with velox_cache.observe(model):
            decode_rows(model, alone)
        assert alone[0].tokens == row.tokens


@pytest.mark.parametrize("bits", [8, 4])
def test_a_document_streamed_past_the_context_decodes_at_kv_bits(tiny_model, bits):
    """Streaming (probes, compaction past the context) reads in float; decoding then holds codes."""
    model, tokenizer = tiny_model
    document = tokenizer.encode("Streaming reads the document chunk by chunk and keeps a budget. " * 6)
    instruction = tokenizer.encode("\nSummarize the text above.")
    config = KVCacheConfig(method="pyramidkv", budget=24, eviction="streaming", scoring="observed", kv_bits=bits)
    stack = KVCacheBuilder.for_model(model, config)
    with velox_cache.observe(model):
        logits = prefill_phases(model, stack, document=document, instruction=instruction, chunk_size=32,
                                max_new_tokens=20, context_length=160)
        for _ in range(20):
            logits = model(mx.argmax(logits, axis=-1)[None], cache=stack)[:, -1]
    assert len(document) + len(instruction) > 2 * 160
    assert mx.isfinite(logits).all().item()
    assert all(c.slots.quantized and c.offset <= 160 and c.tokens_kept <= c.layer_budget for c in stack)


def test_plain_mlx_lm_generate_quantizes_when_its_first_token_comes(tiny_model):
    """The user path: ``mlx_lm``'s generate tells no phases; the first single-token call ends prefill."""
    from mlx_lm.generate import generate_step

    model, tokenizer = tiny_model
    config = KVCacheConfig(method="h2o", budget=BUDGET, scoring="observed", kv_bits=8)
    stack = KVCacheBuilder.for_model(model, config)
    with velox_cache.observe(model):
        steps = generate_step(mx.array(_prompt(tokenizer)), model, prompt_cache=stack, max_tokens=30)
        tokens = [int(token) for token, _ in steps]
    assert len(tokens) == 30
    assert all(c.slots.quantized and c.tokens_kept <= BUDGET for c in stack)
    assert all(c.slots.groups >= 1 for c in stack), [c.slots.groups for c in stack]
    assert all(c.offset == 160 + 30 for c in stack), [c.offset for c in stack]  # mlx-lm feeds the last token too


def _arrays_held(obj, seen=None) -> list:
    """Every ``mx.array`` reachable from ``obj``'s attributes (through the per-sequence parts it owns)."""
    found = []
    for value in vars(obj).values():
        if isinstance(value, mx.array):
            found.append(value)
        elif type(value).__module__.startswith("velox_cache.cache"):
            found += _arrays_held(value)
    return found


@pytest.mark.parametrize("fields", [{"method": "h2o"}, {"method": "pyramidkv"}, {"method": "full"}],
                         ids=["h2o", "pyramidkv", "full"])
def test_every_array_a_quantized_cache_keeps_is_in_its_state(tiny_model, fields):
    """ARCHITECTURE.md: what a cache keeps is reachable from ``state`` (mlx-lm evaluates it after each chunk)."""
    model, tokenizer = tiny_model
    stack = _decoded(model, tokenizer, fields, steps=25)
    for cache in stack:
        state = [id(a) for a in cache.state]
        held = _arrays_held(cache.slots if hasattr(cache, "slots") else cache.tokens)
        assert held and all(id(a) in state for a in held)


def test_a_quantized_full_cache_refuses_mlx_lm_merging():
    from velox_cache.policies import QuantizedFullKVCache

    with pytest.raises(TypeError, match="cannot be merged"):
        QuantizedFullKVCache.merge([QuantizedFullKVCache(KVCacheConfig(method="full", kv_bits=8))])
