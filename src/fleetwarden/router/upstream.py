"""The router's HTTP/1.1 client to its engines: pooled connections on the event loop's own
protocols, answers parsed by httptools (llhttp, the parser uvicorn and Node use).

Owns: connections to the backends, sending one request, reading its answer's head and body.
Must not: decide anything about a request's fate: it says what happened (an answer, or which
of the errors below), and :mod:`fleetwarden.router.forward` decides.

Why not aiohttp's client: it was ~33 % of a router process's CPU per request (BENCHMARKS.md,
"The router's own data path"): a request object, a response object, a task for the body write,
a connector and a timer context per request. A router needs a small part of it: one pool of
keep-alive connections per backend, one write per request (head and body together), one
deadline per request (kept in a set that one timer sweeps: a timer per request cost 4 µs under
uvloop) for the total timeout, and an answer whose body is read whole or chunk by chunk. The
parsing is llhttp's (httptools), never hand-written.

The errors, as the router reads them:

* :class:`ConnectFailed`: no connection could be made (refused, unreachable): the request never
  reached an engine. :class:`ConnectTimeout` (a subclass): none within ``connect_timeout_s``.
* :class:`Disconnected`: the connection broke, or the engine's answer could not be parsed, after
  the request may have reached it.
* :class:`TimeoutError`: ``total_timeout_s`` passed since the request began, before its answer
  was whole.

What an engine (or a proxy in front of one) may send, and what the router makes of it:

* An interim answer (1xx: ``100 Continue``, ``103 Early Hints``) is skipped: the answer is the
  final one that follows, on the same connection, which is never handed to another request
  before it. ``101 Switching Protocols`` is refused (the router asked for no upgrade): the
  connection is dropped as a broken answer.
* Trailers (after a chunked body) are read and dropped, never merged into the headers.
* A head over ``max_head_bytes`` or with more than ``max_headers`` fields is a broken answer
  (llhttp bounds nothing: a header line that never ends would be buffered whole).
* An answer delimited by its connection's close ends only with a clean close: a reset is a
  cut, never a whole answer. Its framing is llhttp's (RFC 9112 section 6.3): the parser has
  refused every ambiguous one (two lengths, a length beside chunking) before the head arrives.
* Its body is read whole, or, with a bound (:meth:`Answer.read_at_most`, for an engine's
  5xx), to the bound and no further.
* Running out of descriptors or buffers here (:class:`LocalExhaustion`) is the router's own
  trouble, never evidence against an engine.

An event stream's connection is never pooled (see :meth:`_EngineConnection.on_headers_complete`).
Cancelling a wait (a rescue, a client that left) aborts the connection: the engine sees the
disconnect and aborts the generation. So does :meth:`Answer.close` on an answer not yet whole.
"""

from __future__ import annotations

import asyncio
import errno
import ssl
from collections import deque
from dataclasses import dataclass
from typing import cast

import httptools
from yarl import URL

#: Headers as they go on the wire: (name, value) bytes, in order, names as sent.
RawHeaders = list[tuple[bytes, bytes]]

__all__ = [
    "Address",
    "Answer",
    "ConnectFailed",
    "ConnectTimeout",
    "Disconnected",
    "LocalExhaustion",
    "RawHeaders",
    "UpstreamClient",
    "UpstreamError",
]

#: A body that waits this many bytes unread pauses the engine's connection (its sends then
#: block in the engine, as they would on a slow client); reading what is buffered resumes it.
_HIGH_WATER = 256 * 1024
#: Methods sent without a Content-Length when they carry no body. (The router sends GET and
#: POST; a HEAD's answer has no body to read, which this client does not expect.)
_BODYLESS = frozenset({"GET", "DELETE", "OPTIONS"})


class UpstreamError(Exception):
    """An attempt on a backend ended without a whole answer (timeouts excepted: TimeoutError)."""


class ConnectFailed(UpstreamError):
    """No connection to the backend: the request never left the router."""


class ConnectTimeout(ConnectFailed):
    """No connection to the backend within the connect timeout."""


class Disconnected(UpstreamError):
    """The connection broke (or the answer was malformed) after the request was sent."""


class LocalExhaustion(UpstreamError):
    """The router itself is out of descriptors or buffers: no connection could be opened, and
    the engine had nothing to do with it."""


