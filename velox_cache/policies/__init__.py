"""One policy per module; each is a small subclass of ``EvictingKVCache`` (or ``FullKVCache``)."""

from .full import FullKVCache
from .h2o import H2OCache
from .pyramidkv import PyramidKVCache
from .snapkv import SnapKVCache
from .squeeze import SqueezeAttentionCache
from .streaming import StreamingLLMCache
from .tova import TOVACache

POLICIES = {
    "full": FullKVCache,
    "h2o": H2OCache,
    "tova": TOVACache,
    "snapkv": SnapKVCache,
    "streaming": StreamingLLMCache,
    "pyramidkv": PyramidKVCache,
    "squeeze": SqueezeAttentionCache,
}

__all__ = [cls.__name__ for cls in POLICIES.values()] + ["POLICIES"]
