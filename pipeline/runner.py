"""``run_job``: every document through every variant, results into the store.

Exit statuses (also of ``velox-batch run``):

* 0 every document was done, skipped by the limits, or already done before;
* 1 at least one document failed (its error is stored; the run went on);
* 2 the job spec, its input, its store path or its model is invalid (nothing was run);
* 3 another run holds the store (nothing was run);
* 4 the run stopped on an unexpected error (a bug, a full disk): marked ``failed``;
* 130 / 143 (128 + the signal) SIGINT (Ctrl-C) or SIGTERM stopped it: the document in
  progress is abandoned (nothing of it is stored), the run is marked ``interrupted``, the
  lock released; the next run resumes.
"""

from __future__ import annotations

import hashlib
import json
import signal
import socket
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from . import model_store
from .generation import Reference, generate
from .platform import loaded_blas, package_version
from .prompting import Prompt, PromptTooLong, build_prompt, tokens_hash
from .similarity import rouge_l
from .source import Document, count_documents, iter_documents, open_dataset
from .spec import JobSpec, SpecError, Variant, variant_hash
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


@dataclass
class PreparedDocument:
    """A document's prompt, or why it has none, and what keys its work."""

    document: Document
    basis: str  # the prompt tokens' hash, or the content hash of a document without a prompt
    prompt: Optional[Prompt] = None
    prompt_hash: Optional[str] = None
    prompt_tokens: Optional[int] = None
    status: str = "ready"  # ready, skipped or error
    error: Optional[str] = None


def _doc_key(document_id: str, basis: str, settings_hash: str, variant: Variant) -> str:
    """What decides one document × variant's output: prompt tokens, model and generation, variant."""
    raw = json.dumps([document_id, basis, settings_hash, variant_hash(variant)])
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


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
    """Run ``spec``; raises ``JobError`` (exit status 2, 3, 130 or 143) when nothing ran.

    SIGINT and SIGTERM stop the run between two Python steps (at the latest after the
    prefill chunk or decode step in progress): the summary then has ``status``
    ``interrupted`` and ``signal`` set. Any other exception marks the run ``failed``
    and propagates.
    """
    guard = _SignalGuard()
    with guard.installed():
        try:
            dataset = open_dataset(spec)  # validates files and columns before any model is loaded
            store = Store(spec.output.db)
            with store.locked():
                store.close_abandoned_runs()
                return _run_locked(spec, store, dataset, force, quiet, load_model, progress_stream, guard)
        except (SpecError, StoreError) as exc:
            raise JobError(str(exc), EXIT_BAD_INPUT) from None
        except StoreLocked as exc:
            raise JobError(str(exc), EXIT_LOCKED) from None
        except Interrupted as exc:
            message = f"interrupted by {exc} before the run started; nothing was run"
            raise JobError(message, exit_status_for_signal(exc.signum)) from None


def _run_locked(spec, store, dataset, force, quiet, load_model, progress_stream, guard) -> RunSummary:
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
            "device": f"{mx.default_device()} ({model_store.backend_name()}; BLAS: {loaded_blas()})",
            "host": socket.gethostname(),
            "documents_total": total * len(spec.variants),
        }
    )
    counts = {"documents_done": 0, "documents_skipped": 0, "documents_failed": 0, "documents_unchanged": 0}
    status, error, signum, progress = "failed", None, None, None
    try:
        model, tokenizer, context = _load(spec, load_model)
        settings_hash = spec.output_settings_hash(weights=model_store.weights_mode())
        variants = sorted(spec.variants, key=lambda v: v.cache.method != "full")  # full first
        progress = Progress(total, quiet, progress_stream)
        if spec.input.prompt_column and any(_streams(v.cache) for v in variants):
            progress.note(
                "input.prompt_column: a ready prompt has no instruction to probe with; streaming variants "
                "rank each chunk by its own last queries (SnapKV per chunk)"
            )
        for index, document in enumerate(iter_documents(spec, dataset)):
            if limit and index >= limit:
                break
            prepared = _prepare_all(spec, tokenizer, document, context, variants)
            outcomes, rates = [], []
            for variant in variants:
                prompt = prepared[_streams(variant.cache)]
                outcome, rate = _process(spec, store, run_id, model, tokenizer, prompt, variant, settings_hash, force)
                counts[f"documents_{outcome}"] += 1
                outcomes.append(f"{variant.name} {outcome}")
                if rate:
                    rates.append(rate)
            store.update_run(run_id, **counts)
            progress.document_done(document.document_id, outcomes, sum(rates) / len(rates) if rates else None)
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
            store.finish_run(run_id, status, counts, error=error)
        except Exception:
            if error is None or status == "interrupted":
                raise  # otherwise the error that stopped the run is the one to report
    return RunSummary(run_id, str(spec.output.db), counts, status=status, signal=signum)


def _streams(config) -> bool:
    """True for variants that read documents in bounded memory, past the model's context."""
    return config.method != "full" and config.eviction == "streaming"


