"""Back at once, out at once, on launched engines at the fleet's defaults: a rolling restart
paced by the engines' /health loses nothing, and a whole engine SIGSTOPped under load is judged
silent and its requests hedged (docs/design.md, "A comeback is seen at once", "None left, one
coming", "Silence is evidence"). Each fault is verified on the engine, and the check of it fails
on an engine the fault was never sent to. The attached side runs as `bench/failover.py` does
(tests/scenario/test_failover_bench.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleetwarden.config import HealthConfig
from fleetwarden.ledger import ShardState
from fleetwarden.testing.faults import check_fault, process_state
from fleetwarden.testing.load import Load
from support.fleet import running_fleet, sim_stats
from support.wait import until

pytestmark = pytest.mark.scenario


H = ShardState.HEALTHY

#: The judge at its defaults (tests/support/fleet.py compresses them).
DEFAULTS: dict[str, Any] = {k: getattr(HealthConfig(), k) for k in (
    "probe_interval_s", "probe_timeout_s", "stall_s", "canary_interval_s", "canary_timeout_s")}


def first_after(stats: dict[str, Any], what: str, path: str | None = None) -> float | None:
    """When the engine's own log first shows a request: a client's (``what`` "load-"), or any
    to ``path``."""
    times = [e["at"] for e in stats.get("log", [])
             if (path is None or e["path"] == path)
             and (e.get("request_id") or "").startswith(what)]
    return min(times) if times else None


@pytest.mark.parametrize("stream", [False, True], ids=["answers", "streams"])
async def test_a_rolling_restart_of_launched_engines_paced_by_health_loses_nothing(
        tmp_path: Path, stream: bool) -> None:
    """Two engines: while one is restarted, the other holds every request, and the second
    goes as soon as the first one's new process answers /health. A request that finds none
    waits for the first one's admission instead of a 409."""
    async with running_fleet(tmp_path, health=DEFAULTS) as fleet:
        await until(lambda: [r.state for r in fleet.ledger.snapshot()] == [H, H],
                    what="both serving")
        load = Load(fleet.router_url, concurrency=12, max_tokens=4, stream=stream,
                    timeout_s=30, pause_after_failure_s=1.0)
        load.start()
        back: list[float | None] = []
        try:
            await until(lambda: len(load.results) >= 20, what="load flowing")
            for shard in (0, 1):
                old = fleet.supervisor.engines[shard]
                assert old.pgid is not None
                os.killpg(old.pgid, signal.SIGTERM)  # a deploy's restart: the process exits

                def replaced(shard: int = shard, old: Any = old) -> bool:
                    return fleet.supervisor.engines.get(shard) not in (None, old)

                # the supervisor's handle exists once its /health answered: the pace, so the
                # next one goes at once, while this one may not be routed yet
                await until(replaced, timeout=30, what=f"shard {shard}'s new process")
            await asyncio.sleep(1.0)  # the last one serves a moment
            for shard in (0, 1):
                stats = await sim_stats(fleet.supervisor.engines[shard].url)
                health = first_after(stats, "", "/health")
                first = first_after(stats, "load-")
                back.append(None if health is None or first is None else first - health)
        finally:
            await load.stop()
        served = fleet.router.stats
        print(f"\nlaunched rolling restart ({'streamed' if stream else 'answers'}): "
              f"{len(load.results)} sent, {len(load.failures)} failed; each restarted engine's "
              "first client request after its first /health: "
              + " / ".join("none" if b is None else f"{b:.2f} s" for b in back)
              + f" (target < 1 s); {served.comeback_waits} requests waited for a comeback, "
              f"{served.comeback_served} of them served")
        assert load.failures == [], load.failures[:3]
        assert all(b is not None for b in back)
        assert fleet.supervisor.restarts_completed == 2


async def test_a_whole_engine_sigstopped_under_load_is_silent_and_its_requests_hedged(
        tmp_path: Path) -> None:
    """The OS says the launched engine is stopped: judged SILENT without a read's timeout,
    its held requests hedged, nothing failed. The fault is read back from /proc."""
    async with running_fleet(tmp_path, health=DEFAULTS) as fleet:
        await until(lambda: [r.state for r in fleet.ledger.snapshot()] == [H, H],
                    what="both serving")
        victim = fleet.supervisor.engines[1]
        assert victim.pid is not None
        async with Load(fleet.router_url, concurrency=8, max_tokens=20, timeout_s=30) as load:
            await until(lambda: fleet.router.in_flight().get(victim.url, 0) >= 2,
                        what="requests on shard 1")
            os.kill(victim.pid, signal.SIGSTOP)
            struck = time.monotonic()
            verified = await check_fault(victim.url, "sigstop", victim.pid)
            await until(lambda: fleet.ledger.state(1) is not H, timeout=30,
                        what="shard 1 taken out")
            out_after = time.monotonic() - struck
            await load.carried_on(3.0)  # its held requests hedged, the load on the other
        verdicts = fleet.controller.verdict_counts
        print(f"\nSIGSTOP of a launched engine: {verified}; out of the serving states after "
              f"{out_after:.1f} s; {fleet.router.stats.hedges_won} answered by hedges; "
              f"{len(load.failures)} failed of {len(load.results)}; verdicts {verdicts}")
        assert verified.startswith("verified"), verified
        assert load.failures == []
        assert verdicts.get("SILENT", 0) >= 1


async def test_each_faults_check_fails_on_an_engine_it_was_never_sent_to(
        tmp_path: Path) -> None:
    """The control: the same checks, aimed at an engine that got no fault, say so; then the
    faults, and they pass."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetwarden", "sim", "--port", "0",
        stdout=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().split()
        url = line[1]
        for fault in ("sigstop", "blackhole"):
            control = await check_fault(url, fault, proc.pid)
            assert control.startswith("NOT verified"), (fault, control)
        assert process_state(proc.pid) in ("S", "R")
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/sim/fault", json={"mode": "blackhole"}) as resp:
                assert resp.status == 200
            async def swallowed() -> None:
                async with http.get(url + "/health") as held:
                    await held.read()

            reader = asyncio.create_task(swallowed())
            for _ in range(100):  # the engine's own count shows the read it swallowed
                if (await sim_stats(url))["blackholed"] >= 1:
                    break
                await asyncio.sleep(0.05)
            assert (await check_fault(url, "blackhole", proc.pid)).startswith("verified")
            reader.cancel()
        os.kill(proc.pid, signal.SIGSTOP)
        await until(lambda: process_state(proc.pid) == "T", what="stopped")
        assert (await check_fault(url, "sigstop", proc.pid)).startswith("verified")
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

