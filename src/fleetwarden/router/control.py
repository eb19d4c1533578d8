"""The router's control API, so that one controller can drive several router processes.

Owns: the router's control API and the clients that drive a router, in this process or another.
Must not: decide anything: it carries the controller's pushes and drains.

Served on its own port, on 127.0.0.1 by default, and only to callers holding the bearer token
(401 otherwise). The controller's tick (docs/design.md section 6) uses it to push the serving set,
drain outcomes and rescue requests off condemned backends.

=======  ===============  ===============================  ==============================
method   path             body                             answer
=======  ===============  ===============================  ==============================
GET      /status          -                                :meth:`Router.status`
PUT      /serving         ``{"backends": [url, ...],       ``{"serving": [url, ...],
                          "facts": {url: facts}}``         "facts": {url: facts}}``
POST     /outcomes/drain  ``{"ack": batch or null}``       ``{"outcomes": {url: [s, f, t]},
                          (optional)                       "batch": id}``
POST     /rescue          ``{"backend": url,               ``{"rescued": n}``
                          "streams": bool}`` (default
                          true: streams begun move too)
POST     /hedge           ``{"backend": url,               ``{"hedged": n}``
                          "held_s": x,
                          "lost_race_fails": b}``
                          (the last optional, false)
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

:class:`RemoteRouter` is the client of this API and :class:`InProcessRouter` wraps a
:class:`~fleetwarden.router.app.Router` in the same async methods, so a controller treats a
router in its own process and one across a socket alike (:class:`RouterControl`).

Drains are acknowledged, so that a lost answer loses no outcome: each drain's answer carries a
``batch`` id, and the router keeps that batch until a later drain names it in ``ack``. A drain
whose ``ack`` is not the batch the router holds (the answer was lost, or a new controller
starts with ``null``) gets the held batch again, merged with what happened since; a drain
without ``ack`` (an older controller) gets only what happened since, as before. At least once:
a controller that applied a batch and died before acknowledging it has that window counted
twice by the next one, where losing it would hide failures.

``facts`` of a backend are ``{"shard": i, "weight_version": v, "incarnation": s}``
(:class:`BackendFacts`; the incarnation tells the cache-aware policy of a restart). They
are optional both ways: a push without them (an older controller) is served, with every
backend's facts unknown, and an older router reads ``backends`` alone and ignores them.

Evidence (each failed attempt, as it happens) reaches a controller in the same process through
:meth:`InProcessRouter.listen`. A router in another process (``fleetwarden up``'s worker
processes, a remote router) holds one ``GET /evidence`` of the controller's open at a time: it
is answered the moment an attempt fails (``failed``: how many since the count ``after`` the
caller last saw, so none falls between two polls; ``failures`` is the new count), or a backend
holds a request silent for ``silent_after_s``, else empty after ``wait_s``. The controller then
drains that router's outcomes, or accuses the silent engines, at once: the same pace as in its
own process, give or take a loopback round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import math
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from aiohttp import web

from fleetwarden.router.pool import BackendFacts
from fleetwarden.router.serve import error_body

if TYPE_CHECKING:
    from fleetwarden.router.app import Router

__all__ = ["ControlError", "InProcessRouter", "RemoteRouter", "RouterControl",
           "make_control_app", "merge_outcomes"]

#: How long ``GET /evidence`` waits for evidence by default, and at most: a long poll held
#: open, answered at once when there is any; the bound keeps a connection from outliving a
#: controller that went away unseen.
EVIDENCE_WAIT_S = 20.0
EVIDENCE_WAIT_MAX_S = 60.0
#: How often a held ``GET /evidence`` looks for requests that turned silent (failures wake it
#: at once): the in-process controller's own evidence_poll_s is 0.5 s.
EVIDENCE_SCAN_S = 0.25

#: How long a control call may take. The calls are in-memory operations on the router, so
#: seconds without an answer mean the router process is gone or stuck; the tick moves on.
CONTROL_TIMEOUT_S = 5.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RouterControl(Protocol):
    """What a controller calls on a router, wherever it runs."""

    async def set_serving_backends(self, urls: Iterable[str],
                                   facts: Mapping[str, BackendFacts] | None = None) -> None: ...
    async def drain_outcomes(self) -> dict[str, tuple[int, int, int]]: ...
    async def rescue(self, url: str, *, streams: bool = True) -> int: ...
    async def hedge(self, url: str, held_s: float, *, lost_race_fails: bool = False
                    ) -> int: ...
    async def in_flight(self) -> dict[str, int]: ...
    async def set_retry_after(self, seconds: float | None) -> None: ...
    async def set_trial_backends(self, urls: Iterable[str]) -> None: ...
    async def silent_backends(self, after_s: float) -> dict[str, float]: ...
    async def status(self) -> dict[str, Any]: ...


class ControlError(Exception):
    """A control call was refused or failed; the message carries the router's answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"router control answered {status}: {message}")
        self.status = status


