"""``observe(model)``: let Velox caches see the real queries of every attention call.

mlx-lm never hands queries to a cache. Every mlx-lm architecture whose
attention calls ``scaled_dot_product_attention(queries, keys, values,
cache=..., scale=..., mask=..., sinks=...)`` from its own module can be
observed: inside the context that function is wrapped so that a Velox cache
computes the attention itself (scoring tokens with the same softmax on the CPU
backend) and every other cache falls through to the original. A call with
arguments the observer does not know also falls through; the Velox cache then
notices at its next call that it was not observed, warns, and scores that layer
with the key proxy from then on (never silently mis-scored).
"""

from __future__ import annotations

import contextlib
import sys
import threading

import mlx.core as mx

ATTENTION_FUNCTION = "scaled_dot_product_attention"
_active = 0
_lock = threading.Lock()


class ObservationError(RuntimeError):
    """The model's attention cannot be observed."""


def is_observing() -> bool:
    """True inside any ``observe`` context."""
    return _active > 0


def shared_softmax_default() -> bool:
    """Compute observed attention with one shared softmax (the CPU backend), not the fused kernel."""
    return mx.default_device() == mx.cpu


def _attention_modules(model) -> list:
    modules = {type(model).__module__}
    for _, child in model.named_modules():
        modules.add(type(child).__module__)
    found = [sys.modules[name] for name in sorted(modules) if name in sys.modules]
    return [m for m in found if callable(getattr(m, ATTENTION_FUNCTION, None))]


def _wrap(original):
    def observed_attention(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None, **kwargs):
        if hasattr(cache, "observe_attention") and not kwargs:
            return cache.observe_attention(queries, keys, values, scale, mask, sinks=sinks)
        if sinks is not None:
            kwargs["sinks"] = sinks
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    observed_attention.__wrapped__ = original
    return observed_attention


@contextlib.contextmanager
def observe(model):
    """Observe ``model``'s attention while the block runs; restores the model on exit, always.

    Example::

        with velox_cache.observe(model):
            mlx_lm.generate(model, tokenizer, prompt, prompt_cache=caches)
    """
    global _active
    modules = _attention_modules(model)
    if not modules:
        raise ObservationError(
            f"{type(model).__module__}.{type(model).__name__} cannot be observed: none of its "
            f"modules calls mlx-lm's `{ATTENTION_FUNCTION}`; use scoring='key_proxy'"
        )
    originals = [(module, getattr(module, ATTENTION_FUNCTION)) for module in modules]
    with _lock:
        for module, original in originals:
            setattr(module, ATTENTION_FUNCTION, _wrap(original))
        _active += 1
    try:
        yield model
    finally:
        with _lock:
            for module, original in reversed(originals):
                setattr(module, ATTENTION_FUNCTION, original)
            _active -= 1
