"""Engines behind keys (vLLM's ``--api-key``), on simulated engines that guard their paths as
vLLM 0.32's middleware does (``fleetwarden sim --api-key``).

The rule under test (docs/design.md section 5, "Asked wrong"): an answer that says "you asked
wrong" (401, 403, 400, 404, ...) to fleetwarden's own request is a fault of its configuration,
never evidence against the engine; and a client's key and the engine's 401 to it are the
client's (docs/operations.md, "Engines with API keys")."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from fleetwarden.admin import views
from fleetwarden.judge import DEFAULT_POLICY, Health, Target
from fleetwarden.ledger import ShardState
from fleetwarden.watchdog import Watchdog
from support.fleet import record_transitions, running_fleet
from support.sim import SimProcess
from support.wait import until

KEY = "sk-fleet-test-3f9a1c"
OTHER_KEY = "sk-other-test-77b2"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _send(http: aiohttp.ClientSession, url: str, n: int, headers: dict[str, str],
                max_tokens: int = 4) -> list[int]:
    """``n`` completions, 4 at a time; their statuses. Bounded by ``n`` and the session's
    timeout."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": max_tokens}
    gate = asyncio.Semaphore(4)

    async def one() -> int:
        async with gate, http.post(url + "/v1/completions", json=body, headers=headers) as r:
            await r.read()
            return r.status

    return list(await asyncio.gather(*(one() for _ in range(n))))


async def test_the_sim_guards_paths_as_vllms_middleware_does(
        spawn: Callable[..., SimProcess]) -> None:
    sim = spawn("--api-key", KEY, "--api-key", OTHER_KEY)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async def status(method: str, path: str, headers: dict[str, str] | None = None) -> int:
            async with http.request(method, sim.url + path, headers=headers or {}) as r:
                await r.read()
                return r.status

        # Open: probes, metrics, version, the dev endpoints, the simulator's own control.
        for path in ("/health", "/metrics", "/version", "/is_sleeping", "/sim/stats"):
            assert await status("GET", path) == 200, path
        # Guarded: every path under /v1 (a plain string prefix, as vLLM's startswith), with
        # either key, the scheme in any case; OPTIONS never.
        assert await status("GET", "/v1/models") == 401
        assert await status("GET", "/v1/models", bearer(KEY)) == 200
        assert await status("GET", "/v1/models", bearer(OTHER_KEY)) == 200
        assert await status("GET", "/v1/models", {"Authorization": f"bearer {KEY}"}) == 200
        assert await status("GET", "/v1/models", {"Authorization": f"Basic {KEY}"}) == 401
        assert await status("GET", "/v1/models", {"Authorization": f"Bearer  {KEY}"}) == 401
        assert await status("GET", "/v1/models", bearer("sk-wrong")) == 401
        assert await status("GET", "/v1xyz") == 401  # guarded before it is found missing
        assert await status("GET", "/v2/anything") == 401
        assert await status("OPTIONS", "/v1/models") != 401
        async with http.get(sim.url + "/v1/models") as r:
            assert await r.json() == {"error": "Unauthorized"}


async def test_canaries_answered_400_or_404_condemn_nothing(
        spawn: Callable[..., SimProcess]) -> None:
    """A canary that asks for a model the engine does not serve (404), and an engine URL with a
    path prefix the engine does not serve (every path 404): reads on reads, the engine is
    never once failing, and the fault is named."""
    sim = spawn("--steps-per-s", "40")
    policy = DEFAULT_POLICY.__class__(canary_interval_s=0.0, canary_timeout_s=2.0)
    async with Watchdog(policy, model="not-the-served-one") as wrong_model, \
            Watchdog(policy) as prefixed:
        healths = []
        faults = set()
        for _ in range(4):
            for watchdog, url in ((wrong_model, sim.url), (prefixed, sim.url + "/prefix")):
                report = await watchdog.probe(Target(url))
                healths.append(report.health)
                faults.update(f.split(":")[0] for f in report.faults)
        print(f"4 reads each: healths {sorted({h.value for h in healths})}; faults {faults}")
        assert Health.FAILING not in healths and Health.CONDEMNED not in healths, healths
        assert "POST /v1/completions answered 404" in faults
        assert "GET /health answered 404" in faults


async def test_keyed_engines_with_no_key_configured_are_never_condemned(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The first thing a new user tries: engines started with --api-key, attached with no key
    in the config. Their canaries are refused (401) read after read; they are never SUSPECT,
    DEAD or out of routing for it, the fault is logged once per engine and cause and shown in
    the status; clients' keys pass through the router, and a wrong key's 401 is the
    client's, 20 of 20."""
    caplog.set_level(logging.WARNING, logger="fleetwarden.watchdog")
    sims = [SimProcess("--steps-per-s", "40", "--api-key", KEY) for _ in range(2)]
    try:
        urls = [s.url for s in sims]
        async with running_fleet(tmp_path, fleet={"engines": 0, "backends": urls}) as fleet:
            moves = record_transitions(fleet)
            # Idle: the canaries are due every second and refused every time.
            await until(lambda: all(
                any("401" in f for f in views.shards_view(fleet.snapshot())[i]["config_faults"])
                for i in range(2)), what="both engines' config faults shown", timeout=20)
            await asyncio.sleep(3.0)  # more refused canaries: still nothing against them
            router = fleet.router_url
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                wrong = await _send(http, router, 20, bearer("sk-wrong"))
                keyed = await _send(http, router, 20, bearer(KEY))
                bare = await _send(http, router, 5, {})
            snap = fleet.snapshot()
            shards = views.shards_view(snap)
            status = views.status_view(snap)
            print(f"wrong key: {wrong.count(401)} of {len(wrong)} answered 401; keyed: "
                  f"{keyed.count(200)} of {len(keyed)} answered 200; moves: {moves}")
            assert wrong == [401] * 20
            assert keyed == [200] * 20
            assert bare == [401] * 5
            assert not moves, moves
            assert [s["state"] for s in shards] == ["HEALTHY", "HEALTHY"]
            assert all(s["ejected_until"] is None for s in shards), shards
            assert status["config_faults"] == 2
            for s in shards:
                assert any("api_key_file" in f for f in s["config_faults"]), s
            assert fleet.ledger.state(0) is ShardState.HEALTHY
        told = [r.getMessage() for r in caplog.records if "configuration fault" in r.getMessage()]
        per_engine = {url: sum(url in line for line in told) for url in urls}
        print(f"config-fault log lines per engine: {per_engine}")
        # One line per engine and cause (the canary's model list, refused): not one per read.
        assert all(n == 1 for n in per_engine.values()), told
    finally:
        for s in sims:
            s.kill()
