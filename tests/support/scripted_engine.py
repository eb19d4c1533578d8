"""A test double for an engine: an aiohttp server that answers with real vLLM captures.

Tests script its behaviour (:meth:`ScriptedEngine.answer`, :meth:`wedge`, :meth:`crash`) and
read what reached it. Its answers are the bytes real vLLM 0.32 sent (``fixtures/vllm/``), so
"passes through unchanged" is checked against the real wire format. It is a stand-in for the
engine only; the router under test is always the real one, on real sockets on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from multidict import CIMultiDict

FIXTURES = Path(__file__).parents[1] / "fixtures" / "vllm"


@dataclass(frozen=True)
class Capture:
    """One response as real vLLM sent it: status, headers and body bytes."""

    status: int
    headers: CIMultiDict[str]
    body: bytes

    @classmethod
    def load(cls, name: str) -> Capture:
        raw = (FIXTURES / name).read_bytes()
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers.add(k.strip(), v.strip())
        return cls(status, headers, body)

    def events(self) -> list[bytes]:
        """The SSE events of a streamed capture, each with its blank line, as sent one by one."""
        return [e + b"\n\n" for e in self.body.split(b"\n\n") if e]


COMPLETION = Capture.load("completions.http")
COMPLETION_STREAM = Capture.load("completions-stream.http")
CHAT = Capture.load("chat.http")
CHAT_STREAM = Capture.load("chat-stream.http")
MODELS = Capture.load("models.http")
ENGINE_DEAD = Capture.load("engine-dead.http")  # vLLM's 500 when its engine core died
UNKNOWN_MODEL = Capture.load("error-unknown-model.http")  # a 404 from the engine itself

_PASSED_HEADERS = ("content-type",)


@dataclass
class Seen:
    """One request as it reached the engine."""

    method: str
    path: str
    headers: CIMultiDict[str]
    body: bytes


@dataclass
class ScriptedEngine:
    """An OpenAI-compatible engine whose behaviour the test sets."""

    received: int = 0  # requests that reached the handler
    answered: int = 0  # requests answered (any status)
    #: The router's reads of ``/kv_event_sources`` (cache-aware routing asks each engine once
    #: per incarnation where it publishes its KV events): counted here alone, not as requests,
    #: so that what a test counts is what it sent, whenever the read happens to land.
    kv_sources_read: int = 0
    held: int = 0  # requests being held by a wedge right now
    cancelled: int = 0  # held requests whose connection the router closed
    seen: list[Seen] = field(default_factory=list)
    keep_seen: bool = True
    _answer: Capture | None = None
    _reset: bool = False
    _stalled: asyncio.Event | None = None
    _stall_after: int = 1
    _wedged: asyncio.Event | None = None
    _runner: web.AppRunner | None = None
    url: str = ""

    async def start(self) -> ScriptedEngine:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # handler_cancellation: a connection the router closes cancels the handler, as a real
        # engine aborts a request whose client went away.
        # shutdown_timeout: a crash cuts the requests in flight at once.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=0.01)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def crash(self) -> None:
        """Stop listening: new connections are refused, requests in flight are cut."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    stop = crash

    # ------------------------------------------------------------------ scripting

    def answer(self, capture: Capture | None) -> None:
        """Answer every request with ``capture``; ``None``: the normal answers again."""
        self._answer = capture

    def answer_status(self, status: int, body: bytes = b'{"error": "scripted"}') -> None:
        self._answer = Capture(status, CIMultiDict({"content-type": "application/json"}), body)

    def reset(self, on: bool = True) -> None:
        """Close each connection after reading the request, without an answer."""
        self._reset = on

    def wedge(self) -> None:
        """Accept requests and hold them without an answer (vLLM with its EngineCore stopped)."""
        if self._wedged is None:
            self._wedged = asyncio.Event()

    def stall_streams(self, after: int = 1) -> None:
        """Send the head and the first ``after`` events of each stream (0: the head alone, as
        vLLM does when its core wedges before the first token), then hold the rest until
        :meth:`unwedge`."""
        self._stall_after = after
        if self._stalled is None:
            self._stalled = asyncio.Event()

    def unwedge(self) -> None:
        """Answer the held requests normally, and every later one."""
        if self._wedged is not None:
            self._wedged.set()
            self._wedged = None
        if self._stalled is not None:
            self._stalled.set()
            self._stalled = None

    # ------------------------------------------------------------------ serving

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path == "/kv_event_sources":  # a scripted engine publishes none
            self.kv_sources_read += 1
            return web.Response(status=404)
        self.received += 1
        if self.keep_seen:
            self.seen.append(Seen(request.method, request.raw_path,
                                  CIMultiDict(request.headers), body))
        if self._reset:
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        wedged = self._wedged
        if wedged is not None:
            self.held += 1
            try:
                await wedged.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            finally:
                self.held -= 1
        response = await self._respond(request, body)
        self.answered += 1
        return response

    async def _respond(self, request: web.Request, body: bytes) -> web.StreamResponse:
        if self._answer is not None:
            return _replay(self._answer)
        path = request.path
        if path == "/metrics":
            return web.Response(text="vllm:num_requests_running 7.0\n")
        if path == "/v1/models":
            return _replay(MODELS)
        if path in ("/v1/completions", "/v1/chat/completions"):
            try:
                stream = bool(json.loads(body).get("stream", False))
            except ValueError:
                stream = False
            chat = path == "/v1/chat/completions"
            if not stream:
                return _replay(CHAT if chat else COMPLETION)
            capture = CHAT_STREAM if chat else COMPLETION_STREAM
            response = web.StreamResponse(status=200, headers=_headers(capture))
            await response.prepare(request)
            for n, event in enumerate(capture.events()):  # one write per event, like an engine
                stalled = self._stalled
                if n == self._stall_after and stalled is not None:
                    await stalled.wait()
                await response.write(event)
            await response.write_eof()
            return response
        return web.json_response({"path": path, "echo": len(body)})


def _headers(capture: Capture) -> dict[str, str]:
    return {k: v for k, v in capture.headers.items() if k.lower() in _PASSED_HEADERS}


def _replay(capture: Capture) -> web.Response:
    return web.Response(status=capture.status, body=capture.body, headers=_headers(capture))
