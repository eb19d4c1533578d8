"""The admin side's own state: what only the admin API and the dashboard use.

Owns: :class:`AdminState`: the admin token and the URL the API listens on, the event bus
(``events.py``: recent state changes and the dashboard's listeners), the router's traffic over
the last hour for the page (``views.Traffic``), and the Prometheus registry ``/metrics``
answers from. Nothing outside the admin side reads them to decide anything.

Must not: import ``fleet.py`` or the routes (``app.py`` and ``dashboard.py`` read this state;
``server.py`` serves it), or reach into a fleet's parts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fleetwarden.admin.events import EventBus
from fleetwarden.admin.views import TRAFFIC_STEP_S, Traffic, traffic_point
from fleetwarden.auth import load_or_create_token

if TYPE_CHECKING:
    from fleetwarden.router.stats import RouterStats

__all__ = ["AdminState"]


class AdminState:
    """The token, the URL, the events, the traffic and the metrics registry of one fleet's
    admin side."""

    def __init__(self, *, token_file: Path, tick_s: float,
                 failure_statuses: frozenset[int]) -> None:
        self.token_file = token_file
        #: The bearer token (read or created by :meth:`load_token`).
        self.token = ""
        #: Where the admin API listens, once it does.
        self.url = ""
        #: State changes and the dashboard's listeners.
        self.events = EventBus()
        #: The router's counters over the last hour for the dashboard: a point per tick, one a
        #: second at most (an hour holds 720 points at the default 5 s tick, 3600 at most).
        self.traffic = Traffic(step_s=min(TRAFFIC_STEP_S, max(1.0, tick_s)))
        #: What ``/metrics`` answers: the fleet registers its collectors here.
        self.registry = CollectorRegistry(auto_describe=True)
        #: The statuses that say the fleet could not serve (the router's deliberate answers).
        self.failure_statuses = failure_statuses

    def load_token(self) -> str:
        """The token from ``token_file``, created (0600) with a random one when missing."""
        self.token = load_or_create_token(self.token_file)
        return self.token

    def announce(self, kind: str, **data: Any) -> None:
        """An act the pages show as it happens (a refit's phase, a sleep or a wake)."""
        self.events.publish({"type": kind, "data": data})

    def record_traffic(self, stats: RouterStats) -> None:
        """The router's counters now, as a point of the traffic series."""
        self.traffic.record(traffic_point(stats, time.time(), self.failure_statuses))

    def metrics_text(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
