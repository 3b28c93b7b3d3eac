"""What an adversarial new user broke in velox-batch (issue 10), one pinned defect per section."""

import json
import math
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import pipeline.runner as runner
import pipeline.store as store_module
import pipeline.store.migrations as migrations_module
from pipeline.runner import EXIT_BAD_INPUT, EXIT_LOCKED, JobError, run_job
from pipeline.spec import SpecError, load_spec, parse_spec
from pipeline.store import MIGRATIONS, Store
from tests.test_pipeline import REPO, invoke, job, rows, wait_until_stored, write_corpus  # noqa: F401 (job is a fixture)
from tests.tiny_model import build_tiny_model_dir


def base_spec(**input_changes):
    return {
        "name": "t",
        "model": "m",
        "input": {"path": "x.parquet", "id_column": "id", "text_column": "text", **input_changes},
    }


def no_model(name):
    raise AssertionError("the model was loaded before the input and store were validated")


def cli_env(**extra):
    """Environment for a ``python -m pipeline.cli`` subprocess that uses this worktree's code."""
    return {**os.environ, "VELOX_BLAS": "reference", **extra}


# ----- 1. prompt templates are validated by their real fields ---------------------------------


@pytest.mark.parametrize(
    "template, message",
    [
        ("Summarize: {{text}}", "must contain the field {text}"),
        ('Reply as JSON {"a": 1}: {text}', "double them"),
        ("{text} and a stray {", "double them"),
        ("{text} and a stray }", "double them"),
        ("{} {text}", "'{}' is not a column field"),
        ("{text.upper} {text}", "'{text.upper}' is not a column field"),
        ("{text!r}", "'{text!r}' is not a column field"),
    ],
)
def test_prompt_template_fields_are_checked_with_a_real_parser(template, message):
    with pytest.raises(SpecError, match="input.prompt_template") as error:
        parse_spec(base_spec(prompt_template=template))
    assert message in str(error.value)


def test_doubled_braces_are_literal_text(job, tiny_model):
    from pipeline.prompting import build_prompt
    from pipeline.source import Document

    spec = load_spec(job({"input": {"prompt_template": 'Reply like {{"a": 1}}: {text}'}}))
    assert spec.input.template_columns() == ["text"]
    _, tokenizer = tiny_model
    prompt = build_prompt(spec, tokenizer, Document("d", {"text": "hi"}, "h"))
    assert 'Reply like {"a": 1}: hi' in tokenizer.decode(prompt.tokens)


# ----- 2. one current row per document and variant; keys ignore limits that did not apply ----


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


@pytest.mark.parametrize("policy", ["truncate", "skip"])
def test_raising_the_prompt_limit_redoes_only_documents_it_applied_to(job, tmp_path, policy):
    table = pa.table({"id": ["a", "b", "long"], "text": ["short text one", "short text two", "y " * 200], "topic": ["t"] * 3})
    pq.write_table(table, tmp_path / "corpus.parquet")
    path = job({"limits": {"max_prompt_tokens": 120, "on_too_long": policy}, "variants": [{"name": "full", "method": "full"}]})
    assert invoke("run", path, "-q").exit_code == 0
    assert invoke("run", path, "-q", "--max-prompt-tokens", 2000).exit_code == 0
    db = tmp_path / "store.db"
    assert rows(db, "select documents_unchanged, documents_done from runs where id = 2") == [(2, 1)]
    assert rows(db, "select count(*) from documents where document_id != 'long'") == [(2,)]
    assert rows(db, "select status, truncated from latest_documents where document_id = 'long'") == [("done", 0)]
    # a cut prompt's row stays as history; a skipped one is replaced by the work it stood for
    history = rows(db, "select status from documents where document_id = 'long' and is_latest = 0")
    assert history == ([("done",)] if policy == "truncate" else [])
    assert rows(db, "select documents from method_summary") == [(3,)]


# ----- 3. the model's context limit applies without max_prompt_tokens ------------------------


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory):
    directory = build_tiny_model_dir(tmp_path_factory.mktemp("short") / "llama")
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = 96
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("policy, status", [("truncate", "done"), ("skip", "skipped"), ("fail", "error")])
def test_prompts_longer_than_the_model_context_follow_on_too_long(job, tmp_path, short_context_model, policy, status):
    path = job({"limits": {"on_too_long": policy}, "variants": [{"method": "full"}], "generation": {"max_tokens": 6}},
               model=str(short_context_model))
    result = invoke("run", path, "-q")
    assert result.exit_code == (1 if policy == "fail" else 0), result.output
    db = tmp_path / "store.db"
    assert rows(db, "select distinct status from documents") == [(status,)]
    if policy == "truncate":
        assert rows(db, "select max(prompt_tokens) from documents")[0][0] + 6 <= 96
    else:
        errors = rows(db, "select distinct error from documents")
        assert "context" in errors[0][0] and "96" in errors[0][0]


