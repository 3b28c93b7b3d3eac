"""The store's one writer: ``Store``, a job store on one SQLite file, held by one run at a time.

Migrations (``migrations.py``) build the schema, each in one transaction, and only
while the run lock is held. WAL mode lets people query while a job runs; a write
that finds another connection holding the write lock waits, with a notice every
30 s. One document's rows (its ``documents`` row and its ``layer_stats``) are
written in one transaction, so a run killed at any point leaves each document
either fully stored or not at all. A lock file beside the database (beside the
real file when the path is a symlink) keeps two runs from overlapping; the
operating system releases it when a run dies, even on kill -9.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from .base import SQLITE_BUSY, SQLITE_HEADER, SQLITE_LOCKED, StoreError, StoreLocked, now, primary_code
from .migrations import migrate

BUSY_TIMEOUT_MS = 1_000  # one wait inside SQLite; writes retry after it
WAIT_NOTICE_SECONDS = 30.0

if TYPE_CHECKING:  # imported when a store is opened: sqlite_utils loads pandas if installed, slow for readers
    import sqlite_utils


def _print_notice(message: str) -> None:
    print(f"velox-batch: {message}", file=sys.stderr, flush=True)


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    code = primary_code(exc)
    return code in (SQLITE_BUSY, SQLITE_LOCKED) if code is not None else "locked" in str(exc)


def check_store_path(path: str | os.PathLike) -> Path:
    """The real file a store path names (symlinks resolved), creating missing parent directories.

    Raises ``StoreError`` for a directory, an existing file that is not SQLite, or a
    place that cannot be written.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise StoreError(f"{path}: is a directory; name a file, such as {path / 'velox.db'}")
    resolved = path.resolve()
    try:
        resolved.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"{path}: cannot create the directory {resolved.parent} ({exc.strerror})") from None
    if resolved.exists():
        if not resolved.is_file():
            raise StoreError(f"{path}: not a regular file")
        try:
            with open(resolved, "rb") as handle:
                header = handle.read(len(SQLITE_HEADER))
        except OSError as exc:
            raise StoreError(f"{path}: cannot read ({exc.strerror})") from None
        if header and header != SQLITE_HEADER:
            raise StoreError(f"{path}: not an SQLite database; give another output.db or --db")
        if not os.access(resolved, os.W_OK):
            raise StoreError(f"{path}: cannot write the store (read-only here)")
    return resolved


