"""The router's HTTP/1.1 server on its data port: connections on the event loop's own
protocols, requests parsed by httptools (llhttp, the parser uvicorn and Node use).

Owns: the data port's connections: parsing requests, handing each to the router's handler in
order, writing its answer, keep-alive, the drain's ``Connection: close``, and cancelling a
handler whose client has gone.
Must not: route or decide anything about a request: :mod:`fleetwarden.router.app` dispatches
and :mod:`fleetwarden.router.forward` forwards.

Why not aiohttp's server: it was ~40 % of a router process's CPU per request once the client
was the router's own (BENCHMARKS.md, "The router's own data path"): a request object with lazy
properties, a payload writer, a response with its signals and a task loop per connection. The
data port needs a small part of it: the OpenAI API's few routes, bodies buffered whole (so they
can be re-sent), answers written whole or as a stream. The control API and the admin API stay
on aiohttp (they are not on the request path). The parsing is llhttp's, never hand-written.

The rules it keeps, as aiohttp did for the router:

* One request at a time per connection, in the order they came (pipelined ones wait).
* A client that goes cancels its handler (and with it the engine's request: it aborts).
* A body over ``max_body_bytes`` is not kept: :meth:`Request.read` raises
  :class:`BodyTooLarge` (the handler answers 413, and the connection closes after it);
  ``Expect: 100-continue`` is answered as the headers arrive, unless the length announced is
  over the limit.
* A request that cannot be parsed is answered 400, a head over ``max_head_bytes`` or with more
  than ``max_headers`` fields 431, and the connection is closed. So is one the router will not
  read unambiguously (no ``Host`` or two, a target not in origin form, a second ``Connection``
  header, an ``Upgrade``): 400, in its turn after the answers before it.
* Trailers are read and dropped, never merged into the headers (the body was already taken).
* Each connection has one deadline at a time (a sweep, not a timer per request, checks them):
  its head within ``client_head_timeout_s`` (408), its next request on a kept-alive one within
  ``client_idle_timeout_s`` (closed), and an answer's writes make progress within
  ``client_write_timeout_s`` (dropped: its handler is cancelled, the engine aborts).
* Pipelined requests: the next is read only when there is room (reading pauses once more than
  one waits its turn, and resumes as they are taken), and ``100 Continue`` goes only to the
  request being served.
* At most ``max_client_connections`` connections: past it the longest-idle one is closed to make
  room, or, when none is idle, the new one is answered 503 and closed.
* An answer the handler left unfinished is finished (a stream's last chunk), or the connection
  closed where it cannot be (the client then sees an incomplete answer, never a false end).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import resource
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import cast
from urllib.parse import unquote

import httptools

from fleetwarden.router.settings import RouterSettings

__all__ = ["MAX_HEAD_BYTES", "BodyTooLarge", "Headers", "MalformedBody", "RawHeaders", "Request",
           "Response", "Server", "StreamResponse", "error_body", "http_url", "listening_url"]

#: Headers as they go on the wire: (name, value) bytes, in order, names as sent.
RawHeaders = list[tuple[bytes, bytes]]

log = logging.getLogger("fleetwarden.router")

_DEFAULTS = RouterSettings()
#: The most bytes a request's line and headers may take, unless the server is told otherwise.
MAX_HEAD_BYTES = _DEFAULTS.max_head_bytes
#: Reading pauses once more than this many requests wait their turn on a connection (the one
#: being served not counted once its handler has taken it). One: the next request is ready
#: when its turn comes, and a client that pipelines without reading its answers holds a
#: request or two more, never a queue (h11's servers read nothing past the request being
#: served). What one read of the socket brought is parsed whole (llhttp cannot stop inside
#: it), so a read of small requests, 256 KiB at most, may queue more before the pause.
_READ_AHEAD = 1
#: Seconds a refused connection is still read (and what comes discarded) after its answer,
#: before it is closed: closing a socket with unread bytes in it resets the connection, the
#: client's send then fails, and a client that sends its whole request before it reads
#: (http.client does) never sees the answer (nginx's ``lingering_close``, whose
#: ``lingering_timeout`` is 5 s; a refusal is short, so less is enough).
_LINGER_S = 2.0
#: The sweep of the connections' deadlines runs this often at most (and at least four times
#: within the shortest timeout): a deadline holds to within it.
_SWEEP_EVERY_S = 0.5


class BodyTooLarge(Exception):
    """The request's body is larger than the router takes."""


