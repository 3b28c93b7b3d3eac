"""Per-head budgets (``head_budgets='adaptive'``): AdaKV's selection, stored in bytes that follow the counts."""

import mlx.core as mx
import pytest

import velox_cache
from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases, snapshot
from velox_cache.cache.head_slots import HeadPooledSlots, adaptive_keep
from velox_cache.cache.signals import CumulativeMass
from velox_cache.cache.slots import TokenSlots
from velox_cache.config import ConfigError
from velox_cache.kernels import attend as attend_module
from velox_cache.kernels.attend import attend_and_score
from velox_cache.kernels.rope import RotaryShift

BUDGET = 24


def _tokens(length, seed):
    return mx.random.randint(3, 200, (length,), key=mx.random.key(seed)).tolist()


def _run(model, tokens, steps=8, **fields):
    """Prefill by phases (instruction last), then greedy decode: ``(tokens, every step's logits, caches)``."""
    config = KVCacheConfig(method="pyramidkv", budget=BUDGET, scoring="observed", **fields)
    caches = KVCacheBuilder.for_model(model, config, prompt_tokens=len(tokens))
    with velox_cache.observe(model):
        logits = prefill_phases(
            model, caches, document=tokens[:-6], instruction=tokens[-6:], chunk_size=16, max_new_tokens=steps
        )
        outputs, token = [logits], mx.argmax(logits, axis=-1)
        for _ in range(steps):
            logits = model(token[None], cache=caches)[:, -1]
            outputs.append(logits)
            token = mx.argmax(logits, axis=-1)
    return [int(mx.argmax(o).item()) for o in outputs], outputs, caches


# ----- the selection ------------------------------------------------------------------------


