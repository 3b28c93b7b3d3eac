"""The fast-BLAS setup: OpenBLAS preloaded, its kernels chosen from the CPU's flags; runs.device names the BLAS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import platform
from tests.pipeline.helpers import REPO, cli_env, rows

AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize(
    "flags, core",
    [
        (AVX512 | {"avx2", "fma", "avx512_bf16"}, "Cooperlake"),
        (AVX512 | {"avx2", "fma"}, "SkylakeX"),
        ({"avx2", "fma", "avx512f"}, "Haswell"),  # AVX-512 foundation alone is not enough
        ({"avx", "sse4_2"}, None),
        (set(), None),
    ],
)
def test_the_core_is_the_best_one_the_flags_support(flags, core):
    assert platform.openblas_core(flags) == core


def test_cpu_flags_are_read_from_the_first_cpu(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert platform.cpu_flags(str(cpuinfo)) == {"fpu", "sse2", "avx2"}
    assert platform.cpu_flags(str(tmp_path / "missing")) == set()


@pytest.fixture
def openblas_here(monkeypatch):
    monkeypatch.setattr(platform, "find_openblas", lambda: Path("/usr/lib/x/openblas-pthread/libblas.so.3"))
    monkeypatch.setattr(platform, "openblas_core", lambda flags=None: "SkylakeX")


def test_the_environment_preloads_openblas_and_sets_its_core(openblas_here):
    env = platform.fast_blas_environment({"PATH": "/bin"})
    assert env["LD_PRELOAD"] == "/usr/lib/x/openblas-pthread/libblas.so.3"
    assert env["OPENBLAS_CORETYPE"] == "SkylakeX" and env[platform.REEXEC_FLAG] == "1"
    assert env["OPENBLAS_THREAD_TIMEOUT"] == "18", "idle OpenBLAS threads sleep after ~0.1 ms, not ~0.1 s"


def test_a_preload_without_the_core_is_redone_with_it(openblas_here):
    env = platform.fast_blas_environment({"LD_PRELOAD": "/usr/lib/x/openblas-pthread/libblas.so.3:/other.so"})
    assert env["OPENBLAS_CORETYPE"] == "SkylakeX"
    assert env["LD_PRELOAD"] == "/usr/lib/x/openblas-pthread/libblas.so.3:/other.so"  # not preloaded twice


def test_a_core_the_user_set_is_kept(openblas_here):
    env = platform.fast_blas_environment({"OPENBLAS_CORETYPE": "Haswell"})
    assert env["OPENBLAS_CORETYPE"] == "Haswell" and "libblas" in env["LD_PRELOAD"]
    preloaded = {"OPENBLAS_CORETYPE": "Haswell", "LD_PRELOAD": "/usr/lib/x/openblas-pthread/libblas.so.3"}
    assert platform.fast_blas_environment({**preloaded, "OPENBLAS_THREAD_TIMEOUT": "28"}) is None
    assert platform.fast_blas_environment(preloaded)["OPENBLAS_THREAD_TIMEOUT"] == "18", "no timeout: redone with it"


def test_a_thread_timeout_the_user_set_is_kept(openblas_here):
    assert platform.fast_blas_environment({"OPENBLAS_THREAD_TIMEOUT": "28"})["OPENBLAS_THREAD_TIMEOUT"] == "28"


def test_nothing_to_do_after_one_reexecution_or_without_openblas(openblas_here, monkeypatch):
    assert platform.fast_blas_environment({platform.REEXEC_FLAG: "1"}) is None
    monkeypatch.setattr(platform, "find_openblas", lambda: None)
    assert platform.fast_blas_environment({}) is None


def test_the_wrapper_runs_python_with_the_core_the_cpu_supports():
    """``python -m pipeline.platform`` (what ``make test`` uses) loads OpenBLAS with the chosen kernels."""
    if platform.find_openblas() is None or platform.openblas_core() is None:
        pytest.skip("no OpenBLAS here, or a CPU without AVX2")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE", "VELOX_BLAS")}
    probe = "from pipeline.platform import loaded_blas; print(loaded_blas())"
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.platform", "-c", probe],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("OpenBLAS") and f"{platform.openblas_core()} kernels" in result.stdout


# ----- runs.device names the BLAS MLX really uses ----------------------------------------------


def test_runs_device_names_the_reference_blas_when_openblas_is_not_preloaded(job, tmp_path):
    env = {k: v for k, v in cli_env().items() if k != "LD_PRELOAD"}
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", str(job()), "--limit", "1", "--variant", "full", "-q"],
        cwd=REPO, env={k: str(v) for k, v in env.items()}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    [(device,)] = rows(tmp_path / "store.db", "select device from runs")
    assert "reference BLAS" in device and "OpenBLAS" not in device


def test_preloaded_openblas_is_recognised_with_numpy_loaded():
    from pipeline.platform import find_openblas

    library = find_openblas()
    if library is None:
        pytest.skip("no OpenBLAS installed")
    probe = "import numpy, mlx.core, mlx_lm; from pipeline.platform import loaded_blas; print(loaded_blas())"
    env = {**os.environ, "LD_PRELOAD": str(library)}
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("OpenBLAS") and "numpy" not in result.stdout
