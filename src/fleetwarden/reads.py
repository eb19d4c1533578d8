"""What the fleet learns of its engines, from the routers and from the engines themselves, each
piece decided on as it comes.

Owns: the routers' evidence (:class:`Evidence`); the reads of the round (:class:`Reads`), the
focused reads of an accused engine and the hedges they ask for (:class:`Focus`), a refit lease's
reads of its participants, each read's target; each report's one way into the ledger, the
journal and an open lease (:class:`ReportBook`), whoever read it; the tick's report
(:class:`TickReport`): what the reads decided since the last tick, until the tick takes it.
Must not: judge a read or decide what a focused read asks and what its report leads to (the
judge does: its report, its :class:`~fleetwarden.judge.Accusation`), map a report or a window
to a state (the ledger's table does), decide who is routed or when a hold ends (the ledger's
:class:`~fleetwarden.ledger.Admission` does: the focused reads ask it to hold and release), or
push the serving set (pushes.py does).

* The evidence: each router's outcome windows, drained one at a time per router into the
  ledger; the failure events of the routers in this process; the long poll of those in other
  processes (``GET /evidence``); the requests held silent, which accuse their engine; and what
  every read asks the routers first, what they hold on each engine.
* The reads of the round run beside the tick, each engine on its own schedule (docs/design.md
  6.2), or every engine at once (:meth:`Reads.round`). A read's target says what the routers
  hold there, whether its stalls are excused and whether it is canaried.
* Focused reads: right away, then every ``confirm_interval_s``, until they conclude or
  ``confirm_max_s`` passes; the hedges they ask for, a silent engine's between its reads, and
  the canary that watches a hedged lost core.

Evidence does not wait for the tick, nor does judgement (docs/design.md section 12, "Judgement
at the speed of evidence"): a failed attempt an in-process router reports as it happens (its
``listen``), or a long poll answers with, is drained at once, so the ledger ejects within a
round trip; engines holding requests silent for ``silent_after_s`` are accused (asked every
``evidence_poll_s`` of the in-process routers, at each long poll's answer and once a tick of
the others). An accusation is anything that puts a shard in doubt between two reads of the
round: an ejection for failed requests, requests held silent, a stall or an unreachable read, a
read that left it SUSPECT; each gets focused reads at once, whatever the fleet's size.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetwarden.config import Config
from fleetwarden.journal import Journal
from fleetwarden.judge import Accusation, AccusedFacts, Hedge, accused_by
from fleetwarden.ledger import ABSENT, HoldCause, Ledger, Reading, ShardState
from fleetwarden.refit import ProcessSeen, RefitCoordinator
from fleetwarden.router.links import EVIDENCE_WAIT_S, ControlError, RouterLink
from fleetwarden.router.ops import Holding
from fleetwarden.tasks import TaskOwner, sleep_unless
from fleetwarden.watchdog import Report, Target, Watchdog
from fleetwarden.workmeter import WorkMeter

__all__ = ["Evidence", "Focus", "Reads", "ReportBook", "TickReport", "guarded", "reading_of",
           "router_error"]

log = logging.getLogger(__name__)


@dataclass
class TickReport:
    """What one tick saw and did (for the dashboard, tests and the status command)."""

    number: int
    started_at: float
    duration_s: float = 0.0
    verdicts: dict[int, str] = field(default_factory=dict)
    condemned: list[int] = field(default_factory=list)
    rescued: int = 0
    router_errors: list[str] = field(default_factory=list)
    #: Steps of this tick that failed (a bug, a journal that raised): logged, and the tick
    #: went on to its push and rescue all the same.
    errors: list[str] = field(default_factory=list)


def guarded(report: TickReport, step: str, fn: Callable[..., object], *args: Any) -> None:
    """Run one step of the tick. No step's failure aborts the tick: the push and the rescue
    that follow are what keep requests away from a bad engine."""
    try:
        fn(*args)
    except Exception as exc:
        log.exception("tick %d: %s failed; the tick goes on", report.number, step)
        report.errors.append(f"{step}: {type(exc).__name__}: {exc}")


def router_error(errors: list[str] | None, message: str) -> None:
    """A router's failure noted where the caller keeps them (a tick's report), or logged."""
    if errors is None:
        log.warning("%s", message)
    else:
        errors.append(message)


class Evidence:
    """The routers' evidence about the engines, taken in as it comes."""

    def __init__(self, ledger: Ledger, routers: Sequence[RouterLink], config: Config, *,
                 tasks: TaskOwner, meter: WorkMeter,
                 accuse: Callable[[int, str], None]) -> None:
        self.ledger = ledger
        self.routers = routers
        self.config = config
        self.tasks = tasks
        self.meter = meter
        #: Starts focused reads of a shard, saying why.
        self.accuse = accuse
        #: URLs whose engine was seen restarted on its own since their last drained window:
        #: that window's failures are the old process's, never the new one's.
        self._renewed: set[str] = set()
        #: Links whose outcomes are drained now (an evidence event came), not at the tick.
        self._drain_pending: set[int] = set()
        self._drain_locks = [asyncio.Lock() for _ in self.routers]
        #: When each router's current window began (the ledger's clock: its last drain).
        self._window_began: list[float | None] = [None for _ in self.routers]
        #: When each link's first reported failure of the burst not yet drained came.
        self._evidence_at: dict[int, float] = {}
        self._unlisten = [link.listen(self._failed_at(k))
                          for k, link in enumerate(self.routers) if link.in_process]

    def renewed(self, url: str) -> None:
        """The engine at ``url`` restarted on its own: its window's failures are not its own."""
        self._renewed.add(url)

    def close(self) -> None:
        for unlisten in self._unlisten:
            unlisten()

    # ------------------------------------------------------------------ windows

    def _failed_at(self, k: int) -> Callable[[str, str], None]:
        def failed(url: str, cause: str) -> None:
            # Called inside the router's request path: only schedule, never wait. Failures
            # that come in the same turn of the loop (a burst) are drained as one window.
            if k not in self._drain_pending:
                self._drain_pending.add(k)
                self._evidence_at.setdefault(k, time.monotonic())
                self.tasks.start_if_running(self._drain_now(k), f"drain:{k}")
        return failed

    async def _drain_now(self, k: int) -> None:
        self._drain_pending.discard(k)
        try:
            began, outcomes = await self._drain(k)
        except Exception as exc:
            log.warning("router %s: drain: %s", self.routers[k].name, exc)
            return
        self.apply_outcomes(outcomes, window_began_at=began)
        came = self._evidence_at.pop(k, None)
        if came is not None:
            self.meter.decided(time.monotonic() - came)

    async def _drain(self, k: int) -> tuple[float | None, dict[str, tuple[int, int, int]]]:
        """One window of router ``k``'s outcomes, and when it began (None: the first). One
        drain per router at a time: two in flight would both acknowledge the same batch, and
        the router would count it twice. The next window is dated from just before this
        drain is asked for: a little early, so a suspicion is never taken to be older than
        the window."""
        async with self._drain_locks[k]:
            began, self._window_began[k] = self._window_began[k], self.ledger.now()
            try:
                return began, await self.routers[k].drain_outcomes()
            except BaseException:
                # nothing was acknowledged: the window still began where it did
                self._window_began[k] = began
                raise

    async def take_windows(self, failed_probe: frozenset[str], errors: list[str]) -> None:
        """The tick's intake: one window of outcomes from every router, and the silent
        requests of the routers in other processes. A router that fails is noted in
        ``errors`` and the others are read all the same."""
        for k, link in enumerate(self.routers):
            try:
                began, outcomes = await self._drain(k)
            except Exception as exc:
                errors.append(f"{link.name}: drain: {exc}")
                continue
            self.apply_outcomes(outcomes, failed_probe, window_began_at=began)
        remote = [link for link in self.routers if not link.in_process]
        if remote:
            await self._accuse_silent(remote)
        # Every router's window of this tick has been read: a restart seen before it no longer
        # needs its failures set aside.
        self._renewed.clear()

    def apply_outcomes(self, outcomes: Mapping[str, tuple[int, int, int]],
                       failed_probe: frozenset[str] = frozenset(), *,
                       window_began_at: float | None = None) -> None:
        """Router windows into the ledger. ``failed_probe``: engines whose probe failed in
        this tick's round: their windows began before it and may have ended before it too,
        so their completions lift no suspicion (:meth:`Ledger.report_outcomes`); nor do
        those of a window that began before the engine became suspect (``window_began_at``,
        the ledger's clock)."""
        for url, (successes, failures, trailing) in outcomes.items():
            i = self.ledger.shard_for_url(url)
            if i is None:
                continue
            if url in self._renewed:
                # The engine restarted on its own during this window: its failures are the old
                # process's (they are why it restarted), and a new process has no history.
                failures = trailing = 0
            self.ledger.report_outcomes(i, successes, failures, trailing,
                                        may_predate_suspicion=url in failed_probe,
                                        window_began_at=window_began_at)

    # ------------------------------------------------------------------ what the routers hold

    async def holding(self, errors: list[str] | None) -> Holding:
        """Per engine, the requests every router has in flight there, and how long the oldest
        request any router holds there has received nothing (engines holding none left out,
        as ``silent``): one read of each router (``errors``: where a router's failure is
        noted; ``None``: logged)."""
        total: dict[str, int] = {}
        oldest: dict[str, float] = {}
        for link in self.routers:
            try:
                holding = await link.holding()
            except Exception as exc:
                router_error(errors, f"{link.name}: holding: {exc}")
                continue
            for url, n in holding.in_flight.items():
                total[url] = total.get(url, 0) + n
            for url, age in holding.silent.items():
                oldest[url] = max(oldest.get(url, 0.0), age)
        return Holding(total, oldest)

    # ------------------------------------------------------------------ watching

    def watch(self, stop: asyncio.Event, tasks: TaskOwner) -> None:
        """Start, in ``tasks``, the watchers that run until ``stop``: the silent-request poll
        of the in-process routers, and one long poll per router in another process."""
        tasks.start(self._watch_silence(stop), "watch-silence")
        for k, link in enumerate(self.routers):
            if not link.in_process:
                tasks.start(self._watch_remote(k, stop), f"evidence:{k}")

    async def _watch_remote(self, k: int, stop: asyncio.Event) -> None:
        """Router ``k`` runs in another process: one long poll of its evidence open at a time
        (``GET /evidence``). A failed attempt drains its outcomes at once (the ledger ejects
        within a round trip, as for a router in this process); engines holding requests
        silent are accused. A router that does not answer is retried at the tick's pace; an
        older one without the call is judged at the tick, as before."""
        link = self.routers[k]
        h = self.config.health
        while not stop.is_set():
            try:
                failed, silent = await link.evidence(EVIDENCE_WAIT_S, h.silent_after_s)
            except ControlError as exc:
                if exc.status == 404:
                    log.info("router %s has no evidence call: judged at the tick", link.name)
                    return
                log.warning("router %s: evidence: %s", link.name, exc)
                await sleep_unless(stop, h.probe_interval_s)
                continue
            except Exception as exc:  # down, or restarting: the tick reports it
                log.debug("router %s: evidence: %s", link.name, exc)
                await sleep_unless(stop, h.probe_interval_s)
                continue
            if failed:
                await self._drain_now(k)
            for url in silent:
                i = self.ledger.shard_for_url(url)
                if i is not None:
                    self.accuse(i, "silent requests")
            if silent and not failed:
                # still silent at the next poll, which would answer at once: the in-process
                # routers are asked at this pace too
                await sleep_unless(stop, h.evidence_poll_s)

    async def _watch_silence(self, stop: asyncio.Event) -> None:
        """Every ``evidence_poll_s``: engines holding requests silent for ``silent_after_s``
        are accused (in-process routers; those in other processes: :meth:`_watch_remote`)."""
        h = self.config.health
        local = [link for link in self.routers if link.in_process]
        if not local:
            return
        while not stop.is_set():
            await self._accuse_silent(local)
            await sleep_unless(stop, h.evidence_poll_s)

    async def _accuse_silent(self, links: Sequence[RouterLink]) -> None:
        after = self.config.health.silent_after_s
        for link in links:
            try:
                silent = (await link.holding(after)).silent
            except Exception as exc:
                log.warning("router %s: silent: %s", link.name, exc)
                continue
            for url in silent:
                i = self.ledger.shard_for_url(url)
                if i is not None:
                    self.accuse(i, "silent requests")


