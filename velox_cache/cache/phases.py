"""Prefill phases, told to the caches instead of guessed.

A prompt for a long-document job has parts that a cache should treat
differently: the document (read in chunks), the *probe* (the instruction that
follows the document, run on top of a chunk to rank tokens and then dropped,
in streaming prefill), the instruction itself, and decoding. Tell a cache
stack which one the next model calls belong to::

    from velox_cache import phases

    phases.tell(caches, "document")
    model(chunk, cache=caches)
    with phases.probe(caches):       # appended, scored, then dropped without a trace
        model(instruction, cache=caches)
    phases.tell(caches, "instruction")
    logits = model(instruction, cache=caches)
    with phases.look_ahead(caches):  # drafted tokens: their queries join the window, then dropped
        model(draft_token, cache=caches)
    phases.tell(caches, "decode")    # prefill ends here: prefill-end policies compress now

``velox_cache.stream_prefill`` does all of this for one prompt. A stack that is
never told a phase falls back to inferring the end of prefill from the first
single-token call (what ``mlx_lm.generate`` does with the prompt's last token);
once told, a single-token call is just a one-token chunk.

Caches that know nothing of phases (mlx-lm's own, for layers Velox does not
replace) are left alone, except that a probe must not stay in them: it is
trimmed off where the cache is trimmable, and refused where it is not. The
members of a hybrid layer's ``CacheList`` count as caches of their own.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Iterable, Optional

from mlx_lm.models.cache import KVCache


class Phase(str, enum.Enum):
    """What the next model calls on a cache stack are."""

    DOCUMENT = "document"
    PROBE = "probe"
    INSTRUCTION = "instruction"
    DECODE = "decode"

    @classmethod
    def parse(cls, value) -> "Phase":
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ValueError(f"phase: {value!r} is not one of {names}") from None


@dataclass(frozen=True)
class ProbeMark:
    """What a probe must give back: one layer's slots, buffer size, offset and tokens seen before it ran."""

    stored: int
    capacity: int
    offset: int
    tokens_seen: int

    @classmethod
    def of(cls, slots) -> "ProbeMark":
        """The mark of ``slots`` (a ``velox_cache.cache.slots.TokenSlots``) as they are now."""
        return cls(slots.stored, slots.capacity, slots.offset, slots.tokens_seen)

    def restore(self, slots) -> None:
        """Drop everything appended since the mark, exactly (spare slots zeroed as they were)."""
        if not slots.empty:
            slots.truncate(self.stored, self.capacity)
        slots.offset, slots.tokens_seen = self.offset, self.tokens_seen


PROBE, DRAFT, LOOK_AHEAD, RECONSTRUCTION = "probe", "draft", "look_ahead", "reconstruction"
PROBE_KINDS = (PROBE, DRAFT, LOOK_AHEAD, RECONSTRUCTION)  # calls that run on top of the prompt and are dropped after

PROMPT_SINGLES = 2  # single-token prompt calls mlx-lm can make after a chunk: a one-token remainder, the last token


