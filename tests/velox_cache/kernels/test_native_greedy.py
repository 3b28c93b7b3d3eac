"""Velox's native greedy choice (``VeloxGreedy``, and with targets ``forced_choice``) against the MLX ops it replaces.

On x86 MLX's CPU ``logsumexp`` sums its exponentials one by one (SIMD width 1),
so the native pass must give the same token and the same log-probability bits
as ``mx.argmax`` of ``logits - mx.logsumexp(logits)``; ``greedy_choice`` falls
back to those ops where the native module is not built or is switched off.
"""

import os
import platform
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from velox_cache.generation.sampling import TokenSampler, forced_choice, greedy_choice, log_softmax
from velox_cache.kernels import native

needs_native = pytest.mark.skipif(
    native.ops() is None or not hasattr(native.ops(), "greedy_choice"),
    reason=f"native greedy choice: {native.status()}",
)
exact = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                           reason="MLX's CPU logsumexp sums in SIMD lanes here, not one by one")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def mlx_choice(logits):
    logprobs = log_softmax(logits)
    tokens = mx.argmax(logprobs, axis=-1)
    return tokens, mx.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]


def awkward_logits() -> list[np.ndarray]:
    """Rows of every width the loops split differently, with ties, -inf, NaN and huge spreads."""
    rng = np.random.default_rng(7)
    cases = []
    for vocabulary, scale in ((1, 1.0), (7, 3.0), (16, 1.0), (33, 50.0), (1000, 0.1), (4099, 10.0), (49152, 5.0)):
        x = (rng.normal(size=(3, vocabulary)) * scale).astype(np.float32)
        cases.append(x)
        cases.append(np.round(x))  # ties: the first index must win
    spread = (rng.normal(size=(2, 300)) * 200).astype(np.float32)  # many exp(x - max) below -88: zero
    masked = rng.normal(size=(4, 130)).astype(np.float32)
    masked[0, 5:] = -np.inf
    masked[1, :] = -np.inf  # every logit -inf: NaN log-probabilities, token 0, as MLX gives
    masked[2, 17] = np.inf
    masked[3, 40] = np.nan
    return cases + [spread, masked]


def _bits(array) -> bytes:
    return np.array(array).tobytes()


@needs_native
@exact
@pytest.mark.parametrize("case", range(len(awkward_logits())))
def test_the_native_choice_gives_mlxs_token_and_logprob_bits(case):
    logits = mx.array(awkward_logits()[case])
    expected_tokens, expected_logprobs = mlx_choice(logits)
    tokens, logprobs = native.ops().greedy_choice(logits)
    assert tokens.dtype == mx.uint32 and logprobs.dtype == mx.float32
    assert np.array(tokens).tolist() == np.array(expected_tokens).tolist()
    assert _bits(logprobs) == _bits(expected_logprobs)


@needs_native
@exact
def test_leading_axes_strided_rows_and_half_precision_are_taken_as_mlx_takes_them():
    logits = mx.random.normal((2, 5, 3001), key=mx.random.key(1)) * 4
    for x in (logits, logits[:, 1::2], logits.astype(mx.float16), logits.transpose(1, 0, 2)):
        expected_tokens, expected_logprobs = mlx_choice(x)
        tokens, logprobs = greedy_choice(x)
        assert tokens.shape == expected_tokens.shape
        assert mx.array_equal(tokens, expected_tokens).item()
        assert _bits(logprobs) == _bits(expected_logprobs)


@needs_native
def test_a_row_gets_the_same_choice_alone_and_in_a_batch():
    logits = mx.random.normal((5, 49152), key=mx.random.key(3)) * 6
    tokens, logprobs = greedy_choice(logits)
    for row in range(5):
        alone_token, alone_logprob = greedy_choice(logits[row : row + 1])
        assert alone_token.item() == tokens[row].item()
        assert _bits(alone_logprob) == _bits(logprobs[row : row + 1])


