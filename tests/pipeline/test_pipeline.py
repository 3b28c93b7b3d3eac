"""velox-batch end to end on the tiny model with temporary Parquet files."""

import json
import os
import signal
import sqlite3
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.execute

from pipeline.runner import EXIT_BAD_INPUT, EXIT_DOCUMENT_FAILED, EXIT_LOCKED, JobError, run_job
from pipeline.spec import SpecError, load_spec, parse_spec
from pipeline.store import MIGRATIONS, Store
from tests.pipeline.helpers import REPO, invoke, rows, wait_until_stored, write_corpus


def test_run_fills_every_table_and_view(job, tmp_path):
    result = invoke("run", job())
    assert result.exit_code == 0, result.output
    db = tmp_path / "store.db"
    assert rows(db, "select status, documents_done from runs") == [("done", 12)]
    assert rows(db, "select count(*) from documents where status = 'done'") == [(12,)]
    assert rows(db, "select count(*) from layer_stats") == [(12 * 4,)]
    methods = rows(db, "select method, documents from method_summary order by method")
    assert methods == [("full", 4), ("pyramidkv", 4), ("squeeze", 4)]
    assert len(rows(db, "select * from layer_summary")) == 12
    assert rows(db, "select count(*) from documents where method != 'full' and rouge_l_vs_full is null") == [(0,)]
    budgets = rows(db, "select layer, layer_budget from layer_stats where variant = 'pyramid' and document_id = 'doc-0'")
    assert [b for _, b in budgets] == sorted([b for _, b in budgets], reverse=True)
    assert sum(b for _, b in budgets) == 24 * 4
    assert rows(db, "select count(*) from layer_stats where tokens_kept > layer_budget and method != 'full'") == [(0,)]
    assert rows(db, "select count(*) from _velox_migrations") == [(len(MIGRATIONS),)]
    kinds = rows(db, "select distinct method, cache_kind, scoring from layer_stats order by method")
    assert [k[:2] for k in kinds] == [("full", "FullKVCache"), ("pyramidkv", "PyramidKVCache"),
                                      ("squeeze", "SqueezeAttentionCache")]
    assert "[4/4] doc-3" in result.output  # plain progress lines when not on a terminal


def test_full_text_search_and_query_formats(job, tmp_path):
    invoke("run", job(), "--quiet")
    db = tmp_path / "store.db"
    word = rows(db, "select output from documents where output != '' limit 1")
    ok = invoke("query", "select variant, count(*) as n from documents group by variant", "--db", db, "--format", "json")
    assert ok.exit_code == 0 and '"variant": "full"' in ok.output
    as_csv = invoke("query", "select document_id from documents order by id limit 1", "--db", db, "--format", "csv")
    assert as_csv.output.splitlines() == ["document_id", "doc-0"]
    found = invoke("query", "select count(*) from documents_fts where documents_fts match 'pyramid'", "--db", db)
    assert found.exit_code == 0 and "4" in found.output
    assert word is not None
    shown = invoke("show", "doc-1", "--db", db)
    assert shown.exit_code == 0 and "doc-1 / squeeze: done" in shown.output and "layer_budget" in shown.output
    assert invoke("status", "--db", db).exit_code == 0


def test_rerun_skips_and_force_redoes_without_duplicates(job, tmp_path):
    path = job()
    invoke("run", path, "-q")
    again = invoke("run", path)
    assert again.exit_code == 0
    db = tmp_path / "store.db"
    assert rows(db, "select documents_unchanged, documents_done from runs where id = 2") == [(12, 0)]
    forced = invoke("run", path, "--force", "-q")
    assert forced.exit_code == 0
    assert rows(db, "select count(*), count(distinct doc_key) from documents") == [(12, 12)]
    assert rows(db, "select count(*) from layer_stats") == [(48,)]
    assert rows(db, "select distinct run_id from documents") == [(3,)]


def test_changed_content_is_done_again(job, tmp_path):
    path = job()
    invoke("run", path, "-q")
    write_corpus(tmp_path / "corpus.parquet", n=5)
    invoke("run", path, "-q")
    db = tmp_path / "store.db"
    assert rows(db, "select documents_done, documents_unchanged from runs where id = 2") == [(3, 12)]


