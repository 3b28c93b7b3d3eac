"""Rows of every kind (float or quantized, evicting or full) decoding in one batch (``MixedBatch``)."""

import mlx.core as mx
import pytest

import velox_cache
from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases
from velox_cache.generation.batching import BatchedLayer, batch_layers
from velox_cache.generation.decode import DecodeRow, decode_rows
from velox_cache.generation.mixed_batch import MixedBatch
from velox_cache.generation.sampling import TokenSampler

TEXT = "Rows of four kinds share one model call and each decodes as it would alone. " * 8
KINDS = {
    "pyramidkv-kv8": dict(method="pyramidkv", budget=40, kv_bits=8),
    "pyramidkv": dict(method="pyramidkv", budget=40),
    "full-kv4": dict(method="full", kv_bits=4, kv_group_size=16, kv_window=8),
    "full": dict(method="full"),
}


def _rows(model, tokenizer, kinds, lengths, steps=20):
    made = []
    for kind, length in zip(kinds, lengths):
        stack = KVCacheBuilder.for_model(model, KVCacheConfig(**KINDS[kind], scoring="observed"), prompt_tokens=length)
        with velox_cache.observe(model):
            logits = prefill_phases(model, stack, document=tokenizer.encode(TEXT)[:length], max_new_tokens=steps)
        sampler = TokenSampler()
        made.append(DecodeRow(stack, sampler, sampler.logprobs(logits), steps))
    return made


@pytest.mark.parametrize("pipelined", [False, True])
def test_rows_of_every_kind_decode_in_one_batch_as_alone(tiny_model, pipelined):
    model, tokenizer = tiny_model
    kinds, lengths = ["pyramidkv-kv8", "full", "full-kv4", "pyramidkv", "pyramidkv-kv8"], [120, 60, 90, 150, 75]
    rows = _rows(model, tokenizer, kinds, lengths)
    rows[1].max_tokens = 9  # leaves early: the batch filters its part
    layers = batch_layers([row.caches for row in rows])
    assert all(isinstance(layer, MixedBatch) and len(layer.parts) == 3 for layer in layers), "float rows share a part"
    with velox_cache.observe(model):
        decode_rows(model, rows, pipelined=pipelined)
    alone = _rows(model, tokenizer, kinds, lengths)
    alone[1].max_tokens = 9
    with velox_cache.observe(model):
        decode_rows(model, alone, batch=False)
    assert [row.batch_size for row in rows] == [5] * 5
    assert [row.tokens for row in rows] == [row.tokens for row in alone]
    for a, b in zip(rows, alone):
        assert [cache.offset for cache in a.caches] == [cache.offset for cache in b.caches]
        assert [cache.nbytes for cache in a.caches] == [cache.nbytes for cache in b.caches]


def test_a_row_of_another_kind_joins_a_running_batch(tiny_model):
    model, tokenizer = tiny_model
    first = _rows(model, tokenizer, ["pyramidkv", "pyramidkv"], [100, 70], steps=14)
    first[0].max_tokens = 5
    later = _rows(model, tokenizer, ["pyramidkv-kv8", "full-kv4"], [130, 80], steps=14)
    pending = [later]

    def refill(in_batch):
        return pending.pop() if pending and len(in_batch) == 1 else []

    with velox_cache.observe(model):
        rows = decode_rows(model, first, refill=refill)
    assert [row.batch_size for row in rows] == [2, 3, 3, 3], "the quantized rows joined the float one's batch"
    alone = _rows(model, tokenizer, ["pyramidkv", "pyramidkv", "pyramidkv-kv8", "full-kv4"], [100, 70, 130, 80],
                  steps=14)
    alone[0].max_tokens = 5
    with velox_cache.observe(model):
        decode_rows(model, alone, batch=False)
    assert [row.tokens for row in rows] == [row.tokens for row in alone]


def test_one_kind_needs_no_mixed_batch(tiny_model):
    model, tokenizer = tiny_model
    rows = _rows(model, tokenizer, ["pyramidkv", "pyramidkv"], [60, 80], steps=3)
    assert all(isinstance(layer, BatchedLayer) for layer in batch_layers([row.caches for row in rows]))
    assert mx.array_equal(batch_layers([row.caches for row in rows])[0].offset, mx.array([60, 80])).item()
