"""Continuous batching: rows that join a running batch (``decode_rows(refill=...)``) decode as they do alone."""

import mlx.core as mx
import pytest

import velox_cache
from velox_cache.generation.batching import (
    BatchedLayer, BatchUnsupported, batch_layers, decode_footprint, join_layers,
)
from velox_cache.generation.decode import decode_rows

from tests.velox_cache.generation.test_batching_head_budgets import BATCHES, _assert_same, _prompt, _row


def _rows(model, batch_rows, eos=None):
    return [
        _row(model, _prompt(length, i), config, limit, (eos or {}).get(i, ()), seed=i)
        for i, (config, length, limit) in enumerate(batch_rows)
    ]


class Queue:
    """A refill that hands out one waiting row whenever fewer than ``width`` rows decode; records what it saw."""

    def __init__(self, rows, width: int):
        self.rows, self.width = list(rows), width
        self.seen: list[int] = []  # the batch's size at each call

    def __call__(self, in_batch):
        self.seen.append(len(in_batch))
        if self.rows and len(in_batch) < self.width:
            return [self.rows.pop(0)]
        return []


def _alone(model, batch_rows, eos=None):
    rows = _rows(model, batch_rows, eos)
    with velox_cache.observe(model):
        decode_rows(model, rows, batch=False, pipelined=False)
    return rows


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("name", ["mixed", "adaptive", "below-budget"])
def test_rows_joining_a_running_batch_decode_as_alone(tiny_model, name, pipelined):
    model, _ = tiny_model
    alone = _alone(model, BATCHES[name])
    first, *waiting = _rows(model, BATCHES[name])
    queue = Queue(waiting, width=2)
    with velox_cache.observe(model):
        rows = decode_rows(model, [first], pipelined=pipelined, refill=queue)
    assert rows[0] is first and len(rows) == len(alone)
    assert not queue.rows and 1 in queue.seen  # rows joined a batch that was decoding
    assert max(row.batch_size for row in rows) == 2
    _assert_same(alone, rows)


def test_rows_join_after_rows_that_stopped_at_eos(tiny_model):
    model, _ = tiny_model
    first = _alone(model, BATCHES["mixed"])
    eos = {0: (first[0].tokens[1],), 2: (first[2].tokens[3],)}
    alone = _alone(model, BATCHES["mixed"], eos)
    assert alone[0].stop_reason == "eos"
    rows = _rows(model, BATCHES["mixed"], eos)
    queue = Queue(rows[2:], width=3)
    with velox_cache.observe(model):
        decoded = decode_rows(model, rows[:2], refill=queue)
    _assert_same(alone, decoded)


def test_a_refill_row_that_stops_at_its_first_token_never_joins(tiny_model):
    model, _ = tiny_model
    first = _alone(model, BATCHES["mixed"])
    eos = {1: (first[1].tokens[0],)}  # row 1 stops before it is fed anything
    alone = _alone(model, BATCHES["mixed"], eos)
    rows = _rows(model, BATCHES["mixed"], eos)
    with velox_cache.observe(model):
        decoded = decode_rows(model, rows[:1], refill=Queue(rows[1:], width=2))
    assert decoded[1].tokens == [] and decoded[1].stop_reason == "eos"
    _assert_same(alone, decoded)


def test_unbatched_decoding_still_takes_every_refill_row(tiny_model):
    model, _ = tiny_model
    alone = _alone(model, BATCHES["mixed"])
    rows = _rows(model, BATCHES["mixed"])
    with velox_cache.observe(model):
        decoded = decode_rows(model, rows[:1], batch=False, refill=Queue(rows[1:], width=1))
    assert len(decoded) == len(alone) and all(row.batch_size == 1 for row in decoded)
    _assert_same(alone, decoded)


def test_a_layer_joins_rows_of_its_own_shape_only(tiny_model):
    model, _ = tiny_model
    rows = _rows(model, BATCHES["mixed"][:2])
    layer, other = BatchedLayer([rows[0].caches[0]]), BatchedLayer([rows[1].caches[0]])
    other.keys = other.keys.astype(mx.float16)
    with pytest.raises(BatchUnsupported, match="dtypes"):
        layer.join(other)
    assert len(layer.rows) == 1


def _buffers(layer: BatchedLayer) -> int:
    arrays = (layer.keys, layer.values, layer.scores, layer.positions, layer._flat)
    return sum(array.nbytes for array in arrays if array is not None)


