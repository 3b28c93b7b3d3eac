"""The order of work: variants full first; rows admitted to a decoding batch while they fit its budget."""

from types import SimpleNamespace

import pytest

from pipeline.schedule import DecodeAdmission, variant_order


def _item(*variants):
    return SimpleNamespace(variants=[SimpleNamespace(name=name, cache=SimpleNamespace(method=method))
                                     for name, method in variants])


def test_full_variants_go_first_and_the_others_keep_their_order():
    items = [_item(("pyr", "pyramidkv"), ("full", "full")), _item(("sq", "squeeze"), ("pyr", "pyramidkv"))]
    assert variant_order(items) == ["full", "pyr", "sq"]


class Work:
    """Rows of given sizes, prefilled (counted) only when pulled; a row is done when the test says so."""

    def __init__(self, sizes):
        self.sizes, self.pulled = list(sizes), 0

    def __iter__(self):
        for size in self.sizes:
            self.pulled += 1
            yield SimpleNamespace(row=SimpleNamespace(size=size, done=False))


def _admission(sizes, budget, max_rows):
    work = Work(sizes)
    return work, DecodeAdmission(iter(work), budget_bytes=budget, max_rows=max_rows, footprint=lambda row: row.size)


def _rows(items):
    return [item.row for item in items]


def _sizes(items):
    return [item.row.size for item in items]


def _finish(*rows):
    for row in rows:
        row.done = True


def test_rows_join_while_they_fit_and_the_next_waits_for_room_unprefilled_work_behind_it():
    work, admit = _admission([3, 4, 2, 5], budget=8, max_rows=4)
    three, four = _rows(admit([]))
    assert (three.size, four.size) == (3, 4)  # 3 + 4 + 2 > 8: the third waits
    assert work.pulled == 3  # the waiting one is prefilled, nothing after it
    assert admit([three, four]) == []  # no room yet
    _finish(three)
    two, = _rows(admit([four]))  # a row left: the waiting one joins; 5 does not fit yet
    assert two.size == 2
    _finish(four, two)
    assert _sizes(admit([])) == [5]
    _finish(*_rows(admit.taken))
    assert admit([]) == [] and _sizes(admit.taken) == [3, 4, 2, 5]


def test_at_most_max_rows_decode_together():
    _, admit = _admission([1] * 5, budget=100, max_rows=2)
    first, second = _rows(admit([]))
    _finish(first)
    assert len(admit([second])) == 1


def test_a_row_larger_than_the_budget_decodes_alone():
    _, admit = _admission([20, 1], budget=8, max_rows=4)
    large, = _rows(admit([]))
    assert large.size == 20
    assert admit([large]) == []
    _finish(large)
    assert _sizes(admit([])) == [1]


def test_a_row_decoding_alone_counts_until_it_is_done():
    """A row that cannot batch is in no ``in_batch``: it still holds its caches, so it counts until it is done."""
    _, admit = _admission([5, 2, 4, 3], budget=8, max_rows=4)
    alone, batched = _rows(admit([]))  # 5 + 2 + 4 > 8
    assert admit([batched]) == []  # the one decoding alone (5) and the batched one (2) leave no room for 4
    _finish(batched)
    assert admit([]) == []  # 5 + 4 > 8: still no room while it decodes
    _finish(alone)
    assert _sizes(admit([])) == [4, 3]


def test_what_was_not_handed_out_is_the_rest_the_waiting_one_first():
    _, admit = _admission([6, 6, 1], budget=8, max_rows=4)
    admit([])
    assert [item.row.size for item in admit.rest()] == [6, 1]


def test_a_budget_or_width_below_one_is_refused_by_name():
    with pytest.raises(ValueError, match="budget_bytes and max_rows"):
        DecodeAdmission(iter([]), budget_bytes=0, max_rows=4)


def test_a_decoding_rows_size_is_the_one_it_joined_with():
    """Once a row decodes in a batch its own caches' counts stand still: what it joined with is what it costs."""
    rows = [SimpleNamespace(size=5, done=False), SimpleNamespace(size=5, done=False), SimpleNamespace(size=3, done=False)]
    admit = DecodeAdmission(iter(SimpleNamespace(row=row) for row in rows), budget_bytes=10, max_rows=4,
                            footprint=lambda row: row.size)
    first = [item.row for item in admit([])]
    assert first == rows[:2]
    rows[0].size = rows[1].size = 1  # what a stale reading of their counts would say
    assert admit(first) == []  # 5 + 5 + 3 > 10: the third still waits
    _finish(rows[0])
    assert [item.row for item in admit(first[1:])] == [rows[2]]
