"""The hostile-input tier: a client, or an engine, that sends what no well-behaved library
would, over raw sockets on 127.0.0.1 against a real router. Each case gets a clear answer
(never a 500 with a traceback, never an answer meant for someone else), holds nothing past
its limit, and blames no healthy engine for what a client did (docs/design.md, "Limits on
the data port").
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import socket
import time
import tracemalloc
from pathlib import Path

import pytest

from fleetwarden.router import serve
from fleetwarden.router.keys import hash_secret
from support.keys import recorded_comparisons
from support.raw_http import (
    Client,
    RawEngine,
    Received,
    answer_prompt,
    exchange,
    post,
    reset,
    routed,
)
from support.router_rig import until

pytestmark = pytest.mark.scenario

#: Long enough that a case the router mishandles waits on it past the test's own bound: the
#: answer must come from the fix, never from this timeout.
BACKEND_TIMEOUT_S = 60.0


def fleet(*engines: RawEngine, **settings: object):  # type: ignore[no-untyped-def]
    return routed(*engines, backend_timeout_s=BACKEND_TIMEOUT_S, **settings)


def clear_error(answer: object, *statuses: int) -> None:
    """A whole answer with one of ``statuses`` and the router's JSON error."""
    assert answer is not None, "no answer at all"
    assert answer.status in statuses, (answer.status, answer.body[:200])  # type: ignore[attr-defined]
    assert answer.complete  # type: ignore[attr-defined]
    assert "error" in json.loads(answer.body)  # type: ignore[attr-defined]


# ---------------------------------------------------------------- what an engine may answer

async def test_an_early_hints_answer_is_skipped_and_its_answer_never_reaches_another_client(
        ) -> None:
    async def hints_first(request: Received, writer: asyncio.StreamWriter) -> bool:
        if request.prompt == "A":
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.3)  # B asks meanwhile
        body = json.dumps({"prompt": request.prompt}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        return True

    async with fleet(RawEngine(hints_first)) as router:
        a = asyncio.create_task(exchange(router, post("A")))
        await asyncio.sleep(0.1)
        b = await exchange(router, post("B"))
        a_answer = await a
        assert a_answer is not None and b is not None
        assert (a_answer.status, json.loads(a_answer.body)) == (200, {"prompt": "A"})
        assert (b.status, json.loads(b.body)) == (200, {"prompt": "B"})


async def test_headers_an_engine_names_in_connection_never_reach_the_client() -> None:
    """RFC 9110 7.6.1: a proxy removes the header fields its Connection header names, on the
    answer as on the request: they are the engine's hop's, not the client's."""
    async def named(request: Received, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Engine-Hop\r\n"
                     b"X-Engine-Hop: private\r\nX-Kept: 1\r\nContent-Length: 2\r\n\r\n{}")
        return True

    async with fleet(RawEngine(named)) as router:
        answer = await exchange(router, post("x"))
        assert answer is not None and answer.status == 200 and answer.body == b"{}"
        assert answer.headers.get(b"x-kept") == b"1"
        assert b"x-engine-hop" not in answer.headers


async def test_a_101_from_an_engine_is_refused_never_relayed() -> None:
    async def upgrades(request: Received, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n"
                     b"Connection: upgrade\r\n\r\n\x00\x00\x12\x04")
        return True

    async with fleet(RawEngine(upgrades), max_retries=0) as router:
        clear_error(await exchange(router, post("x")), 409, 500)


async def test_trailers_are_never_merged_into_headers_either_way() -> None:
    async def trailing_500(request: Received, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"2\r\n{}\r\n0\r\nX-Engine-Trailer: sneaked\r\n\r\n")
        return True

    engine = RawEngine(trailing_500)
    async with fleet(engine, max_retries=0) as router:
        chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n"
                   b"Trailer: X-Client-Trailer\r\n\r\n"
                   b"2\r\n{}\r\n0\r\nX-Client-Trailer: sneaked\r\n\r\n")
        answer = await exchange(router, chunked)
        assert answer is not None and answer.status == 500
        assert b"x-engine-trailer" not in answer.headers
        assert engine.received and b"x-client-trailer" not in engine.received[0].headers


