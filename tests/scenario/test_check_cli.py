"""`fleetwarden check URL` as cron or a liveness probe runs it: a subprocess and its exit status,
against a `fleetwarden sim` in each mode.

0 healthy (busy, or idle with a good canary), 1 stuck or lost-core (or an idle engine whose
canary failed), 2 unreachable, 3 cannot judge.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import aiohttp
import pytest

from support.proxy import LeastConnectionsProxy
from support.sim import (
    CHECK_FAST,
    Load,
    SimProcess,
    free_port,
    metrics,
    run_check,
    set_fault,
    stats,
    until,
)

pytestmark = pytest.mark.scenario


async def fill(http: aiohttp.ClientSession, url: str, n: int) -> None:
    async def full() -> bool:
        return (await metrics(http, url)).running == n

    await until(full)


async def test_an_idle_engine_is_healthy(spawn: Any, http: aiohttp.ClientSession) -> None:
    sim: SimProcess = spawn()
    code, report = await run_check(sim.url)
    assert (code, report["verdict"], report["reads"]) == (0, "idle", 2)
    assert report["canary"]["ok"] is True


async def test_a_busy_engine_is_healthy_and_gets_no_canary(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    sim: SimProcess = spawn("--slots", "2")
    async with Load(http, sim.url, n=2, max_tokens=4000):
        await fill(http, sim.url, 2)
        code, report = await run_check(sim.url)
    assert (code, report["verdict"], report["canary"]) == (0, "busy", None)
    assert (await stats(http, sim.url))["by_path"]["/v1/completions"] == 2


async def test_a_slow_busy_engine_is_healthy(spawn: Any, http: aiohttp.ClientSession) -> None:
    sim: SimProcess = spawn("--slots", "1", "--fault", "slow", "--factor", "4")  # 5 steps/s
    async with Load(http, sim.url, n=1, max_tokens=4000):
        await fill(http, sim.url, 1)
        code, report = await run_check(sim.url, "--interval", "0.6")
    assert (code, report["verdict"]) == (0, "busy")


async def test_a_wedged_busy_engine_is_stuck_after_a_third_read(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    sim: SimProcess = spawn("--slots", "2")
    async with Load(http, sim.url, n=2, max_tokens=4000):
        await fill(http, sim.url, 2)
        await set_fault(http, sim.url, "wedge")
        code, report = await run_check(sim.url)
    assert (code, report["verdict"], report["reads"]) == (1, "stuck", 3)
    assert report["evidence"]["stalled_for_s"] >= 0.8
    assert report["canary"] is None


async def test_a_wedged_idle_engine_fails_its_canary(spawn: Any,
                                                    http: aiohttp.ClientSession) -> None:
    sim: SimProcess = spawn("--fault", "wedge")
    code, report = await run_check(sim.url)
    # Idle, and it held the canary for the (fast) stall floor with nothing advancing: a wedge,
    # not a slow engine (judge.held_its_canary; check reads before it sends the canary).
    assert (code, report["verdict"], report["health"]) == (1, "idle", "condemned")
    assert report["canary"]["ok"] is False
    assert "held its canary" in report["evidence"]["summary"]


async def test_a_wedged_idle_engine_with_requests_in_flight_is_a_lost_core(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    sim: SimProcess = spawn("--fault", "wedge")
    code, report = await run_check(sim.url, "--in-flight", "1")
    assert (code, report["verdict"], report["health"]) == (1, "lost-core", "condemned")


@pytest.mark.parametrize("mode", ["crash", "refuse"])
async def test_an_engine_that_is_gone_is_unreachable(spawn: Any, http: aiohttp.ClientSession,
                                                    mode: str) -> None:
    sim: SimProcess = spawn()
    await set_fault(http, sim.url, mode)
    if mode == "crash":
        await asyncio.to_thread(sim.wait, 20)
    code, report = await run_check(sim.url)
    assert (code, report["verdict"]) == (2, "unreachable")


async def test_a_closed_port_is_unreachable_and_says_so_in_words(spawn: Any) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetwarden", "check", f"http://127.0.0.1:{free_port()}",
        *CHECK_FAST,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert "UNREACHABLE (failing)" in out.decode() and "cannot connect" in out.decode()


async def test_an_engine_whose_generations_fail_fails_its_canary(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    sim: SimProcess = spawn("--fault", "error5xx")
    code, report = await run_check(sim.url)
    assert (code, report["verdict"], report["canary"]["status"]) == (1, "idle", 500)


@pytest.mark.parametrize("mode", ["no_metrics", "garbage_metrics"])
async def test_an_engine_without_metrics_is_judged_by_its_canary(
    spawn: Any, http: aiohttp.ClientSession, mode: str
) -> None:
    sim: SimProcess = spawn("--fault", mode)
    code, report = await run_check(sim.url)
    assert (code, report["verdict"], report["canary"]["ok"]) == (0, "no-metrics", True)


async def test_no_metrics_and_requests_in_flight_cannot_be_judged(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    sim: SimProcess = spawn("--fault", "no_metrics")
    code, report = await run_check(sim.url, "--in-flight", "2")
    assert (code, report["verdict"], report["canary"]) == (3, "no-metrics", None)


async def test_a_restart_between_the_reads_is_seen_and_gets_a_canary(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    sim: SimProcess = spawn()
    running = asyncio.create_task(run_check(sim.url, "--interval", "2"))

    async def first_read() -> bool:
        return (await stats(http, sim.url))["by_path"].get("/metrics", 0) >= 1

    await until(first_read)
    await set_fault(http, sim.url, "restart")
    code, report = await running
    assert (code, report["verdict"], report["canary"]["ok"]) == (0, "restarted", True)


async def test_a_proxy_is_checked_by_its_model_list(spawn: Any,
                                                    http: aiohttp.ClientSession) -> None:
    a: SimProcess = spawn()
    b: SimProcess = spawn()
    async with LeastConnectionsProxy([a.url, b.url]) as proxy:
        code, report = await run_check(proxy.url, "--proxy")
    assert (code, report["verdict"], report["reads"]) == (0, "reachable", 1)
    assert proxy.forwarded and {p for _, p, _ in proxy.forwarded} == {"/v1/models"}
    code, report = await run_check(f"http://127.0.0.1:{free_port()}", "--proxy")
    assert (code, report["verdict"]) == (2, "unreachable")
