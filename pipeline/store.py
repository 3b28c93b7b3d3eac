"""The SQLite store: the only module that writes SQL.

Numbered migrations (recorded in ``_velox_migrations``) build the schema; WAL
mode and a busy timeout let people query while a job runs. One document's
rows (its ``documents`` row and its ``layer_stats``) are written in one
transaction, so a run killed at any point leaves each document either fully
stored or not at all. A lock file beside the database keeps two runs from
overlapping; the operating system releases it when a run dies, even on kill -9.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import os
import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import sqlite_utils

BUSY_TIMEOUT_MS = 30_000


class StoreLocked(RuntimeError):
    """Another run holds the store."""


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


def m003_layer_cache_kind(db: sqlite_utils.Database) -> None:
    """Which cache each layer had (``PyramidKVCache``, ``RotatingKVCache``, ...) and how it scored tokens."""
    db["layer_stats"].add_column("cache_kind", str)
    db["layer_stats"].add_column("scoring", str)


MIGRATIONS = [m001_tables, m002_views, m003_layer_cache_kind]


def migrate(db: sqlite_utils.Database) -> list[str]:
    """Apply the migrations not yet recorded; returns the names applied."""
    db["_velox_migrations"].create({"id": int, "name": str, "applied_at": str}, pk="id", if_not_exists=True)
    done = {row["name"] for row in db["_velox_migrations"].rows}
    applied = []
    for number, migration in enumerate(MIGRATIONS, 1):
        if migration.__name__ in done:
            continue
        with db.conn:
            migration(db)
            db["_velox_migrations"].insert({"id": number, "name": migration.__name__, "applied_at": now()})
        applied.append(migration.__name__)
    return applied


# ----- the store ------------------------------------------------------------------------------


class Store:
    """A job store on one SQLite file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite_utils.Database(self.path)
        self.db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        self.db.enable_wal()
        migrate(self.db)
        self._lock_file = None

    @contextmanager
    def locked(self) -> Iterator["Store"]:
        """Hold the store for one run; raises ``StoreLocked`` if another run holds it."""
        lock_path = self.path.with_name(self.path.name + ".lock")
        handle = open(lock_path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            raise StoreLocked(f"{self.path} is in use by another run ({holder or 'unknown process'})") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} since {now()}")
        handle.flush()
        try:
            yield self
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()

    # runs

    def close_abandoned_runs(self) -> int:
        """Mark runs left 'running' by a killed process as 'interrupted' (call while locked)."""
        with self.db.conn:
            cursor = self.db.execute(
                "update runs set status = 'interrupted', ended_at = coalesce(ended_at, ?) where status = 'running'",
                [now()],
            )
        return cursor.rowcount

    def start_run(self, row: dict) -> int:
        with self.db.conn:
            return self.db["runs"].insert({**row, "status": "running", "started_at": now()}).last_pk

    def update_run(self, run_id: int, **values) -> None:
        with self.db.conn:
            self.db["runs"].update(run_id, values)

    def finish_run(self, run_id: int, status: str, counts: dict) -> None:
        self.update_run(run_id, status=status, ended_at=now(), **counts)

    # documents

    def is_done(self, doc_key: str) -> bool:
        row = self.db.execute("select 1 from documents where doc_key = ? and status = 'done'", [doc_key]).fetchone()
        return row is not None

    def save_document(self, row: dict, layer_rows: list[dict]) -> int:
        """Store one document × variant and its per-layer rows atomically, replacing an earlier try."""
        with self.db.conn:
            old = self.db.execute("select id from documents where doc_key = ?", [row["doc_key"]]).fetchone()
            if old:
                self.db.execute("delete from layer_stats where document_row = ?", [old[0]])
                self.db.execute("delete from documents where id = ?", [old[0]])
            document_row = self.db["documents"].insert({**row, "created_at": now()}).last_pk
            if layer_rows:
                base = {k: row[k] for k in ("run_id", "document_id", "variant", "method")}
                self.db["layer_stats"].insert_all(
                    [{**base, **layer, "document_row": document_row} for layer in layer_rows]
                )
        return document_row

    def full_output(self, document_id: str, content_hash: str, settings_hash: str) -> Optional[str]:
        """The stored full-cache output for the same document content and settings, if any."""
        row = self.db.execute(
            "select output from documents where document_id = ? and content_hash = ? and settings_hash = ? "
            "and method = 'full' and status = 'done' order by id desc limit 1",
            [document_id, content_hash, settings_hash],
        ).fetchone()
        return row[0] if row else None

    def compressed_outputs(self, document_id: str, content_hash: str, settings_hash: str) -> list[tuple[int, str]]:
        return [
            tuple(row)
            for row in self.db.execute(
                "select id, output from documents where document_id = ? and content_hash = ? and "
                "settings_hash = ? and method != 'full' and status = 'done'",
                [document_id, content_hash, settings_hash],
            ).fetchall()
        ]

    def set_similarity(self, document_row: int, value: float) -> None:
        with self.db.conn:
            self.db["documents"].update(document_row, {"rouge_l_vs_full": value})


def read_only_query(path: str | os.PathLike, sql: str, params=()) -> tuple[list[str], list[tuple]]:
    """Run SQL on a store opened read-only; any write raises ``sqlite3.OperationalError``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no store at {path}")
    conn = sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True)
    try:
        conn.execute("PRAGMA query_only = ON")
        cursor = conn.execute(sql, params)
        columns = [d[0] for d in cursor.description or []]
        return columns, cursor.fetchall()
    finally:
        conn.close()


def recent_runs(path, limit: int = 10):
    """``(columns, rows)`` of the latest runs, newest first."""
    return read_only_query(path, "select * from run_summary limit ?", [limit])


def document_variants(path, document_id: str):
    """``(columns, rows)``: one document's rows, one per variant."""
    return read_only_query(
        path,
        "select id, variant, status, error, prompt_tokens, output_tokens, compression_ratio, "
        "rouge_l_vs_full, output from documents where document_id = ? order by id",
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