#: What ``connect`` fails with when the router's own process or host is exhausted, not the
#: engine: too many open files (the process's, the system's), no buffer space, no memory, no
#: local port left.
_LOCAL_EXHAUSTION = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                               errno.EADDRNOTAVAIL})
#: Defaults for the limits on an engine's head (the router passes its settings').
_MAX_HEAD_BYTES = 60 * 1024
_MAX_HEADERS = 100


@dataclass(frozen=True, slots=True)
class Address:
    """Where one request goes: the backend's address and the request target, pre-encoded."""

    host: str
    port: int
    tls: bool
    #: The request line's target and the Host header, as bytes ready to send.
    path: bytes
    host_header: bytes

    @classmethod
    def parse(cls, url: str) -> Address:
        """``url``: a backend's base URL joined with a path, as the client sent it (encoded)."""
        parsed = URL(url, encoded=True)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parsed.scheme == "https"
        port = parsed.port or (443 if tls else 80)
        host = parsed.raw_host or parsed.host
        bracketed = f"[{host}]" if ":" in host else host
        return cls(host=host, port=port, tls=tls,
                   path=(parsed.raw_path_qs or "/").encode("ascii"),
                   host_header=(bracketed if parsed.is_default_port()
                                else f"{bracketed}:{port}").encode("ascii"))


class Answer:
    """One answer from a backend, from its head on. Its body is read whole (:meth:`read`) or
    as it arrives (:meth:`readany`); an answer abandoned before it is whole must be closed."""

    __slots__ = (
        "_buffered",
        "_chunked",
        "_chunks",
        "_connection",
        "_content_length",
        "_content_type",
        "_deadline",
        "_deadlines",
        "_delimited_by_close",
        "_error",
        "_head",
        "_paused",
        "_reuse",
        "_waiter",
        "_whole",
        "raw_headers",
        "reason",
        "status",
    )

    def __init__(self, connection: _EngineConnection, head: asyncio.Future[None],
                 deadlines: set[Answer], deadline: float) -> None:
        self.status = 0
        self.reason = ""
        #: The answer's headers as they came.
        self.raw_headers: RawHeaders = []
        self._content_length: int | None = None
        self._chunked = False
        #: The body ends at the connection's clean close (no length, not chunked).
        self._delimited_by_close = False
        self._connection: _EngineConnection | None = connection
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._whole = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head = head
        #: Until it is whole, the answer is in its client's ``deadlines``, swept for those past
        #: their ``deadline`` (the total timeout).
        self._deadlines = deadlines
        self._deadline = deadline
        deadlines.add(self)
        self._paused = False
        self._reuse = True
        self._content_type = "application/octet-stream"  # aiohttp's default, if none came

    # ------------------------------------------------------------------ what the router reads

    @property
    def content_type(self) -> str:
        """The media type, lower case, without parameters."""
        return self._content_type

    @property
    def content_length(self) -> int | None:
        return self._content_length

    async def read(self) -> bytes:
        """The whole body (what was already taken by :meth:`readany` excepted)."""
        while not self._whole:
            self._resume()  # a body over the high-water mark waits for this reader
            await self._wait()
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return data

    async def read_at_most(self, limit: int) -> tuple[bytes, bool]:
        """The body up to ``limit`` bytes, and whether it was cut there. A cut answer is
        closed (its connection dropped, never pooled half-read), never waited on to its end."""
        while not self._whole and self._buffered <= limit:
            self._resume()
            await self._wait()
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if len(data) <= limit and self._whole:
            return data, False
        self.close()
        return data[:limit], True

    async def readany(self) -> bytes:
        """What has arrived of the body, waiting for some if nothing has; ``b""`` at its end."""
        while not self._chunks:
            if self._whole:
                return b""
            await self._wait()
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._resume()
        return data

    def close(self) -> None:
        """Done with this answer: a connection not yet whole is aborted (the engine sees the
        disconnect); a whole one was already pooled or closed."""
        self._deadlines.discard(self)
        if not self._head.done():
            self._head.cancel()  # nobody waits for it any more
        connection = self._connection
        if connection is not None and not self._whole:
            self._connection = None
            connection.abort()
        self._chunks.clear()

    # ------------------------------------------------------------------ internals

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            connection = self._connection
            if connection is not None and connection.transport is not None:
                connection.transport.resume_reading()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        except BaseException:
            self.close()  # cancelled (a rescue, a client that left): the engine is told
            raise
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        """The connection broke or timed out before the answer was whole."""
        if self._whole or self._error is not None:
            return
        self._error = error
        self._deadlines.discard(self)
        if not self._head.done():
            self._head.set_exception(error)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        connection = self._connection
        self._connection = None
        if connection is not None:
            connection.abort()

    def _expire(self) -> None:
        self._deadlines.discard(self)
        self._fail(TimeoutError("the backend timeout passed"))


