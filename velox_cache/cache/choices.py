"""``PolicyChoices``: a config's open fields resolved against a policy's defaults, once per cache."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyChoices:
    """What one layer does, with every default filled in.

    Attributes:
        eviction: ``continuous``, ``prefill_end`` or ``streaming`` (the timing).
        selection: what ranks tokens at the end of prefill, ``cumulative`` or ``window``
            (streaming always ranks by a window or a probe).
        mass_weight: share of cumulative mass blended into a window's or probe's ranking.
        head_budgets: ``uniform`` or ``adaptive`` (one selection over the layer's heads).
    """

    eviction: str
    selection: str
    mass_weight: float
    head_budgets: str = "uniform"

    @classmethod
    def resolve(cls, policy, config) -> "PolicyChoices":
        """``config``'s choices, where it leaves one open the ``policy`` class's default."""
        eviction = config.eviction or policy.default_eviction
        selection = config.selection or ("window" if eviction == "streaming" else policy.default_selection)
        mass_weight = policy.default_mass_weight(eviction) if config.mass_weight is None else config.mass_weight
        head_budgets = config.head_budgets or policy.default_head_budgets(eviction)
        return cls(eviction, selection, mass_weight, head_budgets)
