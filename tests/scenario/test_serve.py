"""The router's data-port server (router/serve.py), driven byte for byte over raw sockets on
127.0.0.1 with handlers of the test's own, on both event loops the router runs on. The router's
own behaviour on it (413, 404, streams, disconnects, the drain) is tested in test_router.py and
test_router_control.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest
import uvloop

from fleetwarden.router import RouterSettings
from fleetwarden.router.serve import (
    MAX_HEAD_BYTES,
    BodyTooLarge,
    Headers,
    Request,
    Response,
    Server,
    StreamResponse,
)

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run(loop: str, test: Callable[[], Awaitable[None]]) -> None:
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(asyncio.wait_for(test(), 30))


async def echo(request: Request) -> StreamResponse:
    """Answers with what it was sent: method, target, path and body."""
    try:
        body = await request.read()
    except BodyTooLarge:
        return Response(413, body=b"too large")
    return Response(body=json.dumps({
        "method": request.method, "raw_path": request.raw_path, "path": request.path,
        "body": body.decode(), "x": request.headers.get("X-Test")}).encode(),
        content_type="application/json")


class Serving:
    def __init__(self, handler: Callable[[Request], Awaitable[StreamResponse]],
                 max_body_bytes: int = 1024, **settings: float) -> None:
        self.server = Server(handler, max_body_bytes=max_body_bytes,
                             settings=RouterSettings(**settings))  # type: ignore[arg-type]
        self.listener: asyncio.Server | None = None

    async def __aenter__(self) -> Serving:
        self.listener = await asyncio.get_running_loop().create_server(
            self.server, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.listener is not None
        self.listener.close()
        await self.server.shutdown(1.0)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        assert self.listener is not None
        port = self.listener.sockets[0].getsockname()[1]
        return await asyncio.open_connection("127.0.0.1", port)


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One answer: status, headers (lower-cased names), body (by length, chunks or close)."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    lines = head.split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:]
                                                    if line)}
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readexactly(2)
    else:
        body = await reader.read()
    return status, headers, body


def test_request_headers_read_case_insensitively_first_of_a_repeated_name() -> None:
    headers = Headers([(b"X-Session-Id", b"a"), (b"content-type", b"json"),
                       (b"x-session-id", b"b"), (b"X-Note", "é".encode())])
    assert headers["x-session-id"] == "a" and headers.get("CONTENT-TYPE") == "json"
    assert headers.get("x-note") == "é" and headers.get("missing") is None
    assert list(headers) == ["X-Session-Id", "content-type", "X-Note"] and len(headers) == 3


@pytest.mark.parametrize("loop", LOOPS)
def test_pipelined_requests_are_answered_in_order_on_one_connection(loop: str) -> None:
    async def test() -> None:
        async with Serving(echo) as serving:
            reader, writer = await serving.connect()
            writer.write(b"POST /a?q=%20x HTTP/1.1\r\nHost: r\r\nX-Test: 1\r\n"
                         b"Content-Length: 3\r\n\r\none"
                         b"GET /b%2Fc HTTP/1.1\r\nHost: r\r\n\r\n"
                         b"POST /c HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"3\r\nthr\r\n2\r\nee\r\n0\r\n\r\n")
            got = [json.loads((await answer(reader))[2]) for _ in range(3)]
            assert got == [
                {"method": "POST", "raw_path": "/a?q=%20x", "path": "/a", "body": "one",
                 "x": "1"},
                {"method": "GET", "raw_path": "/b%2Fc", "path": "/b/c", "body": "", "x": None},
                {"method": "POST", "raw_path": "/c", "path": "/c", "body": "three", "x": None},
            ]
            writer.close()

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_what_cannot_be_served_is_answered_and_closed(loop: str) -> None:
    async def test() -> None:
        async with Serving(echo) as serving:
            for sent, status in [
                (b"NOT A REQUEST\r\n\r\n", 400),
                (b"GET / HTTP/1.1\r\nX-Big: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n", 431),
            ]:
                reader, writer = await serving.connect()
                writer.write(sent)
                code, headers, body = await answer(reader)
                assert code == status and headers["connection"] == "close"
                assert json.loads(body)["error"]["code"] == status
                assert await reader.read() == b""  # closed
                writer.close()

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_body_over_the_limit_is_never_kept_and_its_connection_closes(loop: str) -> None:
    async def test() -> None:
        async with Serving(echo, max_body_bytes=10) as serving:
            for sent in [
                # announced: no 100 Continue, the handler refuses it
                b"POST /x HTTP/1.1\r\nHost: r\r\nContent-Length: 11\r\n"
                b"Expect: 100-continue\r\n\r\n",
                # chunked, past the limit as it arrives
                b"POST /x HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"8\r\n12345678\r\n8\r\n12345678\r\n0\r\n\r\n",
            ]:
                reader, writer = await serving.connect()
                writer.write(sent)
                code, headers, _ = await answer(reader)
                assert code == 413 and headers["connection"] == "close"
                writer.close()
            # within it, with Expect: the 100 comes first
            reader, writer = await serving.connect()
            writer.write(b"POST /x HTTP/1.1\r\nHost: r\r\nContent-Length: 5\r\n"
                         b"Expect: 100-continue\r\n\r\n")
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"small")
            code, _, body = await answer(reader)
            assert code == 200 and json.loads(body)["body"] == "small"
            writer.close()

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_http_1_0_and_head(loop: str) -> None:
    async def stream(request: Request) -> StreamResponse:
        response = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        return response  # left unfinished: the server ends it

    async def test() -> None:
        async with Serving(stream) as serving:
            reader, writer = await serving.connect()
            writer.write(b"GET /s HTTP/1.0\r\n\r\n")
            code, headers, body = await answer(reader)  # delimited by the close
            assert code == 200 and "transfer-encoding" not in headers
            assert body == b"data: 1\n\n"
            reader, writer = await serving.connect()
            writer.write(b"GET /s HTTP/1.1\r\nHost: r\r\n\r\n")
            code, headers, body = await answer(reader)  # chunked, and its end written
            assert headers["transfer-encoding"] == "chunked" and body == b"data: 1\n\n"
            writer.close()
        async with Serving(echo) as serving:
            reader, writer = await serving.connect()
            writer.write(b"HEAD /x HTTP/1.1\r\nHost: r\r\n\r\nGET /y HTTP/1.1\r\nHost: r\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")  # no body follows a HEAD's head
            assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: " in head
            code, _, body = await answer(reader)
            assert code == 200 and json.loads(body)["path"] == "/y"
            writer.close()

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_handler_that_fails_is_answered_500_and_one_whose_client_left_is_cancelled(
        loop: str) -> None:
    cancelled = asyncio.Event()

    async def handler(request: Request) -> StreamResponse:
        if request.path == "/fail":
            raise RuntimeError("a bug")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Response()

    async def test() -> None:
        async with Serving(handler) as serving:
            reader, writer = await serving.connect()
            writer.write(b"GET /fail HTTP/1.1\r\nHost: r\r\n\r\n")
            code, headers, body = await answer(reader)
            assert code == 500 and headers["connection"] == "close"
            assert json.loads(body)["error"]["type"] == "router_error"
            reader, writer = await serving.connect()
            writer.write(b"GET /wait HTTP/1.1\r\nHost: r\r\n\r\n")
            await asyncio.sleep(0.2)
            writer.close()
            await asyncio.wait_for(cancelled.wait(), 5)

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_stream_to_a_client_that_does_not_read_waits_instead_of_buffering(
        loop: str) -> None:
    written: list[int] = []
    ended = asyncio.Event()

    async def handler(request: Request) -> StreamResponse:
        response = StreamResponse()
        await response.prepare(request)
        chunk = b"x" * 65536
        try:
            for _ in range(1000):  # 64 MiB, if nothing waited
                await response.write(chunk)
                written.append(len(chunk))
        finally:
            ended.set()  # ended by the client leaving while the write waited for it
        return response

    async def test() -> None:
        async with Serving(handler) as serving:
            _reader, writer = await serving.connect()
            writer.write(b"GET /s HTTP/1.1\r\nHost: r\r\n\r\n")
            # Until the socket's buffers are full and the server told its writer to wait.
            for _ in range(200):
                if written and all(c._paused for c in serving.server.connections):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"the server never paused ({len(written)} chunks sent)")
            sent = sum(written)
            await asyncio.sleep(0.3)  # a writer that did not wait would go on meanwhile
            assert sum(written) == sent < 16 * 1024 * 1024 and len(written) < 1000
            writer.transport.abort()
            await asyncio.wait_for(ended.wait(), 5)

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_draining_server_says_close_and_closes(loop: str) -> None:
    async def test() -> None:
        async with Serving(echo) as serving:
            reader, writer = await serving.connect()
            writer.write(b"GET /a HTTP/1.1\r\nHost: r\r\n\r\n")
            _, headers, _ = await answer(reader)
            assert "connection" not in headers  # kept alive
            serving.server.draining = True
            writer.write(b"GET /b HTTP/1.1\r\nHost: r\r\n\r\n")
            _, headers, _ = await answer(reader)
            assert headers["connection"] == "close"
            assert await reader.read() == b""
            writer.close()

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_shutdown_lets_answers_finish_within_its_grace_and_closes_the_rest(loop: str) -> None:
    async def handler(request: Request) -> StreamResponse:
        await asyncio.sleep(float(request.path.strip("/")))
        return Response(body=b"done")

    async def test() -> None:
        serving = Serving(handler)
        await serving.__aenter__()
        assert serving.listener is not None
        idle_reader, idle_writer = await serving.connect()
        idle_writer.write(b"GET /0 HTTP/1.1\r\nHost: r\r\n\r\n")
        assert (await answer(idle_reader))[2] == b"done"  # then idle, kept alive
        short_reader, short_writer = await serving.connect()
        short_writer.write(b"GET /0.3 HTTP/1.1\r\nHost: r\r\n\r\n")
        long_reader, long_writer = await serving.connect()
        long_writer.write(b"GET /30 HTTP/1.1\r\nHost: r\r\n\r\n")
        await asyncio.sleep(0.1)
        serving.listener.close()
        await serving.server.shutdown(1.0)
        assert await idle_reader.read() == b""  # closed at once
        code, headers, body = await answer(short_reader)  # finished within the grace
        assert (code, body, headers["connection"]) == (200, b"done", "close")
        assert await long_reader.read() == b""  # cut at the grace
        for writer in (idle_writer, short_writer, long_writer):
            writer.close()

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_the_limits_hold_on_both_event_loops(loop: str) -> None:
    """The head deadline, the head size counted on the bytes fed, the lingering close that
    lets the client read its 431, and the read-ahead that pauses a pipelining client: the
    transports' pause/resume and write_eof differ between asyncio and uvloop."""
    async def slow(request: Request) -> StreamResponse:
        await asyncio.sleep(0.3)
        return await echo(request)

    async def test() -> None:
        async with Serving(slow, 8192, client_head_timeout_s=0.4) as serving:
            reader, writer = await serving.connect()  # silent
            assert (await answer(reader))[0] == 408
            writer.close()

            reader, writer = await serving.connect()
            writer.write(b"GET / HTTP/1.1\r\nHost: r\r\nX-Long: " + b"a" * (1 << 20))
            code, headers, _ = await answer(reader)
            assert code == 431 and headers["connection"] == "close"
            writer.close()

            reader, writer = await serving.connect()
            body = b"o" * 4000
            request = b"POST /p HTTP/1.1\r\nHost: r\r\nContent-Length: 4000\r\n\r\n" + body
            writer.write(request * 200)  # 800 KB: more than the reads before the pause
            await asyncio.sleep(0.1)
            (connection,) = [c for c in serving.server.connections if c.busy]
            # What one read brought is parsed (llhttp cannot stop inside it), then no more.
            assert len(connection.queue) < 100
            for _ in range(3):
                assert json.loads((await answer(reader))[2])["body"] == body.decode()
            writer.close()

    run(loop, test)
