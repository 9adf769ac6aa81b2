# `make run`: the whole stack on embedded real servers.  `make test`: lint, types and every test.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install run test lint unit bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/weir up $(ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest $(PYTEST_ARGS)

unit: install
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m bench.bus
	$(BIN)/python -m bench.counters
	$(BIN)/python -m bench.auth
	command -v wrk >/dev/null || apt-get install -y wrk
	$(BIN)/python -m bench.api

clean:
	rm -rf .weir .pytest_cache .mypy_cache .ruff_cache
