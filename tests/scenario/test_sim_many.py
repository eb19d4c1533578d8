"""Many simulated engines in one process (``fleetwarden sim --engines N``): each its own port,
state and faults, so a fault on one touches no other (docs/design.md, "A fleet at scale")."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import aiohttp
import pytest

from fleetwarden.sim import SimConfig
from fleetwarden.sim.many import SimGroup, configs, files_needed, raise_file_limit
from support.sim import Load, SimProcess, metrics, set_fault, stats, until

pytestmark = pytest.mark.scenario


async def complete(http: aiohttp.ClientSession, url: str, max_tokens: int = 2) -> int:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": max_tokens}
    async with http.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status


def test_each_engine_gets_its_own_port() -> None:
    assert [c.port for c in configs(SimConfig(port=9000), 3)] == [9000, 9001, 9002]
    assert [c.port for c in configs(SimConfig(port=0), 3)] == [0, 0, 0]
    with pytest.raises(ValueError, match="engines must be >= 1"):
        configs(SimConfig(), 0)


def test_the_file_limit_is_raised_never_lowered() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert raise_file_limit(16) == soft  # asking for less leaves it
    assert files_needed(1000) > 1000 * 3  # a listener and two clients per engine, at least


async def test_a_wedge_on_one_engine_leaves_the_others_serving(
    http: aiohttp.ClientSession
) -> None:
    async with SimGroup([SimConfig(slots=2, steps_per_s=50) for _ in range(4)]) as group:
        urls = group.urls
        assert len(set(urls)) == 4
        await set_fault(http, urls[1], "wedge")
        async with Load(http, urls[1], n=1, max_tokens=5):
            async def held() -> bool:
                return bool((await stats(http, urls[1]))["engine"]["held"] == 1)

            await until(held)
            for url in (urls[0], urls[2], urls[3]):
                assert await asyncio.wait_for(complete(http, url), 10) == 200
            frozen = await metrics(http, urls[1])
            assert frozen.running == 0  # held in its inbox, the loop stopped
        for i, url in enumerate(urls):
            assert (await stats(http, url))["fault"]["mode"] == ("wedge" if i == 1 else None)


async def test_a_crash_ends_that_engine_alone(http: aiohttp.ClientSession) -> None:
    async with SimGroup([SimConfig(slots=2, steps_per_s=50, crash_exit_s=0.05)
                         for _ in range(3)]) as group:
        urls = group.urls
        async with Load(http, urls[0], n=1, max_tokens=4000):
            async def running() -> bool:
                return (await metrics(http, urls[0])).running == 1

            await until(running)
            await set_fault(http, urls[0], "crash")
            await asyncio.wait_for(group.sims[0].exited.wait(), 10)
        async with aiohttp.ClientSession() as fresh:
            with pytest.raises(aiohttp.ClientConnectionError):
                async with fresh.get(urls[0] + "/health"):
                    pass
            for url in urls[1:]:
                async with fresh.get(url + "/health") as r:
                    assert r.status == 200
                assert await asyncio.wait_for(complete(fresh, url), 10) == 200
        assert not group.all_exited.is_set()


async def test_the_command_serves_many_engines_and_outlives_a_crash(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    proc: SimProcess = spawn("--engines", "3", "--steps-per-s", "50")
    assert len(set(proc.urls)) == 3
    await set_fault(http, proc.urls[2], "crash")

    async def refused() -> bool:
        try:
            async with aiohttp.ClientSession() as fresh, fresh.get(proc.urls[2] + "/health"):
                return False
        except aiohttp.ClientConnectionError:
            return True

    await until(refused)
    for url in proc.urls[:2]:
        assert await asyncio.wait_for(complete(http, url), 10) == 200
    assert proc.proc.poll() is None  # one engine's crash is not the process's end
    proc.terminate(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 20) == 0


async def test_the_command_ends_with_1_once_every_engine_crashed(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    proc: SimProcess = spawn("--engines", "2")
    for url in proc.urls:
        await set_fault(http, url, "crash")
    assert await asyncio.to_thread(proc.wait, 20) == 1


async def test_an_engines_metrics_body_is_kept_only_until_it_changes(
    http: aiohttp.ClientSession
) -> None:
    async with SimGroup([SimConfig(slots=2, steps_per_s=50) for _ in range(2)]) as group:
        url = group.urls[0]
        families: Any = group.sims[0]._families
        rendered: list[int] = []
        render = families._inner.exposition

        def counted() -> bytes:
            rendered.append(1)
            return bytes(render())

        families._inner.exposition = counted
        async with http.get(url + "/metrics") as r:
            first = await r.read()
        async with http.get(url + "/metrics") as r:
            assert await r.read() == first
        assert len(rendered) == 1  # idle: the same bytes, rendered once
        before = await metrics(http, url)
        assert await complete(http, url, max_tokens=3) == 200
        after = await metrics(http, url)
        assert after.generation_tokens == before.generation_tokens + 3  # a change shows
        assert len(rendered) >= 2
        other = await metrics(http, group.urls[1])
        assert other.generation_tokens == 0  # the other engine's body is its own
