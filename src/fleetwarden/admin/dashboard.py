"""The live dashboard on the admin port: one page, its sign-in, and its event stream.

Owns: the page, its sign-in and cookie, its static files, and the event stream the page listens
to.
Must not: act on the fleet, or read its parts: it renders ``fleet.snapshot()`` through
``views.py``, and the admin side's own state (``state.py``: its events and traffic).

    GET  /               the page, with a valid token (cookie or bearer); else the sign-in form
    GET  /?token=T       the link ``fleetwarden up`` prints: sets the cookie and redirects to /,
                         so the token leaves the address bar (and the browser's history entry)
    POST /login          form field ``token``: sets the cookie and redirects to /
    POST /logout         clears the cookie
    GET  /static/NAME    the page's script, style and icon: no data, served without a token
    GET  /admin/events   server-sent events, behind the token like every /admin route

The event stream opens with ``retry:`` (EventSource reconnects by itself after that many
milliseconds) and a ``hello`` event holding everything the page shows: status, shards, the
last hour of transitions, the router's traffic, the refit history. Then, as they happen:
``snapshot`` after every controller tick (the same view, without the history), ``transition``
for every state change (with the shard's new record), ``refit`` for a trainer's begin, complete
or abort, and ``bye`` when the fleet stops. A ``: keepalive`` comment goes out when nothing else
did for a while, so a page that left is noticed. Nothing is polled: the page learns what the
controller learns, when it learns it.

Rules: no build step, no CDN, no library (the machines that run fleetwarden may have no
internet): plain JavaScript and SVG in ``static/``. The cookie is HttpOnly and SameSite=Strict.
The token never reaches a log: the admin server has no access log, and nothing here logs a
request's URL or form.
"""

from __future__ import annotations

import asyncio
import html
import json
import math
import time
from dataclasses import asdict
from importlib import resources
from typing import Any

from aiohttp import web

from fleetwarden.admin import views
from fleetwarden.admin.keys import ADMIN, FLEET, TOKEN, presented_token
from fleetwarden.admin.state import AdminState
from fleetwarden.admin.surface import FleetSurface
from fleetwarden.admin.views import WINDOW_S
from fleetwarden.auth import token_matches

__all__ = ["COOKIE", "PUBLIC_PATHS", "WINDOW_S", "add_routes", "hello", "snapshot"]

COOKIE = "fleetwarden_token"
#: EventSource waits this long before it reconnects (the stream's ``retry:`` hint).
RETRY_MS = 2000
#: A comment line goes out after this long without an event, so a page that left is noticed.
KEEPALIVE_S = 15.0

