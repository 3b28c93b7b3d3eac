"""The cache: one layer's mlx-lm cache protocol and its parts.

``base.EvictingKVCache`` speaks mlx-lm's protocol and delegates to its parts:
storage and eviction mechanics (``slots``, ``head_slots``), what ranks tokens
(``scoring``, ``signals``, ``selection``), when to evict (``timing``), where a
sequence stands (``phases``), a config resolved against a policy (``choices``),
byte accounting (``accounting``) and which of a model's layers Velox compresses
(``model_caches``).

Layer: above ``kernels/`` and ``budgets/``; imports only those and ``velox_cache.config``.
"""
