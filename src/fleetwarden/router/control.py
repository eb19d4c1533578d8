"""The router's control API, so that one controller can drive several router processes.

Owns: the router's control API, the server side (its clients are in
:mod:`fleetwarden.router.links`).
Must not: decide anything: it carries the controller's pushes and drains.

Served on its own port, on 127.0.0.1 by default, and only to callers holding the bearer token
(401 otherwise). The controller's tick (docs/design.md section 6) uses it to push the serving set,
drain outcomes and rescue requests off condemned backends.

=======  ===============  ===============================  ==============================
method   path             body                             answer
=======  ===============  ===============================  ==============================
GET      /status          -                                :meth:`Router.status`
PUT      /serving         ``{"backends": [url, ...],       ``{"serving": [url, ...],
                          "facts": {url: facts},           "facts": {url: facts}}``
                          "coming_back": n}``
POST     /outcomes/drain  ``{"ack": batch or null}``       ``{"outcomes": {url: [s, f, t]},
                          (optional)                       "batch": id}``
POST     /rescue          ``{"backend": url,               ``{"rescued": n}``
                          "streams": bool}`` (default
                          true: streams begun move too)
POST     /hedge           ``{"backend": url,               ``{"hedged": n}``
                          "held_s": x,
                          "lost_race_fails": b}``
                          (the last optional, false)
POST     /weights-changing ``{"backend": url,              ``{"marked": n}``
                          "version": v}`` (its requests
                          kept across a load of v)
GET      /in-flight       -                                ``{"in_flight": {url: n}}``
PUT      /trial           ``{"backends": [url, ...]}``     ``{"trial": [url, ...]}``
GET      /silent?after_s  -                                ``{"silent": {url: seconds}}``
GET      /evidence?...    ``wait_s``, ``silent_after_s``,  ``{"failed": n, "failures": c,
                          ``after``                        "silent": {url: seconds}}``, as
                                                           soon as there is any (long poll)
PUT      /retry-after     ``{"seconds": x or null}``       ``{"retry_after": x or null}``
POST     /stop-accepting  -                                ``{"accepting": false}`` once
                                                           its listeners are closed
GET      /metrics         -                                the router's own ``/metrics``
=======  ===============  ===============================  ==============================

Every route above but ``/stop-accepting`` and ``/metrics`` is a row of
:data:`~fleetwarden.router.ops.OPERATIONS`, and served from it: the row's arguments read from
the body (the query, for a GET) by its readers, a 400 naming the field where one is wrong, then
its target called on the router. :class:`~fleetwarden.router.links.RemoteRouter` is the client
built from the same rows and :class:`~fleetwarden.router.links.InProcessRouter` calls their
targets in this process, so a controller treats a router in its own process and one across a
socket alike (:class:`~fleetwarden.router.links.RouterLink`). ``GET /holding?silent_after_s``
answers ``{"holding": {"in_flight": {url: n}, "silent": {url: seconds}}}``: the two reads
``/in-flight`` and ``/silent`` (still served) make, in one.

Drains are acknowledged, so that a lost answer loses no outcome: each drain's answer carries a
``batch`` id, and the router keeps that batch until a later drain names it in ``ack``. A drain
whose ``ack`` is not the batch the router holds (the answer was lost, or a new controller
starts with ``null``) gets the held batch again, merged with what happened since; a drain
without ``ack`` (an older controller) gets only what happened since, as before. At least once:
a controller that applied a batch and died before acknowledging it has that window counted
twice by the next one, where losing it would hide failures.

``facts`` of a backend are ``{"shard": i, "weight_version": v, "incarnation": s, "models":
[...]}`` (:class:`BackendFacts`; the incarnation tells the cache-aware policy of a restart, the
models are what the router's own ``GET /v1/models`` lists). They
are optional both ways: a push without them (an older controller) is served, with every
backend's facts unknown, and an older router reads ``backends`` alone and ignores them.
``coming_back`` (optional, 0 when absent) is how many engines the controller expects back in
routing soon: while it is not 0, a request that finds no backend waits a while for one
(``RouterSettings.comeback_wait_s``) before it is answered ``status_when_none_left``.

Evidence (each failed attempt, as it happens) reaches a controller in the same process through
:meth:`~fleetwarden.router.links.InProcessRouter.listen`. A router in another process
(``fleetwarden up``'s worker processes, a remote router) holds one ``GET /evidence`` of the
controller's open at a time: it is answered the moment an attempt fails (``failed``: how many
since the count ``after`` the caller last saw, so none falls between two polls; ``failures`` is
the new count), or a backend holds a request silent for ``silent_after_s``, else empty after
``wait_s`` (:class:`~fleetwarden.router.waiting.EvidenceFeed`). The controller then
drains that router's outcomes, or accuses the silent engines, at once: the same pace as in its
own process, give or take a loopback round trip.
"""

from __future__ import annotations

import hmac
import inspect
import itertools
import json
import secrets
from collections.abc import Awaitable, Callable, Mapping
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fleetwarden.router.ops import DRAIN, OPERATIONS, SERVING, Operation, Outcomes, facts_json
from fleetwarden.router.serve import error_body

