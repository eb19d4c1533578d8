"""The fleet end to end: real engine processes, the router, the controller's tick,
the supervisor's restarts, and load from a bounded client (the official `openai` package).

Each scenario prints what it measured (detection time, rescued requests, restarts); the
figures of record come from the demo and the benchmarks, which run at the default timings.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from fleetwarden.journal import Journal
from fleetwarden.launchers.local import kill_launched, launch_id_of, live_launch_ids
from fleetwarden.ledger import Event, ShardState
from fleetwarden.router.ops import Holding
from fleetwarden.testing.load import Load
from fleetwarden.testing.scenarios import condemned_as_a_stopped_core
from support.fleet import (
    SIM,
    record_transitions,
    running_fleet,
    served_ids,
    sim_stats,
    states,
    until,
    wedge_when_busy,
)
from support.links import QuietLink
from support.pids import alive

pytestmark = pytest.mark.scenario

H, S, ST, D, R, X = (ShardState.HEALTHY, ShardState.SUSPECT, ShardState.STALE,
                     ShardState.DEAD, ShardState.RESTARTING, ShardState.RETIRED)


async def test_a_crashed_engine_is_restarted_and_no_request_is_lost(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, fleet={"engines": 3}) as fleet:
        old_url = fleet.ledger.shard(0).base_url
        seen = record_transitions(fleet)
        async with Load(fleet.router_url, concurrency=9, max_tokens=24) as load:
            await until(lambda: len(load.results) >= 20, what="load flowing")
            await until(lambda: fleet.router.in_flight().get(old_url, 0) >= 2,
                        what="requests in flight on shard 0")
            await fleet.inject_fault(0, "crash", {})
            # The restart begins on the condemnation itself, so DEAD may last one turn of the
            # loop: what shows it is the transition.
            await until(lambda: any(t.shard == 0 and t.to_state is D for t in seen),
                        what="shard 0 condemned")
            await until(lambda: fleet.ledger.state(0) is H, timeout=60, what="shard 0 back")
            back = time.monotonic()
            await until(lambda: len(load.since(back)) >= 20, what="load after the restart")
        r = fleet.ledger.shard(0)
        assert r.base_url != old_url and r.restart_attempts == 1
        death = next(t for t in seen if t.shard == 0 and t.to_state is D)
        # Seen as a process exit, or (when its 500s and refusals win the race) as failed
        # requests confirmed by one focused read at once: never after a streak of probes.
        assert "exited" in death.cause or death.event is Event.CONFIRMED, death.cause
        assert load.failures == [], load.failures[:3]
        assert served_ids(await sim_stats(r.base_url))  # the new engine gets traffic
        print(f"\ncrash: {load.summary()}, retries {fleet.router.stats.retries}")


async def test_a_wedged_engine_is_quarantined_and_its_requests_rescued(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, fleet={"engines": 3}) as fleet:
        wedged = fleet.ledger.shard(1).base_url
        seen = record_transitions(fleet)
        async with Load(fleet.router_url, concurrency=9, max_tokens=40) as load:
            wedged_at = await wedge_when_busy(fleet, 1)
            held = await sim_stats(wedged)
            await until(lambda: fleet.ledger.state(1) is not H and fleet.ledger.state(1)
                        is not S, timeout=30, what="shard 1 condemned")
            detected_s = time.monotonic() - wedged_at
            await until(lambda: fleet.ledger.state(1) is H, timeout=60, what="shard 1 back")
        death = next(t for t in seen if t.shard == 1 and t.to_state is D)
        assert "STUCK" in death.cause or "stuck" in death.cause.lower()
        assert load.failures == [], load.failures[:3]
        # Held there, each was hedged (sent to another engine as well) or rescued at the
        # condemnation, or both: a hedge that had not answered yet by then goes on.
        rescued = fleet.router.stats.rescues
        hedged = fleet.router.stats.hedges_won
        assert rescued + hedged >= 2
        # the requests that were waiting on the wedge were answered elsewhere
        on_wedge = served_ids(held)
        answered = {r.request_id for r in load.results if r.ok}
        assert on_wedge and on_wedge <= answered | {r.request_id for r in load.results
                                                   if r.started > wedged_at}
        print(f"\nwedge: condemned after {detected_s:.1f} s (stall_s 2, tick 0.5), "
              f"{rescued} rescued, {hedged} answered by hedges, {load.summary()}")


async def test_requests_parked_on_a_wedge_are_answered_by_hedges_before_any_condemnation(
    tmp_path: Path
) -> None:
    # A stall limit of 30 s: within this test only hedges can answer what the wedge holds.
    async with running_fleet(tmp_path, fleet={"engines": 3}, health={"stall_s": 30.0}) as fleet:
        wedged = fleet.ledger.shard(1).base_url
        seen = record_transitions(fleet)
        async with Load(fleet.router_url, concurrency=9, max_tokens=40) as load:
            wedged_at = await wedge_when_busy(fleet, 1)
            parked = served_ids(await sim_stats(wedged)) - {
                r.request_id for r in load.results}  # received there, not answered yet
            assert parked

            def answered() -> set[str]:
                return {r.request_id for r in load.results if r.ok}

            await until(lambda: parked <= answered(), timeout=20,
                        what="every request parked on the wedge answered")
            answered_s = time.monotonic() - wedged_at
        assert load.failures == [], load.failures[:3]
        assert fleet.router.stats.hedges_won >= len(parked)
        assert fleet.router.stats.rescues == 0
        # Never condemned: the stall limit has not passed. Its gauges show work, so its lost
        # races are no failures (a long step looks the same until it ends): each took it out
        # of the router's list until the next push, and the ledger keeps it serving.
        assert D not in {t.to_state for t in seen if t.shard == 1}
        assert fleet.ledger.state(1) in (H, S)
        print(f"\nhedged: {len(parked)} parked answered {answered_s:.1f} s after the wedge "
              f"(hedge_after_s 1), {fleet.router.stats.hedges} hedges, "
              f"{fleet.router.stats.hedges_won} won, {load.summary()}")


async def test_an_idle_wedge_is_caught(tmp_path: Path) -> None:
    async with running_fleet(tmp_path) as fleet:
        seen = record_transitions(fleet)
        await until(lambda: 0 in fleet.controller.reports, what="a first round")
        await fleet.inject_fault(0, "wedge", {})  # idle: running 0, metrics say nothing
        await until(lambda: fleet.ledger.state(0) is D or fleet.ledger.state(0) is R,
                    timeout=40, what="the idle wedge condemned by failed canaries")
        death = next(t for t in seen if t.shard == 0 and t.to_state is D)
        assert "canary" in death.cause or "probe" in death.cause, death.cause
        await until(lambda: fleet.ledger.state(0) is H, timeout=60, what="shard 0 back")


async def test_an_idle_wedge_is_caught_by_the_first_routed_request(tmp_path: Path) -> None:
    # canaries far apart: the routed request, not a canary, exposes the wedge (lost core)
    async with running_fleet(tmp_path, health={"canary_interval_s": 3600}) as fleet:
        seen = record_transitions(fleet)
        await until(lambda: len(fleet.controller.reports) == 2, what="a first round")
        await fleet.inject_fault(0, "wedge", {})
        async with Load(fleet.router_url, concurrency=2, max_tokens=8, total=6) as load:
            await until(lambda: fleet.ledger.state(0) is D or fleet.ledger.state(0) is R,
                        timeout=20, what="lost core condemned")
            await load.wait()
        death = next(t for t in seen if t.shard == 0 and t.to_state is D)
        # the request it held through the stall limit with nothing advancing, or (when that
        # was still further off than a canary's timeout) a failed canary: a lost core either
        # way; or its lost race confirmed by a canary it never answered
        assert condemned_as_a_stopped_core(death.cause), death.cause
        # the held request was rescued, or answered by its hedge
        assert load.failures == [] and len(load.results) == 6


async def test_an_idle_suspect_shard_is_canaried_back_without_waiting_for_the_interval(
        tmp_path: Path) -> None:
    # The real-vLLM tier's case: a read timed out under load (SUSPECT), then the shard got no
    # traffic. With canaries an hour apart, nothing but a canary can prove it: it is due at
    # every tick while the shard is SUSPECT and idle, and two good ones lift it. The shard
    # nobody doubts gets none.
    async with running_fleet(tmp_path, health={"canary_interval_s": 3600}) as fleet:
        await until(lambda: len(fleet.controller.reports) == 2, what="a first round")
        urls = fleet.ledger.serving_urls()
        before = [served_ids(await sim_stats(u), "fleetwarden-canary") for u in urls]
        seen = record_transitions(fleet)
        fleet.ledger.record_probe(0, False, "UNREACHABLE: /metrics: timed out")
        assert fleet.ledger.state(0) is S
        await until(lambda: fleet.ledger.state(0) is H, timeout=20, what="shard 0 lifted")
        after = [served_ids(await sim_stats(u), "fleetwarden-canary") for u in urls]
        lifted = next(t for t in seen if t.shard == 0 and t.to_state is H)
        assert lifted.event is Event.RECOVERED, lifted
        assert len(after[0]) - len(before[0]) >= 2  # proved by canaries, nothing else
        assert after[1] == before[1]  # the healthy idle shard: its interval is an hour


async def test_trickle_failures_are_condemned_by_their_confirmation(tmp_path: Path) -> None:
    # No canary when due (a far interval): every tick's probe is a metrics read, and they all
    # pass. Every generation fails: the first failed request ejects the engine, and the
    # confirmation canary sent to the accused (idle, now that it gets no traffic) engine fails
    # as the requests did. A burst plus a failed confirmation condemns; the streak
    # that no probe can reset is the ledger's test of a trial that keeps failing.
    async with running_fleet(tmp_path, health={"canary_interval_s": 3600,
                                               "probe_interval_s": 60}) as fleet:
        await until(lambda: len(fleet.controller.reports) == 2, what="a first round")
        seen = record_transitions(fleet)
        await fleet.inject_fault(0, "error5xx", {})
        async with Load(fleet.router_url, concurrency=1, max_tokens=4, think_s=0.1) as load:
            await until(lambda: fleet.ledger.state(0) in (D, R), timeout=30,
                        what="shard 0 condemned by failed windows")
        death = next(t for t in seen if t.shard == 0 and t.to_state is D)
        assert death.event is Event.CONFIRMED
        assert "confirmed by a failed probe" in death.cause, death.cause
        assert fleet.controller.tick_number == 1  # the evidence did it, not the tick
        assert load.failures == []  # every failed request was retried on shard 1


#: The saturation soak's stretch: more work than slots for this long (seconds; longer with
#: FLEETWARDEN_SATURATION_SOAK_S, as a soak by hand). 30 s is 60 of the tests' 0.5 s ticks, and
#: each generation (4-8 s) outlasts stall_s (2 s), the canary's timeout and the silence read.
SATURATION_SOAK_S = float(os.environ.get("FLEETWARDEN_SATURATION_SOAK_S", "30"))


async def test_a_saturated_healthy_fleet_is_never_ejected_condemned_canaried_or_restarted(
        tmp_path: Path) -> None:
    """The no-false-positive soak: 2 engines of 2 slots, 10 clients of long generations (half
    of them never streamed, so no answer comes back on the request path for seconds), for
    :data:`SATURATION_SOAK_S` once both engines have requests waiting: not one state change
    (no ejection, no condemnation), not one canary reaching an engine (the engines' own
    logs), no restart, no failed request; reads BUSY, or STALLED between two steps (a read,
    no verdict)."""
    slow = SIM + " --slots 2 --steps-per-s 10"
    async with running_fleet(tmp_path, fleet={"engine_cmd": slow}) as fleet:
        await until(lambda: len(fleet.controller.reports) == 2, what="a first round")
        ramp = record_transitions(fleet)
        urls = fleet.ledger.serving_urls()
        long = (40, 80)  # tokens: 4-8 s each at 10 steps a second
        async with Load(fleet.router_url, concurrency=6, max_tokens_range=long) as plain, \
                Load(fleet.router_url, concurrency=4, max_tokens_range=long,
                     stream=True) as streamed:
            await until(lambda: all(
                (rep.sample is not None and rep.sample.running == 2 and rep.sample.waiting > 0)
                for rep in fleet.controller.reports.values()), what="saturated")
            # Judged from here: the load's first seconds are a ramp (an engine read idle an
            # instant before the load came may be canaried then; that is printed, apart).
            ramped = list(ramp)
            seen = record_transitions(fleet)
            before = {u: served_ids(await sim_stats(u), "fleetwarden-canary") for u in urls}
            ticks, saturated, verdicts = fleet.controller.tick_number, 0, Counter[str]()
            held_out = 0  # ticks at whose end the router routed to fewer than both engines
            started = time.monotonic()
            while time.monotonic() - started < SATURATION_SOAK_S:
                tick = fleet.controller.tick_number
                await until(lambda t=tick: fleet.controller.tick_number > t,  # type: ignore[misc]
                            what="a tick")
                reports = list(fleet.controller.reports.values())
                verdicts.update(rep.verdict.name for rep in reports)
                held_out += sorted(fleet.router.serving_backends()) != sorted(urls)
                saturated += all(rep.sample is not None and rep.sample.waiting > 0
                                 for rep in reports)
            after = {u: served_ids(await sim_stats(u), "fleetwarden-canary") for u in urls}
            ticks = fleet.controller.tick_number - ticks
        answered = len(plain.results) + len(streamed.results)
        print(f"\n{SATURATION_SOAK_S:g} s saturated: {ticks} ticks, {saturated} of them with "
              f"requests waiting on both engines; {answered} long generations answered; "
              f"reads {dict(verdicts)}; {held_out} ticks with an engine held out of routing; "
              f"state changes {[(t.shard, t.to_state.name, t.cause) for t in seen]}; in the "
              f"ramp before it {[(t.shard, t.to_state.name, t.cause) for t in ramped]}")
        assert saturated >= ticks // 2  # saturated most of the stretch, not just at its start
        assert after == before  # not one canary while the engines were busy
        assert seen == [] and states(fleet) == [H, H]
        assert fleet.supervisor.restarts_completed == 0
        assert set(verdicts) <= {"BUSY", "STALLED"}, verdicts
        assert held_out == 0  # the router routed to both throughout
        assert plain.failures == [] and streamed.failures == []


async def test_restart_budget_retires_a_shard_that_keeps_dying(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, supervisor={"max_restart_attempts": 2}) as fleet:
        for n in range(2):
            await fleet.inject_fault(0, "crash", {})
            await until(lambda: fleet.ledger.state(0) is not H, what=f"crash {n + 1} seen")
            await until(lambda: fleet.ledger.state(0) is H, timeout=60, what="back")
        await fleet.inject_fault(0, "crash", {})
        await until(lambda: fleet.ledger.state(0) is X, what="retired")
        r = fleet.ledger.shard(0)
        assert "restart budget exhausted" in r.last_error
        assert 0 not in fleet.supervisor.engines  # nothing left running for a retired shard
        assert fleet.ledger.serving_urls() == [fleet.ledger.shard(1).base_url]
        async with Load(fleet.router_url, concurrency=2, total=6) as load:
            await load.wait()
        assert load.failures == []


async def test_restarts_are_capped_fleet_wide(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, fleet={"engines": 4},
                             supervisor={"max_concurrent_restarts": 1}) as fleet:
        restarting: list[int] = []

        def count(_: object) -> None:
            restarting.append(sum(1 for s in states(fleet) if s is R))

        fleet.ledger.subscribe(count)
        for i in range(3):
            await fleet.inject_fault(i, "crash", {})
        await until(lambda: fleet.supervisor.restarts_completed >= 3, timeout=90,
                    what="three restarts")
        assert max(restarting) == 1
        assert all(fleet.ledger.shard(i).restart_attempts == 1 for i in range(3))


async def test_a_restarted_engine_comes_back_on_a_new_port_and_gets_traffic(
        tmp_path: Path) -> None:
    async with running_fleet(tmp_path) as fleet:
        old = fleet.ledger.shard(1).base_url
        await fleet.inject_fault(1, "crash", {})
        await until(lambda: fleet.ledger.state(1) is not H, what="crash seen")
        # The push runs as its own task after the ledger's transition: wait for it too.
        await until(lambda: fleet.ledger.state(1) is H and fleet.ledger.shard(1).base_url
                    in fleet.router.serving_backends(), timeout=60, what="back and pushed")
        new = fleet.ledger.shard(1).base_url
        assert new != old
        async with Load(fleet.router_url, concurrency=4, total=20) as load:
            await load.wait()
        assert load.failures == []
        assert len(served_ids(await sim_stats(new))) >= 5


def test_stopping_fleetwarden_leaves_no_engine_process(tmp_path: Path) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        work = tmp_path / sig.name
        work.mkdir()
        proc = subprocess.Popen(
            [sys.executable, "-m", "fleetwarden", "up", "--quiet", "--engines", "2",
             "--port", "0", "--admin-port", "0", "--engine-cmd", SIM + " --slots 4"],
            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )
        try:
            engine_pids = _engine_pids(work)
            assert len(engine_pids) == 2 and all(alive(p) for p in engine_pids)
            proc.send_signal(sig)
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                with Journal(work / "fleetwarden.sqlite") as journal:
                    # nothing this test started lives on: engines, router processes
                    kill_launched(journal.launch_ids() | journal.router_launch_ids())
        assert proc.returncode == 0, out
        assert "nothing left running" in out
        with Journal(work / "fleetwarden.sqlite") as journal:  # the router's processes too
            assert live_launch_ids(journal.router_launch_ids()) == set()
        assert not any(alive(p) for p in engine_pids)
        assert not any(_groupalive(p) for p in engine_pids)


def _engine_pids(work: Path) -> list[int]:
    """The engines' PIDs, from the log file names' launch ids and /proc environ."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        logs = list((work / "fleetwarden-logs").glob("shard-*.log"))
        ids = {p.stem.split("-", 2)[2] for p in logs}
        pids = [pid for pid in _pids() if launch_id_of(pid) in ids]
        if len(logs) == 2 and len(pids) == 2:
            return pids
        time.sleep(0.2)  # polling for the engines to appear, with the deadline above
    raise AssertionError("engines did not start")


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _groupalive(pgid: int) -> bool:
    from fleetwarden.launchers.procs import group_members

    return bool(group_members(pgid))


