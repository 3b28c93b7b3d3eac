"""The decode memory budget holds for every row, batched or alone, measured from the arrays held at every step."""

import pytest
from mlx_lm.models.cache import RotatingKVCache

import pipeline.schedule as schedule
import velox_cache
from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases
from velox_cache.generation.batching import batch_refusal, decode_footprint, row_kind
from velox_cache.generation.decode import DecodeRow
from velox_cache.generation.sampling import TokenSampler

from tests.velox_cache.generation.held import MeasuredModel

TEXT = "Rows of every kind under one budget, batched or alone, and never more than it. " * 8
CONFIGS = {
    "full": dict(method="full"),
    "pyramidkv": dict(method="pyramidkv", budget=40),
    "full-kv4": dict(method="full", kv_bits=4, kv_group_size=16, kv_window=8),
    "pyramidkv-kv8": dict(method="pyramidkv", budget=40, kv_bits=8),
}
# (config, prompt length, new tokens, refused): every kind, rows that leave early beside ones that stay, and rows
# batch_refusal sends to decode alone: a quantized full cache whose decoding has not started, and a stack with a
# sliding-window layer (mlx-lm's RotatingKVCache) whose full layers grow past a buffer step alone
MIX = [
    ("full-kv4", 400, 3, None), ("full", 120, 30, None), ("pyramidkv", 150, 20, None), ("pyramidkv-kv8", 300, 4, None),
    ("full-kv4", 100, 20, "undecided"), ("full", 250, 30, "sliding"), ("full-kv4", 60, 25, None),
    ("pyramidkv-kv8", 130, 30, None), ("pyramidkv", 70, 12, None), ("full", 60, 10, None),
    ("full-kv4", 140, 18, "undecided"), ("pyramidkv-kv8", 110, 15, None), ("full-kv4", 45, 30, None),
]


def _row(model, tokenizer, name, length, steps, refused):
    stack = KVCacheBuilder.for_model(model, KVCacheConfig(**CONFIGS[name], scoring="observed"), prompt_tokens=length)
    if refused == "sliding":
        stack[-1] = RotatingKVCache(max_size=32, keep=4)
    with velox_cache.observe(model):
        logits = prefill_phases(model, stack, document=tokenizer.encode(TEXT)[:length], max_new_tokens=steps,
                                tell_decode=refused != "undecided")
    sampler = TokenSampler()
    return DecodeRow(stack, sampler, sampler.logprobs(logits), steps)


class _Admissions(schedule.DecodeAdmission):
    made: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.made.append(self)


@pytest.mark.parametrize("budget_mb", [0.8, 1.4, 2.4])
def test_float_quantized_evicting_and_refused_rows_never_hold_more_than_the_budget(tiny_model, monkeypatch, budget_mb):
    model, tokenizer = tiny_model
    rows = [_row(model, tokenizer, *spec) for spec in MIX]
    refused = [row for row in rows if batch_refusal(row.caches) is not None]
    assert len(refused) == 3
    assert {row_kind(cache).name for row in rows for cache in row.caches} == {
        "float full", "float evicting", "quantized full", "quantized evicting", "no batch"}
    budget = int(budget_mb * 2**20)
    assert max(decode_footprint([row.caches], [row.max_tokens]) for row in rows) <= budget  # each fits on its own
    monkeypatch.setattr(schedule, "DecodeAdmission", _Admissions)
    _Admissions.made = []
    measured = MeasuredModel(model, lambda: [row for admission in _Admissions.made for row in admission.taken
                                             if not row.done])
    with velox_cache.observe(model):
        decoded = schedule.decode_within(measured, rows, budget_bytes=budget, max_rows=8)
    assert decoded == rows and all(row.done for row in rows)
    assert max(row.batch_size for row in rows) >= 3 and all(row.batch_size == 1 for row in refused)
    assert 0 < max(held for held, _ in measured.held) <= budget
