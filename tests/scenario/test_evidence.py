"""Judgement at the speed of evidence (docs/design.md section 12), on real simulated engines.

The tick is set to a minute here, so that whatever happens within a test happened on
evidence: a failed request, a request gone silent, a focused read. Each test names its
mechanism and asserts it, never how many seconds it took (that is ``bench/failover.py``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fleetwarden.ledger import Event, ShardState
from fleetwarden.testing.load import Load
from support.fleet import (
    SIM,
    record_transitions,
    running_fleet,
    served_ids,
    sim_stats,
    until,
    wedge_when_busy,
)

pytestmark = pytest.mark.scenario

D, R = ShardState.DEAD, ShardState.RESTARTING
#: One tick a minute: only the evidence can act within a test.
SLOW_TICK = {"probe_interval_s": 60.0}


async def test_a_refusing_engine_is_condemned_by_a_focused_read_at_once(tmp_path: Path) -> None:
    # The process lives on (no exit to see), its socket is closed: every connection refused,
    # as an attached engine that crashed looks to fleetwarden.
    # Least in flight: both engines get requests at once, so one meets shard 0's refusal.
    # Under cache-aware placement no request did (3 runs of 3): shard 0 was accused of silent
    # requests instead and condemned by three failed reads (FAILURES_AT_THRESHOLD, about 6 s),
    # a path the wedge tests below cover; this test is about the refusal on the request path.
    async with running_fleet(tmp_path, health=SLOW_TICK,
                             router={"routing": "least_in_flight"}) as fleet:
        await until(lambda: len(fleet.controller.reports) == 2, what="a first round")
        seen = record_transitions(fleet)
        await fleet.inject_fault(0, "refuse", {})
        async with Load(fleet.router_url, concurrency=2, max_tokens=4, think_s=0.05) as load:
            await until(lambda: any(t.shard == 0 and t.to_state is D for t in seen),
                        what="shard 0 condemned")
        death = next(t for t in seen if t.shard == 0 and t.to_state is D)
        assert death.event is Event.CONFIRMED, death.cause  # one refusal, one failed read
        assert "refused" in death.cause or "cannot connect" in death.cause, death.cause
        assert fleet.controller.tick_number == 1
        assert load.failures == []  # a refused request never reached an engine: re-sent


async def test_a_wedge_under_load_is_condemned_by_focused_reads_not_the_tick(
        tmp_path: Path) -> None:
    async with running_fleet(tmp_path, fleet={"engines": 3}, health=SLOW_TICK) as fleet:
        seen = record_transitions(fleet)
        async with Load(fleet.router_url, concurrency=9, max_tokens=40) as load:
            await wedge_when_busy(fleet, 1)
            await until(lambda: any(t.shard == 1 and t.to_state is D for t in seen),
                        what="shard 1 condemned")
        death = next(t for t in seen if t.shard == 1 and t.to_state is D)
        assert "STUCK" in death.cause, death.cause
        assert fleet.controller.focus_started.get("silent requests", 0) >= 1
        assert fleet.controller.tick_number == 1
        # what it held: answered by hedges, or rescued at its condemnation
        assert fleet.router.stats.rescues + fleet.router.stats.hedges_won >= 2
        assert load.failures == [], load.failures[:3]


async def test_a_busy_engine_accused_of_silence_is_read_but_never_sent_a_canary(
        tmp_path: Path) -> None:
    # Generations longer than silent_after_s: every engine is accused again and again while it
    # works. Reads show its progress; no canary, no ejection, nothing condemned.
    slow = SIM + " --slots 2 --steps-per-s 20"
    health = {**SLOW_TICK, "silent_after_s": 0.3, "canary_interval_s": 1.0}
    async with running_fleet(tmp_path, fleet={"engine_cmd": slow}, health=health) as fleet:
        await until(lambda: len(fleet.controller.reports) == 2, what="a first round")
        urls = fleet.ledger.serving_urls()
        before = {u: served_ids(await sim_stats(u), "fleetwarden-canary") for u in urls}
        seen = record_transitions(fleet)
        async with Load(fleet.router_url, concurrency=6, max_tokens=40) as load:
            await until(lambda: fleet.controller.focus_started.get("silent requests", 0) >= 6,
                        what="engines accused of silence")
            await until(lambda: len(load.results) >= 12, what="requests answered")
        after = {u: served_ids(await sim_stats(u), "fleetwarden-canary") for u in urls}
        assert after == before  # not one canary to an engine with work in it
        assert seen == [] and fleet.ledger.ejected() == []
        assert load.failures == []


# ---------------------------------------------------------------------- streams are evidence


async def test_streams_parked_on_a_wedge_accuse_it_and_are_continued(tmp_path: Path) -> None:
    # Only streams: each has its head at once, so nothing waits for one. Held on the wedge
    # with no token, they are what accuses it (no tick runs within the test), and they go on
    # elsewhere, whole.
    async with running_fleet(tmp_path, fleet={"engines": 3}, health=SLOW_TICK) as fleet:
        seen = record_transitions(fleet)
        async with Load(fleet.router_url, concurrency=6, max_tokens=60, stream=True) as load:
            await wedge_when_busy(fleet, 1)
            await until(lambda: any(t.shard == 1 and t.to_state is D for t in seen),
                        what="shard 1 condemned")
        assert fleet.controller.focus_started.get("silent requests", 0) >= 1
        assert fleet.controller.tick_number == 1
        stats = fleet.router.stats
        assert stats.rescues >= 2 and stats.streams_ended == {}
        assert load.failures == [], load.failures[:3]


async def _parked(url: str, loads: list[Load]) -> dict[str, set[str]]:
    """By load (its id prefix): the requests in flight on the engine at ``url`` now (arrived
    there, not answered)."""
    stats = await sim_stats(url)
    return {load.id_prefix: served_ids(stats, load.id_prefix)
            - {r.request_id for r in load.results} for load in loads}


async def test_a_stream_parked_on_a_wedge_goes_on_as_fast_as_a_waiting_request(
        tmp_path: Path) -> None:
    # Streams and waiting requests side by side, some of each on the engine that wedges: both
    # kinds are moved on the same evidence (held, no step), and the figures are printed.
    async with running_fleet(tmp_path, fleet={"engines": 3}, health=SLOW_TICK) as fleet:
        url = fleet.ledger.shard(1).base_url
        streams = Load(fleet.router_url, concurrency=4, max_tokens=40, stream=True,
                       id_prefix="stream-")
        waiting = Load(fleet.router_url, concurrency=4, max_tokens=40, id_prefix="load-")
        loads = [streams, waiting]
        async with streams, waiting:
            parked: dict[str, set[str]] = {}

            async def both_there() -> bool:
                parked.update(await _parked(url, loads))
                return all(parked.values())

            await until(both_there, what=f"both kinds in flight on {url}")
            await fleet.inject_fault(1, "wedge", {})
            fault_at = time.time()
            parked = {k: v | (await _parked(url, loads))[k] for k, v in parked.items()}
            answered = {r.request_id for load in loads for r in load.results}
            await until(lambda: all(ids <= {r.request_id for load in loads
                                            for r in load.results} for ids in parked.values()),
                        what="every request parked on the wedge answered")
        to_wall = time.time() - time.monotonic()
        after = {prefix: max(r.started + r.latency_s + to_wall - fault_at
                             for load in loads for r in load.results
                             if r.request_id in ids and r.request_id not in answered)
                 for prefix, ids in parked.items()}
        print(f"\nparked on the wedge, last answered after the fault: streams "
              f"+{after['stream-']:.2f} s ({len(parked['stream-'])}), waiting requests "
              f"+{after['load-']:.2f} s ({len(parked['load-'])})")
        assert streams.failures == [] and waiting.failures == []
        assert fleet.controller.tick_number == 1  # on evidence alone
        assert fleet.router.stats.streams_ended == {}
