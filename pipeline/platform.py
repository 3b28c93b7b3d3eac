"""What this machine runs MLX on: backend, BLAS, and a measured float32 GEMM speed.

On Linux CPU the ``mlx-cpu`` wheel links a reference BLAS that is ~40x slower
than OpenBLAS for float32 GEMM. ``ensure_fast_blas`` re-executes the current
command with OpenBLAS preloaded when the system has it (Debian:
``libopenblas0-pthread``); ``VELOX_BLAS=reference`` turns that off and
``VELOX_BLAS=/path/to/libblas.so.3`` picks a library.

OpenBLAS picks its kernels from the CPU model it reads with ``cpuid``. Inside
some virtual machines (this project's Firecracker VM among them: "Intel(R)
Xeon(R) Processor") it does not recognise the model and falls back to its
generic SSE3 kernels ("Prescott"), measured here at 34 GFLOP/s for a 1024^3
float32 GEMM against 190 with the AVX-512 kernels the CPU supports. So the
re-execution also sets ``OPENBLAS_CORETYPE`` from the CPU's instruction-set
flags, unless it is set already (set it to override the choice).

After each GEMM OpenBLAS's worker threads spin, yielding, for 2**28 cycles
(~0.1 s) before they sleep. On two cores that spinning thread takes a core from
whatever runs next: Velox's fused attention (two threads of its own) and MLX's
elementwise ops. So the re-execution also sets ``OPENBLAS_THREAD_TIMEOUT=18``
(2**18 cycles, ~0.1 ms: back-to-back GEMMs still find the thread awake), unless
it is set already. Measured on a 2-core AMD EPYC: a 256-token chunk after 3,840
keys 1,317 -> 920 ms, a 1k prefill 2.23 -> 1.93 s, a decode step 62.5 -> 57 ms.
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
CORETYPE_VARIABLE = "OPENBLAS_CORETYPE"
THREAD_TIMEOUT_VARIABLE = "OPENBLAS_THREAD_TIMEOUT"
THREAD_TIMEOUT = "18"  # log2 of the cycles an idle OpenBLAS thread spins before sleeping (OpenBLAS: 4..30, default 28)
# OpenBLAS x86-64 cores, best first, each with the instruction-set flags its kernels need.
OPENBLAS_CORES = (
    ("Cooperlake", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}),
    ("SkylakeX", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    ("Haswell", {"avx2", "fma"}),
)


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


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The instruction-set flags of this machine's first CPU (empty where ``cpuinfo`` is unreadable)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def openblas_core(flags: set[str] | None = None) -> str | None:
    """The OpenBLAS core (``OPENBLAS_CORETYPE``) that the CPU's flags support best, or None.

    None off x86-64 Linux and on CPUs without AVX2: there OpenBLAS's own choice stands.
    """
    if flags is None:
        if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
            return None
        flags = cpu_flags()
    for core, needed in OPENBLAS_CORES:
        if needed <= flags:
            return core
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
        core = _openblas_core_name()
        return f"OpenBLAS ({library}, {core} kernels)" if core else f"OpenBLAS ({library})"
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


def _openblas_core_name() -> str | None:
    """The core whose kernels the loaded OpenBLAS runs (``openblas_get_corename``), or None."""
    try:
        getter = ctypes.CDLL(None).openblas_get_corename
    except (AttributeError, OSError):
        return None
    getter.restype = ctypes.c_char_p
    name = getter()
    return name.decode() if name else None


def fast_blas_environment(environ: dict[str, str] | None = None) -> dict[str, str] | None:
    """The environment to re-execute with (OpenBLAS preloaded, its core and thread timeout set), or None when set up.

    None also off Linux, when disabled with ``VELOX_BLAS=reference``, when no
    OpenBLAS is installed, and after one re-execution.
    """
    environ = dict(os.environ if environ is None else environ)
    library = find_openblas()
    if library is None or environ.get(REEXEC_FLAG):
        return None
    core = None if environ.get(CORETYPE_VARIABLE) else openblas_core()
    preloaded = str(library) in environ.get("LD_PRELOAD", "")
    timeout_set = bool(environ.get(THREAD_TIMEOUT_VARIABLE))
    if preloaded and core is None and timeout_set:
        return None
    if not preloaded:
        environ["LD_PRELOAD"] = ":".join(filter(None, [str(library), environ.get("LD_PRELOAD")]))
    if core is not None:
        environ[CORETYPE_VARIABLE] = core
    if not timeout_set:
        environ[THREAD_TIMEOUT_VARIABLE] = THREAD_TIMEOUT
    environ[REEXEC_FLAG] = "1"
    return environ


def ensure_fast_blas() -> None:
    """Re-execute this command with OpenBLAS preloaded and its core set (``fast_blas_environment``).

    Does nothing when that environment is already in place.
    """
    env = fast_blas_environment()
    if env is None:
        return
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


def main(argv: list[str]) -> None:
    """``python -m pipeline.platform ARGS...``: run ``python ARGS...`` with the fast BLAS set up.

    What ``make test`` and ``make bench`` use, so that pytest and the benchmarks get the
    same OpenBLAS preload and core as ``velox-batch``.
    """
    env = fast_blas_environment() or dict(os.environ)
    env.pop(REEXEC_FLAG, None)
    os.execve(sys.executable, [sys.executable, *argv], env)


if __name__ == "__main__":
    main(sys.argv[1:])
