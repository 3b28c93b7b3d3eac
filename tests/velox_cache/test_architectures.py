"""Velox on hybrid mlx-lm architectures: compress the global-attention layers, keep every other cache.

Tiny configurations from ``tests/velox_cache/architectures.py`` (no network). For each:
logits equal plain mlx-lm caches with a budget covering the sequence, for
PyramidKV and squeeze, with the key proxy and with observed attention; with a
small budget every compressed layer stays within its budget, and budgets
average over the compressed layers only.
"""

import warnings

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    make_prompt_cache,
)

import velox_cache
from bench.architectures import (
    cache_scoring,
    max_difference,
    run_sequence,
    velox_layers,
)
from tests.velox_cache.architectures import VOCAB, build
from velox_cache import KVCacheBuilder, KVCacheConfig
from velox_cache.cache.accounting import CacheAccounting, layer_stats
from velox_cache.cache.model_caches import UnsupportedModelError
from velox_cache.kernels.masks import MaskMismatchError

TOKENS = 30  # 24 prompt tokens (chunks of 7) + 6 teacher-forced decode steps
COMPRESSIBLE = ["gemma3_text", "gpt_oss", "falcon_h1", "afm7", "gemma2", "deepseek_v3"]
NOT_OBSERVABLE = {"gemma2"}  # attention written by hand: observe() refuses it clearly


@pytest.fixture(scope="module")
def models():
    return {}


def tiny(models, model_type):
    if model_type not in models:
        models[model_type] = build(model_type)
    return models[model_type]


def tokens():
    mx.random.seed(7)
    return mx.random.randint(0, VOCAB, (TOKENS,))


def _run(model, caches, scoring):
    return run_sequence(model, tokens(), caches, chunk=7, scoring=scoring)


@pytest.mark.parametrize("scoring", ["key_proxy", "fast", "observed"])  # fast: key proxy inside fast_attention
@pytest.mark.parametrize("method", ["pyramidkv", "squeeze"])
@pytest.mark.parametrize("model_type", COMPRESSIBLE)
def test_full_budget_gives_plain_logits_and_small_budget_is_bounded(models, model_type, method, scoring):
    model = tiny(models, model_type)
    if scoring != "key_proxy" and model_type in NOT_OBSERVABLE:
        with pytest.raises(velox_cache.ObservationError, match="cannot (be observed|use Velox attention)"):
            _run(model, make_prompt_cache(model), scoring)
        return
    expected = _run(model, make_prompt_cache(model), "key_proxy")
    config = KVCacheConfig(method=method, budget=4 * TOKENS, scoring=cache_scoring(scoring))
    got = _run(model, KVCacheBuilder.for_model(model, config), scoring)
    assert max_difference(expected, got) < 1e-4

    config = KVCacheConfig(method=method, budget=8, n_sink=2, scoring=cache_scoring(scoring))
    caches = KVCacheBuilder.for_model(model, config)
    _run(model, caches, scoring)
    compressed = velox_layers(caches)
    assert compressed and all(c.tokens_kept <= c.layer_budget for c in compressed)
    assert sum(c.layer_budget for c in compressed) == 8 * len(compressed), "mean budget over compressed layers"
    assert all(c.tokens_kept < c.offset for c in compressed), "every compressed layer evicted"


@pytest.mark.parametrize("model_type", sorted(set(COMPRESSIBLE) - NOT_OBSERVABLE))
def test_fast_attention_with_the_model_caches_gives_plain_logits(models, model_type):
    """Every layer on Velox's attention (sinks and calls the kernel cannot take fall back to mlx-lm's)."""
    model = tiny(models, model_type)
    if model_type == "gpt_oss":
        for layer in model.model.layers:  # make the sinks matter
            layer.self_attn.sinks = mx.full(layer.self_attn.sinks.shape, 2.0)
    expected = _run(model, make_prompt_cache(model), "key_proxy")
    got = _run(model, make_prompt_cache(model), "fast")
    assert max_difference(expected, got) < 1e-4


