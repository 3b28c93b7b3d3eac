"""Fidelity to the full cache: cache snapshots and teacher forcing from the end of prefill."""

import mlx.core as mx
import numpy as np
import pytest
import yaml

import velox_cache
from pipeline.generation import Reference, generate, prefill, teacher_force
from pipeline.spec import GenerationSpec
from tests.pipeline.helpers import invoke, rows, write_corpus
from tests.velox_cache.policies import EVICTING_METHODS
from velox_cache import KVCacheBuilder, KVCacheConfig

SETTINGS = GenerationSpec(max_tokens=12, temperature=0.0, seed=0, prefill_step_size=16)
COMPRESSED = EVICTING_METHODS  # every evicting policy, from the one policy table


def _prompt(tokenizer, n=70):
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 4
    return tokenizer.encode(text)[:n]


def _as_numpy(caches):
    return [[np.array(a) for a in c.state if isinstance(a, mx.array)] for c in caches]


@pytest.mark.parametrize("method", ["full", *COMPRESSED])
def test_snapshot_is_untouched_by_later_decoding(tiny_model, method):
    model, tokenizer = tiny_model
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, budget=24, n_sink=2, scoring="observed"))
    with velox_cache.observe(model):
        prefill(model, _prompt(tokenizer), caches, 16)
        copy = velox_cache.snapshot(caches)
        before = _as_numpy(copy)
        offsets = [c.offset for c in copy]
        token = mx.array([[5]])
        for _ in range(30):  # past the budget: slots are replaced in place
            model(token, cache=caches)
    after = _as_numpy(copy)
    assert [c.offset for c in copy] == offsets
    assert [c.offset for c in caches] == [o + 30 for o in offsets]
    for layer_before, layer_after in zip(before, after):
        for a, b in zip(layer_before, layer_after):
            np.testing.assert_array_equal(a, b)


def _reference(model, tokenizer, prompt):
    full = generate(model, tokenizer, prompt, KVCacheConfig(method="full"), SETTINGS)
    return full, Reference(full.token_ids, full.logprobs)


def test_full_against_itself_agrees_completely(tiny_model):
    model, tokenizer = tiny_model
    prompt = _prompt(tokenizer)
    full, reference = _reference(model, tokenizer, prompt)
    again = generate(model, tokenizer, prompt, KVCacheConfig(method="full"), SETTINGS, reference=reference)
    assert again.fidelity.agreement == 1.0
    assert again.fidelity.nll_gap == pytest.approx(0.0, abs=1e-4)


@pytest.mark.parametrize("method", ["pyramidkv", "squeeze", "h2o"])
def test_teacher_forcing_leaves_the_free_run_and_its_accounting_alone(tiny_model, method):
    model, tokenizer = tiny_model
    prompt = _prompt(tokenizer)
    _, reference = _reference(model, tokenizer, prompt)
    config = KVCacheConfig(method=method, budget=16, n_sink=2, scoring="observed")
    plain = generate(model, tokenizer, prompt, config, SETTINGS)
    measured = generate(model, tokenizer, prompt, config, SETTINGS, reference=reference)
    assert measured.token_ids == plain.token_ids
    assert measured.output == plain.output
    assert measured.layer_stats == plain.layer_stats
    assert plain.fidelity is None
    assert 0.0 <= measured.fidelity.agreement <= 1.0


def _forced_from_a_second_prefill(model, prompt, config, reference):
    """The slow way: a fresh prefill (by phases, as ``generate`` runs it), then the reference in one pass."""
    caches = KVCacheBuilder.for_model(model, config)
    with velox_cache.observe(model):
        logits = velox_cache.prefill_phases(model, caches, document=prompt, chunk_size=SETTINGS.prefill_step_size,
                                            max_new_tokens=SETTINGS.max_tokens)
        predictions = [mx.argmax(logits, axis=-1).item()]
        forced = model(mx.array([reference.token_ids[:-1]]), cache=caches)[0]
        predictions += mx.argmax(forced, axis=-1).tolist()
    return sum(p == t for p, t in zip(predictions, reference.token_ids)) / len(reference.token_ids)


@pytest.mark.parametrize("method", ["pyramidkv", "squeeze"])
def test_agreement_equals_teacher_forcing_after_a_second_prefill(tiny_model, method):
    model, tokenizer = tiny_model
    prompt = _prompt(tokenizer)
    _, reference = _reference(model, tokenizer, prompt)
    assert len(reference.token_ids) >= 4
    config = KVCacheConfig(method=method, budget=12, n_sink=2, scoring="observed")
    measured = generate(model, tokenizer, prompt, config, SETTINGS, reference=reference)
    assert measured.fidelity.agreement == pytest.approx(_forced_from_a_second_prefill(model, prompt, config, reference))


