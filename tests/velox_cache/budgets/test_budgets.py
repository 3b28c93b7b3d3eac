"""Table-driven tests of the pure budget allocators."""

import pytest

from velox_cache import pyramid_budgets, squeeze_budgets
from velox_cache.budgets.schedules import fit_budgets


@pytest.mark.parametrize(
    "n_layers, avg, n_sink, beta",
    [(30, 256, 4, 3.0), (30, 512, 4, 20.0), (4, 64, 4, 2.0), (7, 10, 4, 5.0), (1, 100, 4, 3.0), (30, 5, 4, 8.0)],
)
def test_pyramid_invariants(n_layers, avg, n_sink, beta):
    budgets = pyramid_budgets(n_layers, avg, n_sink, beta)
    assert len(budgets) == n_layers
    assert all(isinstance(b, int) for b in budgets)
    assert sum(budgets) == avg * n_layers
    assert min(budgets) >= n_sink + 1
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))


@pytest.mark.parametrize(
    "n_layers, avg, beta, expected",
    [
        (4, 100, 1.0, [100, 100, 100, 100]),
        (3, 100, 3.0, [150, 100, 50]),
        (2, 60, 2.0, [80, 40]),
    ],
)
def test_pyramid_values(n_layers, avg, beta, expected):
    assert pyramid_budgets(n_layers, avg, 4, beta) == expected


def test_pyramid_floor_takes_from_the_early_layers():
    budgets = pyramid_budgets(4, 10, n_sink=4, beta=20.0)
    assert budgets[-1] == 5 and sum(budgets) == 40


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n_layers=0, avg=10), "n_layers"),
        (dict(n_layers=4, avg=4, n_sink=4), "avg"),
        (dict(n_layers=4, avg=10, beta=0.5), "beta"),
        (dict(n_layers=4, avg=10, n_sink=-1), "n_sink"),
    ],
)
def test_pyramid_rejects_bad_input(kwargs, field):
    with pytest.raises(ValueError, match=field):
        pyramid_budgets(**kwargs)


@pytest.mark.parametrize(
    "concentrations, avg, strength",
    [
        ([0.9, 0.1, 0.5, 0.5], 64, 0.5),
        ([0.0] * 30, 256, 1.0),
        ([1.0, 0.0, 1.0, 0.0], 10, 1.0),
        ([0.2, 0.95, 0.4], 7, 0.8),
    ],
)
def test_squeeze_invariants(concentrations, avg, strength):
    budgets = squeeze_budgets(concentrations, avg, 4, strength)
    assert sum(budgets) == avg * len(concentrations)
    assert min(budgets) >= 5
    broad_first = sorted(range(len(budgets)), key=lambda i: concentrations[i])
    assert all(budgets[a] >= budgets[b] for a, b in zip(broad_first, broad_first[1:]))


def test_squeeze_strength_zero_is_uniform():
    assert squeeze_budgets([0.9, 0.1, 0.5], 100, 4, strength=0.0) == [100, 100, 100]


def test_squeeze_moves_budget_from_concentrated_to_broad_layers():
    budgets = squeeze_budgets([0.9, 0.1], 100, 4, strength=0.5)
    assert budgets[1] > 100 > budgets[0]


def test_squeeze_equal_concentrations_are_uniform():
    assert squeeze_budgets([0.3] * 5, 50, 4, 1.0) == [50] * 5


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(concentrations=[0.5], avg=10, strength=1.5), "strength"),
        (dict(concentrations=[], avg=10), "n_layers"),
        (dict(concentrations=[0.5], avg=3, n_sink=4), "avg"),
    ],
)
def test_squeeze_rejects_bad_input(kwargs, field):
    with pytest.raises(ValueError, match=field):
        squeeze_budgets(**kwargs)


# ----- fit_budgets: budgets that fit one prompt ------------------------------------------

PYRAMID_128 = pyramid_budgets(30, 128)


@pytest.mark.parametrize(
    "budgets, prompt, new, expected",
    [
        ([100, 60, 20], 50, 10, [60, 60, 60]),  # short prompt, tall budgets: each holds what it can, total drops
        ([150, 100, 50], 200, 20, [150, 100, 50]),  # a long prompt: nothing to fit
        ([150, 100, 50], 90, 30, [120, 90, 90]),  # prompt <= mean: every layer keeps it whole, the top pays
        ([200, 100, 60], 130, 50, [180, 113, 67]),  # the cap frees 20, the others take it in proportion
        ([128, 128], 100, None, [128, 128]),  # unknown new tokens: no cap
        ([128, 128], 300, None, [128, 128]),
    ],
)
def test_fit_budgets_values(budgets, prompt, new, expected):
    assert fit_budgets(budgets, prompt, new) == expected


@pytest.mark.parametrize("prompt", [20, 64, 110, 128, 150, 170, 292, 1000])
@pytest.mark.parametrize("new", [0, 40, None])
def test_fit_budgets_keeps_the_total_and_the_order_and_caps_every_layer(prompt, new):
    fitted = fit_budgets(PYRAMID_128, prompt, new)
    cap = float("inf") if new is None else prompt + new
    assert all(isinstance(b, int) for b in fitted)
    assert max(fitted) <= cap
    assert sum(fitted) == min(sum(PYRAMID_128), 30 * cap)
    assert all(a >= b for a, b in zip(fitted, fitted[1:]))
    if prompt <= 128:  # the prompt fits the budget: no layer compresses it
        assert min(fitted) >= min(prompt, cap)
    else:  # no layer loses budget it could use
        assert all(f >= min(b, cap) for f, b in zip(fitted, PYRAMID_128))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(budgets=[10, 0], prompt_tokens=5), "budgets"),
        (dict(budgets=[10, 2.5], prompt_tokens=5), "budgets"),
        (dict(budgets=[10], prompt_tokens=-1), "prompt_tokens"),
        (dict(budgets=[10], prompt_tokens=5, new_tokens=-2), "new_tokens"),
    ],
)
def test_fit_budgets_rejects_bad_input(kwargs, field):
    with pytest.raises(ValueError, match=field):
        fit_budgets(**kwargs)
