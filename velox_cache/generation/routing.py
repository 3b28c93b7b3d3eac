"""Which attention a model runs on for caches built from some configs: one rule, used everywhere.

``batch_generate``, the job runner (``pipeline.generation``) and teacher forcing
all ask ``attention_routing``; none decides on its own.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

from ..config import KVCacheConfig
from ..kernels.observe import can_route, fast_attention, observe


def wants_observation(config: KVCacheConfig) -> bool:
    """True when ``config``'s caches rank tokens by observed attention.

    ``scoring='observed'`` asks for it; ``scoring`` left open (None) takes it
    wherever the model can be observed (the key proxy otherwise). A full cache
    ranks nothing.
    """
    return config.method != "full" and config.scoring in ("observed", None)


def attention_routing(model, configs: Iterable[KVCacheConfig]):
    """The context to run ``model`` in for caches built from ``configs`` (rows of one batch, or one stack).

    - ``observe(model)`` when any of them wants observed attention
      (``wants_observation``); a model that cannot be routed then raises
      ``ObservationError`` if one asked for ``scoring='observed'`` outright,
      and runs on its own attention (the open ones score by the key proxy) if not;
    - else ``fast_attention(model)`` (Velox's attention, with any caches) where
      the model can be routed, and its own attention where it cannot.
    """
    configs = list(configs)
    if not configs:
        raise ValueError("configs: at least one config")
    if any(c.method != "full" and c.scoring == "observed" for c in configs):
        return observe(model)
    if not can_route(model):
        return contextlib.nullcontext()
    if any(wants_observation(c) for c in configs):
        return observe(model)
    return fast_attention(model)
