"""The CLI: help for every command, readers that start without MLX, query's honest errors and
table output (issue 10)."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

import pipeline.cli as cli_module
from pipeline import platform
from pipeline.cli import cli
from pipeline.model_import import COMPLETE_MARKER
from pipeline.store import Store
from tests.pipeline.helpers import REPO, invoke, rows


# ----- help -----------------------------------------------------------------------------------


def test_every_command_has_help():
    runner = CliRunner()

    def walk(group, path):
        for name, command in group.commands.items():
            result = runner.invoke(cli, [*path, name, "--help"])
            assert result.exit_code == 0, (path, name)
            assert "Example" in result.output, f"{' '.join(path + [name])} --help lacks an example"
            if hasattr(command, "commands"):
                walk(command, path + [name])

    walk(cli, [])


# ----- the readers start fast: no MLX, no re-execution ----------------------------------------

READERS_PROBE = """
import json, sys
from click.testing import CliRunner
from pipeline.cli import cli

db, report = sys.argv[1], sys.argv[2]
runner = CliRunner()
helps = [["--help"]]
stack = [([], cli)]
while stack:
    path, group = stack.pop()
    for name, command in group.commands.items():
        helps.append([*path, name, "--help"])
        if hasattr(command, "commands"):
            stack.append(([*path, name], command))
readers = [["status", "--db", db], ["query", "select count(*) from documents", "--db", db],
           ["show", "d", "--db", db], ["models", "list"], ["report", "--db", db, "-o", report]]
results = {" ".join(args): runner.invoke(cli, args) for args in helps + readers}
print(json.dumps({
    "failed": {args: result.output for args, result in results.items() if result.exit_code != 0},
    "loaded": sorted(name for name in sys.modules if name.split(".")[0] in ("mlx", "mlx_lm", "velox_cache")),
}))
"""


def test_help_and_the_readers_import_no_mlx(tmp_path):
    db = tmp_path / "store.db"
    with Store(db).locked() as store:
        run_id = store.start_run({"job_name": "j"})
        layer = {"layer": 0, "layer_budget": 8, "tokens_seen": 20, "tokens_kept": 8}
        store.save_document({"doc_key": "k", "run_id": run_id, "document_id": "d", "variant": "v",
                             "method": "h2o", "status": "done", "output": "out"}, [layer])
        store.finish_run(run_id, "done", {"documents_done": 1})
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / COMPLETE_MARKER).write_text("x")
    result = subprocess.run(
        [sys.executable, "-c", READERS_PROBE, str(db), str(tmp_path / "report.html")],
        cwd=REPO, env={**os.environ, "VELOX_MODELS_DIR": str(tmp_path / "models")}, capture_output=True, text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["failed"] == {}
    assert found["loaded"] == []


@pytest.mark.parametrize(
    "args, reexecutes",
    [
        ([], False),
        (["--help"], False),
        (["--version"], False),
        (["status", "--db", "x.db"], False),
        (["query", "select 1"], False),
        (["show", "d"], False),
        (["report", "-o", "r.html"], False),
        (["models", "list"], False),
        (["corpus", "pydoc-topics"], False),
        (["run", "jobs/summarize.yaml", "--limit", "1"], True),
        (["doctor"], True),
        (["models", "import"], True),
    ],
)
def test_only_the_commands_that_load_mlx_reexecute_for_the_fast_blas(monkeypatch, args, reexecutes):
    calls = []
    monkeypatch.setattr(platform, "ensure_fast_blas", lambda: calls.append(args))
    monkeypatch.setattr(sys, "argv", ["velox-batch", *args])
    monkeypatch.setattr(cli, "main", lambda *a, **k: None)  # decide, but run nothing
    cli_module.main()
    assert calls == ([args] if reexecutes else [])


# ----- query: no files created, honest errors, visible truncation -----------------------------


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