def _load(spec: JobSpec, load_model: Callable):
    """``(model, tokenizer, context length or None)``; a bad model or a context too small is a ``JobError``."""
    try:
        model, tokenizer = load_model(spec.model)
    except (model_store.ModelImportError, ValueError, OSError) as exc:
        raise JobError(f"model: {exc}", EXIT_BAD_INPUT) from None
    context = model_store.context_length(model)
    if context is not None and spec.generation.max_tokens >= context:
        raise JobError(
            f"generation.max_tokens: {spec.generation.max_tokens} leaves no room for a prompt in the "
            f"model's context of {context} positions",
            EXIT_BAD_INPUT,
        )
    return model, tokenizer, context


def _prepare_all(spec: JobSpec, tokenizer, document: Document, context: Optional[int], variants) -> dict:
    """One prepared prompt per kind of variant present: ``True`` for streaming, ``False`` for the others."""
    kinds = sorted({_streams(v.cache) for v in variants})
    return {kind: _prepare(spec, tokenizer, document, context, streaming=kind, hint=True in kinds) for kind in kinds}


def _prepare(
    spec: JobSpec, tokenizer, document: Document, context: Optional[int], *, streaming: bool = False, hint: bool = False
) -> PreparedDocument:
    """Build one document's prompt once, for every variant of one kind.

    Streaming variants read documents past the model's context, so only
    ``limits.max_prompt_tokens`` bounds their prompt; for the others the
    context does too (``hint``: say that streaming variants read it).
    """
    if document.error:
        return PreparedDocument(document, f"content:{document.content_hash}", status="error", error=document.error)
    try:
        prompt = build_prompt(spec, tokenizer, document, context_length=None if streaming else context)
    except PromptTooLong as exc:
        prompt_hash = tokens_hash(exc.tokens)
        status = "skipped" if spec.limits.on_too_long == "skip" else "error"
        message = str(exc)
        if hint and not streaming:
            message += "; streaming variants (eviction: streaming) read it"
        return PreparedDocument(
            document, prompt_hash, prompt_hash=prompt_hash, prompt_tokens=len(exc.tokens), status=status, error=message
        )
    prompt_hash = tokens_hash(prompt.tokens)
    return PreparedDocument(document, prompt_hash, prompt=prompt, prompt_hash=prompt_hash, prompt_tokens=len(prompt.tokens))


def _process(spec, store, run_id, model, tokenizer, prepared, variant, settings_hash, force):
    """One document × variant; returns (outcome, decode tokens/s or None)."""
    config = variant.cache
    document = prepared.document
    key = _doc_key(document.document_id, prepared.basis, settings_hash, variant)
    if not force and store.reuse_done(key):
        return "unchanged", None
    row = {
        "doc_key": key,
        "run_id": run_id,
        "document_id": document.document_id,
        "content_hash": document.content_hash,
        "prompt_hash": prepared.prompt_hash,
        "settings_hash": settings_hash,
        "variant": variant.name,
        "method": config.method,
        "budget": None if config.method == "full" or config.budget_fraction is not None else config.budget,
        "scoring": None if config.method == "full" else config.scoring,
    }
    if prepared.status != "ready":
        store.save_document({**row, "status": prepared.status, "error": prepared.error, "prompt_tokens": prepared.prompt_tokens}, [])
        return ("skipped" if prepared.status == "skipped" else "failed"), None
    prompt = prepared.prompt
    full = None
    if config.method != "full":
        row["budget"] = config.resolved_for(len(prompt.tokens)).budget
        full = store.full_reference(document.document_id, prepared.prompt_hash, settings_hash)
    reference = None
    if full is not None and full["token_ids"] is not None:
        reference = Reference(full["token_ids"], full["logprobs"])
    try:
        result = generate(model, tokenizer, prompt, config, spec.generation, reference=reference)
    except Exception as exc:  # one bad document must not stop the night's run
        store.save_document({**row, "status": "error", "error": f"{type(exc).__name__}: {exc}", "prompt_tokens": len(prompt.tokens)}, [])
        return "failed", None
    similarity = rouge_l(result.output, full["output"]) if full is not None else None
    fidelity = result.fidelity
    store.save_document(
        {
            **row,
            "status": "done",
            "output": result.output,
            "prompt_tokens": result.prompt_tokens,
            "truncated": int(prompt.truncated),
            "output_tokens": result.output_tokens,
            "prefill_seconds": result.prefill_seconds,
            "decode_seconds": result.decode_seconds,
            "prefill_tokens_per_second": result.prefill_tokens_per_second,
            "decode_tokens_per_second": result.decode_tokens_per_second,
            "peak_memory_bytes": result.peak_memory_bytes,
            "stop_reason": result.stop_reason,
            "rouge_l_vs_full": similarity,
            "agreement_vs_full": fidelity.agreement if fidelity else None,
            "nll_gap_vs_full": fidelity.nll_gap if fidelity else None,
            "fidelity_seconds": fidelity.seconds if fidelity else None,
            "output_token_ids": json.dumps(result.token_ids),
            "output_logprobs": json.dumps([round(p, 6) for p in result.logprobs]),
            **result.totals(),
        },
        result.layer_stats,
    )
    if config.method == "full":
        for other_row, output in store.compressed_outputs(document.document_id, prepared.prompt_hash, settings_hash):
            store.set_similarity(other_row, rouge_l(output, result.output))
    return "done", result.decode_tokens_per_second
