"""One document's way to the store: the row built once, logprobs rounded once, the stored full output read once."""

import json

import pytest

from pipeline.generation import Fidelity, GenerationResult
from pipeline.plan import DocumentPlan, PreparedDocument, VariantPlan
from pipeline.prompting import Prompt
from pipeline.reference import LOGPROB_DECIMALS, Reference, rounded_logprobs
from pipeline.rows import document_row
from pipeline.runner import run_job
from pipeline.source import Document
from pipeline.spec import load_spec, parse_spec
from pipeline.store import Store

RAW = {
    "name": "t",
    "model": "m",
    "input": {"path": "x.parquet", "id_column": "id", "text_column": "text"},
    "variants": [{"name": "full", "method": "full"}, {"name": "half", "method": "pyramidkv", "budget": "50%"}],
}


def test_logprobs_are_rounded_as_stored_and_as_teacher_forcing_feeds_them():
    logprobs = [-0.12345678901, -2.0000004, -1e-9]
    assert rounded_logprobs(logprobs) == [round(p, LOGPROB_DECIMALS) for p in logprobs] == [-0.123457, -2.0, -0.0]
    reference = Reference.of_output((5, 6, 7), logprobs)
    assert reference == Reference([5, 6, 7], rounded_logprobs(logprobs))
    assert json.loads(json.dumps(reference.logprobs)) == reference.logprobs  # what the store gives back


def _plan():
    spec = parse_spec(RAW)
    document = Document("doc", {"text": "abc"}, "contenthash", None)
    prompt = Prompt(list(range(40)), truncated=True)
    prepared = PreparedDocument(document, "prompthash", prompt=prompt, prompt_hash="prompthash", prompt_tokens=40)
    plan = DocumentPlan(3, prepared, "settingshash")
    plan.variants = [VariantPlan(variant, f"key-{variant.name}", "due") for variant in spec.variants]
    return plan


def test_a_done_row_is_built_from_the_plan_and_the_result():
    plan = _plan()
    result = GenerationResult(
        output="out", prompt_tokens=40, output_tokens=2, prefill_seconds=2.0, decode_seconds=0.5,
        peak_memory_bytes=123, stop_reason="eos",
        layer_stats=[{"kept_bytes": 10, "full_seq_bytes": 40}], token_ids=[1, 2], logprobs=[-0.1234567, -1.0],
        fidelity=Fidelity(agreement=0.5, nll_gap=0.25, seconds=0.1),
    )
    row = document_row(plan, plan.variants[1], 7, status="done", result=result, rouge_l_vs_full=0.75)
    assert row == {
        "doc_key": "key-half", "document_id": "doc", "content_hash": "contenthash", "prompt_hash": "prompthash",
        "settings_hash": "settingshash", "variant": "half", "method": "pyramidkv", "budget": 20,
        "scoring": "observed", "eviction": None, "kv_bits": None, "run_id": 7, "status": "done", "output": "out",
        "prompt_tokens": 40, "truncated": 1,
        "output_tokens": 2, "prefill_seconds": 2.0, "reading_seconds": None, "draft_seconds": None, "decode_seconds": 0.5,
        "decode_batch_size": 1,
        "prefill_tokens_per_second": 20.0,
        "decode_tokens_per_second": 4.0, "peak_memory_bytes": 123, "stop_reason": "eos", "rouge_l_vs_full": 0.75,
        "agreement_vs_full": 0.5, "nll_gap_vs_full": 0.25, "fidelity_seconds": 0.1, "fidelity_note": None,
        "output_token_ids": "[1, 2]", "output_logprobs": "[-0.123457, -1.0]",
        "kept_bytes": 10, "spare_bytes": 0, "full_seq_bytes": 40, "compression_ratio": 4.0, "accounting": "prefill_end",
    }


def test_a_row_without_a_result_says_why():
    plan = _plan()
    plan.prepared.error = "too long"
    assert document_row(plan, plan.variants[0], 7, status="skipped", error="too long") == {
        "doc_key": "key-full", "document_id": "doc", "content_hash": "contenthash", "prompt_hash": "prompthash",
        "settings_hash": "settingshash", "variant": "full", "method": "full", "budget": None, "scoring": None, "eviction": None,
        "kv_bits": None, "run_id": 7, "status": "skipped", "error": "too long", "prompt_tokens": 40,
    }


@pytest.fixture
def full_reference_reads(monkeypatch):
    """Every ``Store.full_reference`` call: ``(document_id, prompt_hash)``."""
    calls = []
    read = Store.full_reference

    def counted(self, document_id, prompt_hash, settings_hash):
        calls.append((document_id, prompt_hash))
        return read(self, document_id, prompt_hash, settings_hash)

    monkeypatch.setattr(Store, "full_reference", counted)
    return calls


def test_the_stored_full_output_is_read_once_per_document(job, tmp_path, full_reference_reads):  # noqa: F811
    spec = load_spec(job())
    assert run_job(spec.with_overrides(variants=["full"]), quiet=True).counts["documents_done"] == 4
    assert full_reference_reads == []  # nothing compressed to compare
    assert run_job(spec, quiet=True).counts == {
        "documents_done": 8, "documents_skipped": 0, "documents_failed": 0, "documents_unchanged": 4,
    }
    assert sorted(document for document, _ in full_reference_reads) == ["doc-0", "doc-1", "doc-2", "doc-3"]


def test_with_the_full_variant_due_its_own_output_is_compared_and_nothing_is_read(job, full_reference_reads):  # noqa: F811
    assert run_job(load_spec(job()), quiet=True).counts["documents_done"] == 12
    assert full_reference_reads == []
