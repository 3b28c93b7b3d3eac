"""Budgets: how many tokens each layer keeps.

The pure schedules (``schedules``: ``pyramid_budgets``, ``squeeze_budgets``),
the per-layer allocators a cache holds (``allocators``) and the squeeze
coordinator that measures a stack's layers once and publishes their budgets
(``coordinator``).

Layer: beside ``kernels/`` at the bottom. Imports only ``velox_cache.config``.
"""
