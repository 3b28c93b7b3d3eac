"""Velox: KV caches for mlx-lm that keep each layer within a token budget.

Install on a model for ``mlx_lm.generate`` in one line::

    prompt_cache = KVCacheBuilder.for_model(model, KVCacheConfig(method="pyramidkv", budget=256))
"""

from .budgets import pyramid_budgets, squeeze_budgets
from .builder import KVCacheBuilder, KVCacheFactory
from .config import ConfigError, KVCacheConfig
from .coordinator import SqueezeCoordinator
from .masks import MaskMismatchError
from .model_caches import UnsupportedModelError
from .observe import ObservationError, observe
from .policies import (
    FullKVCache,
    H2OCache,
    PyramidKVCache,
    SnapKVCache,
    SqueezeAttentionCache,
    StreamingLLMCache,
    TOVACache,
)

__all__ = [
    "ConfigError",
    "FullKVCache",
    "H2OCache",
    "KVCacheBuilder",
    "KVCacheConfig",
    "KVCacheFactory",
    "MaskMismatchError",
    "ObservationError",
    "PyramidKVCache",
    "SnapKVCache",
    "SqueezeAttentionCache",
    "SqueezeCoordinator",
    "StreamingLLMCache",
    "TOVACache",
    "UnsupportedModelError",
    "observe",
    "pyramid_budgets",
    "squeeze_budgets",
]
