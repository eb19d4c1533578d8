"""The watchdog against real `fleetwarden sim` processes: one scenario per verdict, and the rule
of note 002 — a health check never consumes the resource it protects.

Times are shrunk (stall_s 1 s, rounds a few tenths of a second apart) so the whole file runs in
seconds; every wait polls for a condition with a deadline.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from fleetwarden.engine_metrics import Sample, parse
from fleetwarden.judge import Health, Verdict, WatchdogPolicy, judge
from fleetwarden.sim import Sim, SimConfig
from fleetwarden.watchdog import Report, Target, Watchdog
from support.proxy import LeastConnectionsProxy
from support.sim import Load, SimProcess, canaries, free_port, metrics, set_fault, stats, until

pytestmark = pytest.mark.scenario

POLICY = WatchdogPolicy(stall_s=1.0, canary_timeout_s=1.0)


async def rounds(watchdog: Watchdog, target: Target, n: int, every: float) -> list[Report]:
    reports = []
    for i in range(n):
        if i:
            await asyncio.sleep(every)
        reports.append((await watchdog.round([target]))[target.url])
    return reports


async def running(http: aiohttp.ClientSession, url: str, n: int) -> None:
    async def check() -> bool:
        return (await metrics(http, url)).running == n

    await until(check)


# ------------------------------------------------------------------ one scenario per verdict


async def test_an_idle_engine_is_idle_and_gets_one_canary_per_interval(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    sim: SimProcess = spawn()
    async with Watchdog(POLICY) as watchdog:
        first, second = await rounds(watchdog, Target(sim.url), 2, 0.2)
    assert (first.verdict, first.health) == (Verdict.IDLE, Health.PROVEN)
    assert first.canary is not None and first.canary.ok and first.canary.status == 200
    assert (second.verdict, second.canary, second.health) == (
        Verdict.IDLE, None, Health.UNPROVEN)  # the next canary is not due for 30 s
    seen = await stats(http, sim.url)
    # two rounds' reads, and one after the answered canary: the next round's baseline
    assert len(canaries(seen)) == 1 and seen["by_path"]["/metrics"] == 3
    assert first.incarnation == second.incarnation is not None


async def test_a_busy_engine_is_busy_and_proves_it_by_progress(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    sim: SimProcess = spawn("--slots", "2")
    async with Load(http, sim.url, n=2, max_tokens=4000):
        await running(http, sim.url, 2)
        async with Watchdog(POLICY) as watchdog:
            reports = await rounds(watchdog, Target(sim.url, in_flight=2), 3, 0.3)
    assert [r.verdict for r in reports] == [Verdict.FIRST_READ, Verdict.BUSY, Verdict.BUSY]
    busy = reports[-1]
    assert busy.health is Health.PROVEN and busy.canary is None
    assert busy.sample is not None and busy.sample.running == 2
    assert busy.tokens_per_s is not None and busy.tokens_per_s > 0
    assert "steps" in busy.evidence.moved
    assert canaries(await stats(http, sim.url)) == []


async def test_a_wedged_engine_with_requests_in_flight_is_stalled_then_stuck(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    sim: SimProcess = spawn("--slots", "2")
    async with Load(http, sim.url, n=2, max_tokens=4000), Watchdog(POLICY) as watchdog:
        await running(http, sim.url, 2)
        target = Target(sim.url, in_flight=2)
        await watchdog.round([target])
        await set_fault(http, sim.url, "wedge")
        reports: list[Report] = []
        for _ in range(20):  # 2 waits and 1 s of stall: ~4 rounds; 20 bounds a slow machine
            await asyncio.sleep(0.3)
            reports.append((await watchdog.round([target]))[sim.url])
            if reports[-1].verdict is Verdict.STUCK:
                break
    verdicts = [r.verdict for r in reports]
    assert verdicts[-1] is Verdict.STUCK, verdicts
    assert Verdict.STALLED in verdicts and set(verdicts) <= {Verdict.BUSY, Verdict.STALLED,
                                                              Verdict.STUCK}
    stuck = reports[-1]
    assert stuck.health is Health.CONDEMNED
    assert stuck.evidence.stalled_waits >= 2 and stuck.evidence.stalled_for_s >= 1.0
    assert stuck.evidence.running == 2 and stuck.evidence.moved == ()
    assert canaries(await stats(http, sim.url)) == []


async def test_a_stall_during_a_refit_lease_is_never_stuck(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    sim: SimProcess = spawn("--slots", "1")
    async with Load(http, sim.url, n=1, max_tokens=4000), Watchdog(POLICY) as watchdog:
        await running(http, sim.url, 1)
        await set_fault(http, sim.url, "wedge")
        reports = await rounds(watchdog, Target(sim.url, in_flight=1, stalls_excused=True),
                               6, 0.3)  # 1.5 s: past stall_s, with five waits
    assert [r.verdict for r in reports[1:]] == [Verdict.STALLED] * 5
    assert all(r.evidence.stalls_excused and r.health is Health.UNPROVEN for r in reports[1:])


async def test_a_restarted_engine_is_restarted_and_gets_a_canary_at_once(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    sim: SimProcess = spawn()
    async with Watchdog(POLICY) as watchdog:
        before = await watchdog.probe(Target(sim.url))
        await set_fault(http, sim.url, "restart")
        after = await watchdog.probe(Target(sim.url))
    assert before.verdict is Verdict.IDLE and before.canary is not None
    assert after.verdict is Verdict.RESTARTED
    assert after.canary is not None and after.canary.ok  # not waiting for the interval
    assert after.health is Health.PROVEN
    assert after.incarnation != before.incarnation
    assert after.evidence.previous_incarnation == before.incarnation
    # One canary per process: the interval did not hold back the new process's first.
    assert len(canaries(await stats(http, sim.url))) == 2


async def test_an_engine_without_metrics_is_judged_by_health_and_a_canary(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    sim: SimProcess = spawn("--fault", "no_metrics")
    async with Watchdog(POLICY) as watchdog:
        quiet = await watchdog.probe(Target(sim.url))
    async with Watchdog(POLICY) as watchdog:
        loaded = await watchdog.probe(Target(sim.url, in_flight=3))
    assert (quiet.verdict, quiet.health) == (Verdict.NO_METRICS, Health.PROVEN)
    assert quiet.canary is not None and quiet.canary.ok
    assert "404" in quiet.evidence.problem
    # With requests in flight a canary would queue behind them: none is sent, nothing proved.
    assert (loaded.verdict, loaded.canary, loaded.health) == (
        Verdict.NO_METRICS, None, Health.UNPROVEN)
    seen = await stats(http, sim.url)
    assert len(canaries(seen)) == 1 and seen["by_path"]["/health"] == 2


async def test_garbage_metrics_are_no_metrics(spawn: Any, http: aiohttp.ClientSession) -> None:
    sim: SimProcess = spawn("--fault", "garbage_metrics")
    async with Watchdog(POLICY) as watchdog:
        report = await watchdog.probe(Target(sim.url))
    assert report.verdict is Verdict.NO_METRICS and report.sample is None
    assert report.evidence.problem.startswith(("unparseable", "lacks"))
    assert report.canary is not None and report.canary.ok


async def test_a_proxy_is_read_only_through_v1_models(spawn: Any,
                                                      http: aiohttp.ClientSession) -> None:
    a: SimProcess = spawn()
    b: SimProcess = spawn()
    async with LeastConnectionsProxy([a.url, b.url]) as proxy, Watchdog(POLICY) as watchdog:
        reports = await rounds(watchdog, Target(proxy.url, in_flight=5, proxy=True), 4, 0.05)
    assert [(r.verdict, r.health, r.canary) for r in reports] == [
        (Verdict.REACHABLE, Health.PROVEN, None)] * 4
    assert {(m, p) for m, p, _ in proxy.forwarded} == {("GET", "/v1/models")}
    assert {backend for _, _, backend in proxy.forwarded} == {a.url, b.url}
    for sim in (a, b):
        assert set((await stats(http, sim.url))["by_path"]) == {"/v1/models", "/sim/stats"}


async def test_metrics_read_through_a_proxy_would_look_like_a_restart(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    """Why the rule above: two reads through a least-connections proxy, two processes."""
    a: SimProcess = spawn()
    b: SimProcess = spawn()
    async with LeastConnectionsProxy([a.url, b.url]) as proxy:
        samples = []
        for _ in range(2):
            async with http.get(proxy.url + "/metrics") as r:
                samples.append(parse(await r.read()))
    one, two = samples
    assert isinstance(one, Sample) and isinstance(two, Sample)
    assert judge(one, two, elapsed_s=1.0).verdict is Verdict.RESTARTED  # a false alarm


async def test_a_closed_port_is_dead(spawn: Any, http: aiohttp.ClientSession) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with Watchdog(POLICY) as watchdog:
        report = await watchdog.probe(Target(url))
    assert (report.verdict, report.health, report.canary) == (
        Verdict.UNREACHABLE, Health.FAILING, None)
    assert "cannot connect" in report.evidence.problem


async def test_a_crashed_engine_is_dead(spawn: Any, http: aiohttp.ClientSession) -> None:
    sim: SimProcess = spawn()
    async with Watchdog(POLICY) as watchdog:
        assert (await watchdog.probe(Target(sim.url))).verdict is Verdict.IDLE
        await set_fault(http, sim.url, "crash")
        assert await asyncio.to_thread(sim.wait, 20) != 0
        report = await watchdog.probe(Target(sim.url))
    assert (report.verdict, report.health) == (Verdict.UNREACHABLE, Health.FAILING)


async def test_an_engine_out_for_failed_requests_is_read_at_its_health_path_too(
        http: aiohttp.ClientSession) -> None:
    # vLLM's API server outlives a killed engine core for seconds (9-13 s under load on the
    # real tier), its /metrics frozen and answered, its /health 503. The simulated crash does
    # the same while its process lives (here 30 s).
    async with Sim(SimConfig(crash_exit_s=30)) as sim, Watchdog(POLICY) as watchdog:
        assert (await watchdog.probe(Target(sim.url))).verdict is Verdict.IDLE
        await set_fault(http, sim.url, "crash")
        plain = await watchdog.probe(Target(sim.url))
        accused = await watchdog.probe(Target(sim.url, check_health=True))
        assert not sim.exited.is_set()
    assert plain.verdict is not Verdict.UNREACHABLE  # /metrics alone cannot tell
    assert (accused.verdict, accused.health) == (Verdict.UNREACHABLE, Health.FAILING)
    assert accused.evidence.problem == ("/health: answered 503, while /metrics answers "
                                        "(its engine core is dead)")


async def test_only_an_engine_whose_health_proves_its_core_is_read_there(
        http: aiohttp.ClientSession) -> None:
    # llama.cpp's /health says nothing of the kind: its profile leaves it unread.
    async with Sim(SimConfig(engine="llamacpp", crash_exit_s=30)) as sim, \
            Watchdog(POLICY) as watchdog:
        await set_fault(http, sim.url, "crash")
        report = await watchdog.probe(Target(sim.url, engine="llamacpp", check_health=True))
    assert report.verdict is not Verdict.UNREACHABLE


async def test_an_idle_wedge_with_requests_in_flight_is_a_lost_core_and_its_canary_condemns(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    """SIGSTOP of an idle EngineCore is invisible to /metrics; only the router's count and a
    canary can tell."""
    sim: SimProcess = spawn()
    await set_fault(http, sim.url, "wedge")
    async with Load(http, sim.url, n=1, max_tokens=8), Watchdog(POLICY) as watchdog:
        target = Target(sim.url, in_flight=1)
        first, second = await rounds(watchdog, target, 2, 0.2)
    # The first round sees idle gauges with a request in flight: nothing to compare with yet,
    # and no canary to queue behind that request (the first read sends no canary).
    assert (first.verdict, first.health, first.canary) == (
        Verdict.FIRST_READ, Health.UNPROVEN, None)
    # The second sees it idle and flat with a request in flight: a canary at once, whatever
    # the interval, and its failure is conclusive.
    assert second.verdict is Verdict.LOST_CORE
    assert second.canary is not None and not second.canary.ok
    assert "no answer within 1 s" in second.canary.error
    assert second.health is Health.CONDEMNED


async def test_an_idle_wedge_with_no_traffic_is_condemned_by_the_canary_it_held(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    """No request at all: the canary is the only one, and the engine holds it for the floor
    with nothing advancing (the idle wedge with no traffic)."""
    sim: SimProcess = spawn()
    async with Watchdog(POLICY) as watchdog:
        (healthy,) = await rounds(watchdog, Target(sim.url), 1, 0.0)
        assert healthy.canary is not None and healthy.canary.ok  # the first read's canary
        await set_fault(http, sim.url, "wedge")
        target = Target(sim.url, confirm=True)  # accused: its canary is due now
        (wedged,) = await rounds(watchdog, target, 1, 0.0)
    assert wedged.verdict is Verdict.IDLE
    assert wedged.canary is not None and "no answer within 1 s" in wedged.canary.error
    assert wedged.health is Health.CONDEMNED
    assert "held its canary" in wedged.evidence.summary


async def test_an_idle_wedge_is_condemned_by_the_request_it_holds_without_a_canary(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    """The router's first request to an engine that wedged while idle is the canary: held
    through the stall limit with nothing advancing, it condemns, and no canary of ours waits
    its timeout on top (the idle wedge with traffic)."""
    sim: SimProcess = spawn()
    async with Watchdog(POLICY) as watchdog:
        (healthy,) = await rounds(watchdog, Target(sim.url), 1, 0.0)
        assert healthy.canary is not None and healthy.canary.ok  # it has worked, and the
        # sample kept was read after that canary: the next read does not see its work
        await set_fault(http, sim.url, "wedge")
        async with Load(http, sim.url, n=1, max_tokens=8):
            sent = asyncio.get_running_loop().time()

            def held() -> Target:
                age = asyncio.get_running_loop().time() - sent
                return Target(sim.url, in_flight=1, held_s=age, confirm=True)

            await asyncio.sleep(0.2)
            (early,) = await rounds(watchdog, held(), 1, 0.0)
            # A lost core, but the held request concludes within the canary's timeout.
            assert early.verdict is Verdict.LOST_CORE and early.canary is None
            assert early.health is Health.UNPROVEN and "no canary" in early.evidence.summary
            await asyncio.sleep(POLICY.stall_s)
            (late,) = await rounds(watchdog, held(), 1, 0.0)
    assert late.health is Health.CONDEMNED and late.canary is None
    assert "held a request" in late.evidence.summary
    # How long it held the request with no step: what a hedge is decided on.
    assert early.held_flat_s < 1.0 <= POLICY.stall_s <= late.held_flat_s
    assert len(canaries(await stats(http, sim.url))) == 1  # the healthy one only


async def test_a_hedged_lost_cores_canary_condemns_it_when_the_limit_is_reached_together(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    """The requests a lost core holds are hedged away (cancelled when their hedges answer),
    so they will not reach the stall limit: the canary sent with the hedges waits what they had
    left of it, and with no answer and nothing advanced, condemns. On an engine that works,
    the same canary answers and condemns nothing."""
    wedged: SimProcess = spawn()
    fine: SimProcess = spawn()
    async with Watchdog(POLICY) as watchdog:
        for sim in (wedged, fine):
            (healthy,) = await rounds(watchdog, Target(sim.url), 1, 0.0)
            assert healthy.canary is not None and healthy.canary.ok  # it has worked
        await set_fault(http, wedged.url, "wedge")
        async with Load(http, wedged.url, n=1, max_tokens=8):
            sent = asyncio.get_running_loop().time()
            await asyncio.sleep(0.5)
            age = asyncio.get_running_loop().time() - sent
            (read,) = await rounds(watchdog, Target(wedged.url, in_flight=1, held_s=age,
                                                    confirm=True), 1, 0.0)
            assert read.verdict is Verdict.LOST_CORE and read.canary is None
            assert 0 < read.held_flat_s < POLICY.stall_s
            condemned = await watchdog.watch_hedged(read)
        sent_fine = len(canaries(await stats(http, fine.url)))
        cleared = await watchdog.watch_hedged(replace(read, url=fine.url, held_flat_s=0.5))
    assert condemned is not None and condemned.health is Health.CONDEMNED
    canary, why = condemned.canary, condemned.evidence.summary
    assert canary is not None and not canary.ok
    assert "held a request" in why and "stall limit 1 s" in why
    # It waited what the held request had left of the limit, not a whole canary timeout.
    timeout = float(canary.error.removeprefix("no answer within ").removesuffix(" s"))
    assert timeout == pytest.approx(POLICY.stall_s - read.held_flat_s, abs=1e-3)
    # On the engine that works, the canary was sent, answered, and concluded nothing.
    assert cleared is None
    assert len(canaries(await stats(http, fine.url))) == sent_fine + 1


async def test_a_request_held_through_slow_steps_is_never_condemned(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    """Steps 0.7 s apart (a long prefill each time), under a 1 s floor: the engine holds the
    request for seconds, but something advances within every floor."""
    sim: SimProcess = spawn("--steps-per-s", "1.4")
    async with Watchdog(POLICY) as watchdog:
        (healthy,) = await rounds(watchdog, Target(sim.url), 1, 0.0)
        assert healthy.canary is not None and healthy.canary.ok
        async with Load(http, sim.url, n=1, max_tokens=40):  # ~29 s at 1.4 steps/s
            sent = asyncio.get_running_loop().time()
            reports = []
            for _ in range(12):  # ~3.6 s of reads, the request held all along
                await asyncio.sleep(0.3)
                age = asyncio.get_running_loop().time() - sent
                reports += [await watchdog.probe(Target(sim.url, in_flight=1, held_s=age))]
    assert all(r.health is not Health.CONDEMNED for r in reports), [
        (r.verdict, r.evidence.summary) for r in reports]
    assert Verdict.BUSY in {r.verdict for r in reports}
    # Never held a second without a step: the default hedge_after_s (1 s) sends no hedge.
    assert max(r.held_flat_s for r in reports) < 1.0, [r.held_flat_s for r in reports]
    print("\nheld with no step:", [round(r.held_flat_s, 2) for r in reports],
          "\nlongest pause seen:", [round(r.longest_pause_s, 2) for r in reports])
    # ...and the pauses it came back from are learned: a hedge would wait past them too.
    assert reports[-1].longest_pause_s > 0


async def test_a_visit_that_waited_on_its_canary_never_keeps_an_older_sample_over_a_newer(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    """A tick's canary waits up to its timeout while the controller's focused reads of the
    same engine go on: the sample kept is the newest, not the one read before the canary."""
    sim: SimProcess = spawn("--fault", "wedge")
    loop = asyncio.get_running_loop()
    policy = replace(POLICY, canary_timeout_s=3.0)  # the quick visit's room, on a loaded machine
    async with Watchdog(policy, clock=loop.time) as watchdog:
        slow = asyncio.create_task(watchdog.probe(Target(sim.url)))  # idle: a canary, held 3 s

        async def canary_sent() -> bool:  # so the slow visit has read, and now waits
            return len(canaries(await stats(http, sim.url))) == 1

        await until(canary_sent)
        focused_at = loop.time()
        quick = await watchdog.probe(Target(sim.url))  # the canary is not due again: a read
        assert quick.canary is None
        kept = watchdog._memory[sim.url].watch.sample_at
        assert kept >= focused_at
        first = await slow
    assert first.canary is not None and not first.canary.ok
    assert watchdog._memory[sim.url].watch.sample_at == kept  # the older read was not kept over it


async def test_a_new_engine_that_holds_its_first_canary_is_one_failed_probe(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    """The first read of an engine: its first generation may be slow (compilation, cold
    caches), so holding it proves nothing conclusive yet."""
    sim: SimProcess = spawn("--fault", "wedge")
    async with Watchdog(POLICY) as watchdog:
        (first,) = await rounds(watchdog, Target(sim.url), 1, 0.0)
    assert first.verdict is Verdict.IDLE and first.canary is not None
    assert not first.canary.ok and first.health is Health.FAILING


# ------------------------------------------------------------------ note 002


async def test_the_watchdog_never_sends_a_request_to_a_busy_engine(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    sim: SimProcess = spawn("--slots", "4")
    async with Load(http, sim.url, n=4, max_tokens=4000):  # 200 s each at 20 steps/s
        await running(http, sim.url, 4)
        async with Watchdog(POLICY) as watchdog:
            reports = await rounds(watchdog, Target(sim.url, in_flight=4), 12, 0.4)
    assert reports[0].verdict is Verdict.FIRST_READ
    assert [r.verdict for r in reports[1:]] == [Verdict.BUSY] * 11
    assert all(r.canary is None for r in reports)
    seen = await stats(http, sim.url)
    assert canaries(seen) == []
    assert seen["by_path"]["/v1/completions"] == 4  # the load, and nothing else
    assert seen["by_path"]["/metrics"] >= 12


async def test_the_note_002_day_compressed_a_slow_batch_is_never_worse_than_busy(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    """Note 002: a batch job held every slot for minutes, a chat-request health check queued
    behind it, timed out, and a healthy server was restarted eight times in one day.

    Here: every slot busy with long-prompt requests and more waiting, on an engine that steps
    slowly (8 steps/s, note 002's 8 tokens/s) and reads each 1,500-token prompt over 24 steps
    without producing a token. A judge that counted tokens would call that a stall (stall_s is
    1 s here); one that counts steps sees a busy engine, every round, and sends nothing.
    """
    sim: SimProcess = spawn("--slots", "3", "--steps-per-s", "8",
                            "--max-num-batched-tokens", "64")
    async with Load(http, sim.url, n=6, max_tokens=400, prompt="p" * 1500):
        async def full() -> bool:
            s = await metrics(http, sim.url)
            return (s.running, s.waiting) == (3, 3)

        await until(full)
        async with Watchdog(POLICY) as watchdog:
            reports = await rounds(watchdog, Target(sim.url, in_flight=6), 10, 0.6)
    assert reports[0].verdict is Verdict.FIRST_READ
    assert [r.verdict for r in reports[1:]] == [Verdict.BUSY] * 9
    assert {r.health for r in reports[1:]} == {Health.PROVEN}
    # The scenario did what it says: rounds in which steps advanced and no token appeared.
    assert any(r.evidence.deltas["generation_tokens"] == 0 and r.evidence.deltas["steps"] > 0
               for r in reports[1:])
    assert canaries(await stats(http, sim.url)) == []


async def test_a_proxy_in_the_fleet_is_found_and_judged_as_a_proxy(spawn: Any) -> None:
    """An attached URL that is a load balancer answers /metrics from one
    engine, then another. The first change of start time may be a restart; a start time that
    comes back is not (no process returns to an earlier start): it is a proxy, read through
    GET /v1/models from then on, and never again RESTARTED (which in trainer mode would make it
    STALE again and again)."""
    a: SimProcess = spawn()
    b: SimProcess = spawn()
    async with LeastConnectionsProxy([a.url, b.url]) as proxy, Watchdog(POLICY) as watchdog:
        reports = await rounds(watchdog, Target(proxy.url), 8, 0.05)
        assert watchdog.is_proxy(proxy.url)
    verdicts = [r.verdict for r in reports]
    assert verdicts.count(Verdict.RESTARTED) <= 1, verdicts
    first = verdicts.index(Verdict.REACHABLE)
    assert verdicts[first:] == [Verdict.REACHABLE] * (8 - first)
    assert all(r.health is Health.PROVEN for r in reports[first:])


async def test_a_request_held_by_a_process_that_never_worked_is_no_ground_for_a_hedge(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    """Its first generation may be slow (compilation, cold caches): the time a request is held
    there with no step is not reported, so the controller sends no hedge (whose lost race
    would count against the engine)."""
    sim: SimProcess = spawn("--fault", "wedge")  # wedged before it ever generated
    loop = asyncio.get_running_loop()
    async with Watchdog(POLICY) as watchdog, Load(http, sim.url, n=1, max_tokens=8):
        sent = loop.time()
        reports = []
        for _ in range(5):
            await asyncio.sleep(0.3)
            reports += [await watchdog.probe(
                Target(sim.url, in_flight=1, held_s=loop.time() - sent))]
    assert {r.verdict for r in reports[1:]} <= {Verdict.STALLED, Verdict.LOST_CORE}, [
        r.verdict for r in reports]
    assert [r.held_flat_s for r in reports] == [0.0] * 5
