"""A whole fleet in the test's event loop, on real `fleetwarden sim` engine processes.

Timings are compressed (a 0.5 s tick, a 2 s stall) so a scenario takes seconds, not minutes;
the logic is the same as at the defaults. Waits poll for a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from fleetwarden.config import Config, parse_config
from fleetwarden.fleet import Fleet
from fleetwarden.ledger import ShardState, Transition
from support.wait import until

#: A simulated engine with a few slots, fast enough that a 16-token request takes 0.4 s.
SIM = "{python} -m fleetwarden sim --host {host} --port {port} --steps-per-s 40"


def fleet_config(tmp_path: Path, **sections: dict[str, Any]) -> Config:
    data: dict[str, Any] = {
        "fleet": {"engines": 2, "engine_cmd": SIM, "log_dir": str(tmp_path / "logs"),
                  "startup_timeout_s": 30},
        # The router in the test's own process (the tests read fleet.router's pool and
        # counters); test_router_processes runs it as processes, as `fleetwarden up` does.
        "router": {"port": 0, "workers": 0},
        "health": {"probe_interval_s": 0.5, "probe_timeout_s": 1.0, "stall_s": 2.0,
                   "canary_interval_s": 1.0, "canary_timeout_s": 1.5},
        "supervisor": {"backoff_initial_s": 0.5, "backoff_max_s": 2, "stop_grace_s": 3},
        "journal": {"path": str(tmp_path / "fleet.sqlite")},
        "admin": {"port": 0, "token_file": str(tmp_path / "admin.token")},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return parse_config(data, "test")


@contextlib.asynccontextmanager
async def running_fleet(tmp_path: Path, **sections: dict[str, Any]) -> AsyncIterator[Fleet]:
    fleet = Fleet(fleet_config(tmp_path, **sections))
    try:
        await fleet.start()
    except BaseException:
        await fleet.stop()  # whatever it started before it failed
        raise
    loop = asyncio.create_task(fleet.run(), name="controller")
    try:
        yield fleet
    finally:
        fleet.request_stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(loop, 30)
        await fleet.stop()


async def wedge_when_busy(fleet: Fleet, shard: int) -> float:
    """Wedge ``shard`` once it holds at least two of the router's requests (a wedge under
    load); returns when, on ``time.monotonic()``."""
    url = fleet.ledger.shard(shard).base_url
    await until(lambda: fleet.router.in_flight().get(url, 0) >= 2,
                what=f"requests in flight on shard {shard}")
    await fleet.inject_fault(shard, "wedge", {})
    return time.monotonic()


def states(fleet: Fleet) -> list[ShardState]:
    return [r.state for r in fleet.ledger.snapshot()]


def record_transitions(fleet: Fleet) -> list[Transition]:
    seen: list[Transition] = []
    fleet.ledger.subscribe(lambda t: seen.append(t) if t.changes_state else None)
    return seen


async def sim_stats(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s, \
            s.get(url + "/sim/stats") as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def stamp(fleet: Fleet, version: int) -> None:
    """What a trainer's weight push ends with on vLLM: ``version`` stamped on each participant's
    engine (``POST /update_weight_version``; vLLM's ``finish_weight_update`` does the same),
    which the completion reads back: an engine that does not say it holds the version is not
    credited. An engine that does not answer is left as it is (the completion judges it)."""
    lease = fleet.refit.lease
    assert lease is not None, "stamp inside a lease"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        for p in lease.participants:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with s.post(p.url + "/update_weight_version",
                                  json={"new_version": str(version)}):
                    pass


def served_ids(stats: dict[str, Any], prefix: str = "load-") -> set[str]:
    """The x-request-ids of requests an engine received (from its /sim/stats log)."""
    return {e["request_id"] for e in stats.get("log", [])
            if (e.get("request_id") or "").startswith(prefix)}
