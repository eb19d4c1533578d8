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
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

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
from fleetwarden.ledger import Ledger, Outcome, ShardState, Transition
from fleetwarden.loads import CheckpointLoads
from fleetwarden.refit import Lease, RefitCoordinator, RefitRecord
from fleetwarden.restore import adopt_or_stop, begin_run, read_attached
from fleetwarden.router import Router
from fleetwarden.router.links import RemoteRouter, RouterLink
from fleetwarden.router.pool import BackendFacts
from fleetwarden.sleep import SleepResult, put_to_sleep
from fleetwarden.sleep import wake as wake_shards
from fleetwarden.snapshot import Acted, RouterCounters, Snapshot
from fleetwarden.supervisor import Supervisor, launch_first
from fleetwarden.watchdog import Target, Watchdog
from fleetwarden.weight_sync import (
    RefitLoad,
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
        #: The checkpoint loads fleetwarden runs itself, and a replacement's catch-up.
        self.loads = CheckpointLoads(self)
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
        launcher, local, self._launchers = await _start_launchers(
            cfg, journal, launched, attached, self._engine_exited, self.engine_keys.fleet)
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
        self._supervisor = supervisor = _start_supervisor(
            cfg, ledger, journal, self._launchers, adopted, first, fresh=restored is None)
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
        await self.loads.close()
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
        self.loads.catch_up_soon()  # one that came back during a load waits for it to end

    def _on_transition(self, t: Transition) -> None:
        if t.event in COMEBACKS and t.to_state is ShardState.STALE:
            # At its return, not at the next tick (up to probe_interval_s later, 5 s by
            # default): a replacement's capacity waits for nothing but its load.
            self.loads.catch_up_soon()

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
        results = await put_to_sleep(self.ledger, self.controller.pushes, level=level,
                                     shards=shards)
        self.controller.wake()
        self.admin.announce("sleep", phase="sleep", level=level)
        return results

    async def wake(self, shards: list[int] | None) -> list[SleepResult]:
        results = await wake_shards(self.ledger, self.controller.pushes, shards=shards)
        self.controller.wake()
        self.admin.announce("sleep", phase="wake")
        return results

    async def begin_refit(self, version: int) -> Lease:
        return await self.loads.begin_refit(version)

    async def complete_refit(self, version: int, checksums: Mapping[str, str] | None = None,
                             *, failed: Mapping[int, str] | None = None) -> RefitRecord:
        return await self.loads.complete_refit(version, checksums, failed=failed)

    def abort_refit(self, version: int, reason: str) -> RefitRecord:
        return self.loads.abort_refit(version, reason)

    async def refit_from(self, path: str, version: int, *, pause_mode: str | None = None,
                         checksums: Mapping[str, str] | None = None) -> RefitLoad:
        """Load the checkpoint at ``path`` into every participant as ``version``
        (:meth:`CheckpointLoads.refit_from <fleetwarden.loads.CheckpointLoads.refit_from>`)."""
        return await self.loads.refit_from(path, version, pause_mode=pause_mode,
                                           checksums=checksums)

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
            output_caps={rec.index: c.pushes.output_cap(rec) for rec in shards},
            output_defaults={rec.index: c.pushes.output_default(rec) for rec in shards},
        )


async def _start_launchers(cfg: Config, journal: Journal, launched: list[int],
                           attached: dict[int, str], on_exit: Callable[[EngineHandle], None],
                           key: Secret | None,
                           ) -> tuple[Launcher, LocalLauncher | None, ShardLaunchers]:
    """The launcher of the launched shards (and the local one, when it is local), and
    every shard's launcher (attached shards: the attach launcher). ``on_exit``: told of an
    engine that exits; ``key``: the fleet's engine key, for the attach launcher's reads."""
    launcher: Launcher
    local: LocalLauncher | None = None
    if cfg.fleet.launcher == "ray" and launched:
        from fleetwarden.launchers.ray import RayLauncher  # the optional extra

        ray_launcher = RayLauncher(cfg.fleet, cfg.supervisor, on_exit)
        await ray_launcher.connect()  # a wrong address fails the start, not each shard
        launcher = ray_launcher
    else:
        local = LocalLauncher(cfg.fleet, cfg.supervisor, on_exit)
        local.events = _JournalEngines(journal)
        launcher = local
    attach = AttachLauncher(cfg.fleet, cfg.health, key=key)
    shards = ShardLaunchers({i: launcher for i in launched} | {i: attach for i in attached})
    return launcher, local, shards


def _start_supervisor(cfg: Config, ledger: Ledger, journal: Journal, launchers: ShardLaunchers,
                      adopted: dict[int, EngineHandle],
                      first: dict[int, EngineHandle | BaseException], *,
                      fresh: bool) -> Supervisor:
    """The supervisor, with every engine running adopted; a first engine that did not
    start is condemned (the supervisor restarts it within budget)."""
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