def _kinds(caches):
    def kind(cache):
        if isinstance(cache, CacheList):
            return tuple(kind(member) for member in cache.caches)
        return "velox" if isinstance(cache, CacheAccounting) else type(cache).__name__

    return [kind(c) for c in caches]


def test_only_global_attention_is_replaced(models):
    gemma3 = KVCacheBuilder.for_model(tiny(models, "gemma3_text"), KVCacheConfig(method="pyramidkv"))
    assert _kinds(gemma3) == ["RotatingKVCache", "RotatingKVCache", "velox"] * 2
    falcon = KVCacheBuilder.for_model(tiny(models, "falcon_h1"), KVCacheConfig(method="squeeze"))
    assert _kinds(falcon) == [("ArraysCache", "velox")] * 3
    assert [c.caches[1].layer_id for c in falcon] == [0, 1, 2]
    gpt_oss = KVCacheBuilder.for_model(tiny(models, "gpt_oss"), KVCacheConfig(method="squeeze"))
    assert [c.layer_id for c in gpt_oss if isinstance(c, CacheAccounting)] == [1, 3]
    assert gpt_oss[1].coordinator.layer_ids == [1, 3]


def test_pyramid_tapers_over_the_compressed_layers_only(models):
    caches = KVCacheBuilder.for_model(tiny(models, "gemma3_text"), KVCacheConfig(method="pyramidkv", budget=64))
    assert [c.layer_budget for c in velox_layers(caches)] == velox_cache.pyramid_budgets(2, 64, 4, 3.0)


def test_full_method_keeps_the_model_caches_with_accounting(models):
    caches = KVCacheBuilder.for_model(tiny(models, "gpt_oss"), KVCacheConfig(method="full"))
    assert [type(c).__name__ for c in caches] == ["RotatingKVCache", "FullKVCache"] * 2
    assert KVCacheBuilder.for_model(tiny(models, "mamba"), KVCacheConfig(method="full"))[0].__class__ is ArraysCache


def test_an_architecture_with_nothing_to_compress_is_refused_by_name(models):
    with pytest.raises(UnsupportedModelError, match=r"mamba cannot be compressed.*2 x ArraysCache.*fixed-size state"):
        KVCacheBuilder.for_model(tiny(models, "mamba"), KVCacheConfig(method="pyramidkv"))


def test_layer_rows_say_which_cache_each_layer_had(models):
    model = tiny(models, "gemma3_text")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="pyramidkv", budget=8, n_sink=2))
    _run(model, caches, "key_proxy")
    rows = [layer_stats(i, c) for i, c in enumerate(caches)]
    assert [r["cache_kind"] for r in rows] == ["RotatingKVCache", "RotatingKVCache", "PyramidKVCache"] * 2
    assert [r["layer"] for r in rows] == list(range(6))
    kept = rows[0]
    assert kept["layer_budget"] is None and kept["kept_bytes"] == kept["full_seq_bytes"] == caches[0].nbytes > 0
    assert kept["compression_ratio"] == 1.0
    compressed = rows[2]
    assert compressed["method"] == "pyramidkv" and compressed["scoring"] == "key_proxy"
    assert compressed["compression_ratio"] > 1

    falcon = tiny(models, "falcon_h1")
    caches = KVCacheBuilder.for_model(falcon, KVCacheConfig(method="pyramidkv", budget=8, n_sink=2))
    _run(falcon, caches, "key_proxy")
    row = layer_stats(0, caches[0])
    state_bytes = caches[0].caches[0].nbytes
    assert row["cache_kind"] == "CacheList(ArraysCache,PyramidKVCache)"
    assert row["kept_bytes"] == caches[0].caches[1].kept_bytes + state_bytes
    assert row["full_seq_bytes"] == caches[0].caches[1].full_seq_bytes + state_bytes


def test_builder_reads_the_model_attention_scale(models):
    caches = KVCacheBuilder.for_model(tiny(models, "gemma3_text"), KVCacheConfig(method="pyramidkv"))
    assert all(c.attention_scale == pytest.approx(144**-0.5) for c in velox_layers(caches))


