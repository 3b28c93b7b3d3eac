"""``PolicyRegistry``: method name -> policy class, refusing duplicates and unnamed policies."""

from __future__ import annotations


class PolicyRegistry(dict):
    """A ``dict`` from method name to policy class that every config method must be in, once.

    ``register`` refuses a class that does not name its own ``method`` (a base
    class such as ``EvictingKVCache`` is not a policy), a name that is not one of
    ``methods`` (``velox_cache.config.METHODS``: a config could never ask for it)
    and a name already registered (it would silently replace another policy).
    With ``timings`` (``velox_cache.config.DEFAULT_TIMINGS``), it also refuses a policy whose
    ``default_eviction`` and ``default_selection`` are not the ones the config fills its
    ranking's defaults by.
    """

    def __init__(self, methods: tuple, timings: dict | None = None):
        super().__init__()
        self.methods = tuple(methods)
        self.timings = dict(timings or {})

    def register(self, policy: type) -> type:
        """Add ``policy`` under its ``method``; returns it, so it also works as a class decorator."""
        method = vars(policy).get("method")
        if not isinstance(method, str) or not method:
            raise TypeError(f"{policy.__name__}: a policy class names its own `method`; it inherits one or has none")
        if method not in self.methods:
            raise ValueError(f"{policy.__name__}: method {method!r} is not in velox_cache.config.METHODS {self.methods}")
        if method in self:
            raise ValueError(f"{policy.__name__}: method {method!r} is already {self[method].__name__}")
        declared = (getattr(policy, "default_eviction", None), getattr(policy, "default_selection", None))
        if method in self.timings and declared != (None, None) and declared != tuple(self.timings[method]):
            raise ValueError(
                f"{policy.__name__}: default eviction and selection {declared} differ from "
                f"velox_cache.config.DEFAULT_TIMINGS[{method!r}] {tuple(self.timings[method])}"
            )
        self[method] = policy
        return policy

    def check_complete(self) -> None:
        """Raise unless every name in ``methods`` has a policy class."""
        missing = [method for method in self.methods if method not in self]
        if missing:
            raise ValueError(f"no policy class registered for {', '.join(missing)} (velox_cache.config.METHODS)")