def test_teacher_force_scores_the_reference_logprobs():
    """A fake model whose log-probabilities are known: agreement and gap follow by hand."""
    vocab = 4

    def model(tokens, cache=None):
        # at every position predicts token 2 with log-probability log(0.7); others share 0.3
        probs = mx.array([0.1, 0.1, 0.7, 0.1])
        return mx.broadcast_to(mx.log(probs), (*tokens.shape, vocab))

    first = mx.log(mx.array([[0.1, 0.1, 0.7, 0.1]]))
    reference = Reference(token_ids=[2, 1, 2], logprobs=[-0.1, -0.2, -0.3])
    fidelity = teacher_force(model, [], first, reference)
    assert fidelity.agreement == pytest.approx(2 / 3)
    expected_gap = ((-0.1 - np.log(0.7)) + (-0.2 - np.log(0.1)) + (-0.3 - np.log(0.7))) / 3
    assert fidelity.nll_gap == pytest.approx(expected_gap, rel=1e-4)
    assert vocab == first.shape[-1]


def test_the_store_records_fidelity_for_every_compressed_document(tmp_path, tiny_model_dir):
    """A job with a full variant: agreement and NLL gap per compressed row, their means in the views."""
    corpus = write_corpus(tmp_path / "corpus.parquet", n=3)
    spec = {
        "name": "fidelity-job",
        "model": str(tiny_model_dir),
        "input": {"path": str(corpus), "id_column": "id", "text_column": "text",
                  "prompt_template": "{text}\nSummarize."},
        "generation": {"max_tokens": 8, "prefill_step_size": 16},
        "variants": [
            {"name": "pyramid", "method": "pyramidkv", "budget": 12},  # listed first: full still runs first
            {"name": "full", "method": "full"},
            {"name": "squeeze", "method": "squeeze", "budget": 12},
        ],
        "output": {"db": str(tmp_path / "store.db")},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = invoke("run", path)
    assert result.exit_code == 0, result.output
    db = tmp_path / "store.db"
    compressed = rows(db, "select agreement_vs_full, nll_gap_vs_full from documents where method != 'full'")
    assert len(compressed) == 6
    assert all(a is not None and 0.0 <= a <= 1.0 and g is not None for a, g in compressed)
    assert rows(db, "select count(*) from documents where method = 'full' and agreement_vs_full is not null") == [(0,)]
    summary = dict(rows(db, "select variant, mean_agreement_vs_full from method_summary"))
    means = dict(rows(db, "select variant, round(avg(agreement_vs_full), 3) from documents group by variant"))
    assert summary == means and summary["full"] is None
    assert rows(db, "select mean_agreement_vs_full is not null from run_summary") == [(1,)]


def test_a_job_without_a_full_variant_leaves_fidelity_empty(tmp_path, tiny_model_dir):
    corpus = write_corpus(tmp_path / "corpus.parquet", n=2)
    spec = {
        "name": "no-full",
        "model": str(tiny_model_dir),
        "input": {"path": str(corpus), "id_column": "id", "text_column": "text"},
        "generation": {"max_tokens": 4, "prefill_step_size": 16},
        "variants": [{"name": "pyramid", "method": "pyramidkv", "budget": 12}],
        "output": {"db": str(tmp_path / "store.db")},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert invoke("run", path).exit_code == 0
    assert rows(tmp_path / "store.db", "select agreement_vs_full, nll_gap_vs_full from documents") == [(None, None)] * 2


def test_show_prints_fidelity(tmp_path, tiny_model_dir):
    corpus = write_corpus(tmp_path / "corpus.parquet", n=1)
    spec = {
        "name": "show-fidelity",
        "model": str(tiny_model_dir),
        "input": {"path": str(corpus), "id_column": "id", "text_column": "text"},
        "generation": {"max_tokens": 4, "prefill_step_size": 16},
        "variants": [{"name": "full", "method": "full"}, {"name": "pyramid", "method": "pyramidkv", "budget": 12}],
        "output": {"db": str(tmp_path / "store.db")},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert invoke("run", path).exit_code == 0
    shown = invoke("show", "doc-0", "--db", tmp_path / "store.db")
    assert shown.exit_code == 0, shown.output
    assert shown.output.count("agreement_vs_full: ") == 1 and "nll_gap_vs_full: " in shown.output