class LayerPhase:
    """Where one layer's sequence is: prefilling or decoding, the phase told last, and a running probe."""

    def __init__(self):
        self.prefilling = True
        self.told: Optional[Phase] = None  # None: never told (the end of prefill is inferred)
        self.probe: Optional[ProbeMark] = None
        self.probe_kind = PROBE  # what the running probe is: PROBE, LOOK_AHEAD or RECONSTRUCTION
        self.probe_scores = None  # [B, H, held before the probe]: the probe's pooled ranking
        self.state_read = False  # the cache's ``state`` was read since its last call (``starts_decoding``)
        self.singles_since_chunk = 0  # single-token calls since the last multi-token one

    def starts_decoding(self, n_new: int, seen: int) -> bool:
        """Never told: does this call of ``n_new`` tokens, after ``seen`` tokens, start decoding?

        ``mlx_lm.generate_step`` feeds all but the prompt's last token in chunks
        (the last of them can be one token long), reading every cache's
        ``state`` after each, then the last token alone, then the generated
        tokens, with no read of the state in between. So a single-token call
        is still the prompt's when the state was read since the previous call
        (at most ``PROMPT_SINGLES`` in a row after a chunk: the one-token
        remainder and the last token), and the first generated token when it
        was not: prefill ends there, its selection seeing every prompt token,
        as when ``decode`` is told after the prompt. A caller that never reads
        the state starts decoding at its first single-token call; one that reads
        it after every call, at its third.
        """
        if n_new > 1:
            self.singles_since_chunk = 0
            self.state_read = False
            return False
        starts = (
            self.prefilling
            and self.told is None
            and seen > 0
            and (not self.state_read or self.singles_since_chunk >= PROMPT_SINGLES)
        )
        self.singles_since_chunk += 1
        self.state_read = False
        return starts

    @property
    def current(self) -> Optional[Phase]:
        """The phase told last (``PROBE`` while one runs); None when never told."""
        return Phase.PROBE if self.probe is not None else self.told

    @property
    def in_probe(self) -> bool:
        return self.probe is not None

    @property
    def in_prefill_chunk(self) -> bool:
        """A prefill call that is not a probe."""
        return self.prefilling and self.probe is None

    @property
    def in_document(self) -> bool:
        """A document chunk (or, never told, any prefill call)."""
        return self.probe is None and self.told in (None, Phase.DOCUMENT)

    @property
    def in_document_chunk(self) -> bool:
        """A prefill call of the document (streaming ranks what it held before each one)."""
        return self.in_prefill_chunk and self.in_document

    def tell(self, phase: Phase) -> bool:
        """The next calls belong to ``phase`` (not a probe); True when this ends prefill."""
        if phase is Phase.PROBE:
            raise ValueError("phase: a probe starts with start_probe")
        if phase is not Phase.DECODE and not self.prefilling:
            raise ValueError(f"phase: {phase.value!r} after decoding started; build a fresh cache stack per sequence")
        self.told = phase
        return phase is Phase.DECODE and self.prefilling

    def start_probe(self, mark: ProbeMark, kind: str = "probe") -> None:
        """A probe starts; ``mark`` is what it must give back. ``kind``: see ``PROBE_KINDS``."""
        if kind not in PROBE_KINDS:
            raise ValueError(f"kind: {kind!r} is not one of {', '.join(PROBE_KINDS)}")
        if not self.prefilling:
            raise ValueError("phase: a probe runs during prefill, not after decoding started")
        if self.probe is not None:
            raise ValueError("phase: a probe is already running; end it first")
        self.probe, self.probe_scores, self.probe_kind = mark, None, kind
        self.told = self.told or Phase.DOCUMENT

    def finish_probe(self) -> tuple:
        """The probe ends: ``(mark, its ranking or None)``."""
        mark, scores = self.probe, self.probe_scores
        self.probe = self.probe_scores = None
        self.probe_kind = PROBE
        return mark, scores

    @property
    def looking_ahead(self) -> bool:
        """A look-ahead runs: tokens drafted after the prompt, whose queries join the window."""
        return self.probe is not None and self.probe_kind == LOOK_AHEAD

    @property
    def reconstructing(self) -> bool:
        """A reconstruction runs: the document re-read after a request to repeat it (KVzip)."""
        return self.probe is not None and self.probe_kind == RECONSTRUCTION


def leaves(caches: Iterable) -> list:
    """Every cache of a stack, with the members of a ``CacheList`` (a hybrid layer) in its place."""
    found = []
    for cache in caches:
        members = getattr(cache, "caches", None)
        found.extend(members if isinstance(members, (list, tuple)) else [cache])
    return found


def knows_phases(cache) -> bool:
    """True for caches that take phases (every Velox eviction cache)."""
    return callable(getattr(cache, "begin_phase", None))


def tell(caches: Iterable, phase) -> None:
    """Tell every phase-aware cache in ``caches`` that the next calls belong to ``phase``."""
    phase = Phase.parse(phase)
    if phase is Phase.PROBE:
        raise ValueError("phase: use `with phases.probe(caches):` for a probe (it must be dropped afterwards)")
    for cache in leaves(caches):
        if knows_phases(cache):
            cache.begin_phase(phase)


def wants_probe(caches: Iterable) -> bool:
    """True when some cache in the stack ranks tokens by a probe (streaming timing)."""
    return any(getattr(cache, "uses_probes", False) for cache in leaves(caches))


