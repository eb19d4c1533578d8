"""The order test files are handed out in: the long ones first, longest first.

`make test` runs the suite on a worker per core, each taking whole files (pytest-xdist's
``--dist loadfile``; ``--no-loadscope-reorder`` keeps the order given here). xdist's own order,
most tests first, hands out the one-test files last, and they are among the longest: the fleet
model's one test then runs alone at the end while the other worker has nothing left (198 s in
the last CI run; 280 s and more here). Longest first, the short files fill in at the end instead.

A file's cost is known only from a past run: the list is what `make test` measured (the files
over about 25 s, longest first; docs/development.md says how to measure them again). A file not
named keeps its place after these, in collection order (the unit tier last). A stale entry costs
wall time, never a result: the order decides no outcome.
"""

from __future__ import annotations

import pytest

#: The files over about 25 s in `make test` (2 workers on 2 cores), longest first.
LONG_FILES: tuple[str, ...] = (
    "tests/scenario/test_fleet_model.py",
    "tests/scenario/test_fleet.py",
    "tests/browser/test_dashboard_at_scale.py",
    "tests/scenario/test_failover_bench.py",
    "tests/scenario/test_refit_from.py",
    "tests/scenario/test_router_processes.py",
    "tests/ray_tier/test_ray_fleet.py",
    "tests/scenario/test_replay.py",
    "tests/scenario/test_check_cli.py",
    "tests/scenario/test_watchdog.py",
    "tests/scenario/test_refit.py",
    "tests/scenario/test_resilience.py",
    "tests/scenario/test_exactness_oracle.py",
    "tests/unit/test_cli.py",
    "tests/scenario/test_router_under_faults.py",
    "tests/scenario/test_soak.py",
    "tests/scenario/test_examples.py",
    "tests/scenario/test_check_profiles.py",
    "tests/scenario/test_sleep.py",
    "tests/llamacpp/test_real_llamacpp_fleet.py",
    "tests/scenario/test_bad_input.py",
    "tests/scenario/test_evidence.py",
    "tests/scenario/test_engine_keys.py",
    "tests/scenario/test_demo.py",
    "tests/scenario/test_continuation.py",
)
_RANK = {path: rank for rank, path in enumerate(LONG_FILES)}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return _RANK.get(item.nodeid.split("::", 1)[0], len(LONG_FILES))

    items.sort(key=rank)  # stable: a file's own tests, and the files not named, keep their order