def test_sinks_are_scored_and_leave_no_pending_observation(models):
    model = tiny(models, "gpt_oss")
    for layer in model.model.layers:  # make the sinks matter
        layer.self_attn.sinks = mx.full(layer.self_attn.sinks.shape, 2.0)
    expected = _run(model, make_prompt_cache(model), "key_proxy")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="h2o", budget=4 * TOKENS, scoring="observed"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer falls back to the key proxy
        got = _run(model, caches, "observed")
    assert max_difference(expected, got) < 1e-4
    compressed = velox_layers(caches)
    assert all(c.scoring == "observed" and c.scoring_fallback is None for c in compressed)
    assert all(0 < c.scores[..., : c.tokens_kept].sum().item() for c in compressed)


def test_a_mask_shared_by_layers_with_different_budgets_is_a_clear_error(models):
    model = tiny(models, "gemma2")
    config = KVCacheConfig(method="pyramidkv", budget=10, n_sink=2, eviction="continuous", selection="cumulative")
    caches = KVCacheBuilder.for_model(model, config)
    with pytest.raises(MaskMismatchError, match="one array mask for every layer"):
        _run(model, caches, "key_proxy")


def test_prefill_end_policies_work_on_array_mask_models(models):
    for model_type in ("gemma2", "deepseek_v3"):
        model = tiny(models, model_type)
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="squeeze", budget=8, n_sink=2))
        outputs = _run(model, caches, "key_proxy")
        assert all(mx.isfinite(o).all().item() for o in outputs)


@pytest.mark.parametrize("method", ["pyramidkv", "squeeze"])
def test_latent_attention_window_selection_is_observed(models, method):
    model = tiny(models, "deepseek_v3")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, budget=8, n_sink=2, scoring="observed"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(model, caches, "observed")
    for cache in caches:
        assert cache.scoring == "observed" and cache.scores.shape[1] == cache.keys.shape[1] == 1
        assert cache.tokens_kept == cache.layer_budget


def test_a_layer_whose_attention_bypasses_the_observer_falls_back_explicitly(tiny_model):
    model, _ = tiny_model
    cache = velox_cache.KVCacheFactory.create(KVCacheConfig(method="h2o", budget=16, scoring="observed"))
    keys = mx.random.normal((1, 2, 12, 16))
    with velox_cache.observe(model):
        cache.update_and_fetch(keys, keys)  # attention computed elsewhere: never observed
        with pytest.warns(RuntimeWarning, match="did not go through velox_cache.observe"):
            cache.update_and_fetch(keys, keys)
    assert cache.scoring == "key_proxy" and cache.scoring_fallback
    assert cache.stats()["scoring"] == "key_proxy"
    assert cache.tokens_kept <= 16


@pytest.mark.parametrize("scoring", ["key_proxy", "observed"])  # key proxy: routed by fast_attention
def test_routed_attention_rebuilds_a_mask_built_for_another_layer(scoring):
    cache = velox_cache.KVCacheFactory.create(KVCacheConfig(method="h2o", budget=64, scoring=scoring))
    mx.random.seed(3)
    queries, keys = mx.random.normal((1, 4, 5, 16)), mx.random.normal((1, 2, 9, 16))
    held, values = cache.update_and_fetch(keys, keys)
    built_for_12_keys = mx.tril(mx.ones((5, 12), mx.bool_), k=7)  # lower-right causal, another layer's width
    output = cache.observe_attention(queries, held, values, 0.25, built_for_12_keys)
    expected = mx.fast.scaled_dot_product_attention(queries, held, values, scale=0.25, mask="causal")
    assert mx.allclose(output, expected, atol=1e-5)