async def test_attach_mode_quarantines_an_engine_it_did_not_start_and_runs_the_restart_command(
        tmp_path: Path) -> None:
    from support.sim import SimProcess

    marker = tmp_path / "restarted.txt"
    script = Path(__file__).parents[1] / "support" / "engines" / "restart_sim.py"
    sims = [SimProcess("--steps-per-s", "40"), SimProcess("--steps-per-s", "40")]
    try:
        urls = [s.url for s in sims]
        command = f"{sys.executable} {script} {{url}} {marker} {{shard}}"
        async with running_fleet(tmp_path, fleet={"engines": 0, "backends": urls,
                                                  "restart_command": command}) as fleet:
            seen = record_transitions(fleet)
            assert fleet.ledger.serving_urls() == urls
            async with Load(fleet.router_url, concurrency=4, max_tokens=40) as load:
                await until(lambda: fleet.router.in_flight().get(urls[1], 0) >= 1,
                            what="in flight on the attached engine")
                await fleet.inject_fault(1, "wedge", {})
                await until(lambda: fleet.ledger.state(1) is not H
                            and fleet.ledger.state(1) is not S, what="condemned")
                await until(lambda: fleet.ledger.state(1) is H, timeout=60,
                            what="re-admitted under a new incarnation")
            assert marker.read_text().split() == ["1"]  # the command ran, once, for shard 1
            r = fleet.ledger.shard(1)
            assert r.base_url == urls[1] and r.restart_attempts == 1
            started = (await sim_stats(urls[1]))["engine"]["start_time"]
            assert r.incarnation == repr(started)  # the new process, as the watchdog names it
            moves = [(t.from_state, t.to_state) for t in seen if t.shard == 1]
            # maybe SUSPECT first (a failed canary), then condemned, restarted, re-admitted
            assert moves[-3:] == [(D, R), (R, ST), (ST, H)] and moves[-4][1] is D, moves
            assert (H, S) in moves or moves[0] == (H, D)
            assert load.failures == []
        assert all(s.proc.poll() is None for s in sims)  # attached engines are not ours to stop
    finally:
        for s in sims:
            s.kill()


