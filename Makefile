# The two commands of the README: `make demo` (the main job on embedded defaults) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv native demo test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

venv: $(STAMP)

native:
	$(MAKE) -s -C native all all-fake

demo: venv native
	$(BIN)/greyhound demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

test: venv native lint
	$(MAKE) -s -C native test asan tsan
	$(BIN)/pytest -q

clean:
	$(MAKE) -s -C native clean
	rm -rf .greyhound .pytest_cache .mypy_cache .ruff_cache
