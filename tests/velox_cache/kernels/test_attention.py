"""The attention arithmetic behind scoring: pooling and window selection."""

import mlx.core as mx
import numpy as np
import pytest

from velox_cache import KVCacheConfig, KVCacheFactory
from velox_cache.kernels.attention import attention_probs, key_peak, max_pool


def test_max_pool_spreads_a_peak_over_its_kernel():
    scores = mx.array([[0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 1.0]])
    assert max_pool(scores, 3).tolist() == [[0.0, 0.0, 5.0, 5.0, 5.0, 0.0, 1.0, 1.0]]
    assert max_pool(scores, 1).tolist() == scores.tolist()


def test_window_selection_keeps_the_neighbours_of_what_the_question_attends_to():
    mx.random.seed(0)
    dim, length, needle = 16, 120, 60
    keys = mx.random.normal((1, 1, length, dim)) * 0.1
    target = mx.ones((dim,)) * 2.0
    keys[0, 0, needle] = target
    config = KVCacheConfig(method="snapkv", budget=20, n_sink=2, recent=0, window=4, kernel=7, scoring="observed")
    cache = KVCacheFactory.create(config)
    out_keys, out_values = cache.update_and_fetch(keys, keys)
    queries = mx.broadcast_to(target, (1, 1, length, dim))  # every query looks for the needle
    cache.observe_attention(queries, out_keys, out_values, dim**-0.5, "causal")
    step = mx.zeros((1, 1, 1, dim))
    out_keys, out_values = cache.update_and_fetch(step, step)  # first decode step ends prefill
    cache.observe_attention(step, out_keys, out_values, dim**-0.5, None)
    kept = set(cache.positions[0, 0, : cache.tokens_kept].tolist())
    assert set(range(needle - 3, needle + 4)) <= kept, "the pooled neighbourhood survives together"
    assert {0, 1} <= kept and cache.tokens_kept == 20


def _kept_after_prefill(mass_weight: float) -> set:
    """Positions a SnapKV layer keeps when every query but the window's looks at one token (30)
    and the window's queries look at another (80)."""
    dim, length, early, late = 16, 120, 30, 80
    mx.random.seed(1)
    keys = mx.random.normal((1, 1, length, dim)) * 0.05
    early_direction = mx.zeros((dim,))
    early_direction[0] = 4.0
    late_direction = mx.zeros((dim,))
    late_direction[1] = 4.0
    keys[0, 0, early] = early_direction
    keys[0, 0, late] = late_direction
    queries = mx.broadcast_to(early_direction, (1, 1, length, dim))
    queries = mx.concatenate([queries[:, :, :-4], mx.broadcast_to(late_direction, (1, 1, 4, dim))], axis=2)
    config = KVCacheConfig(
        method="snapkv", budget=6, n_sink=2, recent=0, window=4, kernel=1, scoring="observed", mass_weight=mass_weight
    )
    cache = KVCacheFactory.create(config)
    out_keys, out_values = cache.update_and_fetch(keys, keys)
    cache.observe_attention(queries, out_keys, out_values, dim**-0.5, "causal")
    step = mx.zeros((1, 1, 1, dim))
    cache.update_and_fetch(step, step)  # the first decode step ends prefill: selection runs here
    return set(cache.positions[0, 0, : cache.tokens_kept].tolist())


def test_mass_weight_blends_cumulative_mass_into_the_window_ranking():
    window_only, blended, mass_only = (_kept_after_prefill(w) for w in (0.0, 0.5, 1.0))
    assert 80 in window_only and 30 not in window_only, "the window alone ranks by its own queries"
    assert {30, 80} <= blended, "a blend keeps what either signal ranks first"
    assert 30 in mass_only, "mass alone keeps what every prompt query looked at"


