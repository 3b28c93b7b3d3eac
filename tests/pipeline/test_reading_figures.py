"""A row cut from a shared reading carries what its variant costs, and a peak that is its own."""

import pytest

from pipeline.generation import cut_shared, draft_together, prefill_variant, read_shared
from pipeline.prompting import Prompt
from pipeline.spec import GenerationSpec
from velox_cache import KVCacheConfig
from velox_cache.kernels import fused

FULL = KVCacheConfig(method="full")
PYRAMID = KVCacheConfig(method="pyramidkv", budget=24, lookahead=4)
SQUEEZE = KVCacheConfig(method="squeeze", budget=24, lookahead=0)


@pytest.fixture
def ticking_clock(monkeypatch):
    """``time.perf_counter`` as a clock that ticks one second per ``mx.eval``: figures become counts of evaluations."""
    import time

    import mlx.core as mx

    now = [0.0]
    evaluate = mx.eval

    def ticking_eval(*arrays):
        now[0] += 1.0
        return evaluate(*arrays)

    monkeypatch.setattr(mx, "eval", ticking_eval)
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    return now


def _reading(tiny_model, **settings):
    model, tokenizer = tiny_model
    prompt = Prompt([5 + (i * 7) % 90 for i in range(200)], document_start=2, document_end=190)
    spec = GenerationSpec(max_tokens=6, prefill_step_size=32, **settings)
    return tokenizer, spec, read_shared(model, tokenizer, prompt, [FULL, PYRAMID, SQUEEZE], spec)


def test_each_cut_row_carries_the_reading_and_none_carries_the_others_recordings(tiny_model, ticking_clock):
    tokenizer, spec, reading = _reading(tiny_model)
    runs, cutting = {}, {}
    for config in (FULL, PYRAMID, SQUEEZE):
        start = ticking_clock[0]
        runs[config.method] = cut_shared(tokenizer, reading, config, spec)
        cutting[config.method] = ticking_clock[0] - start
    recordings = reading.shared.nbytes
    full_stack = reading.shared.held_bytes(FULL)
    assert runs["full"].prefill_peak_bytes <= reading.peak_bytes - recordings
    for method in ("pyramidkv", "squeeze"):
        assert runs[method].prefill_peak_bytes <= reading.peak_bytes - full_stack
    # the reading scored every row for squeeze (its mass blend and measure): only squeeze pays for that
    shared = reading.shared
    assert [shared.scores_while_reading(c) for c in (FULL, PYRAMID, SQUEEZE)] == [False, False, True]
    assert shared.scoring_seconds > 0 or not fused.available()
    unscored = reading.seconds - shared.scoring_seconds
    assert runs["full"].reading_seconds == unscored
    assert runs["pyramidkv"].reading_seconds == unscored + reading.look_ahead_seconds
    assert runs["squeeze"].reading_seconds == reading.seconds
    for method, run in runs.items():  # the reading's share, then its own cut, measured around the call
        assert cutting[method] >= 1 and run.prefill_seconds == pytest.approx(run.reading_seconds + cutting[method])
    # the reading drafted (nothing decoded yet to be the draft): its seconds go to the variant that looks ahead
    assert reading.draft_seconds is not None
    assert runs["pyramidkv"].draft_seconds == reading.draft_seconds
    assert runs["full"].draft_seconds is None and runs["squeeze"].draft_seconds is None


def _prompts(count: int) -> list:
    return [Prompt([5 + (i * (7 + j)) % 90 for i in range(120 + 30 * j)], document_start=2, document_end=110 + 30 * j)
            for j in range(count)]


def test_readings_drafted_together_draft_what_each_drafts_alone_and_cut_what_its_own_prefill_keeps(tiny_model):
    model, tokenizer = tiny_model
    spec = GenerationSpec(max_tokens=6, prefill_step_size=32)
    prompts = _prompts(3)
    together = [read_shared(model, tokenizer, prompt, [PYRAMID], spec, draft=False) for prompt in prompts]
    fed = []
    for reading in together:
        feed = reading.feed_draft
        reading.feed_draft = lambda tokens, feed=feed: (fed.append(list(tokens)), feed(tokens))
    draft_together(model, together, budget_bytes=2**30, max_rows=8)
    alone = [read_shared(model, tokenizer, prompt, [PYRAMID], spec, draft=False).shared.draft() for prompt in prompts]
    assert fed == alone and all(len(tokens) == PYRAMID.lookahead for tokens in alone)
    kept = lambda run: [c.slots.held_positions().tolist() for c in run.row.caches]  # noqa: E731
    for prompt, reading in zip(prompts, together):
        assert reading.shared.looked_ahead and reading.draft_seconds > 0
        run, own = cut_shared(tokenizer, reading, PYRAMID, spec), prefill_variant(model, tokenizer, prompt, PYRAMID, spec)
        assert kept(run) == kept(own)
        assert run.draft_seconds == reading.draft_seconds and run.reading_seconds is None  # one config read


def test_a_reading_that_serves_the_full_variant_is_not_drafted_together(tiny_model):
    model, tokenizer = tiny_model
    spec = GenerationSpec(max_tokens=6, prefill_step_size=32)
    reading = read_shared(model, tokenizer, _prompts(1)[0], [FULL, PYRAMID], spec, draft=False)
    with pytest.raises(ValueError, match="full variant"):
        draft_together(model, [reading], budget_bytes=2**30, max_rows=8)


def test_a_variants_draft_seconds_are_its_draft_and_the_prompts_last_evaluation_is_prefill(tiny_model, monkeypatch,
                                                                                           ticking_clock):
    """A clock that ticks once per evaluation: the draft's seconds are the ticks inside the draft itself, none of
    the prompt's (its last chunk's final layers and LM head, evaluated before the draft, are prefill's)."""
    import velox_cache.generation.prefill as prefill

    now, draft, spans = ticking_clock, prefill.draft, []

    def timed_draft(*args, **kwargs):
        start = now[0]
        tokens = draft(*args, **kwargs)
        spans.append(now[0] - start)
        return tokens

    model, tokenizer = tiny_model
    prompt = Prompt([5 + (i * 7) % 90 for i in range(120)], document_start=2, document_end=100)
    spec = GenerationSpec(max_tokens=6, prefill_step_size=32)
    monkeypatch.setattr(prefill, "draft", timed_draft)
    run = prefill_variant(model, tokenizer, prompt, PYRAMID, spec)
    assert len(spans) == 1 and spans[0] >= 1
    assert run.draft_seconds == spans[0]
