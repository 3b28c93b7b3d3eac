"""Turn a llama-architecture GGUF file into a standard mlx-lm model directory.

The directory holds ``config.json``, ``model.safetensors`` (weights kept in the
GGUF's own quantization, mapped to mlx-lm names) and the tokenizer files
(``tokenizer.json``, ``tokenizer_config.json`` with the chat template), so that
``mlx_lm.load(directory)`` works with no network. MLX is imported by the functions
that read or write tensors, not by importing this module.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

GGUF_TO_MLX_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
GGML_BLOCK_SIZE = 32  # every ggml quant type used here packs 32 values per block
COMPLETE_MARKER = ".velox-import-complete"


class ModelImportError(RuntimeError):
    """A GGUF file could not be turned into a model directory."""


def read_gguf(path: str | os.PathLike) -> tuple[dict, dict]:
    """Read a GGUF file's tensors and metadata, with errors that name the file."""
    import mlx.core as mx

    path = Path(path)
    if not path.is_file():
        raise ModelImportError(f"GGUF file not found: {path}")
    try:
        weights, metadata = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # mlx raises plain RuntimeError/ValueError here
        raise ModelImportError(
            f"{path} is not a readable GGUF file (corrupt or truncated?): {exc}"
        ) from exc
    if not weights or "general.architecture" not in metadata:
        raise ModelImportError(f"{path} holds no model tensors or no GGUF header metadata")
    return weights, metadata


def _scalar(metadata: dict, key: str, path: Path):
    import mlx.core as mx

    if key not in metadata:
        raise ModelImportError(f"{path}: GGUF metadata lacks '{key}'")
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def mlx_name(gguf_name: str) -> str:
    """Map a GGUF tensor name (``blk.3.attn_q.weight``) to its mlx-lm llama name."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part not in GGUF_TO_MLX_NAMES:
            raise ModelImportError(f"unknown GGUF tensor '{gguf_name}'")
        return f"model.layers.{layer}.{GGUF_TO_MLX_NAMES[part]}.{suffix}"
    if stem not in TOP_LEVEL_NAMES:
        raise ModelImportError(f"unknown GGUF tensor '{gguf_name}'")
    return f"{TOP_LEVEL_NAMES[stem]}.{suffix}"


def build_config(weights: dict, metadata: dict, path: Path) -> dict:
    """The mlx-lm llama ``config.json`` for a GGUF file's metadata and tensors."""
    arch = _scalar(metadata, "general.architecture", path)
    if arch != "llama":
        raise ModelImportError(f"{path}: architecture '{arch}' is not supported (only llama)")

    def meta(key):
        return _scalar(metadata, f"llama.{key}", path)

    vocab_size = (
        meta("vocab_size")
        if "llama.vocab_size" in metadata
        else len(metadata["tokenizer.ggml.tokens"])
    )
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": meta("embedding_length"),
        "num_hidden_layers": meta("block_count"),
        "intermediate_size": meta("feed_forward_length"),
        "num_attention_heads": meta("attention.head_count"),
        "num_key_value_heads": meta("attention.head_count_kv"),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab_size,
        "max_position_embeddings": meta("context_length"),
        "rope_theta": float(meta("rope.freq_base")) if "llama.rope.freq_base" in metadata else 10000.0,
        # GGUF stores Q/K rows permuted for interleaved ("traditional") RoPE.
        "rope_traditional": True,
        "tie_word_embeddings": "output.weight" not in weights,
    }
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in metadata:
            config[key] = _scalar(metadata, f"tokenizer.ggml.{key}", path)
    quantization = _quantization(weights)
    if quantization:
        config["quantization"] = quantization
    return config


def _quantization(weights: dict) -> dict:
    """mlx-lm's quantization block: the most common bit width plus per-layer overrides."""
    bits_by_layer = {}
    for name, weight in weights.items():
        if not name.endswith(".weight") or name[: -len("weight")] + "scales" not in weights:
            continue
        scales = weights[name[: -len("weight")] + "scales"]
        bits = weight.shape[-1] * 32 // (scales.shape[-1] * GGML_BLOCK_SIZE)
        bits_by_layer[mlx_name(name)[: -len(".weight")]] = int(bits)
    if not bits_by_layer:
        return {}
    values = list(bits_by_layer.values())
    common = max(set(values), key=values.count)
    quantization = {"group_size": GGML_BLOCK_SIZE, "bits": common}
    for layer, bits in sorted(bits_by_layer.items()):
        if bits != common:
            quantization[layer] = {"group_size": GGML_BLOCK_SIZE, "bits": bits}
    return quantization


def build_tokenizer_files(metadata: dict, path: Path, out_dir: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` from GGUF metadata."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, AddedToken

    model_kind = metadata.get("tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ModelImportError(f"{path}: tokenizer model '{model_kind}' is not supported (only gpt2 BPE)")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    token_types = metadata.get("tokenizer.ggml.token_type")
    token_types = token_types.tolist() if token_types is not None else [1] * len(tokens)

    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, token_types) if kind == 3]  # GGUF CONTROL
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.save(str(out_dir / "tokenizer.json"))

    def token(key):
        full = f"tokenizer.ggml.{key}"
        return tokens[_scalar(metadata, full, path)] if full in metadata else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(_scalar(metadata, "tokenizer.ggml.add_bos_token", path))
        if "tokenizer.ggml.add_bos_token" in metadata
        else False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _scalar(metadata, "llama.context_length", path),
    }
    if "tokenizer.chat_template" in metadata:
        tokenizer_config["chat_template"] = metadata["tokenizer.chat_template"]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special = {k: v for k, v in tokenizer_config.items() if k.endswith("_token") and v}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Import ``gguf_path`` into the model directory ``out_dir``, once, atomically.

    If ``out_dir`` already holds a complete import it is returned as is. The
    directory is built under a temporary name beside it and renamed into place
    only when complete, so an interrupted import never leaves a half-written
    directory behind.
    """
    import mlx.core as mx

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if (out_dir / COMPLETE_MARKER).is_file():
        return out_dir
    weights, metadata = read_gguf(gguf_path)
    config = build_config(weights, metadata, gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.importing-", dir=out_dir.parent))
    try:
        staging.chmod(0o755)
        mx.save_safetensors(
            str(staging / "model.safetensors"),
            {mlx_name(name): array for name, array in weights.items()},
            metadata={"format": "mlx"},
        )
        build_tokenizer_files(metadata, gguf_path, staging)
        config["velox_source"] = {"gguf": str(gguf_path.resolve()), "size": gguf_path.stat().st_size}
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / COMPLETE_MARKER).write_text(str(gguf_path.resolve()))
        if out_dir.exists():
            shutil.rmtree(out_dir)  # an older, incomplete directory (no marker)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if (out_dir / COMPLETE_MARKER).is_file():  # a concurrent import won the race
            return out_dir
        raise
    return out_dir
