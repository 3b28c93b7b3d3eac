"""The SQLite store: the only package that writes or reads SQL.

``writer`` holds ``Store``, the one writer (run lock, write transactions that wait
for a busy lock); ``migrations`` the numbered migrations that build the schema;
``queries`` the read-only readers (``velox-batch query``, ``status``, ``show`` and
the HTML report). ``documents`` keeps history: each document × variant has one row
marked ``is_latest``; the views and ``show`` read only those.
"""

from .base import QueryError, StoreError, StoreLocked, now
from .migrations import MIGRATIONS, migrate, migration
from .queries import (
    document_layers,
    document_variants,
    fidelity_column,
    has_runs_table,
    read_only_note,
    read_only_query,
    recent_runs,
    report_documents,
    report_frontier,
    report_history,
    report_later_runs,
    report_layers,
    report_problems,
    report_run,
    report_run_ids,
    report_variants,
)
from ..defaults import DEFAULT_DB  # the CLI's --db default; spec.py shares it
from .writer import (
    BUSY_TIMEOUT_MS,
    WAIT_NOTICE_SECONDS,
    Store,
    check_store_path,
)

__all__ = [
    "BUSY_TIMEOUT_MS",
    "DEFAULT_DB",
    "MIGRATIONS",
    "QueryError",
    "Store",
    "StoreError",
    "StoreLocked",
    "WAIT_NOTICE_SECONDS",
    "check_store_path",
    "document_layers",
    "document_variants",
    "fidelity_column",
    "has_runs_table",
    "migrate",
    "migration",
    "now",
    "read_only_note",
    "read_only_query",
    "recent_runs",
    "report_documents",
    "report_history",
    "report_later_runs",
    "report_frontier",
    "report_layers",
    "report_problems",
    "report_run",
    "report_run_ids",
    "report_variants",
]
