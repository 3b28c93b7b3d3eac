"""``PolicyChoices``: a config's open fields resolved against a policy's defaults, once per cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class PolicyChoices:
    """What one layer does, with every default filled in.

    Attributes:
        eviction: ``continuous``, ``prefill_end`` or ``streaming`` (the timing).
        selection: what ranks tokens at the end of prefill, ``cumulative`` or ``window``
            (streaming always ranks by a window or a probe).
        mass_weight: share of cumulative mass blended into a window's or probe's ranking.
        head_budgets: ``uniform`` or ``adaptive`` (one selection over the layer's heads).
        kernel: the pooling of the window's (or a probe's) ranking under this timing: the
            config's ``stream_kernel`` under ``streaming``, its ``kernel`` otherwise (None: 1 where a
            look-ahead's draft joins the window, else 31; ``WindowSelector.pooling``).
        lookahead: tokens drafted when the prompt ends under this timing (``stream_lookahead``
            or ``lookahead``, likewise).
    """

    eviction: str
    selection: str
    mass_weight: float
    head_budgets: str = "uniform"
    kernel: Optional[int] = None
    lookahead: int = 0

    @classmethod
    def resolve(cls, policy, config) -> "PolicyChoices":
        """``config``'s choices, where it leaves one open the ``policy`` class's default."""
        eviction = config.eviction or policy.default_eviction
        selection = config.selection or ("window" if eviction == "streaming" else policy.default_selection)
        mass_weight = policy.default_mass_weight(eviction) if config.mass_weight is None else config.mass_weight
        head_budgets = config.head_budgets or policy.default_head_budgets(eviction)
        streams = eviction == "streaming"
        kernel = config.stream_kernel if streams else config.kernel
        lookahead = config.stream_lookahead if streams else config.lookahead
        return cls(eviction, selection, mass_weight, head_budgets, kernel, lookahead)
