"""Velox's native CPU ops, and the switch between them and the pure-MLX path.

MLX's CPU backend runs elementwise ops as scalar code on x86, and its ``exp``
makes an out-of-line call for every step of its polynomial. A small C++
extension (``velox_native.cpp``, built by ``python -m velox_cache.native.build``,
which ``make setup`` runs) adds four MLX primitives whose loops the compiler
vectorises (AVX-512 / AVX2 / baseline, picked at load time):

- ``row_max`` and ``shifted_exp``: the attention kernel's row maximum and its
  multiply/add ``exp``, bit for bit what the pure-MLX kernel computes;
- ``swiglu``: ``silu(gate) * x`` with a ~1 ulp float32 ``exp``;
- ``rope``: RoPE by a table of sines and cosines computed once per chunk
  (``velox_cache.elementwise.rope``), bit for bit ``mx.fast.rope``.

``ops()`` returns the loaded module, or None where it is not built (macOS, no
compiler), did not load, failed its check, or ``VELOX_NATIVE=0`` turns it off;
callers then use the pure-MLX ops, which stay tested.
"""

from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType
from typing import Optional

import mlx.core as mx

ENVIRONMENT_VARIABLE = "VELOX_NATIVE"  # "0": use the pure-MLX ops even where the native ones are built
SWIGLU_TOLERANCE = 1e-6  # relative to float64; mlx-lm's own nn.silu is off by up to 1.6e-6
ROPE_TOLERANCE = 1e-6  # against mx.fast.rope, relative to the largest |x|


def ops() -> Optional[ModuleType]:
    """The native ops module, or None when Velox should use its pure-MLX ops."""
    if os.environ.get(ENVIRONMENT_VARIABLE) == "0":
        return None
    return _loaded()[0]


def status() -> str:
    """One line for ``velox-batch doctor``: whether the native ops are in use, and why not."""
    if os.environ.get(ENVIRONMENT_VARIABLE) == "0":
        return f"off ({ENVIRONMENT_VARIABLE}=0)"
    module, problem = _loaded()
    return "loaded" if module is not None else problem


@functools.cache
def _loaded() -> tuple[Optional[ModuleType], str]:
    try:
        from . import _ops
    except ImportError:
        return None, "not built (python -m velox_cache.native.build; needs g++ and cmake)"
    built_for = getattr(_ops, "mlx_version", None)
    if built_for != mx.__version__:  # another mlx's ABI: calling into it could crash, so never do
        return None, f"built for mlx {built_for}, this is mlx {mx.__version__}: rebuild (python -m velox_cache.native.build)"
    try:
        with mx.stream(mx.cpu):
            mx.eval(_ops.row_max(mx.zeros((1, 2))))
    except Exception as error:  # a module built against another mlx or nanobind ABI
        warnings.warn(f"Velox's native ops did not load ({error}); using the pure-MLX ops", stacklevel=2)
        return None, f"built but unusable: {error}"
    return _ops, ""


def self_check() -> str:
    """Compare the native ops with the pure-MLX ones on awkward inputs; '' when they agree, else what differs.

    ``row_max`` and ``shifted_exp`` must match bit for bit (masked ``-inf``
    keys, fully masked rows, strided rows and broadcast shifts included);
    ``swiglu`` within ``SWIGLU_TOLERANCE`` (relative) of a float64 reference;
    ``rope`` within ``ROPE_TOLERANCE`` of ``mx.fast.rope``.
    """
    import mlx.nn as nn
    import numpy as np

    from .. import elementwise, kernel

    module, problem = _loaded()
    if module is None:
        return problem or "not loaded"
    problems = []
    with mx.stream(mx.cpu):
        scores = mx.random.normal((2, 3, 37, 301), key=mx.random.key(0)) * 3
        scores = mx.where(mx.random.uniform(shape=scores.shape, key=mx.random.key(1)) < 0.2, -mx.inf, scores)
        scores = mx.concatenate([scores, mx.full((2, 3, 1, 301), -mx.inf)], axis=2)  # a fully masked row
        strided = scores[:, :, 5:30]
        for name, x in (("contiguous", scores), ("strided", strided)):
            pure_max, native_max = kernel.pure_row_max(x), module.row_max(x)
            if not mx.array_equal(pure_max, native_max, equal_nan=True).item():
                problems.append(f"row_max differs ({name} rows)")
            shift = native_max / 2**kernel.SQUARINGS
            pure = kernel.pure_shifted_exp(x / 2**kernel.SQUARINGS, shift)
            native = module.shifted_exp(x / 2**kernel.SQUARINGS, shift)
            if not mx.array_equal(pure, native, equal_nan=True).item():
                problems.append(f"shifted_exp differs ({name} rows)")
        gate = mx.random.normal((4, 96, 1536), key=mx.random.key(2)) * 6
        x = mx.random.normal(gate.shape, key=mx.random.key(3))
        gate64, x64 = np.array(gate, dtype=np.float64), np.array(x, dtype=np.float64)
        expected = gate64 / (1 + np.exp(-gate64)) * x64
        got = np.array(module.swiglu(gate, x), dtype=np.float64)
        normal = np.abs(expected) >= 1e-30
        error = float((np.abs(got - expected)[normal] / np.abs(expected[normal])).max())
        if not error <= SWIGLU_TOLERANCE:
            problems.append(f"swiglu differs by {error:.2e} relative (tolerance {SWIGLU_TOLERANCE:.0e})")
        x = mx.random.normal((1, 40, 3, 64), key=mx.random.key(4)).transpose(0, 2, 1, 3)  # strided rows
        for traditional in (True, False):
            module = nn.RoPE(48, traditional=traditional, base=10000.0)
            expected = mx.fast.rope(x, 48, traditional=traditional, base=10000.0, scale=1.0, offset=9000)
            got = elementwise.rope(module, x, 9000)
            error = (mx.abs(got - expected).max() / mx.abs(x).max()).item()
            if got.shape != x.shape or not error <= ROPE_TOLERANCE:
                problems.append(f"rope (traditional={traditional}) differs by {error:.2e} (tolerance {ROPE_TOLERANCE:.0e})")
    return "; ".join(problems)
