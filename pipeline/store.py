"""The SQLite store: the only module that writes SQL.

Numbered migrations (recorded in ``_velox_migrations``) build the schema, each in
one transaction, and only while the run lock is held. WAL mode lets people query
while a job runs; a write that finds another connection holding the write lock
waits, with a notice every 30 s. One document's rows (its ``documents`` row and
its ``layer_stats``) are written in one transaction, so a run killed at any point
leaves each document either fully stored or not at all. A lock file beside the
database (beside the real file when the path is a symlink) keeps two runs from
overlapping; the operating system releases it when a run dies, even on kill -9.

``documents`` keeps history: each document × variant has one row marked
``is_latest``; the views and ``show`` read only those.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import sqlite3
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import sqlite_utils

from .defaults import DEFAULT_DB  # noqa: F401 (the CLI's --db default; spec.py shares it)

BUSY_TIMEOUT_MS = 1_000  # one wait inside SQLite; writes retry after it
WAIT_NOTICE_SECONDS = 30.0
SQLITE_HEADER = b"SQLite format 3\x00"
# primary SQLite result codes (the sqlite3 module names them only from Python 3.11)
SQLITE_BUSY, SQLITE_LOCKED, SQLITE_READONLY, SQLITE_CANTOPEN = 5, 6, 8, 14


class StoreError(RuntimeError):
    """The path cannot hold a store (a directory, not SQLite, not writable); the message says why."""


class StoreLocked(RuntimeError):
    """Another run holds the store."""


class QueryError(sqlite3.OperationalError):
    """A read-only query failed; the message says what went wrong."""


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# ----- migrations -----------------------------------------------------------------------------


def m001_tables(db: sqlite_utils.Database) -> None:
    db["runs"].create(
        {
            "id": int,
            "job_name": str,
            "spec_path": str,
            "spec": str,
            "spec_hash": str,
            "model": str,
            "velox_version": str,
            "mlx_version": str,
            "mlx_lm_version": str,
            "device": str,
            "host": str,
            "started_at": str,
            "ended_at": str,
            "status": str,
            "documents_total": int,
            "documents_done": int,
            "documents_skipped": int,
            "documents_failed": int,
            "documents_unchanged": int,
        },
        pk="id",
    )
    db["documents"].create(
        {
            "id": int,
            "doc_key": str,
            "run_id": int,
            "document_id": str,
            "content_hash": str,
            "settings_hash": str,
            "variant": str,
            "method": str,
            "budget": int,
            "scoring": str,
            "status": str,
            "error": str,
            "output": str,
            "prompt_tokens": int,
            "truncated": int,
            "output_tokens": int,
            "prefill_seconds": float,
            "decode_seconds": float,
            "prefill_tokens_per_second": float,
            "decode_tokens_per_second": float,
            "peak_memory_bytes": int,
            "stop_reason": str,
            "kept_bytes": int,
            "full_seq_bytes": int,
            "compression_ratio": float,
            "rouge_l_vs_full": float,
            "created_at": str,
        },
        pk="id",
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["documents"].create_index(["doc_key"], unique=True)
    db["documents"].create_index(["document_id", "content_hash", "settings_hash"])
    db["layer_stats"].create(
        {
            "id": int,
            "document_row": int,
            "run_id": int,
            "document_id": str,
            "variant": str,
            "method": str,
            "layer": int,
            "layer_budget": int,
            "tokens_seen": int,
            "tokens_kept": int,
            "kept_bytes": int,
            "full_seq_bytes": int,
            "compression_ratio": float,
            "concentration": float,
        },
        pk="id",
        foreign_keys=[("document_row", "documents", "id"), ("run_id", "runs", "id")],
    )
    db["layer_stats"].create_index(["document_row"])
    db["documents"].enable_fts(["output", "document_id", "variant"], create_triggers=True)


def m002_views(db: sqlite_utils.Database) -> None:
    db.create_view(
        "run_summary",
        """
        select r.id as run_id, r.job_name, r.started_at, r.ended_at, r.status,
               r.documents_done, r.documents_skipped, r.documents_failed, r.documents_unchanged,
               count(d.id) as rows_written,
               round(avg(d.prefill_tokens_per_second), 1) as mean_prefill_tps,
               round(avg(d.decode_tokens_per_second), 1) as mean_decode_tps,
               round(sum(d.prefill_seconds + d.decode_seconds), 1) as generation_seconds
        from runs r left join documents d on d.run_id = r.id and d.status = 'done'
        group by r.id order by r.id desc
        """,
    )
    db.create_view(
        "method_summary",
        """
        select method, variant, budget, count(*) as documents,
               round(avg(compression_ratio), 2) as mean_compression_ratio,
               round(avg(rouge_l_vs_full), 3) as mean_rouge_l_vs_full,
               round(avg(prefill_tokens_per_second), 1) as mean_prefill_tps,
               round(avg(decode_tokens_per_second), 1) as mean_decode_tps,
               round(avg(peak_memory_bytes) / 1048576.0, 1) as mean_peak_mib
        from documents where status = 'done'
        group by method, variant, budget order by method, budget
        """,
    )
    db.create_view(
        "layer_summary",
        """
        select method, variant, layer, count(*) as documents,
               round(avg(layer_budget), 1) as mean_budget,
               round(avg(tokens_kept), 1) as mean_tokens_kept,
               round(avg(compression_ratio), 2) as mean_compression_ratio,
               round(avg(concentration), 3) as mean_concentration
        from layer_stats group by method, variant, layer order by method, variant, layer
        """,
    )


def m003_latest_rows(db: sqlite_utils.Database) -> None:
    """Mark each document × variant's latest row; views read only those; runs get an error column."""
    db["documents"].add_column("prompt_hash", str)
    db["documents"].add_column("is_latest", int, not_null_default=1)
    db["runs"].add_column("error", str)
    db.execute(
        "update documents set is_latest = 0 where id not in "
        "(select max(id) from documents group by document_id, variant)"
    )
    db["documents"].create_index(["document_id", "variant", "is_latest"])
    db["documents"].create_index(["document_id", "prompt_hash", "settings_hash"])
    db.create_view("latest_documents", "select * from documents where is_latest = 1")
    db.create_view(
        "run_summary",
        """
        select r.id as run_id, r.job_name, r.started_at, r.ended_at, r.status,
               r.documents_done, r.documents_skipped, r.documents_failed, r.documents_unchanged,
               count(d.id) as rows_written,
               round(avg(d.prefill_tokens_per_second), 1) as mean_prefill_tps,
               round(avg(d.decode_tokens_per_second), 1) as mean_decode_tps,
               round(sum(d.prefill_seconds + d.decode_seconds), 1) as generation_seconds,
               r.error
        from runs r left join documents d on d.run_id = r.id and d.status = 'done'
        group by r.id order by r.id desc
        """,
        replace=True,
    )
    db.create_view(
        "method_summary",
        """
        select method, variant, budget, count(*) as documents,
               round(avg(compression_ratio), 2) as mean_compression_ratio,
               round(avg(rouge_l_vs_full), 3) as mean_rouge_l_vs_full,
               round(avg(prefill_tokens_per_second), 1) as mean_prefill_tps,
               round(avg(decode_tokens_per_second), 1) as mean_decode_tps,
               round(avg(peak_memory_bytes) / 1048576.0, 1) as mean_peak_mib
        from documents where status = 'done' and is_latest = 1
        group by method, variant, budget order by method, budget
        """,
        replace=True,
    )
    db.create_view(
        "layer_summary",
        """
        select l.method, l.variant, l.layer, count(*) as documents,
               round(avg(l.layer_budget), 1) as mean_budget,
               round(avg(l.tokens_kept), 1) as mean_tokens_kept,
               round(avg(l.compression_ratio), 2) as mean_compression_ratio,
               round(avg(l.concentration), 3) as mean_concentration
        from layer_stats l join documents d on d.id = l.document_row and d.is_latest = 1
        group by l.method, l.variant, l.layer order by l.method, l.variant, l.layer
        """,
        replace=True,
    )


