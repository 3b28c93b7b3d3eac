"""``run_job``: every document through every variant, results into the store.

Exit statuses (also of ``velox-batch run``):

* 0 every document was done, skipped by the limits, or already done before;
* 1 at least one document failed (its error is stored; the run went on);
* 2 the job spec, its input or its model is invalid (nothing was run);
* 3 another run holds the store (nothing was run).
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

from . import model_store
from velox_cache import model_context

from .generation import generate
from .platform import loaded_blas, package_version
from .prompting import PromptTooLong, build_prompt
from .similarity import rouge_l
from .source import count_documents, iter_documents, open_dataset
from .spec import JobSpec, SpecError, Variant, variant_hash
from .store import Store, StoreLocked

EXIT_OK, EXIT_DOCUMENT_FAILED, EXIT_BAD_INPUT, EXIT_LOCKED = 0, 1, 2, 3


class JobError(RuntimeError):
    """The job cannot run; ``exit_status`` says why."""

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


@dataclass
class RunSummary:
    run_id: int
    db: str
    counts: dict = field(default_factory=dict)

    @property
    def exit_status(self) -> int:
        return EXIT_DOCUMENT_FAILED if self.counts.get("documents_failed") else EXIT_OK


def _doc_key(document_id: str, content_hash: str, settings_hash: str, variant: Variant) -> str:
    raw = json.dumps([document_id, content_hash, settings_hash, variant_hash(variant)])
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
    """Run ``spec``; raises ``JobError`` (exit status 2 or 3) when nothing can run."""
    try:
        dataset = open_dataset(spec)  # validates files and columns before any model is loaded
    except SpecError as exc:
        raise JobError(str(exc), EXIT_BAD_INPUT) from None
    store = Store(spec.output.db)
    try:
        with store.locked():
            store.close_abandoned_runs()
            return _run_locked(spec, store, dataset, force, quiet, load_model, progress_stream)
    except StoreLocked as exc:
        raise JobError(str(exc), EXIT_LOCKED) from None


def _run_locked(spec, store, dataset, force, quiet, load_model, progress_stream) -> RunSummary:
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
    try:
        model, tokenizer = load_model(spec.model)
    except (model_store.ModelImportError, ValueError, OSError) as exc:
        store.finish_run(run_id, "failed", counts)
        raise JobError(f"model: {exc}", EXIT_BAD_INPUT) from None
    settings_hash = spec.settings_hash()
    variants = sorted(spec.variants, key=lambda v: v.cache.method != "full")  # full first
    progress = Progress(total, quiet, progress_stream)
    if spec.input.prompt_column and any(_streams(v.cache) for v in variants):
        progress.note(
            "input.prompt_column: a ready prompt has no instruction to probe with; streaming variants "
            "rank each chunk by its own last queries (SnapKV per chunk)"
        )
    status = "interrupted"
    try:
        for index, document in enumerate(iter_documents(spec, dataset)):
            if limit and index >= limit:
                break
            outcomes, rates = [], []
            for variant in variants:
                outcome, rate = _process(spec, store, run_id, model, tokenizer, document, variant, settings_hash, force)
                counts[f"documents_{outcome}"] += 1
                outcomes.append(f"{variant.name} {outcome}")
                if rate:
                    rates.append(rate)
            store.update_run(run_id, **counts)
            progress.document_done(document.document_id, outcomes, sum(rates) / len(rates) if rates else None)
        status = "done_with_errors" if counts["documents_failed"] else "done"
    finally:
        progress.close()
        store.finish_run(run_id, status, counts)
    return RunSummary(run_id, str(spec.output.db), counts)


def _streams(config) -> bool:
    """True for variants that read documents in bounded memory, past the model's context."""
    return config.method != "full" and config.eviction == "streaming"


def _process(spec, store, run_id, model, tokenizer, document, variant, settings_hash, force):
    """One document × variant; returns (outcome, decode tokens/s or None)."""
    config = variant.cache
    key = _doc_key(document.document_id, document.content_hash, settings_hash, variant)
    if not force and store.is_done(key):
        return "unchanged", None
    row = {
        "doc_key": key,
        "run_id": run_id,
        "document_id": document.document_id,
        "content_hash": document.content_hash,
        "settings_hash": settings_hash,
        "variant": variant.name,
        "method": config.method,
        "budget": None if config.method == "full" or config.budget_fraction is not None else config.budget,
        "scoring": None if config.method == "full" else config.scoring,
    }
    if document.error:
        store.save_document({**row, "status": "error", "error": document.error}, [])
        return "failed", None
    try:
        prompt = build_prompt(spec, tokenizer, document)
    except PromptTooLong as exc:
        if spec.limits.on_too_long == "skip":
            store.save_document({**row, "status": "skipped", "error": str(exc)}, [])
            return "skipped", None
        store.save_document({**row, "status": "error", "error": str(exc)}, [])
        return "failed", None
    if config.method != "full":
        row["budget"] = config.resolved_for(len(prompt.tokens)).budget
    context = model_context(model)
    needed = len(prompt.tokens) + spec.generation.max_tokens
    if context and needed > context and not _streams(config):
        reason = (
            f"prompt of {len(prompt.tokens)} tokens + max_tokens {spec.generation.max_tokens} exceeds the model's "
            f"context of {context} tokens; only streaming variants (eviction: streaming) read it"
        )
        store.save_document({**row, "status": "skipped", "error": reason, "prompt_tokens": len(prompt.tokens)}, [])
        return "skipped", None
    try:
        result = generate(model, tokenizer, prompt, config, spec.generation)
    except Exception as exc:  # one bad document must not stop the night's run
        store.save_document({**row, "status": "error", "error": f"{type(exc).__name__}: {exc}", "prompt_tokens": len(prompt.tokens)}, [])
        return "failed", None
    similarity = None
    if config.method != "full":
        reference = store.full_output(document.document_id, document.content_hash, settings_hash)
        similarity = rouge_l(result.output, reference) if reference is not None else None
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
            **result.totals(),
        },
        result.layer_stats,
    )
    if config.method == "full":
        for other_row, output in store.compressed_outputs(document.document_id, document.content_hash, settings_hash):
            store.set_similarity(other_row, rouge_l(output, result.output))
    return "done", result.decode_tokens_per_second
