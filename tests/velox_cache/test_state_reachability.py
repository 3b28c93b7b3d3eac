"""Every array a cache layer keeps is in its ``state`` or rebuilt from it (issue 54), found by the test itself.

ARCHITECTURE.md ("velox_cache: what every cache must get right"): every array a
cache keeps must be reachable from ``state`` (mlx-lm evaluates ``[c.state ...]``
after each prefill chunk; a batch's decode loop evaluates its ``step_arrays``),
or lazy graphs grow without bound. The invariant tests elsewhere ask the code's
own list of per-sequence fields (``snapshot.PER_SEQUENCE``) and skip ``_`` names;
this one has its own oracle: it walks ``vars()`` of the layer and of every
object the layer holds (``_`` names included) and collects every ``mx.array``.

Each array found must be, by identity, one of ``state``'s, or *rebuilt from
state*: where the layer's class can be restored from its state (mlx-lm's
protocol, ``type(layer).from_state(state)``) the restored layer's array at the
same path is equal (a buffer's zero spare room aside); otherwise it must be one
of the derived arrays of ``REBUILT``, each recomputed here from the layer's
state arrays and host-side counts and settings, and equal to that. Anything
else fails, naming its path. A stack restored from its state and meta state
(``type(layer).from_state(state, meta_state)``, fresh array handles: what a
save and a load leave) then decodes the same next 10 greedy tokens, logits bit
for bit; a kind that cannot be restored (``CannotRestore``) would be a strict
xfail naming why (``NOT_RESTORABLE``: none is).

The table: every policy row of ``tests/velox_cache/policies.py`` (every registered
policy, and the non-default timings), the full cache, per-head budgets, quantized
slots (an evicting policy at ``kv_bits`` 8 and 4), quantized tokens (the full cache
at ``kv_bits``), each alone (one sequence's stack) and batched (two rows merged by
``batch_layers``, as ``decode_rows`` does), and a batch of rows of several kinds.
"""

from __future__ import annotations

import types

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import _BaseCache

import velox_cache
from velox_cache import KVCacheBuilder, KVCacheConfig, prefill_phases
from velox_cache.cache.head_slots import HeadPooledSlots, head_membership
from velox_cache.cache.restoring import CannotRestore
from velox_cache.cache.slots import recent_limit
from velox_cache.generation.batching import BatchedLayer, batch_layers
from velox_cache.generation.decoding_batch import DecodingBatch
from velox_cache.generation.mixed_batch import MixedBatch
from velox_cache.generation.quantized_batching import QuantizedFullBatch
from velox_cache.generation.quantized_slots_batch import QuantizedSlotsBatch

from tests.velox_cache.policies import POLICY_TABLE

BUDGET = 24  # per layer, below every prompt: each kind has evicted before the checks
LENGTHS = (90, 61, 75)  # one prompt per row (alone: the first)
STEPS = 8  # decode steps before the checks (a quantized window's group is budget // 4 = 6: one flush)
NEW = 10  # tokens decoded by the stack and by its restored copy
TEXT = "Every array a cache keeps is in its state, or rebuilt from it, row by row and step by step. " * 6

_POOLED = {"method": "snapkv", "head_budgets": "adaptive"}
_SINGLE = [(name, [fields]) for name, fields in POLICY_TABLE] + [
    ("full", [{"method": "full"}]),
    ("head-pooled-snapkv", [_POOLED]),
    ("head-pooled-pyramidkv", [{"method": "pyramidkv", "head_budgets": "adaptive"}]),
    ("quantized-slots-8", [{"method": "h2o", "kv_bits": 8}]),
    ("quantized-slots-4", [{"method": "tova", "kv_bits": 4}]),
    ("quantized-tokens-8", [{"method": "full", "kv_bits": 8}]),
    ("quantized-tokens-4", [{"method": "full", "kv_bits": 4}]),
]
_MIXED = [  # rows of several kinds in one batch: a MixedBatch, and a BatchedLayer with rows of several signals
    ("mixed-kinds", [{"method": "h2o", "kv_bits": 8}, _POOLED, {"method": "full", "kv_bits": 8}]),
    ("float-kinds", [{"method": "h2o"}, {"method": "full"}, {"method": "streaming"}]),
]
# (id, one config per row, batched)
KINDS = [(name, rows, False) for name, rows in _SINGLE] + [(name, rows * 2, True) for name, rows in _SINGLE] + [
    (name, rows, True) for name, rows in _MIXED
]
NOT_RESTORABLE: dict = {}  # kind id -> why its layers cannot come back from ``from_state`` (a strict xfail)


