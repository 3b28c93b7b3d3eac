"""The in-process engine: one model in this process; documents one after another."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

from .. import model_store
from ..execute import VariantOutcome, execute
from ..plan import WorkItem
from ..spec import JobSpec
from . import BadModel


class InProcessEngine:
    """One model in this process; documents one after another."""

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
        for item in items:
            yield item, execute(self.model, self.tokenizer, item)

    def close(self) -> None:
        self.model = self.tokenizer = None
