"""Keys on the data port, on real sockets: a `fleetwarden route --keys-file` process on
127.0.0.1 in front of an engine that records what it receives. A request without a valid key
is answered 401 in OpenAI's shape and reaches no engine; a valid one is served, its key never
reaches the engine (the engine's own key takes its place when one is given), and its requests
and tokens are counted under its name; keys added and removed are in force within a second,
without a restart; no key is ever written to the router's log."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from fleetwarden.router import Router, RouterSettings
from fleetwarden.router.keys import RELOAD_EVERY_S, add_key, remove_key
from fleetwarden.router.pool import BackendFacts
from support.raw_http import Answer, Client, RawEngine, Received, post
from support.sim import SimProcess
from support.wait import until

pytestmark = pytest.mark.scenario

START_TIMEOUT_S = 30.0


async def answer_with_usage(request: Received, writer: asyncio.StreamWriter) -> bool:
    """A completion's whole answer with vLLM's usage: 11 prompt tokens, 3 completion ones."""
    body = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m",
                       "choices": [{"index": 0, "text": "abc", "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 11, "total_tokens": 14,
                                 "completion_tokens": 3}}).encode()
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d"
                 b"\r\n\r\n%b" % (len(body), body))
    return True


@dataclass
class RouteProcess:
    """A `fleetwarden route` subprocess; its log (stderr) goes to ``log``."""

    proc: subprocess.Popen[str]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def ask(router: Router | RouteProcess, data: bytes) -> Answer | None:
    """Send ``data`` on a new connection to ``router``; its first answer (read by h11)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    client = Client(reader, writer)
    try:
        await client.send(data)
        return await client.answer()
    finally:
        client.close()


@pytest.fixture
def route() -> Iterator[list[RouteProcess]]:
    started: list[RouteProcess] = []
    yield started
    for r in started:
        r.proc.terminate()
        try:
            r.proc.wait(10)
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait(10)


def start_route(started: list[RouteProcess], log: Path, *args: str) -> RouteProcess:
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fleetwarden", "route", "--port", "0",
             "--log-level", "info", *args],
            stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    line = ""
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if match := re.search(r"listening on http://127\.0\.0\.1:(\d+)", line):
            r = RouteProcess(proc, int(match.group(1)), log)
            started.append(r)
            return r
    proc.kill()
    raise AssertionError(f"fleetwarden route did not start: {line!r} {log.read_text()}")


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return str(r.read().decode())