def _kept_after_a_probe(mass_weight: float) -> set:
    """Positions a streaming SnapKV layer keeps after one probe when the document's queries look at
    token 30 and the probe's queries at token 80."""
    from velox_cache import phases

    dim, length = 16, 120
    mx.random.seed(3)
    keys = mx.random.normal((1, 1, length, dim)) * 0.05
    document_direction, probe_direction = mx.zeros((dim,)), mx.zeros((dim,))
    document_direction[0], probe_direction[1] = 4.0, 4.0
    keys[0, 0, 30], keys[0, 0, 80] = document_direction, probe_direction
    config = KVCacheConfig(
        method="snapkv", budget=6, n_sink=2, recent=0, window=4, kernel=1, scoring="observed",
        eviction="streaming", mass_weight=mass_weight,
    )
    cache = KVCacheFactory.create(config)
    phases.tell([cache], "document")
    held_keys, held_values = cache.update_and_fetch(keys, keys)
    cache.observe_attention(mx.broadcast_to(document_direction, (1, 1, length, dim)), held_keys, held_values,
                            dim**-0.5, "causal")
    with phases.probe([cache]):
        probe = mx.zeros((1, 1, 3, dim))
        held_keys, held_values = cache.update_and_fetch(probe, probe)
        cache.observe_attention(mx.broadcast_to(probe_direction, (1, 1, 3, dim)), held_keys, held_values,
                                dim**-0.5, "causal")
    return set(cache.positions[0, 0, : cache.tokens_kept].tolist())


def test_mass_weight_blends_cumulative_mass_into_the_probes_ranking():
    probe_only, blended, mass_only = (_kept_after_a_probe(w) for w in (0.0, 0.5, 1.0))
    assert 80 in probe_only and 30 not in probe_only, "the probe alone ranks by its own queries"
    assert {30, 80} <= blended, "a blend keeps what either signal ranks first"
    assert 30 in mass_only and 80 not in mass_only, "mass alone keeps what the document's queries looked at"


def _kept_when_everything_looks_at_token_30(recent) -> set:
    """Positions a SnapKV layer (budget 8, two sinks) keeps when every query attends to token 30."""
    dim, length = 16, 120
    mx.random.seed(4)
    keys = mx.random.normal((1, 1, length, dim)) * 0.05
    direction = mx.zeros((dim,))
    direction[0] = 4.0
    keys[0, 0, 30] = direction
    config = KVCacheConfig(method="snapkv", budget=8, n_sink=2, recent=recent, window=4, kernel=1, scoring="observed")
    cache = KVCacheFactory.create(config)
    out_keys, out_values = cache.update_and_fetch(keys, keys)
    cache.observe_attention(mx.broadcast_to(direction, (1, 1, length, dim)), out_keys, out_values, dim**-0.5, "causal")
    cache.begin_phase("decode")  # prefill ends: selection runs here
    return set(cache.positions[0, 0, : cache.tokens_kept].tolist())


def test_the_recent_window_is_kept_whatever_the_ranking():
    last_four = {116, 117, 118, 119}
    for recent in (4, "50%"):  # 50% of a budget of 8
        kept = _kept_when_everything_looks_at_token_30(recent)
        assert last_four <= kept and {0, 1, 30} <= kept and len(kept) == 8, recent
    assert not last_four <= _kept_when_everything_looks_at_token_30(0), "unprotected, they compete on attention"


@pytest.mark.parametrize("n_queries, n_keys, group", [(1, 9, 1), (70, 70, 3), (130, 200, 3)])
@pytest.mark.parametrize("causal", [True, False])
def test_key_peak_is_the_largest_probability_any_query_and_group_head_gave_each_key(n_queries, n_keys, group, causal):
    mx.random.seed(3)
    queries = mx.random.normal((1, 2 * group, n_queries, 8))
    keys = mx.random.normal((1, 2, n_keys, 8))
    mask = "causal" if causal else None
    expected = np.array(attention_probs(queries, keys, 0.35, mask)).max(axis=(2, 3))
    assert np.allclose(np.array(key_peak(queries, keys, 0.35, mask)), expected, atol=1e-6)
