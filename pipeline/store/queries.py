"""Read-only access to a store: ad-hoc SQL (``velox-batch query``), and the readers of
``status``, ``show`` and the HTML report.

Every reader opens its own read-only connection, so it can run while a job writes;
a store in a place this process cannot write is opened immutable (see
``read_only_note``). ``documents`` keeps history: each document × variant has one
row marked ``is_latest``; the views and ``show`` read only those.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Optional

from .base import SQLITE_CANTOPEN, SQLITE_READONLY, QueryError, primary_code
from .migrations import ACCOUNTING

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
        if primary_code(exc) not in (SQLITE_READONLY, SQLITE_CANTOPEN) and "readonly" not in str(exc):
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


# ----- report queries (read-only; used by pipeline/report/) -------------------------------------


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


def report_frontier(path, job_name: str) -> list[dict]:
    """The compression frontier of a job's latest points (``frontier_summary``): per variant, budget and bits (a
    quantized point's variant named with its bits), the documents,
    the share of their prompts' bytes kept (all together, and the mean per document), mean and worst
    agreement, mean compression ratio (by share kept)."""
    if not _read_dicts(path, "select 1 from sqlite_master where type = 'table' and name = 'frontier'"):
        return []
    return _read_dicts(
        path,
        "select f.variant || case when f.kv_bits is null then '' else ' (' || f.kv_bits || ' bits)' end as variant, "
        "f.method, f.budget, f.kv_bits, count(*) as documents, "
        "sum(f.kept_bytes) * 1.0 / sum(f.full_seq_bytes) as kept_share, avg(f.kept_share) as mean_kept_share, "
        "avg(f.agreement_vs_full) as mean_agreement, min(f.agreement_vs_full) as worst_agreement, "
        "avg(f.compression_ratio) as mean_compression_ratio "
        "from frontier f join runs r on r.id = f.run_id "
        "where r.job_name = ? and f.is_latest = 1 and f.status = 'done' and f.accounting = ? "
        "group by f.variant, f.method, f.budget, f.kv_bits order by f.variant, f.kv_bits, kept_share",
        [job_name, ACCOUNTING],
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