def m004_fidelity(db: sqlite_utils.Database) -> None:
    """Teacher-forced fidelity to the full cache per compressed row; the full row's tokens to force."""
    documents = db["documents"]
    documents.add_column("agreement_vs_full", float)
    documents.add_column("nll_gap_vs_full", float)
    documents.add_column("fidelity_seconds", float)
    documents.add_column("output_token_ids", str)  # JSON list: what teacher forcing feeds
    documents.add_column("output_logprobs", str)  # JSON list: each output token's log-probability
    db.create_view(
        "run_summary",
        """
        select r.id as run_id, r.job_name, r.started_at, r.ended_at, r.status,
               r.documents_done, r.documents_skipped, r.documents_failed, r.documents_unchanged,
               count(d.id) as rows_written,
               round(avg(d.prefill_tokens_per_second), 1) as mean_prefill_tps,
               round(avg(d.decode_tokens_per_second), 1) as mean_decode_tps,
               round(sum(d.prefill_seconds + d.decode_seconds), 1) as generation_seconds,
               round(avg(d.agreement_vs_full), 3) as mean_agreement_vs_full,
               round(avg(d.nll_gap_vs_full), 3) as mean_nll_gap_vs_full,
               r.error
        from runs r left join documents d on d.run_id = r.id and d.status = 'done'
        group by r.id order by r.id desc
        """,
        replace=True,
    )
    db.create_view(
        "method_summary",
        """
        select method, variant, budget, count(*) as documents,
               round(avg(compression_ratio), 2) as mean_compression_ratio,
               round(avg(agreement_vs_full), 3) as mean_agreement_vs_full,
               round(min(agreement_vs_full), 3) as worst_agreement_vs_full,
               round(avg(nll_gap_vs_full), 3) as mean_nll_gap_vs_full,
               round(avg(rouge_l_vs_full), 3) as mean_rouge_l_vs_full,
               round(avg(prefill_tokens_per_second), 1) as mean_prefill_tps,
               round(avg(decode_tokens_per_second), 1) as mean_decode_tps,
               round(avg(peak_memory_bytes) / 1048576.0, 1) as mean_peak_mib
        from documents where status = 'done' and is_latest = 1
        group by method, variant, budget order by method, budget
        """,
        replace=True,
    )


