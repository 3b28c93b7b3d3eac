"""One policy per module; each is a small subclass of ``EvictingKVCache`` (or ``FullKVCache``).

A policy module declares its three choices as class attributes: ``allocator``
(how many tokens each layer keeps), ``default_eviction`` (when: the timing)
and ``signal`` (what ranks tokens), and its name as ``method``. Adding a policy
is one module here, its name in ``velox_cache.config.METHODS``, one ``register``
line below, and one row in the tests' policy table (``tests/velox_cache/policies.py``).

Layer: above ``cache/``, ``budgets/`` and ``kernels/``, below ``builder.py``;
imports only from those three and ``config.py``.
"""

from ..config import DEFAULT_TIMINGS, METHODS, KVCacheConfig
from .full import FullKVCache, QuantizedFullKVCache
from .h2o import H2OCache
from .pyramidkv import PyramidKVCache
from .registry import PolicyRegistry
from .snapkv import SnapKVCache
from .squeeze import SqueezeAttentionCache
from .streaming import StreamingLLMCache
from .tova import TOVACache

POLICIES = PolicyRegistry(METHODS, DEFAULT_TIMINGS)
for _policy in (FullKVCache, H2OCache, TOVACache, SnapKVCache, StreamingLLMCache, PyramidKVCache, SqueezeAttentionCache):
    POLICIES.register(_policy)
POLICIES.check_complete()



def policy_class(config: KVCacheConfig) -> type:
    """The cache class that builds ``config``'s layers: its method's policy, or its quantized form (``kv_bits``)."""
    if config.kv_bits and config.method == "full":
        return QuantizedFullKVCache
    return POLICIES[config.method]


__all__ = [cls.__name__ for cls in POLICIES.values()] + ["POLICIES", "QuantizedFullKVCache", "policy_class"]
