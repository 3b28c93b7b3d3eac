"""``TokenChoice``: how one sequence picks its next token, through mlx-lm's own samplers.

The job spec's ``generation`` section names mlx-lm's sampling settings
(``temperature``, ``top_p``, ``min_p``, ``top_k``) and its repetition penalty
(``repetition_penalty`` over the last ``repetition_context_size`` tokens). As
in ``mlx_lm.generate_step``, the logits processors see the prompt and every
token generated so far, and the log-probabilities recorded and sampled from
are those after the processors.
"""

from __future__ import annotations

from typing import Iterable

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities (float32) from logits ``[..., V]``."""
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class TokenChoice:
    """mlx-lm's sampler and logits processors for one sequence, with its token history."""

    def __init__(self, settings, prompt_tokens: Iterable[int]):
        self.sampler = make_sampler(
            temp=settings.temperature, top_p=settings.top_p, min_p=settings.min_p, top_k=settings.top_k
        )
        self.processors = make_logits_processors(
            repetition_penalty=settings.repetition_penalty, repetition_context_size=settings.repetition_context_size
        )
        self.context_size = settings.repetition_context_size  # the processors read no further back
        self.prompt = list(prompt_tokens)
        self.history = list(self.prompt)  # the prompt, then every token generated

    def logprobs(self, logits: mx.array, history=None) -> mx.array:
        """Log-probabilities ``[1, V]`` of the next token after ``history`` (default: this sequence's)."""
        if self.processors:
            logits = logits.astype(mx.float32)
            tokens = mx.array((self.history if history is None else history)[-self.context_size :])
            for processor in self.processors:
                logits = processor(tokens, logits)
        return log_softmax(logits)

    def choose(self, logprobs: mx.array) -> int:
        """The next token, sampled from ``logprobs``."""
        return self.sampler(logprobs).item()

    def accept(self, token: int) -> None:
        """``token`` was generated: the processors see it from now on."""
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
