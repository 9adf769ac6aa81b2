# `make run`: the whole stack on embedded real servers.  `make test`: lint, types and every test.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install run test lint unit bench clean browser

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# the docs pages' scripts and stylesheets (web/package.json), served by each service itself: no page asks a CDN
WEB := web/node_modules/.installed
$(WEB): web/package.json web/package-lock.json
	command -v npm >/dev/null || (apt-get update && apt-get install -y --no-install-recommends nodejs npm)
	npm ci --prefix web --ignore-scripts --no-audit --no-fund --loglevel=error
	touch $(WEB)

install: $(STAMP) $(WEB)

# the browser tests' Chromium: Debian's, driven by Playwright (tests/browser); Playwright's own download is not used
browser:
	command -v chromium >/dev/null || (apt-get update && apt-get install -y --no-install-recommends chromium)

run: install
	$(BIN)/weir up $(ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint browser
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
