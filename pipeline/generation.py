"""One document through one cache variant: fresh cache stack, chunked prefill, decode."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

import velox_cache
from velox_cache import KVCacheBuilder, KVCacheConfig
from velox_cache.accounting import layer_stats

from .spec import GenerationSpec


@dataclass
class GenerationResult:
    output: str
    prompt_tokens: int
    output_tokens: int
    prefill_seconds: float
    decode_seconds: float
    peak_memory_bytes: int
    stop_reason: str  # "eos" or "max_tokens"
    layer_stats: list[dict] = field(default_factory=list)

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.output_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def totals(self) -> dict:
        kept = sum(row["kept_bytes"] for row in self.layer_stats)
        full = sum(row["full_seq_bytes"] for row in self.layer_stats)
        return {"kept_bytes": kept, "full_seq_bytes": full, "compression_ratio": full / kept if kept else None}


def _observation(model, config: KVCacheConfig):
    if config.method != "full" and config.scoring == "observed":
        return velox_cache.observe(model)
    return contextlib.nullcontext()


def generate(model, tokenizer, prompt_tokens: list[int], config: KVCacheConfig, settings: GenerationSpec) -> GenerationResult:
    """Generate for one prompt with a freshly built cache stack (and coordinator)."""
    caches = KVCacheBuilder.for_model(model, config)
    sampler = make_sampler(temp=settings.temperature, top_p=settings.top_p)
    eos = set(tokenizer.eos_token_ids)
    mx.random.seed(settings.seed)
    mx.clear_cache()
    mx.reset_peak_memory()
    generated: list[int] = []
    with _observation(model, config):
        start = time.perf_counter()
        token = _sample(prefill(model, prompt_tokens, caches, settings.prefill_step_size), sampler)
        prefill_seconds = time.perf_counter() - start
        start = time.perf_counter()
        stop_reason = "max_tokens"
        while True:
            if token in eos:
                stop_reason = "eos"
                break
            generated.append(token)
            if len(generated) >= settings.max_tokens:
                break
            token = _sample(model(mx.array([[token]]), cache=caches)[:, -1, :], sampler)
        decode_seconds = time.perf_counter() - start
    return GenerationResult(
        output=tokenizer.decode(generated),
        prompt_tokens=len(prompt_tokens),
        output_tokens=len(generated),
        prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds,
        peak_memory_bytes=mx.get_peak_memory(),
        stop_reason=stop_reason,
        layer_stats=[_layer_row(i, cache) for i, cache in enumerate(caches)],
    )


def prefill(model, prompt_tokens, caches, step: int) -> mx.array:
    """Run the prompt through ``model`` in chunks of ``step`` tokens; returns the last logits ``[1, V]``.

    Like ``mlx_lm.generate_step``: all but the last token in chunks (evaluating
    the cache state after each), then the last token alone, which ends prefill.
    """
    prompt = mx.array(prompt_tokens)
    for begin in range(0, prompt.size - 1, step):
        model(prompt[None, begin : min(begin + step, prompt.size - 1)], cache=caches)
        mx.eval([c.state for c in caches])
    return model(prompt[None, -1:], cache=caches)[:, -1, :]


def _sample(logits: mx.array, sampler) -> int:
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sampler(logprobs).item()


def _layer_row(layer: int, cache) -> dict:
    """One ``layer_stats`` row for any entry of the cache list (Velox or kept as the model made it)."""
    row = layer_stats(layer, cache)
    row.pop("offset")
    if row["method"] is None:
        row.pop("method")  # a layer Velox left alone: the store fills in the document's method
    return row
