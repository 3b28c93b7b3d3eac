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

The package is in layers, one folder each, imports running downward only:
``generation/`` -> ``builder.py`` -> ``policies/`` -> ``cache/`` -> ``kernels/`` and
``budgets/``, with ``config.py`` below them all.
"""

from .budgets.coordinator import SqueezeCoordinator
from .budgets.schedules import pyramid_budgets, squeeze_budgets
from .builder import KVCacheBuilder, KVCacheFactory
from .cache import phases
from .cache.model_caches import UnsupportedModelError
from .cache.phases import Phase
from .config import ConfigError, KVCacheConfig
from .generation.batching import BatchUnsupported
from .generation.decode import BatchResponse, batch_generate
from .generation.prefill import ContextError, model_context, prefill_phases
from .generation.snapshot import snapshot
from .kernels.attend import AttentionResult, attend, attend_and_score
from .kernels.masks import MaskMismatchError
from .kernels.observe import ObservationError, fast_attention, observe
from .kernels.rope import RopeError, RotaryShift
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