def m005_run_engine(db: sqlite_utils.Database) -> None:
    """Where each run's documents ran: ``engine`` (in-process or ray), ``workers``, ``address`` (ray's)."""
    db["runs"].add_column("engine", str)
    db["runs"].add_column("workers", int)
    db["runs"].add_column("address", str)
    db.execute("update runs set engine = 'in-process', workers = 1")


def m006_layer_cache_kind(db: sqlite_utils.Database) -> None:
    """Which cache each layer had (``PyramidKVCache``, ``RotatingKVCache``, ...) and how it scored tokens."""
    db["layer_stats"].add_column("cache_kind", str)
    db["layer_stats"].add_column("scoring", str)


MIGRATIONS = [  # append only: stores record what they applied
    m001_tables,
    m002_views,
    m003_latest_rows,
    m004_fidelity,
    m005_run_engine,
    m006_layer_cache_kind,
]


def migrate(db: sqlite_utils.Database, *, transaction: Optional[Callable] = None) -> list[str]:
    """Apply the migrations not yet recorded, each in one transaction; returns the names applied.

    A migration interrupted at any point (even by kill -9) leaves no trace, so the
    next start applies it again from the beginning. ``transaction`` is a context
    manager factory for one write transaction (default ``db.atomic``).
    """
    transaction = transaction or db.atomic
    with transaction():
        db["_velox_migrations"].create({"id": int, "name": str, "applied_at": str}, pk="id", if_not_exists=True)
    done = {row["name"] for row in db["_velox_migrations"].rows}
    applied = []
    for number, migration in enumerate(MIGRATIONS, 1):
        if migration.__name__ in done:
            continue
        with transaction():
            migration(db)
            db["_velox_migrations"].insert({"id": number, "name": migration.__name__, "applied_at": now()})
        applied.append(migration.__name__)
    return applied


