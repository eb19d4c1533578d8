"""Engines behind keys (vLLM's ``--api-key``), on simulated engines that guard their paths as
vLLM 0.32's middleware does (``fleetwarden sim --api-key``).

The rule under test (docs/design.md section 5, "Asked wrong"): an answer that says "you asked
wrong" (401, 403, 400, 404, ...) to fleetwarden's own request is a fault of its configuration,
never evidence against the engine; and a client's key and the engine's 401 to it are the
client's (docs/operations.md, "Engines with API keys")."""

from __future__ import annotations

import asyncio
import json
import logging
import time
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
    # SGLang's rule (python/sglang/srt/utils/auth.py): all but /health* and /metrics*.
    sglang = spawn("--engine", "sglang", "--api-key", KEY)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for path, want in (("/health", 200), ("/health_generate", 404), ("/metrics", 200),
                           ("/v1/models", 401), ("/get_model_info", 401), ("/version", 401)):
            async with http.get(sglang.url + path) as r:
                assert r.status == want, path
        async with http.get(sglang.url + "/v1/models", headers=bearer(KEY)) as r:
            assert r.status == 200


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


async def test_a_keyed_fleet_is_read_with_its_key_and_the_key_shows_nowhere(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The issue's script on two keyed sims, the key in a file: idle (canaries answered: no
    config fault), keyed load, 20 wrong-key requests (the engine's 401 back, 20 of 20), 20
    keyed; 0 condemned or out of routing. Then every place a key could leak is read for it:
    the log, the journal, the admin API (status, shards, transitions, serving, refits,
    metrics, the dashboard's page), the router's status and the error bodies clients got."""
    caplog.set_level(logging.DEBUG, logger="fleetwarden")
    key_file = tmp_path / "engine.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    sims = [SimProcess("--steps-per-s", "40", "--api-key", KEY) for _ in range(2)]
    try:
        urls = [s.url for s in sims]
        async with running_fleet(tmp_path, fleet={"engines": 0, "backends": urls,
                                                  "api_key_file": str(key_file)}) as fleet:
            moves = record_transitions(fleet)
            # Idle until each engine's canary was answered (it took the key), then a little
            # more: idle engines keep being canaried at the test's 1 s interval.
            await until(lambda: all(
                (r := fleet.snapshot().reports.get(i)) is not None and r.canary is not None
                and r.canary.ok for i in range(2)), what="both canaries answered", timeout=20)
            await asyncio.sleep(2.0)
            router = fleet.router_url
            bodies: list[bytes] = []
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                load = await _send(http, router, 40, bearer(KEY), max_tokens=16)
                wrong = await _send(http, router, 20, bearer("sk-wrong"))
                keyed = await _send(http, router, 20, bearer(KEY))
                async with http.post(router + "/v1/completions", headers=bearer("sk-wrong"),
                                     json={"model": "tiny", "prompt": "x"}) as r:
                    bodies.append(await r.read())
                admin = fleet.admin_url
                token = {"Authorization": f"Bearer {fleet.admin.token}"}
                pages = []
                for path in ("/admin/status", "/admin/shards", "/admin/transitions",
                             "/admin/serving", "/admin/refits", "/metrics", "/",
                             "/static/dashboard.js"):
                    async with http.get(admin + path, headers=token) as r:
                        assert r.status == 200, path
                        pages.append(await r.read())
            snap = fleet.snapshot()
            shards = views.shards_view(snap)
            print(f"keyed load: {load.count(200)} of {len(load)}; wrong key: "
                  f"{wrong.count(401)} of {len(wrong)} answered 401; keyed: "
                  f"{keyed.count(200)} of {len(keyed)}; moves: {moves}")
            assert load == [200] * 40
            assert wrong == [401] * 20
            assert keyed == [200] * 20
            assert not moves, moves
            assert [s["state"] for s in shards] == ["HEALTHY", "HEALTHY"]
            assert all(s["ejected_until"] is None for s in shards), shards
            assert [s["config_faults"] for s in shards] == [[], []]
            # The wrong keys' 401s were the clients': never retried, hedged or counted.
            stats = fleet.router.stats
            assert not stats.backend_failures and not any(stats.retries.values()), (
                stats.backend_failures, stats.retries)
            assert stats.hedges == 0
            router_status = json.dumps(fleet.router.status()).encode()
            journal_path = Path(fleet.config.journal.path)
        secret = KEY.encode()
        journal = b"".join(p.read_bytes() for p in journal_path.parent.glob(
            journal_path.name + "*"))
        logged = "\n".join(r.getMessage() for r in caplog.records).encode()
        places = {"log": logged, "journal": journal, "router status": router_status,
                  "error bodies": b"".join(bodies), **{f"admin page {i}": p
                                                      for i, p in enumerate(pages)}}
        print(f"read for the key: {', '.join(f'{k} ({len(v)} B)' for k, v in places.items())}")
        leaks = [name for name, text in places.items() if secret in text]
        assert not leaks, leaks
        assert len(journal) > 0 and len(logged) > 0
        assert [json.loads(b) for b in bodies] == [{"error": "Unauthorized"}]  # the engine's
    finally:
        for s in sims:
            s.kill()


async def test_a_continuation_carries_the_engines_key_not_the_clients() -> None:
    """A stream cut by its engine's crash goes on elsewhere as the router's own request: with
    the key the push gave for that engine. The client's key is taken by the engine it began
    on, and refused by the others once the stream has begun (their keys changed in place),
    so only the engine's key can carry the continuation."""
    from dataclasses import replace

    from fleetwarden.router import Router, RouterSettings
    from fleetwarden.router.pool import BackendFacts
    from fleetwarden.sim import FaultMode, Sim, SimConfig

    client_key = "sk-client-of-the-router"
    sims = [Sim(SimConfig(steps_per_s=40, api_keys=(KEY, client_key))) for _ in range(2)]
    router = Router([], RouterSettings(), health_managed=True)
    body = {"model": "tiny", "prompt": "tell me about engines", "max_tokens": 30,
            "stream": True}
    try:
        for sim in sims:
            await sim.start()
        router.set_serving_backends([s.url for s in sims],
                                    {s.url: BackendFacts(k, key=KEY) for k, s in enumerate(sims)})
        await router.start()
        assert KEY not in repr(router.backend_facts()) and KEY not in json.dumps(router.status())
        events: list[bytes] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http, \
                http.post(router.url + "/v1/completions", json=body,
                          headers=bearer(client_key)) as r:
            assert r.status == 200
            while event := await r.content.readuntil(b"\n\n"):
                events.append(event)
                if len(events) == 4:
                    holder = next(url for url, n in router.in_flight().items() if n)
                    for sim in sims:
                        if sim.url != holder:
                            sim.config = replace(sim.config, api_keys=(KEY,))
                    await next(s for s in sims if s.url == holder).set_fault(FaultMode.CRASH)
        text = b"".join(events)
        print(f"{len(events)} events; continuations {dict(router.stats.continuations)}")
        assert events[-1] == b"data: [DONE]\n\n" and b'"error"' not in text, text[-400:]
        assert sum(router.stats.continuations.values()) == 1
    finally:
        await router.stop()
        for sim in sims:
            await sim.stop()


async def test_a_keyed_llamacpp_engine_is_read_with_its_key_and_never_failed_without(
        spawn: Callable[..., SimProcess]) -> None:
    """llama-server's --api-key guards /metrics too (its public paths are /health, /models
    and their /v1 forms): without the key the watchdog reads no metrics and its canary is
    refused, which fails nothing; with it, it reads the engine as any other."""
    from fleetwarden.credentials import Secret

    sim = spawn("--engine", "llamacpp", "--steps-per-s", "40", "--api-key", KEY)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for path, want in (("/health", 200), ("/v1/models", 200), ("/metrics", 401),
                           ("/slots", 401)):
            async with http.get(sim.url + path) as r:
                assert r.status == want, path
        for headers in (bearer(KEY), {"Authorization": KEY}, {"X-Api-Key": KEY}):
            async with http.get(sim.url + "/metrics", headers=headers) as r:
                assert r.status == 200, headers
    policy = DEFAULT_POLICY.__class__(canary_interval_s=0.0, canary_timeout_s=2.0)
    async with Watchdog(policy) as bare, \
            Watchdog(policy, key_of=lambda _url: Secret(KEY)) as keyed:
        without = [await bare.probe(Target(sim.url, engine="llamacpp")) for _ in range(3)]
        with_key = [await keyed.probe(Target(sim.url, engine="llamacpp")) for _ in range(3)]
    print(f"without the key: {[(r.verdict.value, r.health.value) for r in without]}; "
          f"with it: {[(r.verdict.value, r.health.value) for r in with_key]}")
    assert all(r.health is Health.UNPROVEN for r in without), without
    assert any("GET /metrics answered 401" in f for f in without[-1].faults)
    assert all(r.sample is not None and not r.faults for r in with_key), with_key
    assert with_key[-1].health is Health.PROVEN


def keyed_sims(tmp_path: Path, flags: str = "") -> tuple[Path, str]:
    """The engines' key file (0600) and a command launching a simulator that reads its
    ``--api-key`` from it, with ``flags``."""
    key_file = tmp_path / "engine.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    return key_file, (f"sh -c 'exec {{python}} -m fleetwarden sim --host {{host}} --port "
                      f"{{port}} --steps-per-s 40 {flags} --api-key \"$(cat {key_file})\"'")


async def test_launched_keyed_engines_restart_after_a_crash_and_a_wedge_is_still_condemned(
        tmp_path: Path) -> None:
    """Engines launched with --api-key, their command reading the key from the same file as
    fleetwarden: a crashed one is restarted and serves again (keyed load through it); then a
    wedge of the other under keyed load is condemned, as without keys. The key is in no
    engine's log line of its command."""
    from fleetwarden.testing.load import Load
    from support.fleet import served_ids, sim_stats, wedge_when_busy

    key_file, cmd = keyed_sims(tmp_path)
    async with running_fleet(tmp_path, fleet={"engines": 2, "engine_cmd": cmd,
                                              "api_key_file": str(key_file)}) as fleet:
        seen = record_transitions(fleet)
        old_url = fleet.ledger.shard(0).base_url
        async with Load(fleet.router_url, concurrency=4, max_tokens=24, api_key=KEY) as load:
            await until(lambda: len(load.results) >= 8, what="keyed load flowing")
            await fleet.inject_fault(0, "crash", {})
            await until(lambda: any(t.shard == 0 and t.to_state is ShardState.DEAD
                                    for t in seen), what="shard 0 condemned")
            await until(lambda: fleet.ledger.state(0) is ShardState.HEALTHY
                        and fleet.ledger.shard(0).base_url != old_url, timeout=60,
                        what="shard 0 back")
            new_url = fleet.ledger.shard(0).base_url
            await until(lambda: fleet.router.in_flight().get(new_url, 0) >= 1
                        or fleet.router.stats.responses.get(200, 0) > 40,
                        what="the restarted engine serving")
            wedged_at = await wedge_when_busy(fleet, 1)
            await until(lambda: any(t.shard == 1 and t.to_state is ShardState.DEAD
                                    for t in seen), timeout=30, what="shard 1 condemned")
            condemned = next(t for t in seen if t.shard == 1 and t.to_state is ShardState.DEAD)
            after_s = time.monotonic() - wedged_at
            served = len(served_ids(await sim_stats(new_url)))
        print(f"keyed load: {load.summary()}; the restarted shard 0 got {served} of its "
              f"requests; the wedge condemned within {after_s:.1f} s: {condemned.cause}")
        assert served >= 1, "the restarted engine got none of the load"
        assert not [r for r in load.results if r.status in (401, 403)], "a key was refused"
        assert fleet.ledger.shard(0).restart_attempts == 1
    logs = b"".join(p.read_bytes() for p in (tmp_path / "logs").glob("*.log"))
    assert b"--api-key" in logs and KEY.encode() not in logs


async def test_the_weight_api_and_sleep_are_called_with_each_engines_key(
        tmp_path: Path) -> None:
    """Engines whose RL and sleep endpoints want the key (``--guard-dev-api``: a proxy in front
    of vLLM, which leaves them open): a load fleetwarden runs (pause, reload, stamp, resume,
    then each engine's word on its version) and a sleep bracket succeed on every engine, so
    each of those calls carried the engine's key; the same calls without it are refused."""
    (tmp_path / "ckpt-1").write_text("weights after step 1\n")
    key_file, cmd = keyed_sims(tmp_path, "--guard-dev-api")
    async with running_fleet(tmp_path, fleet={"engines": 2, "engine_cmd": cmd,
                                              "weights": "trainer",
                                              "api_key_file": str(key_file)}) as fleet, \
            aiohttp.ClientSession() as http:
        done = await fleet.refit_from(str(tmp_path / "ckpt-1"), 1)
        assert done.credited == [0, 1] and all(e.confirmed for e in done.engines), \
            done.to_dict()
        slept = await fleet.sleep(1, None)
        assert [(r.state, r.error) for r in slept] == [("SLEEPING", "")] * 2, slept
        woke = await fleet.wake(None)
        assert [r.error for r in woke] == ["", ""] and "SLEEPING" not in {
            r.state for r in woke}, woke
        url = fleet.ledger.shard(0).base_url
        for path in ("/weight_info", "/is_sleeping"):
            async with http.get(url + path) as r:
                assert r.status == 401, path  # the guard is on: without the key, refused
            async with http.get(url + path, headers={"Authorization": f"Bearer {KEY}"}) as r:
                assert r.status == 200, path
        async with http.get(url + "/weight_info",
                            headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert (await r.json())["weight_version"] == "1"


async def test_check_names_the_missing_key_and_judges_with_the_key(
        spawn: Callable[..., SimProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """``fleetwarden check`` on a keyed engine: without the key it cannot judge (exit 3: its
    canary proves nothing) and names the fault; with ``--api-key-env`` it is healthy."""
    from support.sim import run_check

    sim = spawn("--api-key", KEY)
    code, report = await run_check(sim.url)
    assert code == 3 and any("401" in f for f in report["faults"]), report
    monkeypatch.setenv("FLEETWARDEN_TEST_ENGINE_KEY", KEY)  # the check process inherits it
    code, report = await run_check(sim.url, "--api-key-env", "FLEETWARDEN_TEST_ENGINE_KEY")
    print(f"with the key: exit {code}, {report['verdict']}")
    assert (code, report["verdict"], report["faults"]) == (0, "idle", [])
