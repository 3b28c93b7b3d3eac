"""How the job runner picks tokens: ``velox_cache.generation.sampling.TokenSampler`` built from the spec's ``generation``.

The job spec's ``generation`` section names mlx-lm's sampling settings
(``temperature``, ``top_p``, ``min_p``, ``top_k``, ``seed``) and its repetition
penalty (``repetition_penalty`` over the last ``repetition_context_size``
tokens); ``velox_cache.generation.sampling`` applies them through mlx-lm's own samplers
and logits processors.
"""

from __future__ import annotations

from typing import Iterable

from velox_cache.generation.sampling import TokenSampler, log_softmax

__all__ = ["TokenChoice", "log_softmax"]


def TokenChoice(settings, prompt_tokens: Iterable[int]) -> TokenSampler:
    """One sequence's sampler for a ``GenerationSpec`` and its prompt."""
    return TokenSampler.from_settings(settings, prompt_tokens)
