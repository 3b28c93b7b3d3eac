"""Velox: KV caches for mlx-lm that keep each layer within a token budget.

Install on a model for ``mlx_lm.generate`` in one line::

    prompt_cache = KVCacheBuilder.for_model(model, KVCacheConfig(method="pyramidkv", budget=256))

Faster attention on MLX's CPU backend, with any caches::

    with velox_cache.fast_attention(model):
        mlx_lm.generate(model, tokenizer, prompt)
"""

from .attend import AttentionResult, attend, attend_and_score
from .budgets import pyramid_budgets, squeeze_budgets
from .builder import KVCacheBuilder, KVCacheFactory
from .config import ConfigError, KVCacheConfig
from .coordinator import SqueezeCoordinator
from .observe import ObservationError, fast_attention, observe
from .policies import (
    FullKVCache,
    H2OCache,
    PyramidKVCache,
    SnapKVCache,
    SqueezeAttentionCache,
    StreamingLLMCache,
    TOVACache,
)
from .snapshot import snapshot

__all__ = [
    "AttentionResult",
    "ConfigError",
    "FullKVCache",
    "H2OCache",
    "KVCacheBuilder",
    "KVCacheConfig",
    "KVCacheFactory",
    "ObservationError",
    "PyramidKVCache",
    "SnapKVCache",
    "SqueezeAttentionCache",
    "SqueezeCoordinator",
    "StreamingLLMCache",
    "TOVACache",
    "attend",
    "attend_and_score",
    "fast_attention",
    "observe",
    "pyramid_budgets",
    "snapshot",
    "squeeze_budgets",
]