def _config(fields: dict) -> KVCacheConfig:
    if fields["method"] == "full":
        return KVCacheConfig(**fields)
    return KVCacheConfig(**{"budget": BUDGET, "scoring": "observed", **fields})


def _built(model, tokenizer, rows: list, batched: bool):
    """The layers of the kind after prefill (evicted), ``STEPS`` greedy decode steps; and the next tokens ``[B]``."""
    tokens = tokenizer.encode(TEXT)
    stacks, logits = [], []
    with velox_cache.observe(model):
        for fields, length in zip(rows, LENGTHS):
            stack = KVCacheBuilder.for_model(model, _config(fields), prompt_tokens=length)
            logits.append(prefill_phases(model, stack, document=tokens[:length], max_new_tokens=STEPS + NEW + 1))
            stacks.append(stack)
        layers = batch_layers(stacks) if batched else stacks[0]
        next_tokens = mx.argmax(mx.concatenate(logits), axis=-1)
        for _ in range(STEPS):
            next_tokens = mx.argmax(_step(model, layers, next_tokens), axis=-1)
    if batched:
        assert all(isinstance(layer, DecodingBatch) for layer in layers), [type(layer).__name__ for layer in layers]
    return layers, next_tokens


def _step(model, layers: list, tokens: mx.array) -> mx.array:
    """One model call of one token per row; evaluates what the decode loops evaluate. Logits ``[B, V]``."""
    logits = model(tokens[:, None], cache=layers)[:, -1, :]
    mx.eval(logits, [array for layer in layers for array in getattr(layer, "step_arrays", layer.state)])
    return logits


# ----- the walk ---------------------------------------------------------------------------------

_LEAVES = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType, types.FunctionType,
           types.BuiltinFunctionType, types.MethodType, np.ndarray, np.generic, nn.Module, mx.Dtype)