@pytest.mark.parametrize("name", ["mixed", "adaptive", "below-budget"])
def test_the_footprint_bounds_what_a_batch_holds_at_every_step(tiny_model, monkeypatch, name):
    model, _ = tiny_model
    rows = _rows(model, BATCHES[name])
    own = sum(cache.nbytes for row in rows for cache in row.caches)
    bound = decode_footprint([row.caches for row in rows], [row.max_tokens for row in rows])
    held, most = {}, []
    update = BatchedLayer.update_and_fetch

    def recording(layer, keys, values):
        result = update(layer, keys, values)
        held[layer.layer] = _buffers(layer)
        most.append(sum(held.values()))
        return result

    monkeypatch.setattr(BatchedLayer, "update_and_fetch", recording)
    with velox_cache.observe(model):
        decode_rows(model, rows)
    assert max(most) > 0 and own + max(most) <= bound


def test_a_full_rows_footprint_grows_with_its_new_tokens_and_an_evicting_rows_stops_at_its_budget(tiny_model):
    model, _ = tiny_model
    (full, _, _), (pyramid, _, _) = BATCHES["mixed"][2], BATCHES["mixed"][1]
    full_row, pyramid_row = (_row(model, _prompt(60, 0), config, 8) for config in (full, pyramid))
    assert decode_footprint([full_row.caches], [300]) - decode_footprint([full_row.caches], [10]) > 0
    assert decode_footprint([pyramid_row.caches], [300]) == decode_footprint([pyramid_row.caches], [100])
    together = decode_footprint([full_row.caches, pyramid_row.caches], [10, 10])
    assert together > decode_footprint([full_row.caches], [10]) + decode_footprint([pyramid_row.caches], [10])  # padding
    with pytest.raises(ValueError, match="new_tokens"):
        decode_footprint([full_row.caches], [])


def test_rows_that_left_a_batch_going_on_hold_their_own_arrays_not_the_batchs(tiny_model, monkeypatch):
    """A row that leaves while others decode on holds its own arrays: no batch buffer of a step stays alive through
    it (only the last batch's, whose rows all left together, stays until their caches are used or dropped)."""
    model, _ = tiny_model
    first, *waiting = _rows(model, BATCHES["mixed"] * 3)
    mx.eval([cache.state for row in [first, *waiting] for cache in row.caches])
    mx.clear_cache()
    before = mx.get_active_memory()
    last = {}
    update = BatchedLayer.update_and_fetch

    def recording(layer, keys, values):
        result = update(layer, keys, values)
        last[layer.layer] = _buffers(layer)
        return result

    monkeypatch.setattr(BatchedLayer, "update_and_fetch", recording)
    with velox_cache.observe(model):
        decode_rows(model, [first], refill=Queue(waiting, width=3))
    mx.clear_cache()
    assert mx.get_active_memory() - before <= sum(last.values()) + 64 * 1024


def test_decode_seconds_add_up_to_the_steps_and_leave_out_the_prefill_of_rows_that_join(tiny_model):
    """A refill prefills while the batch waits: that time is no row's decode time."""
    import time

    model, _ = tiny_model
    first, *waiting = _rows(model, BATCHES["mixed"])
    queue = Queue(waiting, width=2)
    pause, paused = 0.25, []

    def prefilling(in_batch):
        joining = queue(in_batch)
        if joining:
            time.sleep(pause)  # what prefilling the joining row would take
            paused.append(pause)
        return joining

    start = time.perf_counter()
    with velox_cache.observe(model):
        rows = decode_rows(model, [first], refill=prefilling)
    wall = time.perf_counter() - start
    decoded = sum(row.decode_seconds for row in rows)
    assert len(paused) == len(waiting) and 0 < decoded <= wall - sum(paused)


def _odd_last_layer(rows):
    """The last row's last layer holds its keys in another dtype: that layer alone refuses to join it."""
    odd = rows[-1].caches[-1]
    odd.keys = odd.keys.astype(mx.float16)
    return rows


def test_rows_a_deeper_layer_refuses_are_joined_to_no_layer(tiny_model):
    model, _ = tiny_model
    rows = _odd_last_layer(_rows(model, BATCHES["mixed"][:3]))
    layers, joining = batch_layers([row.caches for row in rows[:2]]), batch_layers([rows[2].caches])
    with pytest.raises(BatchUnsupported, match="dtypes"):
        join_layers(layers, joining)
    assert {len(layer.rows) for layer in layers} == {2}


def test_a_row_that_cannot_join_decodes_alone_and_the_batch_goes_on(tiny_model):
    model, _ = tiny_model
    alone = _alone(model, BATCHES["mixed"][:3])
    rows = _odd_last_layer(_rows(model, BATCHES["mixed"][:3]))
    later = [rows[2]]

    def once_decoding(in_batch):  # the third row comes once the first two decode together
        return [later.pop()] if in_batch and later else []

    with velox_cache.observe(model):
        decoded = decode_rows(model, rows[:2], refill=once_decoding)
    assert [row.batch_size for row in decoded] == [2, 2, 1]
    _assert_same(alone[:2], decoded[:2])
    assert decoded[2].tokens == alone[2].tokens
