"""The fused native attention (``VeloxAttention``) against a float64 reference and the pure-MLX kernel.

Tolerance (``native.ATTENTION_TOLERANCE``, 1e-5): against float64, the output
within it times the largest ``|value|``, each key's mass within it, the
entropy sum within it per row summed; the pure-MLX kernel (``fused=False``)
meets the same bound, so the two differ by at most twice it. Where the native
module is not built (or predates the primitive) these tests skip.
"""

import math
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import velox_cache
from velox_cache.kernels import fused, kernel, native

pytestmark = pytest.mark.skipif(
    native.ops() is None or not hasattr(native.ops(), "attention"), reason=f"fused native attention: {native.status()}"
)

TOLERANCE = native.ATTENTION_TOLERANCE


@pytest.fixture(autouse=True)
def fused_on(monkeypatch):
    """Whatever the shell says, these tests compare the fused primitive (on) with the MLX kernel."""
    monkeypatch.delenv(fused.ENVIRONMENT_VARIABLE, raising=False)

# (batch, kv heads, group, queries, keys, head dim, mask)
CASES = {
    "decode": (1, 3, 3, 1, 77, 64, None),
    "decode-causal": (1, 2, 4, 1, 50, 16, "causal"),
    "decode-batch-rows": (3, 3, 3, 1, 130, 64, "bool-per-sequence"),
    "decode-group2": (1, 2, 2, 1, 45, 24, None),
    "few-rows-odd-dim": (1, 2, 2, 2, 70, 20, "causal"),  # two queries x two heads: the few-rows tiles
    "few-rows-additive": (2, 1, 3, 1, 90, 16, "additive-3d"),
    "chunk-causal-group3": (1, 3, 3, 37, 101, 32, "causal"),
    "chunk-causal-many-blocks": (1, 3, 3, 150, 700, 64, "causal"),  # several tasks and key blocks, two threads
    "square-causal-group1": (2, 2, 1, 40, 40, 16, "causal"),
    "square-causal-odd": (1, 1, 3, 67, 67, 24, "causal"),  # not a multiple of any tile
    "no-mask-prefill": (1, 1, 3, 20, 45, 16, None),
    "bool-mask-rows": (1, 2, 3, 21, 53, 16, "bool"),
    "bool-mask-per-head": (1, 2, 2, 18, 33, 16, "bool-heads"),
    "bool-mask-one-row": (1, 3, 3, 13, 90, 8, "bool-one-row"),
    "additive-mask-rows": (1, 3, 1, 19, 47, 16, "additive"),
    "additive-mask-3d": (2, 2, 4, 17, 40, 16, "additive-3d"),
    "masked-first-block": (1, 1, 3, 9, 200, 32, "bool-first-block"),  # a whole key block masked
}


def _inputs(batch, kv_heads, group, n_queries, n_keys, dim, mask_kind, seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return mx.array((rng.normal(size=shape) * scale).astype(np.float32))

    queries = normal(batch, kv_heads * group, n_queries, dim, scale=2.0)
    keys = normal(batch, kv_heads, n_keys, dim, scale=2.0)
    values = normal(batch, kv_heads, n_keys, dim)
    causal = mx.arange(n_keys - n_queries, n_keys)[:, None] >= mx.arange(n_keys)[None]
    first_key = mx.arange(n_keys) == 0
    uniform = lambda *shape: mx.array(rng.uniform(size=shape))  # noqa: E731
    mask = {
        None: None,
        "causal": "causal",
        "bool": causal & (uniform(n_queries, n_keys) > 0.3) | first_key,
        "bool-heads": (uniform(1, kv_heads * group, n_queries, n_keys) > 0.5) | first_key,
        "bool-one-row": (uniform(1, n_keys) > 0.4) | first_key,
        "bool-per-sequence": (uniform(batch, 1, 1, n_keys) > 0.4) | first_key,
        "bool-first-block": mx.broadcast_to(mx.arange(n_keys) >= 70, (n_queries, n_keys)),
        "additive": mx.where(causal, 0.0, -mx.inf) + normal(n_queries, n_keys),
        "additive-3d": normal(kv_heads * group, n_queries, n_keys),
    }[mask_kind]
    return queries, keys, values, mask


def _reference(queries, keys, values, scale, mask, score_rows, entropy_rows):
    """Attention, key mass and sampled entropy in float64 (NumPy), the keys repeated per group head."""
    q, k = np.array(queries, np.float64), np.array(keys, np.float64)
    batch, n_q_heads, n_queries, _ = q.shape
    n_kv_heads, n_keys = k.shape[1], k.shape[2]
    group = n_q_heads // n_kv_heads
    scores = q @ np.repeat(k, group, axis=1).swapaxes(-1, -2) * scale  # [B, H*R, S, N]
    if isinstance(mask, str):
        visible = np.arange(n_keys)[None] <= (n_keys - n_queries + np.arange(n_queries))[:, None]
        scores = np.where(visible, scores, -np.inf)
    elif mask is not None:
        m = np.array(mask)
        scores = np.where(m, scores, -np.inf) if m.dtype == bool else scores + m.astype(np.float64)
    row_max = scores.max(-1, keepdims=True)  # NaN where a score is NaN: the row's probabilities are NaN
    empty = row_max == -np.inf  # a row that sees no key weighs nothing: output 0, no mass, no entropy
    probs = np.exp(scores - np.where(empty, 0.0, row_max))
    with np.errstate(invalid="ignore"):
        probs = np.where(empty, 0.0, probs / probs.sum(-1, keepdims=True))
    output = None if values is None else probs @ np.repeat(np.array(values, np.float64), group, axis=1)
    mass = None
    if score_rows:
        mass = probs[:, :, n_queries - score_rows :].sum(2).reshape(batch, n_kv_heads, group, n_keys).sum(2)
    entropy = None
    if entropy_rows:
        tail = probs[:, :, n_queries - entropy_rows :]
        with np.errstate(divide="ignore", invalid="ignore"):
            rows = -np.where((tail > 0) | np.isnan(tail), tail * np.log(tail), 0.0).sum(-1)
        entropy = rows.sum() / math.log(n_keys)
    return output, mass, entropy


def _errors(got, expected, values, rows):
    """(output error / max |value|, largest key-mass error, entropy error per summed row)."""
    output, mass, entropy = got
    errors = [0.0, 0.0, 0.0]
    if expected[0] is not None:
        errors[0] = float(np.abs(np.array(output, np.float64) - expected[0]).max() / np.abs(np.array(values)).max())
    if expected[1] is not None:
        errors[1] = float(np.abs(np.array(mass, np.float64) - expected[1]).max())
    if expected[2] is not None:
        errors[2] = abs(entropy.item() - expected[2]) / max(1, rows)
    return errors


@pytest.mark.parametrize("case", list(CASES))
def test_native_and_pure_kernels_match_float64(case):
    queries, keys, values, mask = _inputs(*CASES[case])
    batch, n_q_heads, n_queries, dim = queries.shape
    scale = dim**-0.5
    for score_rows, entropy_rows in ((0, 0), (n_queries, min(n_queries, 8)), (max(1, n_queries // 3), 1)):
        kwargs = dict(scale=scale, mask=mask, score_rows=score_rows, entropy_rows=entropy_rows)
        expected = _reference(queries, keys, values, scale, mask, score_rows, entropy_rows)
        native_result = kernel.blocked_attention(queries, keys, values, **kwargs)
        pure_result = kernel.blocked_attention(queries, keys, values, fused=False, **kwargs)
        assert native_result[0].shape == queries.shape and native_result[0].dtype == mx.float32
        assert (native_result[1] is None) == (score_rows == 0) and (native_result[2] is None) == (entropy_rows == 0)
        rows = batch * n_q_heads * entropy_rows
        native_errors = _errors(native_result, expected, values, rows)
        pure_errors = _errors(pure_result, expected, values, rows)
        assert max(native_errors) <= TOLERANCE, f"native {native_errors}"
        assert max(pure_errors) <= TOLERANCE, f"pure {pure_errors}"
        between = _errors(native_result, [np.array(a, np.float64) if a is not None else None for a in pure_result],
                          values, rows)
        assert max(between) <= 2 * TOLERANCE, f"native vs pure {between}"


@pytest.mark.parametrize("case", ["decode", "chunk-causal-many-blocks", "bool-mask-rows", "additive-mask-3d"])
def test_scores_without_values_are_the_scores_with_them(case):
    queries, keys, values, mask = _inputs(*CASES[case])
    n_queries = queries.shape[2]
    kwargs = dict(scale=0.3, mask=mask, score_rows=max(1, n_queries // 2), entropy_rows=min(5, n_queries))
    output, mass, entropy = kernel.blocked_attention(queries, keys, values, **kwargs)
    none, mass_only, entropy_only = kernel.blocked_attention(queries, keys, None, **kwargs)
    assert none is None
    assert mx.allclose(mass_only, mass, atol=1e-6).item()
    assert entropy_only.item() == pytest.approx(entropy.item(), abs=1e-5)
    assert kernel.blocked_attention(queries, keys, None, scale=0.3, mask=mask) == (None, None, None)


def test_no_scores_matrix_is_ever_held():
    """A 2,048 x 2,048 causal call (scores: 16 MiB of float32) allocates little beyond its inputs and output."""
    queries, keys, values, _ = _inputs(1, 1, 1, 2048, 2048, 16, None)
    mx.eval(queries, keys, values)
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    output, mass, entropy = kernel.blocked_attention(queries, keys, values, scale=0.25, mask="causal",
                                                     score_rows=2048, entropy_rows=64)
    mx.eval(output, mass, entropy)
    assert mx.get_peak_memory() - before < 2048 * 2048 * 4 // 16  # under a sixteenth of the scores


def test_more_score_rows_than_queries_count_every_query():
    queries, keys, values, _ = _inputs(1, 3, 3, 12, 40, 16, None)
    _, all_rows, entropy_all = kernel.blocked_attention(queries, keys, values, scale=0.25, mask="causal",
                                                        score_rows=12, entropy_rows=12)
    _, clamped, entropy_clamped = kernel.blocked_attention(queries, keys, values, scale=0.25, mask="causal",
                                                           score_rows=100, entropy_rows=100)
    assert mx.array_equal(all_rows, clamped).item() and entropy_all.item() == entropy_clamped.item()
    assert mx.allclose(all_rows.sum(-1), mx.full((1, 3), 36.0), atol=1e-4).item(), "each row's mass sums to one"


def test_strided_inputs_are_read_in_place_or_packed():
    """Queries transposed from [B, S, H, D], keys sliced from a bigger buffer, values with a strided feature axis."""
    queries, keys, values, _ = _inputs(1, 3, 3, 30, 90, 32, None)
    scale = 32**-0.5
    expected = _reference(queries, keys, values, scale, "causal", 30, 4)
    strided_queries = mx.array(np.ascontiguousarray(np.array(queries).transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    buffer = mx.concatenate([keys, mx.zeros((1, 3, 40, 32))], axis=2)
    sliced_keys = buffer[:, :, :90]
    strided_values = mx.array(np.ascontiguousarray(np.array(values).swapaxes(-1, -2))).swapaxes(-1, -2)
    got = kernel.blocked_attention(strided_queries, sliced_keys, strided_values, scale=scale, mask="causal",
                                   score_rows=30, entropy_rows=4)
    assert max(_errors(got, expected, values, 9 * 4)) <= TOLERANCE


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_inputs_give_their_dtype_back(dtype):
    queries, keys, values, _ = _inputs(1, 2, 3, 16, 48, 16, None)
    up = kernel.blocked_attention(queries, keys, values, scale=0.25, mask="causal")[0]
    got = kernel.blocked_attention(queries.astype(dtype), keys.astype(dtype), values.astype(dtype), scale=0.25,
                                   mask="causal")[0]
    assert got.dtype == dtype
    assert mx.allclose(got.astype(mx.float32), up, atol=0.05).item()


def _probe(environment: dict, cases) -> list[str]:
    """The instruction set and each case's largest error, computed in a fresh interpreter under ``environment``.

    The module reads ``VELOX_NATIVE_ISA`` and ``VELOX_ATTENTION_THREADS`` once per process.
    """
    probe = (
        "import sys, mlx.core as mx\n"
        "from velox_cache.kernels import native\n"
        "from tests.velox_cache.kernels.test_native_attention import CASES, _inputs, _reference, _errors\n"
        "print(native.ops().attention_instruction_set())\n"
        "for case in sys.argv[1:]:\n"
        "    q, k, v, mask = _inputs(*CASES[case])\n"
        "    got = native.ops().attention(q, k, v, mask if isinstance(mask, mx.array) else None, scale=0.2,\n"
        "                                 causal=isinstance(mask, str), score_rows=5, entropy_rows=3)\n"
        "    rows = q.shape[0] * q.shape[1] * min(3, q.shape[2])\n"
        "    print(max(_errors(got, _reference(q, k, v, 0.2, mask, min(5, q.shape[2]), min(3, q.shape[2])), v, rows)))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    result = subprocess.run([sys.executable, "-c", probe, *cases], capture_output=True, text=True,
                            env={**os.environ, **environment}, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


def test_the_baseline_tiles_compute_the_same_attention():
    """``VELOX_NATIVE_ISA=baseline`` picks the portable tiles (4 lanes: other tile shapes, other paths)."""
    cases = ["decode-group2", "decode", "chunk-causal-group3", "square-causal-odd", "bool-mask-rows"]
    instruction_set, *errors = _probe({"VELOX_NATIVE_ISA": "baseline"}, cases)
    assert instruction_set == "baseline"
    assert all(float(error) <= TOLERANCE for error in errors), errors


@pytest.mark.parametrize("threads", ["1", "3"])
def test_any_number_of_threads_computes_the_same_attention(threads):
    instruction_set, *errors = _probe({"VELOX_ATTENTION_THREADS": threads}, ["chunk-causal-many-blocks", "decode"])
    assert all(float(error) <= TOLERANCE for error in errors), errors


@pytest.mark.parametrize("variable", [native.ENVIRONMENT_VARIABLE, fused.ENVIRONMENT_VARIABLE])
def test_either_switch_runs_the_mlx_kernel(monkeypatch, variable):
    assert fused.available()
    monkeypatch.setenv(variable, "0")
    assert not fused.available()
    assert fused.fused_attention(mx.ones((1, 1, 1, 4)), mx.ones((1, 1, 2, 4)), None, scale=1.0) is None
    assert (native.ops() is None) == (variable == native.ENVIRONMENT_VARIABLE)


@pytest.mark.parametrize("context, config", [
    ("fast_attention", velox_cache.KVCacheConfig(method="full")),
    ("observe", velox_cache.KVCacheConfig(method="h2o", budget=24, scoring="observed")),
])
def test_a_model_generates_the_same_greedy_tokens_with_native_attention_on_and_off(tiny_model, monkeypatch, context,
                                                                                   config):
    """The tiny model's greedy tokens (and, under observation, the evictions its key mass decides) agree."""
    model, _ = tiny_model
    prompt = mx.array([[5, 17, 3, 99, 42, 8, 23, 61, 7, 30, 11, 64, 2, 90, 33, 47] * 3])

    def greedy():
        caches = velox_cache.KVCacheBuilder.for_model(model, config)
        tokens = []
        with getattr(velox_cache, context)(model):
            logits = model(prompt, cache=caches)
            for _ in range(16):
                token = logits[0, -1].argmax().item()
                tokens.append(token)
                logits = model(mx.array([[token]]), cache=caches)
        return tokens, logits

    native_tokens, native_logits = greedy()
    monkeypatch.setenv(native.ENVIRONMENT_VARIABLE, "0")
    pure_tokens, pure_logits = greedy()
    assert native_tokens == pure_tokens
    assert mx.allclose(native_logits, pure_logits, atol=1e-4, rtol=1e-4).item()


# ----- pooled per-head slots (key_heads) ---------------------------------------------------------

# (batch, pooled heads, group, queries, keys, head dim, extra bool mask)
POOLED_CASES = {
    "decode": (1, 3, 3, 1, 300, 64, False),  # few rows: each head's slots read in place
    "decode-masked-rows": (2, 3, 3, 1, 130, 64, True),
    "decode-two-heads": (1, 2, 2, 1, 45, 24, False),
    "chunk": (1, 3, 3, 40, 200, 32, True),  # many rows: each head's slots gathered for the tiles
    "chunk-unmasked": (1, 2, 4, 70, 333, 16, False),
}


@pytest.mark.parametrize("case", list(POOLED_CASES))
def test_pooled_slots_attend_to_their_own_head_as_the_masked_call_does(case):
    batch, n_heads, group, n_queries, n_keys, dim, extra = POOLED_CASES[case]
    rng = np.random.default_rng(3)
    queries = mx.array(rng.normal(size=(batch, n_heads * group, n_queries, dim)).astype(np.float32) * 2)
    keys = mx.array(rng.normal(size=(batch, 1, n_keys, dim)).astype(np.float32) * 2)
    values = mx.array(rng.normal(size=(batch, 1, n_keys, dim)).astype(np.float32))
    key_heads = mx.array(rng.integers(0, n_heads, size=n_keys).astype(np.int32))
    mask = mx.array(rng.uniform(size=(batch, 1, n_queries, n_keys)) > 0.3) if extra else None
    own = velox_cache.kernels.masks.with_pooled_heads(mask, key_heads, n_heads * group, n_heads)
    rows = min(4, n_queries)
    got = native.ops().attention(queries, keys, values, mask, scale=0.2, score_rows=rows, entropy_rows=rows,
                                 key_heads=key_heads, n_heads=n_heads)
    expected = _reference(queries, keys, values, 0.2, mx.broadcast_to(own, (batch,) + own.shape[1:]), rows, rows)
    errors = _errors(got, expected, values, batch * n_heads * group * rows)
    assert max(errors) <= TOLERANCE, errors
    pure = kernel.blocked_attention(queries, keys, values, scale=0.2, mask=mask, score_rows=rows, entropy_rows=rows,
                                    fused=False, key_heads=key_heads, n_heads=n_heads)
    assert max(_errors(pure, expected, values, batch * n_heads * group * rows)) <= TOLERANCE, "the MLX kernel masks"


@pytest.mark.parametrize("change, message", [
    ({"keys": (1, 3, 20, 8)}, "pooled keys"),
    ({"causal": True}, "no causal"),
    ({"n_heads": 4}, "dividing"),
    ({"key_heads": 19}, "key_heads"),
])
def test_pooled_slots_refuse_what_they_cannot_mean(change, message):
    shape = change.get("keys", (1, 1, 20, 8))
    keys = mx.ones(shape)
    with pytest.raises(ValueError, match=message):
        native.ops().attention(mx.ones((1, 6, 1, 8)), keys, keys, None, scale=1.0, causal=change.get("causal", False),
                               key_heads=mx.zeros((change.get("key_heads", 20),), mx.int32),
                               n_heads=change.get("n_heads", 3))


# ----- the same bits on every run (issue 41, item 7) -----------------------------------------------


def _repeated_digests(repeats: int) -> list[str]:
    """One digest per call of output, key mass and entropy, SmolLM2's shapes at real size, causal and pooled.

    A 512-query chunk over 2,048 keys (9 query heads, 3 KV heads, head dim 64) with every row's mass and
    entropy: several tasks per KV head, so several threads add to each key's mass; then pooled per-head
    slots (a masked 256-query call over 2,048 slots), where tasks of one head share a row of the mass.
    """
    import hashlib

    rng = np.random.default_rng(41)
    queries = mx.array(rng.normal(size=(1, 9, 512, 64)).astype(np.float32) * 2)
    keys = mx.array(rng.normal(size=(1, 3, 2048, 64)).astype(np.float32) * 2)
    values = mx.array(rng.normal(size=(1, 3, 2048, 64)).astype(np.float32))
    pooled_keys, pooled_values = keys.reshape(1, 1, -1, 64)[:, :, :2048], values.reshape(1, 1, -1, 64)[:, :, :2048]
    key_heads = mx.array(rng.integers(0, 3, size=2048).astype(np.int32))
    mask = mx.array(rng.uniform(size=(1, 1, 256, 2048)) > 0.2)
    digests = []
    for _ in range(repeats):
        causal = native.ops().attention(queries, keys, values, None, scale=0.125, causal=True, score_rows=512,
                                        entropy_rows=512)
        pooled = native.ops().attention(queries[:, :, :256], pooled_keys, pooled_values, mask, scale=0.125,
                                        score_rows=256, entropy_rows=64, key_heads=key_heads, n_heads=3)
        digest = hashlib.sha256()
        for array in (*causal, *pooled):
            digest.update(np.array(array).tobytes())
        digests.append(digest.hexdigest())
    return digests


def _digests_in(environment: dict, repeats: int) -> tuple[str, list[str]]:
    probe = (
        "import sys\n"
        "from velox_cache.kernels import native\n"
        "from tests.velox_cache.kernels.test_native_attention import _repeated_digests\n"
        "print(native.ops().attention_instruction_set())\n"
        "print(*_repeated_digests(int(sys.argv[1])))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    result = subprocess.run([sys.executable, "-c", probe, str(repeats)], capture_output=True, text=True,
                            env={**os.environ, **environment}, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    instruction_set, *digests = result.stdout.split()
    return instruction_set, digests


@pytest.mark.parametrize("instruction_set", ["avx512", "avx2", "baseline"])
def test_key_mass_and_entropy_are_the_same_bits_on_every_run_and_any_number_of_threads(instruction_set):
    """Ten calls on four threads give one digest, and one thread gives the same (each ISA on its own)."""
    chosen, on_four = _digests_in({"VELOX_NATIVE_ISA": instruction_set, "VELOX_ATTENTION_THREADS": "4"}, 10)
    if chosen != instruction_set:
        pytest.skip(f"this CPU runs {chosen}, not {instruction_set}")
    assert len(set(on_four)) == 1, f"{len(set(on_four))} different results in 10 calls on 4 threads"
    _, on_one = _digests_in({"VELOX_NATIVE_ISA": instruction_set, "VELOX_ATTENTION_THREADS": "1"}, 1)
    assert on_one == on_four[:1], "one thread and four threads differ"


# ----- NaN scores and rows that see no key (issue 41, item 8) ----------------------------------------

# (batch, kv heads, group, queries, keys, head dim, what): few-rows tiles (decode) and many-rows tiles (chunks)
SPECIAL_CASES = {
    "decode-nan-key": (1, 2, 2, 1, 70, 16, "nan-key"),
    "decode-group3-nan-key": (1, 2, 3, 1, 90, 16, "nan-key"),
    "chunk-nan-key-causal": (1, 2, 3, 40, 150, 16, "nan-key"),  # queries 20.. see key 130
    "chunk-nan-in-additive-mask": (1, 2, 3, 40, 150, 16, "nan-mask"),  # an unscored row's NaN stays in its row
    "decode-masked-sequence": (2, 2, 3, 1, 90, 16, "empty-sequence"),  # a batch row that sees nothing
    "decode-group2-masked-rows": (1, 2, 2, 1, 70, 16, "empty-rows"),
    "chunk-masked-rows": (1, 2, 3, 40, 150, 16, "empty-rows"),  # scored and entropy rows among them
    "pooled-head-without-slots": (1, 3, 3, 1, 100, 16, "empty-head"),
    "pooled-chunk-head-without-slots": (1, 3, 3, 20, 100, 16, "empty-head"),
}


def _special_inputs(batch, kv_heads, group, n_queries, n_keys, dim, what):
    """Inputs with a NaN score or rows that see no key, the rows they score, and pooled heads (or None)."""
    queries, keys, values, _ = _inputs(batch, kv_heads, group, n_queries, n_keys, dim, None, seed=8)
    rng = np.random.default_rng(8)
    causal = np.arange(n_keys)[None] <= (n_keys - n_queries + np.arange(n_queries))[:, None]  # [S, N]
    score_rows, entropy_rows, pooled = n_queries, min(4, n_queries), None
    if what == "nan-key":
        k = np.array(keys)
        k[0, 0, n_keys - 20, 3] = np.nan
        keys, mask = mx.array(k), "causal"
    elif what == "nan-mask":
        additive = np.broadcast_to(np.where(causal, 0.0, -np.inf), (1, kv_heads * group, n_queries, n_keys)).copy()
        additive[0, group, 0, 2] = np.nan  # head 1's first query: output NaN, neither scored nor sampled
        mask, score_rows = mx.array(additive.astype(np.float32)), n_queries - 1
    elif what == "empty-sequence":
        visible = np.broadcast_to(rng.uniform(size=(batch, 1, 1, n_keys)) > 0.3, (batch, 1, 1, n_keys)).copy()
        visible[1] = False
        mask = mx.array(visible)
    elif what == "empty-rows":
        visible = np.broadcast_to(causal & (rng.uniform(size=causal.shape) > 0.2), (1, kv_heads * group, n_queries,
                                                                                   n_keys)).copy()
        visible[0, 1, n_queries - 1] = False  # a scored and sampled row of KV head 0
        visible[0, kv_heads * group - 1, :] = False  # every row of the last query head
        visible[0, 0, 0] = False
        mask = mx.array(visible)
    else:  # "empty-head": pooled slots, none of them the last head's
        keys, values = keys[:, :1], values[:, :1]
        pooled = (mx.array(rng.integers(0, kv_heads - 1, size=n_keys).astype(np.int32)), kv_heads)
        mask = None
    return queries, keys, values, mask, score_rows, entropy_rows, pooled


def _check_special_rows(case: str) -> None:
    """The primitive against float64 and MLX's own attention on one of ``SPECIAL_CASES``."""
    queries, keys, values, mask, score_rows, entropy_rows, pooled = _special_inputs(*SPECIAL_CASES[case])
    key_heads, n_heads = pooled if pooled else (None, 0)
    got = native.ops().attention(queries, keys, values, mask if isinstance(mask, mx.array) else None, scale=0.3,
                                 causal=isinstance(mask, str), score_rows=score_rows, entropy_rows=entropy_rows,
                                 key_heads=key_heads, n_heads=n_heads)
    own = mask
    if pooled:
        own = velox_cache.kernels.masks.with_pooled_heads(None, key_heads, queries.shape[1], n_heads)
        own = mx.broadcast_to(own, (queries.shape[0],) + own.shape[1:])
    expected = _reference(queries, keys, values, 0.3, own, score_rows, entropy_rows)
    got = [np.array(a, np.float64) for a in got]
    for name, a, b in zip(("output", "key mass", "entropy"), got, expected):
        assert np.array_equal(np.isnan(a), np.isnan(b)), f"{case}: {name} NaN where float64 is not, or not where it is"
    # NaN rows exactly where MLX's own attention has them (with the keys repeated per group head)
    group = queries.shape[1] // keys.shape[1]
    mlx = mx.fast.scaled_dot_product_attention(queries, mx.repeat(keys, group, 1), mx.repeat(values, group, 1),
                                               scale=0.3, mask=own)
    assert np.array_equal(np.isnan(got[0]).any(-1), np.isnan(np.array(mlx)).any(-1)), f"{case}: NaN rows differ from MLX"
    assert np.array_equal(np.isnan(got[0]).any(-1), np.isnan(got[0]).all(-1)), f"{case}: a NaN row is NaN throughout"
    finite = [np.nan_to_num(a, nan=0.0) for a in got]
    rows = queries.shape[0] * queries.shape[1] * entropy_rows
    errors = _errors(finite, [np.nan_to_num(a, nan=0.0) for a in expected], values, rows)
    assert max(errors) <= TOLERANCE, f"{case}: {errors}"
    if not isinstance(mask, str) and (mask is None or mask.dtype == mx.bool_):  # no NaN in: none out
        assert not any(np.isnan(a).any() for a in got), f"{case}: a row that sees no key made a NaN"


@pytest.mark.parametrize("case", list(SPECIAL_CASES))
def test_a_nan_score_is_nan_as_in_mlx_and_a_row_that_sees_no_key_weighs_nothing(case):
    """A NaN score makes its row NaN (output, and its head's key mass and the entropy where scored), as MLX's
    attention and softmax do; other rows stay exact. A row whose keys are all masked outputs 0 and adds
    nothing to the key mass or the entropy (MLX's SDPA gives the values' mean under a boolean mask, NaN under
    an additive -inf one; the MLX kernel NaN)."""
    _check_special_rows(case)


@pytest.mark.parametrize("instruction_set", ["avx2", "baseline"])
def test_nan_scores_and_rows_that_see_no_key_on_every_instruction_set(instruction_set):
    probe = (
        "import sys\n"
        "from velox_cache.kernels import native\n"
        "from tests.velox_cache.kernels.test_native_attention import SPECIAL_CASES, _check_special_rows\n"
        "print(native.ops().attention_instruction_set())\n"
        "for case in SPECIAL_CASES:\n"
        "    _check_special_rows(case)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=root,
                            env={**os.environ, "VELOX_NATIVE_ISA": instruction_set})
    assert result.returncode == 0, result.stderr[-2000:]
    if result.stdout.split()[0] != instruction_set:
        pytest.skip(f"this CPU runs {result.stdout.split()[0]}, not {instruction_set}")


@pytest.mark.skipif(not fused.available(), reason="the fused attention is not built")
def test_scoring_seconds_grow_with_the_scoring_pass_only():
    """``fused.scoring_seconds()``: what a shared reading takes off the rows that score nothing while reading."""
    queries, keys, values = (mx.random.normal((1, 3, 512, 64), key=mx.random.key(i)) for i in range(3))
    before = fused.scoring_seconds()
    mx.eval(fused.fused_attention(queries, keys, values, scale=0.125, mask="causal")[0])
    assert fused.scoring_seconds() == before
    mx.eval(fused.fused_attention(queries, keys, values, scale=0.125, mask="causal", score_rows=512)[1])
    assert fused.scoring_seconds() > before