class ReportBook:
    """The fleet's record of the watchdog's reports, and their entry into ledger, journal and
    lease."""

    def __init__(self, ledger: Ledger, *, journal: Journal | None = None,
                 refit: RefitCoordinator | None = None) -> None:
        self.ledger = ledger
        self.journal = journal
        self.refit = refit
        #: The last watchdog report per shard (dashboards read running/waiting/tokens from it).
        self.last: dict[int, Report] = {}
        #: Verdicts seen since start, by name (the fleet's Prometheus counter).
        self.counts: dict[str, int] = {}

    def count(self, r: Report) -> None:
        self.counts[r.verdict.name] = self.counts.get(r.verdict.name, 0) + 1

    def enter(self, i: int, r: Report, *, progress_proves: bool = True) -> None:
        """One watchdog verdict into the ledger: the mapping is the ledger's
        (:meth:`Ledger.record_reading`); this only gathers and calls.

        ``progress_proves`` False: progress without a canary counts for nothing (the first
        focused read of an accused engine compares with a sample older than the accusation)."""
        if self.journal is not None and not r.steady:
            # The steady states of a fleet would flood the journal.
            self.journal.record_verdict(i, r.url, r.verdict.name, r.evidence.to_dict())
        excused = self.refit is not None and i in self.refit.stalls_excused()
        self.ledger.record_reading(i, reading_of(r, excused=excused,
                                                 progress_proves=progress_proves))

    def observe_participants(self, reports: Mapping[str, Report]) -> None:
        """During a lease: whether each participant's process lives and its API answered this
        tick's read, onto the lease (what a trainer whose broadcast hangs reads)."""
        assert self.refit is not None and self.refit.lease is not None
        for p in self.refit.lease.participants:
            self.observe_participant(p.shard, p.url, reports.get(p.url))

    def observe_participant(self, i: int, url: str, r: Report | None) -> None:
        """One read of shard ``i`` (at ``url`` when read) onto the open lease, if it takes
        part; ``None``: not read, only whether its process still lives is known."""
        lease = self.refit.lease if self.refit is not None else None
        p = next((p for p in lease.participants if p.shard == i), None) if lease else None
        if self.refit is None or p is None:
            return
        rec = self.ledger.shard(i)
        # A new process at the same URL (restarted in place) is not the participant's: it
        # did not get the weights, however well it answers. (One not named at the lease's
        # start is told by its URL alone: its first name is no restart.)
        replaced = rec.base_url != p.url or (p.incarnation is not None
                                             and rec.incarnation != p.incarnation)
        if rec.state in ABSENT or replaced:
            self.refit.observe_participant(
                i, process_alive=False, api_answers=None,
                evidence=f"{rec.state}: {rec.last_error}" if rec.last_error
                else f"its process was replaced ({rec.state})")
            return
        if r is None or url != p.url:
            return  # not read (this tick, or at its URL)
        answers = r.answered
        self.refit.observe_participant(
            i, process_alive=True, api_answers=answers,
            evidence=f"{r.verdict.name}: {r.evidence.summary}")