class MalformedBody(ConnectionError):
    """The request's body cannot be parsed (a bad chunk): nothing more is read from its
    connection, which ends with a 400 (a connection error, so a handler that reads the body
    ends as if the client had gone, and the refusal is said in its place)."""


def error_body(status: int, message: str, error_type: str, **extra: object) -> bytes:
    """A JSON error in the OpenAI shape (``{"error": {...}}``), with extra fields if given."""
    error = {"message": message, "type": error_type, "param": None, "code": status, **extra}
    return json.dumps({"error": error}).encode()


_date: tuple[int, bytes] = (0, b"")


def _http_date() -> bytes:
    """The Date header's value, made once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, formatdate(now, usegmt=True).encode("ascii"))
    return _date[1]


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


class Headers(Mapping[str, str]):
    """A request's headers as a case-insensitive mapping over the raw pairs, decoded as read
    (the first of a repeated name, as ``CIMultiDict.get`` gives). A request carries a handful:
    a lookup scans them, which costs less than building a dictionary every request."""

    __slots__ = ("_raw",)

    def __init__(self, raw: RawHeaders) -> None:
        self._raw = raw

    def __getitem__(self, name: str) -> str:
        wanted = name.lower().encode("latin-1")
        for key, value in self._raw:
            if key.lower() == wanted:
                return value.decode("utf-8", "surrogateescape")
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        seen: set[bytes] = set()
        for key, _ in self._raw:
            lowered = key.lower()
            if lowered not in seen:
                seen.add(lowered)
                yield key.decode("latin-1")

    def __len__(self) -> int:
        return len({key.lower() for key, _ in self._raw})


class Request:
    """One request as it came: its line and headers, and its body as it arrives."""

    __slots__ = ("_body", "_complete", "_connection", "_headers", "_limit", "_malformed", "_size",
                 "_waiter",
                 "content_length", "expects_continue", "keep_alive", "method", "path",
                 "raw_headers", "raw_path", "too_large", "version")

    def __init__(self, connection: _ClientConnection, method: str, raw_path: str,
                 raw_headers: RawHeaders, content_length: int | None, keep_alive: bool,
                 version: str, limit: int) -> None:
        self._connection = connection
        self.method = method
        #: The request target exactly as the client sent it (path and query, encoded).
        self.raw_path = raw_path
        #: The path, percent-decoded, without the query: what routes match.
        self.path = unquote(raw_path.partition("?")[0]) if "%" in raw_path or "?" in raw_path \
            else raw_path
        #: The headers as they came (names as sent).
        self.raw_headers = raw_headers
        self._headers: Headers | None = None
        self.keep_alive = keep_alive
        self.version = version
        self.content_length = content_length
        self._limit = limit
        self.too_large = content_length is not None and content_length > limit
        self._body: bytes | bytearray = b""
        self._size = 0
        #: ``Expect: 100-continue`` still to be answered when this request's turn comes.
        self.expects_continue = False
        self._complete = False
        self._malformed = False
        self._waiter: asyncio.Future[None] | None = None

    @property
    def headers(self) -> Headers:
        """The headers, read case-insensitively (a view of :attr:`raw_headers`: nothing is
        decoded until it is read)."""
        if self._headers is None:
            self._headers = Headers(self.raw_headers)
        return self._headers

    @property
    def transport(self) -> asyncio.Transport | None:
        """The client's connection (None once it is gone)."""
        return self._connection.transport

    @property
    def body_arrived(self) -> bool:
        """The whole body is here: reading it cannot wait."""
        return self._complete

    async def read(self) -> bytes:
        """The whole body. Raises :class:`BodyTooLarge` past the router's limit."""
        while not self._complete and not self.too_large:
            if self._malformed:
                raise MalformedBody("the request's body cannot be parsed")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.too_large:
            raise BodyTooLarge()
        return self._body if isinstance(self._body, bytes) else bytes(self._body)

    def _feed(self, data: bytes) -> None:
        if self.too_large:
            return  # not kept: the answer is a 413 and the connection closes after it
        self._size += len(data)
        if self._size > self._limit:
            self.too_large = True
            self._body = b""
            self._wake()
            return
        # The first piece as it came (a small body arrives in one), then one growing buffer,
        # not a list of pieces: a body sent as 2-byte chunks would cost a bytes object
        # (~35 bytes) per 2 bytes kept.
        if not self._body:
            self._body = data
        elif isinstance(self._body, bytes):
            self._body = bytearray(self._body) + data
        else:
            self._body += data

    def _end(self) -> None:
        self._complete = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def _raw(headers: Mapping[str, str] | RawHeaders | None) -> RawHeaders:
    if headers is None:
        return []
    if isinstance(headers, list):
        return headers
    return [(k.encode("latin-1"), v.encode("utf-8", "surrogateescape"))
            for k, v in headers.items()]