class Store:
    """A job store on one SQLite file; use it inside ``locked()``.

    ``busy_timeout_ms`` is one wait inside SQLite for another connection's write
    lock; writes then retry until they get it, calling ``on_wait`` (default: a line
    on stderr) every ``wait_notice_seconds`` of waiting.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        busy_timeout_ms: int = BUSY_TIMEOUT_MS,
        wait_notice_seconds: float = WAIT_NOTICE_SECONDS,
        on_wait: Optional[Callable[[str], None]] = None,
    ):
        self.path = Path(path)
        self.busy_timeout_ms = busy_timeout_ms
        self.wait_notice_seconds = wait_notice_seconds
        self.on_wait = on_wait or _print_notice
        self.db: Optional[sqlite_utils.Database] = None

    @contextmanager
    def locked(self) -> Iterator["Store"]:
        """Hold the store for one run: lock, then open and migrate; ``StoreLocked`` if another run holds it.

        The lock file sits beside the real database file, so a symlinked path
        takes the same lock. Raises ``StoreError`` when the path cannot be a store.
        """
        resolved = check_store_path(self.path)
        lock_path = resolved.with_name(resolved.name + ".lock")
        try:
            handle = open(lock_path, "a+")
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot write in {lock_path.parent} ({exc.strerror})") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            raise StoreLocked(f"{self.path} is in use by another run ({holder or 'unknown process'})") from None
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()} since {now()}")
            handle.flush()
            self._open(resolved)
            yield self
        finally:
            if self.db is not None:
                self.db.close()
                self.db = None
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()

    def _open(self, resolved: Path) -> None:
        import sqlite_utils

        try:
            self.db = sqlite_utils.Database(resolved)
            self.db.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
            self.db.enable_wal()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path}: cannot open as an SQLite store ({exc})") from None
        migrate(self.db, transaction=self._write)

    @contextmanager
    def _write(self) -> Iterator[None]:
        """One write transaction, begun only once this connection holds the write lock."""
        conn = self.db.conn
        started = time.monotonic()
        next_notice = self.wait_notice_seconds
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                break
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                waited = time.monotonic() - started
                if waited >= next_notice:
                    self.on_wait(
                        f"waiting for the write lock on {self.path}: another connection holds it "
                        f"({waited:.0f} s so far; close that writer, or Ctrl-C to stop)"
                    )
                    next_notice = waited + self.wait_notice_seconds
        try:
            yield
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    # runs

    def close_abandoned_runs(self) -> int:
        """Mark runs left 'running' by a killed process as 'interrupted' (call while locked).

        A run that left no mark ended when it stored its last document (or when it
        started, if it stored none).
        """
        with self._write():
            cursor = self.db.execute(
                "update runs set status = 'interrupted', "
                "ended_at = coalesce(ended_at, (select max(created_at) from documents d where d.run_id = runs.id), "
                "started_at), "
                "error = coalesce(error, 'the process stopped without marking the run (killed?)') "
                "where status = 'running'"
            )
        return cursor.rowcount

    def start_run(self, row: dict) -> int:
        with self._write():
            return self.db["runs"].insert({**row, "status": "running", "started_at": now()}).last_pk

    def update_run(self, run_id: int, **values) -> None:
        with self._write():
            self.db["runs"].update(run_id, values)

    def finish_run(self, run_id: int, status: str, counts: dict, *, error: Optional[str] = None) -> None:
        self.update_run(run_id, status=status, ended_at=now(), error=error, **counts)

    # documents

    def find_done(self, doc_key: str) -> Optional[tuple[int, bool]]:
        """``(row id, is_latest)`` when this exact work is stored as done, else None (reads only)."""
        row = self.db.execute("select id, is_latest from documents where doc_key = ? and status = 'done'", [doc_key]).fetchone()
        return None if row is None else (row[0], bool(row[1]))

    def make_latest(self, document_row: int) -> None:
        """Mark a stored row as the latest of its document × variant (a rerun reusing it)."""
        with self._write():
            document_id, variant = self.db.execute(
                "select document_id, variant from documents where id = ?", [document_row]
            ).fetchone()
            self._make_latest(document_row, document_id, variant)

    def _make_latest(self, document_row: int, document_id: str, variant: str) -> None:
        self.db.execute(
            "update documents set is_latest = (id = ?) where document_id = ? and variant = ?",
            [document_row, document_id, variant],
        )

    def save_document(self, row: dict, layer_rows: list[dict]) -> int:
        """Store one document × variant and its per-layer rows atomically.

        An earlier try of the same work (same ``doc_key``) is replaced, with its
        layer rows; earlier rows of the same document and variant stay as history
        (``is_latest = 0``).
        """
        with self._write():
            old = self.db.execute("select id from documents where doc_key = ?", [row["doc_key"]]).fetchone()
            if old:
                self.db.execute("delete from layer_stats where document_row = ?", [old[0]])
                self.db.execute("delete from documents where id = ?", [old[0]])
            document_row = self.db["documents"].insert({**row, "created_at": now(), "is_latest": 1}).last_pk
            self._make_latest(document_row, row["document_id"], row["variant"])
            if layer_rows:
                base = {k: row[k] for k in ("run_id", "document_id", "variant", "method")}
                accounting = {"accounting": row["accounting"]} if row.get("accounting") else {}
                self.db["layer_stats"].insert_all(
                    [{**base, **layer, **accounting, "document_row": document_row} for layer in layer_rows]
                )
        return document_row

    # frontier

    def settled_frontier(self, keys: list[str]) -> set[str]:
        """Which of ``keys`` (``frontier_key``) are stored as measured or skipped; an ``error`` row is not."""
        settled: set[str] = set()
        for begin in range(0, len(keys), 500):
            chunk = keys[begin : begin + 500]
            marks = ", ".join("?" * len(chunk))
            settled.update(
                key for (key,) in self.db.execute(
                    f"select frontier_key from frontier where frontier_key in ({marks}) and status in ('done', 'skipped')",
                    chunk,
                )
            )
        return settled

    def save_frontier(self, rows: list[dict]) -> None:
        """Store frontier points atomically: each replaces the row of its ``frontier_key`` and becomes the
        latest of its document × variant × budget × bits (earlier ones stay as history, ``is_latest = 0``)."""
        if not rows:
            return
        with self._write():
            for row in rows:
                self.db.execute("delete from frontier where frontier_key = ?", [row["frontier_key"]])
                point = self.db["frontier"].insert({**row, "created_at": now(), "is_latest": 1}).last_pk
                self._make_frontier_latest(point, row["document_id"], row["variant"], row["budget"], row.get("kv_bits"))

    def make_frontier_latest(self, keys: list[str]) -> None:
        """Mark the stored points of ``keys`` (``frontier_key``) the latest of their document × variant × budget ×
        bits (a rerun whose settings went back to theirs reuses them)."""
        stale = []
        for begin in range(0, len(keys), 500):
            chunk = keys[begin : begin + 500]
            marks = ", ".join("?" * len(chunk))
            stale += self.db.execute(
                f"select id, document_id, variant, budget, kv_bits from frontier where frontier_key in ({marks}) "
                "and status in ('done', 'skipped') and is_latest = 0",
                chunk,
            ).fetchall()
        if stale:
            with self._write():
                for point in stale:
                    self._make_frontier_latest(*point)

    def _make_frontier_latest(self, point: int, document_id: str, variant: str, budget: str, kv_bits) -> None:
        self.db.execute(
            "update frontier set is_latest = (id = ?) where document_id = ? and variant = ? and budget = ? "
            "and kv_bits is ?",
            [point, document_id, variant, budget, kv_bits],
        )

    def full_reference(self, document_id: str, prompt_hash: str, settings_hash: str) -> Optional[dict]:
        """The stored full-cache result for the same prompt tokens and settings, if any.

        A dict with ``output`` and, when the row recorded them, ``token_ids`` and
        ``logprobs`` (what teacher forcing feeds); ``None`` when there is none.
        """
        row = self.db.execute(
            "select output, output_token_ids, output_logprobs from documents where document_id = ? "
            "and prompt_hash = ? and settings_hash = ? and method = 'full' and status = 'done' "
            "order by id desc limit 1",
            [document_id, prompt_hash, settings_hash],
        ).fetchone()
        if row is None:
            return None
        output, token_ids, logprobs = row
        return {
            "output": output,
            "token_ids": json.loads(token_ids) if token_ids is not None else None,
            "logprobs": json.loads(logprobs) if logprobs is not None else None,
        }

    def compressed_outputs(self, document_id: str, prompt_hash: str, settings_hash: str) -> list[tuple[int, str]]:
        """``(row id, output)`` of the compressed variants done on the same prompt tokens and settings."""
        return [
            tuple(row)
            for row in self.db.execute(
                "select id, output from documents where document_id = ? and prompt_hash = ? and "
                "settings_hash = ? and method != 'full' and status = 'done'",
                [document_id, prompt_hash, settings_hash],
            ).fetchall()
        ]

    def set_similarity(self, document_row: int, value: float) -> None:
        with self._write():
            self.db["documents"].update(document_row, {"rouge_l_vs_full": value})

