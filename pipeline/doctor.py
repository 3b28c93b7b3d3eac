"""``velox-batch doctor``: what this machine runs on and what is missing, with fixes."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

from . import model_store, platform

GEMM_PROBE = "from pipeline.platform import gemm_gflops, loaded_blas; print(gemm_gflops(), '|', loaded_blas())"


@dataclass
class Report:
    facts: list[tuple[str, str]] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)

    def add(self, name: str, value: str) -> None:
        self.facts.append((name, value))


def _gemm_in_subprocess(preload: str | None) -> str:
    """Measure GEMM in a fresh interpreter, with or without a preloaded BLAS."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", platform.REEXEC_FLAG)}
    if preload:
        env["LD_PRELOAD"] = preload
    result = subprocess.run(
        [sys.executable, "-c", GEMM_PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0:
        return f"failed: {result.stderr.strip().splitlines()[-1:]}"
    gflops, blas = result.stdout.strip().split(" | ", 1)
    return f"{float(gflops):.1f} GFLOP/s ({blas})"


def _native_ops(report: Report) -> None:
    """Whether Velox's native CPU ops are in use (velox_cache.kernels.native), and how to build them if not."""
    from velox_cache.kernels import native

    status = native.status()
    ops = native.ops()
    report.add("Velox native ops", f"{status} ({ops.instruction_set()})" if ops is not None else status)
    from . import model_store

    report.add("weights", " ".join(model_store.hashed_weights().values()))
    if status.startswith(("not built", "built but unusable", "built for mlx")):
        report.advice.append(
            "Velox's native CPU ops are not in use: prefill runs ~1.5x slower. Fix: apt-get install g++ cmake, "
            "then python -m velox_cache.kernels.native.build (make setup does both)."
        )


def diagnose() -> Report:
    """Collect the facts ``doctor`` prints, and advice for anything missing."""
    import mlx.core as mx

    report = Report()
    report.add("mlx", platform.package_version("mlx"))
    report.add("mlx-lm", platform.package_version("mlx-lm"))
    backend = platform.backend_name()
    report.add("device", f"{mx.default_device()} ({backend} backend)")
    report.add("weights on this backend", model_store.weights_mode())
    report.add("BLAS in use", platform.loaded_blas())
    timeout = os.environ.get(platform.THREAD_TIMEOUT_VARIABLE)
    report.add("OpenBLAS idle threads spin", f"2**{timeout} cycles" if timeout else "2**28 cycles (OpenBLAS's default)")
    report.add("float32 GEMM (this process)", f"{platform.gemm_gflops():.1f} GFLOP/s")
    if backend == "cpu" and sys.platform.startswith("linux"):
        openblas = platform.find_openblas()
        report.add("float32 GEMM, reference BLAS", _gemm_in_subprocess(None))
        if openblas:
            report.add("float32 GEMM, OpenBLAS", _gemm_in_subprocess(str(openblas)))
        else:
            report.advice.append(
                "OpenBLAS not found: float32 GEMM runs ~40x slower. Fix: "
                "apt-get install libopenblas0-pthread (velox-batch then preloads it)."
            )
        _native_ops(report)
    report.add("model cache", str(model_store.models_dir()))
    imported = model_store.list_models()
    report.add("imported models", ", ".join(m.name for m in imported) or "none")
    try:
        report.add("embedded GGUF", str(model_store.embedded_gguf_path()))
    except model_store.ModelImportError as exc:
        report.add("embedded GGUF", "missing")
        report.advice.append(str(exc))
    if model_store.DEFAULT_MODEL not in {m.name for m in imported}:
        report.advice.append(
            f"default model '{model_store.DEFAULT_MODEL}' not imported yet: "
            "velox-batch models import (or it is imported on first use)."
        )
    return report
