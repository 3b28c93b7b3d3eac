"""``decode_footprint``: every layer of every row counted, whatever kinds the rows are, and never below what is held."""

import pytest
from mlx_lm.models.cache import RotatingKVCache

import velox_cache
from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases
from velox_cache.generation.batching import KINDS, batch_layers, batch_refusal, decode_footprint, row_kind
from velox_cache.generation.decode import DecodeRow, decode_rows
from velox_cache.generation.mixed_batch import MixedBatch
from velox_cache.generation.sampling import TokenSampler

from tests.velox_cache.generation.held import MeasuredModel

TEXT = "Every layer of every row is counted, float or quantized, full or evicting. " * 8
KINDS_OF_ROWS = {  # config fields, and the kind each of its layers is
    "full": (dict(method="full"), "float full"),
    "pyramidkv": (dict(method="pyramidkv", budget=40), "float evicting"),
    "full-kv4": (dict(method="full", kv_bits=4, kv_group_size=16, kv_window=8), "quantized full"),
    "pyramidkv-kv8": (dict(method="pyramidkv", budget=40, kv_bits=8), "quantized evicting"),
    "pyramidkv-roomy": (dict(method="pyramidkv", budget=200, fit_budgets=False), "float evicting"),  # below budget
    "h2o-roomy": (dict(method="h2o", budget=200, fit_budgets=False), "float evicting"),  # and no spare slots
}
MIX = [("full-kv4", 150, 6), ("full", 60, 20), ("pyramidkv-kv8", 130, 16), ("pyramidkv", 90, 12), ("full-kv4", 70, 24),
       ("pyramidkv-kv8", 60, 9)]


def _rows(model, tokenizer, mix, *, sliding=False, tell_decode=True, **overrides):
    made = []
    for name, length, steps in mix:
        fields = {**KINDS_OF_ROWS[name][0], **({} if name.startswith("full") else overrides)}
        stack = KVCacheBuilder.for_model(model, KVCacheConfig(**fields, scoring="observed"), prompt_tokens=length)
        if sliding:  # a sliding-window layer: the stack cannot batch
            stack[-1] = RotatingKVCache(max_size=32, keep=4)
        with velox_cache.observe(model):
            logits = prefill_phases(model, stack, document=tokenizer.encode(TEXT)[:length], max_new_tokens=steps,
                                    tell_decode=tell_decode)
        sampler = TokenSampler()
        made.append(DecodeRow(stack, sampler, sampler.logprobs(logits), steps))
    return made


def _footprint(rows) -> int:
    return decode_footprint([row.caches for row in rows], [row.max_tokens for row in rows])


def test_every_kind_of_row_is_declared_once_and_each_layer_is_of_its_configs_kind(tiny_model):
    model, tokenizer = tiny_model
    assert len({kind.name for kind in KINDS}) == len(KINDS)
    for (name, _, _), row in zip(MIX, _rows(model, tokenizer, MIX)):
        assert {row_kind(cache).name for cache in row.caches} == {KINDS_OF_ROWS[name][1]}


def test_a_float_and_quantized_mix_counts_every_layer_of_every_row(tiny_model):
    """Each kind pads its own part of a mixed layer (``MixedBatch``), so a mix costs what each kind's rows cost in a
    batch of their own, all of them added: no row's layer is left out (a quantized row has more parts per layer)."""
    model, tokenizer = tiny_model
    rows = _rows(model, tokenizer, MIX)
    assert all(isinstance(layer, MixedBatch) and len(layer.parts) == 3 for layer in batch_layers([r.caches for r in rows]))
    by_holder = {}
    for row in rows:
        by_holder.setdefault(row_kind(row.caches[0]).holder, []).append(row)
    assert len(by_holder) == 3  # float rows (full and evicting) share a part
    assert _footprint(rows) == sum(_footprint(same) for same in by_holder.values())
    for index in range(len(rows)):  # and every row adds what it costs its own kind's part
        rest = rows[:index] + rows[index + 1:]
        assert _footprint(rows) > _footprint(rest)


# rows of one kind each (the widest leaving first), then every kind in one batch
BATCHES = {
    **{name: [(name, 300, 3), (name, 60, 20), (name, 75, 14)] for name in KINDS_OF_ROWS if "roomy" not in name},
    "below budget": [("pyramidkv-roomy", 60, 5), ("pyramidkv-roomy", 70, 4)],  # the widest row's growth widens them
    "every kind": MIX,
}


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_a_batch_never_holds_more_than_its_footprint(tiny_model, batch, pipelined):
    model, tokenizer = tiny_model
    rows = _rows(model, tokenizer, BATCHES[batch])
    bound = _footprint(rows)
    measured = MeasuredModel(model, lambda: [row for row in rows if not row.done])
    with velox_cache.observe(model):
        decode_rows(measured, rows, pipelined=pipelined)
    assert max(width for _, width in measured.held) == len(rows)
    assert 0 < max(held for held, _ in measured.held) <= bound


@pytest.mark.parametrize("batch", [name for name in BATCHES if name in KINDS_OF_ROWS])
def test_once_the_widest_row_leaves_a_batch_holds_no_more_than_the_rows_left_cost(tiny_model, batch):
    """A batch narrows its buffers to the rows it keeps: what a refill admits beside them is counted from theirs."""
    model, tokenizer = tiny_model
    widest, *rest = _rows(model, tokenizer, BATCHES[batch])
    bound = _footprint(rest)
    if batch.endswith("kv8"):  # a larger budget: a wider region, groups and window than the rows that stay
        widest = _rows(model, tokenizer, [(batch, 300, 3)], budget=120)[0]
    measured = MeasuredModel(model, lambda: [row for row in rest if not row.done])
    with velox_cache.observe(model):
        decode_rows(measured, [widest, *rest])
    after = [held for held, width in measured.held if width == len(rest)]
    assert after and max(after) <= bound


@pytest.mark.parametrize("name,length,refused", [
    ("full", 250, dict(sliding=True)), ("h2o-roomy", 60, dict(sliding=True)),
    ("full-kv4", 250, dict(tell_decode=False)),
])
def test_a_row_that_decodes_alone_never_holds_more_than_its_footprint(tiny_model, name, length, refused):
    """Its own caches by its last token: a full layer past its buffer's step, an evicting one up to its budget, a
    quantized one's window."""
    model, tokenizer = tiny_model
    row, = _rows(model, tokenizer, [(name, length, 30)], **refused)
    assert batch_refusal(row.caches) is not None
    bound = _footprint([row])
    measured = MeasuredModel(model, lambda: [] if row.done else [row])
    with velox_cache.observe(model):
        decode_rows(measured, [row])
    assert len(row.tokens) == 30 and 0 < max(held for held, _ in measured.held) <= bound
