"""The frontier is keyed by what produced it: measured where missing, never stale, never silently dropped."""

import pytest

import pipeline.generation
from tests.pipeline import poison
from tests.pipeline.helpers import invoke, rows, write_corpus
from velox_cache.generation.batching import BatchUnsupported

BUDGETS = {"budgets": [8, 24]}
LATEST = "select variant, budget, count(*) from frontier where is_latest = 1 group by 1, 2 order by 1, 2"
EVERY_POINT = [("pyramid", "24", 3), ("pyramid", "8", 3), ("squeeze", "24", 3), ("squeeze", "8", 3)]


def test_a_changed_variant_is_measured_again_and_its_old_points_leave_the_summary(job, tmp_path):
    write_corpus(tmp_path / "corpus.parquet", n=3)
    db = tmp_path / "store.db"
    assert invoke("run", job(frontier=BUDGETS), "-q").exit_code == 0
    before = dict(((v, b, d), i) for i, v, b, d in rows(db, "select id, variant, budget, document_id from frontier"))
    changed = [
        {"name": "full", "method": "full"},
        {"name": "pyramid", "method": "pyramidkv", "budget": 24, "kernel": 3},
        {"name": "squeeze", "method": "squeeze", "budget": 24},
    ]
    assert invoke("run", job(frontier=BUDGETS, variants=changed), "-q").exit_code == 0
    assert rows(db, LATEST) == EVERY_POINT
    after = rows(db, "select id, variant, budget, document_id from frontier where is_latest = 1")
    kept = [(v, b) for i, v, b, d in after if before[(v, b, d)] == i]
    assert sorted(set(kept)) == [("squeeze", "24"), ("squeeze", "8")], "only the changed variant is measured again"
    assert rows(db, "select count(*) from frontier where is_latest = 0 and variant = 'pyramid'") == [(6,)]
    summary = "select variant, budget, documents from frontier_summary order by 1, 2"
    assert rows(db, summary) == EVERY_POINT, "the summary reads the latest points only"


def test_settings_reverted_make_their_stored_points_the_latest_again(job, tmp_path):
    """Run A, change a variant (run B), revert to A: A's points are found stored, and are the latest again."""
    write_corpus(tmp_path / "corpus.parquet", n=2)
    db = tmp_path / "store.db"
    changed = [
        {"name": "full", "method": "full"},
        {"name": "pyramid", "method": "pyramidkv", "budget": 24, "kernel": 3},
        {"name": "squeeze", "method": "squeeze", "budget": 24},
    ]
    points = "select id from frontier where variant = 'pyramid' {} order by id"
    assert invoke("run", job(frontier=BUDGETS), "-q").exit_code == 0
    first = rows(db, points.format(""))
    assert invoke("run", job(frontier=BUDGETS, variants=changed), "-q").exit_code == 0
    assert rows(db, points.format("and is_latest = 1")) != first
    assert invoke("run", job(frontier=BUDGETS), "-q").exit_code == 0
    assert rows(db, points.format("and is_latest = 1")) == first
    assert rows(db, "select count(*) from frontier") == [(12,)], "nothing measured again"
    assert rows(db, LATEST) == [(v, b, 2) for v, b, _ in EVERY_POINT]


def test_a_frontier_added_to_a_store_is_measured_for_the_documents_already_done(job, tmp_path):
    write_corpus(tmp_path / "corpus.parquet", n=3)
    db = tmp_path / "store.db"
    assert invoke("run", job(), "-q").exit_code == 0
    assert invoke("run", job(frontier=BUDGETS), "-q").exit_code == 0
    assert rows(db, "select documents_unchanged, documents_done from runs where id = 2") == [(9, 0)]
    assert rows(db, LATEST) == EVERY_POINT
    assert invoke("run", job(frontier=BUDGETS), "-q").exit_code == 0
    assert rows(db, "select count(*) from frontier") == [(12,)], "nothing measured twice"


def test_a_batch_redone_row_by_row_keeps_its_frontier(job, tmp_path, monkeypatch):
    """A poisoned full variant fails its batch: the others are redone alone, and still measure their frontier."""
    poison.install(monkeypatch)
    texts = [f"Document {i} talks about kv caches and eviction number {i}. " * 2 for i in range(3)]
    texts[1] = f"Document 1 is {poison.MARK}ed. " * 3
    write_corpus(tmp_path / "corpus.parquet", n=3, text=texts)
    db = tmp_path / "store.db"
    invoke("run", job(frontier=BUDGETS), "-q")
    done = "select document_id, count(*) from frontier where status = 'done' group by 1 order by 1"
    assert rows(db, done) == [("doc-0", 4), ("doc-2", 4)]
    notes = rows(db, "select distinct status, note from frontier where document_id = 'doc-1'")
    assert notes == [("error", "the full variant failed: RuntimeError: injected: a poisoned row")]


