"""Helpers shared by the benchmarks: the embedded model, real prose, timed prefill and decode."""

from __future__ import annotations

import contextlib
import statistics
import time

import mlx.core as mx

import velox_cache
from pipeline.generation import prefill


def load_default_model():
    from pipeline.model_store import load_model

    return load_model("smollm2-135m-instruct")


def prose(min_tokens: int, tokenizer, start: int = 0) -> str:
    """Real English prose from CPython's reference-manual topics, at least ``min_tokens`` long."""
    from pydoc_data.topics import topics

    text, keys = "", sorted(topics)[start:] + sorted(topics)[:start]
    for key in keys:
        text += topics[key] + "\n\n"
        if len(tokenizer.encode(text)) >= min_tokens:
            break
    ids = tokenizer.encode(text)[:min_tokens]
    return tokenizer.decode(ids)


def scoring_context(model, scoring):
    """``plain``: mlx-lm untouched; ``observed``: ``velox_cache.observe``; otherwise ``fast_attention``."""
    if scoring == "plain":
        return contextlib.nullcontext()
    return velox_cache.observe(model) if scoring == "observed" else velox_cache.fast_attention(model)


def timed_run(model, prompt_ids, caches, *, scoring, prefill_step=256, decode_steps=16):
    """Chunked prefill then greedy decode; returns (prefill s, median decode s per token, peak bytes)."""
    mx.clear_cache()
    mx.reset_peak_memory()
    with scoring_context(model, scoring):
        start = time.perf_counter()
        token = mx.argmax(prefill(model, prompt_ids, caches, prefill_step), axis=-1)
        mx.eval(token)
        prefill_seconds = time.perf_counter() - start
        steps = []
        for _ in range(decode_steps):
            start = time.perf_counter()
            token = mx.argmax(model(token[None], cache=caches)[:, -1], axis=-1)
            mx.eval(token)
            steps.append(time.perf_counter() - start)
        decode = statistics.median(steps)
    return prefill_seconds, decode, mx.get_peak_memory()


def config_overrides(items: list[str]) -> dict:
    """``["mass_weight=0.3", "window=64"]`` (a bench's ``--set``) -> ``KVCacheConfig`` keyword arguments."""
    overrides = {}
    for item in items:
        field, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--set: expected FIELD=VALUE, got {item!r}")
        overrides[field] = _number_or_text(text)
    return overrides


def _number_or_text(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
