"""Sleep mode end to end: a sleeping engine is neither routed to, canaried, judged
stuck nor restarted, however long it sleeps, and serves again when it wakes.

Real `fleetwarden sim` engine processes with vLLM's sleep endpoints and metric. The watchdog runs
at a 0.05 s tick (about 0.1 s a round under load on 2 cores) with a 0.5 s stall and a 0.2 s
canary interval, so the ~10 s a sleep lasts here is some 100 rounds, 20 stall windows and 50
canary intervals: minutes of a fleet at its defaults (a 5 s tick), in the judge's terms.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleetwarden.client import FleetClient
from fleetwarden.fleet import Fleet
from fleetwarden.ledger import ShardState
from fleetwarden.sleep import put_to_sleep
from fleetwarden.testing.load import Load
from fleetwarden.watchdog import CANARY_ID_PREFIX
from support.fleet import record_transitions, running_fleet, served_ids, sim_stats, stamp, until

pytestmark = pytest.mark.scenario

H, SL, SUSPECT = ShardState.HEALTHY, ShardState.SLEEPING, ShardState.SUSPECT
FAST = {"probe_interval_s": 0.05, "stall_s": 0.5, "canary_interval_s": 0.2}
#: How long each test keeps an engine asleep under the watchdog and load.
ASLEEP_S = 10.0


async def engine_post(url: str, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url + path) as r:
        return r.status, await r.json(content_type=None) if await r.read() else None


def generations_and_canaries(stats: dict[str, Any], since: float) -> tuple[int, int]:
    log = [e for e in stats["log"] if e["at"] >= since and e["path"] == "/v1/completions"]
    canaries = [e for e in log if (e["request_id"] or "").startswith(CANARY_ID_PREFIX)]
    return len(log) - len(canaries), len(canaries)


async def asleep_under_load(fleet: Fleet, shard: int) -> tuple[Load, float]:
    """Load through the router for ASLEEP_S while ``shard`` sleeps; the load and when it began."""
    began = time.time()
    async with Load(fleet.router_url, concurrency=4, max_tokens=4, think_s=0.02) as load:
        await asyncio.sleep(ASLEEP_S)
    return load, began


async def test_an_engine_put_to_sleep_by_someone_else_is_left_alone_then_serves_on_wake(
        tmp_path: Path) -> None:
    async with running_fleet(tmp_path, health=FAST) as fleet:
        seen = record_transitions(fleet)
        url = fleet.ledger.shard(1).base_url
        incarnation = fleet.ledger.shard(1).incarnation
        ticks = fleet.controller.tick_number
        assert await engine_post(url, "/sleep?level=1") == (200, {"status": "sleeping",
                                                                   "level": 1})
        await until(lambda: fleet.ledger.state(1) is SL, what="the watchdog sees it asleep")
        assert fleet.ledger.serving_urls() == [fleet.ledger.shard(0).base_url]

        load, began = await asleep_under_load(fleet, 1)
        # Watchdog rounds kept judging it: 10 s is 20 stall windows and 50 canary intervals
        assert fleet.controller.tick_number - ticks >= 40
        assert load.failures == [] and len(load.results) > 50
        generations, canaries = generations_and_canaries(await sim_stats(url), began)
        assert (generations, canaries) == (0, 0)  # never routed to, never canaried
        rec = fleet.ledger.shard(1)
        assert rec.state is SL and rec.restart_attempts == 0 and rec.incarnation == incarnation
        assert fleet.controller.reports[1].verdict.name == "SLEEPING"
        # Nothing else happened: at most a canary that was in flight when the sleep landed
        # failed first (the sim's loop stops at once, as vLLM's does), making it SUSPECT on
        # the way (make test's load met that once); never a restart or a condemnation.
        went = [(t.to_state, t.cause) for t in seen if t.shard == 1]
        assert [state for state, _ in went] in ([SL], [SUSPECT, SL]), went
        assert all("probe failed" in cause for state, cause in went if state is SUSPECT), went

        assert (await engine_post(url, "/wake_up"))[0] == 200
        await until(lambda: fleet.ledger.state(1) is H, what="it serves again on wake")
        async with Load(fleet.router_url, concurrency=4, max_tokens=4, total=40) as load:
            await load.wait()
        assert load.failures == []
        assert generations_and_canaries(await sim_stats(url), time.time() - 30)[0] > 0
        assert fleet.ledger.shard(1).restart_attempts == 0


async def test_the_trainers_bracket_sleeps_engines_under_load_and_wakes_them(
        tmp_path: Path) -> None:
    async with running_fleet(tmp_path, health=FAST) as fleet:
        client = FleetClient(fleet.admin_url, token=fleet.admin.token)
        url = fleet.ledger.shard(1).base_url
        async with Load(fleet.router_url, concurrency=4, max_tokens=8, think_s=0.02,
                        stream=True) as load:
            await until(lambda: len(load.results) >= 10, what="load flows to both engines")
            slept = await asyncio.to_thread(client.sleep, 1, [1])
            assert slept["shards"] == [{"shard": 1, "url": url, "state": "SLEEPING",
                                        "error": ""}]
            put_to_sleep_at = time.time()
            await asyncio.sleep(ASLEEP_S)
        assert load.failures == []  # nothing failed, nothing was left waiting on it
        generations, canaries = generations_and_canaries(await sim_stats(url),
                                                         put_to_sleep_at)
        assert (generations, canaries) == (0, 0)
        assert (await sim_stats(url))["engine"]["sleep_level"] == 1
        assert fleet.ledger.state(1) is SL and fleet.ledger.shard(1).sleep_held

        # Asleep is reported as such; the whole fleet asleep is answered deliberately
        await asyncio.to_thread(client.sleep)
        assert fleet.ledger.sleeping() == [0, 1]
        status, body = await post_through(fleet)
        assert status == 409 and body["error"]["type"] == "no_backend_left"
        await until(lambda: fleet.controller.status.state == "asleep", what="status asleep")

        woke = await asyncio.to_thread(client.wake)
        assert [s["state"] for s in woke["shards"]] == ["HEALTHY", "HEALTHY"]
        assert fleet.ledger.serving() == [0, 1]  # the routers know before wake() returns
        async with Load(fleet.router_url, concurrency=4, max_tokens=4, total=40) as load:
            await load.wait()
        assert load.failures == []
        assert generations_and_canaries(await sim_stats(url), put_to_sleep_at)[0] > 0
        assert [fleet.ledger.shard(i).restart_attempts for i in (0, 1)] == [0, 0]


async def post_through(fleet: Fleet) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(
            fleet.router_url + "/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2}) as r:
        return r.status, await r.json()


async def test_a_level_2_sleeper_wakes_stale_and_serves_only_after_a_refit(
        tmp_path: Path) -> None:
    """A level-2 sleep frees the weights: woken, the engine holds none, so it must not serve
    under the version it had (nor unversioned) until a refit gives it weights again."""
    async with running_fleet(tmp_path, health=FAST) as fleet:
        client = FleetClient(fleet.admin_url, token=fleet.admin.token)
        await asyncio.to_thread(client.begin_refit, 3)
        await stamp(fleet, 3)
        await asyncio.to_thread(client.complete_refit, 3)
        url = fleet.ledger.shard(1).base_url
        slept = await asyncio.to_thread(client.sleep, 2, [1])
        assert slept["shards"][0]["error"] == ""
        assert (await sim_stats(url))["engine"]["sleep_level"] == 2
        assert fleet.ledger.shard(1).weights_discarded
        woke = await asyncio.to_thread(client.wake, [1])
        assert [s["state"] for s in woke["shards"]] == ["STALE"]
        assert fleet.ledger.serving_urls() == [fleet.ledger.shard(0).base_url]
        assert url not in fleet.router.serving_backends()
        # it answers canaries (an engine with no weights still generates): no promotion
        woke_at = time.time()
        await until(lambda: fleet.controller.tick_number >= 20, what="ticks go by")
        assert fleet.ledger.state(1) is ShardState.STALE
        assert generations_and_canaries(await sim_stats(url), woke_at)[0] == 0
        await asyncio.to_thread(client.begin_refit, 4)
        await stamp(fleet, 4)
        await asyncio.to_thread(client.complete_refit, 4)
        assert fleet.ledger.state(1) is H and fleet.ledger.shard(1).weight_version == 4
        await until(lambda: url in fleet.router.serving_backends(), what="routed again")


# ---------------------------------------------------------------------- answers under way


#: Generations of 3 s (120 tokens at the sim's 40 steps a second): under way when the
#: bracket is asked, and long past a short drain bound.
LONG = 120


async def send(fleet: Fleet, http: aiohttp.ClientSession, request_id: str, *, stream: bool,
               began: asyncio.Event | None = None) -> tuple[str, int, list[dict[str, Any]]]:
    """One completion through the router: (the shard that answered, status, its chunks; a
    whole answer is one chunk). ``began`` is set once a stream's first event has come."""
    body: dict[str, Any] = {"model": "tiny", "prompt": "hi", "max_tokens": LONG,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with http.post(fleet.router_url + "/v1/completions", json=body,
                         headers={"x-request-id": request_id}) as r:
        shard = r.headers.get("x-fleetwarden-shard", "")
        if not stream:
            return shard, r.status, [await r.json()]
        events = []
        while event := await r.content.readuntil(b"\n\n"):
            events.append(event.strip())
            if began is not None:
                began.set()
        assert events[-1] == b"data: [DONE]" and events.count(b"data: [DONE]") == 1, events[-3:]
        return shard, r.status, [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]


def whole(chunks: list[dict[str, Any]]) -> bool:
    """Every token once, a finish on length, usage for the whole, no error."""
    tokens = [c for c in chunks if c.get("choices")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return (not any("error" in c for c in chunks) and len(tokens) == LONG
            and tokens[-1]["choices"][0]["finish_reason"] == "length"
            and [u["completion_tokens"] for u in usage] == [LONG])


async def test_the_bracket_lets_streams_under_way_finish_and_moves_what_has_not_started(
        tmp_path: Path) -> None:
    async with running_fleet(tmp_path, health=FAST) as fleet, aiohttp.ClientSession() as http:
        client = FleetClient(fleet.admin_url, token=fleet.admin.token)
        url = fleet.ledger.shard(1).base_url
        began = [asyncio.Event() for _ in range(6)]
        tasks = {}
        for k in range(0, 6, 2):  # two of a kind at a time: each engine gets one of each
            for j in (k, k + 1):
                tasks[f"stream-{j}"] = asyncio.create_task(
                    send(fleet, http, f"stream-{j}", stream=True, began=began[j]))
                await asyncio.sleep(0.02)
            for j in (k, k + 1):
                tasks[f"whole-{j}"] = asyncio.create_task(send(fleet, http, f"whole-{j}",
                                                               stream=False))
                await asyncio.sleep(0.02)
        for event in began:  # every stream under way: its first tokens reached its client
            await asyncio.wait_for(event.wait(), 20)
        stats = await sim_stats(url)
        there = served_ids(stats, "stream-") | served_ids(stats, "whole-")
        slept = await asyncio.to_thread(client.sleep, 1, [1])
        assert [s["state"] for s in slept["shards"]] == ["SLEEPING"]
        answers = {rid: await asyncio.wait_for(task, 30) for rid, task in tasks.items()}

        streams_there = {rid for rid in there if rid.startswith("stream-")}
        waiting_there = {rid for rid in there if rid.startswith("whole-")}
        assert streams_there and waiting_there, there  # some of each were on shard 1
        for rid, (shard, status, chunks) in answers.items():
            assert status == 200, (rid, chunks)
            if rid.startswith("stream-"):
                assert whole(chunks), (rid, chunks[-2:])
                # a stream under way finished on its engine, never moved
                assert shard == ("1" if rid in streams_there else "0"), rid
            else:
                # one not yet answered was moved before the engine slept, and answered whole
                assert shard == "0", rid
                assert chunks[0]["usage"]["completion_tokens"] == LONG
        router = fleet.router.stats
        assert router.continuations == {"tokens": 0, "text": 0, "restart": 0}
        assert router.rescues == len(waiting_there) and router.backend_failures == {}
        assert (await sim_stats(url))["engine"]["sleep_level"] == 1


async def test_past_the_drain_bound_a_stream_under_way_goes_on_elsewhere(
        tmp_path: Path) -> None:
    async with running_fleet(tmp_path, health=FAST) as fleet, aiohttp.ClientSession() as http:
        began = asyncio.Event()
        task = asyncio.create_task(send(fleet, http, "stream-0", stream=True, began=began))
        await asyncio.wait_for(began.wait(), 20)
        [url] = [u for u, n in fleet.router.in_flight().items() if n]
        i = fleet.ledger.shard_for_url(url)
        assert i is not None
        # The drain bound (SLEEP_DRAIN_S) at 0.5 s: the stream has 2.5 s left.
        [result] = await put_to_sleep(fleet.ledger, fleet.controller.pushes, shards=[i],
                                      drain_s=0.5)
        assert (result.state, result.error) == ("SLEEPING", "")
        shard, status, chunks = await asyncio.wait_for(task, 30)  # never frozen asleep
        assert status == 200 and shard == str(i)  # its answer began there...
        assert whole(chunks), chunks[-2:]  # ... and went on elsewhere, whole
        assert fleet.router.stats.continuations == {"tokens": 1, "text": 0, "restart": 0}
        assert fleet.router.stats.streams_ended == {}
        assert (await sim_stats(url))["engine"]["sleep_level"] == 1
