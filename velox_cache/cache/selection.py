"""Selectors: rank held tokens by the attention of chosen queries, pooled over neighbours.

Two choices use them. At the end of prefill (SnapKV, PyramidKV) the prompt's
last ``window`` queries rank every held token (with a reconstruction, KVzip:
the largest attention any of them or of the re-read document paid it). In streaming prefill the
*probe* (the instruction that follows the document, run on top of each chunk
and then dropped) ranks every held and new token with all of its queries.
Both max-pool the mass over ``kernel`` neighbouring slots, so that a fact
split into several tokens (six digits) survives whole.

Where the remembered queries and the held keys cannot reproduce the window's
attention (keys derived from the stored ones, as in multi-head latent
attention; an additive position mask; attention sinks), the window's
attention is kept as it was computed instead (``remember_attention``).

``blend_with_mass`` mixes a window's or probe's ranking with the held tokens'
cumulative attention mass (``KVCacheConfig.mass_weight``).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..config import LOOKAHEAD_KERNEL, POOLED_KERNEL
from ..kernels import attention
from ..kernels.attend import attend_and_score
from .signals import fold_heads


def pooled_mass(probs: mx.array, kernel: int) -> mx.array:
    """Attention mass per key ``[B, H, N]`` of ``probs`` ``[B, H, R, S, N]``, max-pooled over ``kernel``."""
    return attention.max_pool(attention.key_mass(probs), kernel)


class WindowSelector:
    """Remembers the latest ``window`` queries (or proxy keys) and ranks held keys by their pooled attention.

    Selectors that adopted one source's window (``adopt``: one layer of every stack cut
    from a shared reading) share the rankings it gives until any of them remembers,
    keeps or clears anything: a layer's ranking does not depend on its budget, so
    every budget of a policy cut from one reading ranks once.
    """

    _derived = ("_rankings",)  # a memo (shared with adopted selectors); a restored selector ranks anew

    def __init__(self, window: int, kernel: Optional[int]):
        self.window = window
        self.kernel = kernel  # None: ``pooling`` decides by whether a draft joined the window
        self.extra = 0  # rows kept beyond ``window``: a look-ahead's drafted queries (``widen``)
        self.peak: Optional[mx.array] = None  # [B, H, N]: a reconstruction's largest attention per key (KVzip)
        self.queries: Optional[mx.array] = None  # [B, H*R, W, D]
        self.positions: Optional[mx.array] = None  # [W], the position of each query
        self.mass: Optional[mx.array] = None  # [B, H, W, N]: each window row's attention, kept as computed
        self._rankings: Optional[dict] = None  # what ``scores`` gave, shared by the selectors of one adopted window

    @property
    def arrays(self) -> list:
        return [a for a in (self.queries, self.positions, self.mass, self.peak) if a is not None]

    @property
    def ready(self) -> bool:
        return self.queries is not None or self.mass is not None

    @property
    def pooling(self) -> int:
        """The kernel that pools the ranking: ``kernel``, or where open 1 once a look-ahead widened the window, else 31."""
        if self.kernel is not None:
            return self.kernel
        return LOOKAHEAD_KERNEL if self.extra else POOLED_KERNEL

    @property
    def rows(self) -> int:
        """How many of the latest queries are kept: the window and any look-ahead beyond it."""
        return self.window + self.extra

    def clear(self) -> None:
        self.queries = self.positions = self.mass = self.peak = None
        self.extra = 0
        self._changed()

    def _changed(self) -> None:
        """What this selector remembers is its own from now on: rankings are no longer shared."""
        self._rankings = None

    def remember_peak(self, peak: mx.array) -> None:
        """Fold a reconstruction call's largest attention per held key ``[B, H, N]`` into the running maximum."""
        self.peak = peak if self.peak is None else mx.maximum(self.peak, peak)
        self._changed()

    def widen(self, rows: int) -> None:
        """Keep ``rows`` more queries from now until ``clear``: drafted ones, added after the prompt's window."""
        self.extra += rows
        self._changed()

    def adopt(self, other: "WindowSelector") -> None:
        """Remember what ``other`` remembers (same ``window`` and ``kernel``), sharing no array with it
        (its rankings are shared, until either changes: see the class doc)."""
        if (other.window, other.kernel) != (self.window, self.kernel):
            raise ValueError(f"window, kernel: {other.window}, {other.kernel} read, {self.window}, {self.kernel} asked")
        for name in ("queries", "positions", "mass", "peak"):
            value = getattr(other, name)
            setattr(self, name, None if value is None else mx.array(value))
        self.extra = other.extra
        if other._rankings is None:
            other._rankings = {}
        self._rankings = other._rankings

    def remember(self, queries: mx.array, first_position: int) -> None:
        """Add a call's queries ``[B, H*R, S, D]`` at positions ``first_position ..``; keep the last ``window``."""
        self.mass = None
        self._changed()
        window = self.rows
        n_new = queries.shape[2]
        positions = mx.arange(first_position, first_position + n_new, dtype=mx.int32)
        if self.queries is None or n_new >= window:
            self.queries = queries[:, :, -window:]
            self.positions = positions[-window:]
        else:
            self.queries = mx.concatenate([self.queries, queries], axis=2)[:, :, -window:]
            self.positions = mx.concatenate([self.positions, positions])[-window:]

    def remember_attention(self, queries, keys, scale, mask, sinks, heads: int) -> None:
        """Keep the attention the call's last ``window`` queries paid each key, as computed, on ``heads`` heads."""
        rows = min(self.rows, queries.shape[2])
        row_mask = mask
        if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] > 1:
            row_mask = mask[..., -rows:, :]
        probs = attention.attention_probs(queries[:, :, -rows:], keys, scale, row_mask, sinks)  # [B, H', R, rows, N]
        self.remember_mass(fold_heads(probs.sum(axis=2), heads))

    def remember_mass(self, row_mass: mx.array) -> None:
        """Add a call's last rows' attention ``[B, H, rows, N]`` (N: the keys it saw); keep the last ``window``.

        Earlier rows never saw this call's keys: they get zero mass there.
        """
        self.queries = self.positions = None
        self._changed()
        if self.mass is not None and row_mass.shape[2] < self.rows:
            earlier = _pad_keys(self.mass, row_mass.shape[-1])
            row_mass = mx.concatenate([earlier, row_mass], axis=2)
        self.mass = row_mass[:, :, -self.rows :]

    def keep(self, indices: mx.array, n_slots: int) -> None:
        """The ``n_slots`` held slots became ``indices`` ``[B, H, K]`` of them: keep the kept mass in step."""
        self._changed()
        if self.peak is not None:
            self.peak = mx.take_along_axis(_pad_keys(self.peak, n_slots), indices, axis=-1)
        if self.mass is None:
            return
        mass = _pad_keys(self.mass, n_slots)  # [B, H, W, n_slots]
        index = mx.broadcast_to(indices[:, :, None], (*mass.shape[:3], indices.shape[-1]))
        self.mass = mx.take_along_axis(mass, index, axis=-1)

    def scores(
        self, keys: mx.array, key_positions: mx.array, *, scale: Optional[float] = None, slots=None
    ) -> mx.array:
        """SnapKV: the remembered queries' attention on ``keys`` ``[B, H, N, D]``, max-pooled ``[B, H, N]``.

        A query sees the keys at or before its own position (``key_positions``
        ``[B, H, N]``). ``scale`` is the softmax scale of the remembered
        queries (default ``D ** -0.5``). ``slots`` (the ``TokenSlots`` that
        hold ``keys``) says which keys each query head sees and pools by head
        where the layer's heads share one buffer (per-head budgets). Attention
        kept as computed is used as it is. Shared with the selectors that adopted
        the same window, for the same keys (see the class doc).
        """
        if self._rankings is None:
            return self._scores(keys, key_positions, scale, slots)
        asked = (tuple(keys.shape), scale, self.pooling, None if slots is None else type(slots).__name__)
        if asked not in self._rankings:
            self._rankings[asked] = self._scores(keys, key_positions, scale, slots)
        return mx.array(self._rankings[asked])  # a copy: whoever takes it may write into it

    def _scores(self, keys: mx.array, key_positions: mx.array, scale: Optional[float], slots) -> mx.array:
        pool = attention.max_pool if slots is None else slots.pool
        if self.peak is not None:
            return pool(self._peaks(keys, key_positions, scale), self.pooling)
        if self.mass is not None:
            mass = _pad_keys(self.mass, keys.shape[2])[..., : keys.shape[2]]
            return pool(mass.sum(axis=2), self.pooling)
        n_q_heads, n_queries = self.queries.shape[1], self.queries.shape[2]
        visible = self._visible(keys, key_positions)
        heads_see = None if slots is None else slots.heads_see(n_q_heads)
        if heads_see is not None:
            visible = visible & heads_see
        scale = keys.shape[-1] ** -0.5 if scale is None else scale
        # as the window's own attention is computed: Velox's kernel where it runs, else a precise softmax
        mass = attend_and_score(self.queries, keys, None, scale=scale, mask=visible, score_rows=n_queries).key_mass
        return pool(mass, self.pooling)

    def _visible(self, keys: mx.array, key_positions: mx.array) -> mx.array:
        """``[B, H*R, W, N]``: which of ``keys`` (at ``key_positions`` ``[B, H, N]``) each remembered query sees."""
        batch, n_q_heads, n_queries, _ = self.queries.shape
        visible = key_positions[:, :, None, None, :] <= self.positions[None, None, None, :, None]  # [B, H, 1, W, N]
        group = n_q_heads // keys.shape[1]
        visible = mx.broadcast_to(visible, (*visible.shape[:2], group, *visible.shape[3:]))
        return visible.reshape(batch, n_q_heads, n_queries, keys.shape[2])

    def _peaks(self, keys: mx.array, key_positions: mx.array, scale: Optional[float]) -> mx.array:
        """KVzip: the largest attention the reconstruction or any window query paid each key ``[B, H, N]``."""
        n_keys = keys.shape[2]
        peak = _pad_keys(self.peak, n_keys)[..., :n_keys]
        if self.mass is not None:
            window = _pad_keys(self.mass, n_keys)[..., :n_keys].max(axis=2)
        elif self.queries is not None:
            scale = keys.shape[-1] ** -0.5 if scale is None else scale
            window = attention.key_peak(self.queries, keys, scale, self._visible(keys, key_positions))
        else:
            return peak
        return mx.maximum(peak, window)

    def probe_scores(self, key_mass: mx.array, n_keys: int, slots=None) -> mx.array:
        """The probe's attention mass ``[B, H, N]`` on the first ``n_keys`` keys (the non-probe ones), pooled.

        ``slots``: the ``TokenSlots`` the keys are in (they pool by head where heads share one buffer).
        """
        pool = attention.max_pool if slots is None else slots.pool
        return pool(key_mass[..., :n_keys], self.pooling)


def blend_with_mass(ranking: mx.array, mass: mx.array, weight: float) -> mx.array:
    """``ranking`` ``[B, H, held]`` blended with the held tokens' cumulative ``mass`` by ``weight``.

    Both are normalised per head first; the blend keeps ``ranking``'s total,
    so that decoding's attention mass adds to it on the same scale.
    """
    if not weight:
        return ranking
    total = ranking.sum(axis=-1, keepdims=True)
    return total * ((1 - weight) * _per_head_share(ranking) + weight * _per_head_share(mass))


def _per_head_share(scores: mx.array) -> mx.array:
    """``scores`` ``[B, H, N]`` divided by each head's total (a head with none stays zero)."""
    return scores / mx.maximum(scores.sum(axis=-1, keepdims=True), 1e-30)


def _pad_keys(mass: mx.array, n_keys: int) -> mx.array:
    """``mass`` ``[..., N]`` with zero mass for keys ``N .. n_keys - 1``."""
    pad = n_keys - mass.shape[-1]
    return mx.pad(mass, [(0, 0)] * (mass.ndim - 1) + [(0, pad)]) if pad > 0 else mass
