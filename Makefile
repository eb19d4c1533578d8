# make demo  — set everything up and show what fleetwarden does
# make test  — set everything up and run lint, types and the whole test suite

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev

# The pure core: no I/O, checked with mypy --strict.
CORE := src/fleetwarden/ledger.py src/fleetwarden/journal.py src/fleetwarden/story.py \
        src/fleetwarden/router/pool.py src/fleetwarden/router/settings.py

# The shell modules that are kept --strict clean too (typed I/O around the core).
TYPED_SHELL := src/fleetwarden/router src/fleetwarden/cli.py

.PHONY: test demo lint typecheck unit bench bench-router clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy --strict $(CORE)
	$(BIN)/mypy --strict $(TYPED_SHELL)

test: lint typecheck
	$(BIN)/pytest

demo: $(STAMP)
	$(BIN)/fleetwarden demo

bench: $(STAMP)
	$(BIN)/python bench/ledger_tick.py

bench-router: $(STAMP)
	$(BIN)/python bench/router_overhead.py --peer sglang-router

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
