"""The admin API's server: started over a fleet's surface, with the admin side's own state.

Owns: :class:`AdminServer`: an :class:`~fleetwarden.admin.state.AdminState` that serves the
admin API and the dashboard (``app.py``), and what the admin side does after each controller
tick (the traffic point, the pages' snapshot).

Must not: import ``fleet.py``, or reach into a fleet's parts: it asks through
:class:`~fleetwarden.admin.surface.FleetSurface`. ``fleet.py`` builds one, registers the
fleet's collectors in its registry, subscribes its event bus to the ledger, tells it of each
tick, and starts and stops it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from fleetwarden.admin import dashboard
from fleetwarden.admin.app import make_admin_app
from fleetwarden.admin.state import AdminState
from fleetwarden.admin.surface import FleetSurface
from fleetwarden.router.app import runner_url

if TYPE_CHECKING:
    from fleetwarden.router.stats import RouterStats

__all__ = ["AdminServer"]


class AdminServer(AdminState):
    """The admin API and the dashboard of one fleet, on their own port."""

    def __init__(self, *, host: str, port: int, token_file: Path, tick_s: float,
                 failure_statuses: frozenset[int]) -> None:
        super().__init__(token_file=token_file, tick_s=tick_s,
                         failure_statuses=failure_statuses)
        self.host, self.port = host, port
        self._runner: web.AppRunner | None = None

    async def start(self, fleet: FleetSurface) -> None:
        """Serve the admin API and the dashboard over ``fleet`` (the token loaded before)."""
        self._runner = web.AppRunner(make_admin_app(fleet, self), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.url = runner_url(self._runner)

    async def stop(self) -> None:
        """End the open event streams now (a ``bye``), not at the server's close; then the
        server."""
        self.events.publish({"type": "bye"})
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def after_tick(self, fleet: FleetSurface, stats: RouterStats) -> None:
        """A controller tick ended: the router's counters join the traffic series, and the
        pages that listen get the fleet as it is now (nobody listening: nothing built)."""
        self.record_traffic(stats)
        if self.events.listeners:
            self.events.publish({"type": "snapshot", "data": dashboard.snapshot(fleet, self)})