def test_decode_batch_sizes_store_the_same_rows(job, tmp_path):
    """Documents decoding together store what they store one at a time (timings and peak memory aside).

    Tokens, outputs, agreements and accounting are equal; the log-probabilities
    (and the NLL gap from them) agree to float rounding: a batch's matmuls add
    in another order than one row's.
    """
    write_corpus(tmp_path / "corpus.parquet", n=5)
    outputs = (
        "document_id, variant, status, output, prompt_tokens, output_tokens, stop_reason, kept_bytes, full_seq_bytes, "
        "compression_ratio, rouge_l_vs_full, agreement_vs_full, output_token_ids, doc_key"
    )
    rounded = "document_id, variant, nll_gap_vs_full, output_logprobs"
    layers = "document_id, variant, layer, layer_budget, tokens_seen, tokens_kept, kept_bytes, full_seq_bytes, concentration"
    stored = {}
    for batch in (1, 4):
        db = tmp_path / f"batch{batch}.db"
        path = job({"generation": {"decode_batch_size": batch}, "output": {"db": str(db)}})
        assert invoke("run", path, "-q").exit_code == 0
        stored[batch] = [rows(db, f"select {columns} from {table} order by {columns}")
                         for columns, table in ((outputs, "documents"), (layers, "layer_stats"))]
        stored[batch].append(rows(db, "select variant, max(decode_batch_size) from documents group by variant"))
        stored[batch].append([
            (document, variant, gap, json.loads(logprobs))
            for document, variant, gap, logprobs in rows(db, f"select {rounded} from documents order by 1, 2")
        ])
    assert stored[4][:2] == stored[1][:2]
    for batched, alone in zip(stored[4][3], stored[1][3]):
        assert batched[:2] == alone[:2]
        assert batched[2] == pytest.approx(alone[2], abs=1e-5)
        assert batched[3] == pytest.approx(alone[3], abs=1e-5)
    assert stored[1][2] == [("full", 1), ("pyramid", 1), ("squeeze", 1)]
    assert stored[4][2] == [("full", 4), ("pyramid", 4), ("squeeze", 4)]


LOOKING_AHEAD = [  # the full variant's own output is their draft when they share its reading; alone, they draft it
    {"name": "full", "method": "full"},
    {"name": "pyramid", "method": "pyramidkv", "budget": 24, "lookahead": 4, "kernel": 1},
    {"name": "squeeze", "method": "squeeze", "budget": 24, "lookahead": 6},
]


SAMPLED = {"generation": {"temperature": 0.8, "seed": 3}}
PENALISED = {"generation": {"repetition_penalty": 1.3}}


@pytest.mark.parametrize("variants, changes", [
    (None, {}), (LOOKING_AHEAD, {}), (LOOKING_AHEAD, SAMPLED), (LOOKING_AHEAD, PENALISED),
], ids=["plain", "look-ahead", "look-ahead-sampled", "look-ahead-penalised"])
def test_variants_sharing_one_reading_store_what_they_store_one_at_a_time(job, tmp_path, variants, changes):
    """The full and prefill-end variants of a document share one reading: the rows are those of separate runs.

    Where the full variant's output is not the greedy draft a variant's own prefill makes
    (sampled, penalised, or a look-ahead longer than ``max_tokens``, as the defaults' 16
    against 6 here), the reading drafts greedily itself.
    """
    write_corpus(tmp_path / "corpus.parquet", n=4)
    top = {"variants": variants} if variants is not None else {}
    spec = lambda extra: job({**changes, **extra}, **top)  # noqa: E731
    outputs = (
        "document_id, variant, status, output, prompt_tokens, output_tokens, stop_reason, kept_bytes, full_seq_bytes, "
        "compression_ratio, rouge_l_vs_full, agreement_vs_full, nll_gap_vs_full, output_token_ids, output_logprobs, "
        "doc_key"
    )
    layers = "document_id, variant, layer, layer_budget, tokens_seen, tokens_kept, kept_bytes, full_seq_bytes, concentration"
    shared, alone = tmp_path / "shared.db", tmp_path / "alone.db"
    assert invoke("run", spec({"output": {"db": str(shared)}}), "-q").exit_code == 0
    for variant in ("full", "pyramid", "squeeze"):
        assert invoke("run", spec({"output": {"db": str(alone)}}), "-q", "--variant", variant).exit_code == 0
    for columns, table in ((outputs, "documents"), (layers, "layer_stats")):
        query = f"select {columns} from {table} order by {columns}"
        assert rows(shared, query) == rows(alone, query)
    # each row's prefill_seconds is what its variant costs: the reading (the shared part) and its own cut
    timing = "select variant, count(reading_seconds), sum(prefill_seconds >= reading_seconds) from documents group by 1"
    assert rows(shared, timing) == [("full", 4, 4), ("pyramid", 4, 4), ("squeeze", 4, 4)]
    assert rows(alone, "select count(reading_seconds) from documents") == [(0,)]
    # drafting is apart from prefill; the full output is the draft where it is the one a variant's own prefill
    # makes (shared: its output in this run; alone: the one stored by the full variant's run before)
    drafts = "select variant, count(draft_seconds) from documents group by 1"  # prefill_end looks ahead by default
    drafted = 4 if variants is None or changes else 0
    assert rows(shared, drafts) == rows(alone, drafts) == [("full", 0), ("pyramid", drafted), ("squeeze", drafted)]
    # each row's peak is its own, never the other variants' recordings (they took it 30-45% above here); what is
    # left is the reading's scoring buffers, a far larger share of this tiny model's peak than of a real one's
    # (bench/store_figures.py measures SmolLM2)
    peaks = "select document_id, variant, peak_memory_bytes from documents order by 1, 2"
    for (document, variant, peak), (_, _, own) in zip(rows(shared, peaks), rows(alone, peaks)):
        assert peak == pytest.approx(own, rel=0.25), (document, variant)