def test_attention_with_sinks_matches_the_fused_kernel_and_scores_with_them():
    from velox_cache.kernels import attention
    from velox_cache.kernels.attend import kernel_supports

    mx.random.seed(2)
    queries, keys, values = (mx.random.normal((1, 4, 6, 16)), mx.random.normal((1, 2, 6, 16)),
                             mx.random.normal((1, 2, 6, 16)))
    sinks = mx.array([0.5, 2.0, -1.0, 3.0])
    probs = attention.attention_probs(queries, keys, 0.25, "causal", sinks=sinks)  # [B, H, R, S, N]
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25, mask="causal", sinks=sinks)
    by_probs = (probs @ mx.expand_dims(values, 2)).reshape(expected.shape)
    assert mx.allclose(by_probs, expected, atol=1e-5)
    assert (probs.sum(axis=-1) < 1).all().item()
    assert not kernel_supports(queries, keys, values, "causal", sinks)
    result = velox_cache.attend_and_score(queries, keys, values, scale=0.25, mask="causal", sinks=sinks, score_rows=6)
    assert mx.allclose(result.output, expected, atol=1e-5)
    assert mx.allclose(result.key_mass, attention.key_mass(probs), atol=1e-5)


def test_window_selection_uses_the_observed_scale():
    from velox_cache.kernels import attention

    mx.random.seed(4)
    config = KVCacheConfig(method="snapkv", budget=32, n_sink=1, window=4, kernel=1, scoring="observed")
    cache = velox_cache.KVCacheFactory.create(config)
    keys, queries = mx.random.normal((1, 2, 20, 16)), mx.random.normal((1, 2, 20, 16)) * 3
    held, values = cache.update_and_fetch(keys, keys)
    cache.observe_attention(queries, held, values, 1.0, "causal")
    one = mx.zeros((1, 2, 1, 16))
    cache.update_and_fetch(one, one)  # the first decode step ends prefill: window selection scores

    def window_mass(scale):
        return attention.key_mass(attention.attention_probs(queries[:, :, -4:], keys, scale, "causal"))

    assert mx.allclose(cache.scores[..., :20], window_mass(1.0), atol=1e-5)
    assert not mx.allclose(window_mass(1.0), window_mass(16**-0.5), atol=1e-3), "the scale matters here"


def test_the_job_runner_stores_one_row_per_layer_of_a_hybrid(models, tmp_path):
    from types import SimpleNamespace

    from pipeline.generation import generate
    from pipeline.report import write_report
    from pipeline.spec import GenerationSpec
    from pipeline.store import Store, report_layers

    model = tiny(models, "gemma3_text")
    tokenizer = SimpleNamespace(eos_token_ids=[], decode=lambda ids: " ".join(map(str, ids)))
    config = KVCacheConfig(method="pyramidkv", budget=8, n_sink=2)
    result = generate(model, tokenizer, tokens().tolist(), config, GenerationSpec(max_tokens=4, prefill_step_size=7))
    db = tmp_path / "store.db"
    with Store(db).locked() as store:
        run_id = store.start_run({"job_name": "hybrid"})
        row = {"doc_key": "k", "run_id": run_id, "document_id": "d", "variant": "v", "method": "pyramidkv",
               "status": "done", "prompt_tokens": TOKENS, **result.totals()}
        store.save_document(row, result.layer_stats)
        query = "select layer, method, cache_kind, layer_budget from layer_stats order by layer"
        stored = store.db.execute(query).fetchall()
    assert [r[2] for r in stored] == ["RotatingKVCache", "RotatingKVCache", "PyramidKVCache"] * 2
    assert {r[1] for r in stored} == {"pyramidkv"}
    assert [r[3] is None for r in stored] == [True, True, False] * 2
    assert result.totals()["compression_ratio"] > 1
    layers = report_layers(db, run_id)
    assert [r["mean_budget"] is None for r in layers] == [True, True, False] * 2
    write_report(db, tmp_path / "report.html", run_id=run_id)  # layers without a budget are charted as gaps


