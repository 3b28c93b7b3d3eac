"""Job specs from YAML: keys and types checked (with "did you mean"), then values (``validate``)."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

import yaml

from .checks import SpecError, validate
from .model import EngineSpec, FrontierSpec, GenerationSpec, InputSpec, JobSpec, LimitsSpec, OutputSpec, Variant

_TYPES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key '{key}'", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


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
    from velox_cache import ConfigError, KVCacheConfig  # velox_cache loads MLX: only when a spec is parsed

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
        auto = item.get("eviction") == "auto"
        if auto:  # prefill_end where the prompt fits the context, streaming where it does not
            if item.get("method", "full") == "full":
                raise SpecError(f"{item_where}.eviction: 'auto' is for compressed methods; the full cache evicts nothing")
            item["eviction"] = "prefill_end"
        try:
            config = KVCacheConfig.from_dict(item, where=item_where)
        except ConfigError as exc:
            raise SpecError(str(exc)) from None
        if auto:
            try:  # how it reads a document past the context (Variant.for_document)
                dataclasses.replace(config, eviction="streaming")
            except ConfigError as exc:
                raise SpecError(f"{item_where}.eviction: 'auto' streams a document past the model's context, "
                                f"where {exc}") from None
        if config.method == "full" and config.kv_bits:
            raise SpecError(
                f"{item_where}.kv_bits: the full variant is the job's reference (every other variant is compared to "
                "its float output); quantize a compressed variant, or run a full cache at kv_bits in the library"
            )
        if config.method != "full" and config.scoring is None:
            config = dataclasses.replace(config, scoring="observed")
        name = str(name) if name is not None else (
            config.method if config.method == "full" else f"{config.method}-{config.budget}"
        )
        variants.append(Variant(name, config, auto_eviction=auto))
    names = [v.name for v in variants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SpecError(f"{where}.variants: duplicate variant name '{duplicates[0]}' (give each a 'name')")
    return variants


def parse_spec(raw: Any, where: str = "spec") -> JobSpec:
    """Validate a spec mapping; errors name the field."""
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: expected a mapping at the top level")
    top = {"name", "model", "input", "generation", "cache", "variants", "limits", "output", "engine", "frontier"}
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
            engine=_section(EngineSpec, raw.get("engine"), "engine"),
            frontier=_section(FrontierSpec, raw.get("frontier"), "frontier"),
        )
        validate(spec)
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None
    return spec


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a YAML job spec; relative input and db paths are taken as given (cwd)."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: job spec file not found")
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None
    spec = parse_spec(raw, where=str(path))
    spec.source = str(path)
    return spec