def reading_of(r: Report, *, excused: bool = False, progress_proves: bool = True) -> Reading:
    """A watchdog report as the ledger reads it (plain facts)."""
    return Reading(
        health=r.health.value,  # the same four words
        verdict=r.verdict.name, summary=r.evidence.summary,
        restarted=r.restarted,
        incarnation=r.incarnation,
        # A refused canary (the judge's ASKED_WRONG) proves nothing: as if none was sent.
        canary_ok=None if r.canary is None else r.canary.outcome,
        canary_error=r.canary.error if r.canary is not None else "",
        excused=excused, progress_proves=progress_proves,
        sleep_level=r.sample.sleep_level if r.sample is not None else None,
    )


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
        its report leads to is the accusation's (the judge's); this does the I/O."""
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

    def _facts(self, i: int) -> AccusedFacts:
        """What the ledger says of shard ``i`` now, as the accusation reads it (ejection on
        the ledger's clock, as ``ejected_until`` is)."""
        rec = self.ledger.shard(i)
        return AccusedFacts(asleep=rec.state is ShardState.SLEEPING,
                            ejected_until=rec.ejected_until,
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


class Reads:
    """The reads of the round, and what they decided, for the tick."""

    def __init__(self, ledger: Ledger, watchdog: Watchdog, config: Config, *,
                 evidence: Evidence, focus: Focus, book: ReportBook, meter: WorkMeter,
                 refit: RefitCoordinator | None = None,
                 stopped: Callable[[int], bool] = lambda i: False) -> None:
        self.ledger = ledger
        self.watchdog = watchdog
        self.config = config
        self.evidence = evidence
        self.focus = focus
        self.book = book
        self.meter = meter
        self.refit = refit
        #: Whether the OS reports shard i's engine process stopped (launched engines only).
        self._stopped = stopped
        #: The tick reads nothing: what the reads decided since the last tick waits here, and
        #: the tick takes it over as its own report.
        self._pending = TickReport(1, 0.0)
        self._pending_reports: dict[str, Report] = {}

    def take(self, number: int, started_at: float) -> tuple[TickReport, Mapping[str, Report]]:
        """What the reads decided since the last tick, as tick ``number``'s report (begun at
        ``started_at``), with their reports by URL; the next tick's report begins empty."""
        report, self._pending = self._pending, TickReport(number + 1, 0.0)
        report.number, report.started_at = number, started_at
        reports, self._pending_reports = self._pending_reports, {}
        return report, reports

    async def round(self) -> Mapping[str, Report]:
        """Every shard with a process read now, at once, each decided into the next tick's
        report as :meth:`loop`'s reads are: what a caller that runs no loop does before a tick
        (a unit test's step)."""
        round_started = time.monotonic()
        reports = await self._read(self._to_read(range(len(self.ledger))))
        round_ended = time.monotonic()
        self.meter.round_done(round_ended, round_ended - round_started, len(reports))
        return reports

    def _to_read(self, shards: Sequence[int]) -> dict[str, int]:
        """Of ``shards``, those with a process, by URL (those under focused reads are being
        read already)."""
        return {self.ledger.shard(i).base_url: i for i in shards
                if self.ledger.state(i) not in ABSENT and i not in self.focus}

    async def loop(self, stop: asyncio.Event) -> None:
        """Every engine read once per ``probe_interval_s``, on its own schedule, beside the
        tick: in slices of ``max_concurrent_reads`` whose starts are spread evenly over the
        interval, readers taking the next engine as soon as they are free and its slice has
        begun, each read decided on as it finishes. The tick waits for none of them, so at a
        thousand engines it stays the cheap ledger and push work (section 6.2). Up to
        ``max_concurrent_reads`` engines, one slice at the interval's start: the round of old.
        """
        interval = self.config.health.probe_interval_s
        while not stop.is_set():
            started = time.monotonic()
            try:
                reports = await self._read(self._to_read(range(len(self.ledger))),
                                           spread_s=interval)
            except Exception:
                log.exception("a read round failed; the next one runs as usual")
                reports = {}
            ended = time.monotonic()
            self.meter.round_done(ended, ended - started, len(reports))
            await sleep_unless(stop, started + interval - time.monotonic())

    async def _read(self, shards: Mapping[str, int], *,
                    spread_s: float | None = None) -> Mapping[str, Report]:
        """Read ``shards`` (by URL), each read into the ledger as it finishes and into the next
        tick's report. ``spread_s``: the reads spread over that many seconds, each target made
        afresh just before its read (:meth:`_target`)."""
        if spread_s is None:
            counts, ages = await self._holding()
            targets = [self._target(url, i, counts, ages) for url, i in shards.items()]
        else:
            targets = [Target(url) for url in shards]

        def decide(url: str, r: Report) -> None:
            # Each read is decided on as it finishes (the watchdog calls back), not at the
            # round's end: a round of a large fleet lasts seconds, and a condemning read would
            # otherwise wait for the slowest of the others.
            i = shards.get(url)
            if i is not None:
                self._decide(i, url, r)

        per_slice = self.watchdog.concurrency
        # What the routers hold, asked again once per slice of the round: a figure seconds old
        # would make a request that finished meanwhile look held on an engine gone quiet.
        fresh_for = (spread_s or 0.0) / max(1, -(-len(shards) // per_slice))
        asked_at = -float("inf")
        in_flight: Mapping[str, int] = {}
        held: Mapping[str, float] = {}
        asking = asyncio.Lock()  # the readers of one slice share one question to the routers

        async def fresh(t: Target) -> Target | None:
            nonlocal asked_at, in_flight, held
            i = shards.get(t.url)
            if (i is None or i in self.focus or self.ledger.state(i) in ABSENT
                    or self.ledger.shard(i).base_url != t.url):
                return None  # condemned, moved or under focused reads since the round began
            if asked_at == -float("inf") or (time.monotonic() - asked_at >= fresh_for
                                              and not asking.locked()):
                # One reader asks; the others read with the last answer meanwhile (at most
                # a slice's time old) rather than all wait on the routers' round trip. Only
                # the round's first reads wait for an answer: none is older than the round.
                async with asking:
                    if time.monotonic() - asked_at >= fresh_for:
                        counts, ages = await self._holding()
                        asked_at, in_flight, held = time.monotonic(), counts, ages
            return self._target(t.url, i, in_flight, held)

        if spread_s is None:
            return await self.watchdog.round(targets, on_report=decide)
        return await self.watchdog.round(targets, spread_s=spread_s, fresh=fresh,
                                         on_report=decide)

    async def _holding(self) -> tuple[dict[str, int], dict[str, float]]:
        """What the routers hold on each engine: requests in flight, and how long the oldest
        has been silent (a router that fails to say is noted in the next tick's report)."""
        holding = await self.evidence.holding(self._pending.router_errors)
        return holding.in_flight, holding.silent

    def _target(self, url: str, i: int, in_flight: Mapping[str, int],
                held: Mapping[str, float]) -> Target:
        """Shard ``i``'s engine as a read sees it: what the routers hold there, and whether its
        stalls are excused."""
        excused = self.refit is not None and i in self.refit.stalls_excused()
        # An engine the ledger holds asleep is never canaried, judged stuck or a lost core, even
        # where it exports no sleep state (or has not yet slept: the trainer's bracket).
        state = self.ledger.state(i)
        # A SUSPECT shard stands accused until it is proven: an idle one is canaried at every
        # tick (never one with work in it), as the ledger needs healthy_threshold good probes
        # in a row to lift it. The canary interval is for engines nobody doubts; the real-vLLM
        # tier runs with it at an hour, and a shard that went SUSPECT on reads that timed out
        # under load, then got no traffic, stayed SUSPECT for the rest of the run.
        return Target(url=url, in_flight=in_flight.get(url, 0),
                      stalls_excused=excused or state is ShardState.SLEEPING,
                      held_s=held.get(url, 0.0), engine=self.config.fleet.engine_of(i),
                      confirm=state is ShardState.SUSPECT, stopped=self._stopped(i))

    def _decide(self, i: int, url: str, r: Report) -> None:
        """One read into the ledger and the next tick's report; a stall or a refusal is
        confirmed at once."""
        if self.ledger.shard(i).base_url != url:
            return  # the shard moved during the round (a restart finished)
        report = self._pending
        self._pending_reports[url] = r
        self.book.last[i] = r
        report.verdicts[i] = r.verdict.name
        self.book.count(r)
        guarded(report, f"shard {i}: verdict {r.verdict.name}", self.book.enter, i, r)
        finished_at: Mapping[str, float] = self.watchdog.finished_at
        now = time.monotonic()
        self.meter.decided(now - finished_at.get(url, now))
        why = accused_by(r, has_process=self.ledger.state(i) not in ABSENT,
                         in_doubt=self.focus.in_doubt(i))
        if why is not None:
            self.focus.confirm(i, why)

    async def read_participants(self) -> dict[int, ProcessSeen]:
        """One read of every participant of the open lease, now: at its start (the baseline)
        and when the trainer asks to complete it. What the ledger knows of each process must
        reach from the lease's start to its end, or a process restarted between two ticks'
        reads, or before its first, is credited with weights it never received. Each read is
        applied as a tick's is (a restart it shows moves the shard) and noted on the lease.
        Returns the participants whose API answered it, with the process each read saw (the
        lease compares its two reads directly: docs/design.md section 8)."""
        if self.refit is None or self.refit.lease is None or self.watchdog is None:
            return {}
        watchdog = self.watchdog
        holding = await self.evidence.holding(None)
        in_flight, held = holding.in_flight, holding.silent
        excused = self.refit.stalls_excused()
        parts = [(p.shard, p.url) for p in self.refit.lease.participants
                 if self.ledger.shard(p.shard).base_url == p.url
                 and self.ledger.state(p.shard) not in ABSENT]

        async def read(i: int, url: str) -> Report:
            return await watchdog.probe(Target(
                url=url, in_flight=in_flight.get(url, 0), held_s=held.get(url, 0.0),
                stalls_excused=i in excused, engine=self.config.fleet.engine_of(i)))

        reports = await asyncio.gather(*(read(i, url) for i, url in parts))
        answered: dict[int, ProcessSeen] = {}
        for (i, url), r in zip(parts, reports, strict=True):
            if self.ledger.shard(i).base_url != url:
                continue  # the shard moved during the read (a restart finished)
            self.book.last[i] = r
            self.book.enter(i, r)
            self.book.observe_participant(i, url, r)
            if r.answered:
                answered[i] = ProcessSeen(
                    r.incarnation, {} if r.sample is None else r.sample.counters())
        return answered
