"""Focused reads: an accused engine read again and again until the reads conclude, and hedges.

Owns: the I/O of one run of focused reads per accused shard (right away, then every
``confirm_interval_s``, until they conclude — condemned, proven, or nothing left to prove —
or ``confirm_max_s`` passes); the hedges its reads ask for (every router sends what it holds on
an engine that takes no step to another engine as well), and a silent engine's between its
reads; the canary that watches a hedged lost core.
Must not: decide what a read asks or what its report leads to (accusation.py does: canary,
hold, hedge, done), conclude what a read means (the judge's report does), map a report to a
state (the ledger's table does), decide who is routed or when a hold ends (the ledger's
:class:`~fleetwarden.ledger.Admission` does: focus asks it to hold and release), or push the
serving set (the controller does).

An accusation is anything that puts a shard in doubt between two reads of the round: an
ejection for failed requests, requests held silent, a stall or an unreachable read, a read that
left it SUSPECT (docs/design.md section 12, "Judgement at the speed of evidence").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from fleetwarden.accusation import Accusation, Facts
from fleetwarden.admission import HoldCause
from fleetwarden.config import Config
from fleetwarden.evidence import Evidence
from fleetwarden.judge import Hedge
from fleetwarden.ledger import ABSENT, Ledger, ShardState
from fleetwarden.refit import RefitCoordinator
from fleetwarden.reports import ReportBook
from fleetwarden.router.links import RouterLink
from fleetwarden.tasks import TaskOwner
from fleetwarden.watchdog import Report, Target, Watchdog

__all__ = ["Focus"]

log = logging.getLogger(__name__)


class Focus:
    """The focused reads of accused shards, one run per shard at a time."""

    def __init__(self, ledger: Ledger, watchdog: Watchdog, routers: Sequence[RouterLink],
                 config: Config, *, evidence: Evidence, book: ReportBook, tasks: TaskOwner,
                 refit: RefitCoordinator | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 stopped: Callable[[int], bool] = lambda i: False) -> None:
        self.ledger = ledger
        self.watchdog = watchdog
        self.routers = routers
        self.config = config
        self.evidence = evidence
        self.book = book
        self.tasks = tasks
        self.refit = refit
        self.clock = clock
        #: Shards under focused reads, by index: the task doing them.
        self.running: dict[int, asyncio.Task[None]] = {}
        #: A hedged lost core's watching canary, by shard (:meth:`_hedge_lost_core`).
        self._watching: dict[int, asyncio.Task[None]] = {}
        #: Focused read runs started, by why (for the fleet's metrics and the tests).
        self.started: dict[str, int] = {}
        #: Whether the OS reports shard i's engine process stopped (launched engines only).
        self._stopped = stopped
        #: A silent engine's hedges while its next read waits out its silence, by shard
        #: (:meth:`_hedge_while_silent`): ended by that read's report.
        self._between: dict[int, asyncio.Task[None]] = {}

    def __contains__(self, shard: int) -> bool:
        """Whether ``shard`` is under focused reads now (the round does not read it)."""
        return shard in self.running

    def confirm(self, shard: int, why: str) -> None:
        """Accuse ``shard``: focused reads of its engine, now and every ``confirm_interval_s``,
        until they conclude. One run per shard at a time."""
        if shard in self.running or self.ledger.state(shard) in ABSENT or self.watchdog is None:
            return
        url = self.ledger.shard(shard).base_url
        task = self.tasks.start_if_running(self._confirm(shard, url), f"confirm:{shard}")
        if task is not None:
            self.started[why] = self.started.get(why, 0) + 1
            self.running[shard] = task
            task.add_done_callback(lambda _: self.running.pop(shard, None))

    def in_doubt(self, i: int) -> bool:
        """SUSPECT on reads alone: not ejected for failed requests (those come back by a
        canary when their time is up) nor on trial (only a completed request ends that)."""
        rec = self.ledger.shard(i)
        return rec.state is ShardState.SUSPECT and rec.ejected_until is None and not rec.on_trial

    async def _confirm(self, i: int, url: str) -> None:
        try:
            await self._focused_reads(i, url)
        finally:
            self._end_between(i)
            # its reads end: its stalled hold with them, and the next accusation may hold it
            self.ledger.admission.reads_ended(url)

    def _hold(self, cause: HoldCause, url: str) -> None:
        """Hold ``url`` out of the pushes for ``cause``, for at most the stall floor (the
        ledger ends it then, on its clock: :meth:`Admission.expire`). Past the floor, a pause
        is one an engine's own cadence may allow (a long prefill step learned): held out as
        long as the stall limit, a healthy engine in such a step would be kept from serving
        as long as a wedge (the fleet model: a wedged engine whose learned limit was 45 s
        stayed HEALTHY and unrouted for 15 s). The floor covers what a hold is for at the
        defaults: a wedge is condemned at it."""
        self.ledger.admission.hold(url, cause, self.config.health.stall_s)

    def _hold_stalled(self, url: str, held: bool) -> None:
        """Whether ``url`` is held out of the pushes for hedged requests on an engine that
        shows work and takes no step. A router whose hedge wins drops it only until the next
        push, and the tick's heartbeat push put a wedge back in routing before the stall limit
        condemned it: a request sent there then waited for the condemnation (+6 s) and a
        generation elsewhere, at 3 as at 256 engines (BENCHMARKS.md, "A wedge's parked
        requests at scale, split"). The hold lasts while its reads stay STALLED, and at most the
        stall floor (:meth:`_hold`); it is no verdict: the ledger still calls it HEALTHY, and a
        long step that ends routes it again at that read."""
        if held:
            self._hold(HoldCause.STALLED, url)
        else:
            self.ledger.admission.release(url, HoldCause.STALLED)

    async def _focused_reads(self, i: int, url: str) -> None:
        """Read shard ``i``'s engine until the reads conclude: what each read asks and what
        its report leads to is the accusation's (accusation.py); this does the I/O."""
        h = self.config.health
        accusation = Accusation(deadline=self.clock() + h.confirm_max_s)
        while True:
            rec = self.ledger.shard(i)
            if rec.base_url != url or rec.state in ABSENT:
                return  # condemned, or a new process: nothing left to confirm about this one
            facts = self._facts(i)
            plan = accusation.plan(facts)
            # Asleep in the ledger: never judged stuck either, as in the round (reads.py,
            # ``_target``): a stall while asleep is no fault.
            excused = facts.asleep or (self.refit is not None
                                       and i in self.refit.stalls_excused())
            holding = await self.evidence.holding(None)
            r = await self.watchdog.probe(Target(
                url=url, in_flight=holding.in_flight.get(url, 0),
                held_s=holding.silent.get(url, 0.0), stalls_excused=excused,
                confirm=plan.canary, check_health=plan.check_health, stopped=self._stopped(i)))
            self._end_between(i)  # this read says what the silence is now
            accusation.read(facts, plan, r)
            if self.ledger.shard(i).base_url != url:
                return
            self.book.last[i] = r
            self.book.count(r)
            # The first read compares with the tick's sample, taken before the accusation:
            # progress it shows may predate the fault, so it proves nothing (a canary does).
            self.book.enter(i, r, progress_proves=not accusation.first)
            # The tick does not read a shard under focused reads: a lease's status of it is
            # kept from these reads, or it would show the last tick's (stale) liveness.
            self.book.observe_participant(i, url, r)
            if self.ledger.state(i) in ABSENT:
                return
            admission = self.ledger.admission
            admission.expire()  # each read is a tick of the ledger's clock for its holds
            step = accusation.next(r, hedge_after_s=h.hedge_after_s,
                                   held_stalled=admission.holds(url, HoldCause.STALLED))
            self._hold_stalled(url, step.hold_stalled)
            if step.hedge is Hedge.STEP:
                await self._hedge(i, url, step.held_s)
                if step.between_reads:
                    self._between_reads(i, url, step.held_s)
            elif step.hedge is Hedge.LOST_CORE:
                await self._hedge_lost_core(i, url, r, step.held_s)
            if accusation.concluded(r, self._facts(i), self.clock()):
                return  # proven, nothing to prove (the tick takes over again), or time is up
            await asyncio.sleep(h.confirm_interval_s)

    def _facts(self, i: int) -> Facts:
        """What the ledger says of shard ``i`` now, as the accusation reads it (ejection on
        the ledger's clock, as ``ejected_until`` is)."""
        rec = self.ledger.shard(i)
        return Facts(asleep=rec.state is ShardState.SLEEPING, ejected_until=rec.ejected_until,
                     ejection_due=self.ledger.ejection_due(i), in_doubt=self.in_doubt(i))

    def _between_reads(self, i: int, url: str, held_s: float) -> None:
        task = self.tasks.start_if_running(self._hedge_while_silent(i, url, held_s),
                                           f"hedge-silent:{i}")
        if task is not None:
            self._between[i] = task

    def _end_between(self, i: int) -> None:
        task = self._between.pop(i, None)
        if task is not None:
            task.cancel()

    async def _hedge_while_silent(self, i: int, url: str, held_s: float) -> None:
        """A silent engine's requests are hedged as they reach ``held_s`` while its next read
        waits out the silence read, every ``confirm_interval_s``, not when that read ends: a
        silent read takes ``silence_read_s`` where a wedge's frozen ``/metrics`` answers at
        once, and a request sent just before the silence began was hedged a whole read later
        than on a wedge (BENCHMARKS.md, "A silent engine's hedges between its reads"). The
        evidence is the read's hedge's own: the last read got no answer, and the engine has
        answered no request for ``held_s`` (the routers' held time there runs from its last
        answer). Only an answer ends a silence: a client's request answered there puts the
        held time back (no hedge until it reaches ``held_s`` again), and the next read's
        report ends this (:meth:`_end_between`; docs/design.md, "Silence is evidence")."""
        while True:
            await asyncio.sleep(self.config.health.confirm_interval_s)
            if (await self.evidence.holding(None)).silent.get(url, 0.0) >= held_s:
                await self._hedge(i, url, held_s)

    async def _hedge_lost_core(self, i: int, url: str, r: Report, held_s: float) -> None:
        """Hedge a lost core's held requests, with a canary sent as they are, unless one sent
        with earlier hedges still waits: it takes over their watch (:meth:`_watch_hedged`).
        Started first, so that the engine holds work throughout (the hedges' answers cancel the
        requests it held, a generation later). In a task of its own: the focused reads go on
        meanwhile, and requests that reach ``held_s`` there later are hedged then."""
        if i not in self._watching:
            task = self.tasks.start_if_running(self._watch_hedged(i, url, r),
                                               f"watch-hedged:{i}")
            if task is not None:
                self._watching[i] = task
                self._hold(HoldCause.LOST_CORE, url)
                task.add_done_callback(lambda _: self._watch_ended(i, url))
                # Its task starts before the hedges are asked for; a hedge answers (and cancels
                # a held request) only after a generation elsewhere, so the canary is there.
                await asyncio.sleep(0)
        # No work in its gauges is no proof that no step is in progress: real vLLM writes its
        # gauges at a step's end, so a long first step after idle reads as idle and flat. Its
        # lost races cost it nothing; the canary (or the held request) condemns at the stall
        # limit (history: docs/design.md section 12).
        await self._hedge(i, url, held_s)

    def _watch_ended(self, i: int, url: str) -> None:
        self._watching.pop(i, None)
        self.ledger.admission.release(url, HoldCause.LOST_CORE)  # routed, unless condemned

    async def _watch_hedged(self, i: int, url: str, r: Report) -> None:
        """The canary that watches a hedged lost core; what it concludes (the watch's, in
        :meth:`Watchdog.watch_hedged`) goes into the ledger as any read does."""
        assert self.watchdog is not None
        condemned = await self.watchdog.watch_hedged(r)
        rec = self.ledger.shard(i)
        if condemned is None or rec.base_url != url or rec.state in ABSENT:
            return
        self.book.last[i] = condemned
        self.book.enter(i, condemned, progress_proves=False)

    async def _hedge(self, i: int, url: str, held_s: float) -> None:
        """Shard ``i``'s engine held a request ``held_s`` and took no step: every router sends
        what it holds there that long to another engine as well (the first answer is the
        client's). Asked again at each focused read while it lasts: requests that reach
        ``held_s`` later are hedged then, and a hedge the retry budget refused is tried again.
        A lost race costs the engine nothing in the ledger (a long step, or a first step whose
        gauges are not written yet, looks the same); the router's ``lost_race_fails`` is left
        to a caller that knows no step runs."""
        for link in self.routers:
            try:
                n = await link.hedge(url, held_s)
            except Exception as exc:
                log.warning("router %s: hedge: %s", link.name, exc)
                continue
            if n:
                log.info("shard %d: %d request(s) held %g s with no step hedged by %s", i, n,
                         held_s, link.name)