def test_the_frontier_measures_every_policy_at_every_budget_from_the_same_reading(job, tmp_path):
    write_corpus(tmp_path / "corpus.parquet", n=3)
    path = job(frontier={"budgets": [8, 24, "50%"]})
    assert invoke("run", path, "-q").exit_code == 0
    db = tmp_path / "store.db"
    assert rows(db, "select count(*), count(distinct frontier_key) from frontier where is_latest = 1") == [(18, 18)]
    # at a variant's own budget the frontier point is that variant's own row, bytes and ratio by one definition
    same = rows(db, """select count(*) from frontier f join documents d on d.document_id = f.document_id
                       and d.variant = f.variant and f.budget = '24'
                       where f.agreement_vs_full = d.agreement_vs_full and f.kept_bytes = d.kept_bytes
                       and f.full_seq_bytes = d.full_seq_bytes and f.compression_ratio = d.compression_ratio
                       and abs(f.nll_gap_vs_full - d.nll_gap_vs_full) < 1e-5""")  # forced in another batch
    assert same == [(6,)]
    summary = rows(db, "select variant, budget, documents from frontier_summary order by variant, kept_share")
    assert summary == [("pyramid", "8", 3), ("pyramid", "24", 3), ("pyramid", "50%", 3),
                       ("squeeze", "8", 3), ("squeeze", "24", 3), ("squeeze", "50%", 3)]
    shares = rows(db, "select budget, avg(kept_share) from frontier where variant = 'pyramid' group by 1 order by 2")
    assert [b for b, _ in shares] == ["8", "24", "50%"] and all(0 < s <= 1 for _, s in shares)
    assert invoke("run", path, "-q", "--force").exit_code == 0
    assert rows(db, "select count(*) from frontier") == [(18,)], "a rerun replaces, never adds"


def test_peak_memory_does_not_count_the_other_rows_of_a_batch(job, tmp_path):
    """A row's ``peak_memory_bytes`` is its own: the same whether it decoded alone or fourth in a batch.

    Not to the byte: Velox's kernel splits work over two streams, so a peak moves
    by a few percent from run to run. The rows held before it in a batch of 4
    (each ~0.25 MiB here, with their snapshots) are far above that.
    """
    write_corpus(tmp_path / "corpus.parquet", n=5)
    peaks = {}
    for batch in (1, 4):
        db = tmp_path / f"batch{batch}.db"
        path = job({"generation": {"decode_batch_size": batch}, "output": {"db": str(db)}})
        assert invoke("run", path, "-q").exit_code == 0
        peaks[batch] = rows(db, "select document_id, variant, peak_memory_bytes from documents order by 1, 2")
    for (doc, variant, batched), (_, _, alone) in zip(peaks[4], peaks[1], strict=True):
        assert batched == pytest.approx(alone, rel=0.15), (doc, variant)


