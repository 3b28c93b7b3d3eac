"""Engines: where planned work items run. The driver plans and persists; an engine executes.

An engine (``Engine``) has ``name``, ``workers`` and ``address`` (recorded on the run row) and:

* ``start(spec)`` -> ``(tokenizer, context length or None)``: what the driver needs to
  plan (build prompts); raises ``BadModel`` when the model cannot be used;
* ``run(items)`` -> ``(item, outcomes)`` once per work item, in completion order
  (``items`` may be a lazy iterator; the driver's store writes happen as it is consumed);
* ``close()``.

``in-process`` (``pipeline.engines.in_process``) runs items one after another on a model
held by the driver process; ``ray`` (``pipeline.engines.ray_engine``, needs the
``velox[ray]`` extra) runs them on many workers. ``make_engine`` imports either only
when asked for it, so importing this module loads neither MLX nor Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Protocol

if TYPE_CHECKING:
    from ..execute import VariantOutcome
    from ..plan import WorkItem
    from ..spec import EngineSpec, JobSpec

RAY_INSTALL_HINT = "pip install 'velox[ray]' (or: pip install 'ray[data]>=2.55,<2.64')"


class BadModel(ValueError):
    """The job's model cannot be loaded or used; the message says why."""


class EngineUnavailable(RuntimeError):
    """The engine asked for cannot be used: not installed here (the message says what to
    install) or its cluster does not answer."""


class Engine(Protocol):
    """What the runner needs of an engine; see the module docstring."""

    name: str
    workers: Optional[int]
    address: Optional[str]

    def start(self, spec: JobSpec) -> tuple[object, Optional[int]]: ...

    def run(self, items: Iterable[WorkItem]) -> Iterator[tuple[WorkItem, list[VariantOutcome]]]: ...

    def close(self) -> None: ...


def make_engine(settings: EngineSpec, *, load_model: Optional[Callable] = None) -> Engine:
    """The engine ``settings`` names; ``EngineUnavailable`` when Ray is asked for but not installed.

    ``load_model`` loads the model where documents run (default ``model_store.load_model``).
    """
    if load_model is None:
        from ..model_store import load_model
    if settings.name == "in-process":
        from .in_process import InProcessEngine

        return InProcessEngine(load_model=load_model)
    try:
        from .ray_engine import RayEngine
    except ImportError as exc:
        raise EngineUnavailable(f"engine.name: 'ray' needs Ray, which is not installed ({exc}): {RAY_INSTALL_HINT}") from None
    return RayEngine(settings, load_model=load_model)