def test_a_variant_that_cannot_share_a_reading_says_so_on_its_frontier_rows(job, tmp_path):
    write_corpus(tmp_path / "corpus.parquet", n=2)
    variants = [
        {"name": "full", "method": "full"},
        {"name": "pyramid", "method": "pyramidkv", "budget": 24},
        {"name": "streamed", "method": "squeeze", "budget": 24, "eviction": "streaming"},
    ]
    db = tmp_path / "store.db"
    assert invoke("run", job(frontier=BUDGETS, variants=variants), "-q").exit_code == 0
    found = rows(db, "select variant, status, count(*), count(note) from frontier group by 1, 2 order by 1")
    assert found == [("pyramid", "done", 4, 0), ("streamed", "skipped", 4, 4)]
    note = rows(db, "select distinct note from frontier where variant = 'streamed'")[0][0]
    assert "streaming" in note and "shared reading" in note
    assert invoke("run", job(frontier=BUDGETS, variants=variants), "-q").exit_code == 0
    assert rows(db, "select count(*) from frontier") == [(8,)], "a skipped point is settled, not retried"


def test_a_frontier_of_streaming_variants_only_leaves_the_full_variant_alone(job, tmp_path):
    write_corpus(tmp_path / "corpus.parquet", n=2)
    variants = [{"name": "full", "method": "full"},
                {"name": "streamed", "method": "squeeze", "budget": 24, "eviction": "streaming"}]
    db = tmp_path / "store.db"
    assert invoke("run", job(frontier=BUDGETS, variants=variants), "-q").exit_code == 0
    assert rows(db, "select variant, status from documents order by 1") == [("full", "done")] * 2 + [("streamed", "done")] * 2
    assert rows(db, "select status, count(*) from frontier group by 1") == [("skipped", 4)]


def test_frontier_bytes_are_taken_before_teacher_forcing(job, tmp_path, monkeypatch):
    """Where stacks cannot be forced together, each is forced alone: its bytes are still the prompt's."""
    write_corpus(tmp_path / "corpus.parquet", n=2)
    together = tmp_path / "together.db"
    assert invoke("run", job({"output": {"db": str(together)}}, frontier=BUDGETS), "-q").exit_code == 0

    def unsupported(*args, **kwargs):
        raise BatchUnsupported("forced one at a time in this test")

    monkeypatch.setattr(pipeline.generation, "feed_together", unsupported)
    alone = tmp_path / "alone.db"
    assert invoke("run", job({"output": {"db": str(alone)}}, frontier=BUDGETS), "-q").exit_code == 0
    query = "select document_id, variant, budget, kept_bytes, full_seq_bytes, agreement_vs_full from frontier order by 1, 2, 3"
    assert rows(alone, query) == rows(together, query)


@pytest.mark.parametrize("column", ["kept_bytes", "full_seq_bytes", "compression_ratio"])
def test_a_variants_row_and_its_own_frontier_point_agree(job, tmp_path, column):
    write_corpus(tmp_path / "corpus.parquet", n=2)
    assert invoke("run", job(frontier=BUDGETS), "-q").exit_code == 0
    pairs = rows(tmp_path / "store.db", f"""select d.{column}, f.{column} from documents d join frontier f
                 on f.document_id = d.document_id and f.variant = d.variant and f.budget = '24'""")
    assert len(pairs) == 4 and all(row == point for row, point in pairs)


def test_a_look_ahead_fed_for_the_frontier_still_counts_to_the_variants_that_look_ahead(job, tmp_path):
    """The full output is fed once, for the frontier and the variants cut after it: each pays for that call."""
    write_corpus(tmp_path / "corpus.parquet", n=2)
    variants = [
        {"name": "full", "method": "full"},
        {"name": "pyramid", "method": "pyramidkv", "budget": 24, "lookahead": 4},
        {"name": "squeeze", "method": "squeeze", "budget": 24, "lookahead": 0},
    ]
    assert invoke("run", job(frontier=BUDGETS, variants=variants), "-q").exit_code == 0
    more = rows(tmp_path / "store.db", """select count(*) from documents p join documents f
                on f.document_id = p.document_id and f.variant = 'full'
                where p.variant = 'pyramid' and p.reading_seconds > f.reading_seconds""")
    assert more == [(2,)]