def test_killed_run_resumes_with_nothing_lost_or_doubled(job, tmp_path):
    """Killed (kill -9) while a group of documents is in flight (they decode in batches of 8)."""
    write_corpus(tmp_path / "corpus.parquet", n=40)
    path = job({"generation": {"max_tokens": 24}}, frontier={"budgets": [8, "50%"]})
    db = tmp_path / "store.db"
    env = {**os.environ, "VELOX_BLAS": "reference"}
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(path), "-q"], cwd=REPO, env=env
    )
    wait_until_stored(process, db, 5)
    process.send_signal(signal.SIGKILL)
    process.wait()
    stored = rows(db, "select count(*) from documents")[0][0]
    assert 5 <= stored < 120
    assert rows(db, "select status from runs") == [("running",)]
    with sqlite3.connect(db) as conn:  # as if it had been killed long ago
        conn.execute("update documents set created_at = '2001-01-01T00:00:00+00:00'")
    resumed = invoke("run", path, "-q")
    assert resumed.exit_code == 0, resumed.output
    assert rows(db, "select count(*), count(distinct doc_key) from documents") == [(120, 120)]
    assert rows(db, "select count(*) from documents where status != 'done'") == [(0,)]
    assert rows(db, "select count(*) from layer_stats") == [(120 * 4,)]
    frontier = "select count(*), count(distinct frontier_key) from frontier where status = 'done'"
    assert rows(db, frontier) == [(40 * 2 * 2, 40 * 2 * 2)], "every document's frontier, once"
    assert rows(db, "select id, status from runs order by id") == [(1, "interrupted"), (2, "done")]
    # the killed run ended when it stored its last document, not when the next run started
    assert rows(db, "select ended_at from runs where id = 1") == [("2001-01-01T00:00:00+00:00",)]
    assert rows(db, "select documents_unchanged + documents_done from runs where id = 2") == [(120,)]
    # a variant's settings change, and the run that redoes it and its frontier points is killed too
    changed = [{"name": "full", "method": "full"}, {"name": "pyramid", "method": "pyramidkv", "budget": 24, "kernel": 3},
               {"name": "squeeze", "method": "squeeze", "budget": 24}]
    path = job({"generation": {"max_tokens": 24}}, frontier={"budgets": [8, "50%"]}, variants=changed)
    process = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", str(path), "-q"], cwd=REPO, env=env)
    wait_until_stored(process, db, 125)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert invoke("run", path, "-q").exit_code == 0
    latest = "select count(*), count(distinct doc_key) from documents where is_latest = 1"
    assert rows(db, latest) == [(120, 120)]
    points = "select count(*), count(distinct frontier_key) from frontier where is_latest = 1 and status = 'done'"
    assert rows(db, points) == [(160, 160)], "every point once, the changed variant's measured again"
    assert rows(db, "select count(*) from frontier where is_latest = 0") == [(80,)]


def test_killed_while_a_row_of_a_batch_fails_every_other_row_is_stored_once(job, tmp_path):
    """kill -9 during a run whose batches hold a row that fails (a poisoned full variant), then resume."""
    from tests.pipeline import poison

    n, bad = 40, "doc-5"
    texts = [f"Document {i} talks about kv caches and eviction number {i}. " * 2 for i in range(n)]
    texts[5] = f"Document 5 is {poison.MARK}ed. " * 3
    pq.write_table(pa.table({"id": [f"doc-{i}" for i in range(n)], "text": texts, "topic": ["caches"] * n}),
                   tmp_path / "corpus.parquet")
    path = job({"generation": {"max_tokens": 24}})
    db = tmp_path / "store.db"
    command = [sys.executable, "-m", "tests.pipeline.poison", "run", str(path), "-q"]
    env = {**os.environ, "VELOX_BLAS": "reference"}
    process = subprocess.Popen(command, cwd=REPO, env=env)
    wait_until_stored(process, db, 5)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert rows(db, "select count(*), count(distinct doc_key) from documents")[0][0] < 3 * n
    with sqlite3.connect(db) as conn:  # as if it had been killed long ago
        conn.execute("update documents set created_at = '2001-01-01T00:00:00+00:00'")
    resumed = subprocess.run(command, cwd=REPO, env=env)
    assert resumed.returncode == EXIT_DOCUMENT_FAILED
    assert rows(db, "select count(*), count(distinct doc_key) from documents") == [(3 * n, 3 * n)]
    assert rows(db, "select document_id, variant, error from documents where status != 'done'") == [
        (bad, "full", "RuntimeError: injected: a poisoned row")
    ]
    assert rows(db, f"select variant, fidelity_note from documents where document_id = '{bad}' and variant != 'full'") == [
        ("pyramid", "the full variant failed: RuntimeError: injected: a poisoned row"),
        ("squeeze", "the full variant failed: RuntimeError: injected: a poisoned row"),
    ]
    assert rows(db, "select count(*) from documents where variant != 'full' and agreement_vs_full is null") == [(2,)]
    assert rows(db, "select count(*) from layer_stats") == [((3 * n - 1) * 4,)]