class StreamResponse:
    """An answer written as it comes: its head at :meth:`prepare`, then each :meth:`write`.
    ``headers``: names and values, or raw (bytes) pairs as they go on the wire; the framing
    ones (Content-Length aside, Transfer-Encoding, Connection, Keep-Alive) are the server's."""

    #: (prompt, completion) tokens of a stream the forwarder read event by event, when it is
    #: asked to count them (keys on the data port); a class default, so that an answer of a
    #: router that counts nothing never sets it.
    usage: tuple[int, int] | None = None

    def __init__(self, status: int = 200, reason: str | None = None,
                 headers: Mapping[str, str] | RawHeaders | None = None) -> None:
        self.status = status
        self.reason = reason
        self.raw_headers = _raw(headers)
        self.prepared = False
        self.finished = False
        self._request: Request | None = None
        self._chunked = False

    async def prepare(self, request: Request) -> None:
        """Write the head. Raises ConnectionResetError if the client has gone."""
        if self.prepared:
            return
        connection = request._connection
        self._request = request
        self.prepared = True
        framing = b""
        if not any(k.lower() == b"content-length" for k, _ in self.raw_headers):
            if request.version == "1.1" and request.method != "HEAD":
                self._chunked = True
                framing = b"Transfer-Encoding: chunked\r\n"
            else:
                connection.close_after = True  # delimited by the close (an HTTP/1.0 client)
        connection.send(_head(self, framing, connection.closing(request)))

    async def write(self, data: bytes) -> None:
        """Send ``data``; waits while the client is slow. Raises ConnectionResetError if it has
        gone."""
        request = self._request
        assert request is not None, "prepare() first"
        if not data or request.method == "HEAD":
            return
        connection = request._connection
        if self._chunked:
            connection.send(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            connection.send(data)
        await connection.drained()

    async def write_eof(self) -> None:
        if self.finished:
            return
        self.finished = True
        request = self._request
        if request is not None and self._chunked:
            request._connection.send(b"0\r\n\r\n")


class Response(StreamResponse):
    """A whole answer: head and body go out in one write at :meth:`prepare` (its
    Content-Length is the server's)."""

    def __init__(self, status: int = 200, reason: str | None = None, body: bytes = b"",
                 headers: Mapping[str, str] | RawHeaders | None = None,
                 content_type: str | None = None) -> None:
        super().__init__(status, reason, headers)
        self.body = body
        if content_type is not None:
            self.raw_headers = [*self.raw_headers,
                                (b"Content-Type", content_type.encode("latin-1"))]

    async def prepare(self, request: Request) -> None:
        if self.prepared:
            return
        self.prepared = self.finished = True
        self._request = request
        connection = request._connection
        head = _head(self, b"Content-Length: %d\r\n" % len(self.body),
                     connection.closing(request), _FRAMING_WHOLE)
        connection.send(head if request.method == "HEAD" else head + self.body)

    async def write_eof(self) -> None:
        pass


#: Headers the server writes itself, never as a handler gave them.
_FRAMING = frozenset({b"connection", b"keep-alive", b"transfer-encoding"})
_FRAMING_WHOLE = _FRAMING | {b"content-length"}


def _head(response: StreamResponse, framing: bytes, close: bool,
          dropped: frozenset[bytes] = _FRAMING) -> bytes:
    status = response.status
    reason = response.reason if response.reason is not None else _reason(status)
    lines = [b"HTTP/1.1 %d %b\r\n" % (status, reason.encode("latin-1", "replace"))]
    dated = False
    for name, value in response.raw_headers:
        lowered = name.lower()
        if lowered in dropped:
            continue
        if lowered == b"date":
            dated = True
        lines += (name, b": ", value, b"\r\n")
    if not dated:
        lines += (b"Date: ", _http_date(), b"\r\n")
    lines.append(framing)
    lines.append(b"Connection: close\r\n\r\n" if close else b"\r\n")
    return b"".join(lines)


Handler = Callable[[Request], Awaitable[StreamResponse]]


class Server:
    """The protocol factory for one router's listeners: every connection, what it serves
    with, and the limits each connection is held to (``settings``: the router's)."""

    def __init__(self, handler: Handler, *, max_body_bytes: int,
                 settings: RouterSettings = _DEFAULTS,
                 closed_for: dict[str, int] | None = None) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.max_head_bytes = settings.max_head_bytes
        self.max_headers = settings.max_headers
        self.head_timeout_s = settings.client_head_timeout_s
        self.idle_timeout_s = settings.client_idle_timeout_s
        self.write_timeout_s = settings.client_write_timeout_s
        self.max_connections = settings.max_client_connections or _half_the_open_file_limit()
        self.connections: set[_ClientConnection] = set()
        #: Every answer from now on says ``Connection: close``, and its connection closes after
        #: it (a drain: the client's next request goes to another router).
        self.draining = False
        #: Connections the server ended itself, by reason (the limits at work: the router's
        #: stats pass theirs, which its /metrics shows).
        self.closed_for: dict[str, int] = {} if closed_for is None else closed_for
        for reason in ("head_timeout", "idle_timeout", "write_timeout", "over_capacity",
                       "evicted_idle", "head_too_large", "refused"):
            self.closed_for.setdefault(reason, 0)
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_every_s = min(_SWEEP_EVERY_S, self.head_timeout_s / 4,
                                  self.idle_timeout_s / 4, self.write_timeout_s / 4)

    def __call__(self) -> _ClientConnection:
        return _ClientConnection(self)

    async def shutdown(self, grace_s: float) -> None:
        """Let the requests being served finish for up to ``grace_s``, then cancel what is
        left and close every connection."""
        self.draining = True  # what is still answered says close; idle connections go now
        for connection in list(self.connections):
            connection.close_idle()
        deadline = asyncio.get_running_loop().time() + grace_s
        while any(c.task is not None for c in self.connections):
            if asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.05)
        tasks = [c.task for c in self.connections if c.task is not None]
        for connection in list(self.connections):
            connection.abort()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    # -- the connections' deadlines
    def _admit(self, connection: _ClientConnection) -> bool:
        """Whether ``connection`` may be served: under the cap, or once the longest-idle
        connection made room (an idle one costs a descriptor and serves nobody)."""
        if len(self.connections) >= self.max_connections:
            idle = [c for c in self.connections if c.idle]
            if not idle:
                self.closed_for["over_capacity"] += 1
                return False
            oldest = min(idle, key=lambda c: c.idle_since)  # unstamped: idle since now
            self.closed_for["evicted_idle"] += 1
            oldest.abort()
            self.connections.discard(oldest)
        self.connections.add(connection)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self._sweep_every_s,
                                                                self._sweep_deadlines)
        return True

    def _sweep_deadlines(self) -> None:
        """End what is past its deadline; again while any connection is open."""
        self._sweep = None
        now = asyncio.get_running_loop().time()
        for connection in [c for c in self.connections
                           if c.deadline <= now or c.write_deadline <= now]:
            if connection.deadline == _UNSTAMPED:
                # Set on the request path without a clock read (one per request was 2-3 % of
                # a request's CPU): the wait is timed from here, within one sweep of its start.
                connection.deadline = now + (self.idle_timeout_s
                                             if connection.deadline_for == _IDLE
                                             else self.head_timeout_s)
                connection.idle_since = now
            else:
                connection.expire(now)
        if self.connections:
            self._sweep = asyncio.get_running_loop().call_later(self._sweep_every_s,
                                                                self._sweep_deadlines)