async def test_an_engines_5xx_with_a_large_body_is_read_to_a_bound_and_answered() -> None:
    async def big_500(request: Received, writer: asyncio.StreamWriter) -> bool:
        body = b"e" * (1 << 20)
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n"
                     % len(body))
        writer.write(body)
        return True

    async with fleet(RawEngine(big_500), max_retries=0) as router:
        answer = await exchange(router, post("x"), timeout_s=10)
        assert answer is not None and answer.status == 500 and answer.complete
        assert len(answer.body) < 64 * 1024
        assert "over 65536 bytes" in json.loads(answer.body)["error"]["message"]


async def test_an_engine_reset_inside_an_answer_delimited_by_its_close_is_a_cut() -> None:
    async def cut(request: Received, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npartial")
        await writer.drain()
        await asyncio.sleep(0.3)  # the head and the first bytes reach the client
        reset(writer)
        return False

    async with fleet(RawEngine(cut), max_retries=0) as router:
        answer = await exchange(router, post("x"))
        assert answer is not None
        assert not (answer.status == 200 and answer.complete), "a cut answered as whole"
        failures = router.stats.backend_failures
        assert sum(failures.values()) == 1 and {c for _, c in failures} == {"reset"}


@pytest.mark.parametrize("head", ["a header line that never ends", "2,000 headers"])
async def test_an_engines_head_is_held_to_the_same_limits(head: str) -> None:
    async def endless(request: Received, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n")
        if head == "2,000 headers":
            writer.write(b"".join(b"X-%d: y\r\n" % i for i in range(2000)))
        else:
            writer.write(b"X-Long: ")
            for _ in range(32):  # 2 MiB and counting, never a line end
                writer.write(b"a" * 65536)
                await writer.drain()
        await asyncio.sleep(30)
        return False

    async with fleet(RawEngine(endless), max_retries=0) as router:
        clear_error(await exchange(router, post("x"), timeout_s=10), 409, 500)


# ---------------------------------------------------------------- what a client may send

async def test_a_header_line_that_never_ends_is_answered_431_before_it_is_buffered() -> None:
    async with fleet(RawEngine()) as router:
        client = await Client.connect(router)
        client.writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-Long: ")
        sent = 0

        async def endless() -> None:
            nonlocal sent
            with contextlib.suppress(ConnectionError):
                for _ in range(256):  # up to 16 MiB: the router answers long before
                    client.writer.write(b"a" * 65536)
                    sent += 65536
                    await client.writer.drain()

        writing = asyncio.create_task(endless())
        answer = await client.answer()
        at_answer = sent
        writing.cancel()
        clear_error(answer, 431)
        assert at_answer < 8 * 1024 * 1024
        client.close()
        assert router._server.closed_for["head_too_large"] == 1


def _send_all_then_read(port: int, data: bytes) -> tuple[str, bytes]:
    """As a blocking client library does: send the whole request, then read the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(data)
        except OSError as exc:
            return f"the send failed: {exc!r}", b""
        return "sent", sock.recv(65536)


async def test_a_refused_client_can_finish_sending_and_read_its_answer() -> None:
    # A client library that sends its whole request before it reads (http.client does) never
    # sees the 431 if the router closes on unread bytes: the close resets the connection and
    # its send fails. The router reads (and drops) what comes after its answer for a while.
    async with fleet(RawEngine()) as router:
        for _ in range(3):
            sent, answer = await asyncio.to_thread(
                _send_all_then_read, router.port,
                b"GET /v1/models HTTP/1.1\r\nHost: r\r\nX-Long: " + b"a" * (16 << 20))
            assert sent == "sent" and answer.startswith(b"HTTP/1.1 431 ")


async def test_a_body_of_2_byte_chunks_costs_its_size_not_20_times_it() -> None:
    class Quiet:
        transport = None

    tracemalloc.start()
    try:
        request = serve.Request(Quiet(), "POST", "/", [], None, True, "1.1",  # type: ignore[arg-type]
                                limit=8 << 20)
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(1 << 20):  # 2 MiB as 2-byte chunks (7 MiB on the wire)
            request._feed(b"ab")
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 3 * (2 << 20), f"{held} bytes held for a 2 MiB body"


async def test_pipelined_requests_are_read_only_when_there_is_room() -> None:
    async def slow_first(request: Received, writer: asyncio.StreamWriter) -> bool:
        if request.prompt == "slow":
            await asyncio.sleep(1.5)
        return await answer_prompt(request, writer)

    async with fleet(RawEngine(slow_first)) as router:
        client = await Client.connect(router)
        client.writer.transport.set_write_buffer_limits(high=1 << 30)
        filler = json.dumps({"prompt": "x" * (64 * 1024)}).encode()
        big = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%b"
               % (len(filler), filler))
        client.writer.write(post("slow") + big * 300)  # 19 MiB pipelined behind a slow one
        await asyncio.sleep(1.0)  # the router reads what it will while the first waits
        (connection,) = router._server.connections
        assert len(connection.queue) <= 2, f"{len(connection.queue)} requests read ahead"
        first = await client.answer()
        assert first is not None and json.loads(first.body) == {"prompt": "slow"}
        for _ in range(3):  # and the rest are served in turn
            answer = await client.answer()
            assert answer is not None and answer.status == 200
        client.close()


async def test_a_silent_connection_an_idle_one_and_a_slowloris_are_closed_in_time() -> None:
    async with fleet(RawEngine(), client_head_timeout_s=1.0,
                     client_idle_timeout_s=0.5) as router:
        silent = await Client.connect(router)
        clear_error(await silent.answer(timeout_s=5), 408)

        idle = await Client.connect(router)
        await idle.send(post("x"))
        first = await idle.answer()
        assert first is not None and first.status == 200
        assert await idle.closed(timeout_s=5) == b""  # closed, without a word

        slow = await Client.connect(router)
        answer = None
        for byte in post("x"):  # a byte every 0.1 s: the head would take ~20 s
            try:
                await slow.send(bytes([byte]))
            except ConnectionError:
                break
            await asyncio.sleep(0.1)
            if slow.reader.at_eof() or slow.reader._buffer:  # type: ignore[attr-defined]
                answer = await slow.answer()
                break
        clear_error(answer, 408)
        for c in (silent, idle, slow):
            c.close()
        assert router._server.closed_for["head_timeout"] == 2
        assert router._server.closed_for["idle_timeout"] == 1
        metrics = await exchange(router, b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n")
        assert metrics is not None
        assert (b'fleetwarden_router_connections_closed_total{reason="head_timeout"} 2.0'
                in metrics.body)


async def test_a_client_that_stops_reading_is_dropped_and_its_engine_is_not_blamed() -> None:
    stop = asyncio.Event()

    async def endless_stream(request: Received, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        while not stop.is_set():
            writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            await writer.drain()
        return False

    engine = RawEngine(endless_stream)
    async with routed(engine, backend_timeout_s=3.0, client_write_timeout_s=0.5) as router:
        _, writer = await asyncio.open_connection("127.0.0.1", router.port)
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer.write(post("x"))
        await until(lambda: engine.disconnects == 1, 2.5, "the engine's request cancelled")
        stop.set()
        assert router._server.closed_for["write_timeout"] == 1
        await asyncio.sleep(3.5)  # past the backend timeout: nothing is counted late either
        assert router.stats.backend_failures == {}
        writer.close()


async def test_past_the_connection_cap_the_longest_idle_makes_room_then_503() -> None:
    async with fleet(RawEngine(), max_client_connections=3) as router:
        idle = [await Client.connect(router) for _ in range(3)]
        await until(lambda: len(router._server.connections) == 3, 5)
        served = await exchange(router, post("fourth"))  # the oldest idle one makes room
        assert served is not None and served.status == 200
        assert await idle[0].closed(timeout_s=5) == b""
        busy = [await Client.connect(router) for _ in range(3)]
        for c in busy:  # each has begun a request: none is idle
            await c.send(b"POST /v1/completions HTTP/1.1\r\n")
        await until(lambda: all(c._head_bytes for c in router._server.connections), 5)
        clear_error(await exchange(router, post("over")), 503)
        assert router._server.closed_for["over_capacity"] == 1
        for c in idle + busy:
            c.close()


async def test_an_expect_100_continue_behind_a_pipelined_request_waits_its_turn() -> None:
    async def slow(request: Received, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(0.3)
        return await answer_prompt(request, writer)

    async with fleet(RawEngine(slow)) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        body = json.dumps({"prompt": "second"}).encode()
        writer.write(post("first") + b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n"
                     b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert first.startswith(b"HTTP/1.1 200"), first  # never a 100 inside A's answer
        length = int(first.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        assert json.loads(await reader.readexactly(length)) == {"prompt": "first"}
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == \
            b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        second = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert second.startswith(b"HTTP/1.1 200")
        writer.close()


#: The issue's table: each is a clear 4xx, never forwarded, never a 500.
TABLE = {
    "no Host": (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 400),
    "two Hosts": (b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nHost: b\r\n"
                  b"Content-Length: 2\r\n\r\n{}", 400),
    "absolute-form target": (b"POST http://evil/v1/completions HTTP/1.1\r\nHost: evil\r\n"
                             b"Content-Length: 2\r\n\r\n{}", 400),
    "2,000 headers": (b"GET /v1/models HTTP/1.1\r\nHost: r\r\n"
                      + b"".join(b"X-%d: y\r\n" % i for i in range(2000)) + b"\r\n", 431),
    "Upgrade: h2c": (b"GET /v1/models HTTP/1.1\r\nHost: r\r\nUpgrade: h2c\r\n"
                     b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n", 400),
    "Upgrade: h2c, Connection: Upgrade": (
        b"GET /v1/models HTTP/1.1\r\nHost: r\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n", 400),
    "a second Connection header": (b"GET /v1/models HTTP/1.1\r\nHost: r\r\n"
                                   b"Connection: keep-alive\r\nConnection: close\r\n\r\n", 400),
    "a 4,300-digit version header": (
        post("x", extra=b"x-fleetwarden-min-weight-version: " + b"9" * 4300 + b"\r\n"), 400),
    "Transfer-Encoding: gzip, chunked": (
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: gzip, chunked\r\n"
        b"\r\n2\r\n{}\r\n0\r\n\r\n", 501),
    "a bad chunk size": (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n2g\r\n{}\r\n0\r\n\r\n", 400),
    "deeply nested JSON": (
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 200011\r\n\r\n"
        b'{"stream": true, "x": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400),
}


@pytest.mark.parametrize("case", list(TABLE))
async def test_each_row_of_the_table_is_a_clear_4xx(case: str) -> None:
    data, status = TABLE[case]
    engine = RawEngine()
    async with fleet(engine) as router:
        clear_error(await exchange(router, data), status)
        assert engine.received == [], "forwarded to an engine"
        assert 500 not in router.stats.responses


async def test_a_refusal_behind_a_pipelined_request_comes_after_its_answer() -> None:
    async with fleet(RawEngine()) as router:
        client = await Client.connect(router)
        await client.send(post("first") + TABLE["two Hosts"][0])
        first = await client.answer()
        assert first is not None and json.loads(first.body) == {"prompt": "first"}
        refused = await client.answer()
        clear_error(refused, 400)
        client.close()


# ---------------------------------------------------------------- keys on the data port

#: The one key of the keys file these cases run against (router/keys.py).
SECRET = "sk-fw-hostile-" + "k" * 36


def keyed(value: bytes) -> bytes:
    return b"Authorization: " + value + b"\r\n"


#: What a client may send instead of its key: each a clear 4xx naming no key, never forwarded.
KEY_TABLE: dict[str, tuple[bytes, set[int]]] = {
    "no Authorization": (post("x"), {401}),
    "a wrong key": (post("x", extra=keyed(b"Bearer sk-fw-wrong")), {401}),
    "the key with its last byte changed": (
        post("x", extra=keyed(b"Bearer " + SECRET[:-1].encode() + b"j")), {401}),
    "the key in the query string": (post("x", "/v1/completions?api_key=" + SECRET), {401}),
    "the key in the query string of a GET": (
        b"GET /v1/models?key=" + SECRET.encode() + b" HTTP/1.1\r\nHost: r\r\n\r\n", {401}),
    "the key bare, without Bearer": (post("x", extra=keyed(SECRET.encode())), {401}),
    "the key under Basic": (post("x", extra=keyed(b"Basic " + SECRET.encode())), {401}),
    "the key in X-API-Key": (post("x", extra=b"X-API-Key: " + SECRET.encode() + b"\r\n"),
                             {401}),
    "Bearer and nothing": (post("x", extra=keyed(b"Bearer ")), {401}),
    "two Authorization headers, one of them right": (
        post("x", extra=keyed(b"Bearer " + SECRET.encode()) + keyed(b"Bearer other")), {401}),
    "the stored hash as the key": (
        post("x", extra=keyed(b"Bearer " + hash_secret(SECRET).encode())), {401}),
    "a 59 KB key": (post("x", extra=keyed(b"Bearer " + b"k" * 59_000)), {401}),
    "a 100 KB Authorization header": (post("x", extra=keyed(b"Bearer " + b"k" * 100_000)),
                                      {431}),
    "a key of control and non-ASCII bytes": (
        post("x", extra=keyed(b"Bearer \x01\x7f\xff\xfe" + SECRET.encode())), {400, 401}),
}


@pytest.mark.parametrize("case", list(KEY_TABLE))
async def test_each_way_of_not_sending_a_valid_key_is_a_clear_401(case: str,
                                                                  tmp_path: Path) -> None:
    data, statuses = KEY_TABLE[case]
    keys = tmp_path / "keys"
    keys.write_text(f"alpha {hash_secret(SECRET)}\n")
    engine = RawEngine()
    async with fleet(engine, keys_file=str(keys)) as router:
        answer = await exchange(router, data)
        clear_error(answer, *statuses)
        assert answer is not None and SECRET.encode() not in answer.body
        if answer.status == 401:
            assert json.loads(answer.body)["error"]["code"] == "invalid_api_key"
        assert engine.received == [], "forwarded to an engine"
        assert 500 not in router.stats.responses
        ok = await exchange(router, post("y", extra=keyed(b"Bearer " + SECRET.encode())))
        assert ok is not None and ok.status == 200  # the router lives on
        assert b"authorization" not in engine.received[0].headers


async def test_keys_are_compared_in_constant_time_and_the_secret_never_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the wire: every comparison is ``hmac.compare_digest`` of two whole SHA-256
    digests, never of the secret. The time a wrong key takes is printed beside the right
    key's and an unrelated one's (a measure, not a claim the test could time)."""
    keys = tmp_path / "keys"
    keys.write_text(f"alpha {hash_secret(SECRET)}\n")
    compared = recorded_comparisons(monkeypatch)
    engine = RawEngine()
    async with fleet(engine, keys_file=str(keys)) as router:
        for value in (SECRET, SECRET[:-1] + "j", "sk-fw-other"):
            await exchange(router, post("x", extra=keyed(b"Bearer " + value.encode())))
        assert compared, "no constant-time comparison"
        assert all(len(a) == len(b) == 32 for a, b in compared)
        assert all(SECRET.encode() not in a + b for a, b in compared)
        ring = router.keys.ring if router.keys is not None else None
        assert ring is not None
    monkeypatch.undo()
    timings = {}
    for label, value in (("right key", SECRET), ("last byte wrong", SECRET[:-1] + "j"),
                         ("unrelated", "sk-fw-" + "z" * 43)):
        header = b"Bearer " + value.encode()
        started = time.perf_counter()
        for _ in range(20_000):
            ring.name_for(header)
        timings[label] = (time.perf_counter() - started) / 20_000 * 1e9
    print("\nname_for, ns per key: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))


# ---------------------------------------------------------------- the router's own limits

async def test_running_out_of_descriptors_is_never_evidence_against_an_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = RawEngine()
    # No KV-event sources read: the connection it keeps alive would carry the request past
    # the exhausted connect this test makes.
    async with fleet(engine, kv_events=False) as router:
        failed: list[tuple[str, str]] = []
        router.listen(lambda backend, cause: failed.append((backend, cause)))
        loop = asyncio.get_running_loop()

        async def exhausted(*args: object, **kwargs: object) -> object:
            raise OSError(errno.EMFILE, "Too many open files")

        client = await Client.connect(router)  # before the router's own connects fail
        monkeypatch.setattr(loop, "create_connection", exhausted)
        await client.send(post("x"))
        clear_error(await client.answer(), 503)
        client.close()
        assert failed == [] and router.stats.backend_failures == {}
        assert router.serving_backends() == [engine.url]
        assert router.stats.local_exhaustion == 1