# ----- the store ------------------------------------------------------------------------------


def _print_notice(message: str) -> None:
    print(f"velox-batch: {message}", file=sys.stderr, flush=True)


def _primary_code(exc: sqlite3.Error) -> Optional[int]:
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    return None if code is None else code & 0xFF


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    code = _primary_code(exc)
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

    def reuse_done(self, doc_key: str) -> bool:
        """True when this exact work is stored as done; it becomes the latest row of its document × variant."""
        found = self.find_done(doc_key)
        if found is None:
            return False
        document_row, is_latest = found
        if not is_latest:
            self.make_latest(document_row)
        return True

    def _make_latest(self, document_row: int, document_id: str, variant: str) -> None:
        self.db.execute(
            "update documents set is_latest = (id = ?) where document_id = ? and variant = ?",
            [document_row, document_id, variant],
        )

    def save_document(self, row: dict, layer_rows: list[dict]) -> int:
        """Store one document × variant and its per-layer rows atomically as its latest row.

        An earlier try of the same work (same ``doc_key``) is replaced; earlier rows
        of the same document and variant stay as history (``is_latest = 0``).
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
                self.db["layer_stats"].insert_all(
                    [{**base, **layer, "document_row": document_row} for layer in layer_rows]
                )
        return document_row

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


# ----- reading ----------------------------------------------------------------------------------

_READ_ONLY_NOTE = (
    "{path} is opened immutable: SQLite cannot open it read-only here (its directory is not "
    "writable, and WAL mode needs side files); changes not yet checkpointed by a running job are not visible"
)


def _connect_read_only(path: str | os.PathLike) -> tuple[sqlite3.Connection, Optional[str]]:
    """A read-only connection, and a note when the store had to be opened immutable."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no store at {path}")
    uri = path.resolve().as_uri()
    conn = sqlite3.connect(f"{uri}?mode=ro", uri=True)
    try:
        conn.execute("select count(*) from sqlite_master").fetchone()
        return conn, None
    except sqlite3.OperationalError as exc:
        conn.close()
        if _primary_code(exc) not in (SQLITE_READONLY, SQLITE_CANTOPEN) and "readonly" not in str(exc):
            raise
    return sqlite3.connect(f"{uri}?immutable=1", uri=True), _READ_ONLY_NOTE.format(path=path)


def read_only_note(path: str | os.PathLike) -> Optional[str]:
    """A note for people when ``path`` can only be opened immutable (else None)."""
    conn, note = _connect_read_only(path)
    conn.close()
    return note


def _refuse_new_files(action, *args):
    # VACUUM INTO attaches its target too, so this refuses both
    return sqlite3.SQLITE_DENY if action in (sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH) else sqlite3.SQLITE_OK


def read_only_query(path: str | os.PathLike, sql: str, params=()) -> tuple[list[str], list[tuple]]:
    """Run SQL on a store opened read-only; raises ``QueryError`` saying what went wrong.

    Writes are refused (the connection is read-only and ``query_only``), and so are
    ATTACH and VACUUM INTO, which would create files. A store in a place this
    process cannot write is opened immutable (see ``read_only_note``).
    """
    conn, _ = _connect_read_only(path)
    try:
        conn.execute("PRAGMA query_only = ON")
        conn.set_authorizer(_refuse_new_files)
        try:
            cursor = conn.execute(sql, params)
            columns = [d[0] for d in cursor.description or []]
            return columns, cursor.fetchall()
        except sqlite3.DatabaseError as exc:
            raise QueryError(_explain(exc)) from None
    finally:
        conn.close()