def _half_the_open_file_limit() -> int:
    """Half the process's soft ``RLIMIT_NOFILE``: the other half is for its engine
    connections (one per request in flight) and its own files."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(1, soft // 2)


#: What a connection's single deadline is for (:attr:`_ClientConnection.deadline`).
_HEAD, _IDLE, _LINGER, _NONE = "head", "idle", "linger", "none"
#: A deadline the next sweep sets (see :meth:`Server._sweep_deadlines`).
_UNSTAMPED = -1.0


class _ClientConnection(asyncio.Protocol):
    """One client connection: parses its requests and serves them one at a time."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        #: Requests in their turn; a refusal (an answer that ends the connection) in its place.
        self.queue: deque[Request | Response] = deque()
        self.task: asyncio.Task[None] | None = None
        self.parsing: Request | None = None
        self.close_after = False
        self._url: list[bytes] = []
        self._raw_headers: list[tuple[bytes, bytes]] = []
        #: Bytes fed while a head is being read (the parser buffers a partial line itself).
        self._head_bytes = 0
        #: Between two requests' heads: the next bytes begin a head (trailers aside).
        self._in_head = True
        self._writable: asyncio.Future[None] | None = None
        self._paused = False
        self._reading_paused = False
        self._broken = False
        #: The one deadline of the connection's read side and what it is for; ``write_deadline``
        #: is the write side's while the client does not read (``inf``: none).
        self.deadline = math.inf
        self.deadline_for = _NONE
        self.write_deadline = math.inf
        self.idle_since = math.inf

    # -- what the drain and the cap read
    @property
    def busy(self) -> bool:
        """A request is being served or waits its turn on this connection (or is arriving)."""
        return self.task is not None or bool(self.queue) or self.parsing is not None

    @property
    def idle(self) -> bool:
        """Nothing served, nothing of a request received: closing it loses nobody anything."""
        return not self.busy and self._head_bytes == 0 and not self._broken

    def close_idle(self) -> None:
        if not self.busy and self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def expire(self, now: float) -> None:
        """A deadline passed (the server's sweep)."""
        if self.write_deadline <= now:
            # The client stopped reading: let it go. Its handler is cancelled as the connection
            # is lost, and the engine's request with it; nothing is counted against the engine.
            self.server.closed_for["write_timeout"] += 1
            self.write_deadline = math.inf
            self.abort()
            return
        what, self.deadline, self.deadline_for = self.deadline_for, math.inf, _NONE
        if what == _IDLE:
            self.server.closed_for["idle_timeout"] += 1
            if self.transport is not None:
                self.transport.close()
        elif what == _LINGER:
            self.abort()
        elif what == _HEAD:
            self.server.closed_for["head_timeout"] += 1
            self._refuse(408, "The request's head did not arrive within "
                         f"{self.server.head_timeout_s:g} s.", "request_timeout", "head_timeout")

    def _wait_for(self, what: str, timeout_s: float) -> None:
        now = asyncio.get_running_loop().time()
        self.deadline, self.deadline_for = now + timeout_s, what
        if what == _IDLE:
            self.idle_since = now

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if not self.server._admit(self):
            body = error_body(503, "The router holds as many connections as it may; try again "
                              "later.", "over_capacity")
            response = Response(503, body=body, content_type="application/json")
            self._broken = True
            self._linger(_head(response, b"Content-Length: %d\r\n" % len(body), True) + body,
                         timer=True)
            return
        # A new connection is idle until its first byte; its first head is due within the head
        # timeout all the same (a connection that never sends is a slowloris too).
        self._wait_for(_HEAD, self.server.head_timeout_s)
        self.idle_since = self.deadline - self.server.head_timeout_s

    def data_received(self, data: bytes) -> None:
        if self._broken:
            return
        if self._in_head:
            if self.deadline_for == _IDLE:  # the first byte of the next request
                self.deadline, self.deadline_for = _UNSTAMPED, _HEAD
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "Protocol upgrades are not served here.", "invalid_request_error")
        except httptools.HttpParserError as exc:
            if not self._broken:
                self._refuse(400, f"Malformed HTTP request: {exc}.", "invalid_request_error")
        else:
            # llhttp keeps a line that has not ended itself, without bound: the bytes fed
            # since the head began are what it holds.
            if self._in_head and self._head_bytes > self.server.max_head_bytes:
                self._too_large_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        self.queue.clear()
        if self.parsing is not None:
            self.parsing._wake()
        if self.task is not None:
            self.task.cancel()  # the client left: its handler (and the engine's request) ends
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(ConnectionResetError("the client has gone"))

    def pause_writing(self) -> None:
        self._paused = True
        self.write_deadline = (asyncio.get_running_loop().time()
                               + self.server.write_timeout_s)

    def resume_writing(self) -> None:
        self._paused = False
        self.write_deadline = math.inf  # the client read: progress
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self._url = []
        self._raw_headers = []
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        self._url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_head:  # else a trailer (after a chunked body): dropped, never a header
            self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._broken:
            return
        self._in_head = False
        self.deadline = math.inf  # the body's time is the handler's
        parser = self.parser
        raw = self._raw_headers
        url = self._url[0] if len(self._url) == 1 else b"".join(self._url)
        server = self.server
        # The bytes fed bound the head: its exact size is summed only when they are over.
        # (A head that follows another request within one read is counted from the next
        # read on: it may pass the limit by what one read holds, 256 KiB at most.)
        if self._head_bytes > server.max_head_bytes and len(url) + sum(
                len(k) + len(v) + 4 for k, v in raw) > server.max_head_bytes:
            self._too_large_head()
            return
        if len(raw) > server.max_headers:
            self._refuse(431, f"More than {server.max_headers} header fields.",
                         "request_header_fields_too_large", "head_too_large")
            return
        length: int | None = None
        expect = False
        hosts = connections = 0
        upgrade = False
        coding = None
        watching = _WATCHED.get
        for name, value in raw:
            watched = watching(name.lower())
            if watched is None:
                continue
            if watched is _LENGTH:
                length = int(value) if value.isdigit() else None
            elif watched is _HOST:
                hosts += 1
            elif watched is _CONNECTION:
                connections += 1
            elif watched is _EXPECT:
                expect = value.lower() == b"100-continue"
            elif watched is _UPGRADE:
                upgrade = True
            else:
                coding = value if coding is None else coding + b"," + value
        if coding is not None and coding.strip().lower() != b"chunked":
            # A coding the router would have to undo before it re-frames the body (RFC 9112
            # section 6.1: 501); llhttp takes "gzip, chunked" as chunked and would pass gzip on.
            self._refuse(501, "Transfer-Encoding other than chunked is not served here.",
                         "not_implemented")
            return
        version = parser.get_http_version()
        if hosts != 1 or connections > 1 or upgrade or url[:1] != b"/":
            problem = _ambiguity(url, version, hosts, connections, upgrade)
            if problem is not None:
                self._refuse(400, problem, "invalid_request_error")
                return
        request = Request(self, parser.get_method().decode("ascii"),
                          url.decode("ascii", "surrogateescape"), raw, length,
                          parser.should_keep_alive(), version, self.server.max_body_bytes)
        self.parsing = request
        if expect and not request.too_large and version == "1.1":
            if self.task is None and not self.queue:
                self.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            else:  # an answer is being written: a 100 now would land inside it
                request.expects_continue = True
        self.queue.append(request)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._serve())

    def on_body(self, body: bytes) -> None:
        if self.parsing is not None:
            self.parsing._feed(body)

    def on_message_complete(self) -> None:
        request = self.parsing
        self.parsing = None
        self._in_head = True
        self._head_bytes = 0
        if request is not None:
            request._end()
        if len(self.queue) > _READ_AHEAD and not self._reading_paused \
                and self.transport is not None and not self.transport.is_closing():
            # Enough is waiting its turn: the next request is read when there is room.
            self._reading_paused = True
            self.transport.pause_reading()

    # -- serving
    def closing(self, request: Request) -> bool:
        """Whether the connection closes after the answer to ``request`` (said in its head)."""
        if self.server.draining or not request.keep_alive or request.too_large:
            self.close_after = True
        return self.close_after

    def send(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client has gone")
        transport.write(data)

    async def drained(self) -> None:
        """Wait while more than the high-water mark is buffered for a slow client."""
        if self._paused:
            if self._writable is None or self._writable.done():
                self._writable = asyncio.get_running_loop().create_future()
            await self._writable

    def _resume_reading(self) -> None:
        """There is room again: the next request is read (unless nothing more is to be)."""
        if not self._broken and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()

    async def _serve(self) -> None:
        try:
            queue = self.queue
            while queue and self.transport is not None:
                request = queue.popleft()
                if self._reading_paused and not queue:
                    self._resume_reading()
                if isinstance(request, Response):  # a refusal in its turn: said, then closed
                    self._linger(request.body)
                    return
                if request.expects_continue and not request._complete:
                    self.send(b"HTTP/1.1 100 Continue\r\n\r\n")
                try:
                    response = await self.server.handler(request)
                except (asyncio.CancelledError, ConnectionError):
                    raise
                except Exception:
                    log.exception("the router failed to answer %s %s", request.method,
                                  request.path)
                    response = Response(500, body=error_body(
                        500, "The router failed to answer this request.", "router_error"),
                        content_type="application/json")
                    self.close_after = True
                try:
                    if not response.prepared:
                        await response.prepare(request)
                    await response.write_eof()
                except ConnectionError:
                    return
                if not request._complete:
                    self.close_after = True  # the rest of its body was never read
                if self.close_after:
                    if self.transport is not None:
                        self.transport.close()
                    return
        except ConnectionError:
            pass
        finally:
            self.task = None
            if self.queue and self.transport is not None:  # came while this one ended
                self.task = asyncio.get_running_loop().create_task(self._serve())
            elif self.parsing is None and self._in_head and not self._broken:
                # Answered: the next request is awaited for the idle timeout, or, when some of
                # its head is here already, for the head timeout.
                self.deadline = _UNSTAMPED
                self.deadline_for = _HEAD if self._head_bytes else _IDLE

    def _too_large_head(self) -> None:
        self._refuse(431, f"The request line and headers are over {self.server.max_head_bytes} "
                     "bytes.", "request_header_fields_too_large", "head_too_large")

    def _refuse(self, status: int, message: str, error_type: str,
                reason: str = "refused") -> None:
        """Answer a request that cannot be served at all, in its turn (after the answers to
        the requests before it), and close. Nothing more is read from the connection."""
        if self._broken:
            return
        self._broken = True
        if reason != "head_timeout":
            self.server.closed_for[reason] += 1
        self.deadline, self.deadline_for = math.inf, _NONE
        if self.parsing is not None:  # its handler may wait for the rest of its body
            self.parsing._malformed = True
            self.parsing._wake()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not self._reading_paused:
            self._reading_paused = True
            transport.pause_reading()
        body = error_body(status, message, error_type)
        response = Response(status, body=body, content_type="application/json")
        response.body = _head(response, b"Content-Length: %d\r\n" % len(body), True) + body
        if self.task is None and not self.queue:
            self._linger(response.body)
        else:
            self.queue.append(response)

    def _linger(self, answer: bytes, *, timer: bool = False) -> None:
        """Send the last ``answer``, end the writing side, and read (discarding) until the
        client closes or :data:`_LINGER_S` passes: a close with unread bytes would reset the
        connection, and a client still sending would fail before it reads the answer.
        ``timer``: the connection is not in the server's sweep (over the cap), so the close
        has a timer of its own."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(answer)
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        if timer:
            asyncio.get_running_loop().call_later(_LINGER_S, transport.abort)
        else:
            self._wait_for(_LINGER, _LINGER_S)
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()


#: The request headers the server reads itself (one lookup per header, then a branch).
_LENGTH, _HOST, _CONNECTION, _EXPECT, _UPGRADE, _CODING = range(6)
_WATCHED = {b"content-length": _LENGTH, b"host": _HOST, b"connection": _CONNECTION,
            b"expect": _EXPECT, b"upgrade": _UPGRADE, b"transfer-encoding": _CODING}


def _ambiguity(url: bytes, version: str, hosts: int, connections: int,
               upgrade: bool) -> str | None:
    """Why a parsed request is refused rather than read one way of two (RFC 9112 section 3.2:
    a 1.1 request without exactly one Host is answered 400), or ``None``."""
    if version == "1.1" and hosts != 1:
        return ("An HTTP/1.1 request needs exactly one Host header, got "
                f"{hosts}.")
    if hosts > 1:
        return f"A request may carry one Host header, got {hosts}."
    if not url.startswith(b"/"):
        return "The request target must be a path (origin form): the router is not a proxy."
    if connections > 1:
        return "A request may carry one Connection header: two can be read two ways."
    if upgrade:
        return "Protocol upgrades (h2c, WebSocket) are not served here: HTTP/1.1 only."
    return None


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 host in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def listening_url(servers: Iterable[asyncio.Server]) -> str:
    """The URL the first listener of ``servers`` listens on."""
    for server in servers:
        for sock in server.sockets:
            host, port = sock.getsockname()[:2]
            return http_url(host, port)
    raise RuntimeError("not listening")
