"""A tiny, randomly initialised mlx-lm model with a byte-level tokenizer, built offline."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_byte_tokenizer(out_dir: Path) -> int:
    """A byte-level BPE tokenizer with no merges (one token per byte); returns vocab size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return len(vocab)


def build_tiny_model_dir(out_dir: Path, model_type: str = "llama", seed: int = 0) -> Path:
    """Write a tiny mlx-lm model directory (4 layers, 4 query / 2 KV heads) and return it."""
    import importlib

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = write_byte_tokenizer(out_dir)
    config = {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"),
    }
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Larger-than-default weights give peaked, input-dependent attention.
    params = dict(tree_flatten(model.parameters()))
    params = {k: (v * 4 if k.endswith(("q_proj.weight", "k_proj.weight")) else v) for k, v in params.items()}
    mx.save_safetensors(str(out_dir / "model.safetensors"), params)
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir
