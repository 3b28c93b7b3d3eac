"""One policy per module; each is a small subclass of ``EvictingKVCache`` (or ``FullKVCache``).

A policy module declares its three choices as class attributes: ``allocator``
(how many tokens each layer keeps), ``default_eviction`` (when: the timing)
and ``signal`` (what ranks tokens). Adding a policy is one module here, one
entry below, and one row in the tests' policy table (``tests/velox_cache/policies.py``).
"""

from .full import FullKVCache
from .h2o import H2OCache
from .pyramidkv import PyramidKVCache
from .snapkv import SnapKVCache
from .squeeze import SqueezeAttentionCache
from .streaming import StreamingLLMCache
from .tova import TOVACache

POLICIES = {
    policy.method: policy
    for policy in (
        FullKVCache,
        H2OCache,
        TOVACache,
        SnapKVCache,
        StreamingLLMCache,
        PyramidKVCache,
        SqueezeAttentionCache,
    )
}

__all__ = [cls.__name__ for cls in POLICIES.values()] + ["POLICIES"]