async def test_admin_api_refuses_requests_without_the_token(tmp_path: Path) -> None:
    async with running_fleet(tmp_path) as fleet, aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer wrong-token-xxxxxxxxxxxxxxxx"}):
            for method, path in (("GET", "/admin/shards"), ("GET", "/admin/status"),
                                 ("POST", "/admin/shards/0/retire"),
                                 ("POST", "/admin/refit/begin"), ("GET", "/metrics")):
                async with http.request(method, fleet.admin_url + path,
                                        headers=headers) as resp:
                    assert resp.status == 401, (method, path)
                    assert "token" in (await resp.json())["error"]["message"]
        assert states(fleet) == [H, H]  # nothing changed
        good = {"Authorization": f"Bearer {fleet.admin.token}"}
        async with http.get(fleet.admin_url + "/admin/shards", headers=good) as resp:
            assert resp.status == 200
            assert [s["state"] for s in (await resp.json())["shards"]] == ["HEALTHY"] * 2
        async with http.get(fleet.admin_url + "/metrics", headers=good) as resp:
            text = await resp.text()
            assert 'fleetwarden_shards{state="HEALTHY"} 2.0' in text


async def test_admin_api_retires_and_restarts_shards(tmp_path: Path) -> None:
    from fleetwarden.client import FleetClient, FleetClientError

    async with running_fleet(tmp_path, fleet={"engines": 3}) as fleet:
        client = FleetClient(fleet.admin_url, token=fleet.admin.token)
        old = fleet.ledger.shard(0).base_url
        result = await asyncio.to_thread(client.restart, 0, "operator test")
        assert result["applied"]
        await until(lambda: fleet.ledger.state(0) is H
                    and fleet.ledger.shard(0).base_url != old, timeout=60, what="restarted")
        await asyncio.to_thread(client.retire, 2, "decommissioned")
        assert fleet.ledger.state(2) is X
        await until(lambda: 2 not in fleet.supervisor.engines, what="its engine stopped")
        with pytest.raises(FleetClientError) as err:
            await asyncio.to_thread(client.retire, 2, "again")
        assert err.value.status == 409
        with pytest.raises(FleetClientError) as err:
            await asyncio.to_thread(client.retire, 7, "no such shard")
        assert err.value.status == 404


