# The two commands of the README: `make demo` (the main job on embedded defaults) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
DEMO_STAMP := $(VENV)/.installed-demo

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

# The demo's chart needs matplotlib (the optional demo extra; nothing else imports it).
$(DEMO_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,demo]'
	touch $@

venv: $(STAMP)

native:
	$(MAKE) -s -C native all all-fake

# The paper's 256-GPU experiment, healthy / without / with Greyhound (stack/paper_demo.py); the
# small one-fault demos: greyhound demo --fault slow|link|hang.
demo: $(DEMO_STAMP) native
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
