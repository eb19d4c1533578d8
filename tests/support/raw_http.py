"""Raw HTTP/1.1 on both sides of a router, byte for byte: an engine that answers what its
script writes, and a client whose answers are read by h11 (a reference parser, not ours).

For the hostile-input tier (tests/scenario/test_hostile_input.py, test_hostile_fuzz.py) and
bench/hostile_load.py: the cases are what a proxy, an engine or a client may put on the wire,
which no well-behaved library would send.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import h11

from fleetwarden.router import Router, RouterSettings


@dataclass
class Received:
    """One request as the engine read it (head and body, raw)."""

    head: bytes
    body: bytes

    @property
    def headers(self) -> dict[bytes, bytes]:
        lines = self.head.split(b"\r\n")[1:]
        return {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":")
                                                             for line in lines if line)}

    @property
    def prompt(self) -> str:
        try:
            return str(json.loads(self.body).get("prompt", ""))
        except ValueError:
            return ""


#: What the engine's script does with one request: write to the writer (raw bytes), and return
#: False to close the connection after it.
Script = Callable[[Received, asyncio.StreamWriter], Awaitable[bool]]


async def answer_prompt(request: Received, writer: asyncio.StreamWriter) -> bool:
    """The default script: a 200 whose body is the request's prompt (who asked is who gets)."""
    body = json.dumps({"prompt": request.prompt}).encode()
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d"
                 b"\r\n\r\n%b" % (len(body), body))
    return True


@dataclass
class RawEngine:
    """An engine on 127.0.0.1 that reads each request and runs ``script`` on it."""

    script: Script = answer_prompt
    received: list[Received] = field(default_factory=list)
    #: Connections that ended (the router closed or reset them).
    disconnects: int = 0
    #: The router's reads of ``/kv_event_sources`` (cache-aware routing asks each engine once
    #: where it publishes its KV events): answered 404 and counted here alone, not in
    #: ``received``, so that what a test reads there is what its clients sent.
    kv_sources_read: int = 0
    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> RawEngine:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request = Received(head, b"")
                length = int(request.headers.get(b"content-length", b"0"))
                request.body = await reader.readexactly(length) if length else b""
                if head.startswith(b"GET /kv_event_sources "):  # publishes none
                    self.kv_sources_read += 1
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                self.received.append(request)
                if not await self.script(request, writer):
                    break
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:
            pass  # the engine stops (its server closes): this connection ends with it
        finally:
            self.disconnects += 1
            writer.close()


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a crashed process's kernel does."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@contextlib.asynccontextmanager
async def routed(*engines: RawEngine, **settings: object) -> AsyncIterator[Router]:
    """A started router in front of ``engines`` (started here), with ``settings``."""
    for engine in engines:
        await engine.start()
    router = Router([e.url for e in engines], RouterSettings(**settings))  # type: ignore[arg-type]
    try:
        await router.start()
        yield router
    finally:
        await router.stop()
        for engine in engines:
            await engine.stop()


def post(prompt: str, path: str = "/v1/completions", extra: bytes = b"") -> bytes:
    """A well-formed completion request carrying ``prompt``, with ``extra`` header lines."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()
    return (b"POST %b HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n%b"
            b"Content-Length: %d\r\n\r\n%b" % (path.encode(), extra, len(body), body))


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes
    #: The answer's framing ended properly (its length, its last chunk, or a clean close).
    complete: bool


class Client:
    """One raw connection to the router; answers are read with h11."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT)
        # Lets the client parse answers to requests it wrote raw, not through h11.
        self.h11.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
        self.h11.send(h11.EndOfMessage())

    @classmethod
    async def connect(cls, router: Router) -> Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self, timeout_s: float = 10.0) -> Answer | None:
        """The next final answer (interim ones are skipped, as a client does), or None if the
        connection closed first."""
        status, headers, body = 0, {}, b""
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    event = self.h11.next_event()
                except h11.RemoteProtocolError:
                    if status:
                        return Answer(status, headers, body, False)  # cut inside its body
                    raise
                if event is h11.NEED_DATA:
                    data = await self.reader.read(65536)
                    self.h11.receive_data(data)
                    if not data and status == 0:
                        return None
                    continue
                if isinstance(event, h11.InformationalResponse):
                    continue
                if isinstance(event, h11.Response):
                    status = event.status_code
                    headers = {k.lower(): v for k, v in event.headers}
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    self._next_cycle()
                    return Answer(status, headers, body, True)
                elif isinstance(event, h11.ConnectionClosed):
                    return None if status == 0 else Answer(status, headers, body, False)

    def _next_cycle(self) -> None:
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            self.h11.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
            self.h11.send(h11.EndOfMessage())

    async def closed(self, timeout_s: float = 10.0) -> bytes:
        """Everything the router still sends until it closes the connection."""
        data = b""
        with contextlib.suppress(ConnectionError):
            async with asyncio.timeout(timeout_s):
                while chunk := await self.reader.read(65536):
                    data += chunk
        return data

    def close(self) -> None:
        self.writer.close()


async def exchange(router: Router, data: bytes, timeout_s: float = 10.0) -> Answer | None:
    """Send ``data`` on a new connection; its first answer."""
    client = await Client.connect(router)
    try:
        await client.send(data)
        return await client.answer(timeout_s)
    except h11.RemoteProtocolError as exc:
        raise AssertionError(f"the router's answer is not valid HTTP/1.1: {exc}") from exc
    finally:
        client.close()
