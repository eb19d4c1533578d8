"""A whole fleet in one process: what ``fleetwarden up`` runs, and what tests embed.

Owns: starting, stopping and wiring. It builds the picture of docs/design.md section 1 from a
:class:`~fleetwarden.config.Config`: the journal (restored when it exists, by ``restore.py``),
the ledger, the launchers and the supervisor, the watchdog, the router, the refit coordinator,
the controller that ticks them, and the admin API (``admin/server.py``, which keeps the admin
side's own state: its token, events, traffic and metrics registry); and it offers
the narrow surface of operations (:class:`~fleetwarden.admin.surface.FleetSurface`: retire,
restart, refits, outcomes, a fault, a snapshot) that the admin API, the demo and the CLI use.

Must not: decide health (the ledger and the judge do), build views (``admin/views.py``), or
hold a restore policy (``restore.py``). The parts (``fleet.ledger``, ``fleet.controller``...)
are reachable for tests; callers outside tests use the surface.

    async with Fleet(config) as fleet:     # engines up, router and admin listening
        print(fleet.router_url)
        await fleet.run()                  # the controller loop, until request_stop()
                                           # leaving the block stops every engine it started
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from fleetwarden.admin.server import AdminServer
from fleetwarden.admin.views import FleetCollector
from fleetwarden.admin.work import WorkCollector
from fleetwarden.auth import load_or_create_token
from fleetwarden.config import Config
from fleetwarden.controller import COMEBACKS, Controller, TickReport
from fleetwarden.credentials import NO_KEYS, EngineKeys, Secret
from fleetwarden.journal import Journal
from fleetwarden.launchers import EngineHandle, EngineRecord, Launcher
from fleetwarden.launchers.attach import AttachLauncher
from fleetwarden.launchers.local import LocalLauncher
from fleetwarden.launchers.routers import RouterWorkers, refuse_if_taken
from fleetwarden.ledger import ABSENT, Ledger, Outcome, ShardState, Transition
from fleetwarden.refit import Lease, RefitCoordinator, RefitRecord, confirmation
from fleetwarden.restore import adopt_or_stop, begin_run, read_attached
from fleetwarden.router import Router
from fleetwarden.router.links import RemoteRouter, RouterLink
from fleetwarden.router.pool import BackendFacts
from fleetwarden.sleep import SleepResult, drain_routers, put_to_sleep
from fleetwarden.sleep import wake as wake_shards
from fleetwarden.snapshot import Acted, RouterCounters, Snapshot
from fleetwarden.supervisor import Supervisor, launch_first
from fleetwarden.watchdog import Target, Watchdog
from fleetwarden.weight_sync import (
    CONFIRM_READ_S,
    PAUSE_MODES,
    EngineOutcome,
    RefitLoad,
    cost_since,
    cost_totals,
    load_checkpoint,
    read_all,
    read_weights,
)

__all__ = ["Fleet", "ShardLaunchers"]

log = logging.getLogger(__name__)

class _JournalEngines:
    """Engines about to start, started and stopped, written to the journal as it happens."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def launching(self, handle: EngineHandle) -> None:
        self.journal.engine_launched(handle.launch_id, handle.shard, EngineRecord.intent(handle))

    def launched(self, handle: EngineHandle) -> None:
        self.journal.engine_launched(handle.launch_id, handle.shard,
                                     EngineRecord.of(handle).to_dict())

    def stopped(self, handle: EngineHandle) -> None:
        self.journal.engine_stopped(handle.launch_id)