def test_max_tokens_filling_the_whole_context_is_an_input_error(job, short_context_model):
    result = invoke("run", job({"generation": {"max_tokens": 96}}, model=str(short_context_model)))
    assert result.exit_code == EXIT_BAD_INPUT
    assert "generation.max_tokens" in result.output and "Traceback" not in result.output


# ----- 4. every input file is validated before the model loads --------------------------------


def _later_csv(directory):
    (directory / "b.parquet").write_text("id,text\nx,hello\n")
    return "b.parquet: not a Parquet file"


def _later_wrong_type(directory):
    pq.write_table(pa.table({"id": ["x"], "text": [42], "topic": ["t"]}), directory / "b.parquet")
    return "column 'text' is int64 in"


def _later_missing_column(directory):
    pq.write_table(pa.table({"id": ["x"], "body": ["hello"], "topic": ["t"]}), directory / "b.parquet")
    return "column 'text' not found in"


@pytest.mark.parametrize("make_later_file", [_later_csv, _later_wrong_type, _later_missing_column])
def test_every_input_file_is_validated(job, tmp_path, make_later_file):
    directory = tmp_path / "corpus"
    directory.mkdir()
    write_corpus(directory / "a.parquet")
    message = make_later_file(directory)
    path = job({"input": {"path": str(directory)}})
    result = invoke("run", path)
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert message in result.output and "b.parquet" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(JobError) as error:
        run_job(load_spec(path), load_model=no_model)
    assert error.value.exit_status == EXIT_BAD_INPUT


def test_files_that_agree_on_string_types_are_read_together(job, tmp_path):
    directory = tmp_path / "corpus"
    directory.mkdir()
    write_corpus(directory / "a.parquet", n=2)
    table = pa.table({"id": pa.array(["z"], pa.large_string()), "text": pa.array(["more"], pa.large_string()), "topic": ["t"]})
    pq.write_table(table, directory / "b.parquet")
    result = invoke("run", job({"input": {"path": str(directory)}, "variants": [{"method": "full"}]}), "-q")
    assert result.exit_code == 0, result.output
    assert rows(tmp_path / "store.db", "select count(*) from documents where status = 'done'") == [(3,)]


# ----- 5. a bad --db is one line and exit 2 ---------------------------------------------------


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


# ----- 6. the lock comes before the first migration, and each migration is atomic ------------


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


# ----- 7. signals and crashes mark the run and exit with their own status --------------------


@pytest.mark.parametrize("signum, exit_status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_marks_the_run_interrupted_and_releases_the_lock(job, tmp_path, signum, exit_status):
    write_corpus(tmp_path / "corpus.parquet", n=30)
    path = job({"generation": {"max_tokens": 24}})
    db = tmp_path / "store.db"
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(path), "-q"],
        cwd=REPO, env=cli_env(), stderr=subprocess.PIPE, text=True,
    )
    wait_until_stored(process, db, 3, what="interrupted")
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == exit_status, stderr
    assert "Traceback" not in stderr and signal.Signals(signum).name in stderr
    [(status, ended_at, error)] = rows(db, "select status, ended_at, error from runs")
    assert status == "interrupted" and ended_at is not None and signal.Signals(signum).name in error
    done = rows(db, "select count(*) from documents where status = 'done'")[0][0]
    assert rows(db, "select count(*) from layer_stats") == [(done * 4,)]
    with Store(db).locked():  # the lock is free again
        pass
    if signum == signal.SIGTERM:  # one resume is enough to show it picks up where the run stopped
        resumed = invoke("run", path, "-q")
        assert resumed.exit_code == 0, resumed.output
        assert rows(db, "select documents_unchanged from runs where id = 2") == [(done,)]
        assert rows(db, "select count(*) from latest_documents where status = 'done'") == [(90,)]


