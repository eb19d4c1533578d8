"""One step of the running fleet, for a test that runs no controller loop."""

from __future__ import annotations

from fleetwarden.controller import Controller
from fleetwarden.reads import TickReport


async def read_and_tick(controller: Controller) -> TickReport:
    """Every engine read at once (what the read loop does over an interval, each read decided
    as it finishes), then a tick, which takes their verdicts as the running fleet's does."""
    await controller.reads.round()
    return await controller.tick()
