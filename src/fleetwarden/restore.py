"""What a fleet does with the last run's journal when it starts again.

Owns: the restore policy. Which engines of the earlier run are adopted and which are stopped
(:func:`adopt_or_stop`); the ledger after a clean stop, where this run's engines are a start
and not a restart (:func:`after_clean_stop`); and the ledger after an unclean stop, where the
fresh engines go through the usual restart (:func:`restore_onto`).

Must not: start engines (``fleet.py`` does, through the launchers), or decide health outside
the ledger's operations.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import aiohttp

from fleetwarden.journal import Journal
from fleetwarden.launchers import EngineHandle, EngineRecord
from fleetwarden.launchers.local import LocalLauncher
from fleetwarden.ledger import ABSENT, Ledger, Policy, ShardState, WeightsMode
from fleetwarden.probe import health_status

__all__ = ["adopt_or_stop", "after_clean_stop", "restore_onto"]

log = logging.getLogger(__name__)


#: Seconds an engine of the last run gets to answer ``/health`` before it is stopped instead of
#: adopted. A live engine answers in milliseconds; one that cannot answer in 3 s is not worth
#: keeping, and the start of the whole fleet waits on this once per leftover engine.
ADOPT_HEALTH_TIMEOUT_S = 3.0


async def _answers(url: str) -> bool:
    async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=ADOPT_HEALTH_TIMEOUT_S)) as s:
        return await health_status(s, url + "/health") == 200


async def adopt_or_stop(
    journal: Journal, local: LocalLauncher, restored: Ledger
) -> dict[int, EngineHandle]:
    """Engines an earlier run left running: the current one of each shard is adopted, the
    rest (a restart in progress, a condemned engine not yet stopped) are stopped."""
    adopted: dict[int, EngineHandle] = {}
    for d in journal.running_engines():
        saved = EngineRecord(**{k: d[k] for k in EngineRecord.__dataclass_fields__})
        current = (saved.shard < len(restored) and saved.shard not in adopted
                   and restored.shard(saved.shard).base_url == saved.url
                   and restored.state(saved.shard) not in ABSENT)
        if current and local.adoptable(saved) and await _answers(saved.url):
            adopted[saved.shard] = await local.adopt(saved)
            continue
        stopped = await local.stop_leftover(saved)
        journal.engine_stopped(saved.launch_id)
        if stopped:
            log.warning("shard %d: an engine of the earlier run (%s) was not adopted and "
                        "was stopped", saved.shard, saved.launch_id)
    return adopted


def after_clean_stop(
    restored: Ledger, first: dict[int, EngineHandle | BaseException], policy: Policy,
    weights: WeightsMode,
) -> Ledger:
    """The last run stopped its engines on purpose: this run's engines are a start, not a
    restart. The fleet keeps what it learned (restart budgets spent, retirements, weight
    versions); each engine is a new process, so streaks start at 0. In trainer mode a new
    process holds the checkpoint's weights: STALE until the trainer's next refit."""
    trainer = weights == "trainer"
    records = []
    for rec in restored.snapshot():
        handle = first.get(rec.index)
        if rec.state is ShardState.RETIRED:
            records.append(rec)
            continue
        url = handle.url if isinstance(handle, EngineHandle) else rec.base_url
        records.append(replace(
            rec, base_url=url,
            incarnation=handle.incarnation if isinstance(handle, EngineHandle) else None,
            state=ShardState.STALE if trainer else ShardState.HEALTHY,
            consecutive_probe_failures=0, consecutive_probe_successes=0,
            consecutive_reported_failures=0,  # the last run's processes failed those
            state_before_partial=None,  # a verdict on the last run's processes
            last_error="", last_transition_at=time.time(),
        ))
    return Ledger.from_records(records, policy, clock=time.time)


def restore_onto(ledger: Ledger, first: dict[int, EngineHandle | BaseException]) -> None:
    """A restored ledger: the engines of the last run are gone, fresh ones stand in.

    A shard that was serving or STALE is condemned (its process is gone) and its fresh
    engine is taken through the usual restart: RESTARTING -> STALE, budget spent, no
    history carried over; then canary or refit. Adopting the last run's engines, where they
    still run, comes with fleetwarden's own restart (resilience).
    """
    for i, result in first.items():
        state = ledger.state(i)
        if state not in ABSENT:
            ledger.condemn(i, "fleetwarden restarted: the engine of its last run is gone")
        if ledger.state(i) in (ShardState.DEAD, ShardState.RESTARTING):
            if ledger.state(i) is ShardState.DEAD:
                ledger.mark_restarting(i)
            if isinstance(result, EngineHandle):
                ledger.mark_loaded(i, result.url, result.incarnation)
