# The two commands of the README: `make demo` (the main job on embedded defaults) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: venv native demo test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# The tests also need the optional PyTorch and Megatron integrations (a CPU build of torch and
# megatron-core, pinned in pyproject.toml).
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,torch,megatron]'
	touch $@

venv: $(STAMP)

native:
	$(MAKE) -s -C native all all-fake

demo: venv native
	$(BIN)/greyhound demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

test: $(TEST_STAMP) native lint
	$(MAKE) -s -C native test asan tsan
	$(BIN)/pytest -q

clean:
	$(MAKE) -s -C native clean
	rm -rf .greyhound .pytest_cache .mypy_cache .ruff_cache
