"""Tiny configurations of representative mlx-lm architectures, written for Velox's own tests.

Each entry builds in well under a second on a CPU and needs no network: a
global-attention model, sliding-window hybrids, a state-space hybrid, a model
sharing KV between layers, models that build one array mask for every layer
and a pure state-space model that Velox refuses.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
from mlx.utils import tree_map

VOCAB = 96

TINY_CONFIGS = {
    # sliding-window hybrid: RotatingKVCache on 5 of 6 layers, query_pre_attn_scalar scale
    "gemma3_text": dict(
        hidden_size=64, num_hidden_layers=6, intermediate_size=96, num_attention_heads=4, head_dim=16,
        num_key_value_heads=2, sliding_window=8, sliding_window_pattern=3, query_pre_attn_scalar=144,
        rms_norm_eps=1e-6,
    ),
    # sliding-window hybrid with attention sinks and a mixture of experts
    "gpt_oss": dict(
        num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, hidden_size=64, intermediate_size=64,
        head_dim=16, num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    # state-space hybrid: every layer is CacheList(ArraysCache, KVCache)
    "falcon_h1": dict(
        hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
        intermediate_size=96, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
        mamba_chunk_size=8, mamba_n_groups=1,
    ),
    # KV shared between layers: two kv-reuse layers read the last cache's keys and values
    "afm7": dict(hidden_dim=64, num_layers=4, num_kv_reuse_layers=2, num_heads=4, num_kv_heads=2),
    # one array mask for every layer, attention written by hand (not observable)
    "gemma2": dict(
        hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4, head_dim=16,
        rms_norm_eps=1e-6, num_key_value_heads=2,
    ),
    # multi-head latent attention (keys derived from a stored latent) and one array mask for every layer
    "deepseek_v3": dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1,
    ),
    # nothing to compress: every layer is a state-space layer
    "mamba": dict(
        hidden_size=64, intermediate_size=128, state_size=8, num_hidden_layers=2, conv_kernel=4,
        use_bias=False, use_conv_bias=True, time_step_rank=8,
    ),
}


def build(model_type: str, seed: int = 0):
    """A float32 instance of ``model_type`` from ``TINY_CONFIGS`` with random weights."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = {"model_type": model_type, "vocab_size": VOCAB, **TINY_CONFIGS[model_type]}
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    return model
