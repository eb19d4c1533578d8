"""The fleet model's memory of the faults it made: a wedged engine stays wedged until its
process is replaced or restarted, however long that takes (:mod:`fleetwarden.testing.fleet_model`).
"""

from __future__ import annotations

import contextlib
import random
import sqlite3
import time
from pathlib import Path
from typing import Any

from fleetwarden.journal import Journal
from fleetwarden.sim.config import FaultMode, SimConfig
from fleetwarden.sim.server import Sim
from fleetwarden.testing.fleet_model import (
    EPOCHS,
    FAULT_MEMORY_S,
    PUSH_BOUND_S,
    FleetModel,
    ModelReport,
    sim_restarts,
)
from fleetwarden.testing.load import RequestResult


def model(tmp_path: Path) -> FleetModel:
    static = EPOCHS[0]
    return FleetModel(static, random.Random(0), tmp_path, ModelReport(0), lambda _: None)


def shards(m: FleetModel, launched_pid: int | None = 100) -> list[dict[str, Any]]:
    """The shards as the admin API lists them: the launched one first, then each attached."""
    out = [{"index": 0, "pid": launched_pid, "base_url": "http://127.0.0.1:1"}]
    out += [{"index": 1 + k, "pid": None, "base_url": a.url} for k, a in enumerate(m.attached)]
    return out


def test_a_wedge_is_remembered_while_its_process_lives_then_forgotten(tmp_path: Path) -> None:
    """Before, a wedge was forgotten FAULT_MEMORY_S after it was made: a clean restart of
    fleetwarden that took 15.6 s outlived it, and the wedge's own failed request on a poison
    draw counted as a healthy engine ejected."""
    m = model(tmp_path)
    now = shards(m)
    m.wedged[1] = m.identity(now[1])  # an attached engine, wedged long ago
    m.wedged[0] = m.identity(now[0])  # the launched one, wedged long ago
    long_ago = time.monotonic() - 10 * FAULT_MEMORY_S
    m.faulted_at[0] = m.faulted_at[1] = long_ago
    m.remember_wedges(now)
    assert m.faulted_at[1] > long_ago + 9 * FAULT_MEMORY_S  # still wedged: faulted now
    assert m.faulted_at[0] > long_ago + 9 * FAULT_MEMORY_S
    # The attached engine replaced (the system behind --backend), the launched one started
    # again by fleetwarden (a new PID): both forgotten, their fault times left as they were.
    m.attached[0].generation += 1
    m.faulted_at[0] = m.faulted_at[1] = long_ago
    m.remember_wedges(shards(m, launched_pid=101))
    assert m.wedged == {}
    assert m.faulted_at[0] == m.faulted_at[1] == long_ago


def test_a_launched_engine_restarted_in_place_is_no_longer_wedged(tmp_path: Path) -> None:
    m = model(tmp_path)
    now = shards(m)
    m.wedged[0] = m.identity(now[0])
    m.restarts_by_model[0] += 1  # the simulator's own restart clears its fault
    m.remember_wedges(now)
    assert 0 not in m.wedged


def test_a_shard_the_journal_shows_leaving_healthy_between_checks_was_no_healthy_engine(
        tmp_path: Path) -> None:
    """Checks are samples. When fleetwarden starts again in trainer mode, every attached shard
    turns STALE (nothing says which weights it holds); a request refused 409 after that and
    before the next check was counted against a HEALTHY shard seen at the check before."""
    m = model(tmp_path)
    Journal(m.journal_path).close()  # the fleet's own schema
    now = time.monotonic()
    m.healthy_seen.append((now - 1.0, frozenset({2})))
    refused = RequestResult("load-36", started=now - 0.5, latency_s=0.01, status=409)
    assert m.had_healthy(refused)  # no transition journaled: it had one
    wall = time.time() - 0.49
    with contextlib.closing(sqlite3.connect(m.journal_path)) as conn, conn:
        conn.execute("INSERT INTO transitions (shard, from_state, to_state, event, cause, at, "
                     "wall, record) VALUES (2, 'HEALTHY', 'STALE', 'new run, weights lost', "
                     "'fleetwarden started again', 0, ?, '{}')", (wall,))
    assert not m.had_healthy(refused)
    # A shard that left HEALTHY before the request's window began is not held against it.
    later = RequestResult("load-37", started=now + PUSH_BOUND_S + 1.0, latency_s=0.01,
                          status=409)
    m.healthy_seen.append((later.started - 0.1, frozenset({2})))
    assert m.had_healthy(later)


async def test_the_model_counts_only_the_restarts_the_simulator_made() -> None:
    """A crashed simulated engine takes no more orders: a restart asked of it never happens,
    and a model that counted it anyway saw a process changed during a refit's lease that was
    the same process (the long run's trainer step 41: the count was read from the wrong key
    of ``/sim/stats``, never found, and every restart asked for was counted)."""
    async with Sim(SimConfig(crash_exit_s=30)) as sim:
        assert await sim_restarts(sim.url) == 0
        await sim.set_fault(FaultMode.RESTART)
        assert await sim_restarts(sim.url) == 1
        await sim.set_fault(FaultMode.CRASH)
        await sim.set_fault(FaultMode.RESTART)  # a dead process takes no more orders
        assert await sim_restarts(sim.url) == 1
    assert await sim_restarts(sim.url) is None  # gone: not an answer
