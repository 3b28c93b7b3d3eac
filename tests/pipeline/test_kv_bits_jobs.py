"""Jobs with ``kv_bits`` variants: stored outputs and bytes, shared reading or alone, with a frontier."""

import pytest

from pipeline.spec import SpecError, parse_spec
from tests.pipeline.helpers import invoke, rows, write_corpus

QUANTIZED = [
    {"name": "full", "method": "full"},
    {"name": "pyramid", "method": "pyramidkv", "budget": 24},
    {"name": "pyramid-8", "method": "pyramidkv", "budget": 24, "kv_bits": 8},
    {"name": "squeeze-4", "method": "squeeze", "budget": 24, "kv_bits": 4},
]


def test_quantized_variants_store_the_same_rows_shared_or_alone(job, tmp_path):
    write_corpus(tmp_path / "corpus.parquet", n=3)
    shared, alone = tmp_path / "shared.db", tmp_path / "alone.db"
    assert invoke("run", job({"output": {"db": str(shared)}}, variants=QUANTIZED), "-q").exit_code == 0
    for variant in ("full", "pyramid-8", "squeeze-4"):
        result = invoke("run", job({"output": {"db": str(alone)}}, variants=QUANTIZED), "-q", "--variant", variant)
        assert result.exit_code == 0, result.output
    columns = "document_id, variant, kv_bits, output, output_token_ids, kept_bytes, full_seq_bytes, agreement_vs_full"
    query = f"select {columns} from documents where variant != 'pyramid' order by 1, 2"
    assert rows(shared, query) == rows(alone, query)
    bits = rows(shared, "select variant, kv_bits, count(*) from documents where status = 'done' group by 1, 2 order by 1")
    assert bits == [("full", None, 3), ("pyramid", None, 3), ("pyramid-8", 8, 3), ("squeeze-4", 4, 3)]
    # the bytes held at prefill end, when the quantized variants' codes were made: fewer than float's
    kept = dict(rows(shared, "select variant, sum(kept_bytes) from documents group by 1"))
    assert kept["squeeze-4"] < kept["pyramid-8"] < kept["pyramid"]
    kinds = rows(shared, "select distinct variant, cache_kind from layer_stats where variant like '%-_' order by 1")
    assert kinds == [("pyramid-8", "PyramidKVCache"), ("squeeze-4", "SqueezeAttentionCache")]


def test_quantized_variants_store_the_same_rows_batched_or_one_at_a_time(job, tmp_path):
    write_corpus(tmp_path / "corpus.parquet", n=3)
    variants = [QUANTIZED[0], QUANTIZED[2], QUANTIZED[3]]
    generation = {"max_tokens": 14}  # past a few window flushes (groups of 6 at budget 24)
    batched, single = tmp_path / "batched.db", tmp_path / "single.db"
    spec = job({"output": {"db": str(batched)}, "generation": generation}, variants=variants)
    assert invoke("run", spec, "-q").exit_code == 0
    spec = job({"output": {"db": str(single)}, "generation": {**generation, "decode_batch_size": 1}}, variants=variants)
    assert invoke("run", spec, "-q").exit_code == 0
    query = "select document_id, variant, output, output_token_ids, kept_bytes, agreement_vs_full from documents order by 1, 2"
    assert rows(batched, query) == rows(single, query)
    sizes = "select variant, max(decode_batch_size) from documents group by 1 order by 1"
    assert rows(batched, sizes) == [("full", 3), ("pyramid-8", 3), ("squeeze-4", 3)], "quantized rows decoded together"
    assert rows(single, sizes) == [("full", 1), ("pyramid-8", 1), ("squeeze-4", 1)]


def test_the_frontier_measures_quantized_variants_at_every_budget(job, tmp_path):
    write_corpus(tmp_path / "corpus.parquet", n=2)
    path = job(frontier={"budgets": [16, 32]}, variants=QUANTIZED[:3])
    assert invoke("run", path, "-q").exit_code == 0
    summary = rows(tmp_path / "store.db", "select variant, budget, documents, kept_share from frontier_summary "
                                          "order by variant, budget")
    assert [row[:3] for row in summary] == [("pyramid", "16", 2), ("pyramid", "32", 2), ("pyramid-8", "16", 2),
                                            ("pyramid-8", "32", 2)]
    share = {(variant, budget): kept for variant, budget, _, kept in summary}
    assert share[("pyramid-8", "32")] < share[("pyramid", "32")], "bits x budget: the codes take fewer bytes"


