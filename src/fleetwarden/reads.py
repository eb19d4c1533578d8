"""The reads: every engine with a process read, each read decided on as it finishes.

Owns: the reads (beside the tick, each engine on its own schedule in the running fleet:
docs/design.md 6.2; or every engine at once, :meth:`Reads.round`); each read's target (what
the routers hold there, whether its stalls are excused, whether it is canaried); each read's
way into the ledger (:class:`~fleetwarden.reports.ReportBook`) and, when it accuses, to the
focused reads; the reads of a refit lease's participants; the tick's report
(:class:`TickReport`): what the reads decided since the last tick, until the tick takes it.
Must not: judge a read (the judge does), map a report to a state (the ledger's table does),
read an engine under focused reads (focus.py does), or tell the routers anything (pushes.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetwarden.accusation import accused_by
from fleetwarden.config import Config
from fleetwarden.evidence import Evidence
from fleetwarden.focus import Focus
from fleetwarden.ledger import ABSENT, Ledger, ShardState
from fleetwarden.refit import ProcessSeen, RefitCoordinator
from fleetwarden.reports import ReportBook
from fleetwarden.tasks import sleep_unless
from fleetwarden.watchdog import Report, Target, Watchdog
from fleetwarden.workmeter import WorkMeter

__all__ = ["Reads", "TickReport", "guarded"]

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
