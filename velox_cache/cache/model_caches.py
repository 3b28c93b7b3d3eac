"""What each layer of an mlx-lm model needs, and which of those caches Velox compresses.

The model says what it needs: ``model.make_cache()`` where it defines one,
mlx-lm's ``make_prompt_cache`` otherwise. Velox compresses only plain
global-attention ``KVCache`` entries (exactly that class): sliding-window
layers (``RotatingKVCache``), state-space and linear-attention state
(``ArraysCache``), chunked attention (``ChunkedKVCache``) and anything else
stay as the model made them. A ``CacheList`` (several caches for one layer)
is compressed only when it holds exactly one plain ``KVCache`` next to
non-KV state (a convolution or SSM state): two ``KVCache`` in one layer may
be paired position by position (an indexer's keys beside the attention
keys), so they are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mlx_lm.models.cache import CacheList, KVCache, make_prompt_cache

SCALE_ATTRIBUTES = ("scale", "sm_scale", "softmax_scale")


class UnsupportedModelError(ValueError):
    """The model has no layer Velox can compress; the message names the architecture and why."""


@dataclass(frozen=True)
class Slot:
    """Where one compressible ``KVCache`` sits: ``index`` in the model's cache list, ``member`` in a ``CacheList``."""

    index: int
    member: Optional[int] = None


def model_caches(model) -> list:
    """The caches the model asks for: ``model.make_cache()`` if defined, else ``make_prompt_cache``."""
    if getattr(model, "layers", None) is None and not hasattr(model, "make_cache"):
        raise TypeError(f"model: {type(model).__name__} has no `layers`; not an mlx-lm language model")
    return list(make_prompt_cache(model))


def is_plain_kv(cache) -> bool:
    """True for mlx-lm's global-attention ``KVCache`` itself (not a subclass, not a sliding window)."""
    return type(cache) is KVCache


def compressible_slots(caches: list) -> list[Slot]:
    """Every entry of ``caches`` that Velox replaces, in order."""
    slots = []
    for index, cache in enumerate(caches):
        if is_plain_kv(cache):
            slots.append(Slot(index))
        elif isinstance(cache, CacheList):
            members = [i for i, member in enumerate(cache.caches) if is_plain_kv(member)]
            if len(members) == 1 and not any(_is_kv_like(m) for i, m in enumerate(cache.caches) if i != members[0]):
                slots.append(Slot(index, members[0]))
    return slots


def _is_kv_like(cache) -> bool:
    return hasattr(cache, "update_and_fetch")


def cache_kind(cache) -> str:
    """The class name of a cache; a ``CacheList`` lists its members: ``CacheList(ArraysCache,KVCache)``."""
    if isinstance(cache, CacheList):
        return f"CacheList({','.join(cache_kind(member) for member in cache.caches)})"
    return type(cache).__name__


def architecture_name(model) -> str:
    """``model_type`` where the model has one, else its module (``mlx_lm.models.mamba``)."""
    return getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None) or (
        type(model).__module__
    )


def refusal_reason(caches: list) -> str:
    """Why a cache list has nothing to compress, naming each kind it holds."""
    counts: dict = {}
    for cache in caches:
        counts[cache_kind(cache)] = counts.get(cache_kind(cache), 0) + 1
    held = ", ".join(f"{n} x {kind}" for kind, n in counts.items()) or "no caches"
    reasons = []
    if any("ArraysCache" in kind or "MambaCache" in kind for kind in counts):
        reasons.append("ArraysCache layers (state-space, linear attention, convolution) hold a fixed-size state")
    if any(kind.startswith("RotatingKVCache") or kind.startswith("ChunkedKVCache") for kind in counts):
        reasons.append("sliding-window and chunked attention is already bounded")
    if any(kind.count("KVCache") > 1 and kind.startswith("CacheList") for kind in counts):
        reasons.append("several KV caches in one layer may be paired position by position (kept as made)")
    if not reasons:
        reasons.append("no plain global-attention KVCache")
    return f"its caches are {held}: {'; '.join(reasons)}"


def attention_scale(model, index: int) -> Optional[float]:
    """The softmax scale of the attention that cache ``index`` serves, when the model says it plainly.

    Looks in ``model.layers[index]`` for attention modules (class name
    containing ``Attention`` or ``Attn``) with a float ``scale``,
    ``sm_scale`` or ``softmax_scale``. ``None`` when the cache list does not
    map one to one onto the first layers, or the modules disagree.
    """
    layers = getattr(model, "layers", None)
    if layers is None or index >= len(layers):
        return None
    found = set()
    for _, module in layers[index].named_modules():
        name = type(module).__name__.lower()
        if "attention" not in name and "attn" not in name:
            continue
        for attribute in SCALE_ATTRIBUTES:
            value = getattr(module, attribute, None)
            if isinstance(value, float):
                found.add(value)
                break
    return found.pop() if len(found) == 1 else None
