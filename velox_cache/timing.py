"""Timings: when a cache evicts during prefill, and what decides it.

* ``continuous`` evicts after every prefill chunk and decode step, by the
  policy's ranking signal: memory stays within budget + one chunk.
* ``prefill_end`` keeps every prompt token and compresses once when decoding
  starts, by the ``window`` of the prompt's last queries (SnapKV, PyramidKV)
  or by ``cumulative`` mass.
* ``streaming`` (FINCH) compresses after every document chunk: by the probe's
  attention when a probe ran on top of the chunk (``velox_cache.phases``),
  otherwise by the chunk's own last ``window`` queries, just before the next
  chunk is appended (SnapKV per chunk). Memory stays within budget + chunk +
  probe. When decoding starts, the prompt's last queries (the instruction)
  rank what is held, as under ``prefill_end``.

Every timing evicts during decoding; the policy's signal ranks there.
"""

from __future__ import annotations


class Continuous:
    name = "continuous"
    evicts_during_prefill = True
    keeps_prefill = False  # grow buffers in steps because nothing is evicted until prefill ends
    uses_probes = False

    def __init__(self, selection: str):
        self.selection = selection

    @property
    def selects_by_window(self) -> bool:
        """Whether the prompt's last queries rank held tokens when prefill ends."""
        return False

    def before_chunk(self, cache) -> None:
        """Called before a prefill call (not a probe) appends its tokens."""

    def after_chunk(self, cache) -> None:
        """Called after a prefill call (not a probe) appended its tokens."""


class PrefillEnd(Continuous):
    name = "prefill_end"
    evicts_during_prefill = False
    keeps_prefill = True

    @property
    def selects_by_window(self) -> bool:
        return self.selection == "window"


class Streaming(Continuous):
    name = "streaming"
    evicts_during_prefill = False
    uses_probes = True

    @property
    def selects_by_window(self) -> bool:
        return True

    def before_chunk(self, cache) -> None:
        if cache.in_document_phase:
            cache.select_pending()

    def after_chunk(self, cache) -> None:
        if cache.in_document_phase:
            cache.mark_pending()


TIMINGS = {timing.name: timing for timing in (Continuous, PrefillEnd, Streaming)}


def make_timing(eviction: str, selection: str):
    """The timing object for a config's ``eviction`` and ``selection``."""
    return TIMINGS[eviction](selection)
