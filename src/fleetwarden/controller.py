"""The controller tick: the one loop that couples watchdog, ledger, supervisor and routers.

Owns: the tick and the loop that runs it, the one transition channel, the fleet's status; it
builds its collaborators and hands each what it needs: what it learns of the engines (reads.py:
the routers' evidence, the reads, the focused reads and their hedges, every finished read's
entry) and what the routers are told (pushes.py).
Must not: decide health itself (the judge and the ledger's table do), start and stop engines
(the supervisor does), or do a collaborator's job itself: it calls the one that owns it.

Every ``probe_interval_s`` (docs/design.md section 6), in this order:

1. the reads since the last tick (reads.py reads every shard that has a process, serving and
   STALE, once per interval beside the tick, each verdict into the ledger as it finishes)
   become the tick's report;
2. a supervisor tick: restarts start for DEAD shards (so a shard condemned this tick is
   RESTARTING before the push), finished restarts are collected;
3. every router's outcomes are drained into ``report_outcomes``; unknown URLs are ignored;
4. holds past their until-time end (the ledger's clock), and the ledger's routed set
   (:meth:`Admission.routed`: less an engine the focused reads hold out) is pushed to every
   router, every tick, unconditionally (no
   deltas, so a restarted router converges on the next push), with each backend's facts
   (shard index, weight version, the models it serves) beside it;
5. the routers rescue the requests waiting on shards condemned this tick.

A router that fails is logged and tried again next tick; nothing a router does stops the loop.
After each tick ``on_tick`` (when given) sees the tick's report: the fleet publishes the
dashboard's snapshot from there, so a page learns what the controller learned, when it did.

The tick is the heartbeat; evidence does not wait for it (docs/design.md, "Judgement at the
speed of evidence"):

* **One channel.** Whatever moves a shard (a verdict, a drained window, a process exit the
  supervisor saw, an operator), the routers learn it from the ledger's transition stream: a
  transition that changes what may be routed, or condemns a shard, pushes and rescues at once.
* **Evidence is an event** (reads.py's :class:`~fleetwarden.reads.Evidence`): a failed attempt
  a router reports is drained at once, and engines holding requests silent are accused between
  ticks.
* **Confirm at once** (reads.py's :class:`~fleetwarden.reads.Focus`): an accused shard
  (ejected, silent requests, a stall or an unreachable read at the tick) gets focused reads
  until they conclude.

Every task the controller and its collaborators start has one owner (:class:`TaskOwner`),
cancelled and awaited by :meth:`Controller.close`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetwarden.config import Config
from fleetwarden.credentials import NO_KEYS, EngineKeys
from fleetwarden.journal import Journal
from fleetwarden.launchers.procs import process_info
from fleetwarden.ledger import Event, Ledger, ShardRecord, ShardState, Transition, tally
from fleetwarden.pushes import Pushes
from fleetwarden.reads import Evidence, Focus, Reads, ReportBook, TickReport, guarded
from fleetwarden.refit import RefitCoordinator
from fleetwarden.router.links import RouterLink
from fleetwarden.router.pool import BackendFacts
from fleetwarden.supervisor import Supervisor
from fleetwarden.tasks import TaskOwner
from fleetwarden.watchdog import Report, Watchdog
from fleetwarden.workmeter import WorkMeter

__all__ = ["COMEBACKS", "Controller", "FleetStatus", "TickReport", "fleet_status"]

log = logging.getLogger(__name__)


@dataclass
class FleetStatus:
    """The fleet-level answer to "can this fleet serve?" — never an exception to the caller."""

    state: str  # "serving", "degraded", "asleep", "down", "exhausted"
    detail: str
    counts: dict[str, int]
    #: The shards as the headline counts them: serving, coming back, out (:func:`tally`).
    tally: dict[str, int] = field(default_factory=dict)


def fleet_status(shards: Sequence[ShardRecord], min_serving_shards: int,
                 journal_problem: str = "") -> FleetStatus:
    """The status of a fleet whose shards are ``shards`` (one snapshot of the ledger's), so
    that a headline and the rows beside it, read from the same records, always agree: the
    detail counts what the rows show, in the ledger's terms (serving, coming back, out)."""
    counts = {s.value: 0 for s in ShardState}
    for rec in shards:
        counts[rec.state.value] += 1
    told = tally(rec.state for rec in shards)
    serving, total = told["serving"], len(shards)
    remaining = total - told["out"]
    if remaining < min_serving_shards:
        return FleetStatus("exhausted", f"{remaining} of {total} shards can still serve; "
                           f"min_serving_shards is {min_serving_shards}", counts, told)
    others = "; ".join(f"{n} {words}" for n, words in ((told["coming_back"], "coming back"),
                                                       (told["out"], "out")) if n)
    if serving == 0:
        asleep = counts[ShardState.SLEEPING.value]
        if asleep:
            return FleetStatus("asleep", f"no shard serves; {others} ({asleep} asleep: none "
                               "serves until one wakes)", counts, told)
        return FleetStatus("down", f"no shard serves; {others}", counts, told)
    if serving < total:
        return FleetStatus("degraded", f"{serving} of {total} shards serve; {others}"
                           + journal_problem, counts, told)
    if journal_problem:
        return FleetStatus("degraded", f"all {serving} shards serve" + journal_problem,
                           counts, told)
    return FleetStatus("serving", f"all {serving} shards serve", counts, told)


class Controller:
    """The tick and its loop over the fleet's parts, and the one channel of the ledger's
    transitions: each step and each transition handed to the collaborator that owns it."""

    def __init__(
        self,
        ledger: Ledger,
        watchdog: Watchdog,
        supervisor: Supervisor,
        routers: Sequence[RouterLink],
        config: Config,
        *,
        journal: Journal | None = None,
        refit: RefitCoordinator | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_tick: Callable[[TickReport], None] | None = None,
        engine_keys: EngineKeys = NO_KEYS,
    ) -> None:
        self.ledger = ledger
        #: The API key each shard's engine wants: pushed to the routers (their own requests
        #: there) and sent with sleep and wake.
        self.engine_keys = engine_keys
        self.refit = refit
        self.watchdog = watchdog
        self.supervisor = supervisor
        self.routers = list(routers)
        self.config = config
        self.journal = journal
        self.clock = clock
        self.on_tick = on_tick
        self.tick_number = 0
        self.last_tick: TickReport | None = None
        #: Every task the controller and its collaborators start between two transitions or
        #: events (pushes, drains, focused reads): all cancelled and awaited on close.
        self.tasks = TaskOwner()
        #: What the controller measured of its own work (tick, reads, pushes, decisions), on
        #: the fleet's /metrics, the dashboard and the journal's run summary. Measured on the
        #: monotonic clock whatever ``clock`` is: it is the real time the work took.
        self.meter = WorkMeter()
        #: Where every finished read is entered (ledger, journal, lease, the last reports).
        self.book = ReportBook(ledger, journal=journal, refit=refit)
        #: The routers' evidence, taken in as it comes; an accusation starts focused reads.
        self.evidence = Evidence(ledger, self.routers, config, tasks=self.tasks,
                                 meter=self.meter, accuse=self.confirm)
        #: The focused reads of accused shards, and the hedges they ask for.
        self.focus = Focus(ledger, watchdog, self.routers, config, evidence=self.evidence,
                           book=self.book, tasks=self.tasks, refit=refit, clock=clock,
                           stopped=self.process_stopped)
        #: What the routers are told: pushes, rescues, Retry-After, a load's marks.
        self.pushes = Pushes(ledger, watchdog, supervisor, self.routers, config, book=self.book,
                             tasks=self.tasks, meter=self.meter, engine_keys=engine_keys,
                             clock=clock)
        supervisor.before_stop = self.pushes.released
        #: The read round, and what it decided for the tick.
        self.reads = Reads(ledger, watchdog, config, evidence=self.evidence, focus=self.focus,
                           book=self.book, meter=self.meter, refit=refit,
                           stopped=self.process_stopped)
        self._unsubscribe = ledger.subscribe(self._on_transition)
        self._wake = asyncio.Event()
        self.status = self._status()

    # ------------------------------------------------------------------ its collaborators

    @property
    def reports(self) -> dict[int, Report]:
        """The last watchdog report per shard (dashboards read running/waiting/tokens)."""
        return self.book.last

    @property
    def verdict_counts(self) -> dict[str, int]:
        """Verdicts seen since start, by name (the fleet's Prometheus counter)."""
        return self.book.counts

    @property
    def focus_started(self) -> dict[str, int]:
        """Focused read runs started, by why (the fleet's metrics, the tests)."""
        return self.focus.started

    def process_stopped(self, shard: int) -> bool:
        """Whether the OS reports shard's engine process stopped (``/proc/PID/stat`` state
        ``T``: SIGSTOP): known only of an engine this fleet launched (an attached one has no
        PID here). Such an engine answers nothing, and is judged silent without a read."""
        handle = self.supervisor.engines.get(shard)
        if handle is None or handle.pid is None:
            return False
        info = process_info(handle.pid)
        return info is not None and info.state == "T"

    def confirm(self, shard: int, why: str) -> None:
        """Accuse ``shard``: focused reads of its engine until they conclude (:class:`Focus`)."""
        self.focus.confirm(shard, why)

    def apply_report(self, i: int, r: Report, *, progress_proves: bool = True) -> None:
        """One watchdog verdict into the ledger (:meth:`ReportBook.enter`)."""
        self.book.enter(i, r, progress_proves=progress_proves)

    def apply_outcomes(self, outcomes: Mapping[str, tuple[int, int, int]],
                       failed_probe: frozenset[str] = frozenset()) -> None:
        """Router windows into the ledger (:meth:`Evidence.apply_outcomes`)."""
        self.evidence.apply_outcomes(outcomes, failed_probe)

    # ------------------------------------------------------------------ events

    def _on_transition(self, t: Transition) -> None:
        """The one channel: every change of the ledger passes here, whoever caused it."""
        if t.event in (Event.NEW_INCARNATION, Event.NEW_INCARNATION_WEIGHTS_LOST):
            self.evidence.renewed(t.record.base_url)
        self.pushes.follow(t)
        if t.event is Event.EJECTED:
            self.confirm(t.shard, "ejected")
        elif t.event in COMEBACKS and t.to_state is ShardState.STALE:
            # A new process answers: proven now, by one canary while it is idle (or by its
            # progress), not at the next read of the round, up to a tick away. With static
            # weights that canary is its refit (HEALTHY, routed by this same channel); with a
            # trainer's it stays STALE until a refit confirms its weights.
            self.confirm(t.shard, "comeback")

    # ------------------------------------------------------------------ what the routers see

    def serving_push(self) -> tuple[list[str], dict[str, BackendFacts]]:
        """What every push carries (:meth:`Pushes.serving_push`)."""
        return self.pushes.serving_push()

    async def push_now(self) -> None:
        """Push the serving set to every router now (start-up, admin actions)."""
        await self.pushes.push()

    # ------------------------------------------------------------------ the tick

    async def tick(self) -> TickReport:
        self.tick_number += 1
        started = time.perf_counter()
        # 0. the reads since the last tick (reads.py reads beside the tick, each decided as it
        # finished): this tick's report
        report, reports = self.reads.take(self.tick_number, self.clock())

        # 1. a refit lease that overran marks its participants SUSPECT
        if self.refit is not None:
            guarded(report, "refit lease", self.refit.check_lease)
        failed_probe = frozenset(url for url, r in reports.items() if r.failed_probe)
        if self.refit is not None and self.refit.lease is not None:
            guarded(report, "refit participants", self.book.observe_participants, reports)

        # 2. the supervisor: a shard condemned above is RESTARTING before the push
        guarded(report, "supervisor", self.supervisor.tick)

        # 3. outcomes from every router, one window each (Evidence)
        await self.evidence.take_windows(failed_probe, report.router_errors)

        # 4. holds past their until-time end; push, every tick (a restarted router converges)
        guarded(report, "holds", self.ledger.admission.expire)
        await self.pushes.push(report.router_errors)
        await self.pushes.tell_retry_after(report.router_errors)

        # 5. rescue what waits on shards condemned or fallen asleep since (if no transition
        # did it already)
        report.condemned, rescued = await self.pushes.rescue(report.router_errors)
        report.rescued += rescued
        self._tick_done(report, time.perf_counter() - started)
        return report

    def _tick_done(self, report: TickReport, duration_s: float) -> None:
        for err in report.router_errors:
            log.warning("%s", err)
        self.status = self._status()
        report.duration_s = duration_s
        self.meter.tick_done(report.duration_s)
        self.last_tick = report
        if self.on_tick is not None:
            try:
                self.on_tick(report)
            except Exception:
                # An observer never stops the loop, and never makes a tick count as failed.
                log.exception("tick %d: the on_tick observer failed", report.number)

    def _status(self) -> FleetStatus:
        return fleet_status(self.ledger.snapshot(), self.ledger.policy.min_serving_shards,
                            self._journal_problem())

    def _journal_problem(self) -> str:
        if self.journal is None or self.journal.failure is None:
            return ""
        return (f"; the journal fails ({self.journal.failure}): {self.journal.dropped} "
                "records lost, restart budgets and history are not being kept")

    # ------------------------------------------------------------------ the loop

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every ``probe_interval_s`` until ``stop`` is set. A tick that raises is logged;
        the loop goes on."""
        interval = self.config.health.probe_interval_s
        watchers = TaskOwner()
        self.evidence.watch(stop, watchers)
        watchers.start(self.reads.loop(stop), "reads")
        try:
            while not stop.is_set():
                try:
                    await self.tick()
                except Exception:
                    log.exception("controller tick %d failed; the next one runs as usual",
                                  self.tick_number)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wait_either(stop), interval)
        finally:
            await watchers.cancel_all()

    async def _wait_either(self, stop: asyncio.Event) -> None:
        waiter = asyncio.create_task(self._wake.wait())
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            stopper.cancel()
            self._wake.clear()

    def wake(self) -> None:
        """Run the next tick now (an admin action changed the fleet)."""
        self._wake.set()

    async def close(self) -> None:
        self._unsubscribe()
        self.evidence.close()
        await self.tasks.cancel_all()

    def describe(self, status: FleetStatus | None = None) -> dict[str, Any]:
        """The status (``status``, else the last tick's) as the admin API's JSON."""
        status = self.status if status is None else status
        return {"status": status.state, "detail": status.detail, "counts": status.counts,
                "tally": status.tally, "tick": self.tick_number}

    def status_of(self, shards: Sequence[ShardRecord]) -> FleetStatus:
        """The status of ``shards`` (a snapshot of the ledger's taken by the caller, who shows
        them beside it)."""
        return fleet_status(shards, self.ledger.policy.min_serving_shards,
                            self._journal_problem())


#: The events that give a shard a new process: each is proven at once (:meth:`_on_transition`).
#: A new process answers (a restart, one seen, a new run): its proof, and with a checkpoint
#: source its catch-up load (``Fleet``), start at this transition, not at the next tick.
COMEBACKS = frozenset({Event.LOADED, Event.NEW_INCARNATION, Event.NEW_INCARNATION_WEIGHTS_LOST,
                        Event.NEW_RUN, Event.NEW_RUN_WEIGHTS_LOST})
