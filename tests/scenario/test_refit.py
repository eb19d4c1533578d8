"""Refit end to end: a trainer's weight syncs through the admin API, on real
engine processes, with leases, the single-suspect rule and restarted engines held in STALE.

The trainer is `FleetClient` (the synchronous client a training loop uses), run in a thread.
`healthy_threshold` is set high where a story needs a shard to stay SUSPECT between steps:
at a 0.5 s tick, two good metrics reads would otherwise lift it within a second.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleetwarden.client import FleetClient
from fleetwarden.fleet import Fleet
from fleetwarden.ledger import ShardState
from fleetwarden.testing.load import Load
from support.fleet import record_transitions, running_fleet, served_ids, sim_stats, stamp, until

pytestmark = pytest.mark.scenario

H, S, ST, D, R, X = (ShardState.HEALTHY, ShardState.SUSPECT, ShardState.STALE,
                     ShardState.DEAD, ShardState.RESTARTING, ShardState.RETIRED)

TRAINER = {"weights": "trainer", "engines": 3}


def trainer(fleet: Fleet) -> FleetClient:
    return FleetClient(fleet.admin_url, token=fleet.admin.token)


async def call(fn: object, *args: object) -> dict[str, object]:
    assert callable(fn)
    result: dict[str, object] = await asyncio.to_thread(fn, *args)
    return result


async def fail_requests(fleet: Fleet, shards: list[int]) -> None:
    """A router window of failed requests for each of ``shards``, as a router reports it: the
    shard is ejected, SUSPECT with a reported streak of 1. (Failing engines themselves would
    be condemned by the confirmation canary at once; these tests are about a
    suspicion, so the engines stay healthy and the suspicion stands on the reported window.)"""
    fleet.controller.apply_outcomes({fleet.ledger.shard(i).base_url: (0, 2, 2) for i in shards})
    assert all(fleet.ledger.shard(i).consecutive_reported_failures >= 1 for i in shards)


async def test_a_restarted_engine_has_no_history_end_to_end(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, fleet=TRAINER, health={"healthy_threshold": 1000}) as f:
        t = trainer(f)
        await fail_requests(f, [1])
        assert f.ledger.state(1) is S  # failed requests: SUSPECT

        lease = await call(t.begin_refit, 1)
        assert {p["shard"] for p in lease["participants"]} == {0, 1, 2}  # type: ignore[union-attr,index]
        aborted = await call(t.abort_refit, 1, "weight broadcast timed out")
        assert aborted["condemned"] == [1]  # the one suspect is the silent participant
        old = f.ledger.shard(1).base_url

        await until(lambda: f.ledger.state(1) is ST and f.ledger.shard(1).base_url != old,
                    timeout=60, what="restarted on a new port, waiting in STALE")
        r = f.ledger.shard(1)
        assert r.consecutive_reported_failures == 0 and r.state_before_partial is None

        await call(t.begin_refit, 2)
        await stamp(f, 2)
        done = await call(t.complete_refit, 2)
        assert done["states"] == {"0": "HEALTHY", "1": "HEALTHY", "2": "HEALTHY"}, done
        r = f.ledger.shard(1)
        assert (r.state, r.consecutive_reported_failures, r.weight_version) == (H, 0, 2)

        await fail_requests(f, [1])
        assert f.ledger.state(1) is S  # one failed window: SUSPECT, not DEAD
        assert f.ledger.shard(1).restart_attempts == 1


async def test_a_restarted_engine_does_not_serve_until_the_next_refit(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, fleet=TRAINER) as f:
        t = trainer(f)
        await f.inject_fault(0, "crash", {})
        await until(lambda: f.ledger.state(0) is ST, timeout=60, what="restarted, STALE")
        new = f.ledger.shard(0).base_url
        assert new not in f.router.serving_backends()
        async with Load(f.router_url, concurrency=4, total=40) as load:
            await load.wait()
        assert load.failures == []
        assert served_ids(await sim_stats(new)) == set()  # not one routed request while STALE
        assert f.ledger.state(0) is ST  # and it stays there: no canary promotes in trainer mode

        await call(t.begin_refit, 1)
        await stamp(f, 1)
        await call(t.complete_refit, 1)
        assert f.ledger.state(0) is H
        await until(lambda: new in f.router.serving_backends(), what="pushed to the router")
        async with Load(f.router_url, concurrency=4, total=30) as load:
            await load.wait()
        assert load.failures == [] and served_ids(await sim_stats(new))


async def test_stalls_during_a_refit_lease_are_not_condemned(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, fleet=TRAINER) as f:
        t = trainer(f)
        url = f.ledger.shard(2).base_url
        async with Load(f.router_url, concurrency=6, max_tokens=30) as load:
            await until(lambda: f.router.in_flight().get(url, 0) >= 1
                        and [f.ledger.state(i) for i in range(3)] == [H, H, H],
                        what="in flight on 2, every shard HEALTHY")
            await call(t.begin_refit, 1)
            await f.inject_fault(2, "wedge", {})  # an engine pausing while it loads weights
            ticks = f.controller.tick_number
            # stall_s is 2 s: run well past two waits and the stall time
            await until(lambda: f.controller.tick_number >= ticks + 12, what="12 ticks")
            assert f.ledger.state(2) is H
            assert f.controller.reports[2].verdict.name == "STALLED"
            assert f.controller.reports[2].evidence.stalls_excused
            await f.inject_fault(2, "unwedge", {})
            await stamp(f, 1)
            await call(t.complete_refit, 1)
        assert [f.ledger.state(i) for i in range(3)] == [H, H, H]
        assert load.failures == []  # the paused requests finished when the engine went on


async def test_a_stall_after_the_lease_is_judged_again(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, fleet=TRAINER) as f:
        t = trainer(f)
        url = f.ledger.shard(2).base_url
        async with Load(f.router_url, concurrency=6, max_tokens=30) as load:
            await until(lambda: f.router.in_flight().get(url, 0) >= 1, what="in flight on 2")
            await call(t.begin_refit, 1)
            await f.inject_fault(2, "wedge", {})
            await stamp(f, 1)
            done = await call(t.complete_refit, 1)  # the lease ends; it stays wedged
            # Its core takes no call: it cannot confirm the version, and is not credited.
            assert "could not be read" in done["unconfirmed"]["2"]  # type: ignore[index]
            await until(lambda: f.ledger.shard(2).restart_attempts >= 1, timeout=30,
                        what="condemned once the lease is over")
        assert load.failures == []


async def test_a_lease_overrun_marks_suspect(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, fleet=TRAINER, refit={"lease_s": 1.5},
                             health={"healthy_threshold": 1000}) as f:
        t = trainer(f)
        seen = record_transitions(f)
        await call(t.begin_refit, 1)
        await until(lambda: all(f.ledger.state(i) is S for i in range(3)), timeout=20,
                    what="every participant SUSPECT")
        assert all("overran its lease" in f.ledger.shard(i).last_error for i in range(3))
        refits = await call(t.refits)
        assert refits["lease"] is None
        assert refits["history"][-1]["outcome"] == "overran"  # type: ignore[index]
        assert {(x.from_state, x.to_state) for x in seen} == {(H, S)}


async def test_a_silent_restart_goes_stale_in_trainer_mode(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, fleet=TRAINER) as f:
        await until(lambda: len(f.controller.reports) == 3, what="a first round")
        before = f.ledger.shard(1).incarnation
        seen = record_transitions(f)
        await f.inject_fault(1, "restart", {})  # the engine restarts without the supervisor
        await until(lambda: f.ledger.state(1) is ST, what="STALE: weights reverted")
        assert f.ledger.shard(1).incarnation != before
        (move,) = [x for x in seen if x.shard == 1]
        assert "restarted on its own" in move.cause and "weights reverted" in move.cause
        assert f.supervisor.restarts_completed == 0
        # The transition's push is a task of its own: the router's list follows within it.
        url = f.ledger.shard(1).base_url
        await until(lambda: url not in f.router.serving_backends(), timeout=5.0,
                    what="the push that takes the STALE engine out of routing")
        assert f.ledger.state(1) is ST  # and it stays out: no canary promotes it (trainer)


async def test_a_silent_restart_stays_serving_in_static_mode(tmp_path: Path) -> None:
    async with running_fleet(tmp_path) as f:
        await until(lambda: len(f.controller.reports) == 2, what="a first round")
        seen = record_transitions(f)
        await f.inject_fault(1, "restart", {})
        await until(lambda: f.controller.reports[1].verdict.name == "RESTARTED",
                    what="the watchdog saw the new process")
        await until(lambda: f.ledger.shard(1).incarnation
                    == f.controller.reports[1].incarnation, what="the ledger took it")
        assert f.ledger.state(1) is H and seen == []


async def test_an_aborted_refit_keeps_a_suspicion(tmp_path: Path) -> None:
    # No threshold is reached here: the requests that were failing when the load stopped can
    # land in one more router window (a streak of 3, condemned at the default threshold, seen
    # once in a full run); this test is about the suspicion surviving the refit, not counts.
    async with running_fleet(tmp_path, fleet={"weights": "trainer", "engines": 3},
                             health={"healthy_threshold": 1000,
                                     "unhealthy_threshold": 1000}) as f:
        t = trainer(f)
        await fail_requests(f, [0, 1])
        ticks = f.controller.tick_number
        await until(lambda: f.controller.tick_number >= ticks + 2, what="two more ticks")
        streaks = [f.ledger.shard(i).consecutive_reported_failures for i in range(3)]
        assert streaks[0] >= 1 and streaks[1] >= 1 and streaks[2] == 0
        assert [f.ledger.state(i) for i in range(3)] == [S, S, H]
        await call(t.begin_refit, 1)
        aborted = await call(t.abort_refit, 1, "trainer crashed")
        assert aborted["condemned"] == []  # two suspects: nobody can be singled out
        assert [f.ledger.state(i) for i in range(3)] == [ST, ST, ST]
        assert [f.ledger.shard(i).state_before_partial for i in range(3)] == [S, S, H]
        await call(t.begin_refit, 1)
        await stamp(f, 1)
        await call(t.complete_refit, 1)
        assert [f.ledger.state(i) for i in range(3)] == [S, S, H]
        assert [f.ledger.shard(i).consecutive_reported_failures for i in range(3)] == streaks


async def test_refit_calls_out_of_order_are_refused_with_the_reason(tmp_path: Path) -> None:
    from fleetwarden.client import FleetClientError

    async with running_fleet(tmp_path, fleet=TRAINER) as f:
        t = trainer(f)
        with pytest.raises(FleetClientError) as err:
            await call(t.complete_refit, 1)
        assert err.value.status == 409 and "no refit is open" in err.value.message
        with pytest.raises(FleetClientError) as err:
            await asyncio.to_thread(t._call, "POST", "/admin/refit/begin", {"version": "x"})
        assert err.value.status == 400 and "version" in err.value.message
        await call(t.begin_refit, 3)
        with pytest.raises(FleetClientError) as err:
            await call(t.begin_refit, 4)
        assert err.value.status == 409 and "still open" in err.value.message
        started = time.monotonic()
        await call(t.abort_refit, 3, "test")
        assert time.monotonic() - started < 30
        load, complete = "/admin/refit/load", "/admin/refit/complete"
        for post, body, field in [
                (load, {"version": 4}, "path"),
                (load, {"path": "/ckpt", "version": 4, "pause_mode": "later"}, "pause_mode"),
                (load, {"path": "/ckpt", "version": 4, "checksums": [1]}, "checksums"),
                (complete, {"version": 4, "checksums": {"w": 1}}, "checksums")]:
            with pytest.raises(FleetClientError) as err:
                await asyncio.to_thread(t._call, "POST", post, body)
            assert err.value.status == 400 and field in err.value.message, body
        await call(t.begin_refit, 5)
        with pytest.raises(FleetClientError) as err:  # a load is a refit: in order too
            await call(t.refit_from, "/ckpt", 6)
        assert err.value.status == 409 and "still open" in err.value.message
        await call(t.abort_refit, 5, "test")


async def test_every_rollout_names_its_weights_and_a_minimum_version_is_kept(
        tmp_path: Path) -> None:
    import openai

    async with running_fleet(tmp_path, fleet={"weights": "trainer", "engines": 2}) as f:
        t = trainer(f)
        client = openai.AsyncOpenAI(base_url=f.router_url + "/v1", api_key="unused",
                                    max_retries=0)
        try:
            sent = itertools.count()

            async def rollout(**headers: str) -> tuple[str, str]:
                # a prompt of its own each (one prompt repeated is an RL group, which the
                # default cache-aware routing keeps on one engine): they spread by load
                raw = await client.completions.with_raw_response.create(
                    model="tiny", prompt=f"hi {next(sent)}", max_tokens=2,
                    extra_headers={k.replace("_", "-"): v for k, v in headers.items()})
                return (raw.headers["x-fleetwarden-weight-version"],
                        raw.headers["x-fleetwarden-shard"])

            before = {await rollout() for _ in range(4)}
            assert before == {("0", "0"), ("0", "1")}

            await call(t.begin_refit, 1)
            await stamp(f, 1)
            await call(t.complete_refit, 1)
            # Pushed before complete_refit answered: the very next rollout names version 1
            demand = {"x_fleetwarden_min_weight_version": "1"}
            after = {await rollout(**demand) for _ in range(4)}
            assert after == {("1", "0"), ("1", "1")}

            with pytest.raises(openai.ConflictError) as refused:
                await rollout(x_fleetwarden_min_weight_version="2")
            error = refused.value.body
            assert isinstance(error, dict) and error["type"] == "weight_version_unavailable"
            assert error["serving_versions"] == [1]
        finally:
            await client.close()


async def test_a_participant_that_goes_silent_in_a_refit_is_named_and_the_abort_condemns_it(
        tmp_path: Path) -> None:
    async with running_fleet(tmp_path, fleet=TRAINER) as f:
        t = trainer(f)
        await call(t.begin_refit, 1)
        await until(lambda: len(f.refit.lease.status) == 3 if f.refit.lease else False,
                    what="every participant seen under the lease")
        status = await asyncio.to_thread(t.refit_status)
        assert status is not None and status["culprits"] == []
        assert all(p["process_alive"] and p["api_answers"] for p in status["status"])

        # Participant 1 wedges in the broadcast so that its API no longer answers
        hung_at = time.monotonic()
        await f.inject_fault(1, "refuse", {})
        named: dict[str, object] = {}

        def culprit_named() -> bool:
            lease = t.refit_status()
            if lease and lease["culprits"]:
                named.update(lease)
                return True
            return False

        while not await asyncio.to_thread(culprit_named):
            assert time.monotonic() - hung_at < 10, "not named within seconds"
            await asyncio.sleep(0.1)
        assert named["culprits"] == [1]
        row = next(p for p in named["status"] if p["shard"] == 1)  # type: ignore[attr-defined]
        assert row["process_alive"] and row["api_answers"] is False
        assert "UNREACHABLE" in row["evidence"] and row["since"] >= f.refit.lease.started_at  # type: ignore[union-attr]

        aborted = await call(t.abort_refit, 1, "weight broadcast hung on shard 1")
        assert aborted["condemned"] == [1]  # the single suspect: the silent participant
        await until(lambda: f.ledger.state(1) is ST and f.ledger.shard(1).restart_attempts == 1,
                    timeout=60, what="replaced, waiting for the next refit")
        await call(t.begin_refit, 2)
        await stamp(f, 2)
        done = await call(t.complete_refit, 2)
        assert done["states"] == {"0": "HEALTHY", "1": "HEALTHY", "2": "HEALTHY"}, done


async def test_an_engine_restarted_just_before_the_trainer_completes_is_not_credited(
        tmp_path: Path) -> None:
    """The engine restarts (a new process: a new start time, counters from zero) and the
    trainer completes before any tick has read it: the fleet reads every participant when
    the trainer completes, sees the new process, and credits the version to the others only.
    Ticks are far apart here, so that no tick's read can tell it first."""
    async with running_fleet(tmp_path, fleet=TRAINER, health={"probe_interval_s": 30}) as f:
        t = trainer(f)
        await call(t.begin_refit, 1)
        await f.inject_fault(1, "restart", {})
        await stamp(f, 1)
        done = await call(t.complete_refit, 1)
        assert done["refitted"] == [0, 2], (done, [(r.state, r.last_error)
                                                   for r in f.ledger.snapshot()])
        assert f.ledger.state(1) is ST and f.ledger.shard(1).weight_version == 0
        assert [f.ledger.shard(i).weight_version for i in (0, 2)] == [1, 1]