if TYPE_CHECKING:
    from fleetwarden.router.app import Router

__all__ = ["control_error", "make_control_app", "merge_outcomes"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def control_error(status: int, message: str, error_type: str) -> web.Response:
    """A JSON error in the OpenAI shape, as the data port answers them."""
    return web.Response(status=status, body=error_body(status, message, error_type),
                        content_type="application/json")


def make_control_app(router: Router, token: str) -> web.Application:
    """The control API of ``router``, for callers presenting ``Bearer <token>``."""
    if not token:
        raise ValueError("the control API needs a non-empty token")
    api = _ControlApi(router)
    app = web.Application(middlewares=[_require(f"Bearer {token}".encode())],
                          client_max_size=1024 * 1024)
    app.on_shutdown.append(api.on_shutdown)
    for op in OPERATIONS:
        handler = api.put_serving if op is SERVING else api.drain if op is DRAIN else api.serve(op)
        app.router.add_route(op.method, op.path, handler)
    app.router.add_post("/stop-accepting", api.stop_accepting)
    app.router.add_get("/metrics", api.metrics)
    app.router.add_route("*", "/{tail:.*}", _not_found)
    return app


def _require(expected: bytes) -> Middleware:
    """The middleware that answers 401 to a caller without the bearer token."""

    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            response = control_error(401, "A bearer token is required.", "unauthorized")
            response.headers["WWW-Authenticate"] = 'Bearer realm="fleetwarden router control"'
            return response
        return await handler(request)

    return require_token


async def _not_found(request: web.Request) -> web.Response:
    return control_error(404, f"No control route for {request.method} {request.path}.",
                         "not_found")


class _ControlApi:
    """The handlers of one router's control API: each reads its arguments, then makes one
    call."""

    def __init__(self, router: Router) -> None:
        self.router = router
        #: The drain batch handed out last, kept until a drain acknowledges it.
        self.held: Outcomes = {}
        self._batches = itertools.count(1)
        self.held_batch = f"{secrets.token_hex(4)}-0"  # unique to this router process

    async def on_shutdown(self, app: web.Application) -> None:
        self.router.feed.close()  # the router is stopping: held polls are answered now

    def serve(self, op: Operation[Any]) -> Handler:
        """The handler of ``op``'s route: its arguments read, its target called, the result
        under its answer's key."""
        target = attrgetter(op.target)(self.router)

        async def handle(request: web.Request) -> web.Response:
            result = target(**await _args(op, request))
            if inspect.isawaitable(result):  # a wait (the evidence long poll)
                result = await result
            answer = op.encode(result)
            return web.json_response(answer if op.answer is None else {op.answer: answer})

        return handle

    async def put_serving(self, request: web.Request) -> web.Response:
        self.router.set_serving_backends(**await _args(SERVING, request))
        self.router.arm_reflex()  # pushed from the fleet's health: the next push undoes a drop
        return web.json_response({"serving": self.router.serving_backends(),
                                  "facts": facts_json(self.router.backend_facts())})

    async def drain(self, request: web.Request) -> web.Response:
        body = await _json_object(request) if request.can_read_body else {}
        fresh = self.router.pool.drain_outcomes()
        if "ack" not in body:  # an older controller: each window handed over once
            self.held = {}
            return web.json_response({"outcomes": fresh})
        ack = body["ack"]
        if ack is not None and not isinstance(ack, str):
            raise _bad_request("'ack' must be a batch id or null")
        if ack != self.held_batch:
            fresh = merge_outcomes(self.held, fresh)  # that batch's answer was lost: again
        self.held = fresh
        self.held_batch = f"{self.held_batch.split('-')[0]}-{next(self._batches)}"
        return web.json_response({"outcomes": fresh, "batch": self.held_batch})

    async def stop_accepting(self, request: web.Request) -> web.Response:
        await self.router.stop_accepting()
        return web.json_response({"accepting": False})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.router.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})


def merge_outcomes(
    older: Mapping[str, tuple[int, int, int]], newer: Mapping[str, tuple[int, int, int]],
) -> dict[str, tuple[int, int, int]]:
    """Two consecutive windows as one: counts add up; the trailing failures are the newer
    window's when it had a success, else the older's trailing run continued by the newer's."""
    merged = dict(older)
    for url, (s, f, t) in newer.items():
        if url not in merged:
            merged[url] = (s, f, t)
            continue
        s0, f0, t0 = merged[url]
        merged[url] = (s0 + s, f0 + f, t if s > 0 else t0 + t)
    return merged


def _bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(
        text=json.dumps({"error": {"message": message, "type": "invalid_request",
                                   "param": None, "code": 400}}),
        content_type="application/json")


async def _args(op: Operation[Any], request: web.Request) -> dict[str, Any]:
    """``op``'s arguments from ``request``: its query for a GET, else its JSON body; a 400
    naming the field where one is wrong."""
    source: Mapping[str, Any] = (request.query if op.method == "GET" else
                                 await _json_object(request) if op.args else {})
    try:
        return {arg.name: arg.read(source) for arg in op.args}
    except ValueError as exc:
        raise _bad_request(str(exc)) from None


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _bad_request("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise _bad_request("the body must be a JSON object")
    return body
