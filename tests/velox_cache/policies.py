"""The one table of policies the invariant tests run over.

Each row is ``(id, KVCacheConfig fields)``: every evicting policy with its
defaults, plus the non-default timings worth pinning. Adding a policy is its
module in ``velox_cache/policies/`` plus one row here
(``test_every_policy_has_a_row`` fails until it has one).
"""

from velox_cache import ConfigError, KVCacheConfig
from velox_cache.policies import POLICIES

POLICY_TABLE = [
    ("h2o", {"method": "h2o"}),
    ("tova", {"method": "tova"}),
    ("snapkv", {"method": "snapkv"}),
    ("streaming", {"method": "streaming"}),
    ("pyramidkv", {"method": "pyramidkv"}),
    ("squeeze", {"method": "squeeze"}),
    ("pyramidkv-continuous", {"method": "pyramidkv", "eviction": "continuous", "selection": "cumulative"}),
    ("squeeze-continuous", {"method": "squeeze", "eviction": "continuous", "selection": "cumulative"}),
    ("h2o-prefill-end", {"method": "h2o", "eviction": "prefill_end"}),
]
POLICY_CONFIGS = dict(POLICY_TABLE)
EVICTING = list(POLICY_CONFIGS)  # row ids
EVICTING_METHODS = list(dict.fromkeys(fields["method"] for _, fields in POLICY_TABLE))
SCORINGS = ["key_proxy", "observed"]


def _accepts(method: str, **fields) -> bool:
    try:
        KVCacheConfig(method=method, **fields)
    except ConfigError:
        return False
    return True


# Policies that can stream a document (StreamingLLM keeps the latest tokens and has no use for a probe).
STREAMING_METHODS = [m for m in EVICTING_METHODS if _accepts(m, eviction="streaming")]
# Policies that compress once, when prefill ends, unless told otherwise.
PREFILL_END_METHODS = [m for m in EVICTING_METHODS if POLICIES[m].default_eviction == "prefill_end"]
