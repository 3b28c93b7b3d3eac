"""The native ``window_flush`` refuses a bad call with a ValueError, before any work reaches MLX's stream thread.

An exception thrown while MLX evaluates (on its stream thread) ends the process
(``std::terminate``), so every call below runs in a child process: a missing check
shows as a dead child, not as a failed assertion in this one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from velox_cache.kernels import native

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(native.ops() is None or not hasattr(native.ops(), "window_flush"),
                                reason=f"native ops: {native.status()}")

# A batch of B = 2 rows, H = 1 head, a window of W = 8 tokens of D = 8 features, a region of Q = 16 slots, G = 4
# key-scale slots, 8 bits (DK = 8 bytes of codes a slot), values quantized in runs of 8 (NV = 1).
CHILD = r'''
import json, sys
import mlx.core as mx
from velox_cache.kernels import native

B, H, W, D, Q, G = 2, 1, 8, 8, 16, 4

def parts(quantized=(0, 0), groups=(0, 0), live_region=False):
    live = mx.concatenate([mx.full((B, H, Q), live_region, mx.bool_), mx.ones((B, H, W), mx.bool_)], axis=2)
    return [mx.zeros((B, H, Q, D), mx.uint8), mx.zeros((B, H, Q), mx.int32), mx.zeros((B, H, Q, D), mx.uint8),
            mx.zeros((B, H, Q, 1)), mx.zeros((B, H, Q, 1)), mx.zeros((B, H, G, D)), mx.zeros((B, H, G, D)),
            mx.random.normal((B, H, W, D)), mx.random.normal((B, H, W, D)), mx.zeros((B, H, Q + W)),
            mx.zeros((B, H, Q + W), mx.int32), live, mx.array(quantized, mx.int32), mx.array(groups, mx.int32),
            mx.array([4, 4], mx.int32)]

def flush(arrays, rows, group=4, bits=8, value_group=8):
    try:
        mx.eval(native.ops().window_flush(arrays, mx.array(rows, mx.int32), group, bits, value_group))
        return "ok"
    except ValueError as error:
        return "ValueError: " + str(error)

wrong_shape = parts(); wrong_shape[3] = mx.zeros((B, H, Q, 2))
wrong_dtype = parts(); wrong_dtype[1] = mx.zeros((B, H, Q), mx.float32)
print(json.dumps({
    "valid": flush(parts(), [1]),
    "row out of range": flush(parts(), [2]),
    "negative row": flush(parts(), [-1]),
    "row twice": flush(parts(), [0, 0]),
    "rows not 1-d": flush(parts(), [[0]]),
    "wrong shape": flush(wrong_shape, [0]),
    "wrong dtype": flush(wrong_dtype, [0]),
    "no room in the region": flush(parts(quantized=(14, 0), live_region=True), [0]),
    "room in its holes": flush(parts(quantized=(14, 0), live_region=False), [0]),
    "no key-scale slot": flush(parts(groups=(4, 0)), [0]),
    "bits": flush(parts(), [0], bits=3),
}))
'''


def test_bad_calls_are_value_errors_naming_what_is_wrong_and_the_process_lives():
    child = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, f"the child died ({child.returncode}): {child.stderr[-2000:]}"
    found = json.loads(child.stdout.strip().splitlines()[-1])
    assert found.pop("valid") == "ok" and found.pop("room in its holes") == "ok"
    expected = {
        "row out of range": "row 2 is not a row of the batch of 2",
        "negative row": "row -1 is not a row",
        "row twice": "row 0 is given twice",
        "rows not 1-d": "rows must be a 1-d array",
        "wrong shape": "array 3 is [2, 1, 16, 2], expected [2, 1, 16, 1]",
        "wrong dtype": "array 1 has another dtype",
        "no room in the region": "no room for a group of 4",
        "no key-scale slot": "none left for the new one",
        "bits": "group, bits or value_group out of range",
    }
    for case, message in expected.items():
        assert found[case].startswith("ValueError: window_flush:") and message in found[case], (case, found[case])
