"""One read of a running fleet, and what an operator's action answers.

Owns: :class:`Snapshot` (a copy of everything the views show, taken at one moment by
``Fleet.snapshot()``), :class:`RouterCounters` (the router's counters in it) and
:class:`Acted` (what a retire or a restart did).

Must not: hold live state or act: these are plain values. The views in ``admin/views.py``
turn a snapshot into JSON and Prometheus families; the operations are in
``admin/surface.py`` (what the admin side may ask) and ``fleet.py`` (which does it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetwarden.ledger import ShardRecord, ShardState
from fleetwarden.refit import Lease, RefitRecord

if TYPE_CHECKING:
    from fleetwarden.controller import FleetStatus
    from fleetwarden.launchers import EngineHandle
    from fleetwarden.router.stats import RouterStats
    from fleetwarden.watchdog import Report

__all__ = ["Acted", "RouterCounters", "Snapshot"]


@dataclass(frozen=True, slots=True)
class RouterCounters:
    """The in-process router's cumulative counters at one moment (copies, not the live dicts)."""

    requests: int = 0
    rescues: int = 0
    hedges: int = 0
    hedges_won: int = 0
    #: Requests that found no engine while one was coming back, and those then served.
    comeback_waits: int = 0
    comeback_served: int = 0
    retries: Mapping[str, int] = field(default_factory=dict)
    responses: Mapping[int, int] = field(default_factory=dict)
    backend_failures: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: Per client key (keys on the data port): (requests, prompt tokens, completion tokens).
    keys: Mapping[str, tuple[int, int, int]] = field(default_factory=dict)
    #: Requests refused a 401 for their key, by why (missing, wrong, ambiguous).
    key_refusals: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, stats: RouterStats) -> RouterCounters:
        return cls(requests=stats.requests, rescues=stats.rescues, hedges=stats.hedges,
                   hedges_won=stats.hedges_won, comeback_waits=stats.comeback_waits,
                   comeback_served=stats.comeback_served, retries=dict(stats.retries),
                   responses=dict(stats.responses),
                   backend_failures=dict(stats.backend_failures),
                   keys={name: (t.requests, t.prompt_tokens, t.completion_tokens)
                         for name, t in stats.keys.items()},
                   key_refusals=dict(stats.key_refusals))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the views show, read from the parts at one moment."""

    at: float
    started_at: float
    router_url: str
    admin_url: str
    weights: str
    shards: tuple[ShardRecord, ...]
    max_restart_attempts: int
    #: ``Controller.describe()``: status, detail, counts, tick.
    controller: dict[str, Any]
    status: FleetStatus
    verdict_counts: dict[str, int]
    reports: dict[int, Report]
    engines: dict[int, EngineHandle]
    in_flight: dict[str, int]
    restarts_completed: int
    restarts_failed: int
    restarts_in_progress: int
    refit_lease: Lease | None
    refit_version: int
    refit_history: tuple[RefitRecord, ...]
    router: RouterCounters
    #: Why the journal stopped writing (``None`` while it writes), and what it lost since.
    journal_failure: str | None = None
    journal_dropped: int = 0
    #: The cache-aware router's tallies per backend URL: (prompt blocks placed, blocks
    #: predicted held); empty under least in flight.
    cache_predicted: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    #: Each shard's server cap on a request's output and where it comes from
    #: (``Pushes.output_cap``: ``engine``, ``declared``, ``command``, ``unknown: why``).
    output_caps: Mapping[int, tuple[int | None, str]] = field(default_factory=dict)
    #: Each shard's default limit of a chat that names none, and why it is not known
    #: (``Pushes.output_default``; ``None``: known).
    output_defaults: Mapping[int, tuple[int | None, str | None]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Acted:
    """What an operator's action did: applied or not (and why not), and the shard's state."""

    shard: int
    applied: bool
    reason: str
    state: ShardState
