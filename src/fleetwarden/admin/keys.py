"""What every admin route shares: the application's keys and how a request shows its token.

Owns: the ``web.AppKey`` names (the fleet's surface, the admin side's state, the token, the
public paths) and
:func:`presented_token`. Both ``app.py`` and ``dashboard.py`` import this module and neither
imports the other's internals through it (no import circle).

Must not: decide who is let in (``app.py``'s middleware does) or hold the token itself.
"""

from __future__ import annotations

from aiohttp import web

from fleetwarden.admin.state import AdminState
from fleetwarden.admin.surface import FleetSurface

__all__ = ["ADMIN", "FLEET", "PUBLIC", "TOKEN", "bearer", "presented_token"]

FLEET: web.AppKey[FleetSurface] = web.AppKey("fleet")
#: The admin side's own state: its events, the traffic series, the metrics registry.
ADMIN: web.AppKey[AdminState] = web.AppKey("admin")
TOKEN: web.AppKey[str] = web.AppKey("token")
#: Paths served without the token: the dashboard's sign-in and its static files only.
PUBLIC: web.AppKey[frozenset[str]] = web.AppKey("public")


def bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    return auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else None


def presented_token(request: web.Request) -> str | None:
    """The bearer token, else the dashboard's cookie. A ``?token=`` query is no credential
    here: it belongs to the sign-in link (``GET /?token=``) alone, which trades it for the
    cookie and takes it out of the address bar."""
    token = bearer(request)
    if token is not None:
        return token
    return request.cookies.get("fleetwarden_token") or None
