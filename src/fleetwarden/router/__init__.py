"""The router: the fleet's data path (SYSTEM.md section 4).

``pool`` (pure) holds the serving backends, their in-flight counts, picking and the outcome
tallies; ``forward`` sends one request through them, with retries, rescue and deliberate
statuses; ``app`` is the :class:`Router` itself; ``control`` its control API and clients;
``settings`` every default with its reason; ``metrics`` its own Prometheus registry.
"""

from fleetwarden.router.app import Router
from fleetwarden.router.control import ControlError, InProcessRouter, RemoteRouter, RouterControl
from fleetwarden.router.settings import RouterSettings

__all__ = ["ControlError", "InProcessRouter", "RemoteRouter", "Router", "RouterControl",
           "RouterSettings"]