class ShardLaunchers:
    """One launcher per shard: launched shards locally or as Ray actors (``fleet.launcher``),
    attached shards by their command."""

    def __init__(self, by_shard: dict[int, Launcher]) -> None:
        self.by_shard = by_shard

    async def launch(self, shard: int) -> EngineHandle:
        return await self.by_shard[shard].launch(shard)

    async def wait_ready(self, handle: EngineHandle, timeout_s: float) -> None:
        await self.by_shard[handle.shard].wait_ready(handle, timeout_s)

    async def stop(self, handle: EngineHandle) -> None:
        await self.by_shard[handle.shard].stop(handle)

    async def close(self) -> None:
        for launcher in {id(x): x for x in self.by_shard.values()}.values():
            await launcher.close()

    def passive(self, shard: int) -> bool:
        launcher = self.by_shard.get(shard)
        return isinstance(launcher, AttachLauncher) and not launcher.can_restart


class Fleet:
    """Router, controller, supervisor, watchdog, journal and admin API for one fleet."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.started_at = time.time()
        self._stop = asyncio.Event()
        r = config.router
        #: The admin API and what only it uses (its token, events, traffic, metrics).
        self.admin = AdminServer(
            host=config.admin.host, port=config.admin.port, token_file=config.admin.token_file,
            tick_s=config.health.probe_interval_s,
            failure_statuses=frozenset({r.status_when_others_serve, r.status_when_none_left}))
        self._journal: Journal | None = None
        self._router: Router | None = None
        self._workers: RouterWorkers | None = None
        self._watchdog: Watchdog | None = None
        #: The engines' API keys, read at the start (``credentials.EngineKeys``).
        self.engine_keys = NO_KEYS
        self._shard_at: dict[str, int] = {}  # engine URL -> shard, for a group's own key
        self._supervisor: Supervisor | None = None
        self._controller: Controller | None = None
        self._ledger: Ledger | None = None
        self._refit: RefitCoordinator | None = None
        self._launchers: ShardLaunchers | None = None
        self.routers: list[RouterLink] = []
        self._remotes: list[RemoteRouter] = []
        #: The checkpoint of the last load fleetwarden ran (``refit_from``): a replacement
        #: engine waiting in STALE is loaded from it at once (:meth:`_catch_up`).
        self._source: tuple[str, int, Mapping[str, str] | None] | None = None
        #: Loads fleetwarden runs, one at a time: a fleet's and a replacement's never overlap.
        self._loading = asyncio.Lock()
        self._catching_up: asyncio.Task[None] | None = None
        #: (shard, incarnation, version) already tried: a replacement is loaded once per
        #: process and checkpoint, so an engine that cannot load is not tried every tick.
        self._caught: set[tuple[int, str | None, int]] = set()
        #: The routers' fault counters at the end of the last load (``refit_from``): the next
        #: one charges the trainer's step with what they counted since (``RefitLoad.cost``).
        self._costs_at_load: dict[str, Any] = cost_totals([])
        self.admin.registry.register(FleetCollector(
            lambda: self.snapshot() if self._controller is not None else None))
        self.admin.registry.register(WorkCollector(
            lambda: self._controller.meter if self._controller is not None else None))

    # ------------------------------------------------------------------ parts (once started)

    @property
    def ledger(self) -> Ledger:
        assert self._ledger is not None, "the fleet is not started"
        return self._ledger

    @property
    def controller(self) -> Controller:
        assert self._controller is not None, "the fleet is not started"
        return self._controller

    @property
    def supervisor(self) -> Supervisor:
        assert self._supervisor is not None, "the fleet is not started"
        return self._supervisor

    @property
    def router(self) -> Router | RouterWorkers:
        """The router in this process (``[router] workers = 0``), or its processes (their
        URL, counters and in-flight requests as last read)."""
        router = self._router or self._workers
        assert router is not None, "the fleet is not started"
        return router

    @property
    def refit(self) -> RefitCoordinator:
        assert self._refit is not None, "the fleet is not started"
        return self._refit

    @property
    def journal(self) -> Journal | None:
        return self._journal

    @property
    def router_url(self) -> str:
        return self.router.url

    @property
    def admin_url(self) -> str:
        return self.admin.url

    # ------------------------------------------------------------------ start / stop

    async def __aenter__(self) -> Fleet:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        cfg = self.config
        launched = list(range(cfg.fleet.launched))
        attached = {cfg.fleet.launched + k: url for k, url in enumerate(cfg.fleet.backends)}
        size = len(launched) + len(attached)

        # The keys first: one that cannot be read is a config error, before anything starts.
        self.engine_keys = EngineKeys.of(cfg.fleet)
        if self.engine_keys.any:
            log.info("engines' API keys read (%s); every request of fleetwarden's own "
                     "carries its engine's", "; ".join(self.engine_keys.sources))
        self.admin.load_token()
        self._journal = journal = Journal(cfg.journal.path)
        restored = journal.restore(self.config.ledger_policy(), clock=time.time)
        if restored is not None and len(restored) != size:
            raise ValueError(
                f"journal {cfg.journal.path} records a fleet of {len(restored)} shards, the "
                f"config has {size}; use another journal.path for a different fleet"
            )
        launcher, local, self._launchers = await self._start_launchers(journal, launched,
                                                                        attached)
        clean = journal.get_meta("clean_shutdown") == "1"
        journal.set_meta("clean_shutdown", "0")  # until this run stops cleanly

        # Engines an earlier run left running: the current one of each shard is adopted, the
        # rest (a restart in progress, a condemned engine not yet stopped, any of a run that
        # died before its first snapshot) are stopped. (Ray's actors end with their driver.)
        adopted: dict[int, EngineHandle] = {}
        if local is not None:
            adopted = await adopt_or_stop(journal, local, restored)
        ledger, first = await self._first_engines(journal, launcher, local, launched,
                                                  attached, restored, adopted)
        self._watchdog = watchdog = Watchdog(cfg.health.watchdog_policy(),
                                             concurrency=cfg.health.max_concurrent_reads,
                                             key_of=self._key_of)
        # Which process each attached engine is, read now, all at once (the watchdog keeps
        # each read as its baseline): the ledger records it, and an engine that is still the
        # process the journal recorded keeps its state (docs/design.md section 7).
        running = await read_attached(watchdog, {
            i: Target(url, engine=cfg.fleet.engine_of(i)) for i, url in attached.items()})
        if restored is not None:  # journaled, each change with its cause
            log.info("restoring the fleet from %s (last run stopped %s)", cfg.journal.path,
                     "cleanly" if clean else "without a clean stop")
            begin_run(ledger, first, attached, running)
        else:
            for i, incarnation in running.items():
                ledger.observe_incarnation(i, incarnation)  # who it is: no restart
        self._supervisor = supervisor = self._start_supervisor(
            ledger, journal, self._launchers, adopted, first, fresh=restored is None)
        await self._start_routers(ledger)
        self._refit = RefitCoordinator(ledger, lease_s=cfg.refit.lease_s, clock=time.time)
        self._controller = Controller(
            ledger, self._watchdog, supervisor, self.routers, cfg,
            journal=journal, refit=self._refit, on_tick=self._after_tick,
            engine_keys=self.engine_keys,
        )
        # The first answers already name their weights: the push's facts, before any tick.
        if self._router is not None:
            self._router.set_serving_backends(*self._controller.serving_push())
        else:
            await self._controller.push_now()
        await self.admin.start(self)

    def _key_of(self, url: str) -> Secret | None:
        """The key the engine at ``url`` wants: the fleet's, or its shard's group's."""
        keys = self.engine_keys
        if keys.uniform or self._ledger is None:
            return keys.fleet
        shard = self._shard_at.get(url)
        if shard is None or self._ledger.shard(shard).base_url != url:
            # A restart moved a URL: the map is made afresh (once per move, not per read).
            self._shard_at = {rec.base_url: rec.index for rec in self._ledger.snapshot()}
            shard = self._shard_at.get(url)
        return keys.fleet if shard is None else keys.of_shard(shard)

    async def _start_launchers(self, journal: Journal, launched: list[int],
                               attached: dict[int, str],
                               ) -> tuple[Launcher, LocalLauncher | None, ShardLaunchers]:
        """The launcher of the launched shards (and the local one, when it is local), and
        every shard's launcher (attached shards: the attach launcher)."""
        cfg = self.config
        launcher: Launcher
        local: LocalLauncher | None = None
        if cfg.fleet.launcher == "ray" and launched:
            from fleetwarden.launchers.ray import RayLauncher  # the optional extra

            ray_launcher = RayLauncher(cfg.fleet, cfg.supervisor, self._engine_exited)
            await ray_launcher.connect()  # a wrong address fails the start, not each shard
            launcher = ray_launcher
        else:
            local = LocalLauncher(cfg.fleet, cfg.supervisor, self._engine_exited)
            local.events = _JournalEngines(journal)
            launcher = local
        attach = AttachLauncher(cfg.fleet, cfg.health, key=self.engine_keys.fleet)
        shards = ShardLaunchers({i: launcher for i in launched} | {i: attach for i in attached})
        return launcher, local, shards

    async def _first_engines(self, journal: Journal, launcher: Launcher,
                             local: LocalLauncher | None,
                             launched: list[int], attached: dict[int, str],
                             restored: Ledger | None, adopted: dict[int, EngineHandle]
                             ) -> tuple[Ledger, dict[int, EngineHandle | BaseException]]:
        """The first engines started, and the ledger over them (the restored one, or a new
        one built with their URLs)."""
        cfg = self.config
        size = len(launched) + len(attached)
        # The first engines start before the ledger exists, so it is built with their URLs.
        # A restored DEAD shard is not among them: the supervisor restarts it, within budget.
        to_launch = [i for i in launched if i not in adopted and (
            restored is None or restored.state(i) not in (ShardState.RETIRED, ShardState.DEAD))]
        first = await launch_first(launcher, to_launch, cfg.fleet.startup_timeout_s)
        urls = []
        for i in range(size):
            if i in attached:
                urls.append(attached[i])
            elif isinstance(first.get(i), EngineHandle):
                urls.append(first[i].url)  # type: ignore[union-attr]
            else:
                urls.append(f"http://{cfg.fleet.host}:0/shard-{i}-not-started")

        ledger = restored if restored is not None else Ledger(urls, self.config.ledger_policy(),
                                                              clock=time.time)
        self._ledger = ledger
        if local is not None:
            local.taken_urls = lambda: {r.base_url for r in ledger.snapshot()}
        ledger.subscribe(self.admin.events.transition)
        ledger.subscribe(self._on_transition)
        journal.attach(ledger)
        return ledger, first

    def _start_supervisor(self, ledger: Ledger, journal: Journal, launchers: ShardLaunchers,
                          adopted: dict[int, EngineHandle],
                          first: dict[int, EngineHandle | BaseException], *,
                          fresh: bool) -> Supervisor:
        """The supervisor, with every engine running adopted; a first engine that did not
        start is condemned (the supervisor restarts it within budget)."""
        cfg = self.config
        supervisor = Supervisor(ledger, launchers, cfg.fleet, cfg.supervisor, journal=journal,
                                passive=launchers.passive)
        for i, handle in adopted.items():
            supervisor.adopt(i, handle)
        for i, result in first.items():
            if isinstance(result, EngineHandle):
                supervisor.adopt(i, result)
                if fresh:
                    ledger.observe_incarnation(i, result.incarnation)
            else:
                log.error("shard %d: first engine did not start: %s", i, result)
                ledger.condemn(i, f"first start failed: {result}")
        return supervisor

    async def _start_routers(self, ledger: Ledger) -> None:
        """The routers: this process's, or router worker processes of their own; and the
        remote ones the config names."""
        cfg = self.config
        if cfg.router.workers:  # router processes of their own, adopted when they still run
            self._workers = RouterWorkers(
                cfg.router, load_or_create_token(cfg.router.control_token_file),
                cfg.router.control_token_file, cfg.fleet.log_dir, self._journal,
                outlive=cfg.fleet.engines_outlive_fleetwarden)
            await self._workers.start(ledger.serving_urls())
            self.admin.registry.register(self._workers.collector())  # the router's, per worker
            self.routers = list(self._workers.links)
        else:
            if cfg.router.port:  # the bind would fail too; this names who holds the port
                refuse_if_taken(cfg.router.host, cfg.router.port)
            self._router = Router(ledger.serving_urls(), cfg.router.settings(),
                                  health_managed=True)
            await self._router.start(cfg.router.host, cfg.router.port)
            self.routers = [self._router.control()]
        for remote in cfg.router.remote:
            link = RemoteRouter(remote.url, load_or_create_token(remote.token_file))
            self._remotes.append(link)
            self.routers.append(link)

    async def run(self) -> None:
        """Run the controller loop until :meth:`request_stop`."""
        await self.controller.run(self._stop)

    async def reload_routers(self) -> None:
        """Replace the router processes with new ones on the same port, no request failed
        (:meth:`RouterWorkers.reload`); nothing to do for a router in this process."""
        if self._workers is not None:
            await self._workers.reload()

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def stop(self) -> None:
        """Stop serving, then stop every engine this fleet started, leaving nothing running."""
        self._stop.set()
        await self.admin.stop()
        if self._catching_up is not None:
            self._catching_up.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._catching_up
        if self._controller is not None:
            await self._controller.close()
        if self._router is not None:
            await self._router.stop()
        if self._workers is not None:
            try:
                await self._workers.stop()
            except Exception as exc:
                log.error("%s", exc)
        for remote in self._remotes:
            await remote.close()
        stopped_all = False
        if self._supervisor is not None:
            stopped_all = await self._supervisor.close()
        elif self._launchers is not None:
            try:
                await self._launchers.close()
            except Exception as exc:  # said, never swallowed: an engine may be left running
                log.error("stopping the engines: %s", exc)
        if self._watchdog is not None:
            await self._watchdog.close()
        if self._journal is not None:
            if self._controller is not None:
                try:
                    self._journal.record_run_summary(self.run_summary())
                except Exception as exc:  # the stop goes on: the summary is a report, not state
                    log.error("the run summary was not written: %s", exc)
            if stopped_all:
                self._journal.set_meta("clean_shutdown", "1")  # every engine was stopped
            try:
                self._journal.close()
            except Exception as exc:
                log.error("%s", exc)
            self._journal = None

    # ------------------------------------------------------------------ events

    def _engine_exited(self, handle: EngineHandle) -> None:
        if self._supervisor is not None:
            self._supervisor.engine_exited(handle)

    def run_summary(self) -> dict[str, Any]:
        """What this run measured of its own work (the journal keeps it at a clean stop)."""
        c = self.controller
        return {"started_at": self.started_at, "ended_at": time.time(),
                "shards": len(self.ledger), "ticks": c.tick_number, "work": c.meter.summary()}

    def _after_tick(self, report: TickReport) -> None:
        self.admin.after_tick(self, self.router.stats)
        self._catch_up_soon()  # one that came back during a load waits for it to end

    def _on_transition(self, t: Transition) -> None:
        if t.event in COMEBACKS and t.to_state is ShardState.STALE:
            # At its return, not at the next tick (up to probe_interval_s later, 5 s by
            # default): a replacement's capacity waits for nothing but its load.
            self._catch_up_soon()

    def _catch_up_soon(self) -> None:
        """Start a catch-up load (:meth:`_catch_up`) when a replacement waits for one and no
        load runs."""
        if (self._source is not None and self.refit.lease is None and not self._loading.locked()
                and (self._catching_up is None or self._catching_up.done())
                and self._stale_replacements()):
            self._catching_up = asyncio.ensure_future(self._catch_up())

    # ------------------------------------------------------------------ operations (the surface)

    @property
    def size(self) -> int:
        return len(self.ledger)

    def serving(self) -> tuple[list[str], dict[str, BackendFacts]]:
        return self.controller.serving_push()

    def retire(self, i: int, reason: str) -> Acted:
        outcome: Outcome = self.ledger.retire(i, reason)
        self.controller.wake()
        return Acted(i, outcome.applied, outcome.reason, self.ledger.state(i))

    async def restart(self, i: int, reason: str) -> Acted:
        ok = await self.supervisor.restart_now(i, reason)
        self.controller.wake()
        return Acted(i, ok, "", self.ledger.state(i))

    def apply_outcomes(self, outcomes: Mapping[str, tuple[int, int, int]]) -> None:
        self.controller.apply_outcomes(outcomes)

    async def push(self) -> None:
        await self.controller.push_now()

    async def sleep(self, level: int, shards: list[int] | None) -> list[SleepResult]:
        results = await put_to_sleep(self.ledger, self.controller, level=level, shards=shards)
        self.controller.wake()
        self.admin.announce("sleep", phase="sleep", level=level)
        return results

    async def wake(self, shards: list[int] | None) -> list[SleepResult]:
        results = await wake_shards(self.ledger, self.controller, shards=shards)
        self.controller.wake()
        self.admin.announce("sleep", phase="wake")
        return results

    async def begin_refit(self, version: int) -> Lease:
        lease = self.refit.begin_refit(version)
        # Every participant read at the start: the baseline its read at the completion is
        # compared with (docs/design.md section 8).
        self.refit.read_at_start(await self.controller.read_participants())
        self.admin.announce("refit", phase="begin", version=version)
        return lease

    async def complete_refit(self, version: int, checksums: Mapping[str, str] | None = None,
                             *, failed: Mapping[int, str] | None = None) -> RefitRecord:
        # Every participant read once more first: a version is credited only to a process
        # known alive through the whole lease, and whose engine, where it can say, says it
        # holds that version (and the trainer's checksums, when given): docs/design.md
        # section 8.
        lease = self.refit.lease
        targets = {} if lease is None else {
            p.shard: (p.url, self.config.fleet.engine_of(p.shard)) for p in lease.participants}
        read, weights = await asyncio.gather(
            self.controller.read_participants(),
            read_all(targets, checksums=checksums is not None,
                     timeout_s=max(self.config.health.probe_timeout_s, CONFIRM_READ_S),
                     keys={i: self.engine_keys.of_shard(i) for i in targets}))
        record = self.refit.complete_refit(version, read_at_end=read, weights=weights,
                                           checksums=checksums, failed=failed)
        self.controller.wake()
        self.admin.announce("refit", phase="complete", version=version)
        return record

    async def refit_from(self, path: str, version: int, *, pause_mode: str | None = None,
                         checksums: Mapping[str, str] | None = None) -> RefitLoad:
        """Load the checkpoint at ``path`` into every participant as ``version``, and credit
        only the engines that confirm it. Out of routing first (each participant STALE: no
        request is sent to an engine whose weights are changing, nor labelled with a version
        it no longer holds), the routers' requests on them drained for ``[refit] drain_s``;
        then on every engine at once: pause (``pause_mode``, default ``[refit] pause_mode``),
        reload from ``path``, stamp ``version``, resume; then the completion reads each
        engine's own version (and checksums, when given). An engine whose load failed stays
        STALE with the error; the others serve ``version``; the routers know before this
        returns. Per engine: :class:`~fleetwarden.weight_sync.EngineOutcome`."""
        mode = self.config.refit.pause_mode if pause_mode is None else pause_mode
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if self._catching_up is not None and not self._catching_up.done():
            # The trainer's load goes first: a replacement being caught up is a participant
            # of it (STALE), loaded with the newer checkpoint after whatever its engine was
            # doing (vLLM's core takes one call at a time).
            self._catching_up.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._catching_up
        async with self._loading:
            load = await self._refit_from(path, version, mode, checksums)
        now = await self._fault_costs()
        load = dataclasses.replace(load, cost=cost_since(self._costs_at_load, now))
        self._costs_at_load = now
        if load.credited:
            self._source = (path, version, checksums)  # what a replacement is loaded from
        return load

    async def _refit_from(self, path: str, version: int, mode: str,
                          checksums: Mapping[str, str] | None) -> RefitLoad:
        cfg = self.config.refit
        started = time.monotonic()
        lease = await self.begin_refit(version)
        if self.ledger.weights_loaded():
            # From the first load on, a good canary would label a new process's launch
            # weights with the checkpoint's version (docs/rl.md, a replacement's weights).
            log.warning("weights = \"static\" no longer holds: fleetwarden loads %s as version "
                        "%d, so a new engine process waits in STALE until it is loaded with the "
                        "fleet's checkpoint (as with weights = \"trainer\")", path, version)
        try:
            parts = [(p.shard, p.url) for p in lease.participants
                     if self.ledger.shard(p.shard).base_url == p.url
                     and self.ledger.state(p.shard) not in ABSENT]
            for i, _ in parts:
                self.ledger.mark_weights_partial(i, f"loading weight version {version} from "
                                                    f"{path}")
            await self.controller.push_now()
            # Requests already sent finish where they are (for drain_s at most; past it the
            # pause mode decides), so none reaches an engine in the middle of its load.
            await drain_routers(self.controller, {url for _, url in parts}, cfg.drain_s)
            if mode == "keep":
                # Those still under way go on under the new weights: their answers name both
                # versions, never the old one alone (docs/rl.md, the pause mode).
                await self.controller.weights_changing([url for _, url in parts], version)
            timeout = aiohttp.ClientTimeout(total=cfg.load_timeout_s)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                loads = await asyncio.gather(*(
                    load_checkpoint(http, url, path, version, pause_mode=mode,
                                    key=self.engine_keys.of_shard(i))
                    for i, url in parts))
            failed = {i: r.error for (i, _), r in zip(parts, loads, strict=True) if not r.took}
            record = await self.complete_refit(version, checksums, failed=failed)
        except BaseException:
            if self.refit.lease is not None and self.refit.lease.version == version:
                self.abort_refit(version, "the load was interrupted")
            raise
        await self.push()
        disagreed = dict(record.unconfirmed)
        engines = tuple(
            EngineOutcome(i, url, took=r.took,
                          confirmed=True if i in record.confirmed
                          else False if i in disagreed else None,
                          state=self.ledger.state(i).value,
                          error=r.error or disagreed.get(i, ""), seconds=r.seconds)
            for (i, url), r in zip(parts, loads, strict=True))
        return RefitLoad(version, path, mode, engines, time.monotonic() - started)

    async def _fault_costs(self) -> dict[str, Any]:
        """The routers' fault counters now, summed (:func:`~fleetwarden.weight_sync.
        cost_totals`); a router that does not answer is left out of this read."""
        said = []
        for link in self.controller.routers:
            try:
                said.append((await link.status())["stats"])
            except Exception as exc:
                log.warning("router %s: its counters were not read: %s", link.name, exc)
        return cost_totals(said)

    def _stale_replacements(self) -> list[int]:
        """STALE shards not yet tried with the current source, in this process."""
        if self._source is None:
            return []
        version = self._source[1]
        return [r.index for r in self.ledger.snapshot()
                if r.state is ShardState.STALE and r.weight_version <= version
                and (r.index, r.incarnation, version) not in self._caught]

    async def _catch_up(self) -> None:
        """Load the last checkpoint fleetwarden loaded into each replacement engine waiting in
        STALE (restarted, or attached after the load), only it, at once: without this it
        would wait for the trainer's next step, or, worse, in static mode be promoted with the
        checkpoint's weights under the current version. Credited only where its engine
        confirms the version (an engine that cannot say waits for the next refit) and its
        process is the one loaded (the same URL and incarnation before and after)."""
        assert self._source is not None
        path, version, checksums = self._source
        async with self._loading:
            if self.refit.lease is not None:
                return
            shards = [(i, self.ledger.shard(i)) for i in self._stale_replacements()]
            self._caught = {c for c in self._caught if c[2] == version}  # older: done with
            self._caught.update((i, r.incarnation, version) for i, r in shards)
            timeout = aiohttp.ClientTimeout(total=self.config.refit.load_timeout_s)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                loads = await asyncio.gather(*(
                    load_checkpoint(http, r.base_url, path, version,
                                    pause_mode=self.config.refit.pause_mode,
                                    key=self.engine_keys.of_shard(i))
                    for i, r in shards))
                said = await asyncio.gather(*(
                    read_weights(http, r.base_url, self.config.fleet.engine_of(i),
                                 checksums=checksums is not None,
                                 key=self.engine_keys.of_shard(i)) for i, r in shards))
            credited = []
            for (i, before), load, weights in zip(shards, loads, said, strict=True):
                now = self.ledger.shard(i)
                ok, why = confirmation(version, checksums, weights)
                if not load.took or ok is not True or now.state is not ShardState.STALE or (
                        now.base_url, now.incarnation) != (before.base_url, before.incarnation):
                    log.warning("shard %d: not loaded with version %d from %s: %s", i,
                                version, path, load.error or why)
                    continue
                self.ledger.report_refit(i, version)
                credited.append(i)
        if credited:
            await self.push()
            self.admin.announce("refit", phase="catch-up", version=version)

    def abort_refit(self, version: int, reason: str) -> RefitRecord:
        record = self.refit.abort_refit(version, reason)
        self.controller.wake()
        self.admin.announce("refit", phase="abort", version=version)
        return record

    async def inject_fault(self, i: int, fault: str, options: dict[str, Any]) -> str:
        """Inject ``fault`` into shard ``i``'s engine: through a simulated engine's fault
        endpoint, or by signals to a real local vLLM engine's EngineCore process."""
        from fleetwarden.chaos import inject

        handle = self.supervisor.engines.get(i)
        url = self.ledger.shard(i).base_url
        return await inject(url, handle, fault, options)

    def snapshot(self) -> Snapshot:
        """Everything the views show, read from the parts now (``admin/views.py``)."""
        c, s, refit = self.controller, self.supervisor, self.refit
        shards = tuple(self.ledger.snapshot())
        # The headline from the very records the rows show: never the last tick's, which a
        # transition since (a crash, an operator) has made wrong.
        status = c.status_of(shards)
        return Snapshot(
            at=time.time(), started_at=self.started_at, router_url=self.router.url,
            admin_url=self.admin.url, weights=self.ledger.policy.weights, shards=shards,
            max_restart_attempts=self.ledger.policy.max_restart_attempts,
            controller=c.describe(status), status=status,
            verdict_counts=dict(c.verdict_counts),
            reports=dict(c.reports), engines=dict(s.engines),
            in_flight=self.router.in_flight(),
            restarts_completed=s.restarts_completed, restarts_failed=s.restarts_failed,
            restarts_in_progress=len(s.attempts),
            refit_lease=refit.lease, refit_version=refit.current_version,
            refit_history=tuple(refit.history), router=RouterCounters.of(self.router.stats),
            journal_failure=self._journal.failure if self._journal is not None else None,
            journal_dropped=self._journal.dropped if self._journal is not None else 0,
            cache_predicted={u: (t.blocks, t.hit_blocks)
                             for u, t in self.router.cache_predictions().items()},
            output_caps={rec.index: c.output_cap(rec) for rec in shards},
            output_defaults={rec.index: c.output_default(rec) for rec in shards},
        )
