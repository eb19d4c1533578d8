"""Bad input, end to end: each gets a clear answer, and nothing is lost or crashes.

A whole fleet of simulated engines runs in the test's loop; where a test needs an engine that
misbehaves in a way the simulator does not, a small server of the test's own is attached.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from fleetwarden.ledger import ShardState
from fleetwarden.testing.load import Load
from support.fleet import running_fleet, sim_stats, until

pytestmark = pytest.mark.scenario

H = ShardState.HEALTHY
COMPLETIONS = "/v1/completions"


async def routed(url: str) -> int:
    """Completions an engine received, not counting the watchdog's canaries."""
    log = (await sim_stats(url))["log"]
    return sum(1 for e in log if e["path"] == COMPLETIONS
               and not (e.get("request_id") or "").startswith("fleetwarden-canary"))


async def post_raw(url: str, body: bytes) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as http, http.post(
            url + COMPLETIONS, data=body, headers={"content-type": "application/json"}) as r:
        return r.status, await r.json()


async def test_non_json_and_truncated_bodies_get_the_engines_400_and_count_as_no_failure(
        tmp_path: Path) -> None:
    async with running_fleet(tmp_path) as fleet:
        engine = fleet.ledger.shard(0).base_url
        for body in (b"this is not json", b'{"model": "tiny", "prompt": "hel'):
            direct = await post_raw(engine, body)
            through = await post_raw(fleet.router_url, body)
            assert through == direct  # the engine's own 400, unchanged
            assert through[0] == 400 and through[1]["error"]["type"] == "Bad Request"  # type: ignore[index]
        ticks = fleet.controller.tick_number
        await until(lambda: fleet.controller.tick_number >= ticks + 2, what="drained")
        assert fleet.router.stats.backend_failures == {}
        assert all(r.consecutive_reported_failures == 0 for r in fleet.ledger.snapshot())
        assert [r.state for r in fleet.ledger.snapshot()] == [H, H]


async def test_a_body_over_the_limit_is_413_and_nothing_is_forwarded(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, router={"max_body_bytes": 4096}) as fleet:
        received = [await routed(u) for u in fleet.ledger.serving_urls()]
        big = b'{"model": "tiny", "prompt": "' + b"x" * 10_000 + b'", "max_tokens": 1}'
        status, body = await post_raw(fleet.router_url, big)
        assert status == 413 and "4096" in body["error"]["message"]  # type: ignore[index]
        assert [await routed(u) for u in fleet.ledger.serving_urls()] == received == [0, 0]


async def test_a_client_that_sends_headers_then_stalls_times_out_without_holding_a_backend(
        tmp_path: Path) -> None:
    async with running_fleet(tmp_path, router={"client_body_timeout_s": 1.0}) as fleet:
        host, port = fleet.router_url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                     b'{"model": ')  # ... and nothing more
        await writer.drain()
        answer = asyncio.create_task(reader.read(4096))
        while not answer.done():  # while the client stalls, no engine has anything of it
            assert sum(fleet.router.in_flight().values()) == 0
            await asyncio.sleep(0.05)
        assert answer.result().startswith(b"HTTP/1.1 408")
        writer.close()
        for url in fleet.ledger.serving_urls():
            assert await routed(url) == 0
        async with Load(fleet.router_url, concurrency=2, total=4) as load:  # still serving
            await load.wait()
        assert load.failures == []


async def test_a_client_that_disconnects_mid_stream_cancels_the_upstream(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, fleet={"engines": 1}) as fleet:
        engine = fleet.ledger.shard(0).base_url
        async with aiohttp.ClientSession() as http:
            resp = await http.post(fleet.router_url + COMPLETIONS, json={
                "model": "tiny", "prompt": "hello", "max_tokens": 5000, "stream": True})
            assert resp.status == 200
            await resp.content.readline()  # the stream has begun
            assert (await sim_stats(engine))["engine"]["running"] == 1
            resp.close()  # the client goes away mid-stream
        await until(lambda: fleet.router.in_flight().get(engine, 0) == 0, what="router let go")
        stats: dict[str, object] = {}

        async def engine_idle() -> bool:
            stats.update(await sim_stats(engine))
            return stats["engine"]["running"] == 0  # type: ignore[index]

        for _ in range(100):
            if await engine_idle():
                break
            await asyncio.sleep(0.05)
        assert stats["engine"]["running"] == 0  # type: ignore[index]  # aborted, not decoding on


