"""What the store's writer, migrations and readers share: SQLite result codes, errors, timestamps."""

from __future__ import annotations

import datetime as dt
import sqlite3
from typing import Optional

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


def primary_code(exc: sqlite3.Error) -> Optional[int]:
    """The primary SQLite result code of an error (Python 3.11+ records it), else None."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    return None if code is None else code & 0xFF
