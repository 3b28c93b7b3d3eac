"""``run_job``: every document through every variant, results into the store.

Exit statuses (also of ``velox-batch run``):

* 0 every document was done, skipped by the limits, or already done before;
* 1 at least one document failed (its error is stored; the run went on);
* 2 the job spec, its input, its store path or its model is invalid, or the ray engine is not
  installed or not reachable (nothing was run);
* 3 another run holds the store (nothing was run);
* 4 the run stopped on an unexpected error (a bug, a full disk): marked ``failed``;
* 130 / 143 (128 + the signal) SIGINT (Ctrl-C) or SIGTERM stopped it: the document in
  progress is abandoned (nothing of it is stored), the run is marked ``interrupted``, the
  lock released; the next run resumes.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from . import model_store
from .engines import BadModel, EngineUnavailable, make_engine
from .persist import save_outcomes, settle, settle_frontier
from .plan import DocumentPlan, plan_documents, streams
from .platform import loaded_blas, package_version
from .source import count_documents, open_dataset
from .spec import JobSpec, SpecError
from .store import Store, StoreError, StoreLocked

EXIT_OK, EXIT_DOCUMENT_FAILED, EXIT_BAD_INPUT, EXIT_LOCKED, EXIT_CRASHED = 0, 1, 2, 3, 4
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_status_for_signal(signum: int) -> int:
    """128 + the signal number, as shells report a command a signal stopped: 130 SIGINT, 143 SIGTERM."""
    return 128 + int(signum)


class JobError(RuntimeError):
    """The job cannot run; ``exit_status`` says why."""

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; raised where the runner was, so no handler for errors swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


class _SignalGuard:
    """While armed, the first SIGINT or SIGTERM raises ``Interrupted``; later ones are ignored.

    Only in the main thread (Python delivers signals there); elsewhere it does nothing.
    """

    def __init__(self):
        self.armed = False

    def _handler(self, signum, frame):
        if self.armed:
            self.armed = False
            raise Interrupted(signum)

    def disarm(self) -> None:
        self.armed = False

    @contextmanager
    def installed(self) -> Iterator["_SignalGuard"]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {signum: signal.getsignal(signum) for signum in HANDLED_SIGNALS}
        self.armed = True
        for signum in HANDLED_SIGNALS:
            signal.signal(signum, self._handler)
        try:
            yield self
        finally:
            self.armed = False
            for signum, handler in previous.items():
                signal.signal(signum, handler)


@dataclass
class RunSummary:
    run_id: int
    db: str
    counts: dict = field(default_factory=dict)
    status: str = "done"
    signal: Optional[int] = None  # the signal that interrupted the run

    @property
    def signal_name(self) -> Optional[str]:
        return signal.Signals(self.signal).name if self.signal is not None else None

    @property
    def exit_status(self) -> int:
        if self.signal is not None:
            return exit_status_for_signal(self.signal)
        return EXIT_DOCUMENT_FAILED if self.counts.get("documents_failed") else EXIT_OK


class Progress:
    """A tqdm bar on a terminal; plain log lines otherwise (cron); nothing when quiet."""

    def __init__(self, total: int, quiet: bool, stream=None):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.total = total
        self.count = 0
        self.bar = None
        if not quiet and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="doc", file=self.stream)

    def note(self, message: str) -> None:
        """One line for the operator (not shown when quiet)."""
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(f"note: {message}", file=self.stream)
        else:
            print(f"note: {message}", file=self.stream, flush=True)

    def document_done(self, document_id: str, outcomes: list[str], tokens_per_second: Optional[float]) -> None:
        self.count += 1
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.update(1)
            if tokens_per_second:
                self.bar.set_postfix(tok_s=f"{tokens_per_second:.1f}")
            return
        rate = f" {tokens_per_second:.1f} tok/s" if tokens_per_second else ""
        print(f"[{self.count}/{self.total}] {document_id}: {', '.join(outcomes)}{rate}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_job(
    spec: JobSpec,
    *,
    force: bool = False,
    quiet: bool = False,
    load_model: Callable = model_store.load_model,
    progress_stream=None,
) -> RunSummary:
    """Run ``spec`` on the engine it names; raises ``JobError`` (exit status 2, 3, 130 or 143) when nothing ran.

    The run is three steps that both engines share: plan (``pipeline.plan``: store
    reads decide which document × variant work is due), execute (``pipeline.execute``:
    in this process or on Ray workers) and persist (``pipeline.persist``: store writes,
    by this process only, under the run lock). ``load_model`` loads the model where
    documents run (in a Ray worker, too: it must then be picklable).

    SIGINT and SIGTERM stop the run between two Python steps (at the latest after the
    prefill chunk or decode step in progress): the summary then has ``status``
    ``interrupted`` and ``signal`` set. Any other exception marks the run ``failed``
    and propagates.
    """
    guard = _SignalGuard()
    with guard.installed():
        try:
            dataset = open_dataset(spec)  # validates files and columns before any model is loaded
            engine = make_engine(spec.engine, load_model=load_model)
            store = Store(spec.output.db)
            with store.locked():
                store.close_abandoned_runs()
                return _run_locked(spec, store, dataset, engine, force, quiet, progress_stream, guard)
        except (SpecError, StoreError, EngineUnavailable) as exc:
            raise JobError(str(exc), EXIT_BAD_INPUT) from None
        except StoreLocked as exc:
            raise JobError(str(exc), EXIT_LOCKED) from None
        except Interrupted as exc:
            message = f"interrupted by {exc} before the run started; nothing was run"
            raise JobError(message, exit_status_for_signal(exc.signum)) from None


def _run_locked(spec, store, dataset, engine, force, quiet, progress_stream, guard) -> RunSummary:
    import mlx.core as mx

    total_rows = count_documents(dataset)
    limit = spec.limits.max_documents
    total = min(total_rows, limit) if limit else total_rows
    run_id = store.start_run(
        {
            "job_name": spec.name,
            "spec_path": spec.source,
            "spec": json.dumps(spec.as_dict(), default=str),
            "spec_hash": spec.settings_hash(),
            "model": spec.model,
            "velox_version": package_version("velox"),
            "mlx_version": package_version("mlx"),
            "mlx_lm_version": package_version("mlx-lm"),
            "device": f"{mx.default_device()} ({model_store.backend_name()}; BLAS: {loaded_blas()}; "
                      f"weights: {' '.join(model_store.hashed_weights().values())})",
            "host": socket.gethostname(),
            "documents_total": total * len(spec.variants),
            "engine": engine.name,
            "workers": engine.workers,
            "address": engine.address,
        }
    )
    counts = {"documents_done": 0, "documents_skipped": 0, "documents_failed": 0, "documents_unchanged": 0}
    status, error, signum, progress = "failed", None, None, None
    try:
        tokenizer, context = _start(spec, engine)
        store.update_run(run_id, workers=engine.workers, address=engine.address)
        settings_hash = spec.output_settings_hash(**model_store.hashed_weights())
        progress = Progress(total, quiet, progress_stream)
        if spec.input.prompt_column and any(streams(v) for v in spec.variants):
            progress.note(
                "input.prompt_column: a ready prompt has no instruction to probe with; streaming variants "
                "rank each chunk by its own last queries (SnapKV per chunk)"
            )
        running: dict[int, DocumentPlan] = {}

        def document_finished(plan: DocumentPlan, outcomes: list[str], rates: list[float]) -> None:
            """Count one document's outcomes (one per variant, in ``plan.variants`` order) and report it."""
            for outcome in outcomes:
                counts[f"documents_{outcome}"] += 1
            store.update_run(run_id, **counts)
            labels = [f"{entry.variant.name} {outcome}" for entry, outcome in zip(plan.variants, outcomes)]
            progress.document_done(plan.prepared.document.document_id, labels, sum(rates) / len(rates) if rates else None)

        def due_work():
            """Settle what needs no running, in input order; hand the rest to the engine."""
            for plan in plan_documents(spec, dataset, store, tokenizer, context, settings_hash, force=force):
                settled = [settle(store, run_id, plan, entry) for entry in plan.variants if entry.state != "due"]
                settle_frontier(store, plan)
                if plan.work is None:
                    document_finished(plan, settled, [])
                else:
                    running[plan.index] = plan
                    yield plan.work

        for item, outcomes in engine.run(due_work()):
            plan = running.pop(item.index)
            results = save_outcomes(store, run_id, plan, outcomes)
            labels = [results[e.variant.name][0] if e.state == "due" else e.state for e in plan.variants]
            document_finished(plan, labels, [rate for _, rate in results.values() if rate])
        status = "done_with_errors" if counts["documents_failed"] else "done"
    except Interrupted as exc:
        status, error, signum = "interrupted", str(exc), exc.signum
    except KeyboardInterrupt:  # raised by code that turned a SIGINT into one itself
        status, error, signum = "interrupted", "SIGINT", int(signal.SIGINT)
    except JobError as exc:
        error = str(exc)
        raise
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        guard.disarm()  # the run is marked and the lock released whatever arrives now
        if progress is not None:
            progress.close()
        try:
            engine.close()
        finally:
            try:
                store.finish_run(run_id, status, counts, error=error)
            except Exception:
                if error is None or status == "interrupted":
                    raise  # otherwise the error that stopped the run is the one to report
    return RunSummary(run_id, str(spec.output.db), counts, status=status, signal=signum)


def _start(spec: JobSpec, engine):
    """Start ``engine``: ``(tokenizer, context length or None)``; a bad model or a context too small is a ``JobError``."""
    try:
        tokenizer, context = engine.start(spec)
    except BadModel as exc:
        raise JobError(f"model: {exc}", EXIT_BAD_INPUT) from None
    except EngineUnavailable as exc:
        raise JobError(str(exc), EXIT_BAD_INPUT) from None
    if context is not None and spec.generation.max_tokens >= context:
        raise JobError(
            f"generation.max_tokens: {spec.generation.max_tokens} leaves no room for a prompt in the "
            f"model's context of {context} positions",
            EXIT_BAD_INPUT,
        )
    return tokenizer, context
