"""Trace replay on simulated engines: the schedule kept, the prompts as the trace says, and every
fault's post-check passing where the fault happened and failing where it was aimed at nothing.

The bench (``bench/replay.py``) drives its traces through AIPerf; these tests drive a short
trace through this project's own driver (``fleetwarden.testing.replay``), since AIPerf's
install (about 1.2 GB in its own environment) is too heavy for the suite to pay for.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from fleetwarden.testing.replay import (
    FAULTS,
    POST_CHECK_ID_PREFIX,
    ROUTER_FAULTS,
    Counters,
    Fault,
    RouterFault,
    Target,
    Wedge,
    decoys,
    replay,
)
from fleetwarden.testing.traces import TraceShape, generate, reuse_ratio
from fleetwarden.testing.up import UpProcess
from support.sim import SimProcess, free_port

pytestmark = pytest.mark.scenario

#: A short trace: about 6 s of arrivals, sessions and shared prefixes as the bench's, shorter
#: answers so that it ends in seconds on 2 cores.
SHORT = TraceShape(requests=40, rate_per_s=7.0, output_mean=12.0, output_max=40,
                   think_mean_s=1.0, input_mean=400.0, input_max=1500)


async def test_a_trace_is_replayed_at_its_schedule_with_its_prompts(
        spawn: Callable[..., SimProcess]) -> None:
    records = generate(SHORT, seed=5)
    sim = spawn("--steps-per-s", "100", "--slots", "16")
    results = await replay(records, sim.url, block_tokens=SHORT.block_tokens)
    late = [r.sent_s - r.scheduled_s for r in results]
    print(f"\n{len(results)} requests over {records[-1].timestamp / 1000:.1f} s; sent late by "
          f"median {statistics.median(late) * 1000:.1f} ms, most {max(late) * 1000:.1f} ms; "
          f"reuse ratio {reuse_ratio(records):.2f}")
    assert [r.index for r in results] == list(range(len(records)))
    assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
    # Open loop: each request left at its own timestamp (never before it), not after the
    # previous one's answer; the lateness bound is loose (a loaded 2-core machine).
    assert min(late) >= 0 and statistics.median(late) < 0.25, late
    # The engine saw every prompt at the trace's length (its tokenizer: one token per
    # character, plus BOS), so lengths and shared prefixes reached it as the trace says.
    async with aiohttp.ClientSession() as http:
        async with http.get(sim.url + "/sim/requests") as resp:
            seen = await resp.json()
        counters = Counters([sim.url])
        await counters.read(http, 0.0)
    assert sorted(r["prompt_tokens"] for r in seen) == sorted(
        r.input_length + 1 for r in records)
    # Shared prefixes are found in the engine's prefix cache: its own counters say so.
    queries, hits = counters.totals()
    assert queries == sum(r.input_length + 1 for r in records)
    assert hits / queries > 0.2, (hits, queries)


def _engines(spawn: Callable[..., SimProcess], n: int) -> tuple[list[SimProcess], list[Target]]:
    sims = [spawn("--steps-per-s", "50") for _ in range(n)]
    return sims, [Target(s.url, s.pid) for s in sims]


async def _warm(targets: list[Target]) -> None:
    """One answered request on each engine, so that a wedge has something it stops."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for t in targets:
            async with http.post(t.url + "/v1/completions", json={
                    "model": "tiny", "prompt": "warm", "max_tokens": 1}) as resp:
                assert resp.status == 200


#: Each engine fault, short: what the bench runs for tens of seconds lasts about one here.
SHORT_FAULTS: dict[str, Callable[[], Fault]] = {
    "crash": FAULTS["crash"], "wedge": FAULTS["wedge"], "sigstop": FAULTS["sigstop"],
    "tcp-reset": lambda: FAULTS["tcp-reset"](duration_s=5.0),  # type: ignore[call-arg]
    "blackhole": lambda: FAULTS["blackhole"](probe_s=1.0),  # type: ignore[call-arg]
    "slow-drain": lambda: FAULTS["slow-drain"](duration_s=1.5),  # type: ignore[call-arg]
    "rolling-restart": lambda: FAULTS["rolling-restart"](gap_s=0.2),  # type: ignore[call-arg]
    "mixed": lambda: FAULTS["mixed"](gap_s=0.2),  # type: ignore[call-arg]
}


async def _traffic(targets: list[Target], inject: Callable[[], object]) -> None:
    """Requests on every engine across the injection, as a replay's are: one in flight
    before it (a drain finishes it), a few after (a reset or a black hole takes them).
    Their answers do not matter here: the post-check reads the engines."""
    async def one(url: str, max_tokens: int) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as h, \
                    h.post(url + "/v1/completions", json={
                        "model": "tiny", "prompt": "traffic", "max_tokens": max_tokens}) as r:
                await r.read()

    before = [asyncio.create_task(one(t.url, 30)) for t in targets]
    await asyncio.sleep(0.2)  # in flight
    await inject()  # type: ignore[misc]
    await asyncio.sleep(0.3)  # a crash's exit, a drain's closed socket
    await asyncio.gather(*before, *(one(t.url, 2) for t in targets for _ in range(4)))


