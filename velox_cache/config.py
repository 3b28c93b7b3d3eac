"""``KVCacheConfig``: one validated dataclass for every cache policy (the bottom layer: imports nothing of velox_cache)."""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

# The policy names a config may ask for. The registry ``velox_cache.policies.POLICIES`` holds one
# class for each and refuses to load otherwise; config sits below the policies and never imports them.
METHODS = ("full", "h2o", "tova", "snapkv", "streaming", "pyramidkv", "squeeze")
SCORINGS = ("observed", "key_proxy")
EVICTIONS = ("continuous", "prefill_end", "streaming")
SELECTIONS = ("cumulative", "window", "reconstruction")
KV_DTYPES = ("float16", "bfloat16", "float32")
KV_BITS = (8, 4)
FULL_KV_GROUP = 64  # kv_group_size left open: tokens per key group of the full cache (~29% of float32 at 8 bits)
# ... and of an evicting cache, per kv_bits: at 4 bits groups of 32 lost 0.038 agreement on squeeze at a 10% budget
# (bench/RESULTS.md, "Quantized kept tokens"), groups of 16 0.016
EVICTING_KV_GROUP = {8: 32, 4: 16}
HEAD_BUDGETS = ("uniform", "adaptive")

# Each method's timing and prefill-end ranking when a config leaves them open: its policy class's
# ``default_eviction`` and ``default_selection`` (the registry refuses a policy that disagrees). The
# config needs them to fill in the ranking's defaults, which depend on the timing.
DEFAULT_TIMINGS = {
    "full": ("continuous", "cumulative"),
    "h2o": ("continuous", "cumulative"),
    "tova": ("continuous", "cumulative"),
    "streaming": ("continuous", "cumulative"),
    "snapkv": ("prefill_end", "window"),
    "pyramidkv": ("prefill_end", "window"),
    "squeeze": ("prefill_end", "window"),
}

# The ranking's defaults per timing (measured: bench/RESULTS.md, "What the answer will need"). At
# prefill end the window ranks token by token (kernel 1) with the answer's first 16 drafted tokens
# beside the prompt's last queries: the best fidelity and needles measured. Where no draft joins
# the window (a caller that tells no phases, plain ``mlx_lm.generate``; no look-ahead asked) and
# while streaming (each probe ranks a compressed context with no draft), ranking token by token
# loses multi-token facts (0 of 5 streamed 4k needles; a 500-token needle at a 50% budget):
# pooling over 31 neighbours keeps them whole.
LOOKAHEAD_KERNEL = 1
PREFILL_END_LOOKAHEAD = 16
POOLED_KERNEL = 31
STREAM_KERNEL = POOLED_KERNEL
STREAM_LOOKAHEAD = 0

# Field names of the original library, kept so that code written for it runs unchanged.
ALIASES = {
    "pyramid_budget": "budget",
    "pyramid_n_sink": "n_sink",
    "pyramid_resolved_budget": "resolved_budget",
    "pyramid_beta": "beta",
    "squeeze_budget": "budget",
    "squeeze_n_sink": "n_sink",
    "squeeze_resolved_budget": "resolved_budget",
    "squeeze_strength": "strength",
    "h2o_budget": "budget",
    "h2o_n_sink": "n_sink",
    "tova_budget": "budget",
    "snapkv_budget": "budget",
    "snapkv_window": "window",
    "snapkv_kernel": "kernel",
    "streaming_budget": "budget",
    "streaming_n_sink": "n_sink",
}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")


def parse_budget_fraction(value: Any, field: str = "budget") -> Optional[float]:
    """``"25%"`` -> 0.25; None for an absolute value (an int). Raises ``ConfigError`` naming ``field`` otherwise."""
    if isinstance(value, str):
        match = _PERCENT.match(value)
        if not match:
            raise ConfigError(f"{field}: expected a number of tokens or a percentage like '25%', got {value!r}")
        fraction = float(match.group(1)) / 100
        if not 0 < fraction <= 1:
            raise ConfigError(f"{field}: a percentage must be above 0% and at most 100%, got {value!r}")
        return fraction
    return None


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ConfigError(f"{name}: must be at least {minimum}, got {value}")


