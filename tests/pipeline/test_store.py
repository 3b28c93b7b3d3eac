"""The store: one current row per document and variant, store paths, the run lock, migrations,
read-only readers, busy write locks (issue 10)."""

import os
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import pipeline.store as store_module
import pipeline.store.migrations as migrations_module
from pipeline.runner import EXIT_BAD_INPUT, EXIT_LOCKED, JobError, run_job
from pipeline.spec import load_spec
from pipeline.store import MIGRATIONS, Store
from tests.pipeline.helpers import REPO, cli_env, invoke, no_model, rows


# ----- one current row per document and variant ----------------------------------------------


def test_a_changed_document_supersedes_its_old_rows(job, tmp_path):
    path = job({"variants": [{"name": "full", "method": "full"}, {"name": "pyramid", "method": "pyramidkv", "budget": 24}]})
    assert invoke("run", path, "-q").exit_code == 0
    table = pq.read_table(tmp_path / "corpus.parquet").to_pydict()
    table["text"][0] = "An entirely different text about something else. " * 2
    pq.write_table(pa.table(table), tmp_path / "corpus.parquet")
    assert invoke("run", path, "-q").exit_code == 0
    db = tmp_path / "store.db"
    assert rows(db, "select method, documents from method_summary order by method") == [("full", 4), ("pyramidkv", 4)]
    assert rows(db, "select count(*), sum(is_latest) from documents where document_id = 'doc-0'") == [(4, 2)]
    assert rows(db, "select count(*) from latest_documents") == [(8,)]
    assert rows(db, "select sum(documents) from layer_summary where variant = 'full' and layer = 0") == [(4,)]
    shown = invoke("show", "doc-0", "--db", db)
    assert shown.output.count("== doc-0 / full:") == 1 and shown.output.count("== doc-0 / pyramid:") == 1


# ----- a bad --db is one line and exit 2 ------------------------------------------------------


def _db_directory(tmp_path):
    return tmp_path, "is a directory"


def _db_not_sqlite(tmp_path):
    (tmp_path / "junk.db").write_text("this is not a database " * 100)
    return tmp_path / "junk.db", "not an SQLite database"


def _db_parent_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    return tmp_path / "afile" / "sub" / "store.db", "cannot create the directory"


def _db_read_only_location(tmp_path):
    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux /proc as a read-only location")
    return Path("/proc/velox-store.db"), "cannot write"


@pytest.mark.parametrize("make_db", [_db_directory, _db_not_sqlite, _db_parent_is_a_file, _db_read_only_location])
def test_a_bad_db_is_one_line_and_exit_2(job, tmp_path, make_db):
    db, message = make_db(tmp_path)
    result = invoke("run", job(), "--db", db)
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    spec = load_spec(job())
    spec.output.db = str(db)
    with pytest.raises(JobError):
        run_job(spec, load_model=no_model)


def test_a_missing_parent_directory_is_created(job, tmp_path):
    db = tmp_path / "new" / "dir" / "store.db"
    assert invoke("run", job(), "--db", db, "--limit", 1, "--variant", "full", "-q").exit_code == 0
    assert rows(db, "select count(*) from documents") == [(1,)]


# ----- the lock comes before the first migration, and each migration is atomic ---------------


