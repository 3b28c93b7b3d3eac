"""Job specs: YAML in, validated dataclasses out, before any model is loaded.

Every error is a ``SpecError`` whose message names the file and the field
(``jobs/x.yaml: generation.max_tokens: expected an integer, got 'ten'``).
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import hashlib
import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from velox_cache import ConfigError, KVCacheConfig

ON_TOO_LONG = ("truncate", "skip", "fail")


class SpecError(ValueError):
    """The job spec or its input is invalid; the message names the field, column or file."""


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
        names = [name for _, name, _, _ in string.Formatter().parse(self.prompt_template) if name]
        return [self.text_column if name == "text" else name for name in names]

    def columns(self) -> list[str]:
        """Every column a run reads."""
        if self.prompt_column:
            return [self.id_column, self.prompt_column]
        return list(dict.fromkeys([self.id_column, self.text_column, *self.template_columns()]))


@dataclass
class GenerationSpec:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    prefill_step_size: int = 256


@dataclass
class LimitsSpec:
    max_prompt_tokens: Optional[int] = None
    on_too_long: str = "truncate"
    max_documents: Optional[int] = None


@dataclass
class OutputSpec:
    db: str = "velox.db"


@dataclass
class Variant:
    name: str
    cache: KVCacheConfig


@dataclass
class JobSpec:
    name: str
    model: str
    input: InputSpec
    variants: list[Variant]
    generation: GenerationSpec = field(default_factory=GenerationSpec)
    limits: LimitsSpec = field(default_factory=LimitsSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    source: Optional[str] = None  # the spec file

    def settings_hash(self) -> str:
        """Hash of everything except the variants that changes a document's output."""
        settings = {
            "model": self.model,
            "input": {k: v for k, v in dataclasses.asdict(self.input).items() if k != "path"},
            "generation": dataclasses.asdict(self.generation),
            "limits": {k: v for k, v in dataclasses.asdict(self.limits).items() if k != "max_documents"},
        }
        return _hash(settings)

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["variants"] = [{"name": v.name, **dataclasses.asdict(v.cache)} for v in self.variants]
        return data


def _hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def variant_hash(variant: Variant) -> str:
    return _hash({"name": variant.name, **dataclasses.asdict(variant.cache)})


# ----- validation -----------------------------------------------------------------------------

_TYPES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _section(cls, raw: Any, where: str):
    """Build dataclass ``cls`` from a mapping, checking keys (with "did you mean") and types."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: expected a mapping, got {type(raw).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    values = {}
    for key, value in raw.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise SpecError(f"{where}.{key}: unknown field{hint}")
        values[key] = _check_type(value, known[key].type, f"{where}.{key}")
    missing = [
        name
        for name, f in known.items()
        if name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise SpecError(f"{where}.{missing[0]}: required field is missing")
    return cls(**values)


def _check_type(value: Any, annotation: str, where: str):
    base = annotation.replace("Optional[", "").rstrip("]")
    if value is None:
        if annotation.startswith("Optional["):
            return None
        raise SpecError(f"{where}: must not be empty")
    expected = {"int": int, "float": float, "str": str, "bool": bool}.get(base)
    if expected is None:
        return value
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise SpecError(f"{where}: expected {_TYPES[expected]}, got {value!r}")
    return value


def _variants(raw: dict, where: str) -> list[Variant]:
    if "cache" in raw and "variants" in raw:
        raise SpecError(f"{where}: give either 'cache' or 'variants', not both")
    if "variants" in raw:
        items = raw["variants"]
        if not isinstance(items, list) or not items:
            raise SpecError(f"{where}.variants: expected a non-empty list")
    else:
        items = [raw.get("cache") or {"method": "full"}]
    variants = []
    for i, item in enumerate(items):
        item_where = f"{where}.variants[{i}]" if "variants" in raw else f"{where}.cache"
        if not isinstance(item, dict):
            raise SpecError(f"{item_where}: expected a mapping, got {type(item).__name__}")
        item = dict(item)
        name = item.pop("name", None)
        try:
            config = KVCacheConfig.from_dict(item, where=item_where)
        except ConfigError as exc:
            raise SpecError(str(exc)) from None
        if config.method != "full" and config.scoring is None:
            config = dataclasses.replace(config, scoring="observed")
        name = str(name) if name is not None else (
            config.method if config.method == "full" else f"{config.method}-{config.budget}"
        )
        variants.append(Variant(name, config))
    names = [v.name for v in variants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SpecError(f"{where}.variants: duplicate variant name '{duplicates[0]}' (give each a 'name')")
    return variants


def parse_spec(raw: Any, where: str = "spec") -> JobSpec:
    """Validate a spec mapping; errors name the field."""
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: expected a mapping at the top level")
    top = {"name", "model", "input", "generation", "cache", "variants", "limits", "output"}
    for key in raw:
        if key not in top:
            close = difflib.get_close_matches(str(key), sorted(top), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise SpecError(f"{where}: {key}: unknown field{hint}")
    for key in ("name", "model", "input"):
        if key not in raw:
            raise SpecError(f"{where}: {key}: required field is missing")
    for key in ("name", "model"):
        if not isinstance(raw[key], str) or not raw[key]:
            raise SpecError(f"{where}: {key}: expected a non-empty string, got {raw[key]!r}")
    try:
        spec = JobSpec(
            name=raw["name"],
            model=raw["model"],
            input=_section(InputSpec, raw["input"], "input"),
            variants=_variants(raw, "job"),
            generation=_section(GenerationSpec, raw.get("generation"), "generation"),
            limits=_section(LimitsSpec, raw.get("limits"), "limits"),
            output=_section(OutputSpec, raw.get("output"), "output"),
        )
        _check_values(spec)
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None
    return spec


def _check_values(spec: JobSpec) -> None:
    inp, gen, lim = spec.input, spec.generation, spec.limits
    if bool(inp.text_column) == bool(inp.prompt_column):
        raise SpecError("input: give exactly one of text_column and prompt_column")
    if inp.text_column:
        try:
            inp.prompt_template.format(**{name: "" for name in ["text", *inp.template_columns()]})
        except (KeyError, ValueError, IndexError) as exc:
            raise SpecError(f"input.prompt_template: cannot be filled ({exc})") from None
        if "{text}" not in inp.prompt_template:
            raise SpecError("input.prompt_template: must contain {text}")
    if gen.max_tokens < 1:
        raise SpecError(f"generation.max_tokens: must be at least 1, got {gen.max_tokens}")
    if gen.temperature < 0:
        raise SpecError(f"generation.temperature: must be at least 0, got {gen.temperature}")
    if not 0 < gen.top_p <= 1:
        raise SpecError(f"generation.top_p: must be in (0, 1], got {gen.top_p}")
    if gen.prefill_step_size < 1:
        raise SpecError(f"generation.prefill_step_size: must be at least 1, got {gen.prefill_step_size}")
    if lim.on_too_long not in ON_TOO_LONG:
        raise SpecError(f"limits.on_too_long: {lim.on_too_long!r} is not one of {', '.join(ON_TOO_LONG)}")
    if lim.max_prompt_tokens is not None and lim.max_prompt_tokens < 1:
        raise SpecError(f"limits.max_prompt_tokens: must be at least 1, got {lim.max_prompt_tokens}")
    if lim.max_documents is not None and lim.max_documents < 1:
        raise SpecError(f"limits.max_documents: must be at least 1, got {lim.max_documents}")


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a YAML job spec; relative input and db paths are taken as given (cwd)."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: job spec file not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None
    spec = parse_spec(raw, where=str(path))
    spec.source = str(path)
    return spec


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
