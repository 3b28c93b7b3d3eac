"""``observe(model)`` and ``fast_attention(model)``: route a model's attention through Velox.

mlx-lm never hands queries to a cache. Every mlx-lm architecture whose
attention calls ``scaled_dot_product_attention(queries, keys, values,
cache=..., scale=..., mask=..., sinks=...)`` from its own module can be
routed: inside either context that function is wrapped so that a Velox cache
computes the attention itself (scoring tokens from the same pass when its
scoring is observed; attention sinks, as in gpt-oss, count in both), every
other cache (plain ``KVCache`` included) gets ``velox_cache.attend`` (Velox's
kernel on the CPU backend, the fused kernel elsewhere), and quantized caches,
calls with attention sinks or other arguments, and calls Velox's kernel cannot
take (``attend.kernel_supports``) fall through to the original. ``observe``
also makes caches whose scoring is left open score by observed attention.

A call on a Velox cache with arguments the wrapper does not know falls through
to the original too; the cache then notices at its next call that it was not
observed, warns, and scores that layer with the key proxy from then on (never
silently mis-scored).
"""

from __future__ import annotations

import contextlib
import sys
import threading

from .attend import attend, kernel_supports, uses_kernel
from .elementwise import ACTIVATIONS, METHODS

ATTENTION_FUNCTION = "scaled_dot_product_attention"
_active = 0  # observe contexts open
_routing = 0  # observe and fast_attention contexts open
_lock = threading.Lock()


class ObservationError(RuntimeError):
    """The model's attention cannot be observed (or routed through Velox attention)."""


def is_observing() -> bool:
    """True inside any ``observe`` context."""
    return _active > 0


def is_routed() -> bool:
    """True inside any ``observe`` or ``fast_attention`` context: Velox caches get their attention calls."""
    return _routing > 0


def _model_modules(model) -> list:
    """The Python modules that define ``model``'s class and its submodules' classes."""
    modules = {type(model).__module__}
    for _, child in model.named_modules():
        modules.add(type(child).__module__)
    return [sys.modules[name] for name in sorted(modules) if name in sys.modules]


def _attention_modules(model) -> list:
    return [m for m in _model_modules(model) if callable(getattr(m, ATTENTION_FUNCTION, None))]


def can_route(model) -> bool:
    """True when some module of ``model`` calls mlx-lm's attention function (``observe`` can wrap it)."""
    return bool(_attention_modules(model))


def _wrap(original):
    def velox_attention(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None, **kwargs):
        if hasattr(cache, "observe_attention") and not kwargs:
            return cache.observe_attention(queries, keys, values, scale, mask, sinks=sinks)
        if sinks is not None:
            kwargs["sinks"] = sinks
        if kwargs or hasattr(cache, "bits") or not kernel_supports(queries, keys, values, mask):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
        return attend(queries, keys, values, scale=scale, mask=mask)

    velox_attention.__wrapped__ = original
    return velox_attention


@contextlib.contextmanager
def _routed(model, *, observing: bool):
    global _active, _routing
    modules = _attention_modules(model)
    if not modules:
        what = "be observed" if observing else "use Velox attention"
        raise ObservationError(
            f"{type(model).__module__}.{type(model).__name__} cannot {what}: none of its modules calls "
            f"mlx-lm's `{ATTENTION_FUNCTION}`" + ("; use scoring='key_proxy'" if observing else "")
        )
    originals = [(module, ATTENTION_FUNCTION, getattr(module, ATTENTION_FUNCTION)) for module in modules]
    replacements = [_wrap(original) for _, _, original in originals]
    if uses_kernel():  # the activations' stand-ins go with Velox's kernel (VELOX_ATTENTION=exact: mlx-lm's own)
        for module in _model_modules(model):
            for name, stand_in in ACTIVATIONS.items():
                if callable(getattr(module, name, None)):
                    originals.append((module, name, getattr(module, name)))
                    replacements.append(stand_in)
        for (owner, name), stand_in in METHODS.items():
            originals.append((owner, name, getattr(owner, name)))
            replacements.append(stand_in)
    with _lock:
        for (module, name, _), replacement in zip(originals, replacements):
            setattr(module, name, replacement)
        _active += observing
        _routing += 1
    try:
        yield model
    finally:
        with _lock:
            for module, name, original in reversed(originals):
                setattr(module, name, original)
            _active -= observing
            _routing -= 1


def observe(model):
    """Observe ``model``'s attention while the block runs; restores the model on exit, always.

    Velox caches see the real queries (and score by them when their scoring
    is ``observed`` or left open); every other attention call runs as in
    ``fast_attention``.

    Example::

        with velox_cache.observe(model):
            mlx_lm.generate(model, tokenizer, prompt, prompt_cache=caches)
    """
    return _routed(model, observing=True)


def fast_attention(model):
    """Run ``model``'s attention on Velox's attention while the block runs, with any caches.

    On MLX's CPU backend that is Velox's kernel (see ``velox_cache.kernels.kernel``);
    on Metal and CUDA, or with ``VELOX_ATTENTION=exact``, it is the fused
    kernel, exactly as without the context. Restores the model on exit, always.

    Example::

        with velox_cache.fast_attention(model):
            mlx_lm.generate(model, tokenizer, prompt)  # plain mlx-lm caches, faster prefill on CPU
    """
    return _routed(model, observing=False)
