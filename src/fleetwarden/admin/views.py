"""What the admin API, the dashboard and the CLI show of a fleet, built from one snapshot.

Owns: the JSON views (:func:`status_view`, :func:`shards_view`, :func:`states_view`,
:func:`refits_view`), the fleet's Prometheus families (:class:`FleetCollector`), and the
router's traffic over the last hour (:class:`Traffic`, from which the page draws its rates).

Must not: act on the fleet, or read its parts: every view takes a
:class:`~fleetwarden.snapshot.Snapshot` (``fleet.snapshot()``), so a view shows one moment.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from fleetwarden.ledger import ShardState
from fleetwarden.snapshot import RouterCounters, Snapshot

if TYPE_CHECKING:
    from fleetwarden.router.stats import RouterStats

__all__ = ["TRAFFIC_STEP_S", "WINDOW_S", "FleetCollector", "Traffic", "TrafficPoint",
           "refits_view", "shards_view", "states_view", "status_view", "traffic_point"]

#: What the page shows of the past: transitions and traffic of the last hour.
WINDOW_S = 3600.0
#: Traffic points are kept at most this far apart when ticks come faster (a fleet's own step
#: follows its tick: see ``AdminState.traffic``).
TRAFFIC_STEP_S = 5.0


# ---------------------------------------------------------------------- JSON views

def status_view(snap: Snapshot) -> dict[str, Any]:
    """``GET /admin/status``: the fleet's status, counts, URLs, restarts, refit and router."""
    return {
        **snap.controller,
        "router_url": snap.router_url,
        "admin_url": snap.admin_url,
        "shards": len(snap.shards),
        "weights": snap.weights,
        "uptime_s": round(snap.at - snap.started_at, 1),
        "restarts": {"completed": snap.restarts_completed,
                     "failed": snap.restarts_failed,
                     "in_progress": snap.restarts_in_progress},
        "refit": refits_view(snap)["lease"],
        "journal": {"failure": snap.journal_failure, "dropped": snap.journal_dropped},
        # Shards whose answers show a fault of fleetwarden's own configuration (shards_view).
        "config_faults": sum(1 for rec in snap.shards
                             if (r := snap.reports.get(rec.index)) is not None and r.faults
                             and r.url == rec.base_url),
        # Shards whose server cap on a request's output is unknown (shards_view, output_cap):
        # a stream cut there goes on only as far as its floor proves (docs/design.md 4.1).
        "output_caps_unknown": sum(1 for _, source in snap.output_caps.values()
                                   if source.startswith("unknown")),
        # And those whose default limit of a chat that names none is (shards_view,
        # output_default): such a chat cut there goes on only as far as its floor proves.
        "output_defaults_unknown": sum(1 for _, why in snap.output_defaults.values()
                                       if why is not None),
        "router": {"requests": snap.router.requests,
                   "rescues": snap.router.rescues,
                   "hedges": snap.router.hedges,
                   "hedges_won": snap.router.hedges_won,
                   "comeback_waits": snap.router.comeback_waits,
                   "comeback_served": snap.router.comeback_served,
                   "retries": dict(snap.router.retries),
                   # The data port's client keys, when the router checks them.
                   "keys": [{"name": name, "requests": r, "prompt_tokens": p,
                             "completion_tokens": c}
                            for name, (r, p, c) in sorted(snap.router.keys.items())],
                   "key_refusals": dict(snap.router.key_refusals)},
    }


def shards_view(snap: Snapshot) -> list[dict[str, Any]]:
    """``GET /admin/shards``: every shard's record, its in-flight count and last report."""
    budget = snap.max_restart_attempts
    out = []
    for rec in snap.shards:
        handle = snap.engines.get(rec.index)
        report = snap.reports.get(rec.index)
        d = rec.to_dict()
        blocks, hit_blocks = snap.cache_predicted.get(rec.base_url, (0, 0))
        d.update(
            in_flight=snap.in_flight.get(rec.base_url, 0),
            # The router's predicted prefix-cache hit rate here, beside the engine's own in
            # the watchdog report (None: nothing placed by the cache-aware policy).
            cache_predicted_hit_rate=hit_blocks / blocks if blocks else None,
            restart_budget_left=max(0, budget - rec.restart_attempts),
            incarnation_started_at=handle.launched_at if handle else None,
            pid=handle.pid if handle else None,
            log_path=str(handle.log_path) if handle and handle.log_path else None,
            watchdog=report.to_dict() if report is not None else None,
            # Faults of fleetwarden's own configuration its answers show (a key it wants, a
            # model name it does not serve): never held against the engine, so shown here,
            # where no state would show them (docs/design.md section 5, "Asked wrong").
            config_faults=(list(report.faults) if report is not None
                           and report.url == rec.base_url else []),
        )
        cap, source = snap.output_caps.get(rec.index, (None, "unknown: not read"))
        # Its server cap on a request's output, and where it was learnt; "unknown: why" for
        # an attached engine that says nothing and has no declared output_cap.
        d.update(output_cap=cap, output_cap_from=source)
        # Its default limit of a chat that names none, and why that is unknown (None: known):
        # an attached engine whose model folder is not on this host, none declared.
        default, why = snap.output_defaults.get(rec.index, (None, "not read"))
        d.update(output_default=default, output_default_unknown=why)
        out.append(d)
    return out


