"""The router under load while one of three engines fails, is replaced, wedges and is replaced.

20,000 requests at concurrency 64 through one router in front of three scripted engines. A
small controller plays the part the real one will (docs/design.md section 6) with the real ledger:
every tick it drains the router's outcomes into the ledger, restarts DEAD shards (a new engine
on a new port), pushes ``serving_urls()`` and rescues requests off condemned engines. The
watchdog's one verdict is scripted: the wedged engine is condemned as stuck.

The router must answer every request, never with 504, and end with nothing in flight.
"""

from __future__ import annotations

import asyncio
import collections
import json

import aiohttp
import pytest

from fleetwarden.ledger import Ledger, ShardState
from fleetwarden.router import Router, RouterSettings
from support.router_rig import until
from support.scripted_engine import ENGINE_DEAD, ScriptedEngine

REQUESTS = 20_000
CONCURRENCY = 64
#: The whole run is bounded: a request left to wait out backend_timeout_s (600 s) fails it.
BOUND_S = 150.0
#: The controller's tick, compressed from 5 s so the story fits in seconds of traffic.
TICK_S = 0.02


@pytest.mark.scenario
async def test_twenty_thousand_requests_through_a_failing_wedging_recovering_engine() -> None:
    engines = [await ScriptedEngine(keep_seen=False).start() for _ in range(3)]
    ledger = Ledger([e.url for e in engines])
    by_url = {e.url: e for e in engines}
    router = Router(ledger.serving_urls(), RouterSettings(), health_managed=True)
    await router.start()
    statuses: collections.Counter[int] = collections.Counter()
    errors: list[str] = []
    bodies_500: list[bytes] = []
    failures: collections.Counter[str] = collections.Counter()
    successes: collections.Counter[str] = collections.Counter()
    timeline: list[str] = []
    rescued: dict[str, int] = {}
    ledger.subscribe(lambda t: timeline.append(f"{t.from_state}->{t.to_state} {t.cause}")
                     if t.changes_state else None)
    done = issued = 0

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal done, issued
        while issued < REQUESTS:
            issued += 1
            stream = issued % 8 == 0
            path = "/v1/chat/completions" if stream else "/v1/completions"
            payload = ({"model": "tiny", "messages": [], "stream": True, "max_tokens": 16}
                       if stream
                       # a prompt of its own, as distinct clients': the default routing
                       # places distinct prompts by load (one prompt repeated it keeps home)
                       else {"model": "tiny", "prompt": f"hello {issued}", "max_tokens": 8})
            try:
                async with http.post(router.url + path, json=payload) as response:
                    body = await response.read()
                    statuses[response.status] += 1
                    if response.status == 500:
                        bodies_500.append(body)
            except aiohttp.ClientError as exc:
                errors.append(repr(exc))
            done += 1

    def drain() -> None:
        for url, (s, f, t) in router.pool.drain_outcomes().items():
            successes[url] += s
            failures[url] += f
            i = ledger.shard_for_url(url)
            if i is not None:  # a replaced engine's late outcomes belong to no shard
                ledger.report_outcomes(i, s, f, t)

    async def controller() -> None:
        phase, mark = "healthy", 0
        while done < REQUESTS:
            await asyncio.sleep(TICK_S)
            victim = ledger.shard(2).base_url  # shard 2's engine, whichever process it is now
            # the faults, injected by progress
            if phase == "healthy" and done >= 3000:
                by_url[victim].answer(ENGINE_DEAD)  # every generation fails: a trickle of 500s
                phase = "failing"
            elif phase == "replaced" and done >= 9000:
                by_url[victim].wedge()  # accepts, never answers; /health would stay 200
                phase, mark = "wedged", done
            # the tick: outcomes -> ledger; watchdog verdict; supervisor; push; rescue
            drain()
            if phase == "failing" and ledger.ejected() == [2]:
                # the focused read of the ejected engine: its canary fails as its requests do
                ledger.record_probe(2, ok=False, error="canary answered 500")
            condemned = []
            if phase == "wedged" and done >= mark + 1500 and by_url[victim].held > 0:
                ledger.condemn(2, "stuck: requests in flight, no progress")  # the watchdog
                phase = "condemned"
            for i in ledger.absent():
                if ledger.state(i) is ShardState.DEAD:
                    old = ledger.shard(i).base_url
                    condemned.append(old)
                    ledger.mark_restarting(i)
                    replacement = await ScriptedEngine(keep_seen=False).start()
                    by_url[replacement.url] = replacement
                    ledger.mark_loaded(i, replacement.url, f"launch-{replacement.url}")
                    ledger.report_refit(i, 0)  # static weights: the canary promotes it
                    phase = "replaced" if phase == "failing" else "recovered"
            router.set_serving_backends(ledger.serving_urls())
            for url in condemned:
                rescued[url] = router.forwarder.waiting.rescue(url)
                timeline.append(f"rescued {rescued[url]} off {url} at {done}")
                old_engine = by_url[url]
                # the supervisor stops the old process once the rescued requests left it
                await until(lambda e=old_engine: e.held == 0, what="rescued requests left")
                await old_engine.crash()

    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    try:
        async with asyncio.timeout(BOUND_S), \
                aiohttp.ClientSession(connector=connector) as http, asyncio.TaskGroup() as tg:
            tg.create_task(controller())
            for _ in range(CONCURRENCY):
                tg.create_task(client(http))
        drain()
        print(f"statuses {dict(statuses)}, rescues {router.stats.rescues}, "
              f"retries {router.stats.retries}, poison {router.stats.poison_requests}")
        print("\n".join(timeline))

        assert errors == []
        assert sum(statuses.values()) == REQUESTS  # every request answered
        assert 504 not in statuses
        assert set(statuses) <= {200, 500}
        first, second, third = engines[0].url, engines[1].url, engines[2].url
        # A 500 is the engine's own EngineDead answer, passed on when the fleet's retry budget
        # was spent (the bursts before the ledger condemned it), or the router's own naming the
        # failing engine. Never one of the healthy two.
        for body in bodies_500:
            assert body == ENGINE_DEAD.body or json.loads(body)["error"]["backend"] == third
        # Those 500s come only from windows in which the failing engine was still pushed: at
        # most the requests in flight per window, over the ledger's threshold of windows (and
        # the one under way when it condemned).
        windows = ledger.policy.unhealthy_threshold + 1
        assert statuses[500] <= windows * CONCURRENCY, (statuses, timeline)
        final = ledger.serving_urls()
        assert final[:2] == [first, second] and final[2] not in (third,)
        assert len(by_url) == 5  # the original three and two replacements of shard 2
        assert router.in_flight() == dict.fromkeys(final, 0)
        assert router.pool.total_in_flight == 0
        assert router.pool.retry_budget.requests_in_flight == 0
        assert router.pool.retry_budget.retries_in_flight == 0
        assert failures[first] == failures[second] == 0
        assert failures[third] > 0
        wedged = by_url[next(u for u in by_url if u not in (first, second, third, final[2]))]
        assert rescued[wedged.url] > 0 and wedged.cancelled == rescued[wedged.url], timeline
        assert router.stats.rescues == sum(rescued.values())
        assert by_url[final[2]].answered > 0
        assert successes[final[2]] == by_url[final[2]].answered
    finally:
        await router.stop()
        for e in by_url.values():
            await e.stop()
