"""``TokenSampler``: how one sequence picks its next token, through mlx-lm's own samplers.

mlx-lm's sampling settings (``temperature``, ``top_p``, ``min_p``, ``top_k``)
and its repetition penalty (over the last ``repetition_context_size`` tokens).
As in ``mlx_lm.generate_step``, the logits processors see the prompt and every
token generated so far, and the log-probabilities sampled from are those after
the processors.

Each sampler draws from its own random key, split once per sampled token
exactly as MLX's global generator does after ``mx.random.seed(seed)``: a
sequence samples the same tokens whether it decodes alone or in a batch, and
the same as ``mx.random.seed(seed)`` followed by mlx-lm's sampler.
"""

from __future__ import annotations

from typing import Iterable, Optional

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
)

from ..kernels import native


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities (float32) from logits ``[..., V]``."""
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _native_with(op: str):
    """Velox's native ops where they are built with ``op`` and the stream is the CPU's; else None."""
    ops = native.ops()
    return ops if ops is not None and hasattr(ops, op) and mx.default_device() == mx.cpu else None


def greedy_choice(logits: mx.array) -> tuple[mx.array, mx.array]:
    """``(tokens, logprobs)`` ``[...]`` of logits ``[..., V]``: each row's argmax of ``log_softmax`` and its value.

    Where Velox's native ops are built and the stream is the CPU's, one native
    pass per row (``VeloxGreedy``) with the same bits as MLX's ``logsumexp``,
    subtract and ``argmax`` on x86 (about 9x faster for 32 rows of SmolLM2's
    49,152 logits); else those MLX ops. Lazy, like them.
    """
    ops = _native_with("greedy_choice")
    if ops is not None:
        return ops.greedy_choice(logits)
    logprobs = log_softmax(logits)
    tokens = mx.argmax(logprobs, axis=-1)
    return tokens, mx.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]


def forced_choice(logits: mx.array, targets: mx.array) -> tuple[mx.array, mx.array]:
    """``(tokens, target_logprobs)`` ``[...]`` of logits ``[..., V]`` and targets ``[...]``.

    Each row's greedy token (as ``greedy_choice``) and the log-probability of
    its target token under the row's ``log_softmax``: what teacher forcing
    compares. One native pass per row where ``greedy_choice`` has one (the same
    bits as MLX's log-softmax, ``argmax`` and ``take_along_axis`` on x86); else
    those MLX ops. Lazy, like them.
    """
    ops = _native_with("forced_choice")
    if ops is not None:
        tokens, _, target_logprobs = ops.forced_choice(logits, targets)
        return tokens, target_logprobs
    logprobs = log_softmax(logits)
    return mx.argmax(logprobs, axis=-1), mx.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]


class TokenSampler:
    """mlx-lm's sampling and logits processors for one sequence, with its token history and random key.

    ``temperature`` 0 is greedy (argmax); ``top_p`` 1, ``min_p`` 0 and
    ``top_k`` 0 are off; ``repetition_penalty`` None (or 1) is off.
    """

    def __init__(
        self,
        prompt_tokens: Iterable[int] = (),
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        top_k: int = 0,
        repetition_penalty: Optional[float] = None,
        repetition_context_size: int = 20,
        seed: int = 0,
    ):
        self.temperature = temperature
        self.filters = []  # mlx-lm's, in the order its make_sampler applies them
        if 0 < top_p < 1.0:
            self.filters.append(lambda x: apply_top_p(x, top_p))
        if min_p != 0.0:
            self.filters.append(lambda x: apply_min_p(x, min_p, 1))
        if top_k > 0:
            self.filters.append(lambda x: apply_top_k(x, top_k))
        self.processors = make_logits_processors(
            repetition_penalty=repetition_penalty, repetition_context_size=repetition_context_size
        )
        self.context_size = repetition_context_size  # the processors read no further back
        self.prompt = list(prompt_tokens)
        self.history = list(self.prompt)  # the prompt, then every token accepted
        self.key = mx.random.key(seed)

    @property
    def plain_greedy(self) -> bool:
        """True when the next token is the argmax of the logits' log-softmax (greedy, no logits processors)."""
        return self.temperature == 0 and not self.processors

    @classmethod
    def from_settings(cls, settings, prompt_tokens: Iterable[int]) -> "TokenSampler":
        """From an object with the sampling attributes (a job spec's ``generation`` section)."""
        return cls(
            prompt_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            min_p=settings.min_p,
            top_k=settings.top_k,
            repetition_penalty=settings.repetition_penalty,
            repetition_context_size=settings.repetition_context_size,
            seed=settings.seed,
        )

    def logprobs(self, logits: mx.array, history=None) -> mx.array:
        """Log-probabilities ``[1, V]`` of the next token after ``history`` (default: this sequence's)."""
        if self.processors:
            logits = logits.astype(mx.float32)
            tokens = mx.array((self.history if history is None else history)[-self.context_size :])
            for processor in self.processors:
                logits = processor(tokens, logits)
        return log_softmax(logits)

    def sample(self, logprobs: mx.array) -> mx.array:
        """The next token ``[1]`` drawn from ``logprobs`` ``[1, V]`` (lazy; argmax when greedy)."""
        if self.temperature == 0:
            return mx.argmax(logprobs, axis=-1)
        for apply in self.filters:
            logprobs = apply(logprobs)
        self.key, key = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=key)

    def choose(self, logprobs: mx.array) -> int:
        """The next token, sampled from ``logprobs``."""
        return self.sample(logprobs).item()

    def accept(self, token: int) -> None:
        """``token`` was generated and goes to the model: the processors see it from now on."""
        self.history.append(token)

    def forced_logprobs(self, first: mx.array, logits, reference: list[int]) -> mx.array:
        """``[n, V]``: row i is the next-token distribution after the prompt and ``reference[:i]``.

        ``first`` ``[1, V]`` is the prefill's (already processed); ``logits`` ``[n - 1, V]``
        (None when n is 1) the model's at each reference token but the last, unprocessed.
        """
        if logits is None:
            return first
        if not self.processors:
            return mx.concatenate([first, log_softmax(logits)], axis=0)
        rows = [first] + [
            self.logprobs(logits[i : i + 1], self.prompt + reference[: i + 1]) for i in range(logits.shape[0])
        ]
        return mx.concatenate(rows, axis=0)

    def forced_choices(self, first: mx.array, logits, reference: list[int]) -> tuple[mx.array, mx.array]:
        """``(tokens [n], reference_logprobs [n])`` of ``forced_logprobs(first, logits, reference)``'s rows.

        Row i's greedy token and the log-probability of ``reference[i]``: ``argmax``
        and ``take_along_axis`` of those rows, with the same values. Without logits
        processors, the model's rows go through ``forced_choice`` (one native pass
        each) instead of a ``[n, V]`` log-softmax.
        """
        targets = mx.array(reference)
        if logits is not None and not self.processors:
            tokens, logprobs = forced_choice(logits, targets[1:])
            first_token, first_logprob = mx.argmax(first, axis=-1), first[:, reference[0]]
            return mx.concatenate([first_token, tokens]), mx.concatenate([first_logprob, logprobs])
        logprobs = self.forced_logprobs(first, logits, reference)
        return mx.argmax(logprobs, axis=-1), mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
