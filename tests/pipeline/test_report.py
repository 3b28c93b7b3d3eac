"""velox-batch report on stores made by the tiny model."""

import re
import shutil
import sqlite3
from html.parser import HTMLParser

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.report import ReportError, build_report
from pipeline.runner import run_job
from pipeline.spec import load_spec
from pipeline.store import Store

CHARTS = [
    "chart-layer-budgets", "chart-concentration", "chart-bytes", "chart-fidelity", "chart-frontier", "chart-prefill",
    "chart-history",
]
VOID = {"meta", "br", "hr", "img", "input", "link", "col", "area", "base", "wbr", "source"}


class Page(HTMLParser):
    """Parses a report strictly: every element closed in order; collects tables and figures."""

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.stack, self.tables, self.figures, self.ids = [], {}, {}, []
        self._table = self._row = self._cell = self._figure = None
        self.feed(text)
        self.close()
        assert self.stack == [], f"unclosed elements: {self.stack}"

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag not in VOID:
            self.stack.append(tag)
        self._note(tag, attrs)

    def handle_startendtag(self, tag, attrs):
        self._note(tag, dict(attrs))

    def _note(self, tag, attrs):
        if "id" in attrs:
            self.ids.append(attrs["id"])
            if self._figure is not None:
                self._figure["ids"].append(attrs["id"])
        if tag == "table":
            self._table = self.tables.setdefault(attrs["id"], {"header": [], "rows": []})
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "figure":
            figure = {"label": attrs.get("aria-label"), "text": [], "ids": []}
            self._figure = self.figures.setdefault(attrs["id"], figure)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()
        if tag in ("td", "th"):
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr":
            if self._table["header"]:
                self._table["rows"].append(self._row)
            else:
                self._table["header"] = self._row
        elif tag == "figure":
            self._figure = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._figure is not None and data.strip():
            self._figure["text"].append(data.strip())

    def records(self, table_id):
        table = self.tables[table_id]
        return [dict(zip(table["header"], row)) for row in table["rows"]]


def write_job(tmp_path, model_dir, ids, texts, variants=None):
    pq.write_table(pa.table({"id": ids, "text": texts}), tmp_path / "corpus.parquet")
    spec = {
        "name": "tiny-report",
        "model": str(model_dir),
        "input": {"path": str(tmp_path / "corpus.parquet"), "id_column": "id", "text_column": "text",
                  "prompt_template": "{text}\nSummarize."},
        "generation": {"max_tokens": 5, "prefill_step_size": 32},
        "variants": variants or [
            {"name": "full", "method": "full"},
            {"name": "pyramid", "method": "pyramidkv", "budget": 16},
            {"name": "squeeze", "method": "squeeze", "budget": 16},
        ],
        "limits": {"max_prompt_tokens": 400, "on_too_long": "skip"},
        "output": {"db": str(tmp_path / "store.db")},
        "frontier": {"budgets": [8, 16, "50%"]},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_spec(path)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory, tiny_model_dir):
    """Two runs of one job: run 1 does two documents; run 2 adds two, one empty (failed) and one too long (skipped)."""
    tmp_path = tmp_path_factory.mktemp("report")
    texts = [f"Document {i} is about caches that evict tokens, number {i}. " * (i + 2) for i in range(4)]
    ids = ["doc-0", "doc-1", "doc-2", "doc-3", "empty", "long"]
    spec = write_job(tmp_path, tiny_model_dir, ids, texts + [None, "word " * 200])
    spec.limits.max_documents = 2
    run_job(spec, quiet=True)
    spec.limits.max_documents = None
    run_job(spec, quiet=True)
    return tmp_path / "store.db"


def query(db, sql, params=()):
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def close_to(cell, value, digits):
    return abs(float(cell) - value) <= 0.5 * 10**-digits + 1e-9


