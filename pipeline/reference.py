"""The full cache's output as compressed variants are compared with it: pure data, no MLX.

``Reference`` is what teacher forcing feeds; ``rounded_logprobs`` is the one place
log-probabilities are rounded, both for the store (``output_logprobs``) and for a
reference made in the same work item, so a reference read back from the store and
one made alongside are the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

LOGPROB_DECIMALS = 6  # output log-probabilities as stored (and fed to teacher forcing)


def rounded_logprobs(logprobs: Iterable[float]) -> list[float]:
    """Log-probabilities as the store keeps them (``LOGPROB_DECIMALS`` decimals)."""
    return [round(p, LOGPROB_DECIMALS) for p in logprobs]


@dataclass
class Reference:
    """The full cache's output for the same prompt: token ids and their log-probabilities."""

    token_ids: list[int]
    logprobs: list[float]

    @classmethod
    def of_output(cls, token_ids: Iterable[int], logprobs: Iterable[float]) -> "Reference":
        """A freshly generated output as teacher forcing feeds it, exactly as the store keeps it."""
        return cls(list(token_ids), rounded_logprobs(logprobs))