def held_arrays(layer) -> list:
    """``[(path, array, owner, path in owner)]``: every ``mx.array`` reachable from ``layer`` through ``vars()``
    (``_`` names included), lists, tuples and dicts, each array once.

    Walks every object the layer holds except modules, classes, functions and other
    caches: a batch's rows' own caches and the layers a shared coordinator knows hold
    their own ``state`` (the parts of a ``MixedBatch`` are walked: they are the layer).
    """
    found, seen = [], set()

    def visit(value, path, owner, relative):
        if isinstance(value, mx.array):
            if id(value) not in seen:
                seen.add(id(value))
                found.append((path, value, owner, relative))
            return
        if isinstance(value, _LEAVES) or id(value) in seen:
            return
        seen.add(id(value))
        if value is not layer and isinstance(value, _BaseCache) and not isinstance(value, DecodingBatch):
            return
        if isinstance(value, dict):
            for key, item in value.items():
                visit(item, f"{path}[{key!r}]", owner, f"{relative}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                visit(item, f"{path}[{index}]", owner, f"{relative}[{index}]")
        elif hasattr(value, "__dict__"):
            for name, item in vars(value).items():
                visit(item, f"{path}.{name}", value, f".{name}")

    visit(layer, "", layer, "")
    return found


# ----- arrays rebuilt from state: each recomputed from the state arrays and the host's counts and settings ----


def _slots_below(counts: np.ndarray, width: int) -> mx.array:
    """``[B, H, width]`` bool: the first ``counts[b, h]`` slots."""
    return mx.arange(width, dtype=mx.int32)[None, None] < mx.array(counts, mx.int32)[:, :, None]


def _next_positions(positions: mx.array, held: mx.array) -> mx.array:
    """Each row's next position: one after the latest it holds (every step's token is held until the next)."""
    return (mx.where(held, positions, -1).max(axis=(1, 2)) + 1).astype(mx.int32)


def _row_settings(caches: list, name: str) -> mx.array:
    """A per-row setting ``[B, 1, 1]`` from each row's config: sinks, the recent window at its budget, pooled."""
    values = []
    for cache in caches:
        slots = getattr(cache, "slots", None)
        if slots is None:  # a full row: nothing protected, nothing pooled
            values.append(0)
        elif name == "_n_sink":
            values.append(cache.config.n_sink)
        elif name == "_recent":
            values.append(int(recent_limit(cache.config.recent_window, cache.layer_budget, cache.config.n_sink)))
        else:
            values.append(int(cache.config.head_budgets == "adaptive"))
    return mx.array(np.array(values).reshape(-1, 1, 1))


def _row_caches(batch) -> list:
    return [row.cache for row in batch.rows] if isinstance(batch, BatchedLayer) else list(batch.caches)


def _group_mask(batch, relative: str) -> mx.array:
    """A row group's mask ``[B, 1, 1]`` (``_ranked[g][1]``, ``_folded[observed][g][1]``): the rows of its signal
    that rank by it (every evicting row) or fold each decode step's attention (observed or by the key proxy)."""
    caches = _row_caches(batch)
    parts = relative.strip(".").replace("]", "").split("[")
    signal = {"_ranked": lambda: batch._ranked, "_folded": lambda: batch._folded[parts[1] == "True"]}[parts[0]]()
    signal = signal[int(parts[-2])][0]
    mask = []
    for cache in caches:
        slots = getattr(cache, "slots", None)
        member = slots is not None and slots.signal is signal
        if member and parts[0] == "_folded":
            member = signal.rows(1) > 0 and (cache.scoring == "observed") == (parts[1] == "True")
        mask.append(member)
    return mx.array(np.array(mask).reshape(-1, 1, 1))


def _membership(slots: HeadPooledSlots, relative: str) -> mx.array:
    """A per-head layer's memo of which slots each head holds, for the slot count it is keyed by."""
    (changes, n_slots), _ = slots._membership_cache
    assert changes == slots._heads_changed, "a membership memo of heads that have changed since"
    return head_membership(slots.heads[:n_slots], slots.n_heads)


def _part_rows(batch: MixedBatch) -> list:
    """Each part's batch rows, from where the host says each row sits (``members``)."""
    return [[row for row, (part, _) in enumerate(batch.members) if part == p] for p in range(len(batch.parts))]


REBUILT = {  # (class of the object holding it, its path there) -> what it must equal, rebuilt
    (BatchedLayer, "._offset"): lambda b, _: _next_positions(b.positions, _slots_below(b.counts.head_stored,
                                                                                        b.positions.shape[2])),
    (BatchedLayer, "._valid"): lambda b, _: _slots_below(b.counts.head_stored, b.keys.shape[2]),
    (QuantizedSlotsBatch, "._offset"): lambda b, _: _next_positions(b.positions, b.live),
    (QuantizedFullBatch, "._offset"): lambda b, _: mx.array(b.quantized + b.tails, mx.int32),  # it keeps every token
    **{(kind, f".{name}"): (lambda name: lambda b, _: _row_settings(_row_caches(b), name))(name)
       for kind in (BatchedLayer, QuantizedSlotsBatch) for name in ("_n_sink", "_recent", "_pooled")},
    (HeadPooledSlots, "._membership_cache[1]"): _membership,
    **{(MixedBatch, f"._rows_of[{p}]"): (lambda p: lambda b, _: mx.array(_part_rows(b)[p], mx.int32))(p)
       for p in range(3)},  # a mixed batch's routing: which rows each part takes, and the order that puts them back
    (MixedBatch, "._back"): lambda b, _: mx.array(np.argsort(np.concatenate(_part_rows(b)), kind="stable"), mx.int32),
}


def _rebuilt_rule(owner, relative: str):
    if relative.startswith(("._ranked[", "._folded[")) and relative.endswith("[1]"):
        return _group_mask
    return next((rule for (kind, path), rule in REBUILT.items() if isinstance(owner, kind) and path == relative), None)


def _equal_up_to_spare(kept: mx.array, rebuilt: mx.array) -> bool:
    """``kept`` is ``rebuilt`` (broadcast to it), or ``rebuilt`` followed by zero spare room along its axes."""
    if kept.ndim == rebuilt.ndim and all(k >= r for k, r in zip(kept.shape, rebuilt.shape)):
        head = kept[tuple(slice(0, size) for size in rebuilt.shape)]
        pads = [(0, k - r) for k, r in zip(kept.shape, rebuilt.shape)]
        return bool(mx.array_equal(head, rebuilt).item()) and bool(
            mx.array_equal(kept, mx.pad(rebuilt.astype(kept.dtype), pads)).item())
    try:
        return bool(mx.array_equal(mx.broadcast_to(kept, rebuilt.shape), rebuilt).item())
    except ValueError:
        return False


def _saved(state):
    """``state`` as a save and a load leave it: fresh array handles (what one side writes in place, the other
    never sees), counts as they are."""
    return type(state)(mx.array(item) if isinstance(item, mx.array) else item for item in state)


def restored(layer):
    """``layer`` restored from its state and meta state by mlx-lm's protocol (``from_state``); None where it
    cannot be (``CannotRestore``)."""
    try:
        return type(layer).from_state(_saved(layer.state), layer.meta_state)
    except CannotRestore:
        return None


def _at(obj, path: str):
    """The value at ``path`` (``.name``, ``[index]`` or ``['key']`` steps) under ``obj``."""
    for step in path.replace("]", "").replace("[", ".").strip(".").split("."):
        if isinstance(obj, dict):
            obj = obj[eval(step)]  # a repr'd key
        elif isinstance(obj, (list, tuple)):
            obj = obj[int(step)]
        else:
            obj = vars(obj).get(step)
    return obj


def unreachable(layers: list) -> list[str]:
    """Every array of ``layers`` neither in its layer's ``state`` nor rebuilt from it (see the module doc)."""
    failures = []
    for index, layer in enumerate(layers):
        state = {id(array) for array in layer.state if isinstance(array, mx.array)}
        back = None
        for path, array, owner, relative in held_arrays(layer):
            if id(array) in state:
                continue
            where = f"layers[{index}]{path}"
            rule = _rebuilt_rule(owner, relative)
            if rule is not None:
                if not _equal_up_to_spare(array, rule(owner, relative)):
                    failures.append(f"{where}: {array.shape} {array.dtype} is not what its state rebuilds")
                continue
            back = restored(layer) if back is None else back
            if back is None:
                failures.append(f"{where}: {array.shape} {array.dtype} is not in `state` (and "
                                f"{type(layer).__name__} cannot be restored from it)")
                continue
            again = _at(back, path)
            if not isinstance(again, mx.array) or not _equal_up_to_spare(array, again):
                failures.append(f"{where}: {array.shape} {array.dtype} is not in `state`, and a "
                                f"{type(layer).__name__} restored from it has {_described(again)} there")
    return failures


def _described(value) -> str:
    return f"{value.shape} {value.dtype}" if isinstance(value, mx.array) else repr(value)


# ----- the tests ---------------------------------------------------------------------------------

_IDS = [f"{name}-{'batched' if batched else 'alone'}" for name, _, batched in KINDS]


@pytest.mark.parametrize("name,rows,batched", KINDS, ids=_IDS)
def test_every_array_a_layer_keeps_is_in_its_state_or_rebuilt_from_it(tiny_model, name, rows, batched):
    model, tokenizer = tiny_model
    layers, _ = _built(model, tokenizer, rows, batched)
    evicting = [layer for layer in layers if hasattr(layer, "slots")]
    assert all(layer.slots.tokens_seen > layer.layer_budget for layer in evicting), "every evicting layer evicted"
    found = [array for layer in layers for _, array, _, _ in held_arrays(layer)]
    assert len(found) >= 2 * len(layers), "the walk reaches every layer's keys and values at least"
    failures = unreachable(layers)
    assert not failures, "arrays kept outside `state`:\n" + "\n".join(failures)
    for index, layer in enumerate(layers):  # what a decode loop evaluates each step: in state, or rebuilt from it
        state = {id(array) for array in layer.state}
        kept = {id(array): (owner, relative) for _, array, owner, relative in held_arrays(layer)}
        stray = [a.shape for a in getattr(layer, "step_arrays", [])
                 if id(a) not in state and (id(a) not in kept or _rebuilt_rule(*kept[id(a)]) is None)]
        assert not stray, f"layers[{index}].step_arrays: arrays neither in `state` nor rebuilt from it {stray}"
        for part in getattr(layer, "parts", [layer]):
            if isinstance(part, QuantizedSlotsBatch):  # the counts a flush leaves on the device were checked
                assert (part.groups_bound > [cache.slots.groups for cache in part.caches]).all(), "every row flushed"


def _restore_param(name, rows, batched):
    kind = f"{name}-{'batched' if batched else 'alone'}"
    if kind not in NOT_RESTORABLE:
        return pytest.param(name, rows, batched, id=kind)
    return pytest.param(name, rows, batched, id=kind,
                        marks=pytest.mark.xfail(raises=CannotRestore, strict=True, reason=NOT_RESTORABLE[kind]))


@pytest.mark.parametrize("name,rows,batched", [_restore_param(*kind) for kind in KINDS])
def test_a_stack_restored_from_its_state_decodes_the_same(tiny_model, name, rows, batched):
    model, tokenizer = tiny_model
    layers, first = _built(model, tokenizer, rows, batched)
    again = [type(layer).from_state(_saved(layer.state), layer.meta_state) for layer in layers]
    produced = []
    for stack in (layers, again):
        tokens, logits = first, []
        with velox_cache.observe(model):
            for _ in range(NEW):
                logits.append(_step(model, stack, tokens))
                tokens = mx.argmax(logits[-1], axis=-1)
        produced.append(mx.stack(logits))
    original, restored_ = produced
    assert mx.argmax(original, axis=-1).tolist() == mx.argmax(restored_, axis=-1).tolist()
    assert mx.array_equal(original, restored_).item(), "logits bit for bit"
    assert [layer.meta_state for layer in again] == [layer.meta_state for layer in layers], "the same counts after"
    if batched:  # every row taken out of either batch: its own cache as decoding it alone leaves it, in both
        for layer, back in zip(layers, again):
            for row in range(len(layer.rows)):
                written, rewritten = layer.extract(row), back.extract(row)
                assert len(written) == len(rewritten)
                assert all(mx.array_equal(a, b).item() for a, b in zip(written, rewritten)), f"row {row}"


def test_meta_state_is_strings_and_a_restore_shares_nothing(tiny_model):
    """mlx-lm's shapes (a list of arrays, a tuple of strings); a restored layer's meta state is the saved one,
    no array is shared with the original, and a live layer's ``state`` setter rebinds its arrays in place."""
    model, tokenizer = tiny_model
    layers, _ = _built(model, tokenizer, [_POOLED, {"method": "squeeze"}], batched=True)
    for layer in layers:
        meta = layer.meta_state
        assert isinstance(meta, tuple) and all(isinstance(part, str) for part in meta)
        back = type(layer).from_state(_saved(layer.state), meta)
        assert back.meta_state == meta
        originals = {id(a) for _, a, _, _ in held_arrays(layer)}
        assert not originals & {id(a) for _, a, _, _ in held_arrays(back)}
        fresh = _saved(back.state)
        back.state = fresh
        assert [id(a) for a in back.state[: len(fresh)]] == [id(a) for a in fresh[: len(back.state)]]
        assert back.meta_state == meta


def test_what_cannot_be_restored_says_why(tiny_model):
    """A squeeze layer before its coordinator publishes (its budget depends on every layer), and a Velox layer
    without its meta state, refuse clearly; a full cache alone restores from its state as mlx-lm's ``KVCache``."""
    model, tokenizer = tiny_model
    tokens = tokenizer.encode(TEXT)[:40]
    stacks = {}
    for method in ("squeeze", "h2o", "full"):
        stack = KVCacheBuilder.for_model(model, _config({"method": method}), prompt_tokens=len(tokens))
        with velox_cache.observe(model):
            model(mx.array(tokens)[None], cache=stack)
        stacks[method] = stack
    with pytest.raises(CannotRestore, match="SqueezeCoordinator that has not published"):
        stacks["squeeze"][0].meta_state
    with pytest.raises(CannotRestore, match="needs meta_state"):
        type(stacks["h2o"][0]).from_state(stacks["h2o"][0].state)
    full = stacks["full"][0]
    alone = type(full).from_state(_saved(full.state))
    assert alone.offset == full.offset and mx.array_equal(alone.keys, full.keys).item()


@pytest.mark.parametrize("fields", [{"method": "snapkv"}, {"method": "h2o"}, {"method": "snapkv", "eviction": "streaming"},
                                    {"method": "full", "kv_bits": 8}, {"method": "full"}],
                         ids=["snapkv", "h2o", "snapkv-streaming", "quantized-tokens-8", "full"])
def test_a_stack_restored_mid_prefill_reads_on_and_decodes_the_same(tiny_model, fields):
    """Saved after a prefill chunk (its state read, as mlx-lm's prefill reads it), never told a phase: the
    restored stack reads the rest of the prompt, infers the end of prefill, selects and decodes as the original."""
    model, tokenizer = tiny_model
    tokens = tokenizer.encode(TEXT)[:80]
    stack = KVCacheBuilder.for_model(model, _config(fields), prompt_tokens=len(tokens))
    produced = []
    with velox_cache.observe(model):
        model(mx.array(tokens[:50])[None], cache=stack)
        mx.eval([layer.state for layer in stack])
        again = [type(layer).from_state(_saved(layer.state), layer.meta_state) for layer in stack]
        for layers in (stack, again):
            model(mx.array(tokens[50:-1])[None], cache=layers)
            mx.eval([layer.state for layer in layers])
            logits = [model(mx.array(tokens[-1:])[None], cache=layers)[:, -1]]
            for _ in range(5):
                logits.append(model(mx.argmax(logits[-1], axis=-1)[:, None], cache=layers)[:, -1])
            produced.append(mx.stack(logits))
    assert mx.array_equal(*produced).item(), "logits bit for bit"
