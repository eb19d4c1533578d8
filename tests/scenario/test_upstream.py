"""The router's client to its engines (router/upstream.py), against raw sockets on 127.0.0.1
that answer byte for byte as each test scripts, on both event loops the router runs on
(uvloop in every router process, asyncio's own in the in-process tests)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable

import pytest
import uvloop

from fleetwarden.router.upstream import (
    Address,
    ConnectFailed,
    ConnectTimeout,
    Disconnected,
    UpstreamClient,
)

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def run(loop: str, test: Callable[[], Awaitable[None]]) -> None:
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(asyncio.wait_for(test(), 30))


class Script:
    """A server whose connections each run ``handle(reader, writer)``; it counts connections
    and keeps what each request sent."""

    def __init__(self, handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                        Awaitable[None]]) -> None:
        self.handle = handle
        self.connections = 0
        self.closed = asyncio.Event()  # set when a connection's client went away
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Script:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handle(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.port = int(self.server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()

    def target(self, path: str = "/v1/completions") -> Address:
        return Address.parse(f"http://127.0.0.1:{self.port}{path}")


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + (await reader.readexactly(length) if length else b"")


def client(**kw: float) -> UpstreamClient:
    return UpstreamClient(connect_timeout_s=kw.get("connect", 2.0),
                          total_timeout_s=kw.get("total", 10.0),
                          keepalive_timeout_s=kw.get("keepalive", 4.0))


def test_a_target_is_parsed_once_into_what_goes_on_the_wire() -> None:
    t = Address.parse("http://127.0.0.1:8001/v1/completions?x=%20y")
    assert (t.host, t.port, t.tls, t.path, t.host_header) == (
        "127.0.0.1", 8001, False, b"/v1/completions?x=%20y", b"127.0.0.1:8001")
    assert Address.parse("https://engine.example/v1/models").port == 443
    assert Address.parse("http://[::1]:9/a").host_header == b"[::1]:9"
    with pytest.raises(ValueError, match="not an http"):
        Address.parse("ftp://x/y")


@pytest.mark.parametrize("loop", LOOPS)
def test_keep_alive_connections_are_reused_and_the_request_goes_out_as_given(loop: str) -> None:
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_request(reader))
            writer.write(OK)

    async def test() -> None:
        async with Script(handle) as engine:
            http = client()
            for _ in range(3):
                answer = await http.request(engine.target(), "POST",
                                            [(b"Content-Type", b"application/json")], b'{"a":1}')
                assert (answer.status, answer.reason, answer.content_type,
                        answer.content_length) == (200, "OK", "application/json", 2)
                assert await answer.read() == b"{}"
            assert engine.connections == 1
            await http.close()
        assert seen[0] == (
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:" + str(engine.port).encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"a\":1}")

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_what_is_never_pooled(loop: str) -> None:
    """A request sent with Connection: close, an answer saying close, and an event stream
    (llama.cpp closes a stream's connection after its end while saying keep-alive)."""
    answers = [
        OK,
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 12\r\n\r\n"
        b"data: [DONE]",
    ]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(answers.pop(0))

    async def test() -> None:
        async with Script(handle) as engine:
            http = client()
            answer = await http.request(engine.target(), "POST", [(b"Connection", b"close")],
                                        b"", keep_alive=False)
            assert await answer.read() == b"{}"
            answer = await http.request(engine.target(), "POST", [], b"")
            assert await answer.read() == b"{}"
            answer = await http.request(engine.target(), "POST", [], b"")
            assert answer.content_type == "text/event-stream"  # whole with its head, even
            assert await answer.read() == b"data: [DONE]"
            answers.append(OK)
            answer = await http.request(engine.target(), "POST", [], b"")
            assert await answer.read() == b"{}"
            assert engine.connections == 4  # one per answer: none was reused
            await http.close()

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_refused_connection_and_a_connect_timeout_say_the_request_never_left(
        loop: str) -> None:
    async def test() -> None:
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]  # bound, not listening: refused
            http = client()
            with pytest.raises(ConnectFailed) as refused:
                await http.request(Address.parse(f"http://127.0.0.1:{port}/"), "GET", [], b"")
            assert not isinstance(refused.value, ConnectTimeout)
        # A listener that never accepts, its queue full: the kernel drops further handshakes.
        with socket.socket() as full:
            full.bind(("127.0.0.1", 0))
            full.listen(0)
            port = full.getsockname()[1]
            fillers = []
            try:
                for _ in range(8):
                    s = socket.socket()
                    s.setblocking(False)
                    with contextlib.suppress(BlockingIOError):
                        s.connect(("127.0.0.1", port))
                    fillers.append(s)
                await asyncio.sleep(0.2)
                http = client(connect=0.5)
                with pytest.raises(ConnectTimeout):
                    await http.request(Address.parse(f"http://127.0.0.1:{port}/"), "GET", [],
                                       b"")
            finally:
                for s in fillers:
                    s.close()

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_the_total_timeout_ends_a_silent_answer_and_its_connection(loop: str) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345")  # half a body
        await reader.read()  # until the client goes
        engine.closed.set()

    async def test() -> None:
        nonlocal engine
        async with Script(handle) as engine:
            http = client(total=0.5)
            answer = await http.request(engine.target(), "POST", [], b"")
            with pytest.raises(TimeoutError):
                await answer.read()
            await asyncio.wait_for(engine.closed.wait(), 5)  # the engine saw the disconnect
            await http.close()

    engine: Script
    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_cancelled_wait_closes_the_connection_so_the_engine_aborts(loop: str) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # never answers; waits until the client goes
        engine.closed.set()

    async def test() -> None:
        nonlocal engine
        async with Script(handle) as engine:
            http = client()
            wait = asyncio.create_task(http.request(engine.target(), "POST", [], b"x"))
            await asyncio.sleep(0.2)
            wait.cancel()
            with pytest.raises(asyncio.CancelledError):
                await wait
            await asyncio.wait_for(engine.closed.wait(), 5)
            await http.close()

    engine: Script
    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_broken_and_malformed_answers_are_disconnections(loop: str) -> None:
    replies = [
        b"",  # closed before any answer
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345",  # closed mid-body
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",  # mid-chunks
        b"NOT HTTP AT ALL\r\n\r\n",
    ]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(replies.pop(0))
        await writer.drain()

    async def test() -> None:
        async with Script(handle) as engine:
            http = client()
            with pytest.raises(Disconnected):
                await http.request(engine.target(), "POST", [], b"")
            answer = await http.request(engine.target(), "POST", [], b"")
            with pytest.raises(Disconnected):
                await answer.read()
            answer = await http.request(engine.target(), "POST", [], b"")
            assert await answer.readany() == b"hello"
            with pytest.raises(Disconnected):
                await answer.readany()
            with pytest.raises(Disconnected, match="malformed"):
                await http.request(engine.target(), "POST", [], b"")
            await http.close()

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_an_answer_delimited_by_its_close_and_a_chunked_one_are_read_whole(loop: str) -> None:
    replies = [
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    ]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        reply = replies.pop(0)
        writer.write(reply)
        await writer.drain()
        if b"chunked" in reply:
            await reader.read()

    async def test() -> None:
        async with Script(handle) as engine:
            http = client()
            answer = await http.request(engine.target(), "POST", [], b"")
            assert answer.content_length is None
            assert await answer.read() == b"until the end"
            answer = await http.request(engine.target(), "POST", [], b"")
            chunks = []
            while chunk := await answer.readany():
                chunks.append(chunk)
            assert b"".join(chunks) == b"hello world"
            await http.close()

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_large_body_read_slowly_arrives_whole(loop: str) -> None:
    """Past the high-water mark the engine's connection is paused, and resumed as the body is
    read: nothing is lost or reordered."""
    body = bytes(range(256)) * 8192  # 2 MiB

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        await reader.read()

    async def test() -> None:
        async with Script(handle) as engine:
            http = client()
            answer = await http.request(engine.target(), "POST", [], b"")
            got = bytearray()
            while chunk := await answer.readany():
                got += chunk
                await asyncio.sleep(0.001)
            assert bytes(got) == body
            await http.close()

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_an_idle_connection_is_not_reused_past_the_keep_alive_timeout(loop: str) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(OK)

    async def test() -> None:
        async with Script(handle) as engine:
            http = client(keepalive=0.3)
            assert await (await http.request(engine.target(), "GET", [], b"")).read() == b"{}"
            await asyncio.sleep(0.6)  # the sweep closed it
            assert await (await http.request(engine.target(), "GET", [], b"")).read() == b"{}"
            assert engine.connections == 2
            await http.close()
            with pytest.raises(ConnectFailed, match="closed"):
                await http.request(engine.target(), "GET", [], b"")

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_pooled_connection_the_engine_closed_is_sent_again_once_on_a_new_one(
        loop: str) -> None:
    """An engine closes an idle keep-alive connection as the router reuses it: the request
    meets the close and no byte of an answer (RFC 9112 9.3.1). urllib3 and aiohttp send it
    again on a new connection, once; so does the router, instead of failing a healthy
    engine. A new connection that fails so is the engine's failure, as before."""

    async def close_after_one(reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)  # the reused connection's request: closed, unanswered

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async def test() -> None:
        async with Script(close_after_one) as engine:
            http = client()
            for _ in range(3):
                assert await (await http.request(engine.target(), "POST", [], b"{}")).read() \
                    == b"{}"
            assert engine.connections == 3  # each close met once, on a reused connection
            await http.close()
        async with Script(never_answer) as engine:
            http = client()
            with pytest.raises(Disconnected):
                await http.request(engine.target(), "POST", [], b"{}")
            assert engine.connections == 1  # a new connection's failure is not sent again
            await http.close()

    run(loop, test)
