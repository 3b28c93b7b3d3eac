"""Job specs: YAML in, validated dataclasses out, before any model is loaded.

Every error is a ``SpecError`` whose message names the file and the field
(``jobs/x.yaml: generation.max_tokens: expected an integer, got 'ten'``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import glob
import hashlib
import json
import math
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import yaml

from .defaults import DEFAULT_DB

if TYPE_CHECKING:
    from velox_cache import KVCacheConfig

ON_TOO_LONG = ("truncate", "skip", "fail")
ENGINES = ("in-process", "ray")
SEED_LIMIT = 2**64  # mlx.random.seed takes an unsigned 64-bit integer


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
        return [self.text_column if name == "text" else name for name in template_fields(self.prompt_template)]

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
    on_too_long: Optional[str] = None  # truncate for text_column, fail for a ready prompt_column
    max_documents: Optional[int] = None


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
    engine: EngineSpec = field(default_factory=EngineSpec)
    source: Optional[str] = None  # the spec file

    def settings_hash(self) -> str:
        """Hash of the job's settings apart from its variants (recorded per run as ``spec_hash``)."""
        settings = {
            "model": self.model,
            "input": {k: v for k, v in dataclasses.asdict(self.input).items() if k != "path"},
            "generation": dataclasses.asdict(self.generation),
            "limits": {k: v for k, v in dataclasses.asdict(self.limits).items() if k != "max_documents"},
        }
        return _hash(settings)

    def output_settings_hash(self, **extra) -> str:
        """Hash of what decides a document's output besides its prompt tokens and variant.

        That is the model (``extra`` adds how it was loaded, e.g. its weights) and the
        generation settings; limits are left out: they decide the prompt, and the
        prompt's own tokens are hashed separately.
        """
        return _hash({"model": self.model, "generation": dataclasses.asdict(self.generation), **extra})

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


def variant_hash(variant: Variant) -> str:
    return _hash({"name": variant.name, **dataclasses.asdict(variant.cache)})


_BRACES_HINT = "to write braces as text, double them: {{ and }}"


def template_fields(template: str) -> list[str]:
    """The column fields of a prompt template, parsed as ``str.format`` parses it.

    Only plain ``{column}`` fields are allowed; anything else (``{}``, ``{0}``,
    ``{text.upper}``, ``{text!r}``, a stray brace, JSON such as ``{"a": 1}``)
    raises ``SpecError`` saying to double literal braces.
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise SpecError(f"input.prompt_template: {exc}; {_BRACES_HINT}") from None
    names = []
    for _, name, format_spec, conversion in parsed:
        if name is None:
            continue
        plain = name and name.strip() == name and not name.isdigit() and not any(c in name for c in ".[]{}'\"")
        if not plain or format_spec or conversion:
            field_text = "{" + name + (f"!{conversion}" if conversion else "") + (f":{format_spec}" if format_spec else "") + "}"
            raise SpecError(
                f"input.prompt_template: '{field_text}' is not a column field (write {{column}}); {_BRACES_HINT}"
            )
        names.append(name)
    return names


# ----- validation -----------------------------------------------------------------------------

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
    top = {"name", "model", "input", "generation", "cache", "variants", "limits", "output", "engine"}
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
        )
        validate(spec)
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None
    return spec


def validate(spec: JobSpec) -> None:
    """Check a spec's values (again after command-line overrides); errors name the field.

    Fills the one default that depends on another field: ``limits.on_too_long`` is
    ``truncate`` for a ``text_column`` and ``fail`` for a ready ``prompt_column``.
    """
    inp, gen, lim = spec.input, spec.generation, spec.limits
    if not inp.path.strip():
        raise SpecError("input.path: must not be empty")
    if bool(inp.text_column) == bool(inp.prompt_column):
        raise SpecError("input: give exactly one of text_column and prompt_column")
    if inp.text_column:
        fields = template_fields(inp.prompt_template)
        if "text" not in fields:
            hint = " ({{text}} is the literal text {text})" if "{{text}}" in inp.prompt_template else ""
            raise SpecError(f"input.prompt_template: must contain the field {{text}}{hint}")
    if gen.max_tokens < 1:
        raise SpecError(f"generation.max_tokens: must be at least 1, got {gen.max_tokens}")
    if not math.isfinite(gen.temperature):
        raise SpecError(f"generation.temperature: must be a finite number, got {gen.temperature}")
    if gen.temperature < 0:
        raise SpecError(f"generation.temperature: must be at least 0, got {gen.temperature}")
    if not 0 < gen.top_p <= 1:
        raise SpecError(f"generation.top_p: must be in (0, 1], got {gen.top_p}")
    if not 0 <= gen.seed < SEED_LIMIT:
        raise SpecError(f"generation.seed: must be in [0, 2**64), got {gen.seed}")
    if gen.prefill_step_size < 1:
        raise SpecError(f"generation.prefill_step_size: must be at least 1, got {gen.prefill_step_size}")
    if lim.on_too_long is None:
        lim.on_too_long = "fail" if inp.prompt_column else "truncate"
    if lim.on_too_long not in ON_TOO_LONG:
        raise SpecError(f"limits.on_too_long: {lim.on_too_long!r} is not one of {', '.join(ON_TOO_LONG)}")
    if lim.on_too_long == "truncate" and inp.prompt_column:
        raise SpecError(
            "limits.on_too_long: 'truncate' cannot cut a ready prompt (input.prompt_column); use skip or fail"
        )
    if lim.max_prompt_tokens is not None and lim.max_prompt_tokens < 1:
        raise SpecError(f"limits.max_prompt_tokens: must be at least 1, got {lim.max_prompt_tokens}")
    if lim.max_documents is not None and lim.max_documents < 1:
        raise SpecError(f"limits.max_documents: must be at least 1, got {lim.max_documents}")
    _validate_engine(spec.engine)


def _validate_engine(engine: EngineSpec) -> None:
    if engine.name not in ENGINES:
        raise SpecError(f"engine.name: {engine.name!r} is not one of {', '.join(ENGINES)}")
    if engine.workers is not None and engine.workers < 1:
        raise SpecError(f"engine.workers: must be at least 1, got {engine.workers}")
    if engine.cpus_per_worker < 1:
        raise SpecError(f"engine.cpus_per_worker: must be at least 1, got {engine.cpus_per_worker}")
    if engine.max_retries < 0:
        raise SpecError(f"engine.max_retries: must be at least 0, got {engine.max_retries}")
    if engine.address is not None and not engine.address.strip():
        raise SpecError("engine.address: must not be empty (leave it out to start Ray on this machine)")
    if engine.name == "in-process":
        for name in ("workers", "address"):
            if getattr(engine, name) is not None:
                raise SpecError(f"engine.{name}: only the ray engine has {name} (set engine.name: ray or --engine ray)")


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
