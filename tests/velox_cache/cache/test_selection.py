"""The window selector: rankings shared by the selectors that adopted one window, and only while nothing changed."""

import mlx.core as mx

from velox_cache.cache.selection import WindowSelector


def _window(seed: int) -> WindowSelector:
    selector = WindowSelector(window=4, kernel=1)
    selector.remember(mx.random.normal((1, 2, 4, 8), key=mx.random.key(seed)), first_position=12)
    return selector


def _keys():
    keys = mx.random.normal((1, 2, 16, 8), key=mx.random.key(7))
    return keys, mx.broadcast_to(mx.arange(16, dtype=mx.int32), (1, 2, 16))


def _two_adopting(source: WindowSelector) -> tuple:
    """Two selectors that adopted ``source``'s window, as two stacks cut from one reading do."""
    first, second = WindowSelector(4, 1), WindowSelector(4, 1)
    first.adopt(source)
    second.adopt(source)
    return first, second


def test_selectors_that_adopted_one_window_rank_alike_and_a_changed_one_ranks_its_own():
    keys = _keys()
    first, second = _two_adopting(_window(0))
    shared = first.scores(*keys)
    assert mx.array_equal(second.scores(*keys), shared).item()
    assert mx.array_equal(_window(0).scores(*keys), shared).item()  # what a selector of its own gives

    second.remember(mx.random.normal((1, 2, 4, 8), key=mx.random.key(1)), first_position=12)
    assert mx.array_equal(second.scores(*keys), _own_after_remember(keys)).item()
    assert not mx.array_equal(second.scores(*keys), shared).item()
    assert mx.array_equal(first.scores(*keys), shared).item()  # the others keep what they adopted


def _own_after_remember(keys):
    own = _window(0)
    own.remember(mx.random.normal((1, 2, 4, 8), key=mx.random.key(1)), first_position=12)
    return own.scores(*keys)


def test_a_ranking_taken_is_a_copy_its_taker_may_write_into():
    keys = _keys()
    first, second = _two_adopting(_window(0))
    taken = first.scores(*keys)
    expected = mx.array(taken)
    taken[..., :4] = 0.0
    assert mx.array_equal(second.scores(*keys), expected).item()