def test_the_job_runner_runs_a_model_whose_attention_cannot_be_routed(models):
    from types import SimpleNamespace

    from pipeline.generation import generate
    from pipeline.spec import GenerationSpec

    model = tiny(models, "gemma2")  # attention written by hand: no fast_attention, key proxy
    tokenizer = SimpleNamespace(eos_token_ids=[], decode=lambda ids: " ".join(map(str, ids)))
    settings = GenerationSpec(max_tokens=4, prefill_step_size=7)
    for method in ("full", "pyramidkv"):
        result = generate(model, tokenizer, tokens().tolist(), KVCacheConfig(method=method, budget=8), settings)
        assert result.output_tokens == 4
    with pytest.raises(velox_cache.ObservationError):
        generate(model, tokenizer, tokens().tolist(), KVCacheConfig(method="pyramidkv", scoring="observed"), settings)


def test_window_kept_as_computed_matches_window_recomputed_across_chunks():
    """An additive mask makes the cache keep the window's attention; it must rank as recomputing does."""
    from velox_cache.kernels import attention

    mx.random.seed(5)
    config = KVCacheConfig(method="snapkv", budget=64, window=4, kernel=3, scoring="observed")
    recomputed, kept = (velox_cache.KVCacheFactory.create(config) for _ in range(2))
    for n_new in (10, 3, 2):  # the window of 4 spans the last three chunks
        keys, queries = mx.random.normal((1, 2, n_new, 16)), mx.random.normal((1, 4, n_new, 16))
        for cache in (recomputed, kept):
            held, values = cache.update_and_fetch(keys, keys)
            causal = attention.causal_mask(n_new, held.shape[2])
            mask = causal if cache is recomputed else mx.where(causal, 0.0, -mx.inf)
            cache.observe_attention(queries, held, values, 0.3, mask)
    one = mx.zeros((1, 2, 1, 16))
    for cache in (recomputed, kept):
        cache.update_and_fetch(one, one)  # ends prefill: window selection
    assert mx.allclose(recomputed.scores[..., :15], kept.scores[..., :15], atol=1e-5)
    assert recomputed.scores[..., :15].sum().item() > 0


def test_window_attention_kept_as_computed_follows_the_slots_through_eviction():
    from velox_cache.cache.selection import WindowSelector

    selector = WindowSelector(window=2, kernel=1)
    selector.remember_mass(mx.array([[[[0.1, 0.2, 0.3, 0.4], [0.0, 0.5, 0.0, 0.5]]]]))  # [B, H, rows, N]
    selector.keep(mx.array([[[1, 3, 4]]]), 5)  # slot 4 arrived after the mass was taken
    assert mx.allclose(selector.mass, mx.array([[[[0.2, 0.4, 0.0], [0.5, 0.5, 0.0]]]]))
    scores = selector.scores(mx.zeros((1, 1, 4, 8)), mx.zeros((1, 1, 4)))  # one more key held by now
    assert mx.allclose(scores, mx.array([[[0.7, 0.9, 0.0, 0.0]]]))


@pytest.mark.parametrize("scoring", ["key_proxy", "observed"])
def test_streaming_prefill_on_latent_attention_and_a_hybrid(models, scoring):
    """Probes and window selection on MLA (kept-as-computed window) and on a CacheList hybrid (probe refused)."""
    model = tiny(models, "deepseek_v3")  # one array mask for every layer: equal budgets (snapkv)
    ids = tokens().tolist()

    def prefill(model, method):
        config = KVCacheConfig(method=method, budget=8, n_sink=2, eviction="streaming", scoring=scoring)
        caches = KVCacheBuilder.for_model(model, config)
        context = velox_cache.observe(model) if scoring == "observed" else velox_cache.fast_attention(model)
        with context:
            logits = velox_cache.prefill_phases(model, caches, document=ids[:24], instruction=ids[24:], chunk_size=8)
        return caches, logits

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        caches, logits = prefill(model, "snapkv")
    assert mx.isfinite(logits).all().item()
    assert all(c.tokens_kept <= c.layer_budget + 6 and c.tokens_seen for c in caches)
    with pytest.raises(MaskMismatchError):  # per-layer budgets, evicted between chunks
        prefill(model, "pyramidkv")
    with pytest.raises(TypeError, match=r"caches\[0\]: ArraysCache cannot drop a probe"):
        prefill(tiny(models, "falcon_h1"), "pyramidkv")
