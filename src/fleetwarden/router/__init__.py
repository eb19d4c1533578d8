"""The router: the fleet's data path (docs/design.md section 4).

Owns: the router package's lazy names.
Must not: import aiohttp for a reader of ``settings`` alone.

``pool`` (pure) holds the serving backends, their in-flight counts, picking and the outcome
tallies; ``forward`` sends one request through them, with retries, rescue and deliberate
statuses; ``app`` is the :class:`Router` itself; ``ops`` the table of its control operations;
``control`` its control API, and ``links`` the controller's links to a router, here or across
that API, both built from that table;
``settings`` every default with its reason; ``stats`` its own Prometheus registry.

The names below are imported on first use, so that ``fleetwarden.router.settings`` (pure) can
be read without loading aiohttp.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetwarden.router.app import Router
    from fleetwarden.router.links import (
        ControlError,
        InProcessRouter,
        RemoteRouter,
        RouterLink,
    )
    from fleetwarden.router.pool import BackendFacts
    from fleetwarden.router.settings import RouterSettings

__all__ = ["BackendFacts", "ControlError", "InProcessRouter", "RemoteRouter", "Router",
           "RouterLink", "RouterSettings"]

_HOMES = {
    "BackendFacts": "fleetwarden.router.pool",
    "Router": "fleetwarden.router.app",
    "ControlError": "fleetwarden.router.links",
    "InProcessRouter": "fleetwarden.router.links",
    "RemoteRouter": "fleetwarden.router.links",
    "RouterLink": "fleetwarden.router.links",
    "RouterSettings": "fleetwarden.router.settings",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'fleetwarden.router' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