def test_bad_documents_are_stored_with_errors_and_the_run_goes_on(tmp_path, job):
    table = pa.table(
        {
            "id": ["good", "null", "empty", "binary", "long"],
            "text": ["fine text", None, "   ", "x", "y" * 400],
            "topic": ["t"] * 5,
            "blob": [b"ok", b"ok", b"ok", b"\xff\xfe broken", b"ok"],
        }
    )
    pq.write_table(table, tmp_path / "corpus.parquet")
    path = job(
        {
            "input": {"prompt_template": "{blob} {topic}: {text}"},
            "limits": {"max_prompt_tokens": 200, "on_too_long": "fail"},
            "variants": [{"name": "full", "method": "full"}],
        }
    )
    result = invoke("run", path, "-q")
    assert result.exit_code == EXIT_DOCUMENT_FAILED
    errors = dict(rows(tmp_path / "store.db", "select document_id, error from documents where status = 'error'"))
    assert "null" in errors["null"] and "empty" in errors["empty"]
    assert "UTF-8" in errors["binary"] and "max_prompt_tokens=200" in errors["long"]
    assert rows(tmp_path / "store.db", "select status from documents where document_id = 'good'") == [("done",)]
    assert rows(tmp_path / "store.db", "select status, documents_failed from runs") == [("done_with_errors", 4)]


@pytest.mark.parametrize("policy, status, truncated", [("skip", "skipped", None), ("truncate", "done", 1)])
def test_too_long_prompts_follow_the_limits(job, tmp_path, policy, status, truncated):
    path = job({"limits": {"max_prompt_tokens": 60, "on_too_long": policy}, "variants": [{"method": "full"}]})
    assert invoke("run", path, "-q").exit_code == 0
    db = tmp_path / "store.db"
    assert rows(db, "select distinct status, truncated from documents") == [(status, truncated)]
    if policy == "truncate":
        assert rows(db, "select max(prompt_tokens) from documents")[0][0] <= 60


@pytest.mark.parametrize(
    "change, message",
    [
        ({"generation": {"max_tokens": "ten"}}, "generation.max_tokens: expected an integer, got 'ten'"),
        ({"input": {"id_column": None}}, "input.id_column: must not be empty"),
        ({"generation": {"max_tokns": 5}}, "generation.max_tokns: unknown field (did you mean 'max_tokens'?)"),
        ({"variants": [{"method": "pyramidkv", "bugdet": 5}]}, "did you mean 'budget'?"),
        ({"variants": [{"method": "lru"}]}, "method: 'lru' is not one of"),
        ({"input": {"path": "/nonexistent/corpus.parquet"}}, "input.path: no Parquet file found at '/nonexistent/corpus.parquet'"),
        ({"input": {"text_column": "body"}}, "column 'body' not found"),
        ({"limits": {"on_too_long": "explode"}}, "limits.on_too_long: 'explode' is not one of"),
    ],
)
def test_bad_specs_fail_fast_with_one_clear_message(job, change, message):
    result = invoke("run", job(change))
    assert result.exit_code == EXIT_BAD_INPUT
    assert message in result.output
    assert "Traceback" not in result.output


def test_missing_column_lists_the_columns_and_loads_no_model(job):
    spec = load_spec(job({"input": {"text_column": "body"}}))

    def no_model(name):
        raise AssertionError("model loaded before the input was validated")

    with pytest.raises(JobError, match="columns: id, text, topic") as error:
        run_job(spec, load_model=no_model)
    assert error.value.exit_status == EXIT_BAD_INPUT


def test_missing_required_and_unknown_top_level_fields():
    with pytest.raises(SpecError, match="model: required field is missing"):
        parse_spec({"name": "x", "input": {}})
    with pytest.raises(SpecError, match=r"modle: unknown field \(did you mean 'model'\?\)"):
        parse_spec({"name": "x", "modle": "m", "model": "m", "input": {}})


