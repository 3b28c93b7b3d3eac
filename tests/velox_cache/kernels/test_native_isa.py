"""Every instruction set's loops run on this host: ``VELOX_NATIVE_ISA`` picks the set of every native op.

The native module chooses its loops once, when an op is first used, so each set
runs in a process of its own: the set each op reports is the one asked for, and
the native tests pass on it (the suite itself runs them on the fastest set this
CPU has, so that one is not run again here).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from velox_cache.kernels import native

ROOT = Path(__file__).resolve().parents[3]
NATIVE_TESTS = [f"tests/velox_cache/kernels/{name}" for name in (
    "test_native.py", "test_native_attention.py", "test_native_quantized.py", "test_native_greedy.py",
)]
# What each set needs of the CPU (dispatch.cpp's `pick`), as /proc/cpuinfo names the flags.
NEEDS = {"baseline": set(), "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512dq", "avx512bw", "avx512vl", "fma"}}
OPS = ("instruction_set", "attention_instruction_set", "quantized_instruction_set", "sampling_instruction_set")


def cpu_flags() -> set:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


def runnable() -> list:
    """The sets this CPU runs, fastest first."""
    flags = cpu_flags()
    return [isa for isa in ("avx512", "avx2", "baseline") if NEEDS[isa] <= flags]


pytestmark = pytest.mark.skipif(native.ops() is None or sys.platform != "linux" or not cpu_flags(),
                                reason=f"native ops on Linux x86 only: {native.status()}")


def _run(isa, *args) -> subprocess.CompletedProcess:
    """``python *args`` with ``VELOX_NATIVE_ISA=isa`` (None: unset)."""
    env = {key: value for key, value in os.environ.items() if key not in ("VELOX_NATIVE_ISA", native.ENVIRONMENT_VARIABLE)}
    if isa is not None:
        env["VELOX_NATIVE_ISA"] = isa
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_every_native_op_runs_the_set_asked_for(isa):
    if isa not in runnable():
        pytest.skip(f"this CPU cannot run the {isa} loops")
    script = ("from velox_cache.kernels import native; ops = native.ops(); "
              f"print(' '.join(getattr(ops, name)() for name in {OPS!r}))")
    done = _run(isa, "-c", script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [isa] * len(OPS)


def test_without_a_choice_every_op_runs_the_fastest_set_this_cpu_has():
    done = _run(None, "-c", "from velox_cache.kernels import native; ops = native.ops(); "
                f"print(' '.join(getattr(ops, name)() for name in {OPS!r}))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [runnable()[0]] * len(OPS)


@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_the_native_tests_pass_on_each_slower_set(isa):
    if isa not in runnable() or isa == runnable()[0]:
        pytest.skip(f"{isa}: not runnable here, or the suite's own set")
    done = _run(isa, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *NATIVE_TESTS)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