_STATIC = {  # name -> content type; nothing else is served from static/
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
PUBLIC_PATHS: frozenset[str] = frozenset(
    {"/", "/login", "/logout", *(f"/static/{name}" for name in _STATIC)})

#: The page's own files only: no inline script or style, no other origin, no framing.
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
_PAGE_HEADERS = {
    "Content-Security-Policy": _CSP,
    # same-origin, not no-referrer: with no-referrer a form post says "Origin: null"
    "Referrer-Policy": "same-origin",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


# ---------------------------------------------------------------------- what the page shows

def snapshot(fleet: FleetSurface, admin: AdminState) -> dict[str, Any]:
    """The fleet as the page shows it now (published after every controller tick)."""
    latest = admin.traffic.latest
    snap = fleet.snapshot()
    return {
        "at": time.time(),
        "fleet": views.status_view(snap),
        "shards": views.shards_view(snap),
        "max_restart_attempts": snap.max_restart_attempts,
        "refits": views.refits_view(snap),
        "traffic": None if latest is None else asdict(latest),
        # the fleet's own work: what the header shows of the tick, the reads and the pushes
        "work": fleet.run_summary()["work"],
        "seq": admin.events.seq,
    }


def hello(fleet: FleetSurface, admin: AdminState) -> dict[str, Any]:
    """A snapshot and the history the page draws: what a page (re)connecting starts from."""
    view = snapshot(fleet, admin)
    since = view["at"] - WINDOW_S
    view.update(
        window_s=WINDOW_S,
        started_at=fleet.started_at,
        traffic=admin.traffic.points(),
        transitions=[{k: e[k] for k in ("seq", "shard", "from", "to", "event", "cause", "at")}
                     for e in admin.events.recent if e["at"] >= since],
    )
    return view


# ---------------------------------------------------------------------- routes

def _signed_in(request: web.Request) -> bool:
    return token_matches(request.app[TOKEN], presented_token(request))


def _same_origin(request: web.Request) -> bool:
    """A form posted from another site is refused (the cookie is SameSite=Strict as well)."""
    origin = request.headers.get("Origin")
    return origin is None or origin == f"{request.scheme}://{request.host}"


def _set_cookie(request: web.Request, resp: web.StreamResponse, token: str) -> None:
    # A session cookie: it ends with the browser. Secure only where the page is served over
    # TLS (the admin port is plain HTTP on 127.0.0.1 by default).
    resp.set_cookie(COOKIE, token, httponly=True, samesite="Strict", path="/",
                    secure=request.secure)


_SIGN_IN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>fleetwarden: sign in</title>
<link rel="icon" href="/static/favicon.svg"><link rel="stylesheet" href="/static/dashboard.css">
</head><body class="signin">
<form method="post" action="/login" id="signin">
<h1>fleetwarden</h1>
<p>The admin token is in the fleet's token file (<code>admin.token_file</code>, by default
<code>fleetwarden-admin.token</code>); <code>fleetwarden up</code> prints a link with it.</p>
<label for="token">admin token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required autofocus>
<button type="submit">sign in</button>
<p class="problem" role="alert">{problem}</p>
</form></body></html>
"""


def _sign_in_page(problem: str = "", status: int = 200) -> web.Response:
    return web.Response(text=_SIGN_IN.format(problem=html.escape(problem)), status=status,
                        content_type="text/html", headers=_PAGE_HEADERS)


def _see_root() -> web.Response:
    return web.Response(status=303, headers={"Location": "/", "Cache-Control": "no-store"})


class _Files:
    """The static files, read once from the package."""

    def __init__(self) -> None:
        root = resources.files("fleetwarden.admin") / "static"
        self.page = (root / "dashboard.html").read_bytes()
        self.static = {name: (root / name).read_bytes() for name in _STATIC}


FILES: web.AppKey[_Files] = web.AppKey("dashboard-files")


async def page(request: web.Request) -> web.StreamResponse:
    token = request.query.get("token")
    if token is not None:
        if not token_matches(request.app[TOKEN], token):
            return _sign_in_page("That token was not accepted.", 401)
        see = _see_root()
        _set_cookie(request, see, token)
        return see
    if _signed_in(request):
        return web.Response(body=request.app[FILES].page, content_type="text/html",
                            charset="utf-8", headers=_PAGE_HEADERS)
    if COOKIE in request.cookies:  # a cookie from another fleet, or an older token
        resp = _sign_in_page("Your sign-in is no longer valid: sign in again.", 401)
        resp.del_cookie(COOKIE, path="/")
        return resp
    return _sign_in_page()


async def login(request: web.Request) -> web.StreamResponse:
    if not _same_origin(request):
        return _sign_in_page("Sign in from this page, not from another site.", 403)
    form = await request.post()
    token = form.get("token")
    if not isinstance(token, str) or not token_matches(request.app[TOKEN], token.strip()):
        return _sign_in_page("That token was not accepted.", 401)
    resp = _see_root()
    _set_cookie(request, resp, token.strip())
    return resp


async def logout(request: web.Request) -> web.StreamResponse:
    # The sign-in's rule: another site's page must not sign the browser out either.
    if not _same_origin(request):
        return _sign_in_page("Sign out from this page, not from another site.", 403)
    resp = _see_root()
    resp.del_cookie(COOKIE, path="/")
    return resp


async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    body = request.app[FILES].static.get(name)
    if body is None:
        raise web.HTTPNotFound()
    return web.Response(body=body, headers={"Content-Type": _STATIC[name],
                                            "Cache-Control": "no-cache",
                                            "X-Content-Type-Options": "nosniff"})


def _frame(event: str, data: Any) -> bytes:
    try:
        text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a NaN in an engine's metrics: JSON.parse would refuse the whole event
        text = json.dumps(_finite(data), separators=(",", ":"))
    return f"event: {event}\ndata: {text}\n\n".encode()


def _finite(data: Any) -> Any:
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_finite(v) for v in data]
    return data


async def events(request: web.Request) -> web.StreamResponse:
    """The page's event stream (see the module's docstring)."""
    fleet, admin = request.app[FLEET], request.app[ADMIN]
    queue = admin.events.listen()  # before the hello: nothing that happens after it is missed
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-store",
                                       "X-Accel-Buffering": "no"})
    try:
        await resp.prepare(request)
        await resp.write(f"retry: {RETRY_MS}\n\n".encode() + _frame("hello", hello(fleet, admin)))
        # The fleet's stop sets ``stopping``, then publishes ``bye`` (no await between): a
        # stream that listened before gets the bye, one that listened after sees ``stopping``.
        ended = fleet.stopping
        while not ended:
            try:
                event = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
            except TimeoutError:
                await resp.write(b": keepalive\n\n")
                continue
            ended = event["type"] == "bye"
            if event["type"] == "resync":  # this page fell behind and lost events: start over
                await resp.write(_frame("hello", hello(fleet, admin)))
            elif not ended:
                await resp.write(_frame(event["type"], event.get("data")))
        await resp.write(_frame("bye", {"reason": "the fleet is stopping"}))
    except ConnectionResetError:
        pass  # the page went away; its queue goes with it below
    finally:
        admin.events.unlisten(queue)
    return resp


def add_routes(app: web.Application) -> None:
    app[FILES] = _Files()
    r = app.router
    r.add_get("/", page)
    r.add_post("/login", login)
    r.add_post("/logout", logout)
    r.add_get("/static/{name}", static)
    r.add_get("/admin/events", events)