def sample(text: str, family: str, label: str) -> float:
    match = re.search(rf"^{family}\{{{label}\}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def refused_for_its_key(answer: Answer | None) -> dict[str, object]:
    """A whole 401 in OpenAI's shape, code ``invalid_api_key``: its error object."""
    assert answer is not None and answer.complete
    assert answer.status == 401, (answer.status, answer.body[:300])
    assert answer.headers.get(b"www-authenticate", b"").startswith(b"Bearer")
    error = json.loads(answer.body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    return dict(error)


def keyed(secret: str) -> bytes:
    return b"Authorization: Bearer " + secret.encode() + b"\r\n"


async def test_a_router_process_with_keys_lets_in_only_its_keys_and_counts_each(
        route: list[RouteProcess], tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    alpha, beta = add_key(keys, "alpha"), add_key(keys, "beta")
    engine = await RawEngine(answer_with_usage).start()
    try:
        router = start_route(route, tmp_path / "router.log", "--backend", engine.url,
                             "--keys-file", str(keys))
        # Refused, each reaching no engine.
        refused_for_its_key(await ask(router, post("no key")))
        wrong = refused_for_its_key(await ask(
            router, post("wrong", extra=keyed("sk-fw-" + "x" * 43))))
        assert "Incorrect API key" in str(wrong["message"])
        for query in (f"?api_key={alpha}", f"?key={alpha}", f"?authorization=Bearer%20{alpha}"):
            error = refused_for_its_key(await ask(
                router, post("query", "/v1/completions" + query)))
            assert "query string is never read" in str(error["message"])
            assert alpha not in json.dumps(error)
        refused_for_its_key(await ask(router, post(
            "two", extra=keyed(alpha) + keyed(beta))))
        # A huge Authorization header: under the head limit, a wrong key (never hashed);
        # over it, the data port's own 431, the connection closed; the router lives on.
        refused_for_its_key(await ask(router, post(
            "big", extra=keyed("k" * 50_000))))
        huge = await ask(router, post("huge", extra=keyed("k" * 100_000)))
        assert huge is not None and huge.status == 431
        assert engine.received == []

        # Let in: the engine never sees the client's key.
        for secret, n in ((alpha, 3), (beta, 2)):
            for i in range(n):
                answer = await ask(router, post(f"ok {i}", extra=keyed(secret)))
                assert answer is not None and answer.status == 200, answer
        # A key in the query string beside a valid one goes no further either.
        answer = await ask(router, post("q", f"/v1/completions?api_key={beta}",
                                        extra=keyed(alpha)))
        assert answer is not None and answer.status == 200
        assert engine.received[-1].head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert len(engine.received) == 6
        assert all(b"authorization" not in r.headers for r in engine.received)
        assert all(alpha.encode() not in r.head and beta.encode() not in r.head
                   for r in engine.received)

        text = metrics_text(router.url)  # open without a key, as vLLM's is
        assert sample(text, "fleetwarden_router_key_requests_total", 'key="alpha"') == 4
        assert sample(text, "fleetwarden_router_key_requests_total", 'key="beta"') == 2
        assert sample(text, "fleetwarden_router_key_prompt_tokens_total", 'key="alpha"') == 44
        assert sample(text, "fleetwarden_router_key_completion_tokens_total",
                      'key="beta"') == 6
        assert sample(text, "fleetwarden_router_key_refusals_total", 'why="missing"') == 4
        assert sample(text, "fleetwarden_router_key_refusals_total", 'why="wrong"') == 2
        assert sample(text, "fleetwarden_router_key_refusals_total", 'why="ambiguous"') == 1

        # A key added, then one removed: in force without a restart.
        pid = router.proc.pid
        gamma = add_key(keys, "gamma")
        added = time.monotonic()

        async def served(secret: str) -> bool:
            answer = await ask(router, post("reload", extra=keyed(secret)))
            assert answer is not None
            return answer.status == 200

        await until(lambda: served(gamma), timeout=10 * RELOAD_EVERY_S + 10,
                    what="the added key let in")
        took_add = time.monotonic() - added
        remove_key(keys, "alpha")
        removed = time.monotonic()

        async def refused(secret: str) -> bool:
            return not await served(secret)

        await until(lambda: refused(alpha), timeout=10 * RELOAD_EVERY_S + 10,
                    what="the removed key refused")
        took_remove = time.monotonic() - removed
        assert await served(beta)
        assert router.proc.pid == pid and router.proc.poll() is None
        print(f"\nkeys file reread: a key added in force after {took_add:.2f} s, one removed "
              f"refused after {took_remove:.2f} s (reread every {RELOAD_EVERY_S:g} s)")

        log = router.log.read_text()
        assert "reread" in log
        for secret in (alpha, beta, gamma):
            assert secret not in log
    finally:
        await engine.stop()


async def test_the_engines_key_replaces_the_clients_and_streams_count_their_tokens(
        tmp_path: Path, spawn: Callable[..., SimProcess]) -> None:
    keys = tmp_path / "keys"
    alpha = add_key(keys, "alpha")
    engine = await RawEngine(answer_with_usage).start()
    router = Router([engine.url], RouterSettings(keys_file=str(keys)), engine_key="sk-engine")
    await router.start()
    try:
        answer = await ask(router, post("one", extra=keyed(alpha)))
        assert answer is not None and answer.status == 200
        (received,) = engine.received
        assert received.headers[b"authorization"] == b"Bearer sk-engine"
        assert alpha.encode() not in received.head
        # The fleet's push names each engine's own key (``[fleet] api_key_file``): with client
        # keys on, every attempt carries it, not only the router's continuations.
        router.set_serving_backends([engine.url], {engine.url: BackendFacts(0, None,
                                                                           key="sk-pushed")})
        answer = await ask(router, post("two", extra=keyed(alpha)))
        assert answer is not None and answer.status == 200
        received = engine.received[-1]
        assert received.headers[b"authorization"] == b"Bearer sk-pushed"
        assert alpha.encode() not in received.head
    finally:
        await router.stop()
        await engine.stop()

    # A stream the router reads event by event: its tokens from the engine's token ids.
    sim = spawn()
    router = Router([sim.url], RouterSettings(keys_file=str(keys)))
    await router.start()
    try:
        async with aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {alpha}"}) as http:
            async with http.get(router.url + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            async with http.post(router.url + "/v1/completions", json={
                    "model": model, "prompt": "hello there", "max_tokens": 7,
                    "stream": True}) as r:
                assert r.status == 200
                text = await r.text()
            assert text.rstrip().endswith("data: [DONE]")
            async with http.post(router.url + "/v1/completions", json={
                    "model": model, "prompt": "hello there", "max_tokens": 5}) as r:
                assert r.status == 200
                usage = (await r.json())["usage"]
        tally = router.stats.keys["alpha"]
        assert tally.requests == 3  # /v1/models, a stream, a whole answer
        assert tally.completion_tokens == 7 + usage["completion_tokens"]
        assert tally.prompt_tokens == 2 * usage["prompt_tokens"] > 0
        # What a worker reports to the fleet (its control API's status): the same counts.
        assert router.status()["stats"]["keys"] == {"alpha": tally.to_list()}
        keys.write_text("alpha sha256:broken\n")
        assert router.reload_keys() is False
        said = router.status()["keys_file"]
        assert said["path"] == str(keys) and said["keys"] == 1 and "line 1" in said["error"]
    finally:
        await router.stop()


async def test_a_kept_alive_client_is_refused_once_and_its_connection_closed(
        tmp_path: Path) -> None:
    """A 401 whose body was not read ends its connection (the rest is not read), so a client
    never has its next request parsed out of a refused one's body."""
    keys = tmp_path / "keys"
    add_key(keys, "alpha")
    engine = await RawEngine(answer_with_usage).start()
    router = Router([engine.url], RouterSettings(keys_file=str(keys)))
    await router.start()
    try:
        client = await Client.connect(router)
        try:
            body = post("smuggled", extra=b"")
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n"
                    % len(body))
            await client.send(head)  # the body (itself a request) not sent yet
            refused_for_its_key(await client.answer())
            with contextlib.suppress(ConnectionError):
                await client.send(body)
            assert await client.answer() is None
        finally:
            client.close()
        assert engine.received == []
    finally:
        await router.stop()
        await engine.stop()
