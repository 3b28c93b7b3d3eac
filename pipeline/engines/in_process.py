"""The in-process engine: one model in this process; documents in groups that decode together."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

from .. import model_store
from ..execute import VariantOutcome, execute_group
from ..plan import WorkItem
from ..spec import JobSpec
from . import BadModel


class InProcessEngine:
    """One model in this process; documents in groups of ``generation.decode_batch_size`` (see ``groups``).

    A group's documents are prefilled one after another and decode together
    (``execute.execute_group``); its outcomes come out when the whole group is
    done, so an interrupt abandons at most the group in flight.
    """

    name = "in-process"
    workers = 1
    address = None

    def __init__(self, *, load_model: Callable = model_store.load_model):
        self.load_model = load_model
        self.model = self.tokenizer = None

    def start(self, spec: JobSpec) -> tuple[object, Optional[int]]:
        try:
            self.model, self.tokenizer = self.load_model(spec.model)
        except (model_store.ModelImportError, ValueError, OSError) as exc:
            raise BadModel(str(exc)) from None
        return self.tokenizer, model_store.context_length(self.model)

    def run(self, items: Iterable[WorkItem]) -> Iterator[tuple[WorkItem, list[VariantOutcome]]]:
        for group in groups(items):
            yield from zip(group, execute_group(self.model, self.tokenizer, group))

    def close(self) -> None:
        self.model = self.tokenizer = None


LOOKAHEAD_GROUPS = 4  # groups are formed from this many groups' worth of items at a time


def groups(items: Iterable[WorkItem]) -> Iterator[list[WorkItem]]:
    """Items in groups of ``generation.decode_batch_size`` that batch well: similar prompt lengths.

    A batch pads every row's attention to its longest row, so the items of a window
    of ``LOOKAHEAD_GROUPS`` groups are sorted by prompt length before they are cut
    into groups (longest first); windows follow the input order.
    """
    window: list[WorkItem] = []
    for item in items:
        window.append(item)
        if len(window) >= item.generation.decode_batch_size * LOOKAHEAD_GROUPS:
            yield from _by_length(window)
            window = []
    yield from _by_length(window)


def _by_length(window: list[WorkItem]) -> Iterator[list[WorkItem]]:
    if not window:
        return
    size = window[0].generation.decode_batch_size
    ordered = sorted(window, key=lambda item: -len(item.prompt_tokens))
    for start in range(0, len(ordered), size):
        yield ordered[start : start + size]
