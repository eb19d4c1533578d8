"""The controller tick: the one loop that couples watchdog, ledger, supervisor and routers.

Owns: the tick: gathering the watchdog's reports and the routers' outcomes, calling the ledger,
pushing the serving set.
Must not: decide health itself (the judge and the ledger's table do), or start and stop engines
(the supervisor does).

Every ``probe_interval_s`` (docs/design.md section 6), in this order:

1. a watchdog round for every shard that has a process (serving and STALE), concurrently;
   verdicts go into the ledger;
2. a supervisor tick: restarts start for DEAD shards (so a shard condemned this tick is
   RESTARTING before the push), finished restarts are collected;
3. every router's outcomes are drained into ``report_outcomes``; unknown URLs are ignored;
4. the ledger's ``serving_urls()`` (less a lost core its hedges' canary still watches:
   :meth:`Controller.serving`) is pushed to every router, every tick, unconditionally (no
   deltas, so a restarted router converges on the next push), with each backend's facts
   (shard index, weight version) beside it;
5. the routers rescue the requests waiting on shards condemned this tick.

A router that fails is logged and tried again next tick; nothing a router does stops the loop.
After each tick ``on_tick`` (when given) sees the tick's report: the fleet publishes the
dashboard's snapshot from there, so a page learns what the controller learned, when it did.

The tick is the heartbeat; evidence does not wait for it (docs/design.md, "Judgement at the
speed of evidence"):

* **One channel.** Whatever moves a shard (a verdict, a drained window, a process exit the
  supervisor saw, an operator), the routers learn it from the ledger's transition stream: a
  transition that changes what may be routed, or condemns a shard, pushes and rescues at once.
* **Evidence is an event.** An in-process router reports each failed attempt as it happens
  (:meth:`InProcessRouter.listen`); its outcomes are drained at once, so the ledger ejects the
  engine within milliseconds. Engines holding requests silent for ``silent_after_s`` are
  asked for every ``evidence_poll_s`` (remote routers: once a tick).
* **Confirm at once.** An accused shard (ejected, silent requests, a stall or an unreachable
  read at the tick) gets focused reads: right away, then every ``confirm_interval_s``, until
  they conclude (condemned, proven, or nothing left to prove) or ``confirm_max_s`` passes.
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
from fleetwarden.engines import AUTO, profile
from fleetwarden.journal import Journal
from fleetwarden.judge import Hedge, Verdict
from fleetwarden.ledger import (
    ABSENT,
    ROUTABLE,
    Event,
    FleetExhausted,
    Ledger,
    Reading,
    ShardState,
    Transition,
)
from fleetwarden.refit import RefitCoordinator
from fleetwarden.router.links import CONTROL_TIMEOUT_S, EVIDENCE_WAIT_S, ControlError, RouterLink
from fleetwarden.router.pool import BackendFacts
from fleetwarden.supervisor import Supervisor
from fleetwarden.watchdog import Report, Target, Watchdog
from fleetwarden.workmeter import WorkMeter

__all__ = ["Controller", "FleetStatus", "TickReport", "reading_of"]

log = logging.getLogger(__name__)

#: The longest the supervisor waits for the routers to be told of a condemnation before it stops
#: the old process: a push and a rescue, each a control call bounded by CONTROL_TIMEOUT_S. In
#: the fleet's own process both are immediate; only a router that does not answer makes it
#: wait this long, and its requests are then moved by the stop itself (refused, re-sent).
RELEASE_WAIT_S = 2 * CONTROL_TIMEOUT_S


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


@dataclass
class FleetStatus:
    """The fleet-level answer to "can this fleet serve?" — never an exception to the caller."""

    state: str  # "serving", "degraded", "asleep", "down", "exhausted"
    detail: str
    counts: dict[str, int]


class Controller:
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
    ) -> None:
        self.ledger = ledger
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
        #: The last watchdog report per shard (dashboards read running/waiting/tokens from it).
        self.reports: dict[int, Report] = {}
        #: Verdicts seen since start, by name (the fleet's Prometheus counter).
        self.verdict_counts: dict[str, int] = {}
        #: URLs whose engine was seen restarted on its own since their last drained window:
        #: that window's failures are the old process's, never the new one's.
        self._renewed: set[str] = set()
        self._condemned: dict[int, str] = {}
        #: Shards that fell asleep since the last tick: their waiting requests move elsewhere,
        #: with their URL and whether the streams begun there move too (an engine seen asleep
        #: holds them; one the trainer holds asleep is still awake: they finish first, sleep.py).
        self._fell_asleep: dict[int, tuple[str, bool]] = {}
        self._urgent: set[asyncio.Task[None]] = set()
        #: The serving and trial sets last pushed: a transition that changes them pushes now.
        self._pushed: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self._push_pending = False
        #: Condemned URLs whose requests the routers have not yet been told to move: set once
        #: they were (what the supervisor waits for before it stops the old process).
        self._released: dict[str, asyncio.Event] = {}
        supervisor.before_stop = self.released
        #: Shards under focused reads, by index: the task doing them.
        self._focus: dict[int, asyncio.Task[None]] = {}
        #: A hedged lost core's watching canary, by shard (:meth:`_hedge_lost_core`).
        self._watching: dict[int, asyncio.Task[None]] = {}
        #: The URLs of those shards: held out of every push while their canary watches
        #: (:meth:`serving`).
        self._held_out: set[str] = set()
        #: The URLs of shards whose focused reads hedged what they hold while their gauges
        #: show work and nothing steps: held out of every push while those reads stay
        #: STALLED (:meth:`_hold_stalled`).
        self._stalled_out: set[str] = set()
        self._closing = False
        #: Links whose outcomes are drained now (an evidence event came), not at the tick.
        self._drain_pending: set[int] = set()
        self._drain_locks = [asyncio.Lock() for _ in self.routers]
        #: Focused read runs started, by why (for the fleet's metrics and the tests).
        self.focus_started: dict[str, int] = {}
        #: What the controller measured of its own work (tick, reads, pushes, decisions), on
        #: the fleet's /metrics, the dashboard and the journal's run summary. Measured on the
        #: monotonic clock whatever ``clock`` is: it is the real time the work took.
        self.meter = WorkMeter()
        #: When each link's first reported failure of the burst not yet drained came.
        self._evidence_at: dict[int, float] = {}
        self._unsubscribe = ledger.subscribe(self._on_transition)
        self._unlisten = [link.listen(self._evidence_from(k))
                          for k, link in enumerate(self.routers) if link.in_process]
        self._wake = asyncio.Event()
        #: While :meth:`run` reads each engine on its own schedule (:meth:`_read_loop`), the
        #: tick reads nothing: what the reads decided since the last tick waits here, and the
        #: tick takes it over as its own report (``False``: each :meth:`tick` reads the fleet).
        self._read_apart = False
        self._pending = TickReport(1, 0.0)
        self._pending_reports: dict[str, Report] = {}
        self.status = self._status()

    # ------------------------------------------------------------------ events

    def _on_transition(self, t: Transition) -> None:
        """The one channel: every change of the ledger passes here, whoever caused it."""
        if t.event in (Event.NEW_INCARNATION, Event.NEW_INCARNATION_WEIGHTS_LOST):
            self._renewed.add(t.record.base_url)
        if t.to_state is ShardState.DEAD and t.from_state not in ABSENT:
            # The URL the shard had when it was condemned: the routers' requests wait there.
            self._condemned[t.shard] = t.record.base_url
            self._released.setdefault(t.record.base_url, asyncio.Event())
            self._push_soon()
        elif t.to_state is ShardState.SLEEPING and t.from_state in ROUTABLE:
            # A sleeping engine holds what it has not begun to answer until it wakes: those
            # requests are rescued, as off a condemned one (it is not condemned). Streams under
            # way go too, unless the trainer holds it: its engine sleeps only once they are done.
            self._fell_asleep[t.shard] = (t.record.base_url, not t.record.sleep_held)
            self._push_soon()
        elif self._sets() != self._pushed:
            self._push_soon()
        if t.event is Event.EJECTED:
            self.confirm(t.shard, "ejected")

    def _sets(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return tuple(self.serving()), tuple(self.ledger.trial_urls())

    def serving(self) -> list[str]:
        """What the routers may use: the ledger's serving set, less a lost core whose hedges'
        canary is still watching it (:meth:`_hedge_lost_core`), unless no other would be left.
        A lost race drops an engine from its router's list only until the next push; a tick's
        push in the watch's seconds put an idle wedge back, and new requests reached it until
        its condemnation, each held a second before its own hedge (history: docs/design.md
        section 13). Held out, it is no verdict and no failure: the ledger still calls it
        HEALTHY, and it is pushed again the moment the watch ends, answered or condemned."""
        return held_out_of(self.ledger.serving_urls(), self._held_out | self._stalled_out)

    def _hold_stalled(self, url: str, held: bool) -> None:
        """Whether ``url`` is held out of the pushes for hedged requests on an engine that
        shows work and takes no step. A router whose hedge wins drops it only until the next
        push, and the tick's heartbeat push put a wedge back in routing before the stall limit
        condemned it: a request sent there then waited for the condemnation (+6 s) and a
        generation elsewhere, at 3 as at 256 engines (BENCHMARKS.md, "A wedge's parked
        requests at scale, split"). The hold lasts while its reads stay STALLED, which the
        stall limit bounds (STUCK condemns; a step ends it), and is no verdict: the ledger
        still calls it HEALTHY, and a long step that ends routes it again at that read."""
        if held == (url in self._stalled_out):
            return
        if held:
            self._stalled_out.add(url)
        else:
            self._stalled_out.discard(url)
        if not self._closing:
            self._push_soon()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[None] | None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            coro.close()  # no loop (a unit test of the mapping): the tick pushes when one runs
            return None
        task: asyncio.Task[None] = asyncio.create_task(coro, name=name)
        self._urgent.add(task)
        task.add_done_callback(self._urgent.discard)
        return task

    def serving_push(self) -> tuple[list[str], dict[str, BackendFacts]]:
        """What every push carries: the serving URLs, and each one's shard, weight version and
        incarnation (a router's cache-aware policy forgets a restarted engine's prefixes)."""
        urls = self.serving()
        wanted = set(urls)
        facts = {rec.base_url: BackendFacts(rec.index, rec.weight_version,
                                            upstream_fields=self._upstream_fields(rec.index),
                                            incarnation=rec.incarnation)
                 for rec in self.ledger.snapshot() if rec.base_url in wanted}
        return urls, facts

    def _upstream_fields(self, shard: int) -> bool | None:
        """Whether shard's engine takes vLLM's own request fields, as its profile says
        (``None`` for ``engine = "auto"``: the router's setting decides)."""
        name = self.config.fleet.engine_of(shard)
        return None if name == AUTO else profile(name).upstream_fields

    def _push_soon(self) -> None:
        if not self._push_pending:
            self._push_pending = True
            self._spawn(self._push_and_rescue(), "push")

    async def _push_and_rescue(self) -> None:
        """Push what the ledger says now, and rescue what waits on condemned shards."""
        self._push_pending = False
        await self._push(None)
        await self._rescue(None)

    async def _push(self, report: TickReport | None) -> None:
        started = time.monotonic()
        urls, facts = self.serving_push()
        trial = self.ledger.trial_urls()
        self._pushed = (tuple(urls), tuple(trial))
        for link in self.routers:
            try:
                await link.set_serving_backends(urls, facts)
                await link.set_trial_backends(trial)
            except Exception as exc:
                self._router_error(report, f"{link.name}: push: {exc}")
        self.meter.pushed(time.monotonic() - started, len(urls))

    async def _rescue(self, report: TickReport | None) -> None:
        condemned, self._condemned = self._condemned, {}
        asleep, self._fell_asleep = self._fell_asleep, {}
        if report is not None:
            report.condemned = sorted(condemned)
        moves = [(url, True) for url in condemned.values()] + list(asleep.values())
        for url, streams in moves:
            for link in self.routers:
                try:
                    rescued = await link.rescue(url, streams=streams)
                except Exception as exc:
                    self._router_error(report, f"{link.name}: rescue: {exc}")
                    continue
                if report is not None:
                    report.rescued += rescued
            released = self._released.pop(url, None)
            if released is not None:
                released.set()

    async def released(self, url: str) -> None:
        """Until the routers were told to move the requests off ``url`` (condemned), at most
        :data:`RELEASE_WAIT_S`: the supervisor stops the old process only then."""
        released = self._released.get(url)
        if released is None:
            return  # not condemned, or its requests were moved already
        try:
            await asyncio.wait_for(released.wait(), RELEASE_WAIT_S)
        except TimeoutError:
            log.warning("the routers were not told to move the requests off %s within %g s; "
                        "stopping it all the same", url, RELEASE_WAIT_S)

    @staticmethod
    def _router_error(report: TickReport | None, message: str) -> None:
        if report is None:
            log.warning("%s", message)
        else:
            report.router_errors.append(message)

    # ------------------------------------------------------------------ evidence

    def _evidence_from(self, k: int) -> Callable[[str, str], None]:
        def failed(url: str, cause: str) -> None:
            # Called inside the router's request path: only schedule, never wait. Failures
            # that come in the same turn of the loop (a burst) are drained as one window.
            if k not in self._drain_pending:
                self._drain_pending.add(k)
                self._evidence_at.setdefault(k, time.monotonic())
                self._spawn(self._drain_now(k), f"drain:{k}")
        return failed

    async def _drain_now(self, k: int) -> None:
        self._drain_pending.discard(k)
        try:
            outcomes = await self._drain(k)
        except Exception as exc:
            log.warning("router %s: drain: %s", self.routers[k].name, exc)
            return
        self.apply_outcomes(outcomes)
        came = self._evidence_at.pop(k, None)
        if came is not None:
            self.meter.decided(time.monotonic() - came)

    async def _drain(self, k: int) -> dict[str, tuple[int, int, int]]:
        """One window of router ``k``'s outcomes. One drain per router at a time: two in
        flight would both acknowledge the same batch, and the router would count it twice."""
        async with self._drain_locks[k]:
            return await self.routers[k].drain_outcomes()

    def confirm(self, shard: int, why: str) -> None:
        """Accuse ``shard``: focused reads of its engine, now and every ``confirm_interval_s``,
        until they conclude. One run per shard at a time."""
        if shard in self._focus or self.ledger.state(shard) in ABSENT or self.watchdog is None:
            return
        url = self.ledger.shard(shard).base_url
        task = self._spawn(self._confirm(shard, url), f"confirm:{shard}")
        if task is not None:
            self.focus_started[why] = self.focus_started.get(why, 0) + 1
            self._focus[shard] = task
            task.add_done_callback(lambda _: self._focus.pop(shard, None))

    async def _confirm(self, i: int, url: str) -> None:
        try:
            await self._focused_reads(i, url)
        finally:
            self._hold_stalled(url, False)  # its reads end: the ledger's set decides again

    async def _focused_reads(self, i: int, url: str) -> None:
        h = self.config.health
        deadline = self.clock() + h.confirm_max_s
        first = True
        canaried_for: float | None = -1.0  # the ejection a canary was sent for
        while True:
            rec = self.ledger.shard(i)
            if rec.base_url != url or rec.state in ABSENT:
                return  # condemned, or a new process: nothing left to confirm about this one
            excused = self.refit is not None and i in self.refit.stalls_excused()
            in_flight = (await self._in_flight(None)).get(url, 0)
            held = (await self._held(None)).get(url, 0.0)
            # A canary, if the engine is idle: on the first read (the accusation itself), and
            # once per ejection when its time is up (the only proof that puts it on trial; a
            # busy engine gets none, and is asked again at the next read).
            due = self.ledger.ejection_due(i)  # on the ledger's clock, as ejected_until is
            # And at every read of an engine in doubt (SUSPECT on reads alone), as the round
            # does (:meth:`_target`): an idle engine proves itself by nothing else.
            doubted = self._in_doubt(i)
            ask = first or doubted or (due and canaried_for != rec.ejected_until)
            # Out of routing for failed requests: its health path too, where that proves a
            # dead core (vLLM's API server outlives its killed core for seconds, /metrics
            # frozen, /health 503).
            r = await self.watchdog.probe(Target(url=url, in_flight=in_flight, held_s=held,
                                                 stalls_excused=excused, confirm=ask,
                                                 check_health=rec.ejected_until is not None))
            if due and ask and r.canary is not None:
                canaried_for = rec.ejected_until
            rec = self.ledger.shard(i)
            if rec.base_url != url:
                return
            self.reports[i] = r
            self.verdict_counts[r.verdict.name] = self.verdict_counts.get(r.verdict.name, 0) + 1
            # The first read compares with the tick's sample, taken before the accusation:
            # progress it shows may predate the fault, so it proves nothing (a canary does).
            self.apply_report(i, r, progress_proves=not first)
            # The tick does not read a shard under focused reads: a lease's status of it is
            # kept from these reads, or it would show the last tick's (stale) liveness.
            self._observe_participant(i, url, r)
            rec = self.ledger.shard(i)
            if rec.state in ABSENT:
                return
            hedge = r.hedge(h.hedge_after_s)
            self._hold_stalled(url, hedge is Hedge.STEP or (
                url in self._stalled_out and r.verdict is Verdict.STALLED))
            if hedge is Hedge.STEP:
                await self._hedge(i, url, r.hedge_after(h.hedge_after_s))
            elif hedge is Hedge.LOST_CORE:
                await self._hedge_lost_core(i, url, r, r.hedge_after(h.hedge_after_s))
            if not first and r.settled and rec.ejected_until is None and not self._in_doubt(i):
                return  # proven, or nothing to prove: the tick takes over again
            if self.clock() >= deadline:
                return
            first = False
            await asyncio.sleep(h.confirm_interval_s)

    async def _hedge_lost_core(self, i: int, url: str, r: Report, held_s: float) -> None:
        """Hedge a lost core's held requests, with a canary sent as they are, unless one sent
        with earlier hedges still waits: it takes over their watch (:meth:`_watch_hedged`).
        Started first, so that the engine holds work throughout (the hedges' answers cancel the
        requests it held, a generation later). In a task of its own: the focused reads go on
        meanwhile, and requests that reach ``held_s`` there later are hedged then."""
        if i not in self._watching:
            task = self._spawn(self._watch_hedged(i, url, r), f"watch-hedged:{i}")
            if task is not None:
                self._watching[i] = task
                self._held_out.add(url)
                task.add_done_callback(lambda _: self._watch_ended(i, url))
                self._push_soon()
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
        self._held_out.discard(url)
        if not self._closing:
            self._push_soon()  # back in routing, unless the watch condemned it

    async def _watch_hedged(self, i: int, url: str, r: Report) -> None:
        """The canary that watches a hedged lost core; what it concludes (the watch's, in
        :meth:`Watchdog.watch_hedged`) goes into the ledger as any read does."""
        assert self.watchdog is not None
        condemned = await self.watchdog.watch_hedged(r)
        rec = self.ledger.shard(i)
        if condemned is None or rec.base_url != url or rec.state in ABSENT:
            return
        self.reports[i] = condemned
        self.apply_report(i, condemned, progress_proves=False)

    async def _hedge(self, i: int, url: str, held_s: float, *,
                     lost_race_fails: bool = False) -> None:
        """Shard ``i``'s engine held a request ``held_s`` and took no step: every router sends
        what it holds there that long to another engine as well (the first answer is the
        client's). Asked again at each focused read while it lasts: requests that reach
        ``held_s`` later are hedged then, and a hedge the retry budget refused is tried again.
        ``lost_race_fails``: a lost race is a failed attempt of the engine (a lost core);
        otherwise (work in its gauges: perhaps one long step) it costs the engine nothing in
        the ledger."""
        for link in self.routers:
            try:
                n = await link.hedge(url, held_s, lost_race_fails=lost_race_fails)
            except Exception as exc:
                log.warning("router %s: hedge: %s", link.name, exc)
                continue
            if n:
                log.info("shard %d: %d request(s) held %g s with no step hedged by %s", i, n,
                         held_s, link.name)

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
                await _sleep_unless(stop, h.probe_interval_s)
                continue
            except Exception as exc:  # down, or restarting: the tick reports it
                log.debug("router %s: evidence: %s", link.name, exc)
                await _sleep_unless(stop, h.probe_interval_s)
                continue
            if failed:
                await self._drain_now(k)
            for url in silent:
                i = self.ledger.shard_for_url(url)
                if i is not None:
                    self.confirm(i, "silent requests")
            if silent and not failed:
                # still silent at the next poll, which would answer at once: the in-process
                # routers are asked at this pace too
                await _sleep_unless(stop, h.evidence_poll_s)

    async def _watch_silence(self, stop: asyncio.Event) -> None:
        """Every ``evidence_poll_s``: engines holding requests silent for ``silent_after_s``
        are accused (in-process routers; those in other processes: :meth:`_watch_remote`)."""
        h = self.config.health
        local = [link for link in self.routers if link.in_process]
        if not local:
            return
        while not stop.is_set():
            await self._accuse_silent(local)
            await _sleep_unless(stop, h.evidence_poll_s)

    async def _accuse_silent(self, links: Sequence[RouterLink]) -> None:
        after = self.config.health.silent_after_s
        for link in links:
            try:
                silent = await link.silent_backends(after)
            except Exception as exc:
                log.warning("router %s: silent: %s", link.name, exc)
                continue
            for url in silent:
                i = self.ledger.shard_for_url(url)
                if i is not None:
                    self.confirm(i, "silent requests")

    # ------------------------------------------------------------------ the tick

    async def tick(self) -> TickReport:
        self.tick_number += 1
        started = time.perf_counter()
        reports: Mapping[str, Report]
        if self._read_apart:
            # The reads since the last tick were decided as each finished: this tick's.
            report, self._pending = self._pending, TickReport(self.tick_number + 1, 0.0)
            report.number, report.started_at = self.tick_number, self.clock()
            reports, self._pending_reports = self._pending_reports, {}
        else:
            report = TickReport(self.tick_number, self.clock())

        # 0. a refit lease that overran marks its participants SUSPECT
        if self.refit is not None:
            self._guarded(report, "refit lease", self.refit.check_lease)

        # 1. the watchdog round, each read decided on as it finishes (read apart: done)
        if not self._read_apart:
            reports = await self._read_round(report)
        failed_probe = frozenset(url for url, r in reports.items() if r.failed_probe)
        if self.refit is not None and self.refit.lease is not None:
            self._guarded(report, "refit participants", self.observe_participants, reports)

        # 2. the supervisor: a shard condemned above is RESTARTING before the push
        self._guarded(report, "supervisor", self.supervisor.tick)

        # 3. outcomes from every router, one window each
        for k, link in enumerate(self.routers):
            try:
                outcomes = await self._drain(k)
            except Exception as exc:
                report.router_errors.append(f"{link.name}: drain: {exc}")
                continue
            self.apply_outcomes(outcomes, failed_probe)
        remote = [link for link in self.routers if not link.in_process]
        if remote:
            await self._accuse_silent(remote)

        # Every router's window of this tick has been read: a restart seen before it no longer
        # needs its failures set aside.
        self._renewed.clear()

        # 4. push, every tick, unconditionally (the heartbeat: a restarted router converges)
        await self._push(report)
        retry_after = self._retry_after_estimate()
        for link in self.routers:
            try:
                await link.set_retry_after(retry_after)
            except Exception as exc:
                report.router_errors.append(f"{link.name}: retry-after: {exc}")

        # 5. rescue what waits on shards condemned or fallen asleep since (if no transition
        # did it already)
        await self._rescue(report)
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

    async def _read_round(self, report: TickReport) -> Mapping[str, Report]:
        """The watchdog round, for every shard with a process, within the tick."""
        round_started = time.monotonic()
        reports = await self._read(report, self._to_read(range(len(self.ledger))))
        round_ended = time.monotonic()
        self.meter.round_done(round_ended, round_ended - round_started, len(reports))
        return reports

    def _to_read(self, shards: Sequence[int]) -> dict[str, int]:
        """Of ``shards``, those with a process, by URL (those under focused reads are being
        read already)."""
        return {self.ledger.shard(i).base_url: i for i in shards
                if self.ledger.state(i) not in ABSENT and i not in self._focus}

    async def _read_loop(self, stop: asyncio.Event) -> None:
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
                reports = await self._read(None, self._to_read(range(len(self.ledger))),
                                           spread_s=interval)
            except Exception:
                log.exception("a read round failed; the next one runs as usual")
                reports = {}
            ended = time.monotonic()
            self.meter.round_done(ended, ended - started, len(reports))
            await _sleep_unless(stop, started + interval - time.monotonic())

    async def _read(self, report: TickReport | None, shards: Mapping[str, int], *,
                    spread_s: float | None = None) -> Mapping[str, Report]:
        """Read ``shards`` (by URL), each read into the ledger as it finishes (``report``
        ``None``: into the next tick's report). ``spread_s``: the reads spread over that many
        seconds, each target made afresh just before its read (:meth:`_target`)."""
        if spread_s is None:
            counts, ages = await self._in_flight(report), await self._held(report)
            targets = [self._target(url, i, counts, ages) for url, i in shards.items()]
        else:
            targets = [Target(url) for url in shards]
        decided: set[str] = set()

        def decide(url: str, r: Report) -> None:
            # Each read is decided on as it finishes (the watchdog calls back), not at the
            # round's end: a round of a large fleet lasts seconds, and a condemning read would
            # otherwise wait for the slowest of the others. What a watchdog does not call back
            # for (a double's round), the loop below decides on at the end.
            i = shards.get(url)
            if i is None or url in decided:
                return
            decided.add(url)
            self._decide(report, i, url, r)

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
            if (i is None or i in self._focus or self.ledger.state(i) in ABSENT
                    or self.ledger.shard(i).base_url != t.url):
                return None  # condemned, moved or under focused reads since the round began
            if asked_at == -float("inf") or (time.monotonic() - asked_at >= fresh_for
                                              and not asking.locked()):
                # One reader asks; the others read with the last answer meanwhile (at most
                # a slice's time old) rather than all wait on the routers' round trip. Only
                # the round's first reads wait for an answer: none is older than the round.
                async with asking:
                    if time.monotonic() - asked_at >= fresh_for:
                        counts, ages = await self._in_flight(report), await self._held(report)
                        asked_at, in_flight, held = time.monotonic(), counts, ages
            return self._target(t.url, i, in_flight, held)

        hooked = hasattr(self.watchdog, "on_report")
        if hooked:
            self.watchdog.on_report = decide
        try:
            if spread_s is None:
                reports = await self.watchdog.round(targets)
            else:
                reports = await self.watchdog.round(targets, spread_s=spread_s, fresh=fresh)
        finally:
            if hooked:
                self.watchdog.on_report = None
        for url in shards:
            r = reports.get(url)
            if r is not None:
                decide(url, r)
        return reports

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
                      confirm=state is ShardState.SUSPECT)

    def _decide(self, report: TickReport | None, i: int, url: str, r: Report) -> None:
        """One read of the round into the ledger; a stall or a refusal is confirmed at once.
        ``report`` ``None``: the read belongs to the next tick's report."""
        if self.ledger.shard(i).base_url != url:
            return  # the shard moved during the round (a restart finished)
        if report is None:
            report = self._pending
            self._pending_reports[url] = r
        self.reports[i] = r
        report.verdicts[i] = r.verdict.name
        self.verdict_counts[r.verdict.name] = self.verdict_counts.get(r.verdict.name, 0) + 1
        self._guarded(report, f"shard {i}: verdict {r.verdict.name}", self.apply_report, i, r)
        finished_at: Mapping[str, float] = self.watchdog.finished_at
        now = time.monotonic()
        self.meter.decided(now - finished_at.get(url, now))
        if r.accuses and self.ledger.state(i) not in ABSENT:
            self.confirm(i, r.verdict.name.lower())
        elif self._in_doubt(i):
            # A read left it SUSPECT (a first canary that timed out, a failed read): it needs
            # healthy_threshold good reads in a row to be lifted, and the round comes back to
            # it only once per round, which at a thousand engines is a minute or more. Focused
            # reads settle the doubt at their own pace, whatever the fleet's size.
            self.confirm(i, "suspect")

    def _in_doubt(self, i: int) -> bool:
        """SUSPECT on reads alone: not ejected for failed requests (those come back by a
        canary when their time is up) nor on trial (only a completed request ends that)."""
        rec = self.ledger.shard(i)
        return rec.state is ShardState.SUSPECT and rec.ejected_until is None and not rec.on_trial

    @staticmethod
    def _guarded(report: TickReport, step: str, fn: Callable[..., object], *args: Any) -> None:
        """Run one step of the tick. No step's failure aborts the tick: the push and the rescue
        that follow are what keep requests away from a bad engine."""
        try:
            fn(*args)
        except Exception as exc:
            log.exception("tick %d: %s failed; the tick goes on", report.number, step)
            report.errors.append(f"{step}: {type(exc).__name__}: {exc}")

    async def _in_flight(self, report: TickReport | None) -> dict[str, int]:
        total: dict[str, int] = {}
        for link in self.routers:
            try:
                for url, n in (await link.in_flight()).items():
                    total[url] = total.get(url, 0) + n
            except Exception as exc:
                self._router_error(report, f"{link.name}: in-flight: {exc}")
        return total

    async def _held(self, report: TickReport | None) -> dict[str, float]:
        """Per engine, how long the oldest request any router holds there has received
        nothing (engines holding none are left out)."""
        oldest: dict[str, float] = {}
        for link in self.routers:
            try:
                for url, age in (await link.silent_backends(0.0)).items():
                    oldest[url] = max(oldest.get(url, 0.0), age)
            except Exception as exc:
                self._router_error(report, f"{link.name}: held requests: {exc}")
        return oldest

    async def read_participants(self) -> frozenset[int]:
        """One read of every participant of the open lease, now: at its start (the baseline)
        and when the trainer asks to complete it. What the ledger knows of each process must
        reach from the lease's start to its end, or a process restarted between two ticks'
        reads, or before its first, is credited with weights it never received. Each read is
        applied as a tick's is (a restart it shows moves the shard) and noted on the lease.
        Returns the participants whose API answered it."""
        if self.refit is None or self.refit.lease is None or self.watchdog is None:
            return frozenset()
        watchdog = self.watchdog
        in_flight = await self._in_flight(None)
        held = await self._held(None)
        excused = self.refit.stalls_excused()
        parts = [(p.shard, p.url) for p in self.refit.lease.participants
                 if self.ledger.shard(p.shard).base_url == p.url
                 and self.ledger.state(p.shard) not in ABSENT]

        async def read(i: int, url: str) -> Report:
            return await watchdog.probe(Target(
                url=url, in_flight=in_flight.get(url, 0), held_s=held.get(url, 0.0),
                stalls_excused=i in excused, engine=self.config.fleet.engine_of(i)))

        reports = await asyncio.gather(*(read(i, url) for i, url in parts))
        answered = set()
        for (i, url), r in zip(parts, reports, strict=True):
            if self.ledger.shard(i).base_url != url:
                continue  # the shard moved during the read (a restart finished)
            self.reports[i] = r
            self.apply_report(i, r)
            self._observe_participant(i, url, r)
            if r.answered:
                answered.add(i)
        return frozenset(answered)

    def observe_participants(self, reports: Mapping[str, Report]) -> None:
        """During a lease: whether each participant's process lives and its API answered this
        tick's read, onto the lease (what a trainer whose broadcast hangs reads)."""
        assert self.refit is not None and self.refit.lease is not None
        for p in self.refit.lease.participants:
            self._observe_participant(p.shard, p.url, reports.get(p.url))

    def _observe_participant(self, i: int, url: str, r: Report | None) -> None:
        """One read of shard ``i`` (at ``url`` when read) onto the open lease, if it takes
        part; ``None``: not read, only whether its process still lives is known."""
        lease = self.refit.lease if self.refit is not None else None
        p = next((p for p in lease.participants if p.shard == i), None) if lease else None
        if self.refit is None or p is None:
            return
        rec = self.ledger.shard(i)
        if rec.state in ABSENT or rec.base_url != p.url:
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

    def apply_outcomes(self, outcomes: Mapping[str, tuple[int, int, int]],
                       failed_probe: frozenset[str] = frozenset()) -> None:
        """Router windows into the ledger. ``failed_probe``: engines whose probe failed in
        this tick's round: their windows began before it and may have ended before it too,
        so their completions lift no suspicion (:meth:`Ledger.report_outcomes`)."""
        for url, (successes, failures, trailing) in outcomes.items():
            i = self.ledger.shard_for_url(url)
            if i is None:
                continue
            if url in self._renewed:
                # The engine restarted on its own during this window: its failures are the old
                # process's (they are why it restarted), and a new process has no history.
                failures = trailing = 0
            self.ledger.report_outcomes(i, successes, failures, trailing,
                                        may_predate_suspicion=url in failed_probe)

    def apply_report(self, i: int, r: Report, *, progress_proves: bool = True) -> None:
        """One watchdog verdict into the ledger: the mapping is the ledger's
        (:meth:`Ledger.record_reading`); the controller only gathers and calls.

        ``progress_proves`` False: progress without a canary counts for nothing (the first
        focused read of an accused engine compares with a sample older than the accusation)."""
        if self.journal is not None and not r.steady:
            # The steady states of a fleet would flood the journal.
            self.journal.record_verdict(i, r.url, r.verdict.name, r.evidence.to_dict())
        excused = self.refit is not None and i in self.refit.stalls_excused()
        self.ledger.record_reading(i, reading_of(r, excused=excused,
                                                 progress_proves=progress_proves))

    def _retry_after_estimate(self) -> float | None:
        """Seconds until a shard is expected back, when some are restarting; else None."""
        restarting = [a for a in self.supervisor.attempts.values() if not a.passive]
        if not restarting:
            return None
        expected = self.supervisor.typical_restart_s()
        now = self.clock()
        left = min(max(1.0, expected - (now - a.started_at)) for a in restarting)
        return round(left)

    def _status(self) -> FleetStatus:
        counts = {s.value: n for s, n in self.ledger.counts_by_state().items()}
        serving = len(self.ledger.serving())
        try:
            self.ledger.raise_if_exhausted()
        except FleetExhausted as exc:
            return FleetStatus("exhausted", str(exc), counts)
        if serving == 0 and self.ledger.sleeping():
            return FleetStatus("asleep", f"{len(self.ledger.sleeping())} shards asleep; none "
                               "serves until one wakes", counts)
        if serving == 0:
            return FleetStatus("down", "no shard serves; restarts in progress", counts)
        journal = self._journal_problem()
        if serving < len(self.ledger):
            return FleetStatus("degraded", f"{serving} of {len(self.ledger)} shards serve"
                               + journal, counts)
        if journal:
            return FleetStatus("degraded", f"all {serving} shards serve" + journal, counts)
        return FleetStatus("serving", f"all {serving} shards serve", counts)

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
        self._read_apart = True
        watchers = [asyncio.create_task(self._watch_silence(stop), name="watch-silence"),
                    asyncio.create_task(self._read_loop(stop), name="reads")]
        watchers += [asyncio.create_task(self._watch_remote(k, stop), name=f"evidence:{k}")
                     for k, link in enumerate(self.routers) if not link.in_process]
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
            self._read_apart = False
            for watcher in watchers:
                watcher.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    async def _wait_either(self, stop: asyncio.Event) -> None:
        waiter = asyncio.create_task(self._wake.wait())
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            stopper.cancel()
            self._wake.clear()

    async def push_now(self) -> None:
        """Push the serving set to every router now (start-up, admin actions)."""
        await self._push(None)

    async def push_and_rescue_now(self) -> int:
        """Push now, and move the requests waiting on shards that fell asleep since the last
        push elsewhere (the trainer's sleep bracket, before its engines sleep; the streams
        begun on a shard the trainer holds asleep stay to finish). Returns how many were
        moved."""
        await self.push_now()
        asleep, self._fell_asleep = self._fell_asleep, {}
        moved = 0
        for url, streams in asleep.values():
            moved += await self.rescue_now([url], streams=streams)
        return moved

    async def rescue_now(self, urls: Sequence[str], *, streams: bool = True) -> int:
        """Every router moves the requests on ``urls`` elsewhere now (``streams``: the streams
        begun there too, continued from where they are). Returns how many were moved."""
        moved = 0
        for url in urls:
            for link in self.routers:
                try:
                    moved += await (link.rescue(url) if streams
                                    else link.rescue(url, streams=False))
                except Exception as exc:
                    log.warning("router %s: rescue failed: %s", link.name, exc)
        return moved

    def wake(self) -> None:
        """Run the next tick now (an admin action changed the fleet)."""
        self._wake.set()

    async def close(self) -> None:
        self._closing = True
        self._unsubscribe()
        for unlisten in self._unlisten:
            unlisten()
        for task in list(self._urgent):
            task.cancel()
        await asyncio.gather(*self._urgent, return_exceptions=True)

    def describe(self) -> dict[str, Any]:
        return {"status": self.status.state, "detail": self.status.detail,
                "counts": self.status.counts, "tick": self.tick_number}


def held_out_of(serving: list[str], held: set[str]) -> list[str]:
    """``serving`` less the URLs ``held`` out, unless that would leave none: an engine in
    doubt still serves when it is all there is (a held-out lost core is no condemned one)."""
    kept = [u for u in serving if u not in held]
    return kept or serving


def reading_of(r: Report, *, excused: bool = False, progress_proves: bool = True) -> Reading:
    """A watchdog report as the ledger reads it (plain facts)."""
    return Reading(
        health=r.health.value,  # the same four words
        verdict=r.verdict.name, summary=r.evidence.summary,
        restarted=r.restarted,
        incarnation=r.incarnation,
        canary_ok=None if r.canary is None else r.canary.ok,
        canary_error=r.canary.error if r.canary is not None else "",
        excused=excused, progress_proves=progress_proves,
        sleep_level=r.sample.sleep_level if r.sample is not None else None,
    )


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``stop`` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
