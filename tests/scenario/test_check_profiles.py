"""`fleetwarden check` on each engine profile, against captures of that engine's ``/metrics``.

A replay server answers ``/metrics`` with one capture after another (the last one again once the
list is used up) on a real socket, and ``fleetwarden check`` runs as a subprocess, as cron or a
liveness probe runs it. llama.cpp's bodies were captured from a real ``llama-server`` on this
machine kind; SGLang's and TGI's are constructed from their source (see each fixture README).

The replay server is a stand-in for the engine only: what is under test is the real check, its
profile detection, the reader and the judge.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from fleetwarden.engines import AUTO
from fleetwarden.judge import Verdict, WatchdogPolicy
from fleetwarden.watchdog import Target, Watchdog
from support.sim import Load, canaries, set_fault, stats, until
from support.sim import run_check as check_url

pytestmark = pytest.mark.scenario

FIXTURES = Path(__file__).parent.parent / "fixtures"


@dataclass(frozen=True)
class Body:
    text: str
    headers: dict[str, str] = field(default_factory=dict)


def capture(engine: str, name: str) -> Body:
    text = (FIXTURES / engine / name).read_text()
    sidecar = FIXTURES / engine / name.replace(".txt", ".headers.json")
    headers: dict[str, str] = {}
    if sidecar.exists():
        sent = json.loads(sidecar.read_text())
        headers = {k: v for k, v in sent.items() if k.lower().startswith("process-start")}
    elif engine == "llamacpp":
        # The busy and wedged bodies were captured without their headers (fixture README):
        # send the first process's header with them, as that process would.
        headers = capture("llamacpp", "metrics_idle_fresh.txt").headers
    return Body(text, headers)


@dataclass
class Replay:
    """``/metrics`` from a list of bodies; ``/health``, ``/v1/models`` and a completion."""

    bodies: Sequence[Body]
    metrics_status: int = 200
    reads: int = 0
    completions: int = 0
    url: str = ""

    async def _metrics(self, _: web.Request) -> web.Response:
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status, text="metrics are off")
        body = self.bodies[min(self.reads, len(self.bodies) - 1)]
        self.reads += 1
        return web.Response(text=body.text, headers=body.headers,
                            content_type="text/plain")

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def _completion(self, _: web.Request) -> web.Response:
        self.completions += 1
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": "tiny",
                                  "choices": [{"index": 0, "text": "x",
                                               "finish_reason": "length"}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completion)
        return app


async def serve(replay: Replay) -> AsyncIterator[Replay]:
    runner = web.AppRunner(replay.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    replay.url = f"http://127.0.0.1:{port}"
    try:
        yield replay
    finally:
        await runner.cleanup()


async def run_check(bodies: Sequence[Body], *args: str, metrics_status: int = 200
                    ) -> tuple[int, dict[str, Any], Replay]:
    async for replay in serve(Replay(bodies, metrics_status)):
        code, report = await check_url(replay.url, *args)
        return code, report, replay
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------- llama.cpp (captured)


async def test_llamacpp_idle_is_recognised_and_proved_by_one_canary() -> None:
    idle = capture("llamacpp", "metrics_idle_fresh.txt")
    code, report, replay = await run_check([idle, idle])
    assert (code, report["verdict"], report["engine"]) == (0, "idle", "llamacpp")
    assert report["canary"]["ok"] is True and replay.completions == 1
    assert report["incarnation"] == repr(2633240348.0)  # the header, compared only


async def test_llamacpp_busy_by_its_decode_counter_gets_no_canary() -> None:
    code, report, replay = await run_check([capture("llamacpp", "metrics_busy.txt"),
                                            capture("llamacpp", "metrics_after_sigcont.txt")])
    assert (code, report["verdict"], report["canary"]) == (0, "busy", None)
    assert report["evidence"]["deltas"]["steps"] == 10381 - 283
    assert replay.completions == 0


async def test_llamacpp_compute_only_wedge_is_stuck_while_it_answers_metrics() -> None:
    code, report, replay = await run_check([capture("llamacpp", "metrics_wedged_compute.txt")])
    assert (code, report["verdict"], report["engine"]) == (1, "stuck", "llamacpp")
    assert report["evidence"]["running"] == 4 and report["evidence"]["deltas"]["steps"] == 0
    assert replay.completions == 0


async def test_llamacpp_restart_shows_in_its_start_header_and_gets_a_canary() -> None:
    code, report, _ = await run_check(
        [capture("llamacpp", "metrics_idle_fresh.txt"),
         capture("llamacpp", "metrics_idle_fresh_after_restart.txt")])
    assert (code, report["verdict"]) == (0, "restarted")
    assert report["canary"]["ok"] is True


async def test_llamacpp_as_configured_reads_the_same() -> None:
    idle = capture("llamacpp", "metrics_idle_fresh.txt")
    code, report, _ = await run_check([idle, idle], "--engine", "llamacpp")
    assert (code, report["verdict"], report["engine"]) == (0, "idle", "llamacpp")


async def test_a_vllm_profile_on_a_llamacpp_body_cannot_judge_progress() -> None:
    idle = capture("llamacpp", "metrics_idle_fresh.txt")
    code, report, _ = await run_check([idle, idle], "--engine", "vllm")
    assert report["verdict"] == "no-metrics" and "lacks vllm:" in report["evidence"]["problem"]
    assert code == 0 and report["canary"]["ok"] is True  # idle: the canary decides


# ---------------------------------------------------------------------- SGLang, TGI (from source)


@pytest.mark.parametrize("engine", ["sglang", "tgi"])
async def test_idle_is_recognised_and_proved_by_one_canary(engine: str) -> None:
    idle = capture(engine, "metrics_idle.txt")
    code, report, replay = await run_check([idle, idle])
    assert (code, report["verdict"], report["engine"]) == (0, "idle", engine)
    assert replay.completions == 1


@pytest.mark.parametrize("engine", ["sglang", "tgi"])
async def test_busy_by_the_step_counter_while_finished_tokens_stay_flat(engine: str) -> None:
    code, report, replay = await run_check([capture(engine, "metrics_busy_1.txt"),
                                            capture(engine, "metrics_busy_2.txt")])
    assert (code, report["verdict"], report["canary"]) == (0, "busy", None)
    deltas = report["evidence"]["deltas"]
    assert deltas["steps"] > 0 and deltas["generation_tokens"] == 0
    assert replay.completions == 0


async def test_tgi_wedge_is_stuck() -> None:
    code, report, _ = await run_check([capture("tgi", "metrics_busy_2.txt")])
    assert (code, report["verdict"], report["engine"]) == (1, "stuck", "tgi")


async def test_sglang_limits_are_said_in_the_report() -> None:
    idle = capture("sglang", "metrics_idle.txt")
    _, report, _ = await run_check([idle, idle])
    assert any("45 s" in limit for limit in report["engine_limits"])
    assert any("constructed from source" in limit for limit in report["engine_limits"])


async def test_sglang_stale_gauges_are_never_stuck_before_its_min_stall() -> None:
    """SGLang refreshes its gauges every 30 s when idle: "3 running" with flat counters is not
    a wedge until 45 s have passed, whatever the policy's stall_s (a fake clock: no waiting)."""
    stale = capture("sglang", "metrics_idle_stale_gauges.txt")
    now = [0.0]
    async for replay in serve(Replay([stale])):
        policy = WatchdogPolicy(stall_s=0.8, stall_waits=2)
        async with Watchdog(policy, clock=lambda: now[0]) as watchdog:
            target = Target(replay.url, engine=AUTO)
            await watchdog.observe(target)
            verdicts = []
            for _ in range(4):
                now[0] += 14.0
                verdicts.append((await watchdog.probe(target)).verdict)
            assert verdicts[:3] == [Verdict.STALLED] * 3  # 14, 28, 42 s: under 45 s
            assert verdicts[3] is Verdict.STUCK  # 56 s
            assert replay.completions == 0