def test_adaptive_keep_gives_every_head_its_floor_and_the_rest_to_the_best_of_the_layer():
    heads = mx.array([0] * 6 + [1] * 6, mx.int32)
    # head 0 holds the six best scores of the layer, head 1 the six worst
    ranking = mx.array([9, 8, 7, 6, 5, 4, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    keep = adaptive_keep(ranking, heads, n_heads=2, budget=3, floor=1).tolist()
    assert keep == [0, 1, 2, 3, 4, 6], "head 1 keeps only its floor (its best slot); head 0 takes the rest"
    assert adaptive_keep(ranking, heads, n_heads=2, budget=3, floor=3).tolist() == [0, 1, 2, 6, 7, 8], "floor = budget: uniform"


def test_adaptive_keep_keeps_protected_slots_and_groups_heads_in_slot_order():
    heads = mx.array([1, 0, 1, 0, 1, 0, 1, 0], mx.int32)
    ranking = mx.array([mx.inf, 5.0, 0.1, 0.2, 7.0, 6.0, 0.3, mx.inf])
    keep = adaptive_keep(ranking, heads, n_heads=2, budget=2, floor=0)
    assert keep.tolist() == [5, 7, 0, 4], "head 0's slots first, then head 1's, each in slot order"


def _uniform_slots(ranks_by_head):
    """One-sequence uniform slots whose scores are ``ranks_by_head`` ``[H][N]``."""
    slots = TokenSlots(CumulativeMass, n_sink=0, recent=0)
    n_heads, held = len(ranks_by_head), len(ranks_by_head[0])
    keys = mx.random.normal((1, n_heads, held, 8), key=mx.random.key(0))
    slots.start(keys, keys, mx.float32, mx.float32)
    slots.append(keys, keys * 2, 0, 0)
    slots.set_scores(mx.array(ranks_by_head)[None])
    return slots


def test_pooled_slots_hold_the_bytes_of_uniform_heads_at_the_same_budget():
    uniform = _uniform_slots([[5, 4, 3, 2, 1, 0], [50, 40, 30, 20, 10, 0], [0.5, 0.4, 0.3, 0.2, 0.1, 0.0]])
    pooled = HeadPooledSlots.pooled(uniform, floor=0.25)
    uniform.evict_to(4)
    pooled.evict_to(4)
    assert pooled.keys.nbytes + pooled.values.nbytes == uniform.keys.nbytes + uniform.values.nbytes
    # floor: each head's best (5, 50, 0.5); then the best 9 of the rest: 40..10, 4..1 and head 2's 0.4
    assert pooled.head_counts() == [5, 5, 2]
    assert pooled.kept_per_head == 4 and pooled.at_budget(4)


def test_pooling_by_head_never_mixes_heads():
    uniform = _uniform_slots([[0.0] * 4, [0.0] * 4])
    pooled = HeadPooledSlots.pooled(uniform, floor=0.0)
    mass = mx.array([0, 0, 0, 1.0, 0, 0, 0, 0])[None, None]  # head 0's last slot, right before head 1's first
    pooled_mass = pooled.pool(mass, kernel=3)
    assert pooled_mass.tolist() == [[[0, 0, 1, 1, 0, 0, 0, 0]]]


# ----- attention over the shared buffer ------------------------------------------------------


@pytest.mark.parametrize("attention", ["fast", "exact"])
@pytest.mark.parametrize("n_queries", [1, 5])
def test_attention_over_pooled_slots_equals_each_head_over_its_own_keys(monkeypatch, attention, n_queries):
    monkeypatch.setenv("VELOX_ATTENTION", attention)
    uniform = _uniform_slots([[float(i % 7) for i in range(20)], [float(i % 5) * 3 for i in range(20)]])
    uniform.offset = 20
    pooled = HeadPooledSlots.pooled(uniform, floor=0.1)
    pooled.evict_to(8)
    new = mx.random.normal((1, 2, n_queries, 8), key=mx.random.key(1))
    pooled.append(new, new * 2, pooled.offset, 0)
    pooled.offset += n_queries
    queries = mx.random.normal((1, 6, n_queries, 8), key=mx.random.key(2))  # 3 query heads per KV head
    keys, values = pooled.held()
    result = pooled.attend(queries, keys, values, scale=0.35, mask="causal", score_rows=n_queries, entropy_rows=1)
    masked = attend_and_score(queries, keys, values, scale=0.35, mask=pooled.attention_mask(n_queries, 6), score_rows=n_queries)
    assert mx.allclose(result.output, masked.output, atol=2e-4, rtol=2e-4).item(), "head by head = one masked call"
    assert mx.allclose(result.key_mass, masked.key_mass, atol=2e-4, rtol=2e-4).item()
    assert result.entropy_rows == 6
    heads, positions = pooled.held_heads(), pooled.held_positions()[0, 0]
    for head in range(2):
        own = [i for i, h in enumerate(heads.tolist()) if h == head]
        index = mx.array(own)
        own_keys, own_values = keys[:, :, index], values[:, :, index]
        query_positions = mx.arange(pooled.offset - n_queries, pooled.offset)
        visible = positions[index][None, :] <= query_positions[:, None]
        expected = mx.fast.scaled_dot_product_attention(
            queries[:, 3 * head : 3 * head + 3], own_keys, own_values, scale=0.35, mask=visible
        )
        assert mx.allclose(result.output[:, 3 * head : 3 * head + 3], expected, atol=2e-4, rtol=2e-4).item()
        assert result.key_mass[0, 0, index].sum().item() == pytest.approx(3 * n_queries, rel=1e-3), (
            "each key's mass comes from its own head's queries only"
        )


# ----- a whole model ------------------------------------------------------------------------


@pytest.mark.parametrize("eviction", ["prefill_end", "streaming"])
def test_a_floor_of_the_whole_budget_is_uniform_heads_exactly(tiny_model, eviction):
    model, _ = tiny_model
    tokens = _tokens(90, 1)
    uniform, uniform_logits, _ = _run(model, tokens, eviction=eviction, head_budgets="uniform")
    adaptive, adaptive_logits, caches = _run(model, tokens, eviction=eviction, head_budgets="adaptive", head_floor=1.0)
    assert all(c.slots.heads_pooled for c in caches), "stored per head from the first selection on"
    assert adaptive == uniform
    for one, other in zip(uniform_logits, adaptive_logits):
        assert mx.allclose(one, other, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("eviction", ["prefill_end", "streaming"])
def test_adaptive_heads_hold_what_uniform_heads_hold_and_keep_their_counts_while_decoding(tiny_model, eviction):
    model, _ = tiny_model
    tokens = _tokens(90, 2)
    _, _, uniform = _run(model, tokens, steps=0, eviction=eviction, head_budgets="uniform")
    _, _, adaptive = _run(model, tokens, steps=0, eviction=eviction, head_budgets="adaptive", head_floor=0.0)
    counts = [c.slots.head_counts() for c in adaptive]
    assert any(len(set(layer)) > 1 for layer in counts), "some layer's heads keep different numbers of tokens"
    for one, other, layer_counts in zip(uniform, adaptive, counts):
        assert other.kept_bytes == one.kept_bytes, "the bytes held, measured from the arrays"
        assert sum(layer_counts) == other.kv_heads * other.layer_budget
        assert other.tokens_kept == one.tokens_kept == other.layer_budget
        assert other.full_seq_bytes == one.full_seq_bytes and other.tokens_seen == one.tokens_seen
    with velox_cache.observe(model):
        token = mx.array([[7]])
        for _ in range(5):
            token = mx.argmax(model(token, cache=adaptive)[:, -1], axis=-1)[None]
    assert [c.slots.head_counts() for c in adaptive] == counts, "a decode token replaces one of its own head's"
    assert all(c.offset == len(tokens) + 5 for c in adaptive)


def test_pooled_heads_from_a_prefill_end_inferred_from_the_first_generated_token(tiny_model):
    """``mlx_lm.generate`` tells no phases: prefill ends at the first generated token, which pools the heads."""
    from pipeline.generation import prefill

    model, _ = tiny_model
    tokens = _tokens(80, 7)
    logits, stacks = {}, {}
    for heads in ("adaptive", "uniform"):
        config = KVCacheConfig(method="snapkv", budget=BUDGET, scoring="observed", head_budgets=heads, head_floor=1.0)
        stacks[heads] = KVCacheBuilder.for_model(model, config)
        with velox_cache.observe(model):
            first = prefill(model, tokens, stacks[heads], 16)
            logits[heads] = model(mx.argmax(first, axis=-1)[None], cache=stacks[heads])[:, -1]
    assert all(c.slots.heads_pooled and c.tokens_kept == BUDGET for c in stacks["adaptive"])
    assert mx.allclose(logits["adaptive"], logits["uniform"], atol=1e-4, rtol=1e-4).item()


def test_a_pooled_snapshot_is_independent_and_decodes_what_the_original_decodes(tiny_model):
    model, _ = tiny_model
    _, _, caches = _run(model, _tokens(70, 3), steps=0, head_budgets="adaptive", head_floor=0.0)
    saved = snapshot(caches)
    with velox_cache.observe(model):
        first = model(mx.array([[5, 6, 7]]), cache=caches)
        second = model(mx.array([[5, 6, 7]]), cache=saved)
    assert mx.allclose(first, second).item()


def test_compaction_moves_each_head_to_contiguous_positions_ending_at_the_offset(tiny_model):
    model, _ = tiny_model
    _, _, caches = _run(model, _tokens(80, 4), steps=0, eviction="streaming", head_budgets="adaptive", head_floor=0.0)
    cache = caches[0]
    counts = cache.slots.head_counts()
    cache.compact_positions(RotaryShift.from_model(model))
    positions, heads = cache.slots.held_positions()[0, 0].tolist(), cache.slots.held_heads().tolist()
    assert cache.offset == max(counts)
    for head, count in enumerate(counts):
        own = sorted(p for p, h in zip(positions, heads) if h == head)
        assert own == list(range(max(counts) - count, max(counts)))


def test_pooled_heads_need_observed_routed_attention(tiny_model):
    model, _ = tiny_model
    with pytest.raises(ConfigError, match="head_budgets"):
        KVCacheConfig(method="snapkv", budget=16, scoring="key_proxy", head_budgets="adaptive")
    with pytest.raises(ConfigError, match="head_budgets"):
        KVCacheConfig(head_budgets="per-head")
    _, _, caches = _run(model, _tokens(60, 5), steps=0, head_budgets="adaptive")
    with pytest.raises(RuntimeError, match="routed"):
        model(mx.array([[5]]), cache=caches)  # outside observe: mlx-lm's attention would read one head


def test_rows_with_pooled_heads_decode_in_a_batch_and_give_the_same_tokens(tiny_model):
    """Pooled rows batch beside uniform ones (tests/velox_cache/generation/test_batching_head_budgets.py pins the rest)."""
    from tests.velox_cache.generation.test_batching import _decode

    model, _ = tiny_model
    configs = [
        KVCacheConfig(method="pyramidkv", budget=BUDGET, scoring="observed", head_budgets="adaptive", head_floor=0.0),
        KVCacheConfig(method="squeeze", budget=BUDGET, scoring="observed"),
        KVCacheConfig(method="snapkv", budget=BUDGET, scoring="observed", head_budgets="adaptive"),
    ]
    alone = _decode(model, configs, batch=False)
    together = _decode(model, configs, batch=True)
    assert [row.tokens for row in together] == [row.tokens for row in alone]
    assert max(row.batch_size for row in together) == len(configs)
    assert together[0].caches[0].slots.heads_pooled and together[0].caches[0].batch_refusal() is None


def _pooled_at_budget(positions_by_head, offset, n_sink, recent):
    """Pooled slots of one sequence at budget, head h holding the tokens at ``positions_by_head[h]``."""
    n_heads = len(positions_by_head)
    slots = HeadPooledSlots(CumulativeMass, n_sink, recent, n_heads, floor=0.0)
    positions = [p for head in positions_by_head for p in head]
    heads = [h for h, head in enumerate(positions_by_head) for _ in head]
    slots.keys = mx.arange(len(positions) * 4, dtype=mx.float32).reshape(1, 1, len(positions), 4)
    slots.values = slots.keys * 2
    slots.scores = mx.arange(len(positions), dtype=mx.float32)[None, None] + 1
    slots.positions = mx.array(positions, mx.int32)[None, None]
    slots.heads = mx.array(heads, mx.int32)
    slots.stored, slots.offset, slots.tokens_seen = len(positions), offset, offset
    return slots


def test_a_head_whose_slots_are_all_protected_writes_into_its_own_slot():
    # budget 3 per head: recent = min(2, 3 - 1 - 1) = 1 protects position 9; n_sink 1 protects position 0.
    # Head 1 holds only position 0 (a sink) and 9 (the recent window): every slot of it is protected.
    slots = _pooled_at_budget([[0, 1, 2, 9], [0, 9]], offset=10, n_sink=1, recent=2)
    assert slots.at_budget(3)
    before_keys = slots.keys
    new = mx.concatenate([mx.full((1, 1, 1, 4), -1.0), mx.full((1, 1, 1, 4), -2.0)], axis=1)  # head 0: -1s, head 1: -2s
    slots.replace_lowest(new, new, budget=3)
    heads, positions = slots.heads.tolist(), slots.positions[0, 0].tolist()
    assert heads == [0, 0, 0, 0, 1, 1], "slots keep their heads"
    written = {slot for slot in range(6) if slots.keys[0, 0, slot, 0].item() < 0}
    head_of = {slot: heads[slot] for slot in written}
    assert sorted(head_of.values()) == [0, 1], f"each head wrote exactly one of its own slots, got {head_of}"
    assert slots.keys[0, 0, 0].tolist() == before_keys[0, 0, 0].tolist(), "head 0's sink is untouched"
    assert positions[4] == 0, "head 1 keeps its sink; its oldest non-sink token (the recent one) made room"
    assert positions[5] == 10 and slots.keys[0, 0, 5, 0].item() == -2.0
    assert positions[1] == 10 and slots.keys[0, 0, 1, 0].item() == -1.0, "head 0 replaced its lowest-ranked slot"


def test_each_head_with_an_unprotected_slot_replaces_its_own_lowest_ranked_one():
    # budget 4 per head: recent = min(1, 4 - 1 - 1) = 1 protects position 11; n_sink 1 protects position 0.
    # Scores rise with the slot (1, 2, ...), so each head's lowest-ranked unprotected slot is its first non-sink.
    slots = _pooled_at_budget([[0, 3, 5, 11], [7, 0, 2, 11], [0, 4, 11, 6]], offset=12, n_sink=1, recent=1)
    slots.scores = mx.array([[[1.0, 9.0, 2.0, 1.0, 0.5, 9.0, 3.0, 0.1, 9.0, 4.0, 0.2, 3.5]]])
    new = mx.full((1, 3, 1, 4), -1.0) * mx.array([1.0, 2.0, 3.0])[None, :, None, None]
    slots.replace_lowest(new, new, budget=4)
    written = [slot for slot in range(12) if slots.keys[0, 0, slot, 0].item() < 0]
    assert written == [2, 4, 11], "head 0: slot 2 (score 2); head 1: slot 4 (0.5); head 2: slot 11 (3.5, not 9)"
    assert [slots.keys[0, 0, slot, 0].item() for slot in written] == [-1.0, -2.0, -3.0], "each head's own token"
    assert [slots.positions[0, 0, slot].item() for slot in written] == [12, 12, 12]
    assert slots.heads.tolist() == [0] * 4 + [1] * 4 + [2] * 4, "slots keep their heads"


def test_a_decode_step_the_kernel_cannot_take_still_sees_only_its_own_heads_slots(monkeypatch):
    """Off the kernel (here: a call it refuses) the pooled step is masked per head, not read across heads."""
    uniform = _uniform_slots([[float(i % 7) for i in range(20)], [float(i % 5) * 3 for i in range(20)]])
    uniform.offset = 20
    pooled = HeadPooledSlots.pooled(uniform, floor=0.1)
    pooled.evict_to(8)
    queries = mx.random.normal((1, 6, 1, 8), key=mx.random.key(2))
    keys, values = pooled.held()
    expected = attend_and_score(queries, keys, values, scale=0.35, mask=pooled.attention_mask(1, 6), score_rows=1)
    monkeypatch.setattr(attend_module, "kernel_supports", lambda *args, **kwargs: False)
    result = pooled.attend(queries, keys, values, scale=0.35, mask=None, score_rows=1)
    assert mx.allclose(result.output, expected.output, atol=2e-4, rtol=2e-4).item()
    assert mx.allclose(result.key_mass, expected.key_mass, atol=2e-4, rtol=2e-4).item()