async def test_external_routers_get_the_serving_set_and_report_outcomes(tmp_path: Path) -> None:
    from fleetwarden.client import FleetClient

    async with running_fleet(tmp_path) as fleet:
        client = FleetClient(fleet.admin_url, token=fleet.admin.token)
        assert await asyncio.to_thread(client.serving) == fleet.ledger.serving_urls()
        url = fleet.ledger.shard(0).base_url
        await asyncio.to_thread(client.report_outcomes, {url: (0, 5, 5)})
        assert fleet.ledger.ejected() == [0]  # its requests failed: out until proof
        assert url not in await asyncio.to_thread(client.serving)
        assert await asyncio.to_thread(client.report_outcomes,
                                       {"http://10.9.9.9:1": (1, 0, 0)}) == 1  # ignored


async def test_a_router_that_fails_never_stops_the_loop(tmp_path: Path) -> None:
    class Broken(QuietLink):
        name = "http://broken-router"

        async def set_serving_backends(self, urls: object, facts: object = None, *,
                                       coming_back: int = 0) -> None:
            raise ConnectionError("router unreachable")

        async def drain_outcomes(self) -> dict[str, tuple[int, int, int]]:
            raise ConnectionError("router unreachable")

        async def rescue(self, url: str, *, streams: bool = True) -> int:
            raise ConnectionError("router unreachable")

        async def holding(self, silent_after_s: float = 0.0) -> Holding:
            raise ConnectionError("router unreachable")

        async def set_retry_after(self, seconds: float | None) -> None:
            raise ConnectionError("router unreachable")

        async def evidence(self, wait_s: float, silent_after_s: float
                           ) -> tuple[int, dict[str, float]]:
            raise ConnectionError("router unreachable")

    async with running_fleet(tmp_path) as fleet:
        fleet.controller.routers.insert(0, Broken())
        ticks = fleet.controller.tick_number
        await until(lambda: fleet.controller.tick_number >= ticks + 3, what="ticks go on")
        last = fleet.controller.last_tick
        assert last is not None and any("broken-router" in e for e in last.router_errors)
        await fleet.inject_fault(0, "crash", {})
        # The push runs as its own task after the ledger's transition: wait for it, not the
        # transition alone.
        await until(lambda: fleet.ledger.state(0) is H and fleet.supervisor.restarts_completed
                    and fleet.ledger.shard(0).base_url in fleet.router.serving_backends(),
                    timeout=60, what="the healthy router still gets the replacement")