def _explain(exc: sqlite3.DatabaseError) -> str:
    message = str(exc)
    if "authoriz" in message:
        return f"{message}: ATTACH and VACUUM INTO are refused (query only reads the store and creates no files)"
    if "readonly" in message:
        return f"{message}: query only reads (the store is opened read-only)"
    return message


def recent_runs(path, limit: int = 10):
    """``(columns, rows)`` of the latest runs, newest first."""
    return read_only_query(path, "select * from run_summary limit ?", [limit])


def document_variants(path, document_id: str):
    """``(columns, rows)``: one document's latest row per variant."""
    _, found = read_only_query(path, "select name from pragma_table_info('documents')")
    present = {name for (name,) in found}
    latest = " and is_latest = 1" if "is_latest" in present else ""  # a store not yet migrated by a run
    fidelity = [c for c in ("agreement_vs_full", "nll_gap_vs_full", "rouge_l_vs_full") if c in present]
    return read_only_query(
        path,
        "select id, variant, status, error, prompt_tokens, output_tokens, compression_ratio, "
        f"{', '.join(fidelity)}, output from documents where document_id = ?{latest} order by id",
        [document_id],
    )


def document_layers(path, document_row: int):
    """``(columns, rows)``: the per-layer accounting of one stored document row."""
    return read_only_query(
        path,
        "select layer, cache_kind, layer_budget, tokens_seen, tokens_kept, kept_bytes, full_seq_bytes, "
        "round(compression_ratio, 2) as compression_ratio, round(concentration, 3) as concentration "
        "from layer_stats where document_row = ? order by layer",
        [document_row],
    )


# ----- report queries (read-only; used by pipeline/report.py) ----------------------------------


def _read_dicts(path, sql: str, params=()) -> list[dict]:
    columns, rows = read_only_query(path, sql, params)
    return [dict(zip(columns, row)) for row in rows]


def has_runs_table(path) -> bool:
    """Whether the file holds a Velox store (an empty SQLite file does not)."""
    _, rows = read_only_query(path, "select 1 from sqlite_master where type = 'table' and name = 'runs'")
    return bool(rows)


def report_run_ids(path) -> dict:
    """``{"latest": newest run id, "latest_with_rows": newest run that stored document rows}``."""
    _, rows = read_only_query(path, "select (select max(id) from runs), (select max(run_id) from documents)")
    latest, with_rows = rows[0]
    return {"latest": latest, "latest_with_rows": with_rows}


def report_run(path, run_id: int) -> Optional[dict]:
    """One ``runs`` row (without the spec text), or None."""
    found = _read_dicts(
        path,
        "select id, job_name, model, device, started_at, ended_at, status, documents_total, documents_done, "
        "documents_skipped, documents_failed, documents_unchanged from runs where id = ?",
        [run_id],
    )
    return found[0] if found else None


def report_later_runs(path, run_id: int, job_name: str) -> list[int]:
    """Ids of the same job's runs after ``run_id``."""
    _, rows = read_only_query(path, "select id from runs where id > ? and job_name = ? order by id", [run_id, job_name])
    return [row[0] for row in rows]


def fidelity_column(path, run_id: Optional[int] = None) -> str:
    """``agreement_vs_full`` where the store has it (with values in ``run_id``), else ``rouge_l_vs_full``."""
    _, rows = read_only_query(path, "select name from pragma_table_info('documents')")
    if "agreement_vs_full" not in {row[0] for row in rows}:
        return "rouge_l_vs_full"
    if run_id is None:
        return "agreement_vs_full"
    _, rows = read_only_query(
        path, "select count(agreement_vs_full) from documents where run_id = ? and status = 'done'", [run_id]
    )
    return "agreement_vs_full" if rows[0][0] else "rouge_l_vs_full"


