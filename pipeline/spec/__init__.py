"""Job specs: YAML in, validated dataclasses out, before any model is loaded.

Every error is a ``SpecError`` whose message names the file and the field
(``jobs/x.yaml: generation.max_tokens: expected an integer, got 'ten'``). The
dataclasses and hashes are in ``model``, the value checks in ``checks`` and the YAML
reading in ``loading``; everything is importable from ``pipeline.spec``. Importing it
loads no MLX: ``velox_cache`` is imported when a spec's variants are parsed.
"""

from .checks import ENGINES, ON_TOO_LONG, SEED_LIMIT, SpecError, template_fields, validate
from .loading import load_spec, parse_spec
from .model import (
    EngineSpec,
    GenerationSpec,
    InputSpec,
    JobSpec,
    LimitsSpec,
    OutputSpec,
    Variant,
    input_files,
    quantization_settings,
    variant_hash,
)

__all__ = [
    "ENGINES", "ON_TOO_LONG", "SEED_LIMIT", "EngineSpec", "GenerationSpec", "InputSpec", "JobSpec", "LimitsSpec",
    "OutputSpec", "SpecError", "Variant", "input_files", "load_spec", "parse_spec", "template_fields", "validate",
    "quantization_settings", "variant_hash",
]
