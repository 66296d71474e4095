# Two entry points for a newcomer: `make demo` and `make test`.
VENV ?= .venv
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin

.PHONY: install demo test clean

# torch first, pinned: an unpinned torch (pulled in by transformers) would
# fetch several GB of CUDA packages.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/layercast up --demo

test: install
	$(BIN)/lint-imports
	$(BIN)/pytest

clean:
	rm -rf $(VENV) .layercast