def test_every_chart_is_present_with_title_labels_and_legend(store_path):
    report = build_report(store_path)
    page = Page(report.html)
    assert report.run_id == 2 and report.charts == CHARTS and report.messages == []
    assert list(page.figures) == CHARTS
    for chart in CHARTS:
        figure = page.figures[chart]
        assert figure["label"], chart
        assert any(i.startswith(f"{chart}-legend") for i in figure["ids"]), f"{chart} has no legend"
    assert len(page.ids) == len(set(page.ids)), "ids repeat across the inline SVGs"
    assert not re.search(r'(src|href)="(https?:)?//', report.html), "the page must load nothing from the network"
    assert "<script" not in report.html and "<link" not in report.html
    text = {chart: " ".join(figure["text"]) for chart, figure in page.figures.items()}
    assert "tokens per KV head" in text["chart-layer-budgets"] and "layer" in text["chart-layer-budgets"]
    assert "concentration" in text["chart-concentration"]
    assert "bytes per document (" in text["chart-bytes"]
    assert "agreement" in text["chart-fidelity"] and "compression ratio" in text["chart-fidelity"]
    assert "prompt length (tokens)" in text["chart-prefill"] and "tokens/s" in text["chart-prefill"]
    assert "share of the prompts' keys and values kept" in text["chart-frontier"] and "agreement" in text["chart-frontier"]
    assert "decode (tokens/s)" in text["chart-history"] and "run (id and start date, UTC)" in text["chart-history"]


def test_frontier_table_equals_the_store(store_path):
    page = Page(build_report(store_path).html)
    shown = [(r["variant"], r["budget"], int(r["documents"])) for r in page.records("frontier-summary")]
    stored = query(store_path, "select variant, budget, documents from frontier_summary")
    assert sorted(shown) == sorted(stored) and len(shown) == 6
    assert {documents for _, _, documents in shown} == {4}, "every document that fits, once"


def test_variant_table_equals_the_store(store_path):
    page = Page(build_report(store_path).html)
    records = {r["variant"]: r for r in page.records("variant-summary")}
    expected = query(
        store_path,
        "select variant, count(*), avg(compression_ratio), avg(agreement_vs_full), avg(prefill_tokens_per_second), "
        "avg(decode_tokens_per_second), avg(kept_bytes) from documents "
        "where run_id = 2 and status = 'done' group by variant",
    )
    assert set(records) == {"full", "pyramid", "squeeze"} == {row[0] for row in expected}
    header = next(h for h in page.tables["variant-summary"]["header"] if h.startswith("mean kept ("))
    unit = header[len("mean kept (") : -1]
    size = {"B": 1, "KiB": 2**10, "MiB": 2**20}[unit]
    for variant, documents, ratio, agreement, prefill, decode, kept in expected:
        record = records[variant]
        assert int(record["documents"]) == documents == 2
        assert close_to(record["mean compression ratio (×)"], ratio, 2)
        assert close_to(record["mean prefill (tokens/s)"], prefill, 1)
        assert close_to(record["mean decode (tokens/s)"], decode, 1)
        assert close_to(record[f"mean kept ({unit})"], kept / size, 2)
        if agreement is None:
            assert record["mean agreement"] == "–" and variant == "full"
        else:
            assert close_to(record["mean agreement"], agreement, 3)


def test_document_and_problem_tables_equal_the_store(store_path):
    page = Page(build_report(store_path).html)
    documents = page.records("document-table")
    expected = query(
        store_path,
        "select document_id, variant, prompt_tokens, kept_bytes, compression_ratio from documents "
        "where run_id = 2 and status = 'done'",
    )
    assert sorted((d["document"], d["variant"]) for d in documents) == sorted((row[0], row[1]) for row in expected)
    by_key = {(d["document"], d["variant"]): d for d in documents}
    for document_id, variant, prompt_tokens, kept_bytes, ratio in expected:
        shown = by_key[(document_id, variant)]
        assert int(shown["prompt tokens"]) == prompt_tokens and int(shown["kept bytes"]) == kept_bytes
        assert close_to(shown["compression ratio (×)"], ratio, 2)
    problems = page.records("problem-table")
    assert [(p["document"], p["status"], p["variants"]) for p in problems] == [
        ("empty", "error", "full, pyramid, squeeze"),
        ("long", "skipped", "full, pyramid, squeeze"),
    ]
    errors = dict(
        query(store_path, "select document_id, error from documents where status != 'done' and variant = 'full'")
    )
    assert {p["document"]: p["reason"] for p in problems} == errors


def test_history_has_one_row_per_run_and_variant(store_path):
    page = Page(build_report(store_path).html)
    history = page.records("history-table")
    assert sorted({(int(h["run"]), h["variant"]) for h in history}) == [
        (run, variant) for run in (1, 2) for variant in ("full", "pyramid", "squeeze")
    ]
    expected = dict(
        query(store_path, "select run_id || '/' || variant, avg(decode_tokens_per_second) from documents "
                          "where status = 'done' group by run_id, variant")
    )
    for row in history:
        assert close_to(row["mean decode (tokens/s)"], expected[f"{row['run']}/{row['variant']}"], 1)


