"""Prefill phases are told, not guessed: one-token chunks stay chunks; decode ends prefill."""

import mlx.core as mx
import pytest

from velox_cache import KVCacheBuilder, KVCacheConfig, KVCacheFactory, Phase, phases, prefill_phases

from tests.velox_cache.policies import PREFILL_END_METHODS as PREFILL_END


def _kept_positions(caches):
    return [c.positions[..., : c.tokens_kept].tolist() for c in caches]


def _prefill(model, prompt, caches, chunk_size):
    events = []

    def check(event, stack):
        events.append(event)
        assert all(c.tokens_kept == c.offset for c in stack), "prefill-end policies keep every prompt token"
        assert all(c.phase is Phase.DOCUMENT for c in stack)
        coordinator = getattr(stack[0], "coordinator", None)
        assert coordinator is None or not coordinator.published, "the schedule waits for the whole prompt"

    prefill_phases(model, caches, document=prompt, chunk_size=chunk_size, after_call=check)
    return events


@pytest.mark.parametrize("method", PREFILL_END)
def test_a_one_token_last_chunk_does_not_end_prefill_early(tiny_model, method):
    model, tokenizer = tiny_model
    prompt = tokenizer.encode("Told phases keep the last token in the prompt. " * 3)
    chunk = 32
    prompt = prompt[: 3 * chunk + 1]  # the last chunk is one token long
    config = KVCacheConfig(method=method, budget=40, scoring="key_proxy", lookahead=0)  # chunks only, no draft
    told = KVCacheBuilder.for_model(model, config)
    assert _prefill(model, prompt, told, chunk) == ["document"] * 4 + ["read"], "the one-token chunk was a chunk"
    whole = KVCacheBuilder.for_model(model, config)
    _prefill(model, prompt, whole, len(prompt))  # prefill_phases ends by telling decode
    assert all(c.offset == len(prompt) and c.phase is Phase.DECODE for c in told)
    if method == "squeeze":  # its schedule samples rows per chunk, so chunking changes the budgets
        assert told[0].coordinator.published and sum(c.layer_budget for c in told) == 40 * len(told)
    else:
        assert _kept_positions(told) == _kept_positions(whole), "the same window decided, last token included"
    assert all(c.tokens_kept <= c.layer_budget for c in told)


@pytest.mark.parametrize("method", PREFILL_END)
def test_prefill_step_size_one_keeps_window_selection(tiny_model, method):
    model, tokenizer = tiny_model
    prompt = tokenizer.encode("One token at a time is still a prompt. " * 2)
    config = KVCacheConfig(method=method, budget=24, scoring="key_proxy", lookahead=0)  # chunks only, no draft
    stepwise = KVCacheBuilder.for_model(model, config)
    assert _prefill(model, prompt, stepwise, 1) == ["document"] * len(prompt) + ["read"]
    chunked = KVCacheBuilder.for_model(model, config)
    _prefill(model, prompt, chunked, 64)
    if method == "squeeze":
        schedule = stepwise[0].coordinator.budgets
        assert sum(schedule) == 24 * len(stepwise) and min(schedule) > 1
        assert [c.layer_budget for c in stepwise] == schedule
    else:
        assert _kept_positions(stepwise) == _kept_positions(chunked), "SnapKV, not H2O, with one-token steps"
    assert all(c.tokens_kept <= c.layer_budget for c in stepwise)


def test_never_told_the_first_single_token_call_still_ends_prefill():
    cache = KVCacheFactory.create(KVCacheConfig(method="snapkv", budget=16, scoring="key_proxy"))
    keys = mx.random.normal((1, 2, 40, 16))
    cache.update_and_fetch(keys, keys)
    assert cache.tokens_kept == 40 and cache.phase is None
    one = mx.random.normal((1, 2, 1, 16))
    cache.update_and_fetch(one, one)
    assert cache.tokens_kept == 16, "mlx_lm.generate's fallback: the prompt's last token starts decoding"


def test_told_a_single_token_call_is_a_chunk_until_decode():
    cache = KVCacheFactory.create(KVCacheConfig(method="snapkv", budget=16, scoring="key_proxy"))
    phases.tell([cache], "document")
    keys = mx.random.normal((1, 2, 40, 16))
    cache.update_and_fetch(keys, keys)
    one = mx.random.normal((1, 2, 1, 16))
    held, _ = cache.update_and_fetch(one, one)
    assert held.shape[2] == 41 and cache.tokens_kept == 41
    phases.tell([cache], "instruction")
    cache.update_and_fetch(keys[:, :, :5], keys[:, :, :5])
    assert cache.tokens_kept == 46
    phases.tell([cache], "decode")
    assert cache.tokens_kept == 16 and cache.phase is Phase.DECODE
    cache.update_and_fetch(one, one)
    assert cache.tokens_kept == 16 and cache.offset == 47


