"""Velox: KV caches for mlx-lm that keep each layer within a token budget.

Install on a model for ``mlx_lm.generate`` in one line::

    prompt_cache = KVCacheBuilder.for_model(model, KVCacheConfig(method="pyramidkv", budget=256))

Long documents in bounded memory (streaming prefill, phases told)::

    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="pyramidkv", budget=512, eviction="streaming"))
    logits = prefill_phases(model, caches, prefix=p, document=d, instruction=q)

Many prompts, each with its own compressed stack, decoding in one batch::

    texts = velox_cache.batch_generate(model, tokenizer, prompts, KVCacheConfig(method="pyramidkv", budget=128)).texts

Faster attention on MLX's CPU backend, with any caches::

    with velox_cache.fast_attention(model):
        mlx_lm.generate(model, tokenizer, prompt)
"""

from .attend import AttentionResult, attend, attend_and_score
from .budgets import pyramid_budgets, squeeze_budgets
from .builder import KVCacheBuilder, KVCacheFactory
from .config import ConfigError, KVCacheConfig
from .batching import BatchUnsupported
from .decode import BatchResponse, batch_generate
from .coordinator import SqueezeCoordinator
from . import phases
from .masks import MaskMismatchError
from .model_caches import UnsupportedModelError
from .observe import ObservationError, fast_attention, observe
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
from .snapshot import snapshot

__all__ = [
    "AttentionResult",
    "BatchResponse",
    "BatchUnsupported",
    "ConfigError",
    "ContextError",
    "FullKVCache",
    "H2OCache",
    "KVCacheBuilder",
    "KVCacheConfig",
    "KVCacheFactory",
    "MaskMismatchError",
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
    "UnsupportedModelError",
    "attend",
    "attend_and_score",
    "batch_generate",
    "fast_attention",
    "model_context",
    "observe",
    "phases",
    "prefill_phases",
    "pyramid_budgets",
    "snapshot",
    "squeeze_budgets",
]
