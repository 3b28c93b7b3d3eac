"""Restoring a cache from its ``state`` and ``meta_state`` (mlx-lm's protocol: ``cls.from_state(state, meta_state)``).

``state`` is the list of arrays a cache holds; ``meta_state`` is a tuple of one
JSON string with everything else its object graph holds: the cache's own
attributes and those of every part it owns (``TokenSlots``, ``WindowSelector``,
``LayerPhase``, the timing, the allocator, ``QuantizedTokens``; a batch's rows
and their own caches), counts, phase, flags, the config as its fields, each
array as its index in ``state``. Written once, for every class: the encoder
walks ``vars()`` (``_`` names included), so a new attribute is saved without
anyone remembering to. ``type(c).from_state(c.state, c.meta_state)`` (fresh
array handles or not) builds an object, without ``__init__``, that decodes as
``c`` does, bit for bit.

What a class keeps but can recompute (memos, per-row setting columns, device
copies of host counts) it names in ``_derived``: those attributes are not
saved, and ``_rebuild()`` recomputes them after a restore. A small device
array that is neither in ``state`` nor recomputable is named in ``_by_value``
and saved by value. Any other array found outside ``state`` is an error that
names its path: the same invariant ARCHITECTURE.md asks of ``state`` (every
array a cache keeps is reachable from it).

Shared objects: an object referenced twice in one cache (its config, from the
cache and from its allocator) is restored once and shared again. What one
layer shares with the other layers of its stack and is frozen by then (a
published ``SqueezeCoordinator``, the config) is re-created per restored layer.
A squeeze layer whose coordinator has not published its schedule cannot be
saved alone (its budget still depends on every layer's measure):
``CannotRestore`` says so.

Only classes of ``velox_cache`` (and mlx-lm's own caches, a batch's plain
``KVCache`` rows) are instantiated from a ``meta_state``; nothing is called
but the class's ``_rebuild`` and ``KVCacheConfig``'s validation.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json

import mlx.core as mx
import numpy as np

from ..budgets.coordinator import SqueezeCoordinator
from ..config import KVCacheConfig

FORMAT = "velox-cache-state/1"
_MLX_MODULES = ("mlx_lm.models.cache",)
_PENDING_STATE, _PENDING_META = "_restoring_state", "_restoring_meta"  # one half of ``from_state`` before the other


class CannotRestore(NotImplementedError):
    """A cache, as it is now, cannot be saved as ``state`` + ``meta_state`` (the message says why)."""


def state_arrays(cache) -> list:
    """The arrays of ``cache``'s ``state`` (a Velox cache's without marking it read; non-arrays left out)."""
    listed = cache._state_list() if isinstance(cache, Restorable) else cache.state
    return [item for item in listed if isinstance(item, mx.array)]


class Restorable:
    """Mixin of every Velox cache: ``meta_state``, a ``state`` setter (``_restore_state``) and ``from_state``.

    A subclass's ``state`` setter calls ``self._restore_state(value)``; ``_state_list``
    is ``state`` without side effects (``EvictingKVCache``'s read marks the sequence).
    """

    _derived: tuple = ()  # attributes recomputed by ``_rebuild`` after a restore (not saved)
    _by_value: tuple = ()  # small device arrays outside ``state``, saved by value

    def _state_list(self) -> list:
        return list(self.state)

    def _rebuild(self) -> None:
        """Recompute the ``_derived`` attributes (they are None until then)."""

    def _check_saveable(self) -> None:
        """Raise ``CannotRestore`` where this object's state cannot be saved now."""

    @property
    def meta_state(self) -> tuple:
        """Everything but the arrays, as one JSON string (see the module doc)."""
        return (encoded(self, self._state_list()),)

    @meta_state.setter
    def meta_state(self, value) -> None:
        arrays = vars(self).pop(_PENDING_STATE, None)
        if arrays is None:
            if not _initialised(self):  # ``from_state`` in the other order: the state comes next
                vars(self)[_PENDING_META] = value
                return
            arrays = self._state_list()
        restore_into(self, value, arrays)

    def _restore_state(self, value) -> None:
        """``state = value``: rebind the arrays (a live cache keeps its layout; ``from_state`` waits for the meta)."""
        meta = vars(self).pop(_PENDING_META, None)
        if meta is None and not _initialised(self):
            vars(self)[_PENDING_STATE] = list(value)
            return
        restore_into(self, self.meta_state if meta is None else meta, list(value))

    @classmethod
    def from_state(cls, state, meta_state=None):
        """The cache ``state`` and ``meta_state`` describe (mlx-lm's protocol), built without ``__init__``."""
        if meta_state is None:
            return cls._from_state_alone(state)
        obj = cls.__new__(cls)
        obj.state = state
        obj.meta_state = meta_state
        return obj

    @classmethod
    def _from_state_alone(cls, state):
        raise CannotRestore(
            f"{cls.__name__}.from_state(state) needs meta_state too: the arrays alone do not say the counts, "
            "phase, timing, selector, budget or config (pass `cache.meta_state`)"
        )


def _initialised(obj) -> bool:
    return bool(set(vars(obj)) - {_PENDING_STATE, _PENDING_META})


# ----- encoding ------------------------------------------------------------------------------------


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _class_at(path: str) -> type:
    """The class named by ``path`` (``module:qualname``): Velox's own, or one of mlx-lm's caches."""
    module, _, qualname = path.partition(":")
    if not (module == "velox_cache" or module.startswith("velox_cache.") or module in _MLX_MODULES):
        raise ValueError(f"meta_state names class {path!r}: only velox_cache's classes (and mlx-lm's caches) restore")
    found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    if not isinstance(found, type):
        raise ValueError(f"meta_state: {path!r} is not a class")
    return found


def _allowed_object(value) -> bool:
    module = type(value).__module__
    return (module == "velox_cache" or module.startswith("velox_cache.") or module in _MLX_MODULES) and hasattr(
        value, "__dict__"
    )


class _Encoder:
    def __init__(self, arrays: list):
        self.index: dict = {}
        for position, item in enumerate(arrays):
            if isinstance(item, mx.array):
                self.index.setdefault(id(item), position)
        self.memo: dict = {}  # id(object) -> its number

    def value(self, value, path: str):
        if isinstance(value, mx.array):
            position = self.index.get(id(value))
            if position is None:
                raise CannotRestore(
                    f"{path}: a {tuple(value.shape)} {value.dtype} array that is neither in `state` nor rebuilt from it"
                )
            return {"a": position}
        if isinstance(value, enum.Enum):
            return {"e": _class_path(type(value)), "v": value.value}
        if value is None or type(value) in (bool, int, float, str):
            return value
        if isinstance(value, np.ndarray):
            return {"nd": value.dtype.str, "shape": list(value.shape), "v": value.ravel().tolist()}
        if isinstance(value, np.generic):
            return {"np": value.dtype.str, "v": value.item()}
        if isinstance(value, mx.Dtype):
            return {"dt": str(value).rpartition(".")[2]}
        if isinstance(value, type):
            _class_at(_class_path(value))  # refuses classes a restore would not load
            return {"cls": _class_path(value)}
        if isinstance(value, list):
            return [self.value(item, f"{path}[{i}]") for i, item in enumerate(value)]
        if isinstance(value, tuple):
            return {"t": [self.value(item, f"{path}[{i}]") for i, item in enumerate(value)]}
        if isinstance(value, dict):
            return {"d": [[self.value(k, f"{path}.keys()"), self.value(v, f"{path}[{k!r}]")] for k, v in value.items()]}
        if id(value) in self.memo:
            return {"r": self.memo[id(value)]}
        if isinstance(value, KVCacheConfig):
            self.memo[id(value)] = number = len(self.memo)
            fields = {f.name: self.value(getattr(value, f.name), f"{path}.{f.name}") for f in dataclasses.fields(value)}
            return {"cfg": fields, "n": number}
        if isinstance(value, SqueezeCoordinator) and not value.published:
            raise CannotRestore(
                f"{path}: a SqueezeCoordinator that has not published its schedule (prefill has not ended): a "
                "layer's budget then depends on every layer's measure, which one layer's state cannot carry; "
                "save the stack once prefill has ended"
            )
        if not _allowed_object(value):
            raise CannotRestore(f"{path}: a {type(value).__module__}.{type(value).__qualname__} cannot be saved")
        return self.object(value, path)

    def object(self, value, path: str) -> dict:
        check = getattr(value, "_check_saveable", None)
        if check is not None:
            check()
        self.memo[id(value)] = number = len(self.memo)
        derived, by_value = _names(type(value), "_derived"), _names(type(value), "_by_value")
        saved = {}
        for name, item in vars(value).items():
            if name in derived or name in _SHARED_ONLY.get(type(value), ()):
                continue
            if name in by_value and isinstance(item, mx.array):
                host = np.array(item)
                saved[name] = {"x": str(item.dtype).rpartition(".")[2], "shape": list(host.shape),
                               "v": host.ravel().tolist()}
            else:
                saved[name] = self.value(item, f"{path}.{name}")
        return {"o": _class_path(type(value)), "n": number, "v": saved}


# What an object shares with other layers and is not this layer's to save: re-created empty on restore.
_SHARED_ONLY = {SqueezeCoordinator: {"_layers": dict}}  # a published coordinator never asks its layers again


def _names(cls: type, attribute: str) -> set:
    return {name for klass in cls.__mro__ for name in vars(klass).get(attribute, ())}


def encoded(cache, arrays: list) -> str:
    """``cache``'s ``meta_state`` string, its arrays named by their place in ``arrays`` (its ``state``)."""
    tree = _Encoder(arrays).object(cache, type(cache).__name__)
    return json.dumps({"format": FORMAT, "class": _class_path(type(cache)), "tree": tree}, separators=(",", ":"))


# ----- decoding ------------------------------------------------------------------------------------


class _Decoder:
    def __init__(self, arrays: list):
        self.arrays = arrays
        self.memo: dict = {}
        self.built: list = []  # objects in the order they were completed (children before their owners)

    def value(self, node):
        if isinstance(node, list):
            return [self.value(item) for item in node]
        if not isinstance(node, dict):
            return node
        if "a" in node:
            return self.arrays[node["a"]]
        if "t" in node:
            return tuple(self.value(item) for item in node["t"])
        if "d" in node:
            return {self.value(k): self.value(v) for k, v in node["d"]}
        if "r" in node:
            return self.memo[node["r"]]
        if "e" in node:
            return _class_at(node["e"])(node["v"])
        if "nd" in node:
            return np.array(node["v"], dtype=np.dtype(node["nd"])).reshape(node["shape"])
        if "np" in node:
            return np.dtype(node["np"]).type(node["v"])
        if "dt" in node:
            return getattr(mx, node["dt"])
        if "cls" in node:
            return _class_at(node["cls"])
        if "cfg" in node:
            config = KVCacheConfig(**{name: self.value(item) for name, item in node["cfg"].items()})
            self.memo[node["n"]] = config
            return config
        if "o" in node:
            cls = _class_at(node["o"])
            return self.into(cls.__new__(cls), node)
        raise ValueError(f"meta_state: unknown node {sorted(node)}")

    def into(self, obj, node: dict):
        self.memo[node["n"]] = obj
        cls = type(obj)
        state = vars(obj)
        state.clear()
        for name in _names(cls, "_derived"):
            state[name] = None
        for name, factory in _SHARED_ONLY.get(cls, {}).items():
            state[name] = factory()
        for name, item in node["v"].items():
            if isinstance(item, dict) and "x" in item:
                state[name] = mx.array(np.array(item["v"]).reshape(item["shape"]), getattr(mx, item["x"]))
            else:
                state[name] = self.value(item)
        rebuild = getattr(obj, "_rebuild", None)
        if rebuild is not None:
            rebuild()
        return obj


def restore_into(cache, meta_state, arrays: list) -> None:
    """``cache`` (its class that of the saved one) becomes what ``meta_state`` and ``arrays`` (its state) describe."""
    text = meta_state if isinstance(meta_state, str) else meta_state[0]
    doc = json.loads(text)
    if doc.get("format") != FORMAT:
        raise ValueError(f"meta_state: format {doc.get('format')!r}, expected {FORMAT!r}")
    if doc["class"] != _class_path(type(cache)):
        raise ValueError(f"meta_state: saved from a {doc['class']}, restored into a {_class_path(type(cache))}")
    _Decoder(arrays).into(cache, doc["tree"])
