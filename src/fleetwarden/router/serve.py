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
* A request that cannot be parsed is answered 400, headers over :data:`MAX_HEAD_BYTES` 431,
  and the connection is closed.
* An answer the handler left unfinished is finished (a stream's last chunk), or the connection
  closed where it cannot be (the client then sees an incomplete answer, never a false end).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import cast
from urllib.parse import unquote

import httptools

__all__ = ["MAX_HEAD_BYTES", "BodyTooLarge", "Headers", "RawHeaders", "Request", "Response",
           "Server", "StreamResponse", "error_body", "http_url", "listening_url"]

#: Headers as they go on the wire: (name, value) bytes, in order, names as sent.
RawHeaders = list[tuple[bytes, bytes]]

log = logging.getLogger("fleetwarden.router")

#: The most bytes a request's line and headers may take (aiohttp's limit was 8190 a line).
MAX_HEAD_BYTES = 64 * 1024


class BodyTooLarge(Exception):
    """The request's body is larger than the router takes."""


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

    __slots__ = ("_body", "_complete", "_connection", "_headers", "_limit", "_size", "_waiter",
                 "content_length", "keep_alive", "method", "path", "raw_headers", "raw_path",
                 "too_large", "version")

    def __init__(self, connection: _Connection, method: str, raw_path: str,
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
        self._body: list[bytes] = []
        self._size = 0
        self._complete = False
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
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.too_large:
            raise BodyTooLarge()
        return self._body[0] if len(self._body) == 1 else b"".join(self._body)

    def _feed(self, data: bytes) -> None:
        if self.too_large:
            return  # not kept: the answer is a 413 and the connection closes after it
        self._size += len(data)
        if self._size > self._limit:
            self.too_large = True
            self._body.clear()
            self._wake()
            return
        self._body.append(data)

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
    """The protocol factory for one router's listeners: every connection, and what it serves
    with."""

    def __init__(self, handler: Handler, *, max_body_bytes: int) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.connections: set[_Connection] = set()
        #: Every answer from now on says ``Connection: close``, and its connection closes after
        #: it (a drain: the client's next request goes to another router).
        self.draining = False

    def __call__(self) -> _Connection:
        return _Connection(self)

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


class _Connection(asyncio.Protocol):
    """One client connection: parses its requests and serves them one at a time."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.parsing: Request | None = None
        self.close_after = False
        self._url: list[bytes] = []
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._writable: asyncio.Future[None] | None = None
        self._paused = False
        self._broken = False

    # -- what the drain reads
    @property
    def busy(self) -> bool:
        """A request is being served or waits its turn on this connection (or is arriving)."""
        return self.task is not None or bool(self.queue) or self.parsing is not None

    def close_idle(self) -> None:
        if not self.busy and self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._broken:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "Protocol upgrades are not served here.", "invalid_request_error")
        except httptools.HttpParserError as exc:
            if not self._broken:
                self._refuse(400, f"Malformed HTTP request: {exc}.", "invalid_request_error")

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

    def resume_writing(self) -> None:
        self._paused = False
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self._url = []
        self._raw_headers = []
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
        self._head_bytes += len(url)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, "The request line and headers are too large.",
                         "request_header_fields_too_large")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, "The request line and headers are too large.",
                         "request_header_fields_too_large")

    def on_headers_complete(self) -> None:
        if self._broken:
            return
        parser = self.parser
        raw = self._raw_headers
        length: int | None = None
        expect = False
        for name, value in raw:
            lowered = name.lower()
            if lowered == b"content-length":
                length = int(value) if value.isdigit() else None
            elif lowered == b"expect":
                expect = value.lower() == b"100-continue"
        request = Request(self, parser.get_method().decode("ascii"),
                          b"".join(self._url).decode("ascii", "surrogateescape"), raw, length,
                          parser.should_keep_alive(), parser.get_http_version(),
                          self.server.max_body_bytes)
        self.parsing = request
        if expect and not request.too_large and request.version == "1.1":
            self.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.queue.append(request)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._serve())

    def on_body(self, body: bytes) -> None:
        if self.parsing is not None:
            self.parsing._feed(body)

    def on_message_complete(self) -> None:
        request = self.parsing
        self.parsing = None
        if request is not None:
            request._end()

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

    async def _serve(self) -> None:
        try:
            while self.queue and self.transport is not None:
                request = self.queue.popleft()
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

    def _refuse(self, status: int, message: str, error_type: str) -> None:
        """Answer a request that cannot be served at all, and close."""
        self._broken = True
        transport = self.transport
        if transport is None or transport.is_closing() or self.task is not None:
            if transport is not None:
                transport.close()  # mid-answer: nothing more can be said on it
            return
        body = error_body(status, message, error_type)
        response = Response(status, body=body, content_type="application/json")
        transport.write(_head(response, b"Content-Length: %d\r\n" % len(body), True) + body)
        transport.close()


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
