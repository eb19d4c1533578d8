"""What a fleet does with the last run's journal when it starts again.

Owns: the restore policy. Which engines of the earlier run are adopted and which are stopped
(:func:`adopt_or_stop`); and how the restored ledger meets this run's engines, clean stop or
not (:func:`begin_run`): a start, never a restart spent on fleetwarden's own death.

Must not: start engines (``fleet.py`` does, through the launchers), or decide health outside
the ledger's operations.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import aiohttp

from fleetwarden.journal import Journal
from fleetwarden.launchers import EngineHandle, EngineRecord
from fleetwarden.launchers.local import LocalLauncher
from fleetwarden.ledger import ABSENT, Ledger, ShardState
from fleetwarden.probe import health_status

__all__ = ["adopt_or_stop", "begin_run"]

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


def begin_run(
    ledger: Ledger, first: Mapping[int, EngineHandle | BaseException],
    attached: Mapping[int, str],
) -> None:
    """The restored ledger meets this run's engines, through the ledger's own operations (so
    every change is journaled with its cause: call it after the journal is attached).

    Whether the last run stopped cleanly or died, fleetwarden's restart is not an engine's
    failure: a shard that had a process and is not adopted gets its new engine as a new run,
    with no restart spent and no history (``Ledger.new_run``). Six crashes of fleetwarden must
    not retire a fleet. An interrupted restart (RESTARTING, already paid for) completes with
    the new engine. A DEAD shard is not launched here: the supervisor restarts it, within its
    budget, as any other. A first launch that fails leaves no shard without a way out: a
    serving or STALE shard is condemned, an interrupted restart fails back to DEAD; either way
    the supervisor takes it from there. Attached engines kept running without us: their shard
    is a new run (in trainer mode STALE: nothing says which weights it holds) on the URL this
    run's config names (``attached``: shard -> URL), never the journal's: an operator who
    replaced a ``--backend`` means the new engine, and the old one may serve something else
    now. A URL another shard still records is taken once that shard has moved to its own
    (a backend moved down the list); one still taken after that condemns the shard, which
    then comes back through the supervisor on its configured URL.
    """
    for i, result in first.items():
        state = ledger.state(i)
        if not isinstance(result, EngineHandle):
            cause = f"first start failed: {result}"
            if state is ShardState.RESTARTING:
                ledger.mark_restart_failed(i, cause)
            else:
                ledger.condemn(i, cause)  # ignored for a shard that is DEAD already
        elif state is ShardState.RESTARTING:
            if not ledger.mark_loaded(i, result.url, result.incarnation):
                ledger.mark_restart_failed(i, "its new engine's URL belongs to another shard")
        elif state not in ABSENT and not ledger.new_run(i, result.url, result.incarnation):
            ledger.condemn(i, "its new engine's URL belongs to another shard")
    for i, url in attached.items():
        state = ledger.state(i)
        if state in (ShardState.DEAD, ShardState.RESTARTING) and ledger.shard(i).base_url != url:
            # The operator replaced a condemned backend: the configured engine is its
            # replacement (a restart spent, as for any DEAD shard's), not a process to wait
            # for at the old URL (a passive wait there never ends).
            if state is ShardState.DEAD:
                ledger.mark_restarting(i)
            if (ledger.state(i) is ShardState.RESTARTING
                    and not ledger.mark_loaded(i, url, None)):
                ledger.mark_restart_failed(i, f"its configured URL {url} belongs to another "
                                              "shard")
    waiting = [i for i in attached if ledger.state(i) not in ABSENT]
    while waiting:
        # A pass moves every shard whose configured URL is free; the next pass retries the
        # rest, whose URL the pass may have freed. Bounded: a pass that moves none ends it.
        left = [i for i in waiting if not ledger.new_run(i, attached[i], None)]
        if len(left) == len(waiting):
            for i in left:
                ledger.condemn(i, f"its configured URL {attached[i]} belongs to another shard")
            break
        waiting = left