def test_a_locked_store_is_not_migrated_by_the_second_run(job, tmp_path):
    import fcntl

    db = tmp_path / "store.db"
    with open(tmp_path / "store.db.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = invoke("run", job())
    assert result.exit_code == EXIT_LOCKED, result.output
    assert not db.exists() or rows(db, "select name from sqlite_master") == []


def test_a_migration_that_dies_halfway_leaves_nothing_behind(tmp_path, monkeypatch):
    def m001_then_crash(db):
        MIGRATIONS[0](db)
        raise RuntimeError("killed halfway")

    monkeypatch.setattr(migrations_module, "MIGRATIONS", [m001_then_crash])
    with pytest.raises(RuntimeError, match="killed halfway"):
        with Store(tmp_path / "s.db").locked():
            pass
    assert "runs" not in {name for (name,) in rows(tmp_path / "s.db", "select name from sqlite_master")}
    monkeypatch.setattr(migrations_module, "MIGRATIONS", MIGRATIONS)
    with Store(tmp_path / "s.db").locked():
        pass
    assert rows(tmp_path / "s.db", "select count(*) from _velox_migrations") == [(len(MIGRATIONS),)]


def test_a_store_from_before_the_history_marks_is_upgraded_in_place(tmp_path, monkeypatch):
    db = tmp_path / "old.db"
    monkeypatch.setattr(migrations_module, "MIGRATIONS", MIGRATIONS[:2])
    with Store(db).locked() as store:
        run_id = store.start_run({"job_name": "old"})
        for output in ("first", "second"):
            store.db["documents"].insert(
                {"doc_key": output, "run_id": run_id, "document_id": "d", "variant": "full", "method": "full",
                 "status": "done", "output": output}
            )
    monkeypatch.setattr(migrations_module, "MIGRATIONS", MIGRATIONS)
    with Store(db).locked():
        pass
    assert rows(db, "select output, is_latest from documents order by id") == [("first", 0), ("second", 1)]
    assert rows(db, "select variant, documents from method_summary") == [("full", 1)]
    shown = invoke("show", "d", "--db", db)
    assert shown.exit_code == 0 and "second" in shown.output and "first" not in shown.output


def test_a_store_from_before_cache_kinds_is_upgraded_in_place(tmp_path, monkeypatch):
    import pipeline.store.migrations as migrations_module

    db = tmp_path / "old.db"
    layer = {"layer": 0, "layer_budget": 8, "tokens_seen": 20, "tokens_kept": 8, "kept_bytes": 64,
             "full_seq_bytes": 160, "compression_ratio": 2.5, "concentration": 0.0}

    def document(key):
        return {"doc_key": key, "run_id": None, "document_id": key, "variant": "v", "method": "h2o", "status": "done"}

    monkeypatch.setattr(migrations_module, "MIGRATIONS", MIGRATIONS[:5])  # main's store before m006
    with Store(db).locked() as store:
        store.save_document(document("old"), [layer])
    monkeypatch.setattr(migrations_module, "MIGRATIONS", MIGRATIONS)
    with Store(db).locked() as store:
        store.save_document(document("new"), [{**layer, "cache_kind": "H2OCache", "scoring": "observed"}])
    assert ("m006_layer_cache_kind",) in rows(db, "select name from _velox_migrations order by id")
    assert rows(db, "select document_id, cache_kind, scoring from layer_stats order by id") == [
        ("old", None, None), ("new", "H2OCache", "observed")]
    assert rows(db, "select method, layer, documents from layer_summary") == [("h2o", 0, 2)]



def test_rows_stored_before_the_accounting_changes_are_marked_and_left_out_of_byte_figures(tmp_path, monkeypatch):
    """``kept_bytes`` counted spare slots before m012 and was taken after decoding until m013: the views
    average only rows of today's definition, and frontier rows from before carry no key and stop being latest."""
    db = tmp_path / "old.db"

    def document(key, **values):
        return {"doc_key": key, "run_id": None, "document_id": key, "variant": "v", "method": "h2o",
                "status": "done", "compression_ratio": 2.0, **values}

    monkeypatch.setattr(migrations_module, "MIGRATIONS", MIGRATIONS[:11])  # before m012
    with Store(db).locked() as store:
        store.save_document(document("spare"), [])
        store.db["frontier"].insert({"document_id": "spare", "variant": "v", "budget": "8", "kept_bytes": 1,
                                     "full_seq_bytes": 4, "created_at": "2001-01-01"})
    monkeypatch.setattr(migrations_module, "MIGRATIONS", MIGRATIONS[:12])  # m012, before m013
    with Store(db).locked() as store:
        store.save_document(document("decoded", spare_bytes=0), [])
    monkeypatch.setattr(migrations_module, "MIGRATIONS", MIGRATIONS)
    with Store(db).locked() as store:
        store.save_document(document("now", spare_bytes=0, compression_ratio=4.0, accounting="prefill_end"), [])
    assert rows(db, "select document_id, accounting from documents order by id") == [
        ("spare", "spare_counted"), ("decoded", "decode_end"), ("now", "prefill_end")]
    assert rows(db, "select documents, mean_compression_ratio from method_summary") == [(3, 4.0)]
    assert rows(db, "select status, is_latest, frontier_key from frontier") == [("done", 0, None)]
    assert rows(db, "select count(*) from frontier_summary") == [(0,)]

# ----- one default store path ------------------------------------------------------------------


def test_the_default_store_is_the_same_for_run_and_readers(job, tmp_path, monkeypatch):
    spec = yaml.safe_load(job().read_text())
    del spec["output"]
    (tmp_path / "no_output.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.chdir(tmp_path)
    assert invoke("run", "no_output.yaml", "--limit", 1, "--variant", "full", "-q").exit_code == 0
    assert (tmp_path / store_module.DEFAULT_DB).is_file()
    status = invoke("status")
    assert status.exit_code == 0 and "tiny-job" in status.output
    assert invoke("show", "doc-0").exit_code == 0


# ----- stores on read-only locations can be read ----------------------------------------------


@pytest.fixture
def read_only_store(job):
    """A finished WAL store with no side files, in a directory its reader cannot write."""
    directory = Path(tempfile.mkdtemp(prefix="velox-ro-"))
    directory.chmod(0o755)
    db = directory / "store.db"
    assert invoke("run", job(), "--db", db, "--limit", 1, "--variant", "full", "-q").exit_code == 0
    assert rows(db, "pragma journal_mode") == [("wal",)]  # closing the last connection removes -wal and -shm
    assert sorted(p.name for p in directory.iterdir()) == ["store.db", "store.db.lock"]
    db.chmod(0o444)
    directory.chmod(0o555)
    yield db
    directory.chmod(0o755)
    shutil.rmtree(directory)


def unprivileged_python():
    """``(interpreter, extra env, Popen options)`` that run this worktree's CLI as a user who cannot
    write the store (uid 65534 when the tests run as root, who could); None if there is none."""
    if os.geteuid() != 0:
        return sys.executable, {}, {}
    env = {"PYTHONPATH": sysconfig.get_paths()["purelib"]}
    options = {"user": 65534, "group": 65534, "extra_groups": []}
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for interpreter in (sys.executable, f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"):
        try:
            probe = subprocess.run(
                [interpreter, "-c", "import click, sqlite_utils"], env={**os.environ, **env}, cwd=REPO,
                capture_output=True, timeout=60, **options,
            )
        except OSError:
            continue
        if probe.returncode == 0:
            return interpreter, env, options
    return None


def run_cli_as_reader(reader, *args):
    interpreter, env, options = reader
    return subprocess.run(
        [interpreter, "-m", "pipeline.cli", *map(str, args)],
        cwd=REPO, env=cli_env(HOME="/tmp", **env), capture_output=True, text=True, timeout=120, **options,
    )


def test_status_and_query_read_a_store_they_cannot_write(read_only_store):
    reader = unprivileged_python()
    if reader is None:
        pytest.skip("no interpreter an unprivileged user can run")
    status = run_cli_as_reader(reader, "status", "--db", read_only_store)
    assert status.returncode == 0, status.stderr
    assert "tiny-job" in status.stdout and "immutable" in status.stderr
    query = run_cli_as_reader(reader, "query", "select count(*) as n from documents", "--db", read_only_store, "--format", "csv")
    assert query.returncode == 0, query.stderr
    assert query.stdout.splitlines() == ["n", "1"]


# ----- busy write locks are waited for; symlinked stores share one run lock -------------------


def test_a_write_lock_held_elsewhere_is_waited_for_with_a_message(tmp_path):
    db = tmp_path / "s.db"
    notices = []
    with Store(db, busy_timeout_ms=10, wait_notice_seconds=0).locked() as store:
        other = sqlite3.connect(db, isolation_level=None)
        other.execute("begin immediate")

        def on_wait(message):
            notices.append(message)
            if len(notices) == 2:
                other.execute("rollback")

        store.on_wait = on_wait
        run_id = store.start_run({"job_name": "waits"})
        other.close()
    assert run_id == 1 and len(notices) == 2
    assert "waiting" in notices[0] and str(db) in notices[0]


def test_a_symlinked_store_path_takes_the_same_lock(job, tmp_path):
    real = tmp_path / "real.db"
    link = tmp_path / "link.db"
    link.symlink_to(real)
    with Store(real).locked():
        result = invoke("run", job(), "--db", link)
    assert result.exit_code == EXIT_LOCKED, result.output
