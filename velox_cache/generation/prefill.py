"""``prefill_phases``: feed one prompt to a cache stack part by part, telling each phase.

A prompt is a ``prefix`` (system message, chat header), a ``document`` and an
``instruction`` (what the job asks, after the document, with the chat
template's tail). The document is read in chunks of ``chunk_size``. Under the
streaming timing (FINCH) the instruction also runs as a *probe* on top of
every chunk but the last: its queries rank the held and new tokens, each
layer evicts to its budget (times ``stream_headroom``, 1 by default) and the
probe is dropped without a trace. The last chunk needs no probe: the
instruction itself follows, and its queries rank what is held when decoding
starts, evicting to the budget itself. Per layer, held keys never exceed
budget x headroom + chunk + probe, and every chunk attends to at most that
many keys, so prefill time grows linearly with the document.

Positions: original positions are kept while the prompt fits the model's
context. When the next chunk and its probe, or the instruction and the
tokens to generate, would run past it, every layer re-rotates its held keys
to contiguous positions (``compact_positions``) and reading goes on, so a
document longer than the context can be read at all.

With no instruction (a ready-made prompt) the whole prompt is the document:
streaming caches then rank each chunk by its own last queries (SnapKV per
chunk) just before the next chunk arrives.
"""

from __future__ import annotations

from typing import Callable, Collection, Optional, Sequence

import mlx.core as mx

from ..cache import phases
from ..cache.phases import Phase
from ..kernels.rope import RotaryShift


class ContextError(ValueError):
    """The prompt cannot be read within the model's context, even re-rotated."""


CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def model_context(model) -> Optional[int]:
    """The number of positions the model was trained for, from its config; None if it does not say.

    mlx-lm models keep their config as ``model.args``; llama-style configs name it
    ``max_position_embeddings``, others one of ``CONTEXT_FIELDS``.
    """
    args = getattr(model, "args", None)
    for name in CONTEXT_FIELDS:
        value = getattr(args, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def prefill_phases(
    model,
    caches: list,
    *,
    document: Sequence[int],
    instruction: Sequence[int] = (),
    prefix: Sequence[int] = (),
    chunk_size: int = 256,
    max_new_tokens: int = 0,
    context_length: Optional[int] = None,
    after_call: Optional[Callable[[str, list], None]] = None,
    tell_decode: bool = True,
    stop_tokens: Collection[int] = (),
    repeat: Sequence[int] = (),
    drafts_after: bool = True,
    last_alone: bool = False,
) -> mx.array:
    """Prefill ``prefix + document + instruction`` into ``caches``; returns the last position's logits ``[1, V]``.

    Tells the caches each phase (document chunks, probes, the instruction,
    then ``decode``, which ends prefill), so the caller decodes next with the
    same ``caches``. ``context_length`` defaults to the model's;
    ``max_new_tokens`` is kept free of it. ``after_call(event, caches)`` runs
    after every model call (``"document"``, ``"probe"``, ``"instruction"``),
    after every probe is dropped (``"probe_dropped"``) and once the prompt's
    last logits are evaluated (``"read"``: what follows is drafting, if any),
    for progress, checks and clocks. ``tell_decode=False`` stops before telling ``decode``: prefill has
    not ended (``velox_cache.generation.reading`` cuts stacks from it first).
    ``last_alone``: the prompt's last token runs in a call of its own after the
    chunks before it, as ``mlx_lm.generate_step`` feeds a prompt
    (``velox_cache.batch_generate`` equals it so).

    Where a cache's config asks for a ``lookahead``, that many tokens are
    drafted greedily after the prompt (``draft``; ``stop_tokens`` end the draft
    early), then fed again in one call whose queries join the window that
    ranks the prompt when prefill ends (``look_ahead``), and dropped.
    ``after_call`` sees ``"draft"`` when the draft is made, then ``"look_ahead"``. ``drafts_after=False`` leaves
    that to the caller (a shared reading feeds the full variant's own output).
    Where a cache ranks by ``reconstruction`` (KVzip), the document is then
    re-read piece by piece (``reconstruct``), each piece after ``repeat`` (the
    tokens that ask the model to repeat it), and dropped; ``after_call`` sees
    ``"reconstruction"`` after each piece.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size: must be at least 1, got {chunk_size}")
    body = list(prefix) + list(document)
    instruction = list(instruction)
    if not body and not instruction:
        raise ValueError("document: the prompt is empty")
    caches = list(caches)
    probe = instruction if instruction and phases.wants_probe(caches) else []
    positions = _Positions(model, caches, context_length)
    notify = after_call or (lambda event, stack: None)

    phases.tell(caches, Phase.DOCUMENT)
    logits = None
    chunks = _chunks(body, chunk_size, last_alone and not instruction)
    for index, chunk in enumerate(chunks):
        last = index == len(chunks) - 1
        positions.make_room(len(chunk) + (0 if last else len(probe)))  # a probe's positions are given back
        logits = _run(model, chunk, caches)
        notify("document", caches)
        if probe and not last:
            with phases.probe(caches):
                _run(model, probe, caches)
                notify("probe", caches)
            mx.eval([c.state for c in caches])
            notify("probe_dropped", caches)
    drafts = phases.look_ahead_steps(caches) if drafts_after else 0
    if instruction:
        phases.tell(caches, Phase.INSTRUCTION)
        positions.make_room(len(instruction) + max(max_new_tokens, drafts))
        for piece in _chunks(instruction, chunk_size, last_alone):
            logits = _run(model, piece, caches)
            notify("instruction", caches)
    mx.eval(logits)  # before decode begins: the last prompt token sees everything held
    notify("read", caches)
    if drafts:
        if not instruction:
            positions.make_room(drafts)
        drafted = draft(model, caches, logits, drafts, stop_tokens=stop_tokens)
        notify("draft", caches)
        look_ahead(model, caches, drafted)
        notify("look_ahead", caches)
    if phases.reconstructs(caches):
        reconstruct(model, caches, list(document) or body, repeat, chunk_size, positions.context,
                    after_piece=lambda: notify("reconstruction", caches))
    if tell_decode:
        phases.tell(caches, Phase.DECODE)
        mx.eval([c.state for c in caches])
    return logits


def draft(model, caches: list, logits: mx.array, steps: int, stop_tokens: Collection[int] = ()) -> list[int]:
    """Up to ``steps`` greedy tokens after the prompt (``logits``: its last position's), drafted and dropped.

    Runs inside ``phases.drafting``: every cache appends the tokens and, on
    exit, is as the prompt left it; nothing is scored or remembered. Stops
    before a token of ``stop_tokens`` (it ends the answer: no query of its own).
    """
    drafted: list[int] = []
    with phases.drafting(caches):
        for _ in range(steps):
            token = int(mx.argmax(logits, axis=-1).item())
            if token in stop_tokens:
                break
            drafted.append(token)
            if len(drafted) < steps:
                logits = _run(model, [token], caches)
    mx.eval([c.state for c in caches])
    return drafted


def look_ahead(model, caches: list, tokens: Sequence[int]) -> None:
    """Feed ``tokens`` (drafted after the prompt, or an answer already known) in one call, then drop them.

    Runs inside ``phases.look_ahead``: windows remember the tokens' queries (each
    cache its own config's ``lookahead`` first ones) for the ranking at the end
    of prefill, and on exit every cache is as the prompt left it.
    """
    if not tokens:
        return
    with phases.look_ahead(caches):
        _run(model, list(tokens), caches)
    mx.eval([c.state for c in caches])


REPEAT_REQUEST = "\n\nRepeat the previous context exactly.\n\n"


def repeat_request(tokenizer) -> list[int]:
    """The tokens that ask the model to repeat the document (``repeat=`` of a reconstruction, as KVzip words it)."""
    return list(tokenizer.encode(REPEAT_REQUEST, add_special_tokens=False))


def reconstruct(
    model, caches: list, document: Sequence[int], repeat: Sequence[int], chunk_size: int,
    context: Optional[int] = None, after_piece: Callable[[], None] = lambda: None,
) -> None:
    """KVzip's scoring pass: re-read ``document`` after the prompt, piece by piece, each dropped again.

    Each piece of at most ``chunk_size`` tokens runs after ``repeat`` (the tokens
    that ask the model to repeat the document) inside ``phases.reconstruction``:
    the caches that rank by reconstruction keep, for every prompt token, the
    largest attention those queries paid it. Pieces shrink so that the prompt,
    ``repeat`` and a piece fit ``context``. About one more prefill of compute.
    """
    if not repeat:
        raise ValueError(
            "repeat: a cache ranks by reconstruction (KVzip) but no tokens ask the model to repeat the document; "
            "pass them (velox_cache.generation.prefill.repeat_request(tokenizer) makes them)"
        )
    held = max(cache.offset for cache in phases.leaves(caches))
    room = chunk_size if context is None else min(chunk_size, context - held - len(repeat))
    if room < 1:
        raise ContextError(
            f"context_length: {context} positions hold the prompt ({held}) but not a request to repeat it "
            f"({len(repeat)}) and a piece of the document to rank it by reconstruction"
        )
    for begin in range(0, len(document), room):
        with phases.reconstruction(caches):
            _run(model, list(repeat) + list(document[begin : begin + room]), caches)
        mx.eval([c.state for c in caches])
        after_piece()


def _chunks(tokens: list[int], size: int, last_alone: bool = False) -> list[list[int]]:
    """``tokens`` in pieces of ``size``; ``last_alone``: all but the last token so, then the last one alone."""
    end = len(tokens) - 1 if last_alone and tokens else len(tokens)
    pieces = [tokens[i : min(i + size, end)] for i in range(0, end, size)]
    return pieces + [tokens[end:]] if end < len(tokens) else pieces


def _run(model, tokens: list[int], caches: list) -> mx.array:
    """One model call; evaluates the caches, leaves the logits lazy (only the last call's are needed)."""
    logits = model(mx.array(tokens)[None], cache=caches)[:, -1, :]
    mx.eval([c.state for c in caches])
    return logits


class _Positions:
    """Keeps every position the model sees inside its context, re-rotating held keys when needed."""

    def __init__(self, model, caches: list, context_length: Optional[int]):
        self.model = model
        self.context = context_length or model_context(model)
        self.movable = [c for c in phases.leaves(caches) if callable(getattr(c, "compact_positions", None))]
        self.shift: Optional[RotaryShift] = None

    def make_room(self, upcoming: int) -> None:
        """Before ``upcoming`` more positions: compact the held ones if they would pass the context."""
        if self.context is None or not self.movable:
            return
        if not self._over(upcoming):
            return
        if self.shift is None:
            self.shift = RotaryShift.from_model(self.model)
        for cache in self.movable:
            cache.compact_positions(self.shift)
        if self._over(upcoming):
            need = max(c.offset for c in self.movable) + upcoming
            raise ContextError(
                f"context_length: {self.context} positions cannot hold the budget plus a chunk and its probe, "
                f"or the instruction and the tokens to generate ({need}); lower the budget, chunk_size or max_tokens"
            )

    def _over(self, upcoming: int) -> bool:
        return any(c.offset + upcoming > self.context for c in self.movable)