def test_invalid_config_names_the_key_at_the_command_line(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.toml"
    bad.write_text('[health]\nstall_s = "soon"\n[fleet]\nengines = 2\nweights = "dynamic"\n'
                   'enginez = 3\n')
    out = subprocess.run([sys.executable, "-m", "fleetwarden", "up", "--config", str(bad)],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2
    assert "health.stall_s = 'soon'" in out.stderr
    assert "fleet.weights = 'dynamic'" in out.stderr and "'static' or 'trainer'" in out.stderr
    assert "fleet.enginez = 3: unknown key; allowed here:" in out.stderr
    assert not (tmp_path / "fleetwarden-logs").exists()  # refused before anything started


async def test_the_controller_drives_a_router_in_another_process(tmp_path: Path) -> None:
    from fleetwarden.auth import load_or_create_token
    from fleetwarden.router import Router

    token_file = tmp_path / "router.token"
    token = load_or_create_token(token_file)
    other = Router([], health_managed=True)
    await other.start("127.0.0.1", 0, control_port=0, control_token=token)
    try:
        remote = [{"url": other.control_url, "token_file": str(token_file)}]
        async with running_fleet(tmp_path, router={"remote": remote}) as fleet:
            await until(lambda: other.serving_backends() == fleet.ledger.serving_urls(),
                        what="the serving set pushed to the other router")
            async with Load(other.url, concurrency=2, total=8) as load:
                await load.wait()
            assert load.failures == []
            await fleet.inject_fault(1, "crash", {})
            await until(lambda: fleet.ledger.state(1) is H
                        and other.serving_backends() == fleet.ledger.serving_urls(),
                        timeout=60, what="the replacement pushed there too")
    finally:
        await other.stop()


async def test_a_failing_journal_is_loud_and_never_stops_the_fleet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk under the journal fails. Condemnations still reach the
    routers, the crashed engine is still replaced, and the status, the log and a metric say
    that the history is not being kept."""
    import sqlite3

    def disk_full(*args: object) -> int:
        raise sqlite3.OperationalError("database or disk is full")

    async with running_fleet(tmp_path) as fleet, aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {fleet.admin.token}"}) as http:
        monkeypatch.setattr(Journal, "_write", staticmethod(disk_full))
        old = fleet.ledger.shard(0).base_url
        await fleet.inject_fault(0, "crash", {})
        await until(lambda: fleet.ledger.state(0) is H and fleet.ledger.shard(0).base_url != old,
                    60, "crashed engine replaced while the journal fails")
        async with http.get(fleet.admin_url + "/admin/status") as resp:
            status = await resp.json()
        assert status["status"] == "degraded" and "journal fails" in status["detail"]
        assert "disk is full" in status["journal"]["failure"]
        async with http.get(fleet.admin_url + "/metrics") as resp:
            text = await resp.text()
        dropped = [line for line in text.splitlines()
                   if line.startswith("fleetwarden_journal_dropped_total ")]
        assert dropped and float(dropped[0].split()[1]) > 0
        async with Load(fleet.router_url, concurrency=2, total=6) as load:
            await load.wait()
        assert list(load.failures) == []