class BadEngine:
    """An attached engine whose /metrics misbehaves; generations and /health are fine."""

    def __init__(self, metrics: str) -> None:
        self.metrics = metrics
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> BadEngine:
        async def health(_: web.Request) -> web.Response:
            return web.Response()

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list",
                                      "data": [{"id": "tiny", "object": "model"}]})

        async def complete(_: web.Request) -> web.Response:
            return web.json_response(
                {"id": "x", "object": "text_completion", "model": "tiny",
                 "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", models)
        app.router.add_post(COMPLETIONS, complete)
        # a handler asleep in "slow" must not hold the runner for its 30 s at cleanup
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        if self.metrics == "garbage":
            return web.Response(text="vllm:num_requests_running{engine= 4 4 4\n\x00\x01 junk {{{")
        if self.metrics == "enormous":
            resp = web.StreamResponse()
            await resp.prepare(request)
            line = b"vllm:num_requests_running{engine=\"0\"} 0.0\n" * 1000
            for _ in range(1000):  # ~44 MB, more than anyone should read
                await resp.write(line)
            return resp
        await asyncio.sleep(30)  # slow: longer than any read timeout
        return web.Response(text="")

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@contextlib.asynccontextmanager
async def bad_engine(metrics: str) -> AsyncIterator[BadEngine]:
    engine = await BadEngine(metrics).start()
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.mark.parametrize("metrics", ["garbage", "enormous", "slow"])
async def test_garbage_enormous_or_slow_metrics_are_no_metrics_never_a_crash(
        tmp_path: Path, metrics: str) -> None:
    async with bad_engine(metrics) as engine, running_fleet(
            tmp_path, fleet={"engines": 1, "backends": [engine.url]}) as fleet:
        ticks = fleet.controller.tick_number
        await until(lambda: fleet.controller.tick_number >= ticks + 6, timeout=40,
                    what="six ticks")
        report = fleet.controller.reports[1]
        assert report.verdict.name == "NO_METRICS", report.evidence.summary
        assert fleet.ledger.state(1) is H  # judged by /health and a canary, not condemned
        last = fleet.controller.last_tick
        assert last is not None and last.duration_s < 10  # the read was bounded
        async with Load(fleet.router_url, concurrency=2, total=6) as load:
            await load.wait()
        assert load.failures == []


async def test_an_engine_that_answers_non_http_bytes_is_a_counted_failure(
        tmp_path: Path) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\x00\xff\xfe not http at all\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(garbage, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with running_fleet(tmp_path, fleet={"engines": 1, "backends": [url]},
                                 health={"canary_interval_s": 3600}) as fleet:
            async with Load(fleet.router_url, concurrency=2, total=12) as load:
                await load.wait()
            assert load.failures == []  # every one re-sent to the engine that speaks HTTP
            assert any(u == url for u, _ in fleet.router.stats.backend_failures)
            await until(lambda: fleet.ledger.shard(1).consecutive_reported_failures > 0
                        or fleet.ledger.state(1) is not H, what="counted against it")
    finally:
        server.close()
        await server.wait_closed()


async def test_no_admin_token_ever_reaches_a_log(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with running_fleet(tmp_path) as fleet:
        async with aiohttp.ClientSession() as http:
            for token in (fleet.admin.token, "wrong-token-0123456789abcdef"):
                async with http.get(f"{fleet.admin_url}/admin/status?token={token}") as r:
                    assert r.status == 401  # a query token belongs to the sign-in link only
                async with http.post(fleet.admin_url + "/admin/shards/0/retire",
                                     headers={"Authorization": f"Bearer {token}x"}) as r:
                    assert r.status == 401
        assert fleet.ledger.state(0) is H  # the refused retire changed nothing
        token = fleet.admin.token
    logged = caplog.text + "".join(p.read_text(errors="replace")
                                   for p in (tmp_path / "logs").glob("*.log"))
    assert token not in logged and "wrong-token" not in logged
