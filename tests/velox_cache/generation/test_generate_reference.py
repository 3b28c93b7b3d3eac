"""``batch_generate`` against ``mlx_lm``: each prompt's tokens equal ``mlx_lm.stream_generate`` with a fresh stack.

The README installs Velox caches for ``mlx_lm.generate`` and promises that
``batch_generate`` gives each prompt what it gets alone. The reference here is
mlx-lm's own loop (``generate_step``: all but the prompt's last token in chunks of
``prefill_step_size``, then the last token alone, no phases told) on a stack from
``KVCacheBuilder.for_model(model, config, prompt_tokens=..., new_tokens=max_tokens)``
inside ``velox_cache.observe(model)``.
"""

import mlx_lm
import pytest

import velox_cache
from velox_cache import KVCacheBuilder, KVCacheConfig

STEP = 16
MAX_TOKENS = 8
# 17: one chunk, then the last token alone either way. 34, 41, 62 leave a remainder that mlx-lm splits
# off its last token (34: a one-token chunk, then the last token alone); h2o evicts after each call, and
# squeeze samples its concentration from each call's last rows (62: a 13-token call and a 1-token one)
LENGTHS = (17, 34, 41, 62)
PROSE = (
    "The committee met on a grey morning to review the harbour accounts. Nobody expected the ledger "
    "from the northern warehouse to balance, and it did not: forty crates of tea had left twice."
)
CONFIGS = {
    "pyramidkv-observed": KVCacheConfig(method="pyramidkv", budget=12, lookahead=0),
    "squeeze-observed": KVCacheConfig(method="squeeze", budget=10, scoring="observed", lookahead=0),
    "h2o-key-proxy": KVCacheConfig(method="h2o", budget=8, scoring="key_proxy"),
    "pyramidkv-streaming": KVCacheConfig(method="pyramidkv", budget=12, eviction="streaming", lookahead=0),
}


def _prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(PROSE * 2)
    return [ids[n : 2 * n] for n in LENGTHS]


def _mlx_lm_alone(model, tokenizer, prompt, config, **fit) -> list[int]:
    caches = KVCacheBuilder.for_model(model, config, **fit)
    with velox_cache.observe(model):
        tokens = [
            r.token
            for r in mlx_lm.stream_generate(
                model, tokenizer, prompt, max_tokens=MAX_TOKENS, prompt_cache=caches, prefill_step_size=STEP
            )
        ]
    return [t for t in tokens if t not in tokenizer.eos_token_ids]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batch_generate_equals_mlx_lm_stream_generate_per_prompt(tiny_model, name):
    """Same chunking (the last prompt token alone, as ``generate_step``), same budgets (fitted to the prompt)."""
    model, tokenizer = tiny_model
    config = CONFIGS[name]
    prompts = _prompts(tokenizer)
    assert all(len(p) > config.budget for p in prompts), "every prompt is compressed"
    batched = velox_cache.batch_generate(
        model, tokenizer, prompts, config, max_tokens=MAX_TOKENS, prefill_step_size=STEP, batch_size=len(prompts)
    )
    expected = [
        _mlx_lm_alone(model, tokenizer, p, config, prompt_tokens=len(p), new_tokens=MAX_TOKENS) for p in prompts
    ]
    assert batched.token_ids == expected
    assert max(batched.batch_sizes) > 1, "decoded together"


def test_a_look_ahead_is_the_path_mlx_lm_generate_cannot_take(tiny_model):
    """With ``lookahead`` (the prefill-end default) ``batch_generate`` drafts and ranks by the draft; mlx-lm cannot.

    ``mlx_lm.generate`` tells no phases, so its stack infers the end of prefill at
    the first generated token, too late to draft: the config's ``lookahead`` is
    not run, and it gets what ``lookahead=0`` gets. ``batch_generate`` prefills
    with ``prefill_phases``, which drafts: the ranking at prefill end differs.
    """
    model, tokenizer = tiny_model
    drafting = KVCacheConfig(method="pyramidkv", budget=12, lookahead=4)
    plain = KVCacheConfig(method="pyramidkv", budget=12, lookahead=0)
    prompts = _prompts(tokenizer)
    fits = [dict(prompt_tokens=len(p), new_tokens=MAX_TOKENS) for p in prompts]
    reference = [_mlx_lm_alone(model, tokenizer, p, drafting, **fit) for p, fit in zip(prompts, fits)]
    assert reference == [_mlx_lm_alone(model, tokenizer, p, plain, **fit) for p, fit in zip(prompts, fits)]
    options = dict(max_tokens=MAX_TOKENS, prefill_step_size=STEP, batch_size=len(prompts))
    assert velox_cache.batch_generate(model, tokenizer, prompts, plain, **options).token_ids == reference
    assert velox_cache.batch_generate(model, tokenizer, prompts, drafting, **options).token_ids != reference


def test_text_prompts_are_encoded_as_mlx_lm_generate_encodes_them(tiny_model, monkeypatch):
    """Special tokens are added unless the text already starts with the BOS token (a chat template's output)."""
    from tokenizers.processors import TemplateProcessing

    model, tokenizer = tiny_model
    backend = tokenizer._tokenizer._tokenizer  # the tiny tokenizer adds no BOS of its own: make it add one
    bos = tokenizer.bos_token
    processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tokenizer.bos_token_id)])
    monkeypatch.setattr(backend, "post_processor", processor)
    assert tokenizer.encode("abc")[0] == tokenizer.bos_token_id
    prompts = [PROSE[:40], bos + PROSE[40:90]]
    config = CONFIGS["h2o-key-proxy"]
    batched = velox_cache.batch_generate(model, tokenizer, prompts, config, max_tokens=MAX_TOKENS, prefill_step_size=STEP)
    expected = []
    for prompt in prompts:
        n = len(tokenizer.encode(prompt, add_special_tokens=not prompt.startswith(bos)))
        expected.append(_mlx_lm_alone(model, tokenizer, prompt, config, prompt_tokens=n, new_tokens=MAX_TOKENS))
    assert batched.token_ids == expected