@needs_native
@exact
@pytest.mark.parametrize("instruction_set", ["avx512", "avx2", "baseline"])
def test_each_instruction_set_gives_the_same_bits(instruction_set):
    """Each ISA's loop in a fresh interpreter (the module reads ``VELOX_NATIVE_ISA`` once) against MLX."""
    probe = (
        "import hashlib, mlx.core as mx, numpy as np\n"
        "from velox_cache.kernels import native\n"
        "from tests.velox_cache.kernels.test_native_greedy import awkward_logits, mlx_choice, mlx_forced\n"
        "print(native.ops().sampling_instruction_set())\n"
        "for x in awkward_logits():\n"
        "    targets = mx.array(np.arange(x.shape[0], dtype=np.int32) * 7 % x.shape[1])\n"
        "    for t, l in (native.ops().greedy_choice(mx.array(x)), mlx_choice(mx.array(x)),\n"
        "                 native.ops().forced_choice(mx.array(x), targets)[::2], mlx_forced(mx.array(x), targets)):\n"
        "        print(hashlib.sha256(np.array(t).tobytes() + np.array(l).tobytes()).hexdigest()[:16])\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env={**os.environ, "VELOX_NATIVE_ISA": instruction_set}, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    chosen, *digests = result.stdout.split()
    if chosen != instruction_set:
        pytest.skip(f"this CPU runs {chosen}, not {instruction_set}")
    assert digests[0::2] == digests[1::2]


def test_without_the_native_ops_the_choice_is_mlxs(monkeypatch):
    monkeypatch.setenv(native.ENVIRONMENT_VARIABLE, "0")
    logits = mx.random.normal((4, 500), key=mx.random.key(2)) * 3
    tokens, logprobs = greedy_choice(logits)
    expected_tokens, expected_logprobs = mlx_choice(logits)
    assert mx.array_equal(tokens, expected_tokens).item()
    assert _bits(logprobs) == _bits(expected_logprobs)


def mlx_forced(logits, targets):
    logprobs = log_softmax(logits)
    return mx.argmax(logprobs, axis=-1), mx.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]


@needs_native
@exact
@pytest.mark.parametrize("case", range(len(awkward_logits())))
def test_the_native_forced_choice_gives_mlxs_token_and_target_logprob_bits(case):
    logits = mx.array(awkward_logits()[case])
    rng = np.random.default_rng(case)
    targets = mx.array(rng.integers(0, logits.shape[-1], size=logits.shape[:-1]).astype(np.int32))
    expected_tokens, expected_logprobs = mlx_forced(logits, targets)
    tokens, target_logprobs = forced_choice(logits, targets)
    assert np.array(tokens).tolist() == np.array(expected_tokens).tolist()
    assert _bits(target_logprobs) == _bits(expected_logprobs)
    _, own_logprobs = mlx_forced(logits, expected_tokens.astype(mx.int32))  # a target that is the greedy token
    assert _bits(forced_choice(logits, expected_tokens)[1]) == _bits(own_logprobs)


@needs_native
def test_a_forced_target_outside_the_vocabulary_is_nan_not_a_read_past_the_row():
    logits = mx.random.normal((3, 100), key=mx.random.key(4))
    _, target_logprobs = native.ops().forced_choice(logits, mx.array([-1, 100, 5], mx.int32))[::2]
    values = np.array(target_logprobs)
    assert np.isnan(values[:2]).all() and np.isfinite(values[2])
    with pytest.raises(ValueError, match="targets"):
        native.ops().forced_choice(logits, mx.array([1, 2], mx.int32))


@exact
@pytest.mark.parametrize("penalty", [None, 1.3])
@pytest.mark.parametrize("length", [1, 2, 9])
def test_forced_choices_are_argmax_and_target_of_the_forced_logprobs(penalty, length):
    """What teacher forcing compares: the same tokens and log-probability bits as the [n, V] log-softmax gives."""
    sampler = TokenSampler([5, 6, 7], repetition_penalty=penalty)
    rng = np.random.default_rng(length)
    reference = rng.integers(0, 700, size=length).tolist()
    first = log_softmax(mx.array(rng.normal(size=(1, 700)).astype(np.float32)))
    logits = mx.array((rng.normal(size=(length - 1, 700)) * 4).astype(np.float32)) if length > 1 else None
    logprobs = sampler.forced_logprobs(first, logits, reference)
    expected = mx.argmax(logprobs, axis=-1), mx.take_along_axis(logprobs, mx.array(reference)[:, None], axis=-1)[:, 0]
    tokens, target_logprobs = sampler.forced_choices(first, logits, reference)
    assert np.array(tokens).tolist() == np.array(expected[0]).tolist()
    assert _bits(target_logprobs) == _bits(expected[1])
