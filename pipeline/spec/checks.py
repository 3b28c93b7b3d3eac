"""Job spec values checked, field by field: ``SpecError`` names the field (or the option) at fault."""

from __future__ import annotations

import math
import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import EngineSpec, JobSpec

ON_TOO_LONG = ("truncate", "skip", "fail")
ENGINES = ("in-process", "ray")
SEED_LIMIT = 2**64  # mlx.random.seed takes an unsigned 64-bit integer


class SpecError(ValueError):
    """The job spec or its input is invalid; the message names the field, column or file."""


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


def validate(spec: JobSpec) -> None:
    """Check a spec's values (again after command-line overrides); errors name the field.

    Fills the one default that depends on another field: ``limits.on_too_long`` is
    ``truncate`` for a ``text_column`` and ``fail`` for a ready ``prompt_column``.
    """
    inp, gen, lim = spec.input, spec.generation, spec.limits
    _check_frontier(spec.frontier.budgets)
    _check_frontier_bits(spec.frontier.bits)
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
    if gen.top_k < 0:
        raise SpecError(f"generation.top_k: must be at least 0 (0: off), got {gen.top_k}")
    if not 0 <= gen.min_p <= 1:
        raise SpecError(f"generation.min_p: must be in [0, 1] (0: off), got {gen.min_p}")
    penalty = gen.repetition_penalty
    if penalty is not None and not (math.isfinite(penalty) and penalty > 0):
        raise SpecError(f"generation.repetition_penalty: must be a positive number (1 or unset: off), got {penalty}")
    if gen.repetition_context_size < 1:
        raise SpecError(f"generation.repetition_context_size: must be at least 1, got {gen.repetition_context_size}")
    if gen.decode_batch_size < 1:
        raise SpecError(f"generation.decode_batch_size: must be at least 1 (1: one sequence at a time), got {gen.decode_batch_size}")
    if gen.decode_batch_memory_mb < 1:
        raise SpecError(f"generation.decode_batch_memory_mb: must be at least 1, got {gen.decode_batch_memory_mb}")
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
    _check_frontier_points(spec)


def _check_frontier_points(spec: JobSpec) -> None:
    """Every frontier point can be built: each compressed variant's policy at each budget and ``kv_bits``.

    A budget below what the variant must keep (``n_sink + 1``) names ``frontier.budgets[i]``; a bits
    level the variant cannot hold (``head_budgets: adaptive`` at ``kv_bits``) names ``frontier.bits[j]``.
    """
    from velox_cache.config import ConfigError  # velox_cache loads MLX: only here

    for variant in spec.variants:
        if variant.cache.method == "full":
            continue
        for i, budget in enumerate(spec.frontier.budgets):
            try:
                variant.at_point(budget, variant.cache.kv_bits)
            except ConfigError as exc:
                least = variant.cache.n_sink + 1
                raise SpecError(
                    f"frontier.budgets[{i}]: variant '{variant.name}' must keep at least {least} tokens "
                    f"(n_sink {variant.cache.n_sink} + 1), got {budget!r}"
                ) from exc
        for j, bits in enumerate(spec.frontier.bits):
            try:
                variant.at_point(variant.cache.budget, bits)
            except ConfigError as exc:
                raise SpecError(f"frontier.bits[{j}]: variant '{variant.name}' cannot be measured at {bits!r}: {exc}") from None


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


def _check_frontier_bits(bits) -> None:
    """``frontier.bits``: a list of ``kv_bits`` levels (null for float, 8, 4), each once."""
    from velox_cache.config import KV_BITS  # velox_cache loads MLX: only here

    if not isinstance(bits, list):
        raise SpecError(f"frontier.bits: expected a list like [null, 8, 4], got {bits!r}")
    for i, level in enumerate(bits):
        if level is not None and (isinstance(level, bool) or level not in KV_BITS):
            raise SpecError(f"frontier.bits[{i}]: {level!r} is not null (float) or one of {', '.join(map(str, KV_BITS))}")
    if len(set(bits)) != len(bits):
        raise SpecError("frontier.bits: each level once")


def _check_frontier(budgets) -> None:
    """``frontier.budgets``: a list of token counts (at least 1) or shares (``"25%"``), each once."""
    from velox_cache.config import ConfigError, parse_budget_fraction  # velox_cache loads MLX: only here

    if not isinstance(budgets, list):
        raise SpecError(f"frontier.budgets: expected a list of budgets, got {budgets!r}")
    for i, budget in enumerate(budgets):
        where = f"frontier.budgets[{i}]"
        if isinstance(budget, bool) or not isinstance(budget, (int, str)):
            raise SpecError(f"{where}: expected a number of tokens or a percentage like '25%', got {budget!r}")
        try:
            if parse_budget_fraction(budget, where) is None and budget < 1:
                raise SpecError(f"{where}: must be at least 1 token, got {budget}")
        except ConfigError as exc:
            raise SpecError(str(exc)) from None
    if len({str(b) for b in budgets}) != len(budgets):
        raise SpecError("frontier.budgets: each budget once")