def test_unknown_variant_override_is_an_error(job):
    result = invoke("run", job(), "--variant", "nope")
    assert result.exit_code == EXIT_BAD_INPUT and "variants: full, pyramid, squeeze" in result.output


def test_overrides_select_variants_db_and_limit(job, tmp_path):
    other = tmp_path / "other.db"
    result = invoke("run", job(), "--variant", "squeeze", "--db", other, "--limit", "2", "-q")
    assert result.exit_code == 0
    assert rows(other, "select variant, count(*) from documents group by variant") == [("squeeze", 2)]


def test_a_second_run_on_the_same_store_is_refused(job, tmp_path):
    path = job()
    with Store(tmp_path / "store.db").locked():
        result = invoke("run", path)
    assert result.exit_code == EXIT_LOCKED
    assert "in use by another run" in result.output


def test_query_cannot_write(job, tmp_path):
    invoke("run", job(), "-q", "--limit", "1")
    db = tmp_path / "store.db"
    for sql in ["delete from documents", "insert into runs (job_name) values ('x')", "drop table runs"]:
        result = invoke("query", sql, "--db", db)
        assert result.exit_code != 0
        assert "read-only" in result.output
    assert rows(db, "select count(*) from documents") == [(3,)]


class FakeTerminal:
    def __init__(self):
        import io

        self.buffer = io.StringIO()

    def isatty(self):
        return True

    def write(self, text):
        return self.buffer.write(text)

    def flush(self):
        pass


def test_progress_is_a_bar_on_a_terminal_and_silent_when_quiet(job, tmp_path):
    terminal = FakeTerminal()
    run_job(load_spec(job()), progress_stream=terminal)
    shown = terminal.buffer.getvalue()
    assert "4/4" in shown and ("doc/s" in shown or "s/doc" in shown)
    quiet = FakeTerminal()
    run_job(load_spec(job()), force=True, quiet=True, progress_stream=quiet)
    assert quiet.buffer.getvalue() == ""


def test_look_ahead_variants_with_no_full_output_draft_together_and_store_what_their_own_prefills_do(
        job, tmp_path, monkeypatch):
    """No full variant: each group's readings decode their drafts in one batch; the rows are those of own prefills."""
    write_corpus(tmp_path / "corpus.parquet", n=4)
    compressed = LOOKING_AHEAD[1:]
    columns = ("document_id, variant, status, output, output_token_ids, output_logprobs, kept_bytes, "
               "count(draft_seconds) over (partition by variant)")
    stored, drafted_together = {}, []
    original = pipeline.execute.draft_together
    monkeypatch.setattr(pipeline.execute, "draft_together",
                        lambda model, readings, **kw: (drafted_together.append(len(readings)), original(model, readings, **kw)))
    for way in ("together", "own prefill"):
        if way == "own prefill":  # no readings: each variant prefills (and drafts) on its own, one step at a time
            monkeypatch.setattr(pipeline.execute.SharedReadings, "sharing", staticmethod(lambda item: []))
        db = tmp_path / f"{way}.db"
        assert invoke("run", job({"output": {"db": str(db)}}, variants=compressed), "-q").exit_code == 0
        stored[way] = rows(db, f"select {columns} from documents order by 1, 2")
    assert stored["together"] == stored["own prefill"]
    assert {row[-1] for row in stored["together"]} == {4}  # every row drafted
    # the together run drafts the four readings (each shared by both variants) in one batch; the other, none
    assert drafted_together == [4, 0, 0, 0]


def test_when_drafting_together_fails_each_variant_reads_on_its_own_and_stores_the_same_rows(job, tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus.parquet", n=3)
    compressed = LOOKING_AHEAD[1:]
    columns = "document_id, variant, status, output_token_ids, output_logprobs, kept_bytes"
    stored = {}
    for way in ("together", "failing"):
        if way == "failing":
            def failing(model, readings, **kw):
                raise RuntimeError("injected: drafting together failed")
            monkeypatch.setattr(pipeline.execute, "draft_together", failing)
        db = tmp_path / f"{way}.db"
        assert invoke("run", job({"output": {"db": str(db)}}, variants=compressed), "-q").exit_code == 0
        stored[way] = rows(db, f"select {columns} from documents order by 1, 2")
    assert stored["failing"] == stored["together"] and {row[2] for row in stored["failing"]} == {"done"}
