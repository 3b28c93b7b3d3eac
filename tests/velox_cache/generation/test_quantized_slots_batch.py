"""Evicting caches at ``kv_bits`` decoding in one batch (``QuantizedSlotsBatch``): the same as each alone."""

import mlx.core as mx
import numpy as np
import pytest

import velox_cache
from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases
from velox_cache.generation.batching import batch_layers, decode_footprint, row_footprint
from velox_cache.generation.decode import DecodeRow, decode_rows
from velox_cache.generation.quantized_slots_batch import QuantizedSlotsBatch
from velox_cache.generation.sampling import TokenSampler

from tests.velox_cache.policies import POLICY_CONFIGS

BUDGET = 40  # per layer; groups of min(32, 40 // 4) = 10 tokens: a 30-token decode flushes every row's window
STEPS = 30
TEXT = "Evicted codes leave holes that the next whole group fills again, row by row. " * 8


def _rows(model, tokenizer, lengths, fields, *, bits=8, scoring="observed", steps=STEPS):
    context = velox_cache.observe if scoring == "observed" else velox_cache.fast_attention
    made = []
    for length in lengths:
        config = KVCacheConfig(**{**fields, "budget": BUDGET, "scoring": scoring, "kv_bits": bits})
        stack = KVCacheBuilder.for_model(model, config, prompt_tokens=length)
        with context(model):
            logits = prefill_phases(model, stack, document=tokenizer.encode(TEXT)[:length], max_new_tokens=steps)
        sampler = TokenSampler()
        made.append(DecodeRow(stack, sampler, sampler.logprobs(logits), steps))
    return made, context


def _decoded(model, rows, context, **options):
    with context(model):
        decode_rows(model, rows, **options)
    return rows


def _same_slots(a, b) -> None:
    """Two quantized layers hold the same tokens in the same buffers (codes equal, floats within rounding)."""
    x, y = a.slots, b.slots
    counts = ("quantized_count", "tail", "kept", "groups", "stored", "offset", "tokens_seen")
    assert [getattr(x, n) for n in counts] == [getattr(y, n) for n in counts]
    assert [arr.shape for arr in x.arrays] == [arr.shape for arr in y.arrays], "the buffers decoding alone leaves"
    assert mx.array_equal(x.live, y.live).item() and mx.array_equal(x.positions, y.positions).item()
    assert mx.array_equal(x.key_groups, y.key_groups).item()
    for name in ("key_codes", "value_codes"):  # a code may differ by one step where a batch's matmul rounds otherwise
        diff = np.abs(np.array(getattr(x, name)).astype(int) - np.array(getattr(y, name)).astype(int))
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01
    assert mx.allclose(x.keys, y.keys, atol=1e-4).item() and mx.allclose(x.scores, y.scores, atol=1e-3).item()
    assert a.nbytes == b.nbytes and a.kept_bytes == b.kept_bytes


@pytest.mark.parametrize("row,bits,scoring", [
    ("pyramidkv", 8, "observed"), ("squeeze", 4, "observed"), ("h2o", 8, "key_proxy"), ("tova", 4, "observed"),
    ("streaming", 8, "key_proxy"), ("snapkv", 8, "observed"),
])
def test_rows_decode_the_same_alone_and_batched(tiny_model, row, bits, scoring):
    model, tokenizer = tiny_model
    lengths = [120, 61, 170]
    together = _decoded(model, *_rows(model, tokenizer, lengths, POLICY_CONFIGS[row], bits=bits, scoring=scoring))
    alone = _decoded(model, *_rows(model, tokenizer, lengths, POLICY_CONFIGS[row], bits=bits, scoring=scoring),
                     batch=False)
    assert [r.batch_size for r in together] == [3, 3, 3]
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    for a, b in zip(together, alone):
        assert all(cache.slots.groups > 0 and cache.slots.kept == cache.layer_budget for cache in a.caches)
        for x, y in zip(a.caches, b.caches):
            _same_slots(x, y)


def test_rows_join_a_running_batch_and_leave_it(tiny_model):
    model, tokenizer = tiny_model
    fields = POLICY_CONFIGS["pyramidkv"]
    first, context = _rows(model, tokenizer, [90, 150], fields, steps=12)
    first[1].max_tokens = 25
    later, _ = _rows(model, tokenizer, [70, 130], fields, steps=20)
    pending = [later]

    def refill(in_batch):
        return pending.pop() if pending and len(in_batch) < 2 else []

    with context(model):
        rows = decode_rows(model, first, refill=refill)
    assert len(rows) == 4
    assert max(r.batch_size for r in rows) >= 3, "the later rows joined the running batch"
    alone = _rows(model, tokenizer, [90, 150], fields, steps=12)[0] + _rows(model, tokenizer, [70, 130], fields,
                                                                            steps=20)[0]
    alone[1].max_tokens = 25
    _decoded(model, alone, context, batch=False)
    assert [r.tokens for r in rows] == [r.tokens for r in alone]
    for a, b in zip(rows, alone):
        for x, y in zip(a.caches, b.caches):
            _same_slots(x, y)


def test_a_batch_undoes_a_step_it_built_ahead(tiny_model):
    model, tokenizer = tiny_model
    rows, context = _rows(model, tokenizer, [80, 120], POLICY_CONFIGS["h2o"], steps=5)
    layers = batch_layers([row.caches for row in rows])
    assert all(isinstance(layer, QuantizedSlotsBatch) for layer in layers)
    with context(model):
        model(mx.array([[5], [6]]), cache=layers)
        saved = [layer.checkpoint() for layer in layers]
        before = [[mx.array(a) for a in layer.state] for layer in layers]
        for token in range(12):  # past a flush
            model(mx.array([[token + 3], [token + 4]]), cache=layers)
        for layer, checkpoint in zip(layers, saved):
            layer.restore(checkpoint)
    for layer, arrays in zip(layers, before):
        assert all(mx.array_equal(x, y).item() for x, y in zip(layer.state, arrays))


def test_a_quantized_row_costs_a_batch_its_codes(tiny_model):
    model, tokenizer = tiny_model
    quantized, _ = _rows(model, tokenizer, [150], POLICY_CONFIGS["pyramidkv"], steps=8)
    floats, _ = _rows(model, tokenizer, [150], POLICY_CONFIGS["pyramidkv"], bits=None, steps=8)
    footprint = row_footprint(quantized[0].caches, 8)
    assert footprint.batches
    assert decode_footprint([r.caches for r in quantized * 4], [8] * 4) < decode_footprint(
        [r.caches for r in floats * 4], [8] * 4)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_native_flush_is_the_mlx_flush_bit_for_bit(tiny_model, monkeypatch, bits):
    from velox_cache.generation import quantized_slots_batch
    from velox_cache.kernels import native

    if native.ops() is None:
        pytest.skip(f"native ops: {native.status()}")
    model, tokenizer = tiny_model
    held = []
    for use_native in (True, False):
        if not use_native:
            monkeypatch.setattr(quantized_slots_batch, "_native_flush", lambda dtype: None)
        rows, context = _rows(model, tokenizer, [120, 61, 170], POLICY_CONFIGS["h2o"], bits=bits)
        layers = batch_layers([row.caches for row in rows])
        with context(model):
            for step in range(25):
                model(mx.array([[step + 3]] * 3), cache=layers)
        assert all(layer.groups_bound.min() >= 2 for layer in layers), "every row flushed"
        held.append([np.array(a) for layer in layers for a in (*layer.state, layer.quantized, layer.groups,
                                                                layer.scale_room)])
    assert all(np.array_equal(a, b) for a, b in zip(*held))
