"""A mixed fleet: simulated vLLM, llama.cpp and SGLang engines behind one router,
each judged in its own dialect, surviving a wedge and a crash under load with no client error.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fleetwarden.ledger import Event, ShardState
from fleetwarden.testing.load import Load
from fleetwarden.testing.scenarios import condemned_as_a_stopped_core
from support.fleet import SIM, record_transitions, running_fleet, until

pytestmark = pytest.mark.scenario

H, D = ShardState.HEALTHY, ShardState.DEAD


def mixed(tmp_path: Path) -> dict[str, object]:
    return {
        "engines": 1, "engine_cmd": SIM, "engine": "auto",  # vLLM, recognised from /metrics
        "log_dir": str(tmp_path / "logs"),
        "groups": [
            {"engines": 1, "engine": "llamacpp", "engine_cmd": SIM + " --engine llamacpp"},
            {"engines": 1, "engine": "sglang", "engine_cmd": SIM + " --engine sglang"},
        ],
    }


async def test_a_mixed_fleet_survives_a_wedge_and_a_crash_under_load(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, fleet=mixed(tmp_path)) as fleet:
        assert len(fleet.ledger) == 3
        await until(lambda: all(r is not None and r.engine is not None
                                for r in (fleet.controller.reports.get(i) for i in range(3))),
                    what="every shard judged in a dialect")
        kinds = [fleet.controller.reports[i].engine for i in range(3)]
        assert [k.name for k in kinds if k is not None] == ["vllm", "llamacpp", "sglang"]
        seen = record_transitions(fleet)

        def condemned(i: int) -> bool:  # DEAD is left in the same tick (RESTARTING)
            return any(t.shard == i and t.to_state is D for t in seen)

        wedged, crashed = fleet.ledger.shard(1).base_url, fleet.ledger.shard(2).base_url
        async with Load(fleet.router_url, concurrency=9, max_tokens=40) as load:
            await until(lambda: fleet.router.in_flight().get(wedged, 0) >= 1,
                        what="requests in flight on the llama.cpp shard")
            await fleet.inject_fault(1, "wedge", {})
            await until(lambda: condemned(1), timeout=30,
                        what="the wedged llama.cpp shard condemned")
            await until(lambda: fleet.router.in_flight().get(crashed, 0) >= 1,
                        what="requests in flight on the SGLang shard")
            await fleet.inject_fault(2, "crash", {})
            await until(lambda: condemned(2), timeout=30,
                        what="the crashed SGLang shard condemned")
            await until(lambda: fleet.ledger.state(1) is H and fleet.ledger.state(2) is H,
                        timeout=60, what="both back")
            back = time.monotonic()
            await until(lambda: len(load.since(back)) >= 20, what="load after the restarts")
        wedge = next(t for t in seen if t.shard == 1 and t.to_state is D)
        assert condemned_as_a_stopped_core(wedge.cause), wedge.cause
        crash = next(t for t in seen if t.shard == 2 and t.to_state is D)
        # Seen as a process exit, or (when its refusals win the race) as failed requests confirmed
        # by one focused read at once: never after a streak of probes.
        assert "exited" in crash.cause or crash.event is Event.CONFIRMED, crash.cause
        assert load.failures == [], load.failures[:3]
        restarted = [fleet.controller.reports[i].engine for i in (1, 2)]
        assert [k.name for k in restarted if k is not None] == ["llamacpp", "sglang"]
        print(f"\nmixed fleet: {load.summary()}, retries {fleet.router.stats.retries}, "
              f"rescues {fleet.router.stats.rescues}")
