"""A whole fleet in one process: what ``fleetwarden up`` runs, and what tests embed.

It builds the picture of SYSTEM.md section 1 from a :class:`~fleetwarden.config.Config`: the
journal (restored when it exists), the ledger, the launchers and the supervisor, the watchdog,
the router, the refit coordinator, the controller that ticks them, and the admin API.

    async with Fleet(config) as fleet:     # engines up, router and admin listening
        print(fleet.router_url)
        await fleet.run()                  # the controller loop, until request_stop()
                                           # leaving the block stops every engine it started
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fleetwarden.admin import dashboard
from fleetwarden.admin.app import make_admin_app
from fleetwarden.auth import load_or_create_token
from fleetwarden.config import Config
from fleetwarden.controller import Controller, RouterLink, TickReport
from fleetwarden.journal import Journal
from fleetwarden.launchers import EngineHandle, EngineRecord, Launcher
from fleetwarden.launchers.attach import AttachLauncher
from fleetwarden.launchers.local import LocalLauncher
from fleetwarden.ledger import Ledger, Policy, ShardState, Transition
from fleetwarden.refit import Lease, RefitCoordinator, RefitRecord
from fleetwarden.restore import adopt_or_stop, after_clean_stop, restore_onto
from fleetwarden.router import Router
from fleetwarden.router.control import RemoteRouter
from fleetwarden.supervisor import Supervisor, launch_first
from fleetwarden.watchdog import Watchdog

__all__ = ["Fleet", "ShardLaunchers"]

log = logging.getLogger(__name__)

#: State changes kept in memory for the admin API and the dashboard's last hour.
_RECENT = 5000
#: Events a listener (a dashboard's event stream) may fall behind by before it starts over.
_LISTENER_QUEUE = 1000


class _JournalEngines:
    """Engines started and stopped, written to the journal as it happens."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

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
        self.token = ""
        self.admin_url = ""
        self.recent: list[dict[str, Any]] = []
        self._seq = 0
        self._admin: web.AppRunner | None = None
        self._stop = asyncio.Event()
        self._listeners: set[asyncio.Queue[dict[str, Any]]] = set()
        #: The router's counters over the last hour for the dashboard: a point per tick, one a
        #: second at most (an hour holds 720 points at the default 5 s tick, 3600 at most).
        self.traffic = dashboard.Traffic(step_s=min(
            dashboard.TRAFFIC_STEP_S, max(1.0, config.health.probe_interval_s)))
        self._journal: Journal | None = None
        self._router: Router | None = None
        self._watchdog: Watchdog | None = None
        self._supervisor: Supervisor | None = None
        self._controller: Controller | None = None
        self._ledger: Ledger | None = None
        self._refit: RefitCoordinator | None = None
        self._launchers: ShardLaunchers | None = None
        self.routers: list[RouterLink] = []
        self._remotes: list[RemoteRouter] = []
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_FleetCollector(self))

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
    def router(self) -> Router:
        assert self._router is not None, "the fleet is not started"
        return self._router

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

    def _policy(self) -> Policy:
        h, s, f = self.config.health, self.config.supervisor, self.config.fleet
        return Policy(unhealthy_threshold=h.unhealthy_threshold,
                      healthy_threshold=h.healthy_threshold,
                      max_restart_attempts=s.max_restart_attempts,
                      min_serving_shards=h.min_serving_shards, weights=f.weights)

    async def start(self) -> None:
        cfg = self.config
        launched = list(range(cfg.fleet.engines))
        attached = {cfg.fleet.engines + k: url for k, url in enumerate(cfg.fleet.backends)}
        size = len(launched) + len(attached)

        self.token = load_or_create_token(cfg.admin.token_file)
        self._journal = Journal(cfg.journal.path)
        restored = self._journal.restore(self._policy(), clock=time.time)
        if restored is not None and len(restored) != size:
            raise ValueError(
                f"journal {cfg.journal.path} records a fleet of {len(restored)} shards, the "
                f"config has {size}; use another journal.path for a different fleet"
            )

        launcher: Launcher
        local: LocalLauncher | None = None
        if cfg.fleet.launcher == "ray" and launched:
            from fleetwarden.launchers.ray import RayLauncher  # the optional extra

            ray_launcher = RayLauncher(cfg.fleet, cfg.supervisor, self._engine_exited)
            await ray_launcher.connect()  # a wrong address fails the start, not each shard
            launcher = ray_launcher
        else:
            local = LocalLauncher(cfg.fleet, cfg.supervisor, self._engine_exited)
            local.events = _JournalEngines(self._journal)
            launcher = local
        attach = AttachLauncher(cfg.fleet, cfg.health)
        self._launchers = ShardLaunchers(
            {i: launcher for i in launched} | {i: attach for i in attached}
        )
        clean = self._journal.get_meta("clean_shutdown") == "1"
        self._journal.set_meta("clean_shutdown", "0")  # until this run stops cleanly

        # Engines an earlier run left running: the current one of each shard is adopted, the
        # rest (a restart in progress, a condemned engine not yet stopped) are stopped. (Ray
        # engines are Ray's: their actors end with the driver that started them.)
        adopted: dict[int, EngineHandle] = {}
        if restored is not None and local is not None:
            adopted = await adopt_or_stop(self._journal, local, restored)

        # The first engines start before the ledger exists, so it is built with their URLs.
        to_launch = [i for i in launched if i not in adopted and (
            restored is None or restored.state(i) is not ShardState.RETIRED)]
        first = await launch_first(launcher, to_launch, cfg.fleet.startup_timeout_s)
        urls = []
        for i in range(size):
            if i in attached:
                urls.append(attached[i])
            elif isinstance(first.get(i), EngineHandle):
                urls.append(first[i].url)  # type: ignore[union-attr]
            else:
                urls.append(f"http://{cfg.fleet.host}:0/shard-{i}-not-started")

        if restored is not None and clean:
            ledger = after_clean_stop(restored, first, self._policy(), cfg.fleet.weights)
        elif restored is not None:
            ledger = restored
            restore_onto(ledger, first)
        else:
            ledger = Ledger(urls, self._policy(), clock=time.time)
        self._ledger = ledger
        ledger.subscribe(self._remember)
        self._journal.attach(ledger)

        self._supervisor = Supervisor(
            ledger, self._launchers, cfg.fleet, cfg.supervisor, journal=self._journal,
            on_condemned=self._condemned_now, passive=self._launchers.passive,
        )
        for i, handle in adopted.items():
            self._supervisor.adopt(i, handle)
        for i, result in first.items():
            if isinstance(result, EngineHandle):
                self._supervisor.adopt(i, result)
                if restored is None:
                    ledger.observe_incarnation(i, result.incarnation)
            else:
                log.error("shard %d: first engine did not start: %s", i, result)
                ledger.condemn(i, f"first start failed: {result}")

        self._watchdog = Watchdog(cfg.health.watchdog_policy())
        self._router = Router(ledger.serving_urls(), cfg.router.settings(), health_managed=True)
        await self._router.start(cfg.router.host, cfg.router.port)
        self.routers = [self._router.control()]
        for remote in cfg.router.remote:
            link = RemoteRouter(remote.url, load_or_create_token(remote.token_file))
            self._remotes.append(link)
            self.routers.append(link)
        self._refit = RefitCoordinator(ledger, lease_s=cfg.refit.lease_s, clock=time.time)
        self._controller = Controller(
            ledger, self._watchdog, self._supervisor, self.routers, cfg,
            journal=self._journal, refit=self._refit, on_tick=self._after_tick,
        )
        # The first answers already name their weights: the push's facts, before any tick.
        self._router.set_serving_backends(*self._controller.serving_push())
        self._admin = web.AppRunner(make_admin_app(self, self.token), access_log=None)
        await self._admin.setup()
        await web.TCPSite(self._admin, cfg.admin.host, cfg.admin.port).start()
        self.admin_url = _url_of(self._admin)

    async def run(self) -> None:
        """Run the controller loop until :meth:`request_stop`."""
        await self.controller.run(self._stop)

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def stop(self) -> None:
        """Stop serving, then stop every engine this fleet started, leaving nothing running."""
        self._stop.set()
        self.publish({"type": "bye"})  # open event streams end now, not at the server's close
        if self._admin is not None:
            await self._admin.cleanup()
            self._admin = None
        if self._controller is not None:
            await self._controller.close()
        if self._router is not None:
            await self._router.stop()
        for remote in self._remotes:
            await remote.close()
        stopped_all = False
        if self._supervisor is not None:
            stopped_all = await self._supervisor.close()
        elif self._launchers is not None:
            with contextlib.suppress(Exception):
                await self._launchers.close()
        if self._watchdog is not None:
            await self._watchdog.close()
        if self._journal is not None:
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

    def _condemned_now(self, shard: int, url: str) -> None:
        if self._controller is not None:
            self._controller.shard_condemned_now(shard, url)

    def _remember(self, t: Transition) -> None:
        if not t.changes_state:
            return
        self._seq += 1
        entry = {"seq": self._seq, "wall": t.at, **t.to_dict()}
        self.recent.append(entry)
        if len(self.recent) > _RECENT:
            del self.recent[: len(self.recent) - _RECENT]
        self.publish({"type": "transition", "data": entry})

    def _after_tick(self, report: TickReport) -> None:
        self.traffic.record(dashboard.traffic_point(
            self.router.stats, time.time(), self._failure_statuses))
        if self._listeners:  # nobody watching: nothing built
            self.publish({"type": "snapshot", "data": dashboard.snapshot(self)})

    @property
    def _failure_statuses(self) -> frozenset[int]:
        r = self.config.router
        return frozenset({r.status_when_others_serve, r.status_when_none_left})

    @property
    def seq(self) -> int:
        """The sequence number of the last state change (``recent[-1]["seq"]``)."""
        return self._seq

    def publish(self, event: dict[str, Any]) -> None:
        """Hand ``event`` (``{"type": ..., "data": ...}``) to every listener. A listener that
        fell :data:`_LISTENER_QUEUE` events behind has lost some: its queue is emptied and
        told to start over (``resync``); a ``bye`` always gets through."""
        for q in list(self._listeners):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:
                while not q.empty():
                    q.get_nowait()
                q.put_nowait({"type": "resync"})
                if event["type"] == "bye":
                    q.put_nowait(event)

    def listen(self) -> asyncio.Queue[dict[str, Any]]:
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=_LISTENER_QUEUE)
        self._listeners.add(q)
        return q

    def unlisten(self, q: asyncio.Queue[dict[str, Any]]) -> None:
        self._listeners.discard(q)

    # ------------------------------------------------------------------ refit (the trainer's API)

    def begin_refit(self, version: int) -> Lease:
        lease = self.refit.begin_refit(version)
        self.publish({"type": "refit", "data": {"phase": "begin", "version": version}})
        return lease

    def complete_refit(self, version: int) -> RefitRecord:
        record = self.refit.complete_refit(version)
        self.controller.wake()
        self.publish({"type": "refit", "data": {"phase": "complete", "version": version}})
        return record

    def abort_refit(self, version: int, reason: str) -> RefitRecord:
        record = self.refit.abort_refit(version, reason)
        self.controller.wake()
        self.publish({"type": "refit", "data": {"phase": "abort", "version": version}})
        return record

    # ------------------------------------------------------------------ chaos

    async def inject_fault(self, i: int, fault: str, options: dict[str, Any]) -> str:
        """Inject ``fault`` into shard ``i``'s engine: through a simulated engine's fault
        endpoint, or by signals to a real local vLLM engine's EngineCore process."""
        from fleetwarden.chaos import inject

        handle = self.supervisor.engines.get(i)
        url = self.ledger.shard(i).base_url
        return await inject(url, handle, fault, options)

    # ------------------------------------------------------------------ views

    def describe(self) -> dict[str, Any]:
        c = self.controller
        return {
            **c.describe(),
            "router_url": self.router.url,
            "admin_url": self.admin_url,
            "shards": len(self.ledger),
            "weights": self.config.fleet.weights,
            "uptime_s": round(time.time() - self.started_at, 1),
            "restarts": {"completed": self.supervisor.restarts_completed,
                         "failed": self.supervisor.restarts_failed,
                         "in_progress": len(self.supervisor.attempts)},
            "refit": self.refits_view()["lease"],
            "journal": {"failure": self._journal.failure if self._journal else None,
                        "dropped": self._journal.dropped if self._journal else 0},
            "router": {"requests": self.router.stats.requests,
                       "rescues": self.router.stats.rescues,
                       "retries": dict(self.router.stats.retries)},
        }

    def shards_view(self) -> list[dict[str, Any]]:
        in_flight = self.router.in_flight()
        budget = self.ledger.policy.max_restart_attempts
        out = []
        for rec in self.ledger.snapshot():
            handle = self.supervisor.engines.get(rec.index)
            report = self.controller.reports.get(rec.index)
            d = rec.to_dict()
            d.update(
                in_flight=in_flight.get(rec.base_url, 0),
                restart_budget_left=max(0, budget - rec.restart_attempts),
                incarnation_started_at=handle.launched_at if handle else None,
                pid=handle.pid if handle else None,
                log_path=str(handle.log_path) if handle and handle.log_path else None,
                watchdog=report.to_dict() if report is not None else None,
            )
            out.append(d)
        return out

    def states_view(self) -> dict[str, str]:
        return {str(r.index): r.state.value for r in self.ledger.snapshot()}

    def transitions_view(self, since: int, limit: int, shard: int | None) -> list[dict[str, Any]]:
        picked = [e for e in self.recent
                  if e["seq"] > since and (shard is None or e["shard"] == shard)]
        return picked[:limit]

    def refits_view(self) -> dict[str, Any]:
        lease = self.refit.lease
        return {
            "lease": None if lease is None else {
                "version": lease.version, "participants": sorted(lease.shards),
                "started_at": lease.started_at, "deadline": lease.deadline},
            "current_version": self.refit.current_version,
            "history": [
                {"version": r.version, "outcome": r.outcome, "started_at": r.started_at,
                 "ended_at": r.ended_at, "participants": list(r.participants),
                 "detail": r.detail, "condemned": list(r.condemned)}
                for r in self.refit.history[-100:]
            ],
        }

    def metrics_text(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _FleetCollector:
    """Fleet gauges, read at scrape time (nothing to keep in sync)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        fleet = self.fleet
        if fleet._ledger is None or fleet._controller is None or fleet._supervisor is None:
            return []
        shards = GaugeMetricFamily("fleetwarden_shards", "Shards by state.", labels=["state"])
        for state, n in fleet.ledger.counts_by_state().items():
            shards.add_metric([state.value], n)
        restarts = CounterMetricFamily("fleetwarden_restarts", "Restarts by outcome.",
                                       labels=["outcome"])
        restarts.add_metric(["completed"], fleet.supervisor.restarts_completed)
        restarts.add_metric(["failed"], fleet.supervisor.restarts_failed)
        verdicts = CounterMetricFamily("fleetwarden_verdicts", "Watchdog verdicts.",
                                       labels=["verdict"])
        for verdict, n in sorted(fleet.controller.verdict_counts.items()):
            verdicts.add_metric([verdict], n)
        status = GaugeMetricFamily("fleetwarden_fleet_status",
                                   "1 for the fleet's current status.", labels=["status"])
        for name in ("serving", "degraded", "asleep", "down", "exhausted"):
            status.add_metric([name], 1.0 if fleet.controller.status.state == name else 0.0)
        attempts = GaugeMetricFamily("fleetwarden_restart_attempts",
                                     "Restarts spent per shard (of the budget).",
                                     labels=["shard"])
        for rec in fleet.ledger.snapshot():
            attempts.add_metric([str(rec.index)], rec.restart_attempts)
        journal = fleet.journal
        dropped = CounterMetricFamily(
            "fleetwarden_journal_dropped",
            "Journal records (transitions, verdicts, restarts) lost because its writes fail; "
            "anything above 0 means restart budgets and history are not being kept.")
        dropped.add_metric([], journal.dropped if journal is not None else 0)
        return [shards, restarts, verdicts, status, attempts, dropped]


def _url_of(runner: web.AppRunner) -> str:
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            host, port = server.sockets[0].getsockname()[:2]
            return f"http://{host}:{port}"
    raise RuntimeError("the admin server is not listening")


async def admin_call(admin_url: str, token: str, method: str, path: str,
                     body: dict[str, Any] | None = None, timeout_s: float = 30.0) -> Any:
    """One call to a fleet's admin API (the CLI's and FleetClient's transport)."""
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        headers={"Authorization": f"Bearer {token}"},
    ) as session, session.request(method, admin_url + path, json=body) as resp:
        data = await resp.json(content_type=None)
        if resp.status >= 400:
            message = data.get("error", {}).get("message") if isinstance(data, dict) else data
            raise RuntimeError(f"{method} {path}: {resp.status}: {message}")
        return data