# ---------------------------------------------------------------------- openai (no /metrics)


async def test_openai_profile_is_judged_by_its_canary_and_says_its_limits() -> None:
    code, report, replay = await run_check([Body("")], "--engine", "openai",
                                           metrics_status=404)
    assert (code, report["verdict"], report["engine"]) == (0, "no-metrics", "openai")
    assert replay.reads == 0  # never asks /metrics
    assert replay.completions == 1
    assert any("no progress proof" in limit for limit in report["engine_limits"])


async def test_openai_profile_with_requests_in_flight_cannot_be_judged() -> None:
    code, report, replay = await run_check([Body("")], "--engine", "openai", "--in-flight", "2",
                                           metrics_status=404)
    assert (code, report["verdict"], report["canary"]) == (3, "no-metrics", None)
    assert replay.completions == 0


async def test_an_unknown_metrics_body_is_no_metrics_and_names_the_engines_known() -> None:
    code, report, _ = await run_check([Body("# TYPE foo_requests gauge\nfoo_requests 3\n")])
    assert report["verdict"] == "no-metrics" and report["engine"] is None
    assert "vllm, llamacpp, sglang, tgi" in report["evidence"]["problem"]
    assert code == 0  # idle as far as anyone can tell: its canary answered


# ---------------------------------------------------------------------- the simulator's dialects


