"""Build Velox's native CPU ops: ``python -m velox_cache.kernels.native.build``.

Configures and builds ``velox_native.cpp`` with CMake against the installed
mlx wheel (its headers, ``libmlx`` and ``share/cmake/MLX``) and nanobind, then
puts the module ``_ops`` beside this file and checks that it loads and agrees
with the pure-MLX ops. Needs a C++20 compiler and CMake (Debian:
``apt-get install g++ cmake``). ``make setup`` runs it with ``--optional``:
where it cannot build, Velox runs on the pure-MLX path, which is always there.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD_DIRECTORY = HERE / "build"


def cmake() -> str | None:
    """CMake: the one pip put beside this interpreter (the ``native`` extra), else the one on PATH."""
    beside = Path(sys.executable).parent / "cmake"
    return str(beside) if beside.exists() else shutil.which("cmake")


def missing_tools() -> list[str]:
    """The tools the build needs that this machine lacks (empty when it can build)."""
    missing = [] if cmake() else ["cmake"]
    if not any(shutil.which(compiler) for compiler in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++)")
    return missing


def build(verbose: bool = False) -> Path:
    """Build the module into this package; returns its path. Raises ``RuntimeError`` on failure."""
    missing = missing_tools()
    if missing:
        raise RuntimeError(f"cannot build Velox's native ops: missing {', '.join(missing)} (Debian: apt-get install g++ cmake)")
    BUILD_DIRECTORY.mkdir(exist_ok=True)
    output = None if verbose else subprocess.PIPE
    configure = [cmake(), "-S", str(HERE), "-B", str(BUILD_DIRECTORY), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DPython_EXECUTABLE={sys.executable}"]
    for command in (configure, [cmake(), "--build", str(BUILD_DIRECTORY), "--parallel", "2"]):
        result = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, text=True)
        if result.returncode:
            raise RuntimeError(f"{Path(command[0]).name} {command[1]} failed:\n{(result.stdout or '')[-4000:]}")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    built = BUILD_DIRECTORY / f"_ops{suffix}"
    if not built.exists():
        raise RuntimeError(f"the build made no {built.name} in {BUILD_DIRECTORY}")
    target = HERE / built.name
    staged = target.with_suffix(".new")
    shutil.copy2(built, staged)
    staged.replace(target)  # a new file, not rewritten in place: processes using the old one keep it intact
    return target


def check() -> str:
    """Load the built module in a fresh interpreter and compare it with the pure-MLX ops; '' when it agrees."""
    probe = "from velox_cache.kernels import native_check; print(native_check.self_check())"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if result.returncode:
        return (result.stderr or result.stdout).strip()[-2000:]
    return result.stdout.strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m velox_cache.kernels.native.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--optional", action="store_true",
                        help="on failure print a warning and exit 0: Velox then runs on its pure-MLX path")
    parser.add_argument("--verbose", action="store_true", help="show CMake's and the compiler's output")
    args = parser.parse_args(argv)
    if platform.system() != "Linux":
        print("velox native ops: not built (only MLX's Linux CPU backend needs them)")
        return 0
    try:
        target = build(args.verbose)
        problem = check()
        if problem:
            target.unlink(missing_ok=True)
            raise RuntimeError(f"the built module failed its check, removed:\n{problem}")
    except RuntimeError as error:
        print(f"{'warning' if args.optional else 'error'}: {error}", file=sys.stderr)
        if args.optional:
            print("velox native ops: not built; Velox uses its pure-MLX ops", file=sys.stderr)
        return 0 if args.optional else 1
    print(f"velox native ops: built {target.relative_to(HERE.parent.parent) if HERE.parent.parent in target.parents else target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
