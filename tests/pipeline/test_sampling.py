"""Sampling parity with mlx-lm: top_k, min_p and the repetition penalty, in the spec and in decoding."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from pipeline.generation import Reference, generate
from pipeline.spec import GenerationSpec, SpecError, parse_spec
from velox_cache import KVCacheConfig

SPEC = {
    "name": "t",
    "model": "m",
    "input": {"path": "x.parquet", "id_column": "id", "text_column": "text"},
    "generation": {"max_tokens": 40, "temperature": 0.5, "top_p": 0.9, "seed": 3},
}


def _spec(**generation):
    return parse_spec({**SPEC, "generation": {**SPEC["generation"], **generation}})


@pytest.mark.parametrize(
    "field, value",
    [("top_k", -1), ("min_p", 1.5), ("repetition_penalty", 0.0), ("repetition_penalty", "strong"),
     ("repetition_context_size", 0)],
)
def test_bad_sampling_values_name_the_field(field, value):
    with pytest.raises(SpecError, match=f"generation.{field}"):
        _spec(**{field: value})


def test_stores_keep_their_keys_until_a_sampling_field_is_set():
    spec = _spec()
    # The hashes this spec had before the sampling fields existed (a store's keys are made from them).
    assert (spec.settings_hash(), spec.output_settings_hash(weights="float32")) == ("01aa02709921c2e0", "80074de539b09db2")
    penalised = _spec(repetition_penalty=1.3)
    assert penalised.settings_hash() != spec.settings_hash()
    assert penalised.output_settings_hash(weights="float32") != spec.output_settings_hash(weights="float32")
    assert _spec(top_k=5).settings_hash() != _spec(top_k=6).settings_hash()
    batched = _spec(decode_batch_size=1, decode_batch_memory_mb=10)  # how fast, not what: no document is redone
    assert (batched.settings_hash(), batched.output_settings_hash(weights="float32")) == (
        spec.settings_hash(), spec.output_settings_hash(weights="float32"))


def _prompt(tokenizer):
    return tokenizer.encode("One two three. One two three. One two three. One two three.")


def _plain(model, prompt, settings):
    """mlx-lm's own greedy or sampled decoding with the same settings and plain caches."""
    mx.random.seed(settings.seed)
    sampler = make_sampler(temp=settings.temperature, top_p=settings.top_p, min_p=settings.min_p, top_k=settings.top_k)
    processors = make_logits_processors(
        repetition_penalty=settings.repetition_penalty, repetition_context_size=settings.repetition_context_size
    )
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=settings.max_tokens,
        sampler=sampler,
        logits_processors=processors,
        prompt_cache=[KVCache() for _ in model.layers],
        prefill_step_size=settings.prefill_step_size,
    )
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize(
    "settings",
    [
        GenerationSpec(max_tokens=16, prefill_step_size=8, repetition_penalty=1.5, repetition_context_size=6),
        GenerationSpec(max_tokens=16, prefill_step_size=8, temperature=0.8, top_k=5, seed=7),
        GenerationSpec(max_tokens=16, prefill_step_size=8, temperature=0.8, min_p=0.1, seed=11),
    ],
    ids=["repetition-penalty", "top-k", "min-p"],
)
def test_full_cache_decodes_as_mlx_lm_does(tiny_model, settings, monkeypatch):
    monkeypatch.setenv("VELOX_ATTENTION", "exact")  # MLX's fused attention, bit for bit as mlx-lm
    model, tokenizer = tiny_model
    prompt = _prompt(tokenizer)
    result = generate(model, tokenizer, prompt, KVCacheConfig(method="full"), settings)
    assert result.token_ids == _plain(model, prompt, settings)[: len(result.token_ids)]
    assert len(result.token_ids) == settings.max_tokens or result.stop_reason == "eos"


def test_the_penalty_changes_what_is_generated(tiny_model):
    model, tokenizer = tiny_model
    prompt = _prompt(tokenizer)
    plain = generate(model, tokenizer, prompt, KVCacheConfig(method="full"), GenerationSpec(max_tokens=16))
    penalised = generate(
        model, tokenizer, prompt, KVCacheConfig(method="full"), GenerationSpec(max_tokens=16, repetition_penalty=2.0)
    )
    assert plain.token_ids != penalised.token_ids


def test_teacher_forcing_applies_the_same_penalty(tiny_model):
    model, tokenizer = tiny_model
    prompt = _prompt(tokenizer)
    settings = GenerationSpec(max_tokens=16, prefill_step_size=8, repetition_penalty=2.0, repetition_context_size=8)
    full = generate(model, tokenizer, prompt, KVCacheConfig(method="full"), settings)
    again = generate(
        model, tokenizer, prompt, KVCacheConfig(method="full"), settings,
        reference=Reference.of_output(full.token_ids, full.logprobs),
    )
    assert again.fidelity.agreement == 1.0
    assert again.fidelity.nll_gap == pytest.approx(0.0, abs=1e-4)
