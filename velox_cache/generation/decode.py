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

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from ..builder import KVCacheBuilder
from ..config import KVCacheConfig
from ..kernels.observe import can_route
from .batching import BatchUnsupported, batch_layers, batch_refusal, join_layers
from .prefill import prefill_phases, repeat_request
from .routing import attention_routing
from .sampling import TokenSampler, greedy_choice, log_softmax
from .snapshot import restore, snapshot


@dataclass
class DecodeRow:
    """One prefilled sequence to decode, and what decoding it produced.

    ``logprobs`` ``[1, V]``: the next token's log-probabilities (the prefill's
    last position, processed by the sampler's logits processors); while rows
    decode together the batch holds them as one ``[B, V]`` array, and a row that
    leaves the batch carries its ``pending`` token instead. A plain greedy row
    decoding alone picks from the logits (``greedy_choice``) and leaves it as it was.
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

    @property
    def stops_after_next(self) -> bool:
        """True when the next token taken stops this row whatever it is (its ``max_tokens``)."""
        return len(self.tokens) + 1 >= self.max_tokens

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


def decode_rows(
    model,
    rows: Iterable[DecodeRow],
    *,
    batch: bool = True,
    pipelined: Optional[bool] = None,
    refill: Optional[Callable[[list[DecodeRow]], Sequence[DecodeRow]]] = None,
) -> list[DecodeRow]:
    """Generate for every row (see the module doc); returns the rows, each done.

    ``batch`` False (or a single row) decodes each row alone. ``pipelined``
    (as ``mlx_lm.generate_step``): the next step's model call is built on the
    lazily sampled tokens while this step computes, then checked against them;
    when a row stops at EOS the step built ahead is undone (restored from
    handles kept for that, no copy), so no cache is fed a token it would not be
    fed unpipelined, and the tokens are the same. None (the default) pipelines
    batched steps everywhere and one-row steps on a GPU or where the model has
    quantized layers: with float32 weights on a CPU the host's graph building
    competes with the step's own threads, and one row's per-step checkpoint (a
    ``snapshot`` of its stack) costs more than the overlap saves; a 4-bit step is
    short enough that building it is a large share (bench/RESULTS.md, "Pipelined
    decode"). Rows that
    cannot decode together (``BatchUnsupported``: an unroutable model, cache
    kinds that do not batch, RoPE that needs one offset) decode alone too.
    Batched decoding needs the model's attention routed
    (``velox_cache.observe`` or ``velox_cache.fast_attention``).

    ``refill`` (continuous batching, as mlx-lm's ``BatchGenerator``): called with
    the rows decoding together whenever that set changes (before the first step,
    and after rows leave), it returns more prefilled rows to join the batch now
    (none: the batch goes on as it is). It is called until it returns none with
    no row left; the rows it gave are returned after ``rows``, in the order given.
    A row decodes to the same tokens whichever rows it joins (``BatchedLayer.join``).
    """
    rows = list(rows)
    live = [row for row in rows if not row.done]
    alone_pipelined = (mx.default_device() == mx.gpu or has_quantized_layers(model)) if pipelined is None else pipelined
    if batch and (len(live) > 1 or refill is not None):
        rows += _decode_together(model, live, True if pipelined is None else pipelined, refill, alone_pipelined)
    for row in rows:
        if not row.done:
            decode_alone(model, row, pipelined=alone_pipelined)
    while refill is not None:  # unbatched, or what is left once a batch could not go on: one row at a time
        more = list(refill([]))
        if not more:
            break
        for row in more:
            if not row.done:
                decode_alone(model, row, pipelined=alone_pipelined)
        rows += more
    return rows


def has_quantized_layers(model) -> bool:
    """True when some layer of ``model`` multiplies by quantized weights (``nn.QuantizedLinear``, ``QuantizedEmbedding``)."""
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return any(isinstance(module, kinds) for _, module in model.named_modules())


def decode_alone(model, row: DecodeRow, *, pipelined: bool = False) -> DecodeRow:
    """One row, one token per model call on its own caches (``mlx_lm.generate_step``'s loop).

    ``pipelined``: the next step's model call is built while this step's token
    is computed (see ``decode_rows``); the tokens and caches are the same.
    """
    start = time.perf_counter()
    logits = None  # the next step's, when it was built ahead
    while not row.done:
        choice = None
        if row.pending is not None:
            logits = model(mx.array([[row.pending]]), cache=row.caches)[:, -1, :] if logits is None else logits
            row.pending = None
            if row.sampler.plain_greedy:
                choice = greedy_choice(logits)
            else:
                row.logprobs = row.sampler.logprobs(logits)
        token, value = choice if choice is not None else _sample_together([row], row.logprobs)
        mx.async_eval(token, value)
        logits, saved = None, None
        if pipelined and not row.stops_after_next:
            saved = snapshot(row.caches)
            logits = model(token[None], cache=row.caches)[:, -1, :]
        row.take(token.item(), value.item())
        if saved is not None:
            if row.done:  # it stopped at EOS: its caches never see the step built ahead
                restore(row.caches, saved)
                logits = None
            saved = None  # gone before the step ahead is evaluated, so its buffers update in place
    row.decode_seconds += time.perf_counter() - start
    return row


def _logprobs_together(rows: list[DecodeRow], logits: mx.array) -> mx.array:
    """``[B, V]``: each row's next-token log-probabilities from ``logits`` ``[B, V]``, its processors applied.

    One normalisation for the batch unless a row has logits processors (a repetition
    penalty reads the row's own history): those rows are processed one by one.
    """
    if not any(row.sampler.processors for row in rows):
        return log_softmax(logits)
    return mx.concatenate([row.sampler.logprobs(logits[i : i + 1]) for i, row in enumerate(rows)], axis=0)


def _sample_together(rows: list[DecodeRow], logprobs: mx.array) -> tuple[mx.array, mx.array]:
    """Each row's next token drawn from its row of ``logprobs`` ``[B, V]``, and its log-probability (both ``[B]``, lazy).

    Greedy rows take one argmax for the batch; a sampled row draws with its own key.
    """
    if all(row.sampler.temperature == 0 for row in rows):
        chosen = mx.argmax(logprobs, axis=-1)
    else:
        chosen = mx.concatenate([row.sampler.sample(logprobs[i : i + 1]) for i, row in enumerate(rows)])
    return chosen, mx.take_along_axis(logprobs, chosen[:, None], axis=-1)[:, 0]


def _choose_together(rows: list[DecodeRow], logits: mx.array) -> tuple[mx.array, mx.array]:
    """Each row's next token from ``logits`` ``[B, V]`` and its log-probability (both ``[B]``, lazy).

    Plain greedy rows (no logits processors) take ``greedy_choice`` for the batch: the
    tokens and values that the log-softmax and argmax give, in one native pass.
    """
    if all(row.sampler.plain_greedy for row in rows):
        return greedy_choice(logits)
    return _sample_together(rows, _logprobs_together(rows, logits))


def _take_together(rows: list[DecodeRow], chosen: mx.array, values: mx.array) -> None:
    for row, token, value in zip(rows, chosen.tolist(), values.tolist()):
        row.take(token, value)


def _decode_together(model, rows: list[DecodeRow], pipelined: bool, refill=None,
                     alone_pipelined: bool = False) -> list[DecodeRow]:
    """Decode ``rows`` and what ``refill`` gives in one batch; returns the rows ``refill`` gave.

    Rows that cannot batch (``batch_refusal``: a cache kind that does not batch),
    and rows that cannot batch with the others, decode alone at once, before the
    batch goes on: a row holds its caches (and its share of a refill's memory budget)
    until it is done. Every row left when the batch cannot go on decodes alone too.
    """
    joined: list[DecodeRow] = []
    layers: Optional[list] = None
    in_batch: list[DecodeRow] = []
    waiting = _first_tokens(rows)
    if refill is None and len(waiting) < 2:
        return joined  # one row decodes alone
    while True:
        more = list(refill(list(in_batch))) if refill is not None else []
        joined += more
        waiting += _first_tokens(more)
        refused = [batch_refusal(row.caches) is not None for row in waiting]
        alone = [row for row, no in zip(waiting, refused) if no]
        waiting = [row for row, no in zip(waiting, refused) if not no]
        if waiting:
            try:  # nothing of the rows' own caches is touched before a step has run with them
                batched = batch_layers([row.caches for row in waiting])
                if layers is None:
                    layers = batched
                else:
                    join_layers(layers, batched)
                in_batch += waiting
            except BatchUnsupported:
                alone += waiting
            waiting = []
        for row in alone:  # from its pending token
            decode_alone(model, row, pipelined=alone_pipelined)
        if not in_batch:
            if more:
                continue  # what refill gave stopped at once or cannot batch: ask again
            return joined
        if not _steps_until_a_row_leaves(model, layers, in_batch, pipelined):
            return joined  # every row left the batch: each goes on alone
        remaining = [i for i, row in enumerate(in_batch) if not row.done]
        in_batch = [in_batch[i] for i in remaining]
        if in_batch:
            for layer in layers:
                layer.filter(remaining)
        else:
            layers = None


def _first_tokens(rows: list[DecodeRow]) -> list[DecodeRow]:
    """Each row's first token, from the log-probabilities its prefill left; the rows that go on."""
    rows = [row for row in rows if not row.done]
    if not rows:
        return []
    start = time.perf_counter()
    _take_together(rows, *_sample_together(rows, mx.concatenate([row.logprobs for row in rows], axis=0)))
    _share(rows, time.perf_counter() - start, batched=False)
    return [row for row in rows if not row.done]


def _steps_until_a_row_leaves(model, layers: list, in_batch: list[DecodeRow], pipelined: bool) -> bool:
    """Batched steps until at least one row is done; the done rows leave (their state written back).

    False when the batch cannot go on (``BatchUnsupported``): every row has left it, as it was
    before the step that failed.
    """
    start = time.perf_counter()
    logits = None
    while True:
        if logits is None:
            try:
                logits = _batched_step(model, layers, mx.array([[row.pending] for row in in_batch]))[0]
            except BatchUnsupported:  # the layers are as before the step: each row goes on alone
                _leave(layers, range(len(in_batch)))
                return False
        for row in in_batch:
            row.pending = None
        chosen, values = _choose_together(in_batch, logits)
        mx.async_eval(chosen, values, *[array for layer in layers for array in layer.step_arrays])
        logits, ahead, alone = None, None, False
        if pipelined and not any(row.stops_after_next for row in in_batch):
            try:
                logits, ahead = _batched_step(model, layers, chosen[:, None])  # built while this step computes
            except BatchUnsupported:  # the layers are as before it: the rows go on alone after this step
                alone = True
        _take_together(in_batch, chosen, values)
        _share(in_batch, time.perf_counter() - start)
        start = time.perf_counter()
        finished = [i for i, row in enumerate(in_batch) if row.done]
        if ahead is not None and finished:  # a row stopped at EOS: undo the step built ahead
            _restore(layers, ahead)
            logits = None
        ahead = None  # gone before the step ahead is evaluated, so its buffers update in place
        if alone:
            _leave(layers, range(len(in_batch)))
            return False
        if finished:
            _leave(layers, finished)
            return True


def _batched_step(model, layers: list, tokens: mx.array) -> tuple[mx.array, list]:
    """One model call on the batched ``layers``: ``(logits [B, V], the layers' checkpoints before it)``.

    A ``BatchUnsupported`` raised by any layer, or attention that did not reach
    them, leaves every layer as it was before the call, and is raised.
    """
    checkpoints = [layer.checkpoint() for layer in layers]
    try:
        logits = model(tokens, cache=layers)[:, -1, :]
        if not all(layer.attended for layer in layers):
            raise BatchUnsupported("the model's attention did not reach the batched caches (not routable)")
    except BatchUnsupported:
        _restore(layers, checkpoints)
        raise
    return logits, checkpoints


def _restore(layers: list, checkpoints: list) -> None:
    for layer, checkpoint in zip(layers, checkpoints):
        layer.restore(checkpoint)


def _leave(layers: list, indices) -> None:
    """Rows ``indices`` leave the batch: each writes its state back into its own caches.

    Where other rows go on, what the leaving rows wrote is evaluated at once:
    unevaluated, it would keep this step's whole batch buffers alive (its inputs) for
    as long as the rows live, and the next step could not update them in place. When
    the whole batch leaves, nothing is copied until a row's caches are used.
    """
    indices = list(indices)
    written = [layer.extract(index) for layer in layers for index in indices]
    if len(indices) < len(layers[0].rows):
        mx.eval(written)


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
    prompt (text, encoded as ``mlx_lm.generate`` encodes it, or token ids) gets
    a stack from ``KVCacheBuilder.for_model`` fitted to it (``prompt_tokens``,
    ``new_tokens=max_tokens``; its own squeeze coordinator), is prefilled as
    ``mlx_lm.generate_step`` prefills (all but the last token in chunks of
    ``prefill_step_size``, then the last token alone), and decodes in a batch
    with the others. Each prompt gets the tokens ``mlx_lm.generate`` gets on
    such a stack inside ``observe(model)``, except where the config drafts a
    ``lookahead`` or ranks by ``reconstruction``: those need phases told
    (``prefill_phases``), which ``mlx_lm.generate`` never tells
    (docs/batching.md). Decoding is greedy, or
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
    prompts = [_encode(tokenizer, p) if isinstance(p, str) else list(p) for p in prompts]
    seeds = list(seeds) if seeds is not None else [0] * len(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"seeds: {len(seeds)} seeds for {len(prompts)} prompts")
    if "seed" in sampling:
        raise ValueError("seed: give one per prompt as seeds=[...]")
    TokenSampler(**sampling)  # unknown keywords fail here, before any prefill
    eos = frozenset(tokenizer.eos_token_ids)
    rows: list[DecodeRow] = []
    with attention_routing(model, [config]):
        for start in range(0, len(prompts), batch_size):
            group = []
            for tokens, seed in zip(prompts[start : start + batch_size], seeds[start : start + batch_size]):
                if not tokens:
                    raise ValueError(f"prompts[{len(rows) + len(group)}]: the prompt is empty")
                caches = KVCacheBuilder.for_model(model, config, prompt_tokens=len(tokens), new_tokens=max_tokens)
                logits = prefill_phases(
                    model, caches, document=tokens, chunk_size=prefill_step_size, max_new_tokens=max_tokens,
                    stop_tokens=eos, repeat=repeat_request(tokenizer) if config.selection == "reconstruction" else (),
                    last_alone=True,
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



def _encode(tokenizer, prompt: str) -> list[int]:
    """``prompt``'s tokens as ``mlx_lm.generate`` encodes it: special tokens unless it starts with the BOS text."""
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))