def test_an_older_run_can_be_chosen_and_an_unknown_one_is_an_error(store_path):
    report = build_report(store_path, run_id=1)
    page = Page(report.html)
    assert {r["document"] for r in page.records("document-table")} == {"doc-0", "doc-1"}
    assert "problem-table" not in page.tables and "Newer runs of this job: 2" in report.html
    with pytest.raises(ReportError, match="no run 7"):
        build_report(store_path, run_id=7)


def test_rouge_l_is_the_fidelity_for_runs_without_agreement(store_path, tmp_path):
    copy = tmp_path / "rouge.db"
    shutil.copy(store_path, copy)
    conn = sqlite3.connect(copy)
    with conn:
        conn.execute("update documents set agreement_vs_full = null, rouge_l_vs_full = 0.75 "
                     "where method != 'full' and status = 'done'")
    conn.close()
    page = Page(build_report(copy).html)
    records = {r["variant"]: r for r in page.records("variant-summary")}
    assert records["pyramid"]["mean ROUGE-L"] == "0.750" and records["full"]["mean ROUGE-L"] == "–"
    assert "ROUGE-L" in " ".join(page.figures["chart-fidelity"]["text"])


def test_empty_store_and_run_without_compression_give_a_clear_message(tmp_path, tiny_model_dir):
    with Store(tmp_path / "empty.db").locked():
        pass  # creates and migrates the store, stores no run
    empty = build_report(tmp_path / "empty.db")
    Page(empty.html)
    assert empty.run_id is None and empty.charts == []
    assert "has no runs yet" in empty.messages[0] and "has no runs yet" in empty.html

    spec = write_job(tmp_path, tiny_model_dir, ["a", "b"], ["one text about caches", "another text"],
                     variants=[{"name": "full", "method": "full"}])
    run_job(spec, quiet=True)
    plain = build_report(tmp_path / "store.db")
    page = Page(plain.html)
    assert "no compressed variants" in plain.messages[0] and "no compressed variants" in plain.html
    assert plain.charts == ["chart-prefill", "chart-history"]
    assert [r["variant"] for r in page.records("variant-summary")] == ["full"]


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_cli_writes_the_page_and_reports_errors(store_path, tmp_path):
    output = tmp_path / "out" / "report.html"
    result = invoke("report", "--db", store_path, "-o", output)
    assert result.exit_code == 0, result.output
    assert "run 2 ->" in result.output and "(7 charts)" in result.output
    Page(output.read_text())
    older = invoke("report", "--db", store_path, "--run", 1, "-o", tmp_path / "one.html")
    assert older.exit_code == 0 and "run 1 ->" in older.output
    missing = invoke("report", "--db", tmp_path / "nope.db", "-o", tmp_path / "x.html")
    assert missing.exit_code == 1 and "no store at" in missing.output and not (tmp_path / "x.html").exists()
    unknown = invoke("report", "--db", store_path, "--run", 99, "-o", tmp_path / "y.html")
    assert unknown.exit_code == 1 and "no run 99" in unknown.output
    empty_db = tmp_path / "empty.db"
    with Store(empty_db).locked():
        pass
    empty = invoke("report", "--db", empty_db, "-o", tmp_path / "empty.html")
    assert empty.exit_code == 0 and "no runs yet" in empty.output
    assert "no runs yet" in (tmp_path / "empty.html").read_text()


def test_help_ends_with_an_example():
    result = invoke("report", "--help")
    assert result.exit_code == 0
    lines = [line.strip() for line in result.output.splitlines()]
    example = lines.index("Example:")
    assert lines[example + 1] == "velox-batch report --db data/velox.db -o report.html"
    assert lines[example + 2] == "Options:" or lines[example + 2] == ""


def test_problems_taken_over_by_a_later_run_are_explained(tmp_path):
    db = Store(tmp_path / "store.db")
    row = {"doc_key": "k", "document_id": "long", "variant": "full", "method": "full", "status": "skipped",
           "error": "prompt has 900 tokens"}
    with db.locked():
        for _ in range(2):
            run_id = db.start_run({"job_name": "job"})
            db.save_document({**row, "run_id": run_id}, [])
            db.finish_run(run_id, "done", {"documents_skipped": 1})
    older, newer = build_report(db.path, run_id=1), Page(build_report(db.path, run_id=2).html)
    assert "counted 1 skipped and 0 failed" in older.html and "a later run tried those documents again" in older.html
    assert newer.records("problem-table") == [
        {"document": "long", "status": "skipped", "variants": "full", "reason": "prompt has 900 tokens"}
    ]
