"""The job spec's dataclasses: what a job runs, and the hashes that key its work."""

from __future__ import annotations

import copy
import dataclasses
import glob
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ..defaults import DEFAULT_DB
from .checks import SpecError, template_fields, validate

if TYPE_CHECKING:
    from velox_cache import KVCacheConfig


@dataclass
class InputSpec:
    path: str
    id_column: str
    text_column: Optional[str] = None
    prompt_column: Optional[str] = None
    prompt_template: str = "{text}"
    system: Optional[str] = None
    chat_template: bool = True

    def template_columns(self) -> list[str]:
        """Columns the prompt template refers to (``{text}`` means ``text_column``)."""
        return [self.text_column if name == "text" else name for name in template_fields(self.prompt_template)]

    def columns(self) -> list[str]:
        """Every column a run reads."""
        if self.prompt_column:
            return [self.id_column, self.prompt_column]
        return list(dict.fromkeys([self.id_column, self.text_column, *self.template_columns()]))


@dataclass
class GenerationSpec:
    """How each document is decoded: mlx-lm's sampling settings, its repetition penalty, prefill chunks.

    Up to ``decode_batch_size`` sequences decode together (documents of one variant),
    as many as keep the batch's caches within ``decode_batch_memory_mb`` until every
    row reaches ``max_tokens`` (``pipeline.schedule``); neither changes an output, so
    neither is hashed. ``top_k`` 0 and ``min_p`` 0 are off; ``repetition_penalty`` None (or 1) is off, else
    it penalises the last ``repetition_context_size`` tokens (prompt included), as
    ``mlx_lm.generate`` does.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    prefill_step_size: int = 256
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = 20
    decode_batch_size: int = 8  # sequences decoding together (1: one at a time); outputs do not depend on it
    decode_batch_memory_mb: int = 4096  # a decoding batch's caches never pass this (growth and padding included)

    def hashed(self) -> dict:
        """The settings as hashed into stored keys: fields added later count only when set.

        A spec that leaves them at their defaults keeps the keys it had before they
        existed, so a store's documents are not redone by an upgrade.
        """
        values = {k: v for k, v in dataclasses.asdict(self).items() if k not in NOT_HASHED}
        return {k: v for k, v in values.items() if k not in HASHED_WHEN_SET or v != HASHED_WHEN_SET[k]}


# GenerationSpec fields that decide how fast, not what: never in a hash.
NOT_HASHED = ("decode_batch_size", "decode_batch_memory_mb")
# GenerationSpec fields that came after stores existed, with the default that leaves them out of hashes.
HASHED_WHEN_SET = {"top_k": 0, "min_p": 0.0, "repetition_penalty": None, "repetition_context_size": 20}


@dataclass
class LimitsSpec:
    max_prompt_tokens: Optional[int] = None
    on_too_long: Optional[str] = None  # truncate for text_column, fail for a ready prompt_column
    max_documents: Optional[int] = None


@dataclass
class FrontierSpec:
    """``budgets``: every budget (tokens, or a share like ``"25%"``) at which each compressed variant's
    policy is measured against the full output, from the document's shared reading (empty: no frontier).
    ``bits``: the ``kv_bits`` each budget is measured at (null: float, 8, 4; empty: each variant's own), so
    the frontier is budget x bits."""

    budgets: list = field(default_factory=list)
    bits: list = field(default_factory=list)


@dataclass
class OutputSpec:
    db: str = DEFAULT_DB


@dataclass
class EngineSpec:
    """Where documents run: ``in-process`` (one model in this process) or ``ray`` (many workers).

    ``workers``, ``address``, ``cpus_per_worker`` and ``max_retries`` apply to ``ray`` only.
    ``workers`` defaults to every CPU (of this machine, or of the cluster when joining one);
    ``address`` (else ``$RAY_ADDRESS``) joins a running cluster instead of starting Ray here.
    """

    name: str = "in-process"
    workers: Optional[int] = None
    address: Optional[str] = None
    cpus_per_worker: int = 1  # CPUs each worker reserves, and its BLAS threads
    max_retries: int = 2  # tries of one document after the first, when its worker dies on it


@dataclass
class Variant:
    """One cache configuration of the job. ``auto_eviction`` (the spec's ``eviction: auto``): ``cache``
    reads a document at ``prefill_end`` where its prompt fits the model's context, by streaming where
    it does not (``for_document``)."""

    name: str
    cache: KVCacheConfig
    auto_eviction: bool = False

    def for_document(self, fits: bool) -> "Variant":
        """The variant as it reads a document whose prompt ``fits`` the context, or not."""
        if not self.auto_eviction or fits:
            return self
        return dataclasses.replace(self, cache=dataclasses.replace(self.cache, eviction="streaming"))

    def at_point(self, budget, kv_bits: Optional[int]) -> KVCacheConfig:
        """The cache of one frontier point: this variant's policy at ``budget`` with kept tokens at ``kv_bits``.

        Raises ``ConfigError`` where the variant cannot be measured there (a budget below ``n_sink + 1``,
        ``kv_bits`` on per-head budgets): ``checks.validate`` refuses such a spec when it loads.
        """
        return dataclasses.replace(self.cache, budget=budget, resolved_budget=None, kv_bits=kv_bits)


@dataclass
class JobSpec:
    name: str
    model: str
    input: InputSpec
    variants: list[Variant]
    generation: GenerationSpec = field(default_factory=GenerationSpec)
    limits: LimitsSpec = field(default_factory=LimitsSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    frontier: FrontierSpec = field(default_factory=FrontierSpec)
    source: Optional[str] = None  # the spec file

    def settings_hash(self) -> str:
        """Hash of the job's settings apart from its variants (recorded per run as ``spec_hash``)."""
        settings = {
            "model": self.model,
            "input": {k: v for k, v in dataclasses.asdict(self.input).items() if k != "path"},
            "generation": self.generation.hashed(),
            "limits": {k: v for k, v in dataclasses.asdict(self.limits).items() if k != "max_documents"},
        }
        return _hash(settings)

    def output_settings_hash(self, **extra) -> str:
        """Hash of what decides a document's output besides its prompt tokens and variant.

        That is the model (``extra`` adds how it was loaded, e.g. its weights) and the
        generation settings; limits are left out: they decide the prompt, and the
        prompt's own tokens are hashed separately.
        """
        return _hash({"model": self.model, "generation": self.generation.hashed(), **extra})

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["variants"] = [{"name": v.name, **dataclasses.asdict(v.cache)} for v in self.variants]
        return data

    def with_overrides(
        self,
        *,
        db: Optional[str] = None,
        limit: Optional[int] = None,
        variants: Sequence[str] = (),
        max_prompt_tokens: Optional[int] = None,
        on_too_long: Optional[str] = None,
        model: Optional[str] = None,
        engine: Optional[str] = None,
        workers: Optional[int] = None,
        address: Optional[str] = None,
    ) -> "JobSpec":
        """A copy of this spec with ``velox-batch run``'s options applied, validated again.

        Each argument is one option (``variants``: the ``--variant`` names, in the order
        to run them); an empty one leaves the spec's value. ``engine="in-process"`` drops
        the spec's ray settings rather than refusing them. Errors are ``SpecError``s
        naming the option (``--workers: only the ray engine has workers (add --engine ray)``).
        """
        spec = copy.deepcopy(self)
        if engine == "in-process":  # the spec's ray settings do not apply
            spec.engine.workers = spec.engine.address = None
        if engine:
            spec.engine.name = engine
        for option, value in (("--workers", workers), ("--address", address)):
            if value is not None and spec.engine.name != "ray":
                raise SpecError(f"{option}: only the ray engine has {option[2:]} (add --engine ray)")
        if workers is not None:
            spec.engine.workers = workers
        if address is not None:
            spec.engine.address = address
        if db:
            spec.output.db = db
        if limit:
            spec.limits.max_documents = limit
        if max_prompt_tokens:
            spec.limits.max_prompt_tokens = max_prompt_tokens
        if on_too_long:
            spec.limits.on_too_long = on_too_long
        if model:
            spec.model = model
        if variants:
            known = {v.name: v for v in spec.variants}
            for name in variants:
                if name not in known:
                    raise SpecError(f"--variant: '{name}' is not in the spec; variants: {', '.join(known)}")
            spec.variants = [known[name] for name in variants]
        validate(spec)
        return spec


def _hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


QUANTIZATION_FIELDS = ("kv_bits", "kv_group_size", "kv_window")  # hashed only where kv_bits is set


def quantization_settings(cache: KVCacheConfig) -> dict:
    """What decides how ``cache``'s kept tokens are quantized, resolved as they run: ``kv_bits``, the group
    size it takes (its default depends on the bits and the method) and ``kv_window``; empty for float."""
    if cache.kv_bits is None:
        return {}
    return {"kv_bits": cache.kv_bits, "kv_group_size": cache.kv_group, "kv_window": cache.kv_window}


def variant_hash(variant: Variant) -> str:
    """The variant's identity in the store: its name and every cache field (the quantization fields resolved,
    and only where ``kv_bits`` is set, so a float variant keeps the hash it had before they existed)."""
    auto = {"auto_eviction": True} if variant.auto_eviction else {}
    cache = {k: v for k, v in dataclasses.asdict(variant.cache).items() if k not in QUANTIZATION_FIELDS}
    return _hash({"name": variant.name, **cache, **quantization_settings(variant.cache), **auto})


def input_files(spec: JobSpec) -> list[Path]:
    """The Parquet files the input names (a file, a directory or a glob), sorted."""
    pattern = spec.input.path
    candidate = Path(pattern).expanduser()
    if candidate.is_dir():
        files = sorted(candidate.rglob("*.parquet"))
    elif any(ch in pattern for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(candidate), recursive=True))
    else:
        files = [candidate] if candidate.is_file() else []
    if not files:
        raise SpecError(f"input.path: no Parquet file found at '{pattern}'")
    return files
