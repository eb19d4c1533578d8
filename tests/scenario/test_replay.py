"""Trace replay on simulated engines: the schedule kept, the prompts as the trace says, and every
fault's post-check passing where the fault happened and failing where it was aimed at nothing.

The bench (``bench/replay.py``) drives its traces through AIPerf; these tests drive a short
trace through this project's own driver (``fleetwarden.testing.replay``), since AIPerf's
install (about 1.2 GB in its own environment) is too heavy for the suite to pay for.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable

import aiohttp
import pytest

from fleetwarden.testing.replay import FAULTS, Counters, Target, decoys, replay
from fleetwarden.testing.traces import TraceShape, generate, reuse_ratio
from support.sim import SimProcess

pytestmark = pytest.mark.scenario

#: A short trace: about 6 s of arrivals, sessions and shared prefixes as the bench's, shorter
#: answers so that it ends in seconds on 2 cores.
SHORT = TraceShape(requests=40, rate_per_s=7.0, output_mean=12.0, output_max=40,
                   think_mean_s=1.0, input_mean=400.0, input_max=1500)


async def test_a_trace_is_replayed_at_its_schedule_with_its_prompts(
        spawn: Callable[..., SimProcess]) -> None:
    records = generate(SHORT, seed=5)
    sim = spawn("--steps-per-s", "100", "--slots", "16")
    results = await replay(records, sim.url, block_tokens=SHORT.block_tokens)
    late = [r.sent_s - r.scheduled_s for r in results]
    print(f"\n{len(results)} requests over {records[-1].timestamp / 1000:.1f} s; sent late by "
          f"median {statistics.median(late) * 1000:.1f} ms, most {max(late) * 1000:.1f} ms; "
          f"reuse ratio {reuse_ratio(records):.2f}")
    assert [r.index for r in results] == list(range(len(records)))
    assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
    # Open loop: each request left at its own timestamp (never before it), not after the
    # previous one's answer; the lateness bound is loose (a loaded 2-core machine).
    assert min(late) >= 0 and statistics.median(late) < 0.25, late
    # The engine saw every prompt at the trace's length (its tokenizer: one token per
    # character, plus BOS), so lengths and shared prefixes reached it as the trace says.
    async with aiohttp.ClientSession() as http:
        async with http.get(sim.url + "/sim/requests") as resp:
            seen = await resp.json()
        counters = Counters([sim.url])
        await counters.read(http, 0.0)
    assert sorted(r["prompt_tokens"] for r in seen) == sorted(
        r.input_length + 1 for r in records)
    # Shared prefixes are found in the engine's prefix cache: its own counters say so.
    queries, hits = counters.totals()
    assert queries == sum(r.input_length + 1 for r in records)
    assert hits / queries > 0.2, (hits, queries)


def _engines(spawn: Callable[..., SimProcess], n: int) -> tuple[list[SimProcess], list[Target]]:
    sims = [spawn("--steps-per-s", "50") for _ in range(n)]
    return sims, [Target(s.url, s.pid) for s in sims]


async def _warm(targets: list[Target]) -> None:
    """One answered request on each engine, so that a wedge has something it stops."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for t in targets:
            async with http.post(t.url + "/v1/completions", json={
                    "model": "tiny", "prompt": "warm", "max_tokens": 1}) as resp:
                assert resp.status == 200


@pytest.mark.parametrize("name", sorted(FAULTS))
async def test_each_fault_is_proved_by_its_post_check_and_a_control_aimed_at_nothing_fails_it(
        spawn: Callable[..., SimProcess], name: str) -> None:
    sims, engines = _engines(spawn, 2)
    await _warm(engines)
    fault = FAULTS[name](gap_s=0.2) if name == "rolling-restart" else FAULTS[name]()
    picked = fault.picks(engines)
    fakes, decoy = decoys(len(picked))
    try:
        # The control first: the same injection aimed at nothing, then the same post-check
        # on the engines it should have hit. Its signature must be missing.
        await fault.before(engines)
        await fault.inject(fakes)
        await asyncio.sleep(0.5)  # as long as a crash takes to exit (the check polls further)
        missing = await fault.verify(engines)
        print(f"\n{name} aimed at nothing: {missing}")
        assert missing, f"{name}: the post-check passed with the fault aimed at nothing"
        assert all(s.proc.poll() is None for s in sims)
        # Now for real: the signature is there.
        await fault.before(engines)
        await fault.inject(picked)
        await asyncio.sleep(0.5)
        missing = await fault.verify(engines)
        print(f"{name} aimed at the engines: {missing or 'every signature found'}")
        assert missing == []
    finally:
        await fault.undo(engines)
        decoy.kill()
        decoy.wait()

