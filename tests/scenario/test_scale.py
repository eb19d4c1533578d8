"""A fleet at scale in the suite: 200 simulated engines of one `fleetwarden sim --engines`
process behind an attached fleet at its default tick; every engine serving, every one read
in each round, and a crash under load handled with no request failed (docs/design.md,
section 6.2). The full figures, at up to 1,000 engines: bench/scale.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleetwarden.ledger import ShardState
from fleetwarden.testing.load import Load
from support.fleet import running_fleet, until
from support.sim import SimProcess, set_fault

pytestmark = pytest.mark.scenario

ENGINES = 200


async def test_two_hundred_engines_all_serve_and_a_crash_under_load_fails_nothing(
        tmp_path: Path, spawn: Any) -> None:
    sims: SimProcess = spawn("--engines", str(ENGINES), "--slots", "4")
    assert len(set(sims.urls)) == ENGINES
    # The fleet's defaults where they matter at scale (tick 5 s, a canary every 30 s), not the
    # suite's shortened ones: 200 idle engines canaried every second would be the test.
    async with running_fleet(
            tmp_path, fleet={"engines": 0, "backends": sims.urls},
            health={"probe_interval_s": 5.0, "canary_interval_s": 30.0}) as fleet:
        meter = fleet.controller.meter
        await until(lambda: meter.read_round.count >= 1 and all(
            fleet.ledger.state(i) is ShardState.HEALTHY for i in range(ENGINES)),
            60, "a round done, all 200 engines HEALTHY")
        assert min(meter.round_reads.recent) == ENGINES  # every engine read in each round
        async with Load(fleet.router_url, concurrency=16, max_tokens=20) as load:
            # The engine struck is one the load reached: its one prompt, repeated, is placed
            # where its cache is (a few engines, by the default cache-aware routing), not
            # spread over all 200.
            def busy() -> list[int]:
                return [i for i in range(ENGINES)
                        if fleet.router.in_flight().get(fleet.ledger.shard(i).base_url, 0)]
            await until(lambda: bool(busy()), 30, "a request on the engine that will crash")
            crashed = busy()[0]
            bad = fleet.ledger.shard(crashed).base_url
            async with aiohttp.ClientSession() as http:
                await set_fault(http, bad, "crash")
            await until(lambda: fleet.ledger.state(crashed) in (ShardState.DEAD,
                                                                ShardState.RESTARTING),
                        30, "the crashed engine condemned")
            sent = len(load.results)
            await until(lambda: len(load.results) >= sent + 32, 30, "requests after the crash")
        assert load.failures == []
        assert bad not in fleet.ledger.serving_urls()
        others = [fleet.ledger.state(i) for i in range(ENGINES) if i != crashed]
        assert others.count(ShardState.HEALTHY) == ENGINES - 1  # no healthy engine ejected
