"""What a fleet does with the last run's journal when it starts again.

Owns: the restore policy. Which engines of the earlier run are adopted and which are stopped
(:func:`adopt_or_stop`); which attached engines are still the process the journal recorded
(:func:`read_attached`, :func:`kept_attached`); and how the restored ledger meets this run's
engines, clean stop or not (:func:`begin_run`): a start, never a restart spent on
fleetwarden's own death.

Must not: start engines (``fleet.py`` does, through the launchers), or decide health outside
the ledger's operations.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import aiohttp

from fleetwarden.engine_metrics import Sample
from fleetwarden.journal import Journal
from fleetwarden.launchers import EngineHandle, EngineRecord
from fleetwarden.launchers.local import LocalLauncher
from fleetwarden.ledger import ABSENT, UNNAMED_PREFIX, Ledger, ShardState
from fleetwarden.probe import health_status
from fleetwarden.watchdog import Target, Watchdog

__all__ = ["adopt_or_stop", "begin_run", "kept_attached", "read_attached", "same_process"]

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
    journal: Journal, local: LocalLauncher, restored: Ledger | None
) -> dict[int, EngineHandle]:
    """Engines an earlier run left running: the current one of each shard is adopted, the
    rest (a restart in progress, a condemned engine not yet stopped) are stopped. A launch
    journaled only by its intent (no PID: fleetwarden died between the spawn and the record of
    its process, or that write failed) is stopped wherever a process carries its launch id,
    never adopted: nothing recorded which process it is, and no ledger load followed it.
    With no ledger restored (a run killed during its first start, before its first snapshot)
    none is current: every one is stopped."""
    adopted: dict[int, EngineHandle] = {}
    for d in journal.running_engines():
        if d.get("pid") is None:
            stopped = await local.stop_unrecorded(d["shard"], d["launch_id"])
        else:
            saved = EngineRecord(**{k: d[k] for k in EngineRecord.__dataclass_fields__})
            current = (restored is not None and saved.shard < len(restored)
                       and saved.shard not in adopted
                       and restored.shard(saved.shard).base_url == saved.url
                       and restored.state(saved.shard) not in ABSENT)
            if current and local.adoptable(saved) and await _answers(saved.url):
                adopted[saved.shard] = await local.adopt(saved)
                continue
            stopped = await local.stop_leftover(saved)
        journal.engine_stopped(d["launch_id"])
        if stopped:
            log.warning("shard %d: an engine of the earlier run (%s) was not adopted and "
                        "was stopped", d["shard"], d["launch_id"])
    return adopted


def same_process(recorded: str | None, now: str | None) -> bool:
    """An attached engine found running is the process the journal recorded: both name it
    (its start time), and by the same name. Unknown on either side (an engine with no start
    time: SGLang, TGI, ``openai`` profiles; a read that failed; a name the ledger gave a
    restart it saw, which no engine reports) is never the same: a new process there would be
    credited with the weights and verdicts of the one it replaced."""
    return _named(recorded) and recorded == now


def _named(incarnation: str | None) -> bool:
    """An incarnation an engine reported (its start time), not one the ledger made up."""
    return incarnation is not None and not incarnation.startswith(UNNAMED_PREFIX)


def kept_attached(ledger: Ledger, attached: Mapping[int, str],
                  running: Mapping[int, str | None]) -> set[int]:
    """The attached shards that keep their state across fleetwarden's restart: a process (not
    absent) on its configured URL, which is the process the journal recorded (``running``:
    shard -> the incarnation its engine reports now, ``None`` where unknown). The process
    never stopped, so it holds what the journal says: its weights, its sleep and the
    trainer's hold on it, its streaks and ejection; as an adopted launched engine does."""
    return {i for i, url in attached.items()
            if ledger.state(i) not in ABSENT and ledger.shard(i).base_url == url
            and same_process(ledger.shard(i).incarnation, running.get(i))}


async def read_attached(watchdog: Watchdog, targets: Mapping[int, Target]
                        ) -> dict[int, str | None]:
    """The incarnation each attached engine reports now (shard -> its start time; ``None``
    when it gives none or the read failed), read all at once by the watchdog, each within its
    read timeout. The watchdog keeps each read as the baseline of its next: a process that
    restarts between this read and the first tick is seen restarting there, as any other."""
    shards = list(targets)
    reads = await asyncio.gather(*(watchdog.observe(targets[i]) for i in shards))
    return {i: r.incarnation if isinstance(r, Sample) else None
            for i, r in zip(shards, reads, strict=True)}


def begin_run(
    ledger: Ledger, first: Mapping[int, EngineHandle | BaseException],
    attached: Mapping[int, str], running: Mapping[int, str | None] | None = None,
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
    the supervisor takes it from there. Attached engines kept running without us. One that
    is the process the journal recorded (``running``: shard -> the incarnation it reports
    now; :func:`kept_attached`) keeps its state, as an adopted engine does: in trainer mode
    its weight version, asleep its sleep and the trainer's hold. Any other's shard is a new
    run (in trainer mode STALE: nothing says which weights it holds) on the URL this
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
    now = running or {}
    for i, url in attached.items():
        state = ledger.state(i)
        if state in (ShardState.DEAD, ShardState.RESTARTING) and ledger.shard(i).base_url != url:
            # The operator replaced a condemned backend: the configured engine is its
            # replacement (a restart spent, as for any DEAD shard's), not a process to wait
            # for at the old URL (a passive wait there never ends).
            if state is ShardState.DEAD:
                ledger.mark_restarting(i)
            if (ledger.state(i) is ShardState.RESTARTING
                    and not ledger.mark_loaded(i, url, now.get(i))):
                ledger.mark_restart_failed(i, f"its configured URL {url} belongs to another "
                                              "shard")
    kept = kept_attached(ledger, attached, now)
    for i in sorted(kept):
        log.info("shard %d: its engine at %s is the process the last run knew (incarnation "
                 "%s): it keeps its state, %s", i, attached[i], ledger.shard(i).incarnation,
                 ledger.state(i))
    waiting = [i for i in attached if ledger.state(i) not in ABSENT and i not in kept]
    while waiting:
        # A pass moves every shard whose configured URL is free; the next pass retries the
        # rest, whose URL the pass may have freed. Bounded: a pass that moves none ends it.
        # The new run's process is the one read now (its start time, where it gives one):
        # the next restart of fleetwarden can tell whether it is still the same.
        left = [i for i in waiting if not ledger.new_run(i, attached[i], now.get(i))]
        if len(left) == len(waiting):
            for i in left:
                ledger.condemn(i, f"its configured URL {attached[i]} belongs to another shard")
            break
        waiting = left
