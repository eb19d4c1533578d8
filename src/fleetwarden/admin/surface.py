"""The fleet's surface: what the admin API, the dashboard, the demo and the CLI may ask of a
running fleet.

Owns: :class:`FleetSurface`, the narrow typed set of operations (retire, restart, refits,
outcomes, a fault, a snapshot, a push) that ``fleet.Fleet`` implements. What only the admin
side keeps (its token, events, traffic and metrics registry) is no part of it: that is the
admin side's own state (``state.py``).

Must not: import ``fleet.py``. The admin side depends on this protocol, never on the class
that implements it: that is what keeps fleet.py -> admin/ a one-way street (no import circle),
and what keeps callers from reaching into ``fleet.ledger``, ``fleet.controller`` or
``fleet.router``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from fleetwarden.refit import Lease, RefitRecord
from fleetwarden.router.pool import BackendFacts
from fleetwarden.sleep import SleepResult
from fleetwarden.snapshot import Acted, Snapshot
from fleetwarden.weight_sync import RefitLoad

__all__ = ["FleetSurface"]


class FleetSurface(Protocol):
    """The operations of a running fleet (``fleet.Fleet`` implements them)."""

    started_at: float

    @property
    def router_url(self) -> str: ...

    @property
    def size(self) -> int:
        """How many shards the fleet has (indices 0 .. size - 1)."""
        ...

    @property
    def stopping(self) -> bool: ...

    def snapshot(self) -> Snapshot: ...

    def run_summary(self) -> dict[str, Any]:
        """What the run measured of its own work so far (``workmeter.py``), under ``work``."""
        ...

    def serving(self) -> tuple[list[str], dict[str, BackendFacts]]:
        """The serving set as the controller pushes it: URLs and each backend's facts."""
        ...

    def retire(self, i: int, reason: str) -> Acted: ...

    async def restart(self, i: int, reason: str) -> Acted: ...

    def apply_outcomes(self, outcomes: Mapping[str, tuple[int, int, int]]) -> None: ...

    async def begin_refit(self, version: int) -> Lease: ...

    async def complete_refit(self, version: int, checksums: Mapping[str, str] | None = None
                             ) -> RefitRecord:
        """Credit ``version`` to the participants that lived through the lease and whose
        engine, where it can say, confirms it (and the trainer's ``checksums``, if given)."""
        ...

    async def refit_from(self, path: str, version: int, *, pause_mode: str | None = None,
                         checksums: Mapping[str, str] | None = None) -> RefitLoad:
        """A whole sync run by fleetwarden: out of routing, each engine paused, reloaded from
        ``path``, stamped ``version`` and resumed, then credited where it confirms."""
        ...

    def abort_refit(self, version: int, reason: str) -> RefitRecord: ...

    async def sleep(self, level: int, shards: list[int] | None) -> list[SleepResult]:
        """The trainer's sleep bracket: out of routing, then each engine's ``/sleep``."""
        ...

    async def wake(self, shards: list[int] | None) -> list[SleepResult]:
        """Each sleeping engine's ``/wake_up``; back in routing once it says it is awake."""
        ...

    async def push(self) -> None:
        """Push the serving set to every router now (after a refit, before the next tick)."""
        ...

    async def inject_fault(self, i: int, fault: str, options: dict[str, Any]) -> str: ...