def test_phase_misuse_is_a_clear_error():
    cache = KVCacheFactory.create(KVCacheConfig(method="pyramidkv", budget=16, scoring="key_proxy"))
    with pytest.raises(ValueError, match="phase: 'prefill' is not one of"):
        phases.tell([cache], "prefill")
    with pytest.raises(ValueError, match="phases.probe"):
        phases.tell([cache], "probe")
    keys = mx.random.normal((1, 2, 8, 16))
    cache.update_and_fetch(keys, keys)
    phases.tell([cache], "decode")
    with pytest.raises(ValueError, match="after decoding started"):
        phases.tell([cache], "document")
    with pytest.raises(ValueError, match="probe runs during prefill"):
        with phases.probe([cache]):
            pass


def test_plain_mlx_caches_ignore_phases():
    from mlx_lm.models.cache import KVCache

    plain = KVCache()
    phases.tell([plain], "document")
    phases.tell([plain], "decode")
    assert not phases.wants_probe([plain, KVCacheFactory.create(KVCacheConfig(method="pyramidkv"))])
    assert phases.wants_probe([KVCacheFactory.create(KVCacheConfig(method="pyramidkv", eviction="streaming"))])


def _told_like_generate_step(model, prompt, caches, step, max_tokens):
    """``mlx_lm.generate_step``'s very calls (all but the last token in chunks, then the last alone), phases told."""
    tokens = mx.array(prompt)
    phases.tell(caches, "document")
    for start in range(0, len(prompt) - 1, step):
        model(tokens[None, start : min(start + step, len(prompt) - 1)], cache=caches)
        mx.eval([c.state for c in caches])
    logits = model(tokens[None, -1:], cache=caches)[:, -1]
    phases.tell(caches, "decode")
    out = []
    for _ in range(max_tokens):
        token = mx.argmax(logits, axis=-1)
        out.append(token.item())
        logits = model(token[None], cache=caches)[:, -1]
    return out


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv"])
@pytest.mark.parametrize("remainder", [0, 1, 2])
def test_mlx_lm_generate_step_ends_prefill_where_told_phases_do(tiny_model, method, remainder):
    """Never told, ``generate_step``'s prompt ends where it is told to; lengths ≡ 0, 1, 2 (mod the step).

    Length ≡ 2 makes mlx-lm feed a one-token chunk before the prompt's last token.
    """
    from mlx_lm.generate import generate_step

    model, tokenizer = tiny_model
    step, max_tokens = 16, 6
    prompt = tokenizer.encode("Inferred phases must match told ones, token for token. " * 6)[: 3 * step + remainder]
    config = KVCacheConfig(method=method, budget=20, scoring="key_proxy")
    told = KVCacheBuilder.for_model(model, config)
    expected = _told_like_generate_step(model, prompt, told, step, max_tokens)
    inferred = KVCacheBuilder.for_model(model, config)
    got = [t for t, _ in generate_step(mx.array(prompt), model, prompt_cache=inferred, prefill_step_size=step,
                                        max_tokens=max_tokens)]
    assert got == expected
    assert [c.phase for c in inferred] == [None] * len(inferred), "never told"
    assert _kept_positions(inferred) == _kept_positions(told), "the same tokens kept, last prompt token included"


def test_a_caller_that_reads_the_state_after_every_call_still_starts_decoding():
    """The state read only keeps mlx-lm's one-token remainder and last token in the prompt: two calls at most."""
    cache = KVCacheFactory.create(KVCacheConfig(method="snapkv", budget=16, scoring="key_proxy"))
    keys = mx.random.normal((1, 2, 40, 16))
    cache.update_and_fetch(keys, keys)
    prefilling = []
    for _ in range(4):
        mx.eval(cache.state)
        one = mx.random.normal((1, 2, 1, 16))
        cache.update_and_fetch(one, one)
        prefilling.append(cache.progress.prefilling)
    assert prefilling == [True, True, False, False] and cache.tokens_kept == 16
