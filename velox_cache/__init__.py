"""Velox: KV caches for mlx-lm that keep each layer within a token budget.

Install on a model for ``mlx_lm.generate`` in one line::

    prompt_cache = KVCacheBuilder.for_model(model, KVCacheConfig(method="pyramidkv", budget=256))

Long documents in bounded memory (streaming prefill, phases told)::

    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="pyramidkv", budget=512, eviction="streaming"))
    logits = prefill_phases(model, caches, prefix=p, document=d, instruction=q)
"""

from .budgets import pyramid_budgets, squeeze_budgets
from .builder import KVCacheBuilder, KVCacheFactory
from .config import ConfigError, KVCacheConfig
from .coordinator import SqueezeCoordinator
from . import phases
from .observe import ObservationError, observe
from .phases import Phase
from .policies import (
    FullKVCache,
    H2OCache,
    PyramidKVCache,
    SnapKVCache,
    SqueezeAttentionCache,
    StreamingLLMCache,
    TOVACache,
)
from .prefill import ContextError, model_context, prefill_phases
from .rope import RopeError, RotaryShift

__all__ = [
    "ConfigError",
    "ContextError",
    "FullKVCache",
    "H2OCache",
    "KVCacheBuilder",
    "KVCacheConfig",
    "KVCacheFactory",
    "ObservationError",
    "Phase",
    "PyramidKVCache",
    "RopeError",
    "RotaryShift",
    "SnapKVCache",
    "SqueezeAttentionCache",
    "SqueezeCoordinator",
    "StreamingLLMCache",
    "TOVACache",
    "model_context",
    "observe",
    "phases",
    "prefill_phases",
    "pyramid_budgets",
    "squeeze_budgets",
]