def _check_number(name: str, value: Any, low: float, high: float | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ConfigError(f"{name}: must be {bound}, got {value}")


def _check_choice(name: str, value: Any, choices: tuple, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value not in choices:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(choices)}")


@dataclass
class KVCacheConfig:
    """How one model's KV caches evict tokens.

    Attributes:
        method: ``full``, ``h2o``, ``tova``, ``snapkv``, ``streaming``, ``pyramidkv``
            or ``squeeze``.
        budget: average number of tokens each layer keeps (per head), or a
            percentage of the prompt such as ``"25%"`` (resolved per prompt by
            ``KVCacheBuilder.for_model(..., prompt_tokens=N)``; at least ``n_sink + 1``).
        n_sink: leading positions that are never evicted.
        beta: pyramid steepness, first-layer budget / last-layer budget (1 = flat).
        strength: squeeze reallocation strength in [0, 1] (0 = uniform budgets).
        resolved_budget: this layer's budget when set (``for_model`` fills it in
            for pyramidkv; an explicit override otherwise).
        kv_dtype: dtype of the stored keys/values (default: the model's).
        kv_bits: ``8`` or ``4``: once decoding starts, held keys and values
            are quantized (KIVI: keys per channel over groups of
            ``kv_group_size`` tokens, values per token over groups of
            ``kv_group_size`` features); the prompt is read in float, so
            prefill and the eviction at its end are unchanged. The full cache
            keeps its newest ``kv_window`` tokens and an unfinished group in
            float (``velox_cache.policies.full.QuantizedFullKVCache``); an
            evicting cache keeps its unfinished group in float, ranks its
            tokens with the quantized ones when it evicts (a window token can
            go), and leaves each evicted token's codes as a hole the next whole
            group fills (``velox_cache.cache.quantized_slots``).
            ``None``: held in float. Needs the model's attention routed
            through Velox; rows at ``kv_bits`` decode in batches (each kind
            in a batched layer of its own, beside rows of other kinds).
        kv_group_size: tokens per key scale and features per value scale
            (a value group wider than the head dim is the head dim; one that
            does not divide it becomes it). ``None``: 64 for the full cache,
            32 for an evicting one at 8 bits and 16 at 4; an evicting layer's
            group is at most a quarter of its budget.
        kv_window: the newest tokens the full cache keeps in float under ``kv_bits``.
        scoring: ``observed`` (real attention, needs ``velox_cache.observe``) or
            ``key_proxy`` (each key stands in for its query). ``None`` picks
            observed while the model is observed, key proxy otherwise.
        eviction: ``continuous`` (after every chunk and step), ``prefill_end``
            (once, when decoding starts) or ``streaming`` (after every document
            chunk, ranked by a probe or by the chunk's last queries; see
            ``velox_cache.stream_prefill``). ``None`` takes the policy's default.
        selection: what ranks tokens when prefill ends under ``prefill_end``:
            ``cumulative`` attention mass (H2O), ``window``: the attention of
            the prompt's last ``window`` queries, max-pooled over ``kernel``
            (SnapKV), or ``reconstruction`` (KVzip): after the prompt the model
            re-reads the document piece by piece after a request to repeat it
            (``prefill_phases(repeat=...)``, about one more prefill of compute),
            and a token's score is the largest attention any of those queries or
            the window's paid it, max-pooled over ``kernel``. ``None`` takes the
            policy's default.
        recent: most recent tokens protected from eviction: tokens, or a
            percentage of ``budget`` such as ``"25%"`` (``None``: budget // 8).
            Per-layer budgets (pyramid, squeeze) share the one window.
        window: SnapKV observation window (the prompt's last queries).
        kernel: the pooling of the ranking at prefill end (the window's
            scores, or a reconstruction's peaks) over neighbouring positions
            (odd). ``None``: 1 (token by token, the best measured) where a
            look-ahead's drafted queries joined the window, otherwise 31
            (without a draft, ranking token by token loses multi-token
            facts). Under ``eviction: streaming`` a ``kernel`` given without
            ``stream_kernel`` is also the streamed pooling.
        stream_kernel: the pooling under ``streaming`` (every probe, a chunk's
            own window, the instruction's selection when prefill ends).
            ``None``: ``kernel`` where the config streams and names one,
            otherwise 31 (a probe ranking a compressed context without
            pooling loses multi-token facts). A config keeps both rankings,
            so one that reads at ``prefill_end`` where the prompt fits and
            streams past the context (a job's ``eviction: auto``) pools by
            ``kernel`` there and by ``stream_kernel`` here.
        mass_weight: share of cumulative attention mass (H2O, every prompt
            query) blended into the window's or the probe's ranking, in
            [0, 1]: 0 = that ranking alone (SnapKV), 1 = cumulative mass alone.
            Each signal is normalised per head before blending. Used where a
            window selects at prefill end (``prefill_end``, ``streaming``) and
            at every probe selection of ``streaming``. ``None`` takes the
            policy's default (squeeze at ``prefill_end`` 0.3, otherwise 0).
        head_budgets: ``uniform`` (every KV head of a layer keeps the layer's
            budget) or ``adaptive`` (AdaKV: where a window or a probe ranks
            tokens, one selection over all heads of the layer keeps the same
            total, every head at least ``head_floor`` of the budget; the held
            bytes follow the per-head counts, ``velox_cache.cache.head_slots``).
            Needs observed scoring. ``None`` takes the policy's default.
        head_floor: under ``adaptive``, the share of the layer's per-head
            budget every head keeps at least, in [0, 1] (AdaKV's alpha).
        stream_headroom: under ``streaming``, what each probe (or a chunk's own
            window) evicts to while the document is read, as a multiple of the
            layer's budget (at least 1); the instruction's selection when
            prefill ends evicts to the budget itself. Held keys stay within
            ``budget * stream_headroom`` + chunk + probe during prefill. 1 by
            default (every probe evicts to the budget: the least memory); 2
            tracks the full cache closer on summaries (the main job's setting).
        lookahead: at prefill end, tokens drafted greedily with the stack as
            it stands when the prompt ends (nothing evicted yet), whose queries
            join the window that ranks the held tokens, then dropped: decoding
            starts from the prompt's end as before (Lookahead Q-Cache, SpecKV).
            Costs ``lookahead`` decode steps on the unevicted stack
            (``velox_cache.prefill_phases`` drafts them; a shared reading
            drafts once for all its stacks). A caller that tells no phases
            (plain ``mlx_lm.generate``) drafts nothing: the window then holds
            the prompt's queries alone (and an open ``kernel`` pools over 31).
            Needs a window ranking (``selection: window``). ``None``: 16 where
            the window ranks at prefill end (snapkv, pyramidkv, squeeze, or
            ``selection: window``), otherwise 0. Under ``eviction: streaming``
            a ``lookahead`` given without ``stream_lookahead`` is also the
            streamed one.
        stream_lookahead: tokens drafted (with the compressed stack) when a
            streamed prefill ends, as ``lookahead`` does at prefill end.
            ``None``: ``lookahead`` where the config streams and names one,
            otherwise 0.
        fit_budgets: fit the per-layer budgets to the prompt when its length is
            known (``KVCacheBuilder.for_model(..., prompt_tokens=N,
            new_tokens=M)``): no layer gets more than the prompt plus the
            tokens to generate, what that frees goes to the other layers at the
            same total, and a prompt no longer than the budget is compressed by
            no layer (``velox_cache.budgets.schedules.fit_budgets``).
    """

    method: str = "pyramidkv"
    budget: Union[int, str] = 512
    n_sink: int = 4
    beta: float = 3.0
    strength: float = 0.5
    resolved_budget: Optional[int] = None
    kv_dtype: Optional[str] = None
    kv_bits: Optional[int] = None
    kv_group_size: Optional[int] = None
    kv_window: int = 64
    scoring: Optional[str] = None
    eviction: Optional[str] = None
    selection: Optional[str] = None
    recent: Union[int, str, None] = None
    window: int = 32
    kernel: Optional[int] = None
    mass_weight: Optional[float] = None
    head_budgets: Optional[str] = None
    head_floor: float = 0.2
    stream_headroom: float = 1.0
    lookahead: Optional[int] = None
    stream_kernel: Optional[int] = None
    stream_lookahead: Optional[int] = None
    fit_budgets: bool = True

    def __post_init__(self):
        _check_choice("method", self.method, METHODS)
        _check_int("n_sink", self.n_sink, 0)
        if parse_budget_fraction(self.budget) is None:
            _check_int("budget", self.budget, self.n_sink + 1)
        _check_int("resolved_budget", self.resolved_budget, self.n_sink + 1, optional=True)
        _check_number("beta", self.beta, 1.0)
        _check_number("strength", self.strength, 0.0, 1.0)
        _check_choice("kv_dtype", self.kv_dtype, KV_DTYPES, optional=True)
        if self.kv_bits is not None and (isinstance(self.kv_bits, bool) or self.kv_bits not in KV_BITS):
            raise ConfigError(f"kv_bits: {self.kv_bits!r} is not one of {', '.join(map(str, KV_BITS))} (or null: float)")
        if self.kv_bits is not None and self.head_budgets == "adaptive":
            raise ConfigError("kv_bits: per-head budgets (head_budgets 'adaptive') cannot hold quantized tokens yet")
        _check_int("kv_group_size", self.kv_group_size, 2, optional=True)
        _check_int("kv_window", self.kv_window, 0)
        _check_choice("scoring", self.scoring, SCORINGS, optional=True)
        _check_choice("eviction", self.eviction, EVICTIONS, optional=True)
        _check_choice("selection", self.selection, SELECTIONS, optional=True)
        if parse_budget_fraction(self.recent, "recent") is None:
            _check_int("recent", self.recent, 0, optional=True)
        _check_int("window", self.window, 1)
        _check_int("kernel", self.kernel, 1, optional=True)
        _check_int("stream_kernel", self.stream_kernel, 1, optional=True)
        _check_number("mass_weight", self.mass_weight, 0.0, 1.0, optional=True)
        _check_choice("head_budgets", self.head_budgets, HEAD_BUDGETS, optional=True)
        _check_number("head_floor", self.head_floor, 0.0, 1.0)
        _check_number("stream_headroom", self.stream_headroom, 1.0)
        _check_int("lookahead", self.lookahead, 0, optional=True)
        _check_int("stream_lookahead", self.stream_lookahead, 0, optional=True)
        if not isinstance(self.fit_budgets, bool):
            raise ConfigError(f"fit_budgets: expected true or false, got {self.fit_budgets!r}")
        if self.head_budgets == "adaptive" and self.scoring == "key_proxy":
            raise ConfigError(
                "head_budgets: 'adaptive' ranks each head's tokens by the real queries' attention; "
                "it needs scoring 'observed', not 'key_proxy'"
            )
        for name in ("kernel", "stream_kernel"):
            if getattr(self, name) is not None and getattr(self, name) % 2 == 0:
                raise ConfigError(f"{name}: must be odd, got {getattr(self, name)}")
        if self.eviction == "streaming":
            if self.method == "streaming":
                raise ConfigError(
                    "eviction: 'streaming' ranks tokens by attention; method 'streaming' (StreamingLLM) "
                    "keeps the most recent ones and has no use for it"
                )
            if self.selection in ("cumulative", "reconstruction"):
                raise ConfigError(
                    f"selection: 'streaming' eviction ranks by a probe or a window, not {self.selection!r} "
                    "(reconstruction re-reads the whole document, which streaming does not hold)"
                )
        self._fill_ranking()

    def _fill_ranking(self) -> None:
        """Fill in the open ranking fields with their timing's defaults (``PREFILL_END_*``, ``STREAM_*``).

        Both rankings are resolved whatever the eviction, so a copy with another eviction
        (``dataclasses.replace``; a job's ``eviction: auto`` streaming past the context) ranks by
        that timing's own: the prefill-end fields are never the streamed ones unless the config
        streams and names them. An open ``kernel`` stays None: whether a draft joined the window is
        known only when prefill ends (``velox_cache.cache.selection.WindowSelector.pooling``).
        """
        default_eviction, default_selection = DEFAULT_TIMINGS[self.method]
        eviction = self.eviction or default_eviction
        selection = self.selection or default_selection  # what ranks at prefill end (streaming: always a window)
        if self.lookahead and (eviction == "continuous" or (eviction == "prefill_end" and selection == "cumulative")):
            raise ConfigError(
                f"lookahead: drafted tokens join the window that ranks the prompt; {self.method} with eviction "
                f"{eviction!r} and selection {selection!r} ranks by no window (use selection 'window')"
            )
        streams = eviction == "streaming"
        if self.stream_kernel is None:
            self.stream_kernel = self.kernel if streams and self.kernel is not None else STREAM_KERNEL
        if self.stream_lookahead is None:
            self.stream_lookahead = self.lookahead if streams and self.lookahead is not None else STREAM_LOOKAHEAD
        if self.lookahead is None:
            self.lookahead = PREFILL_END_LOOKAHEAD if eviction != "continuous" and selection == "window" else 0

    @property
    def kv_group(self) -> int:
        """``kv_group_size``, or its default for this method and ``kv_bits`` (``FULL_KV_GROUP``, ``EVICTING_KV_GROUP``)."""
        if self.kv_group_size is not None:
            return self.kv_group_size
        return FULL_KV_GROUP if self.method == "full" else EVICTING_KV_GROUP.get(self.kv_bits, 32)

    @property
    def budget_fraction(self) -> Optional[float]:
        """The budget as a fraction of the prompt (``"25%"`` -> 0.25); None for an absolute budget."""
        return parse_budget_fraction(self.budget)

    def resolved_for(self, prompt_tokens: int) -> "KVCacheConfig":
        """This config with a percentage budget turned into tokens for a prompt of ``prompt_tokens``.

        The result is at least ``n_sink + 1``; an absolute budget is returned unchanged.
        """
        fraction = self.budget_fraction
        if fraction is None:
            return self
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
            raise ConfigError(f"prompt_tokens: expected a non-negative integer, got {prompt_tokens!r}")
        budget = max(self.n_sink + 1, round(fraction * prompt_tokens))
        return dataclasses.replace(self, budget=budget)

    @property
    def recent_window(self) -> int:
        """Most recent tokens protected from eviction (the budget must be resolved to tokens)."""
        if isinstance(self.recent, int):
            return self.recent
        if self.budget_fraction is not None:
            raise ConfigError(f"budget: {self.budget!r} must be resolved to tokens first (resolved_for)")
        share = 0.125 if self.recent is None else parse_budget_fraction(self.recent, "recent")
        return int(share * self.budget)  # the default: budget // 8

    @classmethod
    def from_dict(cls, values: dict, *, where: str = "cache") -> "KVCacheConfig":
        """Build from a mapping, strictly: unknown keys are errors with a "did you mean"."""
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(values).__name__}")
        known = [f.name for f in fields(cls)] + list(ALIASES)
        for key in values:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ConfigError(f"{where}.{key}: unknown field{hint}")
        try:
            return cls(**values)
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc}") from None


def _init_with_aliases(original_init):
    def __init__(self, *args, **kwargs):
        for alias, name in ALIASES.items():
            if alias in kwargs:
                if name in kwargs and kwargs[name] != kwargs[alias]:
                    raise ConfigError(f"{alias}: conflicts with {name} (both given)")
                kwargs[name] = kwargs.pop(alias)
        original_init(self, *args, **kwargs)

    __init__.__doc__ = original_init.__doc__
    return __init__


def _alias_property(name: str) -> property:
    def get(self):
        return getattr(self, name)

    def set(self, value):
        setattr(self, name, value)

    return property(get, set, doc=f"Alias of ``{name}`` (the original library's name).")


KVCacheConfig.__init__ = _init_with_aliases(KVCacheConfig.__init__)
for _alias, _name in ALIASES.items():
    setattr(KVCacheConfig, _alias, _alias_property(_name))
