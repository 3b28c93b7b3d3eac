"""Per-layer budget allocators: pure functions, lists in, ints out.

``pyramid_budgets`` and ``squeeze_budgets`` keep the mean budget exactly at
``avg`` and never go below ``n_sink + 1``; ``fit_budgets`` then fits any
schedule to one prompt at the same total.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence


def _allocate(weights: Sequence[float], avg: int, floor: int) -> list[int]:
    """Integer budgets proportional to ``weights``, each at least ``floor``, summing to ``avg * n``.

    Budgets are ``max(floor, c * w)`` with ``c`` found by bisection, then rounded
    down; the remainder goes one token each to the largest weights first, so the
    order of the weights is preserved (equal weights get equal or adjacent budgets).
    """
    n = len(weights)
    total = avg * n
    if any(w < 0 for w in weights):
        raise ValueError("weights must be non-negative")
    if sum(weights) == 0:
        weights = [1.0] * n
    low, high = 0.0, float(total) / min(w for w in weights if w > 0)
    for _ in range(100):
        mid = (low + high) / 2
        if sum(max(floor, mid * w) for w in weights) > total:
            high = mid
        else:
            low = mid
    exact = [max(floor, low * w) for w in weights]
    budgets = [int(b) for b in exact]
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    for i in order[: total - sum(budgets)]:
        budgets[i] += 1
    return budgets


def _check_common(n_layers: int, avg: int, n_sink: int) -> None:
    if n_layers < 1:
        raise ValueError(f"n_layers: must be at least 1, got {n_layers}")
    if n_sink < 0:
        raise ValueError(f"n_sink: must be at least 0, got {n_sink}")
    if avg < n_sink + 1:
        raise ValueError(f"avg: must be at least n_sink + 1 = {n_sink + 1}, got {avg}")


def pyramid_budgets(n_layers: int, avg: int, n_sink: int = 4, beta: float = 3.0) -> list[int]:
    """A linear taper of per-layer budgets, large early and small deep.

    ``beta`` is the ratio of the first layer's budget to the last one's before
    the floor applies (``beta=1``: flat). The result is non-increasing, has mean
    exactly ``avg`` and no value below ``n_sink + 1``.
    """
    _check_common(n_layers, avg, n_sink)
    if beta < 1:
        raise ValueError(f"beta: must be at least 1, got {beta}")
    if n_layers == 1:
        return [avg]
    weights = [beta - (beta - 1) * i / (n_layers - 1) for i in range(n_layers)]
    return _allocate(weights, avg, n_sink + 1)


def squeeze_budgets(
    concentrations: Sequence[float], avg: int, n_sink: int = 4, strength: float = 0.5
) -> list[int]:
    """Move budget from layers whose attention is concentrated to layers whose attention is broad.

    ``concentrations`` holds one score per layer in [0, 1] (1 = all attention on
    one token). A layer's weight is ``(1 - strength) + strength * broadness /
    mean(broadness)`` with ``broadness = 1 - concentration``; ``strength=0``
    gives uniform budgets. The mean is exactly ``avg``; the floor is ``n_sink + 1``.
    """
    _check_common(len(concentrations), avg, n_sink)
    if not 0 <= strength <= 1:
        raise ValueError(f"strength: must be between 0 and 1, got {strength}")
    broadness = [1.0 - min(1.0, max(0.0, float(c))) for c in concentrations]
    mean = sum(broadness) / len(broadness)
    if mean == 0 or strength == 0:
        weights = [1.0] * len(broadness)
    else:
        weights = [(1 - strength) + strength * b / mean for b in broadness]
    return _allocate(weights, avg, n_sink + 1)


def squeeze_budget_cap(n_layers: int, avg: int, strength: float) -> int:
    """The largest budget ``squeeze_budgets`` can give any layer (before rounding up by one)."""
    return int(avg * ((1 - strength) + strength * n_layers)) + 1


def fit_budgets(budgets: Sequence[int], prompt_tokens: int, new_tokens: Optional[int] = None) -> list[int]:
    """``budgets`` fitted to one prompt: no layer gets more than it can hold, at the same total.

    A layer holds at most ``prompt_tokens + new_tokens`` tokens (the prompt and
    what will be generated; no cap when ``new_tokens`` is None): budget above
    that would sit unused, so it goes to the layers below the cap, in
    proportion to their budgets. A prompt no longer than the mean budget is
    compressed by no layer: each keeps at least the whole prompt, the layers
    above paying for it in proportion. Otherwise no layer gets less than it
    had. Budgets are ``clamp(c * budget, low, cap)`` with ``c`` found by
    bisection, rounded so that the total stays; it drops only when every
    layer is at the cap. The order of the budgets is kept.
    """
    n = len(budgets)
    if n == 0:
        return []
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in budgets):
        raise ValueError(f"budgets: expected positive integers, got {list(budgets)}")
    if prompt_tokens < 0 or (new_tokens is not None and new_tokens < 0):
        raise ValueError(f"prompt_tokens, new_tokens: must not be negative, got {prompt_tokens}, {new_tokens}")
    total = sum(budgets)
    cap = math.inf if new_tokens is None else max(1, prompt_tokens + new_tokens)
    if n * cap <= total:
        return [int(cap)] * n
    low = prompt_tokens if prompt_tokens * n <= total else min(budgets)

    def fitted(scale: float) -> list[float]:
        return [min(cap, max(low, scale * b)) for b in budgets]

    bottom, top = 0.0, float(total)
    for _ in range(100):
        middle = (bottom + top) / 2
        if sum(fitted(middle)) > total:
            top = middle
        else:
            bottom = middle
    exact = fitted(bottom)
    result = [int(b) for b in exact]
    order = sorted(range(n), key=lambda i: (-budgets[i], i))
    short = total - sum(result)
    for i in order:
        if short <= 0:
            break
        if result[i] < cap:
            result[i] += 1
            short -= 1
    return result