# ---------------------------------------------------------------------- the server side


def error_response(status: int, message: str, error_type: str) -> web.Response:
    """A JSON error in the OpenAI shape, as the data port answers them."""
    return web.Response(status=status, body=error_body(status, message, error_type),
                        content_type="application/json")

def make_control_app(router: Router, token: str) -> web.Application:
    """The control API of ``router``, for callers presenting ``Bearer <token>``."""
    if not token:
        raise ValueError("the control API needs a non-empty token")
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            response = error_response(401, "A bearer token is required.", "unauthorized")
            response.headers["WWW-Authenticate"] = 'Bearer realm="fleetwarden router control"'
            return response
        return await handler(request)

    async def status(request: web.Request) -> web.Response:
        return web.json_response(router.status())

    async def put_serving(request: web.Request) -> web.Response:
        body = await _json_object(request)
        backends = body.get("backends")
        if not isinstance(backends, list) or not all(isinstance(u, str) for u in backends):
            raise _bad_request("'backends' must be a list of URL strings")
        router.set_serving_backends(backends, _facts_of(body.get("facts")))
        router.arm_reflex()  # pushed from the fleet's health: the next push undoes a drop
        return web.json_response({"serving": router.serving_backends(),
                                  "facts": _facts_json(router.backend_facts())})

    held: dict[str, tuple[int, int, int]] = {}
    batches = itertools.count(1)
    held_batch = f"{secrets.token_hex(4)}-0"  # unique to this router process

    async def drain(request: web.Request) -> web.Response:
        nonlocal held, held_batch
        body = await _json_object(request) if request.can_read_body else {}
        fresh = router.drain_outcomes()
        if "ack" not in body:  # an older controller: each window handed over once
            held = {}
            return web.json_response({"outcomes": fresh})
        ack = body["ack"]
        if ack is not None and not isinstance(ack, str):
            raise _bad_request("'ack' must be a batch id or null")
        if ack != held_batch:
            fresh = merge_outcomes(held, fresh)  # that batch's answer was lost: send it again
        held, held_batch = fresh, f"{held_batch.split('-')[0]}-{next(batches)}"
        return web.json_response({"outcomes": fresh, "batch": held_batch})

    async def rescue(request: web.Request) -> web.Response:
        body = await _json_object(request)
        backend = body.get("backend")
        if not isinstance(backend, str):
            raise _bad_request("'backend' must be a URL string")
        streams = body.get("streams", True)
        if not isinstance(streams, bool):
            raise _bad_request("'streams' must be true or false")
        return web.json_response({"rescued": router.rescue(backend, streams=streams)})

    async def hedge(request: web.Request) -> web.Response:
        body = await _json_object(request)
        backend, held_s = body.get("backend"), body.get("held_s")
        if not isinstance(backend, str):
            raise _bad_request("'backend' must be a URL string")
        if (isinstance(held_s, bool) or not isinstance(held_s, int | float)
                or not math.isfinite(held_s) or held_s < 0):
            raise _bad_request("'held_s' must be a number of seconds >= 0")
        fails = body.get("lost_race_fails", False)
        if not isinstance(fails, bool):
            raise _bad_request("'lost_race_fails' must be true or false")
        return web.json_response({"hedged": router.hedge(backend, float(held_s),
                                                         lost_race_fails=fails)})

    async def in_flight(request: web.Request) -> web.Response:
        return web.json_response({"in_flight": router.in_flight()})

    async def put_retry_after(request: web.Request) -> web.Response:
        body = await _json_object(request)
        seconds = body.get("seconds", ...)
        if seconds is not None and (isinstance(seconds, bool)
                                    or not isinstance(seconds, int | float)
                                    or not math.isfinite(seconds) or seconds < 0):
            raise _bad_request("'seconds' must be a number >= 0 or null")
        router.set_retry_after(seconds)
        return web.json_response({"retry_after": seconds})

    async def put_trial(request: web.Request) -> web.Response:
        body = await _json_object(request)
        backends = body.get("backends")
        if not isinstance(backends, list) or not all(isinstance(u, str) for u in backends):
            raise _bad_request("'backends' must be a list of URL strings")
        router.set_trial_backends(backends)
        return web.json_response({"trial": sorted(router.pool.trial)})

    async def silent(request: web.Request) -> web.Response:
        try:
            after_s = float(request.query.get("after_s", "0"))
        except ValueError:
            raise _bad_request("'after_s' must be a number of seconds") from None
        if not math.isfinite(after_s) or after_s < 0:
            raise _bad_request("'after_s' must be a number >= 0")
        return web.json_response({"silent": router.silent_backends(after_s)})

    failures = 0  # failed attempts since this router started: what ``after`` counts against
    came = asyncio.Event()  # set at each failure, cleared as a poll takes it

    def on_failure(backend: str, cause: str) -> None:
        nonlocal failures
        failures += 1
        came.set()

    router.listen(on_failure)
    closing = False  # the router is stopping: held polls are answered now, not at wait_s

    async def on_shutdown(app: web.Application) -> None:
        nonlocal closing
        closing = True
        came.set()

    async def evidence(request: web.Request) -> web.Response:
        wait_s = _seconds(request, "wait_s", EVIDENCE_WAIT_S, EVIDENCE_WAIT_MAX_S)
        silent_after_s = _seconds(request, "silent_after_s", 1.0, math.inf)
        try:
            after = int(request.query.get("after", failures))
        except ValueError:
            raise _bad_request("'after' must be a count of failed attempts") from None
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            # ``after`` above the count: the caller counted in an earlier router process
            new = failures - after if failures >= after else failures
            silent = router.silent_backends(silent_after_s)
            left = deadline - asyncio.get_running_loop().time()
            if new or silent or left <= 0 or closing:
                return web.json_response({"failed": new, "failures": failures,
                                          "silent": silent})
            came.clear()
            # a request turns silent without an event: looked for again every EVIDENCE_SCAN_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(came.wait(), min(left, EVIDENCE_SCAN_S))

    async def stop_accepting(request: web.Request) -> web.Response:
        await router.stop_accepting()
        return web.json_response({"accepting": False})

    async def metrics(request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return web.Response(body=generate_latest(router.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def not_found(request: web.Request) -> web.Response:
        return error_response(404, f"No control route for {request.method} {request.path}.",
                              "not_found")

    app = web.Application(middlewares=[require_token], client_max_size=1024 * 1024)
    app.on_shutdown.append(on_shutdown)
    app.router.add_get("/status", status)
    app.router.add_put("/serving", put_serving)
    app.router.add_post("/outcomes/drain", drain)
    app.router.add_post("/rescue", rescue)
    app.router.add_post("/hedge", hedge)
    app.router.add_get("/in-flight", in_flight)
    app.router.add_put("/retry-after", put_retry_after)
    app.router.add_put("/trial", put_trial)
    app.router.add_get("/silent", silent, allow_head=False)
    app.router.add_get("/evidence", evidence, allow_head=False)
    app.router.add_post("/stop-accepting", stop_accepting)

    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app


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


def _facts_of(raw: object) -> dict[str, BackendFacts] | None:
    """``facts`` of a push: absent or null (an older controller), or ``{url: {"shard": i,
    "weight_version": v}}`` with either field absent or null when unknown."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _bad_request("'facts' must be an object mapping URLs to facts")
    facts = {}
    for url, fact in raw.items():
        if not isinstance(fact, dict):
            raise _bad_request(f"'facts.{url}' must be an object")
        values: dict[str, int | None] = {}
        for name in ("shard", "weight_version"):
            value = fact.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise _bad_request(f"'facts.{url}.{name}' must be an integer >= 0 or null")
            values[name] = value
        fields = fact.get("upstream_fields")
        if fields is not None and not isinstance(fields, bool):
            raise _bad_request(f"'facts.{url}.upstream_fields' must be true, false or null")
        incarnation = fact.get("incarnation")
        if incarnation is not None and not isinstance(incarnation, str):
            raise _bad_request(f"'facts.{url}.incarnation' must be a string or null")
        facts[url] = BackendFacts(values["shard"], values["weight_version"],
                                  upstream_fields=fields, incarnation=incarnation)
    return facts


def _facts_json(facts: Mapping[str, BackendFacts]
                ) -> dict[str, dict[str, int | bool | str | None]]:
    return {url: f.to_dict() for url, f in facts.items()}


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _bad_request("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise _bad_request("the body must be a JSON object")
    return body


# ---------------------------------------------------------------------- the two clients

class InProcessRouter:
    """A :class:`Router` in this process, behind the async :class:`RouterControl` methods."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def set_serving_backends(self, urls: Iterable[str],
                                   facts: Mapping[str, BackendFacts] | None = None) -> None:
        self.router.set_serving_backends(urls, facts)

    async def drain_outcomes(self) -> dict[str, tuple[int, int, int]]:
        return self.router.drain_outcomes()

    async def rescue(self, url: str, *, streams: bool = True) -> int:
        return self.router.rescue(url, streams=streams)

    async def hedge(self, url: str, held_s: float, *, lost_race_fails: bool = False) -> int:
        return self.router.hedge(url, held_s, lost_race_fails=lost_race_fails)

    async def in_flight(self) -> dict[str, int]:
        return self.router.in_flight()

    async def set_retry_after(self, seconds: float | None) -> None:
        self.router.set_retry_after(seconds)

    async def set_trial_backends(self, urls: Iterable[str]) -> None:
        self.router.set_trial_backends(urls)

    async def silent_backends(self, after_s: float) -> dict[str, float]:
        return self.router.silent_backends(after_s)

    def listen(self, callback: Callable[[str, str], None]) -> Callable[[], None]:
        """Every failed attempt, as it happens: ``callback(backend, cause)``."""
        return self.router.listen(callback)

    async def status(self) -> dict[str, Any]:
        return self.router.status()


class RemoteRouter:
    """A router in another process, driven through its control API.

    ``url`` is the control API's base URL (``http://127.0.0.1:PORT``), ``token`` its bearer
    token. Use as ``async with RemoteRouter(url, token) as router:``, or call :meth:`close`.
    """

    def __init__(self, url: str, token: str, *, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        #: The batch of the last drain answered: acknowledged by the next drain.
        self._last_batch: str | None = None
        #: The router's count of failed attempts at the last evidence answer.
        self._failures: int | None = None

    async def __aenter__(self) -> RemoteRouter:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, body: object = None, *,
                    timeout_s: float | None = None) -> Any:
        return json.loads(await self._text(method, path, body, timeout_s=timeout_s))

    async def _text(self, method: str, path: str, body: object = None, *,
                    timeout_s: float | None = None) -> str:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        kwargs: dict[str, Any] = {} if body is None else {"json": body}
        if timeout_s is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout_s)
        async with self._session.request(method, self.url + path, **kwargs) as response:
            text = await response.text()
            if response.status != 200:
                try:
                    message = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = text
                raise ControlError(response.status, message)
            return text

    async def metrics_text(self) -> str:
        """The router's own ``/metrics``, in Prometheus' text format."""
        return await self._text("GET", "/metrics")

    async def set_serving_backends(self, urls: Iterable[str],
                                   facts: Mapping[str, BackendFacts] | None = None) -> None:
        body: dict[str, Any] = {"backends": list(urls)}
        if facts is not None:
            body["facts"] = _facts_json(facts)
        await self._call("PUT", "/serving", body)

    async def drain_outcomes(self) -> dict[str, tuple[int, int, int]]:
        answer = await self._call("POST", "/outcomes/drain", {"ack": self._last_batch})
        self._last_batch = answer.get("batch")
        return {url: (int(s), int(f), int(t)) for url, (s, f, t) in answer["outcomes"].items()}

    async def rescue(self, url: str, *, streams: bool = True) -> int:
        answer = await self._call("POST", "/rescue", {"backend": url, "streams": streams})
        return int(answer["rescued"])

    async def hedge(self, url: str, held_s: float, *, lost_race_fails: bool = False) -> int:
        answer = await self._call("POST", "/hedge", {"backend": url, "held_s": held_s,
                                                     "lost_race_fails": lost_race_fails})
        return int(answer["hedged"])

    async def in_flight(self) -> dict[str, int]:
        return {url: int(n) for url, n in (await self._call("GET", "/in-flight"))["in_flight"]
                .items()}

    async def set_retry_after(self, seconds: float | None) -> None:
        await self._call("PUT", "/retry-after", {"seconds": seconds})

    async def set_trial_backends(self, urls: Iterable[str]) -> None:
        await self._call("PUT", "/trial", {"backends": list(urls)})

    async def silent_backends(self, after_s: float) -> dict[str, float]:
        answer = await self._call("GET", f"/silent?after_s={after_s:g}")
        return {url: float(x) for url, x in answer["silent"].items()}

    async def evidence(self, wait_s: float, silent_after_s: float) -> tuple[int, dict[str, float]]:
        """Wait up to ``wait_s`` for evidence: (failed attempts since the last call's answer,
        silent backends). Answered at once when there is any."""
        query = f"wait_s={wait_s:g}&silent_after_s={silent_after_s:g}"
        if self._failures is not None:
            query += f"&after={self._failures}"
        answer = await self._call("GET", "/evidence?" + query,
                                  timeout_s=wait_s + (self._timeout.total or CONTROL_TIMEOUT_S))
        self._failures = int(answer["failures"])
        return int(answer["failed"]), {url: float(x) for url, x in answer["silent"].items()}

    async def status(self) -> dict[str, Any]:
        answer: dict[str, Any] = await self._call("GET", "/status")
        return answer

    async def stop_accepting(self) -> None:
        """Close the router's listeners; returns once they are closed (a reload's first
        step: no client told to reconnect may find an old listener)."""
        await self._call("POST", "/stop-accepting")
