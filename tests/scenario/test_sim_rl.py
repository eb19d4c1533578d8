"""The simulated engine serves vLLM 0.32's RL API as its source reads (docs/rl.md): pause modes,
weight versions, per-request version spans, checksums that change with the weights, and a
reload from a path whose bytes change the answers.

In-process simulators (the class `fleetwarden sim` runs); every wait is bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleetwarden.sim import FaultMode, Sim, SimConfig

pytestmark = pytest.mark.scenario

PROMPT = [256, 300, 301, 302]


@pytest.fixture
async def sim() -> AsyncIterator[Sim]:
    async with Sim(SimConfig(slots=4, steps_per_s=100)) as s:
        yield s


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as h:
        yield h


async def call(http: aiohttp.ClientSession, method: str, url: str,
               body: Any = None) -> tuple[int, Any]:
    async with http.request(method, url, json=body) as r:
        return r.status, await r.json(content_type=None)


async def generate(http: aiohttp.ClientSession, sim: Sim, max_tokens: int = 8,
                   ) -> dict[str, Any]:
    status, body = await call(http, "POST", sim.url + "/inference/v1/generate",
                              {"token_ids": PROMPT, "sampling_params": {
                                  "max_tokens": max_tokens, "temperature": 0}})
    assert status == 200, body
    result: dict[str, Any] = body
    return result


def checkpoint(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.write_text(f"weights of {name}\n")
    return str(path)


async def test_weight_version_and_checksums_change_with_a_reload(
        sim: Sim, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    assert await call(http, "GET", sim.url + "/weight_info") == (
        200, {"weight_version": "default"})
    _, before = await call(http, "POST", sim.url + "/weight_checker", {"action": "checksum"})
    base = (await generate(http, sim))["choices"][0]["token_ids"]

    reload = {"method": "reload_weights", "kwargs": {"weights_path": checkpoint(tmp_path, "a")}}
    assert await call(http, "POST", sim.url + "/collective_rpc", reload) == (
        200, {"results": [None]})
    assert await call(http, "POST", sim.url + "/update_weight_version",
                      {"new_version": "1"}) == (200, {"success": True, "new_version": "1"})
    assert await call(http, "GET", sim.url + "/weight_info") == (200, {"weight_version": "1"})

    _, after = await call(http, "POST", sim.url + "/weight_checker", {"action": "checksum"})
    assert set(after["checksums"]) == set(before["checksums"])
    assert after["checksums"] != before["checksums"]
    status, compared = await call(http, "POST", sim.url + "/weight_checker",
                                  {"action": "compare", "baseline": before["checksums"]})
    assert status == 200 and compared["match"] is False
    assert compared["mismatches"] == sorted(before["checksums"])
    assert (await call(http, "POST", sim.url + "/weight_checker",
                       {"action": "compare", "baseline": after["checksums"]}))[1] == {
        "match": True, "mismatches": []}
    status, refused = await call(http, "POST", sim.url + "/weight_checker",
                                 {"action": "compare"})
    assert status == 400 and "baseline" in refused["error"]["message"]

    answer = await generate(http, sim)
    choice = answer["choices"][0]
    assert choice["token_ids"] != base  # the checkpoint changed the greedy answer
    assert choice["weight_versions"] == [{"version": "1", "start": 0, "end": 8}]
    assert answer["output_mode"] == "tokens"

    # The same checkpoint again answers the same: the answer is a function of the bytes.
    await call(http, "POST", sim.url + "/collective_rpc", reload)
    assert (await generate(http, sim))["choices"][0]["token_ids"] == choice["token_ids"]


async def test_a_bad_path_fails_the_reload_and_keeps_the_weights(
        sim: Sim, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    _, before = await call(http, "POST", sim.url + "/weight_checker", {"action": "checksum"})
    status, body = await call(http, "POST", sim.url + "/collective_rpc", {
        "method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "missing")}})
    assert status == 500 and "missing" in body["error"]["message"]
    assert (await call(http, "POST", sim.url + "/weight_checker",
                       {"action": "checksum"}))[1] == before
    assert (await call(http, "POST", sim.url + "/collective_rpc", {}))[0] == 400
    status, body = await call(http, "POST", sim.url + "/pause?mode=later")
    assert status == 400 and body["error"]["param"] == "mode"


async def test_keep_freezes_requests_and_labels_each_span(
        sim: Sim, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    """A request kept across a reload: its first tokens are the old weights', the rest the
    new ones', and its spans say where the label changed."""
    await call(http, "POST", sim.url + "/update_weight_version", {"new_version": "1"})
    running = asyncio.ensure_future(generate(http, sim, max_tokens=40))
    await until_tokens(sim, 5)
    assert await call(http, "POST", sim.url + "/pause?mode=keep") == (200, {"status": "paused"})
    assert await call(http, "GET", sim.url + "/is_paused") == (200, {"is_paused": True})
    frozen = sim.stats()["engine"]["steps"]
    held = asyncio.ensure_future(generate(http, sim, max_tokens=4))  # sent while paused
    await call(http, "POST", sim.url + "/collective_rpc", {
        "method": "reload_weights", "kwargs": {"weights_path": checkpoint(tmp_path, "b")}})
    await call(http, "POST", sim.url + "/update_weight_version", {"new_version": "2"})
    assert sim.stats()["engine"]["steps"] == frozen and not running.done() and not held.done()
    assert await call(http, "POST", sim.url + "/resume") == (200, {"status": "resumed"})

    spans = (await running)["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == ["1", "2"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] >= 5
    assert spans[1]["end"] == 40
    assert (await held)["choices"][0]["weight_versions"] == [
        {"version": "2", "start": 0, "end": 4}]


async def test_abort_ends_requests_and_wait_lets_them_finish(
        sim: Sim, http: aiohttp.ClientSession) -> None:
    running = asyncio.ensure_future(generate(http, sim, max_tokens=60))
    await until_tokens(sim, 3)
    assert (await call(http, "POST", sim.url + "/pause?mode=abort"))[0] == 200
    choice = (await running)["choices"][0]
    assert choice["finish_reason"] == "abort" and 3 <= len(choice["token_ids"]) < 60
    await call(http, "POST", sim.url + "/resume")

    running = asyncio.ensure_future(generate(http, sim, max_tokens=30))
    await until_tokens(sim, 3)
    assert (await call(http, "POST", sim.url + "/pause?mode=wait"))[0] == 200
    assert running.done()  # the pause returned once it had finished
    choice = (await running)["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 30
    await call(http, "POST", sim.url + "/resume")


async def test_a_restart_loads_the_base_weights_and_a_slow_load_takes_its_time(
        sim: Sim, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    base = (await generate(http, sim))["choices"][0]["token_ids"]
    await sim.set_fault(FaultMode.SLOW_LOAD, factor=0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await call(http, "POST", sim.url + "/collective_rpc", {
        "method": "reload_weights", "kwargs": {"weights_path": checkpoint(tmp_path, "c")}})
    assert loop.time() - started >= 0.3
    await call(http, "POST", sim.url + "/update_weight_version", {"new_version": "3"})
    assert (await generate(http, sim))["choices"][0]["token_ids"] != base
    await sim.set_fault(FaultMode.RESTART)
    assert await call(http, "GET", sim.url + "/weight_info") == (
        200, {"weight_version": "default"})
    assert (await generate(http, sim))["choices"][0]["token_ids"] == base


async def until_tokens(sim: Sim, n: int) -> None:
    """Until some request in the engine has ``n`` output tokens (bounded: 10 s)."""
    for _ in range(1000):
        core = sim._core
        if any(len(r.output) >= n for r in core.running):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no request reached {n} tokens")


async def test_calls_into_a_wedged_engine_core_wait_for_it(
        sim: Sim, http: aiohttp.ClientSession) -> None:
    """A wedge stops the EngineCore (as SIGSTOP does): vLLM's RL calls are RPCs into it, so
    they go unanswered until it runs again, while /health still answers."""
    await sim.set_fault(FaultMode.WEDGE)
    info = asyncio.ensure_future(call(http, "GET", sim.url + "/weight_info"))
    async with http.get(sim.url + "/health") as r:
        assert r.status == 200
    done, _ = await asyncio.wait({info}, timeout=0.3)
    assert not done
    await sim.set_fault(None)
    assert await info == (200, {"weight_version": "default"})
