"""A run: limits that change which documents are redone, the model's context limit, and signals
and crashes that mark the run and exit with their own status (issue 10)."""

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.runner as runner
from pipeline.runner import EXIT_BAD_INPUT, run_job
from pipeline.spec import load_spec
from pipeline.store import Store
from tests.pipeline.helpers import REPO, cli_env, invoke, rows, wait_until_stored, write_corpus
from tests.tiny_model import build_tiny_model_dir


# ----- keys ignore limits that did not apply -------------------------------------------------


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


# ----- the model's context limit applies without max_prompt_tokens ---------------------------


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


# ----- signals and crashes mark the run and exit with their own status -----------------------


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
