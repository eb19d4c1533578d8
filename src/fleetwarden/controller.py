"""The controller tick: the one loop that couples watchdog, ledger, supervisor and routers.

Owns: the tick and the read round (gathering the watchdog's reports, calling the ledger),
pushing the serving set and rescuing what waits on condemned or sleeping shards; it builds its
collaborators and hands each what it needs.
Must not: decide health itself (the judge and the ledger's table do), start and stop engines
(the supervisor does), take in the routers' evidence (evidence.py) or run focused reads and
hedges (focus.py).

Every ``probe_interval_s`` (docs/design.md section 6), in this order:

1. a watchdog round for every shard that has a process (serving and STALE), concurrently;
   verdicts go into the ledger (reports.py);
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
* **Evidence is an event** (evidence.py): a failed attempt a router reports is drained at
  once, and engines holding requests silent are accused between ticks.
* **Confirm at once** (focus.py): an accused shard (ejected, silent requests, a stall or an
  unreachable read at the tick) gets focused reads until they conclude.

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

from fleetwarden.accusation import accused_by
from fleetwarden.config import Config, FleetConfig
from fleetwarden.credentials import NO_KEYS, EngineKeys
from fleetwarden.engines import (
    AUTO,
    COMPLETION_UNKNOWN,
    CapUnknown,
    output_cap_of,
    output_default_of,
    profile,
)
from fleetwarden.evidence import Evidence, router_error
from fleetwarden.focus import Focus
from fleetwarden.journal import Journal
from fleetwarden.launchers.procs import process_info
from fleetwarden.ledger import (
    ABSENT,
    ROUTABLE,
    Event,
    Ledger,
    ShardRecord,
    ShardState,
    Transition,
    tally,
)
from fleetwarden.model_files import generation_config_file
from fleetwarden.refit import ProcessSeen, RefitCoordinator
from fleetwarden.reports import ReportBook
from fleetwarden.router.links import CONTROL_TIMEOUT_S, RouterLink
from fleetwarden.router.pool import BackendFacts
from fleetwarden.router.splice import CompletionDefault
from fleetwarden.supervisor import Supervisor
from fleetwarden.tasks import TaskOwner, sleep_unless
from fleetwarden.watchdog import Report, Target, Watchdog
from fleetwarden.workmeter import WorkMeter

__all__ = ["Controller", "FleetStatus", "TickReport", "fleet_status"]

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
    #: The shards as the headline counts them: serving, coming back, out (:func:`tally`).
    tally: dict[str, int] = field(default_factory=dict)


#: How :func:`output_cap_from` begins the source of a cap it does not know.
UNKNOWN = "unknown: "


def output_cap_from(said: int | CapUnknown | None, fleet: FleetConfig,
                    shard: int) -> tuple[int | None, str]:
    """A shard's server cap on every request's output, and where it comes from, in the order
    of trust: what its engine's ``/server_info`` says (the running process's word); the
    config's declared ``output_cap``; a launched engine's command
    (``--override-generation-config``); else ``unknown: why`` (:data:`UNKNOWN`: an attached
    engine that says nothing, with no declaration), with ``None``."""
    if not isinstance(said, CapUnknown):
        return said, "engine"
    declared = fleet.declared_output_cap(shard)
    if declared is not None:
        return (None if declared == "none" else int(declared)), "declared"
    if shard < fleet.launched:
        group = fleet.group_of(shard)
        return output_cap_of(fleet.engine_cmd if group is None else group.engine_cmd,
                             generation_config_file), "command"
    return None, f"{UNKNOWN}{said.why}"


def output_default_from(said: int | CapUnknown | None, fleet: FleetConfig,
                        shard: int) -> tuple[int | None, str | None]:
    """A shard's default limit of a request that names none (a chat's; vLLM's
    ``default_sampling_params``, :func:`~fleetwarden.engines.generation_limits`) and why it is
    not known, if it is not: what its engine's ``/server_info`` shows (its model folder, where
    that is on this host), else the config's declared ``output_default``, else a launched
    engine's command (its model folder, ``--generation-config``, the override); else unknown
    (an attached engine elsewhere: its chats naming no limit are continued only as far as
    their finishes proved, docs/design.md 4.1)."""
    if not isinstance(said, CapUnknown):
        return said, None
    declared = fleet.declared_output_default(shard)
    if declared is not None:
        return (None if declared == "none" else int(declared)), None
    if shard < fleet.launched:
        group = fleet.group_of(shard)
        said = output_default_of(fleet.engine_cmd if group is None else group.engine_cmd,
                                 generation_config_file)
        if not isinstance(said, CapUnknown):
            return said, None
    return None, said.why


def completion_default_of(engine: str, report: Report | None) -> CompletionDefault:
    """What a shard's engine gives a completion that names no limit: its kind's rule
    (:data:`~fleetwarden.engines.COMPLETION_FIXED` and the others), the kind configured (its
    ``engine``) or, under ``engine = "auto"``, recognised at its last read (``report``); not
    known before (the router then ends such a completion cut there rather than guess)."""
    kind = profile(engine) if engine != AUTO else None if report is None else report.engine
    return CompletionDefault(COMPLETION_UNKNOWN if kind is None else kind.completion_default)


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
        self._condemned: dict[int, str] = {}
        #: Shards that fell asleep since the last tick: their waiting requests move elsewhere,
        #: with their URL and whether the streams begun there move too (an engine seen asleep
        #: holds them; one the trainer holds asleep is still awake: they finish first, sleep.py).
        self._fell_asleep: dict[int, tuple[str, bool]] = {}
        #: Every task the controller and its collaborators start between two transitions or
        #: events (pushes, drains, focused reads): all cancelled and awaited on close.
        self.tasks = TaskOwner()
        #: The serving and trial sets last pushed: a transition that changes them pushes now.
        self._pushed: tuple[tuple[str, ...], tuple[str, ...], int] | None = None
        self._push_pending = False
        #: The engine process whose unknown server cap was last told, by shard: told once.
        self._cap_told: dict[int, str | None] = {}
        #: Condemned URLs whose requests the routers have not yet been told to move: set once
        #: they were (what the supervisor waits for before it stops the old process).
        self._released: dict[str, asyncio.Event] = {}
        supervisor.before_stop = self.released
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
        self._unsubscribe = ledger.subscribe(self._on_transition)
        self._wake = asyncio.Event()
        #: While :meth:`run` reads each engine on its own schedule (:meth:`_read_loop`), the
        #: tick reads nothing: what the reads decided since the last tick waits here, and the
        #: tick takes it over as its own report (``False``: each :meth:`tick` reads the fleet).
        self._read_apart = False
        self._pending = TickReport(1, 0.0)
        self._pending_reports: dict[str, Report] = {}
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
        """Accuse ``shard``: focused reads of its engine until they conclude (focus.py)."""
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
        elif t.event in COMEBACKS and t.to_state is ShardState.STALE:
            # A new process answers: proven now, by one canary while it is idle (or by its
            # progress), not at the next read of the round, up to a tick away. With static
            # weights that canary is its refit (HEALTHY, routed by this same channel); with a
            # trainer's it stays STALE until a refit confirms its weights.
            self.confirm(t.shard, "comeback")

    def _sets(self) -> tuple[tuple[str, ...], tuple[str, ...], int]:
        return tuple(self.serving()), tuple(self.ledger.trial_urls()), self.coming_back()

    def coming_back(self) -> int:
        """Shards with an engine on its way back to routing: restarting, condemned with a
        restart to come or a return awaited (:meth:`Supervisor.coming_back`), or a new process
        that only its proof stands between it and routing (STALE with static weights: one
        canary). A STALE shard with a trainer's weights waits for a refit nobody can time, so
        it is not counted. Pushed beside the serving set: a router that finds no engine waits
        for one while this is not 0 (docs/design.md, "None left, one coming")."""
        static = self.ledger.policy.weights == "static"
        n = 0
        for rec in self.ledger.snapshot():
            if rec.state is ShardState.STALE:
                n += static and not rec.weights_discarded
            elif rec.state in ABSENT:
                n += self.supervisor.coming_back(rec.index)
        return n

    def serving(self) -> list[str]:
        """What the routers may use: the ledger's routed set (:meth:`Admission.routed`: its
        serving set less the engines the focused reads hold out, a lost core its hedges'
        canary watches or an engine with hedged requests that shows work and takes no step,
        unless none would be left). A lost race drops an engine from its router's list only
        until the next push, and a tick's push put a wedge back in routing before its
        condemnation (history: docs/design.md section 13). Held out is no verdict: the ledger
        still calls it HEALTHY, and it is pushed again when the hold ends (a transition)."""
        return self.ledger.admission.routed()

    def serving_push(self) -> tuple[list[str], dict[str, BackendFacts]]:
        """What every push carries: the serving URLs, and each one's shard, weight version,
        incarnation (a router's cache-aware policy forgets a restarted engine's prefixes) and
        the models it serves, as the watchdog read them (the routers' ``GET /v1/models``), and
        its server cap (:meth:`output_cap`) and default limit (:func:`output_default_from`)."""
        urls = self.serving()
        wanted = set(urls)
        facts = {rec.base_url: self._facts(rec)
                 for rec in self.ledger.snapshot() if rec.base_url in wanted}
        return urls, facts

    def _facts(self, rec: ShardRecord) -> BackendFacts:
        cap, source = self.output_cap(rec)
        default, default_unknown = self.output_default(rec)
        return BackendFacts(rec.index, rec.weight_version,
                            upstream_fields=self._upstream_fields(rec.index),
                            incarnation=rec.incarnation,
                            models=self.watchdog.models(rec.base_url), key=self._key(rec.index),
                            output_cap=cap, output_default=default,
                            output_cap_unknown=(source.removeprefix(UNKNOWN)
                                                if source.startswith(UNKNOWN) else None),
                            output_default_unknown=default_unknown,
                            completion_default=completion_default_of(
                                self.config.fleet.engine_of(rec.index),
                                self.book.last.get(rec.index)))

    def output_cap(self, rec: ShardRecord) -> tuple[int | None, str]:
        """The server cap on every request's output of ``rec``'s engine (``None``: none, or
        not known) and where it comes from: ``engine`` (its own ``GET /server_info``, the
        running process's word), ``declared`` (the config's ``output_cap``), ``command`` (a
        launched engine's ``--override-generation-config``), or ``unknown: why`` (an attached
        engine that says nothing and has no declaration: its continuations go only as far as
        what requests there produced proves, until a ``"length"`` finish reveals it,
        docs/design.md 4.1; said once per process in the log, and on its status row)."""
        said = self.watchdog.output_cap(rec.base_url, rec.incarnation)
        cap, source = output_cap_from(said, self.config.fleet, rec.index)
        if isinstance(said, CapUnknown) and source.startswith("unknown"):
            self._tell_unknown_cap(rec, said)
        return cap, source

    def output_default(self, rec: ShardRecord) -> tuple[int | None, str | None]:
        """``rec``'s engine's default limit of a chat that names none (``None``: none, or not
        known) and why it is not known (:func:`output_default_from`; ``None``: known): a
        chat begun there is then continued only as far as such chats there proved
        (docs/design.md 4.1), and its status row says so."""
        return output_default_from(self.watchdog.output_default(rec.base_url, rec.incarnation),
                                   self.config.fleet, rec.index)

    def _tell_unknown_cap(self, rec: ShardRecord, said: CapUnknown) -> None:
        """Log an attached engine's unknown cap once per process, once it was asked."""
        if said.settled and self._cap_told.get(rec.index, "") != rec.incarnation:
            self._cap_told[rec.index] = rec.incarnation
            log.warning("shard %d (%s): its server cap on a request's output is unknown (%s; "
                        "no output_cap on its [[fleet.backends]] table): a stream cut there is "
                        "continued only as far as what requests there produced proves, until "
                        "a \"length\" finish reveals it; declare output_cap (\"none\" where "
                        "it caps nothing) or run vLLM with VLLM_SERVER_DEV_MODE=1 "
                        "(docs/design.md 4.1)", rec.index, rec.base_url, said.why)

    def _key(self, shard: int) -> str | None:
        key = self.engine_keys.of_shard(shard)
        return None if key is None else key.reveal()

    def _upstream_fields(self, shard: int) -> bool | None:
        """Whether shard's engine takes vLLM's own request fields, as its profile says
        (``None`` for ``engine = "auto"``: the router's setting decides)."""
        name = self.config.fleet.engine_of(shard)
        return None if name == AUTO else profile(name).upstream_fields

    def _push_soon(self) -> None:
        if not self._push_pending:
            self._push_pending = True
            self.tasks.start_if_running(self._push_and_rescue(), "push")

    async def _push_and_rescue(self) -> None:
        """Push what the ledger says now, and rescue what waits on condemned shards."""
        self._push_pending = False
        await self._push(None)
        await self._rescue(None)

    async def _push(self, report: TickReport | None) -> None:
        started = time.monotonic()
        urls, facts = self.serving_push()
        trial = self.ledger.trial_urls()
        coming = self.coming_back()
        self._pushed = (tuple(urls), tuple(trial), coming)
        for link in self.routers:
            try:
                await link.set_serving_backends(urls, facts, coming_back=coming)
                await link.set_trial_backends(trial)
            except Exception as exc:
                router_error(_errors(report), f"{link.name}: push: {exc}")
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
                    router_error(_errors(report), f"{link.name}: rescue: {exc}")
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
            self._guarded(report, "refit participants", self.book.observe_participants,
                          reports)

        # 2. the supervisor: a shard condemned above is RESTARTING before the push
        self._guarded(report, "supervisor", self.supervisor.tick)

        # 3. outcomes from every router, one window each (evidence.py)
        await self.evidence.take_windows(failed_probe, report.router_errors)

        # 4. holds past their until-time end; push, every tick (a restarted router converges)
        self._guarded(report, "holds", self.ledger.admission.expire)
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
                if self.ledger.state(i) not in ABSENT and i not in self.focus}

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
            await sleep_unless(stop, started + interval - time.monotonic())

    async def _read(self, report: TickReport | None, shards: Mapping[str, int], *,
                    spread_s: float | None = None) -> Mapping[str, Report]:
        """Read ``shards`` (by URL), each read into the ledger as it finishes (``report``
        ``None``: into the next tick's report). ``spread_s``: the reads spread over that many
        seconds, each target made afresh just before its read (:meth:`_target`)."""
        if spread_s is None:
            counts, ages = await self._holding(report)
            targets = [self._target(url, i, counts, ages) for url, i in shards.items()]
        else:
            targets = [Target(url) for url in shards]

        def decide(url: str, r: Report) -> None:
            # Each read is decided on as it finishes (the watchdog calls back), not at the
            # round's end: a round of a large fleet lasts seconds, and a condemning read would
            # otherwise wait for the slowest of the others.
            i = shards.get(url)
            if i is not None:
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
                        counts, ages = await self._holding(report)
                        asked_at, in_flight, held = time.monotonic(), counts, ages
            return self._target(t.url, i, in_flight, held)

        if spread_s is None:
            return await self.watchdog.round(targets, on_report=decide)
        return await self.watchdog.round(targets, spread_s=spread_s, fresh=fresh,
                                         on_report=decide)

    async def _holding(self, report: TickReport | None,
                       ) -> tuple[dict[str, int], dict[str, float]]:
        """What the routers hold on each engine: requests in flight, and how long the oldest
        has been silent."""
        holding = await self.evidence.holding(_errors(report))
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
                      confirm=state is ShardState.SUSPECT, stopped=self.process_stopped(i))

    def _decide(self, report: TickReport | None, i: int, url: str, r: Report) -> None:
        """One read of the round into the ledger; a stall or a refusal is confirmed at once.
        ``report`` ``None``: the read belongs to the next tick's report."""
        if self.ledger.shard(i).base_url != url:
            return  # the shard moved during the round (a restart finished)
        if report is None:
            report = self._pending
            self._pending_reports[url] = r
        self.book.last[i] = r
        report.verdicts[i] = r.verdict.name
        self.book.count(r)
        self._guarded(report, f"shard {i}: verdict {r.verdict.name}", self.book.enter, i, r)
        finished_at: Mapping[str, float] = self.watchdog.finished_at
        now = time.monotonic()
        self.meter.decided(now - finished_at.get(url, now))
        why = accused_by(r, has_process=self.ledger.state(i) not in ABSENT,
                         in_doubt=self.focus.in_doubt(i))
        if why is not None:
            self.confirm(i, why)

    @staticmethod
    def _guarded(report: TickReport, step: str, fn: Callable[..., object], *args: Any) -> None:
        """Run one step of the tick. No step's failure aborts the tick: the push and the rescue
        that follow are what keep requests away from a bad engine."""
        try:
            fn(*args)
        except Exception as exc:
            log.exception("tick %d: %s failed; the tick goes on", report.number, step)
            report.errors.append(f"{step}: {type(exc).__name__}: {exc}")

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
        self._read_apart = True
        watchers = TaskOwner()
        self.evidence.watch(stop, watchers)
        watchers.start(self._read_loop(stop), "reads")
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

    async def weights_changing(self, urls: Sequence[str], version: int) -> int:
        """Every router marks the requests on ``urls`` as kept across a load of ``version``
        (their answers name each version: router/relay.py). Returns how many."""
        marked = 0
        for url in urls:
            for link in self.routers:
                try:
                    marked += await link.weights_changing(url, version)
                except Exception as exc:
                    log.warning("router %s: marking a load failed: %s", link.name, exc)
        return marked

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


def _errors(report: TickReport | None) -> list[str] | None:
    """Where a router's failure is noted: the tick's report, or (``None``) the log."""
    return None if report is None else report.router_errors
