"""An engine's server cap on every request's output, learnt where the engine says it: vLLM's
dev-mode ``GET /server_info`` (``VLLM_SERVER_DEV_MODE=1``), read by the watchdog once per
process with the engine's key, never on a request's path; and `fleetwarden check` saying it,
or that it is unknown (docs/design.md 4.1, "Server caps")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from fleetwarden.admin import views
from fleetwarden.credentials import Secret
from fleetwarden.engines import CapUnknown
from fleetwarden.judge import Target
from fleetwarden.router import Router
from fleetwarden.sim import Sim, SimConfig
from fleetwarden.sim.config import FaultMode
from fleetwarden.watchdog import Watchdog
from support.fleet import running_fleet
from support.sim import CHECK_FAST, SimProcess, run_check
from support.wait import until

pytestmark = pytest.mark.scenario

KEY = "engine-key"


@contextlib.asynccontextmanager
async def sims(*configs: SimConfig) -> AsyncIterator[list[Sim]]:
    started = [Sim(c) for c in configs]
    try:
        for sim in started:
            await sim.start()
        yield started
    finally:
        for sim in started:
            await sim.stop()


async def test_the_watchdog_learns_the_cap_from_server_info_once_per_process() -> None:
    # dev mode, its dev endpoints behind the key (as a proxy that wants it everywhere); and
    # one outside dev mode, which vLLM answers 404 there
    async with sims(SimConfig(port=0, override_max_new_tokens=48, dev_mode=True,
                              api_keys=(KEY,), guard_dev_api=True),
                    SimConfig(port=0, override_max_new_tokens=48)) as (dev, plain):
        async with aiohttp.ClientSession() as http:
            async with http.get(plain.url + "/server_info?config_format=json") as r:
                assert r.status == 404  # absent outside dev mode, as vLLM
            async with http.get(dev.url + "/server_info?config_format=json",
                                headers={"Authorization": f"Bearer {KEY}"}) as r:
                model = (await r.json())["vllm_config"]["model_config"]
            assert (model["generation_config"], model["override_generation_config"]) == (
                "auto", {"max_new_tokens": 48})
        targets = [Target(dev.url, engine="vllm"), Target(plain.url, engine="vllm")]
        async with Watchdog(key_of=lambda url: Secret(KEY) if url == dev.url else None) as wd:
            assert isinstance(wd.output_cap(dev.url, None), CapUnknown)  # not read yet
            for _ in range(3):
                reports = await wd.round(targets)
            old = reports[dev.url].incarnation
            assert old is not None and wd.output_cap(dev.url, old) == 48
            said = wd.output_cap(plain.url, reports[plain.url].incarnation)
            assert isinstance(said, CapUnknown) and said.settled
            assert "VLLM_SERVER_DEV_MODE=1" in said.why
            # once per process, not per read (the test's own GET above was the first)
            paths = dev.stats()["by_path"]
            assert paths.get("/server_info") == 2, paths
            assert plain.stats()["by_path"].get("/server_info") == 2
            await dev.set_fault(FaultMode.RESTART)  # a new process: asked again
            for _ in range(3):
                reports = await wd.round(targets)
            assert dev.stats()["by_path"].get("/server_info") == 3
            new = reports[dev.url].incarnation
            assert new != old and wd.output_cap(dev.url, new) == 48
            # the old process's word is not the new one's, nor the other way round
            said = wd.output_cap(dev.url, old)
            assert isinstance(said, CapUnknown) and not said.settled
        async with Watchdog() as keyless:  # the key is what lets it read
            read = await keyless.round([targets[0]])
            said = keyless.output_cap(dev.url, read[dev.url].incarnation)
            assert isinstance(said, CapUnknown) and "401" in said.why


async def test_check_says_the_cap_or_that_it_is_unknown() -> None:
    """And the default limit of a chat that names none, from the same answer (the override
    is that default too)."""
    async with sims(SimConfig(port=0, override_max_new_tokens=48, dev_mode=True),
                    SimConfig(port=0, override_max_new_tokens=48)) as (dev, plain):
        code, report = await run_check(dev.url, "--engine", "vllm")
        assert (code, report["output_cap"], report["output_cap_unknown"]) == (0, 48, None)
        assert (report["output_default"], report["output_default_unknown"]) == (48, None)
        code, report = await run_check(plain.url, "--engine", "vllm")
        assert code == 0 and report["output_cap"] is None
        assert "VLLM_SERVER_DEV_MODE=1" in report["output_cap_unknown"]
        assert report["output_default"] is None
        assert "VLLM_SERVER_DEV_MODE=1" in report["output_default_unknown"]
        proc = await asyncio.create_subprocess_exec(  # in words, as an operator reads it
            sys.executable, "-m", "fleetwarden", "check", plain.url, *CHECK_FAST,
            stdout=asyncio.subprocess.PIPE, env={**os.environ, "COLUMNS": "200"})
        words = (await asyncio.wait_for(proc.communicate(), 60))[0].decode()
        assert "output cap: unknown (no GET /server_info" in words, words
        assert "declare output_cap on its [[fleet.backends]] table)" in words, words
        assert "output default: unknown (no GET /server_info" in words, words
        assert "declare output_default on its [[fleet.backends]] table)" in words, words
    async with sims(SimConfig(port=0, engine="llamacpp")) as (llama,):
        code, report = await run_check(llama.url, "--engine", "llamacpp")
        assert (code, report["output_cap_unknown"]) == (0, "a llamacpp engine shows no "
                                                            "server cap")
        # nor its default (-n): a launched one's command, or a declaration, says it
        assert report["output_default_unknown"] == "a llamacpp engine shows no default limit"
        assert "/server_info" not in llama.stats()["by_path"]  # not asked: it has none


async def test_a_fleet_pushes_each_attached_engines_cap_and_shows_the_unknown_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Three attached engines capped at 24: one in vLLM's dev mode (its /server_info says
    it), one declared on its [[fleet.backends]] table, one that says nothing. The routers get
    the first two; the third is unknown: one warning, its status row, the status count, and
    the push says so. A chat's default unknown (the declared one declares only its cap) is
    shown and counted as the cap is."""
    caplog.set_level(logging.WARNING, logger="fleetwarden.pushes")
    cap = ["--override-generation-config", '{"max_new_tokens": 24}']
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # read by `fleetwarden sim`, as by vLLM
    dev = SimProcess(*cap)
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE")
    declared, silent = SimProcess(*cap), SimProcess(*cap)
    sims = (dev, declared, silent)
    try:
        backends = [dev.url, {"url": declared.url, "output_cap": 24}, silent.url]
        async with running_fleet(tmp_path, fleet={"engines": 0, "backends": backends}) as fleet:

            def caps() -> list[tuple[object, object]]:
                return [(s["output_cap"], s["output_cap_from"])
                        for s in views.shards_view(fleet.snapshot())]

            def defaults() -> list[tuple[object, object]]:
                return [(s["output_default"], s["output_default_unknown"])
                        for s in views.shards_view(fleet.snapshot())]

            # the declared one's /server_info is asked too (its default is not declared): read
            # apart from the silent one's, it may come a round later
            await until(lambda: caps()[0] == (24, "engine") and caps()[2][1] != (
                "unknown: its /server_info not read yet") and all(
                    d[1] != "its /server_info not read yet" for d in defaults()), timeout=20,
                what="the dev-mode engine's cap read and the others asked")
            got = caps()
            print(f"\ncaps on the status rows: {got}")
            assert got[:2] == [(24, "engine"), (24, "declared")]
            assert got[2][0] is None and "VLLM_SERVER_DEV_MODE=1" in str(got[2][1])
            assert views.status_view(fleet.snapshot())["output_caps_unknown"] == 1
            said = defaults()
            print(f"defaults on the status rows: {said}")
            assert said[0] == (24, None)  # the override is a chat's default too
            assert [d[0] for d in said[1:]] == [None, None]
            assert all("VLLM_SERVER_DEV_MODE=1" in str(d[1]) for d in said[1:])
            assert views.status_view(fleet.snapshot())["output_defaults_unknown"] == 2
            router = fleet.router
            assert isinstance(router, Router)  # workers = 0: the router in the fleet's process
            await until(lambda: [router.pool.facts(s.url).output_cap for s in sims]
                        == [24, 24, None], timeout=10, what="the caps pushed")
            # and the third's as unknown, with why: continuations there go only as far as
            # its floor proves
            unknown = [router.pool.facts(s.url).output_cap_unknown for s in sims]
            assert unknown[:2] == [None, None] and "VLLM_SERVER_DEV_MODE=1" in str(unknown[2])
        told = [r.getMessage() for r in caplog.records if "server cap" in r.getMessage()]
        assert len(told) == 1 and silent.url in told[0], told
    finally:
        for s in sims:
            s.kill()
