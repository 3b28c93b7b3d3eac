"""Velox's native CPU ops, and the switch between them and the pure-MLX path.

MLX's CPU backend runs elementwise ops as scalar code on x86, and its ``exp``
makes an out-of-line call for every step of its polynomial. A small C++
extension (``velox_native.cpp``, built by ``python -m velox_cache.kernels.native.build``,
which ``make setup`` runs) adds five MLX primitives whose loops are
vectorised per instruction set (AVX-512 / AVX2 / baseline, picked at load time):

- ``row_max`` and ``shifted_exp``: the attention kernel's row maximum and its
  multiply/add ``exp``, bit for bit what the pure-MLX kernel computes;
- ``swiglu``: ``silu(gate) * x`` with a ~1 ulp float32 ``exp``;
- ``rope``: RoPE by a table of sines and cosines computed once per chunk
  (``velox_cache.kernels.elementwise.rope``), bit for bit ``mx.fast.rope``;
- ``attention`` (``attention.cpp``, ``attention_loops.cpp``): the whole
  attention call fused, FlashAttention-style, on both cores, with the key
  mass and sampled entropy (``velox_cache.kernels.fused``), within
  ``ATTENTION_TOLERANCE`` of a float64 reference as the pure-MLX kernel is.
- ``window_flush`` (``window_flush.cpp``): a batch of evicting layers at
  ``kv_bits`` moving rows' whole window groups into their quantized regions
  (``velox_cache.generation.quantized_slots_batch``), one op where the pure-MLX
  path takes ~100, with the same bits. It checks its arrays' shapes and dtypes, the rows (distinct rows
  of the batch) and that each has room for the group before it enqueues anything: a bad call is a
  ``ValueError`` in the caller, never an exception on MLX's stream thread (which ends the process).

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
# Fused attention (and the pure-MLX kernel) against a float64 reference: the output within this times
# the largest |value|, each key's mass within this, the entropy sum within this per row summed.
# Measured up to 1.5e-6, 1.1e-6 and 5e-7 (N = 4,096 keys); native and pure differ by at most twice this.
ATTENTION_TOLERANCE = 1e-5


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


def built() -> tuple[Optional[ModuleType], str]:
    """The built module whatever ``VELOX_NATIVE`` says, or None and why (for checks and ``doctor``)."""
    return _loaded()


@functools.cache
def _loaded() -> tuple[Optional[ModuleType], str]:
    try:
        from . import _ops
    except ImportError:
        return None, "not built (python -m velox_cache.kernels.native.build; needs g++ and cmake)"
    built_for = getattr(_ops, "mlx_version", None)
    if built_for != mx.__version__:  # another mlx's ABI: calling into it could crash, so never do
        return None, f"built for mlx {built_for}, this is mlx {mx.__version__}: rebuild (python -m velox_cache.kernels.native.build)"
    try:
        with mx.stream(mx.cpu):
            mx.eval(_ops.row_max(mx.zeros((1, 2))))
    except Exception as error:  # a module built against another mlx or nanobind ABI
        warnings.warn(f"Velox's native ops did not load ({error}); using the pure-MLX ops", stacklevel=2)
        return None, f"built but unusable: {error}"
    return _ops, ""
