"""An engine's server cap on every request's output, learnt where the engine says it: vLLM's
dev-mode ``GET /server_info`` (``VLLM_SERVER_DEV_MODE=1``), read by the watchdog once per
process with the engine's key, never on a request's path; and `fleetwarden check` saying it,
or that it is unknown (docs/design.md 4.1, "Server caps")."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from fleetwarden.credentials import Secret
from fleetwarden.engines import CapUnknown
from fleetwarden.judge import Target
from fleetwarden.sim import Sim, SimConfig
from fleetwarden.sim.config import FaultMode
from fleetwarden.watchdog import Watchdog
from support.sim import run_check

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
            assert isinstance(wd.output_cap(dev.url), CapUnknown)  # not read yet
            for _ in range(3):
                await wd.round(targets)
            assert wd.output_cap(dev.url) == 48
            said = wd.output_cap(plain.url)
            assert isinstance(said, CapUnknown) and said.settled
            assert "VLLM_SERVER_DEV_MODE=1" in said.why
            # once per process, not per read (the test's own GET above was the first)
            paths = dev.stats()["by_path"]
            assert paths.get("/server_info") == 2, paths
            assert plain.stats()["by_path"].get("/server_info") == 2
            await dev.set_fault(FaultMode.RESTART)  # a new process: asked again
            for _ in range(3):
                await wd.round(targets)
            assert dev.stats()["by_path"].get("/server_info") == 3
            assert wd.output_cap(dev.url) == 48
        async with Watchdog() as keyless:  # the key is what lets it read
            await keyless.round([targets[0]])
            said = keyless.output_cap(dev.url)
            assert isinstance(said, CapUnknown) and "401" in said.why


async def test_check_says_the_cap_or_that_it_is_unknown() -> None:
    async with sims(SimConfig(port=0, override_max_new_tokens=48, dev_mode=True),
                    SimConfig(port=0, override_max_new_tokens=48)) as (dev, plain):
        code, report = await run_check(dev.url, "--engine", "vllm")
        assert (code, report["output_cap"], report["output_cap_unknown"]) == (0, 48, None)
        code, report = await run_check(plain.url, "--engine", "vllm")
        assert code == 0 and report["output_cap"] is None
        assert "VLLM_SERVER_DEV_MODE=1" in report["output_cap_unknown"]
