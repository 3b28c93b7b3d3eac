"""What this machine runs MLX on: backend, BLAS, and a measured float32 GEMM speed.

On Linux CPU the ``mlx-cpu`` wheel links a reference BLAS that is ~40x slower
than OpenBLAS for float32 GEMM. ``ensure_fast_blas`` re-executes the current
command with OpenBLAS preloaded when the system has it (Debian:
``libopenblas0-pthread``); ``VELOX_BLAS=reference`` turns that off and
``VELOX_BLAS=/path/to/libblas.so.3`` picks a library.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

OPENBLAS_PATTERNS = (
    "/usr/lib/*/openblas-pthread/libblas.so.3",
    "/usr/lib/*/openblas-openmp/libblas.so.3",
    "/usr/lib/*/openblas-serial/libblas.so.3",
    "/usr/lib64/openblas*/libblas.so.3",
)
REEXEC_FLAG = "VELOX_BLAS_REEXEC"


def package_version(package: str) -> str:
    """The installed version of ``package``, or ``not installed``."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def backend_name() -> str:
    """``metal``, ``cuda`` or ``cpu``: where MLX runs by default here."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda"


def find_openblas() -> Path | None:
    """The OpenBLAS ``libblas.so.3`` to preload, or None (also when disabled by ``VELOX_BLAS``)."""
    choice = os.environ.get("VELOX_BLAS", "")
    if choice == "reference" or not sys.platform.startswith("linux"):
        return None
    if choice:
        return Path(choice) if Path(choice).is_file() else None
    for pattern in OPENBLAS_PATTERNS:
        found = sorted(glob.glob(pattern))
        if found:
            return Path(found[0])
    return None


def loaded_blas() -> str:
    """The BLAS whose GEMM MLX calls in this process (``doctor`` and ``runs.device`` show this).

    MLX resolves ``cblas_sgemm`` through the global symbol scope first (where a
    preloaded library sits) and falls back to the reference BLAS bundled with the
    ``mlx-cpu`` wheel. Other BLAS copies in the process (numpy's bundled
    OpenBLAS, with renamed symbols) do not count.
    """
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    library = _global_symbol_library("cblas_sgemm")
    if library is None:
        return "reference BLAS bundled with mlx (slow)"
    if "openblas" in os.path.realpath(library).lower() or "openblas" in library.lower():
        return f"OpenBLAS ({library})"
    return library


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _global_symbol_library(symbol: str) -> str | None:
    """The file of the library that defines ``symbol`` in the process's global scope, or None."""
    try:
        process = ctypes.CDLL(None)
        address = ctypes.cast(getattr(process, symbol), ctypes.c_void_p)
    except (AttributeError, OSError):
        return None
    try:
        dladdr = process.dladdr
    except AttributeError:  # glibc before 2.34 keeps it in libdl
        try:
            dladdr = ctypes.CDLL("libdl.so.2").dladdr
        except (OSError, AttributeError):
            return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def ensure_fast_blas() -> None:
    """Re-execute this command with OpenBLAS preloaded when it is available and not yet loaded.

    Does nothing off Linux, when already preloaded, when disabled with
    ``VELOX_BLAS=reference``, or when no OpenBLAS is installed.
    """
    library = find_openblas()
    if library is None or os.environ.get(REEXEC_FLAG):
        return
    if str(library) in os.environ.get("LD_PRELOAD", ""):
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(filter(None, [str(library), env.get("LD_PRELOAD")]))
    env[REEXEC_FLAG] = "1"
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)


BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def set_blas_threads(threads: int) -> int | None:
    """Cap this process's BLAS threads (so workers sharing a machine do not oversubscribe it).

    Sets the usual environment variables (read by libraries loaded later and by child
    processes) and, when OpenBLAS is already loaded, tells it directly. Returns the
    thread count OpenBLAS reports afterwards, or None when no OpenBLAS is loaded.
    """
    for name in BLAS_THREAD_VARIABLES:
        os.environ[name] = str(threads)
    return _openblas_threads(threads)


def blas_threads() -> int | None:
    """The thread count the loaded OpenBLAS uses, or None when no OpenBLAS is loaded."""
    return _openblas_threads(None)


def _openblas_threads(threads: int | None) -> int | None:
    try:
        process = ctypes.CDLL(None)
        getter = process.openblas_get_num_threads
        if threads is not None:
            process.openblas_set_num_threads(ctypes.c_int(threads))
    except (AttributeError, OSError):
        return None
    getter.restype = ctypes.c_int
    return int(getter())


def gemm_gflops(size: int = 1024, repeats: int = 5) -> float:
    """Measured float32 GEMM speed of MLX's default device, in GFLOP/s."""
    import mlx.core as mx

    a = mx.random.normal((size, size), dtype=mx.float32)
    b = mx.random.normal((size, size), dtype=mx.float32)
    mx.eval(a @ b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9
