"""The admin API: fleet state, history, operator actions, refits, and external routers.

Owns: the admin API's routes, its token check and its cross-site refusal, and the shape of each
answer.
Must not: reach into a fleet's parts (only the operations of ``FleetSurface``), or build a view
(``views.py``). What only the admin side keeps (events, the metrics registry) is its own
``AdminState`` (``state.py``).

On its own port, 127.0.0.1 by default, every route behind the bearer token (401 without it,
and nothing changes); a browser presents it as the dashboard's cookie, and a state change
signed in by the cookie must carry this page's ``Origin`` and a JSON body (403 otherwise: see
:func:`cross_site_refusal`). The token is never logged: the server runs without an access log
line that would carry the sign-in link's ``?token=`` query.

    GET  /admin/status                      fleet status, counts, router and admin URLs
    GET  /admin/shards                      every shard's record, in-flight and last sample
    GET  /admin/transitions?since=SEQ       transitions after a sequence number (journal)
    POST /admin/shards/{i}/retire           {"reason": "..."}
    POST /admin/shards/{i}/restart          {"reason": "..."}
    POST /admin/shards/{i}/chaos            {"fault": "wedge|unwedge|crash|slow|error5xx|..."}:
                                            {"how": ..., "at": when it landed (epoch s)}
    GET  /admin/serving                     the serving set, for routers that poll
    POST /admin/outcomes                    {"outcomes": {url: [ok, failed, trailing]}}
    POST /admin/refit/begin|complete|abort  {"version": N, "reason": "...", "checksums": {...}}
    POST /admin/refit/load                  {"path": P, "version": N, "pause_mode": "wait",
                                            "checksums": {...}}: fleetwarden loads P itself
    GET  /admin/refits                      the refit history and the open lease
    POST /admin/sleep                       {"level": 1|2, "shards": [i, ...]}: the trainer's
                                            sleep bracket (default: every awake shard)
    POST /admin/wake                        {"shards": [i, ...]} (default: every sleeper)
    GET  /metrics                           Prometheus: shards by state, restarts, verdicts
    GET  /admin/events                      server-sent events for the dashboard
    GET  /                                  the dashboard (``dashboard.py``), or its sign-in
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from fleetwarden.admin import dashboard, views
from fleetwarden.admin.keys import ADMIN, FLEET, PUBLIC, TOKEN, bearer, presented_token
from fleetwarden.admin.state import AdminState
from fleetwarden.admin.surface import FleetSurface
from fleetwarden.auth import token_matches
from fleetwarden.refit import RefitError
from fleetwarden.weight_sync import PAUSE_MODES

__all__ = ["make_admin_app", "presented_token"]

log = logging.getLogger(__name__)

#: Admin request bodies are small JSON objects.
_MAX_BODY = 64 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status, **extra}},
                             status=status)


def own_origin(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}"


#: Methods that change nothing, so a cross-site request with the cookie can do no harm.
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def cross_site_refusal(request: web.Request) -> str | None:
    """Why a state-changing request signed in by the cookie is refused, or ``None``.

    A browser sends the cookie with a request that another page starts, and SameSite does
    not help here: pages on other ports of 127.0.0.1 (a notebook, a Ray dashboard) are the
    same *site*. Such a page can post a form, but cannot set an ``Origin`` of ours nor a JSON
    content type without a CORS preflight that this server never answers. So a cookie-signed
    state change needs both; a bearer token (the CLI, clients, trainers) is never sent by a
    browser on its own and needs neither."""
    if request.method in _SAFE_METHODS or bearer(request) is not None:
        return None
    origin = request.headers.get("Origin")
    if origin != own_origin(request):
        return (f"a state change signed in by the cookie must come from this page (Origin "
                f"{own_origin(request)}), not {origin or 'an unknown origin'}")
    if request.content_type != "application/json":
        return (f"a state change signed in by the cookie must send JSON (Content-Type "
                f"application/json), not {request.content_type or 'nothing'}")
    return None


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path in request.app[PUBLIC]:
        return await handler(request)
    if not token_matches(request.app[TOKEN], presented_token(request)):
        resp = _error(401, "missing or wrong admin token: send 'Authorization: Bearer <token>' "
                      "with the token from the admin token file")
        resp.headers["WWW-Authenticate"] = 'Bearer realm="fleetwarden"'
        return resp
    refusal = cross_site_refusal(request)
    if refusal is not None:
        return _error(403, refusal)
    return await handler(request)


async def _json_body(request: web.Request) -> dict[str, Any]:
    if request.content_length and request.content_length > _MAX_BODY:
        raise web.HTTPRequestEntityTooLarge(max_size=_MAX_BODY, actual_size=request.content_length)
    raw = await request.read()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise _http_error(400, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise _http_error(400, "the body must be a JSON object")
    return body


def _http_error(status: int, message: str) -> web.HTTPException:
    exc = web.HTTPException()
    exc.set_status(status)
    exc.text = json.dumps({"error": {"message": message, "code": status}})
    exc.content_type = "application/json"
    return exc


def _shard_index(request: web.Request) -> int:
    fleet = request.app[FLEET]
    try:
        i = int(request.match_info["i"])
    except ValueError:
        raise _http_error(400, f"shard must be an integer, got {request.match_info['i']!r}") \
            from None
    if not 0 <= i < fleet.size:
        raise _http_error(404, f"no shard {i}: the fleet has shards 0..{fleet.size - 1}")
    return i


def _checksums(body: dict[str, Any]) -> dict[str, str] | None:
    sums = body.get("checksums")
    if sums is None:
        return None
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise _http_error(400, "checksums must be an object {parameter: checksum string}, as "
                               "vLLM's POST /weight_checker {\"action\": \"checksum\"} gives")
    return sums


def _version(body: dict[str, Any]) -> int:
    v = body.get("version")
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise _http_error(400, f"version must be a non-negative integer, got {v!r}")
    return v


# ---------------------------------------------------------------------- read

async def status(request: web.Request) -> web.Response:
    return web.json_response(views.status_view(request.app[FLEET].snapshot()))


async def shards(request: web.Request) -> web.Response:
    # With the status of the same snapshot: a headline shown beside these rows agrees with them.
    snap = request.app[FLEET].snapshot()
    return web.json_response({"shards": views.shards_view(snap),
                              "status": views.status_view(snap)})


async def transitions(request: web.Request) -> web.Response:
    events = request.app[ADMIN].events
    try:
        since = int(request.query.get("since", "0"))
        limit = min(int(request.query.get("limit", "1000")), 10_000)
        shard = int(request.query["shard"]) if "shard" in request.query else None
    except ValueError:
        raise _http_error(400, "since, limit and shard must be integers") from None
    return web.json_response({"transitions": events.since(since, limit, shard)})


async def serving(request: web.Request) -> web.Response:
    urls, facts = request.app[FLEET].serving()
    return web.json_response({"urls": urls,
                              "facts": {url: f.to_dict() for url, f in facts.items()}})


async def refits(request: web.Request) -> web.Response:
    return web.json_response(views.refits_view(request.app[FLEET].snapshot()))


# ---------------------------------------------------------------------- act

async def retire(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    i = _shard_index(request)
    body = await _json_body(request)
    reason = str(body.get("reason") or "retired by an operator")
    acted = fleet.retire(i, reason)
    return web.json_response({"shard": i, "applied": acted.applied, "reason": acted.reason,
                              "state": str(acted.state)},
                             status=200 if acted.applied else 409)


async def restart(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    i = _shard_index(request)
    body = await _json_body(request)
    reason = str(body.get("reason") or "restart requested by an operator")
    acted = await fleet.restart(i, reason)
    return web.json_response({"shard": i, "applied": acted.applied, "state": str(acted.state)},
                             status=200 if acted.applied else 409)


async def chaos(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    i = _shard_index(request)
    body = await _json_body(request)
    fault = body.get("fault")
    if not isinstance(fault, str):
        raise _http_error(400, "fault must be a string such as 'wedge', 'unwedge' or 'crash'")
    try:
        how = await fleet.inject_fault(i, fault, body)
    except ValueError as exc:
        raise _http_error(400, str(exc)) from None
    except LookupError as exc:
        raise _http_error(409, str(exc)) from None
    # When it landed (wall clock, as the journal's transitions): a caller that times the
    # fleet's answer counts from here, not from when it asked (a CLI starting on a starved
    # machine took 19 s to get its fault in).
    return web.json_response({"shard": i, "fault": fault, "how": how, "at": time.time()})


async def outcomes(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    body = await _json_body(request)
    raw = body.get("outcomes")
    if not isinstance(raw, dict):
        raise _http_error(400, 'outcomes must be an object {url: [ok, failed, trailing]}')
    parsed: dict[str, tuple[int, int, int]] = {}
    for url, counts in raw.items():
        if (not isinstance(counts, list) or len(counts) != 3
                or not all(isinstance(c, int) and c >= 0 for c in counts)):
            raise _http_error(400, f"outcomes[{url!r}] must be three non-negative integers")
        parsed[url] = (counts[0], counts[1], counts[2])
    fleet.apply_outcomes(parsed)
    return web.json_response({"accepted": len(parsed)})


async def refit_begin(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    body = await _json_body(request)
    try:
        lease = await fleet.begin_refit(_version(body))
    except RefitError as exc:
        raise _http_error(409, str(exc)) from None
    return web.json_response({
        "version": lease.version,
        "participants": [{"shard": p.shard, "url": p.url} for p in lease.participants],
        "lease_s": lease.deadline - lease.started_at,
    })


async def refit_complete(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    body = await _json_body(request)
    try:
        record = await fleet.complete_refit(_version(body), _checksums(body))
    except RefitError as exc:
        raise _http_error(409, str(exc)) from None
    # The routers learn the new weight versions before the trainer's next rollout is sent.
    await fleet.push()
    return web.json_response({"version": record.version, "refitted": list(record.participants),
                              "confirmed": list(record.confirmed),
                              "unconfirmed": {str(i): why for i, why in record.unconfirmed},
                              "states": views.states_view(fleet.snapshot())})


async def refit_load(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    body = await _json_body(request)
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise _http_error(400, f"path must be the checkpoint's path on the engines' hosts, got "
                               f"{path!r}")
    mode = body.get("pause_mode")
    if mode is not None and mode not in PAUSE_MODES:
        raise _http_error(400, f"pause_mode must be one of {', '.join(PAUSE_MODES)}, got "
                               f"{mode!r}")
    try:
        load = await fleet.refit_from(path, _version(body), pause_mode=mode,
                                      checksums=_checksums(body))
    except RefitError as exc:
        raise _http_error(409, str(exc)) from None
    return web.json_response({**load.to_dict(), "states": views.states_view(fleet.snapshot())})


async def refit_abort(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    body = await _json_body(request)
    reason = str(body.get("reason") or "aborted by the trainer")
    try:
        record = fleet.abort_refit(_version(body), reason)
    except RefitError as exc:
        raise _http_error(409, str(exc)) from None
    await fleet.push()  # the shards it left STALE or condemned serve no more
    return web.json_response({"version": record.version, "partial": list(record.participants),
                              "condemned": list(record.condemned),
                              "states": views.states_view(fleet.snapshot())})


def _shards_of(body: dict[str, Any]) -> list[int] | None:
    shards = body.get("shards")
    if shards is None:
        return None
    if not isinstance(shards, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in shards):
        raise _http_error(400, "shards must be a list of shard indices")
    return shards


async def sleep(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    body = await _json_body(request)
    level = body.get("level", 1)
    if level not in (1, 2) or isinstance(level, bool):
        raise _http_error(400, f"level must be 1 (weights offloaded) or 2 (discarded), "
                          f"got {level!r}")
    try:
        results = await fleet.sleep(level, _shards_of(body))
    except ValueError as exc:
        raise _http_error(400, str(exc)) from None
    return web.json_response({"level": level, "shards": [r.to_dict() for r in results],
                              "states": views.states_view(fleet.snapshot())})


async def wake_up(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    body = await _json_body(request)
    try:
        results = await fleet.wake(_shards_of(body))
    except ValueError as exc:
        raise _http_error(400, str(exc)) from None
    return web.json_response({"shards": [r.to_dict() for r in results],
                              "states": views.states_view(fleet.snapshot())})


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[ADMIN].metrics_text()
    return web.Response(body=body, headers={"Content-Type": content_type})


def make_admin_app(fleet: FleetSurface, admin: AdminState) -> web.Application:
    """The admin API over ``fleet``, behind ``admin``'s token (loaded before)."""
    app = web.Application(middlewares=[_auth], client_max_size=_MAX_BODY)
    app[FLEET] = fleet
    app[ADMIN] = admin
    app[TOKEN] = admin.token
    app[PUBLIC] = dashboard.PUBLIC_PATHS
    r = app.router
    r.add_get("/admin/status", status)
    r.add_get("/admin/shards", shards)
    r.add_get("/admin/transitions", transitions)
    r.add_get("/admin/serving", serving)
    r.add_get("/admin/refits", refits)
    r.add_post("/admin/shards/{i}/retire", retire)
    r.add_post("/admin/shards/{i}/restart", restart)
    r.add_post("/admin/shards/{i}/chaos", chaos)
    r.add_post("/admin/outcomes", outcomes)
    r.add_post("/admin/refit/begin", refit_begin)
    r.add_post("/admin/refit/complete", refit_complete)
    r.add_post("/admin/refit/abort", refit_abort)
    r.add_post("/admin/refit/load", refit_load)
    r.add_post("/admin/sleep", sleep)
    r.add_post("/admin/wake", wake_up)
    r.add_get("/metrics", metrics)
    dashboard.add_routes(app)
    return app
