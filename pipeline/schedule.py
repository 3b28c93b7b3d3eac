"""The order of work in a group of documents: which variant goes first, and which rows decode together.

``execute`` runs a group's variants one after another (``variant_order``: the full
cache first, so that its outputs are the references of the others). Each variant's
documents are prefilled one at a time as the decoding batch has room for them
(``DecodeAdmission``): a prefilled row joins the running batch while the batch's
caches stay within ``generation.decode_batch_memory_mb`` until every row reaches
``max_tokens`` (``velox_cache.generation.batching.decode_footprint``: each row's
own caches, and the batch's buffers padded to its widest row) and it has fewer than
``generation.decode_batch_size`` rows; a finished row's place goes to the next
document (continuous batching). The budget holds for every row handed out until it is
done, batched or not: a row that cannot batch (``batch_refusal``) decodes alone and
counts what its own caches hold by its last token, beside the batch. A row too large
for the budget on its own decodes alone. What else a variant holds beside its decode
caches (a shared reading kept for the frontier, a snapshot for teacher forcing, the
caches of rows already done, the one prefilled row waiting for room) is not counted here.

The batches' make-up depends only on the rows (their caches and tokens), never on
time, so a job stores the same log-probabilities however its variants were
prefilled (alone or cut from one reading).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

from velox_cache.generation.batching import RowFootprint, batch_footprint, row_footprint
from velox_cache.generation.decode import DecodeRow, decode_rows

from .plan import full_first


def variant_order(items: Iterable) -> list[str]:
    """The names of the variants due on ``items``, full-cache variants first, then in the items' order."""
    due = {}
    for item in items:
        for variant in item.variants:
            due.setdefault(variant.name, variant)
    return [variant.name for variant in full_first(due.values())]


def footprint_of(row: DecodeRow) -> RowFootprint:
    """What ``row`` costs the batch it joins now, until it reaches its ``max_tokens`` (taken before it joins)."""
    return row_footprint(row.caches, row.max_tokens - len(row.tokens))


class DecodeAdmission:
    """Hands prefilled work to a decoding batch while it fits (behind a ``decode_rows`` ``refill``; see the module doc).

    ``work``: an iterator of prefilled items, pulled (prefilled) only when the batch
    may take one; ``row_of(item)`` is its ``DecodeRow``. ``taken``: every item handed
    out, in order; ``rest()``: what was not (the one that waited for room first).
    Every row handed out counts until it is ``done``, in the batch or decoding alone.
    """

    def __init__(self, work: Iterator, *, budget_bytes: int, max_rows: int,
                 row_of: Callable = lambda item: item.row, footprint: Optional[Callable] = None):
        if budget_bytes < 1 or max_rows < 1:
            raise ValueError(f"budget_bytes and max_rows: must be at least 1, got {budget_bytes} and {max_rows}")
        self._work, self.budget_bytes, self.max_rows = iter(work), budget_bytes, max_rows
        self._row_of = row_of
        self._footprint = footprint or footprint_of  # a row -> what batch_footprint (below) adds up
        self._total = batch_footprint if footprint is None else sum
        self._held: dict = {}  # id(row) -> (row, its footprint when handed out): rows not done yet
        self._waiting: Optional[object] = None
        self.taken: list = []

    def __call__(self, in_batch: list[DecodeRow]) -> list:
        """The work whose rows join ``in_batch`` now: the next items that fit beside every row handed out and not
        done (``in_batch``, and rows decoding alone), in order (none when the next does not)."""
        batched = {id(row) for row in in_batch}
        self._held = {key: held for key, held in self._held.items() if key in batched or not held[0].done}
        sizes = [size for _, size in self._held.values()]
        joining = []
        while len(in_batch) + len(joining) < self.max_rows:
            item = self._next()
            if item is None:
                break
            row = self._row_of(item)
            size = self._footprint(row)
            if sizes and self._total([*sizes, size]) > self.budget_bytes:
                self._waiting = item  # it joins once rows have left
                break
            sizes.append(size)
            self._held[id(row)] = (row, size)
            joining.append(item)
        self.taken += joining
        return joining

    def rest(self) -> Iterator:
        """The work not handed out yet, the one waiting for room first."""
        if self._waiting is not None:
            yield self._waiting
            self._waiting = None
        yield from self._work

    def _next(self):
        if self._waiting is not None:
            item, self._waiting = self._waiting, None
            return item
        return next(self._work, None)


def decode_within(model, rows: Iterable[DecodeRow], *, budget_bytes: int, max_rows: int) -> list[DecodeRow]:
    """Prefilled ``rows`` decoded as a job decodes a variant's rows: each joins the batch (or, where it cannot batch,
    decodes alone), in order, while it fits beside the rows not done (``DecodeAdmission``); returns them. The model's
    attention must be routed for them (``attention_routing``)."""
    admission = DecodeAdmission(iter(rows), budget_bytes=budget_bytes, max_rows=max_rows, row_of=lambda row: row)
    decode_rows(model, [], refill=admission)
    return admission.taken