async def test_an_engine_that_does_not_confirm_the_version_stays_stale_and_is_named(
        tmp_path: Path) -> None:
    """The engines answer vLLM's ``/weight_info``: the completion credits only those that say
    they hold the version (and the trainer's checksums, when it gives them); the others stay
    STALE, out of routing, named with what they reported."""
    async with running_fleet(tmp_path, fleet=TRAINER) as f:
        t = trainer(f)
        await call(t.begin_refit, 1)
        await stamp(f, 1)
        url = f.ledger.shard(2).base_url
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/update_weight_version", json={"new_version": "0"}):
                pass  # shard 2's push went wrong: its engine holds something else
            async with http.post(f.ledger.shard(0).base_url + "/weight_checker",
                                 json={"action": "checksum"}) as r:
                sums = (await r.json())["checksums"]
        done = await asyncio.to_thread(t.complete_refit, 1, sums)
        assert done["states"] == {"0": "HEALTHY", "1": "HEALTHY", "2": "STALE"}
        assert done["confirmed"] == [0, 1] and done["refitted"] == [0, 1]
        assert done["unconfirmed"] == {"2": "reports weight version '0', not 1"}
        assert url not in f.router.serving_backends()
        history: Any = (await call(t.refits))["history"]
        assert history[-1]["unconfirmed"] == {"2": "reports weight version '0', not 1"}

        # Checksums that are not the engine's: nobody is credited.
        await call(t.begin_refit, 2)
        await stamp(f, 2)
        done = await asyncio.to_thread(t.complete_refit, 2, {k: "0" for k in sums})
        assert set(done["states"].values()) == {"STALE"}
        assert all("checksums differ" in why for why in done["unconfirmed"].values())
