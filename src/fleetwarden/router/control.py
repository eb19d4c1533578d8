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

:class:`~fleetwarden.router.links.RemoteRouter` is the client of this API and
:class:`~fleetwarden.router.links.InProcessRouter` wraps a router in the same async methods, so
a controller treats a router in its own process and one across a socket alike
(:class:`~fleetwarden.router.links.RouterLink`).

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
``wait_s`` (:class:`~fleetwarden.router.links.EvidenceFeed`). The controller then
drains that router's outcomes, or accuses the silent engines, at once: the same pace as in its
own process, give or take a loopback round trip.
"""

from __future__ import annotations

import hmac
import itertools
import json
import math
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from fleetwarden.router.links import (
    EVIDENCE_WAIT_S,
    EvidenceFeed,
    LocalRouter,
    Outcomes,
    facts_json,
)
from fleetwarden.router.models import MAX_CARDS, ModelCard, card_error
from fleetwarden.router.pool import BackendFacts
from fleetwarden.router.serve import error_body

__all__ = ["ControlledRouter", "control_error", "make_control_app", "merge_outcomes"]

#: How long ``GET /evidence`` waits for evidence at most: the bound keeps a connection from
#: outliving a controller that went away unseen.
EVIDENCE_WAIT_MAX_S = 60.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ControlledRouter(LocalRouter, Protocol):
    """What the control API calls on the router it serves
    (:class:`~fleetwarden.router.app.Router`): a link's calls and a few reads of its own."""

    @property
    def registry(self) -> CollectorRegistry: ...
    def arm_reflex(self) -> None: ...
    def serving_backends(self) -> list[str]: ...
    def trial_backends(self) -> list[str]: ...
    def backend_facts(self) -> dict[str, BackendFacts]: ...
    async def stop_accepting(self) -> bool: ...


def control_error(status: int, message: str, error_type: str) -> web.Response:
    """A JSON error in the OpenAI shape, as the data port answers them."""
    return web.Response(status=status, body=error_body(status, message, error_type),
                        content_type="application/json")