def states_view(snap: Snapshot) -> dict[str, str]:
    return {str(r.index): r.state.value for r in snap.shards}


def refits_view(snap: Snapshot) -> dict[str, Any]:
    """``GET /admin/refits``: the open lease, the fleet's weight version, the last 100 refits."""
    lease = snap.refit_lease
    return {
        "lease": None if lease is None else {
            "version": lease.version, "participants": sorted(lease.shards),
            "started_at": lease.started_at, "deadline": lease.deadline,
            # per participant: process alive, API answers, since when, the evidence
            "status": [s.to_dict() for _, s in sorted(lease.status.items())],
            "culprits": [s.shard for s in lease.culprits()]},
        "current_version": snap.refit_version,
        "history": [
            {"version": r.version, "outcome": r.outcome, "started_at": r.started_at,
             "ended_at": r.ended_at, "participants": list(r.participants),
             "detail": r.detail, "condemned": list(r.condemned),
             "confirmed": list(r.confirmed),
             "unconfirmed": {str(i): why for i, why in r.unconfirmed}}
            for r in snap.refit_history[-100:]
        ],
    }


# ---------------------------------------------------------------------- Prometheus

class FleetCollector:
    """Fleet gauges, read at scrape time from a snapshot (nothing to keep in sync)."""

    def __init__(self, snapshot: Callable[[], Snapshot | None]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        snap = self._snapshot()
        if snap is None:  # not started yet
            return []
        shards = GaugeMetricFamily("fleetwarden_shards", "Shards by state.", labels=["state"])
        counts = dict.fromkeys(ShardState, 0)
        for rec in snap.shards:
            counts[rec.state] += 1
        for state, n in counts.items():
            shards.add_metric([state.value], n)
        restarts = CounterMetricFamily("fleetwarden_restarts", "Restarts by outcome.",
                                       labels=["outcome"])
        restarts.add_metric(["completed"], snap.restarts_completed)
        restarts.add_metric(["failed"], snap.restarts_failed)
        verdicts = CounterMetricFamily("fleetwarden_verdicts", "Watchdog verdicts.",
                                       labels=["verdict"])
        for verdict, n in sorted(snap.verdict_counts.items()):
            verdicts.add_metric([verdict], n)
        status = GaugeMetricFamily("fleetwarden_fleet_status",
                                   "1 for the fleet's current status.", labels=["status"])
        for name in ("serving", "degraded", "asleep", "down", "exhausted"):
            status.add_metric([name], 1.0 if snap.status.state == name else 0.0)
        attempts = GaugeMetricFamily("fleetwarden_restart_attempts",
                                     "Restarts spent per shard (of the budget).",
                                     labels=["shard"])
        for rec in snap.shards:
            attempts.add_metric([str(rec.index)], rec.restart_attempts)
        dropped = CounterMetricFamily(
            "fleetwarden_journal_dropped",
            "Journal records (transitions, verdicts, restarts) lost because its writes fail; "
            "above 0, restart budgets and history are not being kept.")
        dropped.add_metric([], snap.journal_dropped)
        return [shards, restarts, verdicts, status, attempts, dropped]


# ---------------------------------------------------------------------- the router's traffic

@dataclass(frozen=True, slots=True)
class TrafficPoint:
    """The router's cumulative counters at one moment; rates are differences of two points."""

    at: float  # wall-clock seconds
    requests: int
    #: Answers that say the fleet could not serve: 5xx, and the router's deliberate statuses.
    errors: int
    #: Attempts that failed on an engine (most were retried: the client saw no error).
    backend_failures: int
    retries: int
    rescues: int
    #: Requests sent to a second engine while the first held them taking no step.
    hedges: int = 0


def traffic_point(stats: RouterStats | RouterCounters, at: float,
                  failure_statuses: frozenset[int]) -> TrafficPoint:
    errors = sum(n for status, n in stats.responses.items()
                 if status >= 500 or status in failure_statuses)
    return TrafficPoint(at=at, requests=stats.requests, errors=errors,
                        backend_failures=sum(stats.backend_failures.values()),
                        retries=sum(stats.retries.values()), rescues=stats.rescues,
                        hedges=stats.hedges)


class Traffic:
    """The router's counters over the last ``window_s``, one point per ``step_s`` at most.

    Counters, not rates, are kept: the page draws a rate from two consecutive points, and a
    point dropped by thinning loses no request (the next one still counts it).
    """

    def __init__(self, step_s: float = TRAFFIC_STEP_S, window_s: float = WINDOW_S) -> None:
        self.step_s = step_s
        self.window_s = window_s
        self._points: deque[TrafficPoint] = deque()

    def record(self, point: TrafficPoint) -> bool:
        """Keep ``point`` if the last kept one is ``step_s`` old; True when it was kept."""
        if self._points and point.at - self._points[-1].at < self.step_s:
            return False
        self._points.append(point)
        # One point older than the window stays: the first rate inside it needs a start.
        while len(self._points) > 2 and self._points[1].at < point.at - self.window_s:
            self._points.popleft()
        return True

    @property
    def latest(self) -> TrafficPoint | None:
        return self._points[-1] if self._points else None

    def points(self) -> list[dict[str, Any]]:
        return [asdict(p) for p in self._points]
