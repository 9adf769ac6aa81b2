# `make run`: the whole stack on embedded real servers.  `make test`: lint, types and every test.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# Bytecode is cached (__pycache__/, ignored by git) even where the environment says not to: the suite and `weir up`
# start hundreds of service processes, and each would compile Weir's own modules again (0.35 s of a 2.6 s start)
export PYTHONDONTWRITEBYTECODE =

.PHONY: install run test lint unit bench clean browser edge

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

# the edge in front of the api (`weir up --edge`, weir/edge.py): Debian's HAProxy
edge:
	command -v haproxy >/dev/null || (apt-get update && apt-get install -y --no-install-recommends haproxy)

run: install
	$(BIN)/weir up $(ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

# Two cores: every test but the fault tests in two workers (each with its own embedded servers; a test file stays on
# one worker, with its module's fixtures), then the fault tests alone, since each kills servers under load and bounds
# the recovery in time. Against external servers (WEIR_TEST_EXTERNAL=1) the workers would share them: one worker.
# Exit status 5 is "nothing selected" (e.g. PYTEST_ARGS="-k outbox" matches no fault test).
TEST_WORKERS ?= $(if $(filter 1,$(WEIR_TEST_EXTERNAL)),0,2)
test: lint browser edge
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile -m "not faults" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(BIN)/pytest -m faults $(PYTEST_ARGS) || [ $$? -eq 5 ]

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