def make_control_app(router: ControlledRouter, token: str) -> web.Application:
    """The control API of ``router``, for callers presenting ``Bearer <token>``."""
    if not token:
        raise ValueError("the control API needs a non-empty token")
    api = _ControlApi(router)
    app = web.Application(middlewares=[_require(f"Bearer {token}".encode())],
                          client_max_size=1024 * 1024)
    app.on_shutdown.append(api.on_shutdown)
    app.router.add_get("/status", api.status)
    app.router.add_put("/serving", api.put_serving)
    app.router.add_post("/outcomes/drain", api.drain)
    app.router.add_post("/rescue", api.rescue)
    app.router.add_post("/hedge", api.hedge)
    app.router.add_post("/weights-changing", api.weights_changing)
    app.router.add_get("/in-flight", api.in_flight)
    app.router.add_put("/retry-after", api.put_retry_after)
    app.router.add_put("/trial", api.put_trial)
    app.router.add_get("/silent", api.silent, allow_head=False)
    app.router.add_get("/evidence", api.evidence, allow_head=False)
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
    """The handlers of one router's control API: each checks its body, then makes one call."""

    def __init__(self, router: ControlledRouter) -> None:
        self.router = router
        #: The drain batch handed out last, kept until a drain acknowledges it.
        self.held: Outcomes = {}
        self._batches = itertools.count(1)
        self.held_batch = f"{secrets.token_hex(4)}-0"  # unique to this router process
        self.feed = EvidenceFeed(router)

    async def on_shutdown(self, app: web.Application) -> None:
        self.feed.close()  # the router is stopping: held polls are answered now

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.router.status())

    async def put_serving(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        backends = _urls(body, "backends")
        coming = body.get("coming_back", 0)
        if isinstance(coming, bool) or not isinstance(coming, int) or coming < 0:
            raise _bad_request("'coming_back' must be an integer >= 0")
        self.router.set_serving_backends(backends, _facts_of(body.get("facts"),
                                                             body.get("keys")),
                                         coming_back=coming)
        self.router.arm_reflex()  # pushed from the fleet's health: the next push undoes a drop
        return web.json_response({"serving": self.router.serving_backends(),
                                  "facts": facts_json(self.router.backend_facts())})

    async def drain(self, request: web.Request) -> web.Response:
        body = await _json_object(request) if request.can_read_body else {}
        fresh = self.router.drain_outcomes()
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

    async def rescue(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        backend = body.get("backend")
        if not isinstance(backend, str):
            raise _bad_request("'backend' must be a URL string")
        streams = _flag(body, "streams", True)
        return web.json_response({"rescued": self.router.rescue(backend, streams=streams)})

    async def weights_changing(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        backend, version = body.get("backend"), body.get("version")
        if not isinstance(backend, str):
            raise _bad_request("'backend' must be a URL string")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise _bad_request("'version' must be an integer >= 0")
        return web.json_response({"marked": self.router.weights_changing(backend, version)})

    async def hedge(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        backend, held_s = body.get("backend"), body.get("held_s")
        if not isinstance(backend, str):
            raise _bad_request("'backend' must be a URL string")
        if (isinstance(held_s, bool) or not isinstance(held_s, int | float)
                or not math.isfinite(held_s) or held_s < 0):
            raise _bad_request("'held_s' must be a number of seconds >= 0")
        fails = _flag(body, "lost_race_fails", False)
        return web.json_response({"hedged": self.router.hedge(backend, float(held_s),
                                                              lost_race_fails=fails)})

    async def in_flight(self, request: web.Request) -> web.Response:
        return web.json_response({"in_flight": self.router.in_flight()})

    async def put_retry_after(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        seconds = body.get("seconds", ...)
        if seconds is not None and (isinstance(seconds, bool)
                                    or not isinstance(seconds, int | float)
                                    or not math.isfinite(seconds) or seconds < 0):
            raise _bad_request("'seconds' must be a number >= 0 or null")
        self.router.set_retry_after(seconds)
        return web.json_response({"retry_after": seconds})

    async def put_trial(self, request: web.Request) -> web.Response:
        self.router.set_trial_backends(_urls(await _json_object(request), "backends"))
        return web.json_response({"trial": self.router.trial_backends()})

    async def silent(self, request: web.Request) -> web.Response:
        try:
            after_s = float(request.query.get("after_s", "0"))
        except ValueError:
            raise _bad_request("'after_s' must be a number of seconds") from None
        if not math.isfinite(after_s) or after_s < 0:
            raise _bad_request("'after_s' must be a number >= 0")
        return web.json_response({"silent": self.router.silent_backends(after_s)})

    async def evidence(self, request: web.Request) -> web.Response:
        wait_s = _seconds(request, "wait_s", EVIDENCE_WAIT_S, EVIDENCE_WAIT_MAX_S)
        silent_after_s = _seconds(request, "silent_after_s", 1.0, math.inf)
        try:
            after = int(request.query.get("after", self.feed.failures))
        except ValueError:
            raise _bad_request("'after' must be a count of failed attempts") from None
        failed, silent = await self.feed.wait(after, wait_s, silent_after_s)
        return web.json_response({"failed": failed, "failures": self.feed.failures,
                                  "silent": silent})

    async def stop_accepting(self, request: web.Request) -> web.Response:
        await self.router.stop_accepting()
        return web.json_response({"accepting": False})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.router.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})


def _urls(body: Mapping[str, Any], name: str) -> list[str]:
    urls = body.get(name)
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise _bad_request(f"'{name}' must be a list of URL strings")
    return urls


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise _bad_request(f"'{name}' must be true or false")
    return value


def _seconds(request: web.Request, name: str, default: float, most: float) -> float:
    try:
        value = float(request.query.get(name, default))
    except ValueError:
        raise _bad_request(f"'{name}' must be a number of seconds") from None
    if not math.isfinite(value) or value < 0 or value > most:
        raise _bad_request(f"'{name}' must be a number of seconds from 0 to {most:g}")
    return value


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


def _facts_of(raw: object, keys: object = None) -> dict[str, BackendFacts] | None:
    """``facts`` of a push: absent or null (an older controller), or ``{url: {"shard": i,
    "weight_version": v}}`` with either field absent or null when unknown; ``keys``: the
    engines' API keys by URL (absent: none), never echoed (no error names one)."""
    if keys is not None and (not isinstance(keys, dict) or not all(
            isinstance(k, str) and k for k in keys.values())):
        raise _bad_request("'keys' must be an object mapping URLs to non-empty strings")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _bad_request("'facts' must be an object mapping URLs to facts")
    facts = {}
    for url, fact in raw.items():
        if not isinstance(fact, dict):
            raise _bad_request(f"'facts.{url}' must be an object")
        values: dict[str, int | None] = {}
        for name, least in (("shard", 0), ("weight_version", 0), ("output_cap", 1),
                            ("output_default", 1)):
            value = fact.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < least):
                raise _bad_request(f"'facts.{url}.{name}' must be an integer >= {least} "
                                   "or null")
            values[name] = value
        fields = fact.get("upstream_fields")
        if fields is not None and not isinstance(fields, bool):
            raise _bad_request(f"'facts.{url}.upstream_fields' must be true, false or null")
        strings: dict[str, str | None] = {}
        for name in ("incarnation", "output_cap_unknown"):
            value = fact.get(name)
            if value is not None and not isinstance(value, str):
                raise _bad_request(f"'facts.{url}.{name}' must be a string or null")
            strings[name] = value
        facts[url] = BackendFacts(values["shard"], values["weight_version"],
                                  upstream_fields=fields, incarnation=strings["incarnation"],
                                  models=_models_of(url, fact.get("models")),
                                  key=(keys or {}).get(url), output_cap=values["output_cap"],
                                  output_default=values["output_default"],
                                  output_cap_unknown=strings["output_cap_unknown"])
    return facts


def _models_of(url: str, raw: object) -> tuple[ModelCard, ...] | None:
    """``facts.URL.models`` of a push: absent or null (not read yet, or an older
    controller), or a list of cards (:class:`~fleetwarden.router.models.ModelCard`)."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_CARDS:
        raise _bad_request(f"'facts.{url}.models' must be a list of at most {MAX_CARDS} "
                           "model cards or null")
    for k, card in enumerate(raw):
        problem = card_error(card)
        if problem is not None:
            raise _bad_request(f"'facts.{url}.models[{k}]': {problem}")
    return tuple(ModelCard.of(card) for card in raw)


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _bad_request("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise _bad_request("the body must be a JSON object")
    return body