def look_ahead_steps(caches: Iterable) -> int:
    """How many tokens to draft at the end of prefill: the most any cache asks for (its timing's ``lookahead``).

    None (0) where a cache of the stack could not drop the drafted tokens again: a layer Velox
    leaves alone that is not a plain growing ``KVCache`` (sliding-window ``RotatingKVCache``, whose
    buffer may wrap; state-space ``ArraysCache``). The look-ahead is off on such a model, as under
    plain ``mlx_lm.generate``, and an open ``kernel`` pools as it does without a draft.
    """
    stack = leaves(caches)
    if not all(knows_phases(c) or (_trimmable(c) and getattr(c, "max_size", None) is None) for c in stack):
        return 0
    return max((getattr(c, "lookahead", 0) or 0 for c in stack), default=0)


@contextlib.contextmanager
def probe(caches: list):
    """Run the block's model calls as a probe: scored, then dropped from every cache on exit.

    Velox caches rank their held tokens by the probe's attention (under the
    streaming timing), evict to budget and drop the probe's keys and values,
    restoring ``offset`` and the accounting. Other trimmable caches are
    trimmed back; a stack with a cache that can drop nothing is refused
    before anything runs.
    """
    with _dropped_afterwards(caches, PROBE) as stack:
        yield stack


@contextlib.contextmanager
def look_ahead(caches: list):
    """Run the block's model calls (tokens drafted after the prompt) as a look-ahead, dropped on exit.

    Like a probe, nothing the calls append stays; unlike one, their queries
    join the window that ranks the held tokens when prefill ends (Lookahead
    Q-Cache, SpecKV): the ranking sees what the answer's first tokens attend
    to. Nothing is evicted or scored meanwhile. Caches whose selection is not
    by a window only append and drop.
    """
    with _dropped_afterwards(caches, LOOK_AHEAD) as stack:
        yield stack


@contextlib.contextmanager
def drafting(caches: list):
    """Run the block's model calls (tokens drafted after the prompt) with nothing scored, and drop them on exit."""
    with _dropped_afterwards(caches, DRAFT) as stack:
        yield stack


def reconstructs(caches: Iterable) -> bool:
    """True when some cache in the stack ranks the prompt by reconstructing it (``selection: reconstruction``)."""
    return any(getattr(cache, "reconstructs", False) for cache in leaves(caches))


@contextlib.contextmanager
def reconstruction(caches: list):
    """Run the block's model calls (a request to repeat the document, then a piece of it) as a reconstruction.

    Like a probe, nothing the calls append stays; caches that rank by
    reconstruction (KVzip) keep, for every held token, the largest attention
    any of these queries paid it. Other caches only append and drop.
    """
    with _dropped_afterwards(caches, RECONSTRUCTION) as stack:
        yield stack


@contextlib.contextmanager
def _dropped_afterwards(caches: list, kind: str):
    stack = list(caches)
    for index, layer in enumerate(stack):
        for cache in leaves([layer]):
            if not knows_phases(cache) and not _trimmable(cache):
                raise TypeError(f"caches[{index}]: {type(cache).__name__} cannot drop a probe's tokens")
    members = leaves(stack)
    marks = [None if knows_phases(c) else _BufferMark.of(c) for c in members]
    for cache in members:
        if knows_phases(cache):
            cache.begin_probe(kind)
    try:
        yield stack
    finally:
        for cache, mark in zip(members, marks):
            if knows_phases(cache):
                cache.end_probe()
            else:
                mark.restore(cache)


@dataclass(frozen=True)
class _BufferMark:
    """What a cache that knows no phases must give back: its offset and, for mlx-lm's ``KVCache``, its buffer.

    Trimming moves the offset back; a ``KVCache``'s buffer is also cut to its
    size before and the dropped slots zeroed, so that it is array for array
    what it was (mlx-lm allocates its spare slots as zeros).
    """

    offset: int
    capacity: Optional[int]

    @classmethod
    def of(cls, cache) -> "_BufferMark":
        keys = getattr(cache, "keys", None) if isinstance(cache, KVCache) else None
        return cls(cache.offset, None if keys is None else keys.shape[2])

    def restore(self, cache) -> None:
        if cache.offset > self.offset:
            cache.trim(cache.offset - self.offset)
        if self.capacity is None or cache.keys is None:
            return
        for name in ("keys", "values"):
            buffer = getattr(cache, name)[..., : self.capacity, :]
            buffer[..., self.offset :, :] = 0
            setattr(cache, name, buffer)


def _trimmable(cache) -> bool:
    check = getattr(cache, "is_trimmable", None)
    return bool(check and check()) and hasattr(cache, "trim")