def test_ctrl_c_while_the_model_loads_marks_the_run_interrupted(job, tmp_path):
    def interrupted_load(name):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler runs before this ends
        raise AssertionError("SIGINT was not handled")

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite itself runs in the background
    summary = run_job(load_spec(job()), load_model=interrupted_load, quiet=True)
    assert summary.exit_status == 130
    assert rows(tmp_path / "store.db", "select status, error from runs") == [("interrupted", "SIGINT")]
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def test_an_unexpected_crash_marks_the_run_failed(job, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(runner.Progress, "document_done", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        run_job(load_spec(job()), quiet=True)
    assert rows(tmp_path / "store.db", "select status, error from runs") == [("failed", "RuntimeError: disk on fire")]
    result = invoke("run", job(), "-q")
    assert result.exit_code == runner.EXIT_CRASHED
    assert "disk on fire" in result.output
    assert rows(tmp_path / "store.db", "select status from runs order by id") == [("failed",), ("failed",)]


# ----- 8. validation gaps ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"generation": {"seed": -1}}, "generation.seed: must be in [0, 2**64)"),
        ({"generation": {"seed": 2**64}}, "generation.seed: must be in [0, 2**64)"),
        ({"generation": {"temperature": math.nan}}, "generation.temperature: must be a finite number"),
        ({"generation": {"temperature": math.inf}}, "generation.temperature: must be a finite number"),
        ({"generation": {"top_p": math.nan}}, "generation.top_p"),
        ({"input": {"path": ""}}, "input.path: must not be empty"),
        ({"input": {"path": "   "}}, "input.path: must not be empty"),
        (
            {"input": {"text_column": None, "prompt_column": "text"}, "limits": {"on_too_long": "truncate"}},
            "limits.on_too_long: 'truncate' cannot cut a ready prompt",
        ),
    ],
)
def test_more_bad_values_are_spec_errors(job, changes, message):
    result = invoke("run", job(changes))
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert message in result.output and "Traceback" not in result.output


def test_seed_at_the_top_of_its_range_is_valid():
    raw = {**base_spec(), "generation": {"seed": 2**64 - 1}}
    assert parse_spec(raw).generation.seed == 2**64 - 1


def test_truncate_with_a_prompt_column_is_refused_also_as_an_override(job):
    path = job({"input": {"text_column": None, "prompt_column": "text"}})
    assert load_spec(path).limits.on_too_long == "fail"  # the default for ready prompts
    result = invoke("run", path, "--on-too-long", "truncate")
    assert result.exit_code == EXIT_BAD_INPUT and "cannot cut a ready prompt" in result.output


@pytest.mark.parametrize(
    "text, key",
    [
        ("name: a\nmodel: m\nname: b\ninput: {path: x, id_column: id, text_column: text}\n", "name"),
        ("name: a\nmodel: m\ninput: {path: x, id_column: id, text_column: text, id_column: other}\n", "id_column"),
    ],
)
def test_duplicate_yaml_keys_are_errors(tmp_path, text, key):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=f"duplicate key '{key}'"):
        load_spec(path)


# ----- 9. one default store path ---------------------------------------------------------------


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


# ----- 10. stores on read-only locations can be read ------------------------------------------


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


# ----- 11. query: no files created, honest errors, visible truncation -------------------------


@pytest.fixture
def small_store(job, tmp_path):
    assert invoke("run", job(), "--limit", 1, "-q").exit_code == 0
    return tmp_path / "store.db"


@pytest.mark.parametrize(
    "sql, message",
    [
        ("attach database '{dir}/x.db' as x", "creates no files"),
        ("vacuum into '{dir}/x.db'", "creates no files"),
        ("selec 1", 'near "selec": syntax error'),
        ("select nope from documents", "no such column: nope"),
        ("delete from documents", "read-only"),
    ],
)
def test_query_errors_say_what_went_wrong(small_store, tmp_path, sql, message):
    result = invoke("query", sql.format(dir=tmp_path), "--db", small_store)
    assert result.exit_code != 0
    assert message in result.output
    if "read-only" not in message:
        assert "read-only" not in result.output
    assert not (tmp_path / "x.db").exists()
    assert rows(small_store, "select count(*) from documents") == [(3,)]


def test_cut_table_cells_end_with_an_ellipsis(small_store):
    result = invoke("query", "select printf('%.100c', 'a') as long, 'short' as s", "--db", small_store)
    assert result.exit_code == 0
    assert "a" * 59 + "…" in result.output and "a" * 61 not in result.output


# ----- 12. runs.device names the BLAS MLX really uses ------------------------------------------


def test_runs_device_names_the_reference_blas_when_openblas_is_not_preloaded(job, tmp_path):
    env = {k: v for k, v in cli_env().items() if k != "LD_PRELOAD"}
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", str(job()), "--limit", "1", "--variant", "full", "-q"],
        cwd=REPO, env={k: str(v) for k, v in env.items()}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    [(device,)] = rows(tmp_path / "store.db", "select device from runs")
    assert "reference BLAS" in device and "OpenBLAS" not in device


def test_preloaded_openblas_is_recognised_with_numpy_loaded():
    from pipeline.platform import find_openblas

    library = find_openblas()
    if library is None:
        pytest.skip("no OpenBLAS installed")
    probe = "import numpy, mlx.core, mlx_lm; from pipeline.platform import loaded_blas; print(loaded_blas())"
    env = {**os.environ, "LD_PRELOAD": str(library)}
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("OpenBLAS") and "numpy" not in result.stdout


# ----- 13. busy write locks are waited for; symlinked stores share one run lock ---------------


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
