"""Generation: running stacks of caches over prompts.

Prefill by phases (``prefill``), decoding alone or many rows in one batch
(``decode``, ``batching``), teacher forcing several stacks in one call
(``forcing``), token sampling (``sampling``) and snapshots of a stack
(``snapshot``).

Layer: the top. May import every other layer (``builder``, ``policies/``,
``cache/``, ``kernels/``, ``budgets/``, ``config``); nothing in velox_cache imports it
but the package's own ``__init__``.
"""