def _checked_fidelity(column: str) -> str:
    if column not in ("agreement_vs_full", "rouge_l_vs_full"):
        raise ValueError(f"fidelity column: '{column}' is not agreement_vs_full or rouge_l_vs_full")
    return column


def report_variants(path, run_id: int, fidelity: str = "rouge_l_vs_full") -> list[dict]:
    """One row per variant of a run's done documents: counts, mean bytes, ratio, fidelity, speeds."""
    fidelity = _checked_fidelity(fidelity)
    return _read_dicts(
        path,
        f"select variant, method, budget, count(*) as documents, avg(kept_bytes) as mean_kept_bytes, "
        f"avg(full_seq_bytes) as mean_full_seq_bytes, avg(compression_ratio) as mean_compression_ratio, "
        f"avg({fidelity}) as mean_fidelity, avg(prefill_tokens_per_second) as mean_prefill_tps, "
        f"avg(decode_tokens_per_second) as mean_decode_tps "
        f"from documents where run_id = ? and status = 'done' "
        f"group by variant, method, budget order by method = 'full' desc, variant",
        [run_id],
    )


def report_documents(path, run_id: int, fidelity: str = "rouge_l_vs_full") -> list[dict]:
    """A run's done documents, one row per document × variant, with ``fidelity`` as the fidelity."""
    fidelity = _checked_fidelity(fidelity)
    return _read_dicts(
        path,
        f"select document_id, variant, method, prompt_tokens, output_tokens, kept_bytes, full_seq_bytes, "
        f"compression_ratio, {fidelity} as fidelity, prefill_tokens_per_second, decode_tokens_per_second "
        f"from documents where run_id = ? and status = 'done' order by document_id, method = 'full' desc, variant",
        [run_id],
    )


def report_layers(path, run_id: int) -> list[dict]:
    """Per compressed variant and layer, over a run's done documents: budget (mean, min, max),
    mean tokens kept and seen, mean concentration."""
    return _read_dicts(
        path,
        "select d.variant, d.method, l.layer, count(*) as documents, avg(l.layer_budget) as mean_budget, "
        "min(l.layer_budget) as min_budget, max(l.layer_budget) as max_budget, "
        "avg(l.tokens_kept) as mean_tokens_kept, avg(l.concentration) as mean_concentration "
        "from layer_stats l join documents d on d.id = l.document_row "
        "where d.run_id = ? and d.status = 'done' and d.method != 'full' "
        "group by d.variant, d.method, l.layer order by d.variant, l.layer",
        [run_id],
    )


def report_problems(path, run_id: int) -> list[dict]:
    """A run's failed and skipped documents: one row per document, status and reason, with its variants."""
    return _read_dicts(
        path,
        "select document_id, status, error, group_concat(variant, ', ') as variants from "
        "(select document_id, status, coalesce(error, '') as error, variant from documents "
        "where run_id = ? and status != 'done' order by variant) "
        "group by document_id, status, error order by status, document_id",
        [run_id],
    )


def report_history(path, job_name: str, fidelity: str = "rouge_l_vs_full") -> list[dict]:
    """Per run of ``job_name`` and variant: mean prefill and decode tokens/s and fidelity of its done rows."""
    fidelity = _checked_fidelity(fidelity)
    return _read_dicts(
        path,
        f"select r.id as run_id, r.started_at, d.variant, d.method, count(*) as documents, "
        f"avg(d.prefill_tokens_per_second) as mean_prefill_tps, avg(d.decode_tokens_per_second) as mean_decode_tps, "
        f"avg(d.{fidelity}) as mean_fidelity "
        f"from runs r join documents d on d.run_id = r.id "
        f"where r.job_name = ? and d.status = 'done' group by r.id, d.variant order by r.id, d.variant",
        [job_name],
    )
