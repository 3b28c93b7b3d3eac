"""What the pipeline tests share: a tiny corpus, reading a store, invoking the CLI."""

import os
import sqlite3
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from pipeline.cli import cli

REPO = Path(__file__).resolve().parents[2]  # the repository root: tests/pipeline/helpers.py


def write_corpus(path, n=4, **extra_columns):
    ids = [f"doc-{i}" for i in range(n)]
    texts = [f"Document {i} talks about kv caches and eviction number {i}. " * 2 for i in range(n)]
    table = pa.table({"id": ids, "text": texts, "topic": ["caches"] * n, **extra_columns})
    pq.write_table(table, path)
    return path


def rows(db, sql):
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def wait_until_stored(process, db, count: int, *, timeout: float = 120, what: str = "killed") -> None:
    """Wait until ``db`` holds ``count`` document rows, while ``process`` (the run) keeps running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            if rows(db, "select count(*) from documents")[0][0] >= count:
                return
        except sqlite3.OperationalError:  # no store yet, or no table yet
            pass
        assert process.poll() is None, f"the run ended before it could be {what}"


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def cli_env(**extra):
    """Environment for a ``python -m pipeline.cli`` subprocess that uses this worktree's code."""
    return {**os.environ, "VELOX_BLAS": "reference", **extra}


def no_model(name):
    raise AssertionError("the model was loaded before the input and store were validated")
