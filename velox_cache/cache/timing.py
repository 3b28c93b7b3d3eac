"""Timings: when a cache evicts during prefill, and what decides it.

* ``continuous`` evicts after every prefill chunk and decode step, by the
  policy's ranking signal: memory stays within budget + one chunk.
* ``prefill_end`` keeps every prompt token and compresses once when decoding
  starts, by the ``window`` of the prompt's last queries (SnapKV, PyramidKV),
  by ``cumulative`` mass, or by ``reconstruction``: the largest attention the
  window's queries or a re-reading of the document paid each token (KVzip).
* ``streaming`` (FINCH) compresses after every document chunk: by the probe's
  attention when a probe ran on top of the chunk (``velox_cache.phases``),
  otherwise by the chunk's own last ``window`` queries, just before the next
  chunk is appended (SnapKV per chunk). Memory stays within budget + chunk +
  probe. When decoding starts, the prompt's last queries (the instruction)
  rank what is held, as under ``prefill_end``.

Every timing evicts during decoding; the policy's signal ranks there.

A timing is told the events of one layer's sequence (``on_chunk_end``,
``on_probe_end``, ``on_prefill_end``) and answers with what is due; the cache
carries it out. A timing never reaches into the cache.
"""

from __future__ import annotations


class Continuous:
    """Evicts to budget after every call."""

    name = "continuous"
    uses_probes = False  # a probe's attention ranks the held tokens

    def __init__(self, selection: str):
        self.selection = selection

    @property
    def ranks_by_window(self) -> bool:
        """Whether the prompt's last queries rank held tokens (remembered while prefilling)."""
        return False

    @property
    def reconstructs(self) -> bool:
        """Whether the ranking at prefill end also takes a reconstruction's attention peaks (KVzip)."""
        return False

    def evicts(self, prefilling: bool) -> bool:
        """Whether a call (not a probe) evicts to budget once its attention is scored."""
        return True

    def grows_in_steps(self, prefilling: bool) -> bool:
        """Whether buffers grow in steps, like mlx-lm's ``KVCache``: nothing is evicted soon."""
        return False

    def on_chunk_end(self) -> None:
        """A document chunk was appended."""

    def selection_due(self) -> bool:
        """Whether the last chunk's window selection is due now (before the next chunk, or a compaction)."""
        return False

    def on_probe_end(self) -> bool:
        """A probe's attention ranked the held tokens; True when that ranking evicts to budget now."""
        return False

    def on_prefill_end(self) -> bool:
        """Decoding starts; True when the prompt's last queries rank the held tokens before the final eviction."""
        return self.ranks_by_window


class PrefillEnd(Continuous):
    """Keeps the whole prompt and compresses once, when decoding starts."""

    name = "prefill_end"

    @property
    def ranks_by_window(self) -> bool:
        return self.selection in ("window", "reconstruction")

    @property
    def reconstructs(self) -> bool:
        return self.selection == "reconstruction"

    def evicts(self, prefilling: bool) -> bool:
        return not prefilling

    def grows_in_steps(self, prefilling: bool) -> bool:
        return prefilling


class Streaming(Continuous):
    """Compresses after every document chunk, by the probe or the chunk's last queries."""

    name = "streaming"
    uses_probes = True

    def __init__(self, selection: str):
        super().__init__(selection)
        self.pending = False  # the last chunk still awaits its selection

    @property
    def ranks_by_window(self) -> bool:
        return True

    def evicts(self, prefilling: bool) -> bool:
        return not prefilling

    def on_chunk_end(self) -> None:
        self.pending = True

    def selection_due(self) -> bool:
        due, self.pending = self.pending, False
        return due

    def on_probe_end(self) -> bool:
        self.pending = False
        return True

    def on_prefill_end(self) -> bool:
        self.pending = False
        return True


TIMINGS = {timing.name: timing for timing in (Continuous, PrefillEnd, Streaming)}


def make_timing(eviction: str, selection: str):
    """A fresh timing object for a config's ``eviction`` and ``selection`` (one per layer and sequence)."""
    return TIMINGS[eviction](selection)
