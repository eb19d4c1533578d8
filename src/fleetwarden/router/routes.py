"""The data port's routes: what each request that reaches a router is answered with.

Owns: :class:`Routes`: the OpenAI API the router forwards (:data:`FORWARDED_POST`,
:data:`FORWARDED_GET`), ``GET /v1/models`` answered from the last push, the router's own
``/metrics`` and 404; and the client keys' gate before them (a key of the file or a 401, the
client's key replaced by the engines' own, each key's tokens counted, the file watched).
Must not: forward a request itself or read the keys file's format: the attempt loop
(:class:`~fleetwarden.router.forward.Forwarder`) forwards, :mod:`fleetwarden.router.keys`
reads and checks the keys.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from fleetwarden.router import serve
from fleetwarden.router.answers import error_response
from fleetwarden.router.forward import Forwarder
from fleetwarden.router.keys import RELOAD_EVERY_S, KeysFile, without_client_key
from fleetwarden.router.models import model_list
from fleetwarden.router.pool import Pool
from fleetwarden.router.settings import GENERATE
from fleetwarden.router.stats import KeyTally, RouterStats

__all__ = ["FORWARDED_GET", "FORWARDED_POST", "Routes"]

log = logging.getLogger("fleetwarden.router")

#: The OpenAI API the router forwards (docs/design.md section 4). Anything else is a 404 here.
FORWARDED_POST: tuple[str, ...] = (
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
    "/tokenize", "/detokenize",
    # vLLM's token-in/token-out endpoint (``--enable-scale-out``), what RL frameworks sample
    # rollouts with: its answers carry the engine's own weight-version spans.
    GENERATE,
)
FORWARDED_GET: tuple[str, ...] = ("/v1/models",)
_POST = frozenset(FORWARDED_POST)
_GET = frozenset(FORWARDED_GET)


class Routes:
    """The handler of one router's data port (:attr:`handler`): the open one, or the one
    behind the client keys when the router checks them."""

    def __init__(self, forwarder: Forwarder, pool: Pool, stats: RouterStats,
                 registry: CollectorRegistry, keys: KeysFile | None,
                 engine_key: str | None) -> None:
        self.forwarder = forwarder
        self.pool = pool
        self.stats = stats
        self.registry = registry
        #: The client keys in force (router/keys.py); ``None``: the data port is open, and its
        #: handler is the one that never looks at a key.
        self.keys = keys
        self._engine_authorization = (None if engine_key is None
                                      else b"Bearer " + engine_key.encode())
        self.handler: Callable[[serve.Request], Awaitable[serve.StreamResponse]] = self.dispatch
        if keys is not None:
            self.handler = self.dispatch_keyed
            forwarder.relay.count_usage = True
            forwarder.attempts.engine_keys_always = True

    def dispatch(self, request: serve.Request) -> Awaitable[serve.StreamResponse]:
        """The data port's routes: the OpenAI API forwarded, the router's own /metrics, and a
        404 for anything else (a known path asked with another method included). Returns the
        forwarding coroutine itself: one coroutine fewer on every request's way."""
        method, path = request.method, request.path
        if method == "GET" and path == "/v1/models":
            listed = self.model_list()
            if listed is not None:
                return self._answer_models(listed)
        if ((method == "POST" and path in _POST) or (method == "GET" and path in _GET)):
            return self.forwarder.forward(request)
        return self._own(request)

    def dispatch_keyed(self, request: serve.Request) -> Awaitable[serve.StreamResponse]:
        """:meth:`dispatch` behind the client keys (router/keys.py): the router's /metrics is
        open (as vLLM's is); anything else needs a key of the file, or is answered 401. The
        client's key goes no further: toward the engines it is replaced by theirs, and the
        query string is dropped."""
        method, path = request.method, request.path
        if method == "GET" and path == "/metrics":
            return self._own(request)
        assert self.keys is not None
        presented: bytes | None = None
        why = "missing"
        for name, value in request.raw_headers:
            if name.lower() == b"authorization":
                if presented is not None:
                    why = "ambiguous"  # two credentials: which one is meant is not guessed
                    break
                presented, why = value, "wrong"
        else:
            key = None if presented is None else self.keys.ring.name_for(presented)
            if key is not None:
                request.raw_headers[:] = without_client_key(request.raw_headers,
                                                            self._engine_authorization)
                if "?" in request.raw_path:
                    # Nor does a query string go on: a key put there (the client's, or
                    # another's) would be in the engine's access log. The API the router
                    # forwards takes nothing from one.
                    request.raw_path = request.raw_path.partition("?")[0]
                tally = self.stats.key(key)
                tally.requests += 1
                if method == "GET" and path == "/v1/models":
                    listed = self.model_list()
                    if listed is not None:
                        return self._answer_models(listed)
                if (method == "POST" and path in _POST) or (method == "GET" and path in _GET):
                    return self._counted(request, tally)
                return self._own(request)
        return self._refuse_key(request, why)

    async def _counted(self, request: serve.Request, tally: KeyTally) -> serve.StreamResponse:
        """Forward, then add the answer's tokens to its key's tally: a stream's as the
        forwarder counted them, a whole answer's from its ``usage``."""
        response = await self.forwarder.forward(request)
        usage = response.usage
        if usage is None and isinstance(response, serve.Response) and response.status == 200:
            usage = _usage_of(response.body)
        if usage is not None:
            tally.prompt_tokens += usage[0]
            tally.completion_tokens += usage[1]
        return response

    async def _refuse_key(self, request: serve.Request, why: str) -> serve.StreamResponse:
        """401 in OpenAI's shape (``invalid_api_key``), with ``WWW-Authenticate: Bearer``.
        Nothing the client sent is repeated in it."""
        refusals = self.stats.key_refusals
        refusals[why] = refusals.get(why, 0) + 1
        self.stats.responded(401)
        message = {
            "missing": "No API key: send one as 'Authorization: Bearer <key>'.",
            "wrong": "Incorrect API key: no key of this router has that value.",
            "ambiguous": "More than one Authorization header: send one key.",
        }[why]
        if why == "missing" and "?" in request.raw_path:
            message += " A key in the query string is never read."
        return error_response(401, message, "invalid_request_error",
                              {"WWW-Authenticate": 'Bearer realm="fleetwarden"'},
                              code="invalid_api_key")

    def reload_keys(self) -> bool:
        """Reread the keys file if it changed (:class:`KeysFile`); whether the keys changed."""
        return self.keys is not None and self.keys.reload_if_changed()

    async def watch_keys(self) -> None:
        """Look at the keys file every :data:`RELOAD_EVERY_S`: a key added or removed is in
        force without a restart (owned by :meth:`Router.start
        <fleetwarden.router.app.Router.start>`, ended by its ``stop``)."""
        while True:
            await asyncio.sleep(RELOAD_EVERY_S)
            try:
                self.reload_keys()
            except Exception:
                # The watch never ends the data port: the keys in force stay in force.
                log.exception("rereading the keys file failed")

    def model_list(self) -> dict[str, Any] | None:
        """``GET /v1/models`` as this router answers it: every model that the backends it may
        use serve, each once (:func:`~fleetwarden.router.models.model_list`), from what the
        last push said of them. ``None`` when it named none: the request is then forwarded to
        one backend, as a router whose pushes carry no models (an older controller, a
        fleet's first moments) always did."""
        cards = [facts.models for facts in map(self.pool.facts, self.pool.serving)
                 if facts.models is not None]
        return model_list(cards, int(time.time())) if cards else None

    async def _answer_models(self, listed: dict[str, Any]) -> serve.StreamResponse:
        self.stats.responded(200)
        return serve.Response(body=json.dumps(listed).encode(), content_type="application/json")

    async def _own(self, request: serve.Request) -> serve.StreamResponse:
        """What the router answers itself: its /metrics, or a 404."""
        method, path = request.method, request.path
        if method == "GET" and path == "/metrics":
            return serve.Response(body=generate_latest(self.registry),
                                  headers={"Content-Type": CONTENT_TYPE_LATEST})
        self.stats.responded(404)
        return error_response(
            404, f"No route for {method} {path}: the router serves "
            "POST " + ", ".join(FORWARDED_POST) + "; GET " + ", ".join(FORWARDED_GET)
            + " and its own /metrics.", "not_found")


#: A whole answer's token counts, in its ``usage`` object (a search each: no alternation).
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


def _usage_of(body: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens of a whole OpenAI answer, from its ``usage``; ``None``
    without one. Searched for after its last ``"usage":`` (vLLM writes it last), not parsed:
    the answer is not read as JSON on the request path. An embedding's usage has no
    completion tokens: 0."""
    at = body.rfind(b'"usage":')
    if at < 0:
        return None
    prompt = _PROMPT_TOKENS.search(body, at, at + 512)
    completion = _COMPLETION_TOKENS.search(body, at, at + 512)
    return (0 if prompt is None else int(prompt.group(1)),
            0 if completion is None else int(completion.group(1)))