async def busy(http: Any, url: str, n: int) -> None:
    async def full() -> bool:
        return int((await stats(http, url))["engine"]["running"]) == n

    await until(full)


@pytest.mark.parametrize("engine", ["llamacpp", "sglang"])
async def test_a_simulated_engine_speaks_its_dialect_idle(spawn: Any, http: Any,
                                                          engine: str) -> None:
    sim = spawn("--engine", engine)
    code, report = await check_url(sim.url)
    assert (code, report["verdict"], report["engine"]) == (0, "idle", engine)
    assert len(canaries(await stats(http, sim.url))) == 1


@pytest.mark.parametrize("engine", ["llamacpp", "sglang"])
async def test_a_simulated_engine_busy_in_its_dialect_gets_no_canary(spawn: Any, http: Any,
                                                                     engine: str) -> None:
    sim = spawn("--engine", engine, "--slots", "2")
    async with Load(http, sim.url, n=2, max_tokens=4000):
        await busy(http, sim.url, 2)
        await asyncio.sleep(0.5)  # SGLang's gauges are written at the prefill: let it happen
        code, report = await check_url(sim.url)
    assert (code, report["verdict"], report["engine"], report["canary"]) == (
        0, "busy", engine, None)
    assert canaries(await stats(http, sim.url)) == []


async def test_a_simulated_llamacpp_wedge_under_load_is_stuck(spawn: Any, http: Any) -> None:
    sim = spawn("--engine", "llamacpp", "--slots", "2")
    async with Load(http, sim.url, n=2, max_tokens=4000):
        await busy(http, sim.url, 2)
        await set_fault(http, sim.url, "wedge")
        code, report = await check_url(sim.url)
    assert (code, report["verdict"], report["engine"]) == (1, "stuck", "llamacpp")
    assert canaries(await stats(http, sim.url)) == []


async def test_the_simulated_llamacpp_header_changes_on_a_restart(spawn: Any, http: Any) -> None:
    sim = spawn("--engine", "llamacpp")
    async with http.get(sim.url + "/metrics") as r:
        first = r.headers["Process-Start-Time-Unix"]
        assert "process_start_time" not in await r.text() and "{" not in await r.text()
    await set_fault(http, sim.url, "restart")
    async with http.get(sim.url + "/metrics") as r:
        assert r.headers["Process-Start-Time-Unix"] != first
    async with http.get(sim.url + "/slots") as r:
        assert [s["is_processing"] for s in await r.json()] == [False] * 8


async def test_an_attached_llamacpp_engines_incarnation_is_its_start_header(
        spawn: Any, http: Any) -> None:
    """Attach mode waits for a restarted engine to answer as a new process: for llama.cpp that
    is told by its start header (it has no start-time family)."""
    from fleetwarden.launchers.attach import read_incarnation

    sim = spawn("--engine", "llamacpp")
    healthy, before = await read_incarnation(http, sim.url)
    assert healthy and before is not None
    await set_fault(http, sim.url, "restart")
    healthy, after = await read_incarnation(http, sim.url)
    assert healthy and after is not None and after != before