class _EngineConnection(asyncio.Protocol):
    """One keep-alive connection to one backend, carrying one answer at a time."""

    def __init__(self, client: UpstreamClient, key: tuple[str, int, bool]) -> None:
        self.client = client
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: Answer | None = None
        self.idle_since = 0.0
        self.lost = False
        #: While a head is read: the bytes fed since it began (llhttp buffers a partial line
        #: itself) and its fields so far.
        self._in_head = True
        self._head_bytes = 0
        #: The head just parsed was an interim (1xx) one: its end is not the answer's.
        self._interim = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.answer is None:  # nothing was asked: an idle connection has no business talking
            self.abort()
            return
        if self._in_head:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.answer is not None:
                self.answer._fail(Disconnected(f"malformed answer from the backend: {exc}"))
            self.abort()
            return
        if self._in_head and self.answer is not None:  # a head still arriving: within limits?
            # Counted once a read, not once a header: a head that never ends has no end to be
            # counted at, and a read holds at most 256 KiB of it.
            if self._head_bytes > self.client.max_head_bytes:
                self._broken(f"a head over {self.client.max_head_bytes} bytes")
            elif len(self.answer.raw_headers) > self.client.max_headers:
                self._broken(f"more than {self.client.max_headers} header fields")

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.client._forget(self)
        answer = self.answer
        if answer is None:
            return
        self.answer = None
        if (exc is None and answer._head.done() and not answer._whole
                and answer._delimited_by_close):
            # An answer delimited by the close: a clean close is its end. A reset is not: the
            # rest of it was lost, and the client must see a cut, never a whole answer.
            answer._connection = None
            self._finish(answer)
            return
        answer._fail(Disconnected("the backend closed the connection"
                                  + (f": {exc}" if exc is not None else "")))

    def _broken(self, what: str) -> None:
        if self.answer is not None:
            self.answer._fail(Disconnected(f"malformed answer from the backend: {what}"))
        self.abort()

    # -- httptools callbacks
    def on_status(self, status: bytes) -> None:
        if self.answer is not None:
            self.answer.reason += status.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        answer = self.answer
        if answer is not None and self._in_head:  # else a trailer: dropped, never merged
            answer.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        answer = self.answer
        if answer is None:
            return  # broken off inside this very feed
        self._in_head = False
        if len(answer.raw_headers) > self.client.max_headers:
            self._broken(f"more than {self.client.max_headers} header fields")
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            if status == 101:  # nothing asked for an upgrade: what follows is not HTTP/1.1
                self._broken("101 Switching Protocols where an answer was due")
                return
            # An interim answer (100, 103 Early Hints): skipped, and the connection stays this
            # request's until its final answer has come (its end is not the answer's).
            self._interim = True
            answer.reason = ""
            answer.raw_headers = []
            return
        answer.status = status
        length = chunked = False
        for name, value in answer.raw_headers:
            lowered = name.lower()
            if lowered == b"content-type":
                answer._content_type = (value.partition(b";")[0].strip().lower()
                                        .decode("latin-1"))
            elif lowered == b"content-length":
                # The parser refused a second length, or a length beside chunking.
                answer._content_length = int(value) if value.isdigit() else None
                length = True
            elif lowered == b"transfer-encoding":
                # Chunked when it is the last coding, as the parser reads it.
                chunked = value.rpartition(b",")[2].strip().lower() == b"chunked"
        answer._chunked = chunked
        answer._delimited_by_close = (not length and not chunked and status not in (204, 304))
        if not self.parser.should_keep_alive() or answer.content_type == "text/event-stream":
            # An event stream's connection is never reused: llama.cpp's llama-server closes
            # it after the last event while its headers say Keep-Alive (docs/engines.md), so
            # a pooled one would be reused in the moment before the close
            # arrives, and the next request on it would fail as a reset counted against a
            # healthy engine. Decided here, as the head arrives, before the end can (an answer
            # may come whole with its head). A new connection per stream costs one handshake.
            answer._reuse = False
        if not answer._head.done():
            answer._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        answer = self.answer
        if answer is None:
            return
        answer._chunks.append(body)
        answer._buffered += len(body)
        if answer._buffered > _HIGH_WATER and not answer._paused and self.transport is not None:
            answer._paused = True
            self.transport.pause_reading()
        answer._wake()

    def on_message_complete(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        if self._interim:  # the end of an interim answer: the final one follows
            self._interim = False
            return
        answer = self.answer
        if answer is None:
            return
        self.answer = None
        self._finish(answer)
        answer._connection = None
        if answer._paused:  # the answer is whole: nothing more to hold back
            answer._paused = False
            if self.transport is not None:
                self.transport.resume_reading()
        if answer._reuse:
            self.client._release(self)
        else:
            self.shut()

    def _finish(self, answer: Answer) -> None:
        answer._whole = True
        answer._deadlines.discard(answer)
        if not answer._head.done():  # a body-less answer ends with its head
            answer._head.set_result(None)
        answer._wake()

    # -- ours
    def abort(self) -> None:
        """Reset the connection; an answer still on it fails as disconnected."""
        answer, self.answer = self.answer, None
        self.client._forget(self)
        if self.transport is not None and not self.lost:
            self.transport.abort()
        self.lost = True
        if answer is not None:
            answer._fail(Disconnected("the router closed the connection"))

    def shut(self) -> None:
        """Close the connection after a whole answer (not to be reused)."""
        self.client._forget(self)
        if self.transport is not None and not self.lost:
            self.transport.close()
        self.lost = True


def _exhausted_here(exc: OSError) -> bool:
    """Whether ``connect`` failed for want of the router's own resources. (asyncio folds the
    errors of several addresses into one OSError without an errno; its message keeps them.)"""
    if exc.errno is not None:
        return exc.errno in _LOCAL_EXHAUSTION
    return any(f"[Errno {n}]" in str(exc) for n in _LOCAL_EXHAUSTION)


class UpstreamClient:
    """Keep-alive connections to the backends, and one request at a time on each."""

    def __init__(self, *, connect_timeout_s: float, total_timeout_s: float,
                 keepalive_timeout_s: float, max_head_bytes: int = _MAX_HEAD_BYTES,
                 max_headers: int = _MAX_HEADERS) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self.total_timeout_s = total_timeout_s
        self.keepalive_timeout_s = keepalive_timeout_s
        self._idle: dict[tuple[str, int, bool], list[_EngineConnection]] = {}
        self._open: set[_EngineConnection] = set()
        self._sweep: asyncio.TimerHandle | None = None
        #: Answers not yet whole, swept every ``_sweep_every_s`` for those past their deadline:
        #: the total timeout holds to within that (a tenth of it, and at most 1 s).
        self._deadlines: set[Answer] = set()
        self._deadline_sweep: asyncio.TimerHandle | None = None
        self._sweep_every_s = min(1.0, total_timeout_s / 10)
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def request(self, target: Address, method: str, headers: RawHeaders, body: bytes,
                      *, keep_alive: bool = True) -> Answer:
        """Send one request; returns its answer once its head has come (its body may follow).
        ``headers`` go as given (Host and Content-Length are the client's to add);
        ``keep_alive=False``: the connection is not pooled after this answer (send
        ``Connection: close`` with it). Raises :class:`ConnectFailed`, :class:`Disconnected`
        or :class:`TimeoutError`."""
        if self._closed:
            raise ConnectFailed("the router's client is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_timeout_s
        connection = self._pooled((target.host, target.port, target.tls), loop.time())
        if connection is None:
            connection = await self._connect(target, deadline)
        else:
            try:
                return await self._send(connection, target, method, headers, body, keep_alive,
                                        deadline)
            except Disconnected:
                if connection._head_bytes:
                    raise
            # A reused connection that ended before a byte of the answer: the engine's close
            # of an idle connection was on its way as the request left (RFC 9112 9.3.1: a
            # client may retry then; urllib3 and aiohttp do, once). Its engine is not at
            # fault: once, on a new connection, before anyone is told of a failure.
            connection = await self._connect(target, deadline)
        return await self._send(connection, target, method, headers, body, keep_alive,
                                deadline)

    async def _send(self, connection: _EngineConnection, target: Address, method: str,
                    headers: RawHeaders, body: bytes, keep_alive: bool,
                    deadline: float) -> Answer:
        loop = asyncio.get_running_loop()
        head: asyncio.Future[None] = loop.create_future()
        answer = Answer(connection, head, self._deadlines, deadline)
        if self._deadline_sweep is None:
            self._deadline_sweep = loop.call_later(self._sweep_every_s, self._sweep_deadlines)
        if not keep_alive:
            answer._reuse = False
        connection.answer = answer
        parts = [method.encode("ascii"), b" ", target.path, b" HTTP/1.1\r\nHost: ",
                 target.host_header, b"\r\n"]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if body or method not in _BODYLESS:
            parts += (b"Content-Length: ", str(len(body)).encode("ascii"), b"\r\n")
        parts += (b"\r\n", body)
        assert connection.transport is not None
        try:
            connection.transport.write(b"".join(parts))
            await head
        except BaseException:
            answer.close()  # cancelled, or failed: never pooled half-used
            raise
        return answer

    async def close(self) -> None:
        """Close every connection (answers in progress fail as disconnected)."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        if self._deadline_sweep is not None:
            self._deadline_sweep.cancel()
            self._deadline_sweep = None
        for connection in list(self._open):
            connection.abort()
        self._idle.clear()

    # ------------------------------------------------------------------ the pool

    def _pooled(self, key: tuple[str, int, bool], now: float) -> _EngineConnection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to be closing
            transport = connection.transport
            if (connection.lost or transport is None or transport.is_closing()
                    or now - connection.idle_since >= self.keepalive_timeout_s):
                connection.abort()
                continue
            return connection
        return None

    async def _connect(self, target: Address, deadline: float) -> _EngineConnection:
        loop = asyncio.get_running_loop()
        key = (target.host, target.port, target.tls)
        context: ssl.SSLContext | None = None
        if target.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        timeout = min(self.connect_timeout_s, max(0.0, deadline - loop.time()))
        try:
            async with asyncio.timeout(timeout):
                _, protocol = await loop.create_connection(
                    lambda: _EngineConnection(self, key), target.host, target.port, ssl=context,
                    server_hostname=target.host if context is not None else None)
        except TimeoutError:
            if timeout < self.connect_timeout_s:
                raise TimeoutError("the backend timeout passed while connecting") from None
            raise ConnectTimeout(
                f"no connection to {target.host}:{target.port} within {timeout:g} s") from None
        except OSError as exc:
            if _exhausted_here(exc):
                raise LocalExhaustion(f"the router cannot open a connection to {target.host}:"
                                      f"{target.port}: {exc}") from exc
            raise ConnectFailed(f"cannot connect to {target.host}:{target.port}: {exc}") from exc
        self._open.add(protocol)
        if self._closed:
            protocol.abort()
            raise ConnectFailed("the router's client is closed")
        return protocol

    def _release(self, connection: _EngineConnection) -> None:
        if self._closed or connection.lost:
            connection.abort()
            return
        loop = asyncio.get_running_loop()
        connection.idle_since = loop.time()
        self._idle.setdefault(connection.key, []).append(connection)
        if self._sweep is None:
            self._sweep = loop.call_later(self.keepalive_timeout_s, self._sweep_idle)

    def _forget(self, connection: _EngineConnection) -> None:
        self._open.discard(connection)
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    def _sweep_idle(self) -> None:
        """Close connections idle for the keep-alive timeout (before the engine does, so that
        none is reused in the moment its close is on the way)."""
        self._sweep = None
        now = asyncio.get_running_loop().time()
        left = False
        for idle in list(self._idle.values()):
            for connection in list(idle):
                if now - connection.idle_since >= self.keepalive_timeout_s:
                    connection.abort()
                else:
                    left = True
        if left and not self._closed:
            self._sweep = asyncio.get_running_loop().call_later(
                self.keepalive_timeout_s, self._sweep_idle)

    def _sweep_deadlines(self) -> None:
        """Fail the answers past their deadline (the total timeout); again while any is left."""
        self._deadline_sweep = None
        now = asyncio.get_running_loop().time()
        for answer in [a for a in self._deadlines if a._deadline <= now]:
            answer._expire()
        if self._deadlines and not self._closed:
            self._deadline_sweep = asyncio.get_running_loop().call_later(
                self._sweep_every_s, self._sweep_deadlines)