async def test_a_post_checks_own_requests_are_named_so_that_the_engines_log_leaves_them_out(
        spawn: Callable[..., SimProcess]) -> None:
    """Before: the wedge's post-check sent the engine a completion with no id, and the bench
    counted it as the router's last request to the wedged engine (+36.7 s after the fault,
    30 s after fleetwarden had condemned it)."""
    _, [engine] = _engines(spawn, 1)
    await Wedge(index=0).verify([engine])  # not wedged: it answers, all this needs
    async with aiohttp.ClientSession() as http, http.get(engine.url + "/sim/stats") as resp:
        log = (await resp.json())["log"]
    sent = [e.get("request_id") or "" for e in log if e["path"] == "/v1/completions"]
    assert sent and all(rid.startswith(POST_CHECK_ID_PREFIX) for rid in sent), sent


def test_every_fault_of_the_bench_has_a_short_form_here() -> None:
    assert set(SHORT_FAULTS) | ROUTER_FAULTS == set(FAULTS)


@pytest.mark.parametrize("name", sorted(SHORT_FAULTS))
async def test_each_fault_is_proved_by_its_post_check_and_a_control_aimed_at_nothing_fails_it(
        spawn: Callable[..., SimProcess], name: str) -> None:
    fault = SHORT_FAULTS[name]()
    sims, engines = _engines(spawn, 4 if name == "mixed" else 2)
    await _warm(engines)
    picked = fault.picks(engines)
    fakes, decoy = decoys(len(picked))
    started = time.monotonic()
    try:
        # The control first: the same injection aimed at nothing, then the same post-check
        # on the engines it should have hit. Its signature must be missing.
        await fault.before(engines)
        await _traffic(engines, lambda: fault.inject(fakes))
        missing = await fault.verify(engines)
        print(f"\n{name} aimed at nothing: {missing}")
        assert missing, f"{name}: the post-check passed with the fault aimed at nothing"
        assert all(s.proc.poll() is None for s in sims)
        # Now for real: the signature is there.
        await fault.before(engines)
        await _traffic(engines, lambda: fault.inject(picked))
        missing = await fault.verify(engines)
        print(f"{name} aimed at the engines: {missing or 'every signature found'} "
              f"({time.monotonic() - started:.1f} s)")
        assert missing == []
    finally:
        await fault.undo(engines)
        decoy.kill()
        decoy.wait()


async def test_fleetwardens_own_faults_are_proved_by_the_kernel_and_fail_aimed_at_nothing(
        spawn: Callable[..., SimProcess], tmp_path: Path) -> None:
    """A reload (SIGHUP), a SIGKILL of the router process, and a SIGKILL of `fleetwarden up`
    then its restart, on one fleet in front of one engine: each control first (aimed at a
    process that is no fleetwarden), then each for real, the controller's kill last."""
    sim = spawn("--steps-per-s", "50")
    port = free_port()
    up = UpProcess(tmp_path, "--backend", sim.url, "--port", str(port), "--router-workers",
                   "1", drain=True)
    started = time.monotonic()
    restarted: list[subprocess.Popen[str]] = []

    def spawn_up(argv: list[str], cwd: str | None) -> subprocess.Popen[str]:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        restarted.append(proc)
        return proc

    faults: list[RouterFault] = []
    for name in ("reload", "router-kill", "fleetwarden-kill"):
        fault = FAULTS[name]()
        assert isinstance(fault, RouterFault)
        fault.bind(up.router, up.proc, spawn_up)
        faults.append(fault)
    fakes, decoy = decoys(1)
    try:
        for fault in faults:
            await fault.before([])
            if hasattr(fault, "wait_s"):
                fault.wait_s = 1.0  # a control's signature never comes: do not wait long
            await fault.inject(fakes[:1] if fault.name != "router-kill" else [
                Target(fakes[0].url, decoy.pid)])
            missing = await fault.verify([])
            print(f"\n{fault.name} aimed at nothing: {missing}")
            assert missing, f"{fault.name}: the post-check passed aimed at nothing"
            assert up.running
        for fault in faults:
            await fault.before([])
            if hasattr(fault, "wait_s"):
                fault.wait_s = 60.0
            await fault.inject(fault.picks([]))
            missing = await fault.verify([])
            print(f"{fault.name} aimed at fleetwarden: {missing or 'every signature found'} "
                  f"({time.monotonic() - started:.1f} s)")
            assert missing == []
        # Through it all the router serves: a request after the restart is answered.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http, \
                http.post(up.router + "/v1/completions", json={
                    "model": "tiny", "prompt": "after", "max_tokens": 2}) as resp:
            assert resp.status == 200
    finally:
        for fault in faults:
            await fault.undo([])
        for proc in restarted:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.terminate()
                proc.wait(30)
        if up.running:
            up.stop()
        decoy.kill()
        decoy.wait()
        print(f"fleetwarden's own faults: {time.monotonic() - started:.1f} s")