def test_the_full_variant_stays_the_float_reference():
    spec = {"name": "j", "model": "m", "input": {"path": "x.parquet", "id_column": "id", "text_column": "t"},
            "variants": [{"name": "full-8", "method": "full", "kv_bits": 8}]}
    with pytest.raises(SpecError, match=r"variants\[0\]\.kv_bits: the full variant is the job's reference"):
        parse_spec(spec)
    spec["variants"] = [{"method": "pyramidkv", "kv_bits": 5}]
    with pytest.raises(SpecError, match=r"variants\[0\]\.kv_bits"):
        parse_spec(spec)


def test_the_frontier_is_budget_by_bits(job, tmp_path):
    write_corpus(tmp_path / "corpus.parquet", n=2)
    path = job(frontier={"budgets": [16, 24], "bits": [None, 8, 4]}, variants=QUANTIZED[:2])
    assert invoke("run", path, "-q").exit_code == 0
    db = tmp_path / "store.db"
    summary = rows(db, "select budget, kv_bits, documents, kept_share from frontier_summary order by budget, kv_bits")
    assert [row[:3] for row in summary] == [("16", None, 2), ("16", 4, 2), ("16", 8, 2),
                                            ("24", None, 2), ("24", 4, 2), ("24", 8, 2)]
    share = {(budget, bits): kept for budget, bits, _, kept in summary}
    assert share[("24", 4)] < share[("24", 8)] < share[("24", None)]
    # the float point at the variant's own budget is the variant's own row (pyramidkv at 24, in float)
    same = rows(db, """select count(*) from frontier f join documents d on d.document_id = f.document_id
                       and d.variant = f.variant where f.budget = '24' and f.kv_bits is null
                       and f.agreement_vs_full = d.agreement_vs_full and f.kept_bytes = d.kept_bytes""")
    assert same == [(2,)]
    assert invoke("run", path, "-q").exit_code == 0
    assert rows(db, "select count(*) from frontier") == [(12,)], "a rerun measures nothing again"
    # float points keep the keys they had before the bits axis existed
    plain = tmp_path / "plain.db"
    unquantized = job({"output": {"db": str(plain)}}, frontier={"budgets": [16, 24]}, variants=QUANTIZED[:2])
    assert invoke("run", unquantized, "-q").exit_code == 0
    keys = "select frontier_key from frontier where kv_bits is null order by 1"
    assert rows(plain, keys) == rows(db, keys)


def test_frontier_bits_name_the_bad_level(job):
    from pipeline.spec import load_spec

    with pytest.raises(SpecError, match=r"frontier\.bits\[1\]: 3 is not null"):
        load_spec(job(frontier={"budgets": [16], "bits": [8, 3]}))


def test_a_frontier_bits_points_key_holds_its_group_size_and_window(job, tmp_path):
    """Points at other bits than their variant's run at the job's kv_group_size and kv_window: a rerun at
    other ones measures them anew (and the float points, which neither changes, are kept)."""
    write_corpus(tmp_path / "corpus.parquet", n=2)
    db = tmp_path / "store.db"
    frontier = {"budgets": [24], "bits": [None, 8]}
    assert invoke("run", job(frontier=frontier, variants=QUANTIZED[:2]), "-q").exit_code == 0
    for changed in ({"kv_group_size": 4}, {"kv_group_size": 4, "kv_window": 8}):
        # a float variant's quantization fields change none of its own rows: only its points at 8 bits
        variants = [QUANTIZED[0], {**QUANTIZED[1], **changed}]
        assert invoke("run", job(frontier=frontier, variants=variants), "-q").exit_code == 0
    measured = rows(db, "select kv_bits, count(*) from frontier group by 1 order by 1")
    assert measured == [(None, 2), (8, 6)], "each setting's 8-bit points measured anew, the float ones kept"


def test_a_rows_key_holds_the_group_size_it_ran_with_not_the_one_written(job, tmp_path, monkeypatch):
    """A kv_bits variant that leaves kv_group_size open runs at a default that depends on its bits and
    method: the key holds the group it ran with, so another default measures the rows anew."""
    import velox_cache.config

    write_corpus(tmp_path / "corpus.parquet", n=2)
    db = tmp_path / "store.db"
    variants = [QUANTIZED[0], QUANTIZED[2]]
    assert invoke("run", job(variants=variants), "-q").exit_code == 0
    assert invoke("run", job(variants=variants), "-q").exit_code == 0
    assert rows(db, "select count(*) from documents where variant = 'pyramid-8'") == [(2,)], "same settings: kept"
    monkeypatch.setitem(velox_cache.config.EVICTING_KV_GROUP, 8, 8)
    assert invoke("run", job(variants=variants), "-q").exit_code == 0
    assert rows(db, "select count(*) from documents where variant = 'pyramid-8'") == [(4,)]
    assert rows(db, "select count(*) from documents where variant = 'full'") == [(2,)]
