"""Decoding prefilled sequences: one at a time, or many in one batch (``BatchedLayer``).

A ``DecodeRow`` is one sequence whose cache stack has finished prefill, with
its sampler and the log-probabilities of its next token. ``decode_rows``
generates for every row: alone (exactly the loop ``mlx_lm.generate_step``
runs, one token per model call) or together, one model call per step for
all rows, each row's token choice and stop on its own. A row that stops (EOS,
or its ``max_tokens``) leaves the batch with its state written back into its
own caches; no cache is ever fed a token that decoding alone would not feed
it (the EOS token, or one after the last).

Decode seconds of a batched step are shared equally by the rows in it, so
the rows' seconds add up to the wall time of the batch.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

import mlx.core as mx

from .batching import BatchUnsupported, batch_layers
from .builder import KVCacheBuilder
from .config import KVCacheConfig
from .observe import can_route, fast_attention, observe
from .prefill import prefill_phases
from .sampling import TokenSampler


@dataclass
class DecodeRow:
    """One prefilled sequence to decode, and what decoding it produced.

    ``logprobs`` ``[1, V]``: the next token's log-probabilities (the prefill's
    last position, processed by the sampler's logits processors).
    """

    caches: list
    sampler: TokenSampler
    logprobs: mx.array
    max_tokens: int
    eos: frozenset = frozenset()
    tokens: list = field(default_factory=list)
    token_logprobs: list = field(default_factory=list)  # of each generated token
    stop_reason: Optional[str] = None  # "eos" or "max_tokens" once done
    decode_seconds: float = 0.0
    batch_size: int = 1  # the most rows it decoded beside in one step, itself included
    pending: Optional[int] = None  # chosen and accepted, not yet fed to the model

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def take(self, token: int, logprob: float) -> None:
        """The sampler chose ``token``: stop on EOS or at ``max_tokens``, else it goes to the model next."""
        if token in self.eos:
            self.stop_reason = "eos"
            return
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        if len(self.tokens) >= self.max_tokens:
            self.stop_reason = "max_tokens"
            return
        self.sampler.accept(token)
        self.pending = token


def decode_rows(model, rows: Iterable[DecodeRow], *, batch: bool = True) -> list[DecodeRow]:
    """Generate for every row (see the module doc); returns the rows, each done.

    ``batch`` False (or a single row) decodes each row alone. Rows that
    cannot decode together (``BatchUnsupported``: an unroutable model, cache
    kinds that do not batch, RoPE that needs one offset) decode alone too.
    Batched decoding needs the model's attention routed
    (``velox_cache.observe`` or ``velox_cache.fast_attention``).
    """
    rows = list(rows)
    live = [row for row in rows if not row.done]
    if batch and len(live) > 1:
        _decode_together(model, live)
    for row in live:
        if not row.done:
            decode_alone(model, row)
    return rows


def decode_alone(model, row: DecodeRow) -> DecodeRow:
    """One row, one token per model call on its own caches (``mlx_lm.generate_step``'s loop)."""
    start = time.perf_counter()
    while not row.done:
        if row.pending is None:
            token = row.sampler.choose(row.logprobs)
            row.take(token, row.logprobs[0, token].item())
            continue
        logits = model(mx.array([[row.pending]]), cache=row.caches)[:, -1, :]
        row.pending = None
        row.logprobs = row.sampler.logprobs(logits)
    row.decode_seconds += time.perf_counter() - start
    return row


def _choose_together(rows: list[DecodeRow], extra_eval: list) -> None:
    """Each row samples its next token from its own ``logprobs``; one evaluation for all of them."""
    tokens = [row.sampler.sample(row.logprobs) for row in rows]
    logprobs = [mx.take_along_axis(row.logprobs, token[:, None], axis=-1)[:, 0] for row, token in zip(rows, tokens)]
    chosen, values = mx.concatenate(tokens), mx.concatenate(logprobs)
    mx.eval(chosen, values, *extra_eval)
    for row, token, value in zip(rows, chosen.tolist(), values.tolist()):
        row.take(token, value)


def _decode_together(model, rows: list[DecodeRow]) -> None:
    start = time.perf_counter()
    _choose_together(rows, [])
    _share(rows, time.perf_counter() - start, batched=False)
    in_batch = [row for row in rows if not row.done]
    if len(in_batch) < 2:
        return
    start = time.perf_counter()
    try:  # nothing of the rows' own caches is touched before the first step has run
        layers = batch_layers([row.caches for row in in_batch])
        logits = model(mx.array([[row.pending] for row in in_batch]), cache=layers)[:, -1, :]
        if not all(layer.attended for layer in layers):
            raise BatchUnsupported("the model's attention did not reach the batched caches (not routable)")
    except BatchUnsupported:
        return  # each row decodes alone from its pending token
    while in_batch:
        if logits is None:
            start = time.perf_counter()
            logits = model(mx.array([[row.pending] for row in in_batch]), cache=layers)[:, -1, :]
        for index, row in enumerate(in_batch):
            row.pending = None
            row.logprobs = row.sampler.logprobs(logits[index : index + 1])
        _choose_together(in_batch, [layer.scores for layer in layers])
        _share(in_batch, time.perf_counter() - start)
        logits = None
        finished = [i for i, row in enumerate(in_batch) if row.done]
        if not finished:
            continue
        for layer in layers:
            for index in finished:
                layer.extract(index)
        remaining = [i for i, row in enumerate(in_batch) if not row.done]
        in_batch = [in_batch[i] for i in remaining]
        if in_batch:
            for layer in layers:
                layer.keep_rows(remaining)


def _share(rows: list[DecodeRow], seconds: float, batched: bool = True) -> None:
    """A step's wall time, shared equally by its rows (a model call for all of them when ``batched``)."""
    for row in rows:
        row.decode_seconds += seconds / len(rows)
        if batched:
            row.batch_size = max(row.batch_size, len(rows))


@dataclass
class BatchResponse:
    """What ``batch_generate`` returns: one entry per prompt, in prompt order."""

    texts: list[str]
    token_ids: list[list[int]]
    stop_reasons: list[str]
    batch_sizes: list[int]  # the most sequences each prompt decoded beside, itself included


def batch_generate(
    model,
    tokenizer,
    prompts: Sequence[Union[str, Sequence[int]]],
    config: KVCacheConfig,
    *,
    max_tokens: int = 256,
    prefill_step_size: int = 256,
    batch_size: int = 8,
    seeds: Optional[Sequence[int]] = None,
    **sampling,
) -> BatchResponse:
    """Generate for every prompt with its own fresh Velox cache stack, decoding ``batch_size`` at a time.

    Like ``mlx_lm.batch_generate`` (``.texts``), with compressed caches: each
    prompt (text, or token ids) gets a stack from ``KVCacheBuilder.for_model``
    (and its own squeeze coordinator), is prefilled in chunks of
    ``prefill_step_size``, and decodes in a batch with the others: greedy, or
    sampled with mlx-lm's samplers (``sampling``: ``TokenSampler``'s keywords,
    ``temperature``, ``top_p``, ``min_p``, ``top_k``, ``repetition_penalty``,
    ``repetition_context_size``); prompt ``i`` draws from seed ``seeds[i]``
    (default 0), the same tokens as it would alone. The model's
    attention runs through Velox (``observe`` for observed scoring, else
    ``fast_attention``); a model that cannot be routed decodes one at a time.

    Example::

        texts = velox_cache.batch_generate(model, tokenizer, prompts,
                                           KVCacheConfig(method="pyramidkv", budget=128)).texts
    """
    if batch_size < 1:
        raise ValueError(f"batch_size: must be at least 1, got {batch_size}")
    prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    seeds = list(seeds) if seeds is not None else [0] * len(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"seeds: {len(seeds)} seeds for {len(prompts)} prompts")
    if "seed" in sampling:
        raise ValueError("seed: give one per prompt as seeds=[...]")
    TokenSampler(**sampling)  # unknown keywords fail here, before any prefill
    eos = frozenset(tokenizer.eos_token_ids)
    rows: list[DecodeRow] = []
    with _routing(model, config):
        for start in range(0, len(prompts), batch_size):
            group = []
            for tokens, seed in zip(prompts[start : start + batch_size], seeds[start : start + batch_size]):
                if not tokens:
                    raise ValueError(f"prompts[{len(rows) + len(group)}]: the prompt is empty")
                caches = KVCacheBuilder.for_model(model, config, prompt_tokens=len(tokens))
                logits = prefill_phases(
                    model, caches, document=tokens, chunk_size=prefill_step_size, max_new_tokens=max_tokens
                )
                sampler = TokenSampler(tokens, seed=seed, **sampling)
                group.append(DecodeRow(caches, sampler, sampler.logprobs(logits), max_tokens, eos))
            decode_rows(model, group, batch=can_route(model))
            for row in group:
                row.caches = None  # the stack is done with: free it before the next group
            rows += group
    return BatchResponse(
        texts=[tokenizer.decode(row.tokens) for row in rows],
        token_ids=[row.tokens for row in rows],
        stop_reasons=[row.stop_reason for row in rows],
        batch_sizes=[row.batch_size for row in rows],
    )


def _routing(model, config: KVCacheConfig):
    if not can_route(model):
        return contextlib.nullcontext()
    if config.method != "full" and config.scoring in ("observed", None):
        return observe(model)
    return fast_attention(model)