def test_a_documents_points_seconds_sum_to_the_cutting_and_forcing_measured(job, tmp_path, monkeypatch):
    """Under a clock that ticks once per evaluation, a document's points' seconds add up to what measuring them
    took (timed around ``frontier_rows``: the cuts, the look-ahead's call, the forcing); one ranking per layer
    serves every budget of a variant, so its points share its cutting equally."""
    import time

    import mlx.core as mx

    import pipeline.execute
    import pipeline.generation

    now, evaluate, measure = [0.0], mx.eval, pipeline.execute.frontier_rows
    feed = pipeline.generation.feed_together
    measured = []

    def ticking_eval(*arrays):
        now[0] += 1.0
        return evaluate(*arrays)

    def ticking_feed(*args, **kwargs):  # the forcing's call: its figures are read by .item(), not mx.eval
        now[0] += 1.0
        return feed(*args, **kwargs)

    def timed(*args, **kwargs):
        start = now[0]
        points = measure(*args, **kwargs)
        measured.append(now[0] - start)
        return points

    monkeypatch.setattr(mx, "eval", ticking_eval)
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(pipeline.execute, "frontier_rows", timed)
    monkeypatch.setattr(pipeline.generation, "feed_together", ticking_feed)
    write_corpus(tmp_path / "corpus.parquet", n=2)
    db = tmp_path / "store.db"
    assert invoke("run", job(frontier={"budgets": [8, 24, "50%"]}), "-q").exit_code == 0
    per_document = rows(db, "select sum(seconds) from frontier where status = 'done' group by document_id order by 1")
    assert len(measured) == 2 and min(measured) > 0
    assert sorted(seconds for (seconds,) in per_document) == pytest.approx(sorted(measured))
    shares = rows(db, "select count(*), count(distinct seconds) from frontier where status = 'done' "
                      "group by document_id, variant")
    assert shares == [(3, 1)] * 4


def test_points_whose_budgets_keep_the_whole_prompt_measure_the_same(job, tmp_path):
    """Stacks holding every prompt token are forced as one row: each such point gets that row's figures,
    as it gets them forced beside no other point alike."""
    write_corpus(tmp_path / "corpus.parquet", n=2)
    assert invoke("run", job(frontier={"budgets": [8, 4096, 8192]}), "-q").exit_code == 0
    assert invoke("run", job(frontier={"budgets": [8, 4096]}, output={"db": str(tmp_path / "one.db")}),
                  "-q").exit_code == 0
    keep_all = "select document_id, agreement_vs_full, nll_gap_vs_full from frontier where kept_share = 1 and {} order by 1, variant"
    together = rows(tmp_path / "store.db", keep_all.format("1"))
    assert len(together) == 8
    for document in ("doc-0", "doc-1"):
        figures = {(agreement, gap) for doc, agreement, gap in together if doc == document}
        assert len(figures) == 1  # both policies at both budgets: one row's figures
    alone = rows(tmp_path / "one.db", keep_all.format("budget = '4096'"))
    for (doc, agreement, gap), (doc_alone, agreement_alone, gap_alone) in zip(together[::4], alone[::2]):
        assert doc == doc_alone and agreement == agreement_alone and gap == pytest.approx(gap_alone, abs=1e-5)


def test_a_full_row_whose_reading_served_only_frontier_points_has_no_shared_reading(job, tmp_path):
    """reading_seconds is the part of prefill_seconds shared with other variants' rows: points alone do not share it
    (their seconds are their cuts and forcing), so the full row's prefill holds its whole reading."""
    write_corpus(tmp_path / "corpus.parquet", n=2)
    db = tmp_path / "store.db"
    assert invoke("run", job(), "-q", "--variant", "pyramid", "--variant", "squeeze").exit_code == 0
    assert invoke("run", job(frontier=BUDGETS), "-q").exit_code == 0
    assert rows(db, "select documents_unchanged, documents_done from runs where id = 2") == [(4, 2)]
    full = rows(db, "select reading_seconds is null, prefill_seconds > 0 from documents where variant = 'full'")
    assert full == [(1, 1), (1, 1)]
    assert rows(db, "select count(*) from frontier where status = 'done'") == [(8,)]
    # and where the variants share it, each row names the shared part
    assert invoke("run", job(frontier=BUDGETS, output={"db": str(tmp_path / "shared.db")}), "-q").exit_code == 0
    assert rows(tmp_path / "shared.db", "select count(*) from documents where reading_seconds is null") == [(0,)]
