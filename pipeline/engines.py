"""Engines: where planned work items run. The driver plans and persists; an engine executes.

An engine has ``name``, ``workers`` and ``address`` (recorded on the run row) and:

* ``start(spec)`` -> ``(tokenizer, context length or None)``: what the driver needs to
  plan (build prompts); raises ``BadModel`` when the model cannot be used;
* ``run(items)`` -> ``(item, outcomes)`` once per work item, in completion order
  (``items`` may be a lazy iterator; the driver's store writes happen as it is consumed);
* ``close()``.

``in-process`` runs items one after another on a model held by the driver process;
``ray`` (``pipeline.ray_engine``, needs the ``velox[ray]`` extra) runs them on many workers.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

from . import model_store
from .execute import VariantOutcome, execute
from .plan import WorkItem
from .spec import EngineSpec, JobSpec

RAY_INSTALL_HINT = "pip install 'velox[ray]' (or: pip install 'ray[data]>=2.55,<2.64')"


class BadModel(ValueError):
    """The job's model cannot be loaded or used; the message says why."""


class EngineUnavailable(RuntimeError):
    """The engine asked for cannot be used: not installed here (the message says what to
    install) or its cluster does not answer."""


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


def make_engine(settings: EngineSpec, *, load_model: Callable = model_store.load_model):
    """The engine ``settings`` names; ``EngineUnavailable`` when Ray is asked for but not installed."""
    if settings.name == "in-process":
        return InProcessEngine(load_model=load_model)
    try:
        from .ray_engine import RayEngine
    except ImportError as exc:
        raise EngineUnavailable(f"engine.name: 'ray' needs Ray, which is not installed ({exc}): {RAY_INSTALL_HINT}") from None
    return RayEngine(settings, load_model=load_model)
