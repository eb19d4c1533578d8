"""Fault scenarios on a running fleet, with the figures each one prints: what the real-vLLM
tier asserts on and `bench/engine_scenarios.py` records, on real and simulated engines alike.

Owns: fault scenarios on a running fleet and the figures each prints.
Must not: assert timings: figures are printed, not asserted.

Each scenario drives load through the fleet's router with the official ``openai`` client,
injects one fault with ``fleetwarden chaos`` (the CLI, as an operator would: on a real local
engine a signal to its ``VLLM::EngineCore``, on a simulated one its fault endpoint), and waits
until the shard is quarantined and serving again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from fleetwarden.testing.load import Load
from fleetwarden.testing.up import UpProcess

__all__ = ["Ejections", "Figures", "condemned_as_a_stopped_core", "crash_under_load",
           "engine_metric", "fleet_toml", "idle_wedge", "no_false_ejections",
           "sigstop_under_load", "until_restarted", "wedge_under_load",
           "wedge_while_running", "whole"]


def condemned_as_a_stopped_core(cause: str) -> bool:
    """A condemnation's cause is the evidence of a core that stopped under the requests it
    held: STUCK (its gauges show work, every counter flat); LOST_CORE (a wedge that froze its
    gauges at 0 running while the router held requests there); where its hedges won and took
    every request it held, the windows its lost races failed, confirmed by a canary it never
    answered (docs/design.md section 12); or, where rescues and hedges took every request
    before a read saw them held, the canary it then held for the stall floor with every counter
    flat (the same evidence with the canary in a client's place: ``judge.held_its_canary``).
    Not a streak of failed probes, not an exit."""
    return ("STUCK" in cause or "LOST_CORE" in cause
            or ("confirmed by a failed probe" in cause and "no answer" in cause)
            or ("held its canary" in cause and "advanced nothing" in cause))


@dataclass
class Figures:
    scenario: str
    engines: str
    detected_after_s: float | None = None
    cause: str = ""
    back_after_s: float | None = None
    rescued: int = 0
    #: Requests answered by a hedge (sent to another engine while the faulted one held them).
    hedged: int = 0
    retried: int = 0
    restarts: int = 0
    requests: int = 0
    client_errors: int = 0
    #: What each client error was: its status and the client's error (at most 300 chars).
    failures: list[str] = field(default_factory=list)
    #: The slowest request that was in flight when the fault struck, minus the median.
    extra_latency_s: float | None = None
    old_pid: int | None = None
    new_url: str = ""
    old_url: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def report(self, folder: Path) -> None:
        """Print the figures' line, and keep them in ``folder/.figures.jsonl`` (a tier's
        passes, for BENCHMARKS.md)."""
        print(f"\n{self.line()}")
        with (folder / ".figures.jsonl").open("a") as f:
            f.write(json.dumps(self.to_dict()) + "\n")

    def line(self) -> str:
        def s(x: float | None) -> str:
            return "—" if x is None else f"{x:.1f} s"

        return (f"{self.scenario} ({self.engines}): detected after {s(self.detected_after_s)} "
                f"[{self.cause[:70]}], serving again after {s(self.back_after_s)}; "
                f"{self.rescued} rescued, {self.hedged} answered by hedges, "
                f"{self.retried} retried, {self.restarts} restarts, "
                f"{self.client_errors} client errors of {self.requests} requests, "
                f"extra latency {s(self.extra_latency_s)}"
                + "".join(f"\n  failed: {f}" for f in self.failures))


def fleet_toml(engine_cmd: str, engine_env: dict[str, str], router_port: int,
               admin_port: int, *, engines: int = 2, startup_timeout_s: float = 180.0,
               stop_grace_s: float = 10.0, routing: str | None = None,
               api_key_env: str | None = None, api_key_file: str | None = None) -> str:
    """A fleet judged as a user's is: no ``[health]`` setting at all, so the tick, the stall
    limit and the canaries are the defaults. What is set is about the machine and the tier:
    ``startup_timeout_s`` and ``stop_grace_s`` (the caller's engines), the restart budget, and
    ``routing``, the router's policy (``None``: the default, as a user's fleet gets it).

    The budget: the default is 5 restarts per shard for the fleet's whole life, and one fleet
    serves a whole test module, which faults the same shard on purpose up to five times (a
    wedge, an idle wedge, and a cut stream tried up to three times). A sixth would retire it
    and fail the next test for a reason that is the tier's, not the judge's."""
    env = "\n".join(f'{k} = "{v}"' for k, v in engine_env.items())
    key = "" if api_key_env is None else f'api_key_env = "{api_key_env}"\n'
    policy = "" if routing is None else f'routing = "{routing}"\n'
    if api_key_file is not None:
        key += f'api_key_file = "{api_key_file}"\n'
    return f"""
[fleet]
engines = {engines}
engine_cmd = '''{engine_cmd}'''
startup_timeout_s = {startup_timeout_s}
{key}
[fleet.engine_env]
{env}

[router]
port = {router_port}
{policy}
[admin]
port = {admin_port}

[supervisor]
max_restart_attempts = 50
stop_grace_s = {stop_grace_s}
"""


def chaos(up: UpProcess, fault: str, shard: int) -> float:
    """``fleetwarden chaos FAULT SHARD``; returns when the fault landed (wall clock, as the
    CLI says it). Not when it was asked for: a figure counts the fleet's time from the fault,
    never the CLI's own start on a loaded machine."""
    out = subprocess.run(
        [sys.executable, "-m", "fleetwarden", "chaos", fault, str(shard), "--admin", up.admin,
         "--token-file", str(up.client_token_file)],
        capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"chaos {fault} {shard}: {out.stderr.strip()}")
    _, sep, landed = out.stdout.strip().rpartition(", at ")
    if not sep:
        raise RuntimeError(f"chaos {fault} {shard}: no landing time in {out.stdout!r}")
    return datetime.fromisoformat(landed).timestamp()


async def _state(up: UpProcess, shard: int) -> dict[str, Any]:
    shards = await asyncio.to_thread(up.client.shards)
    return shards[shard]


async def _until_state(up: UpProcess, shard: int, states: set[str], limit_s: float) -> float:
    start = time.monotonic()
    while (await _state(up, shard))["state"] not in states:
        if time.monotonic() - start > limit_s:
            raise AssertionError(f"shard {shard} not {states} within {limit_s} s")
        await asyncio.sleep(0.1)
    return time.monotonic() - start


async def _until_condemned(up: UpProcess, shard: int, since_wall: float,
                           limit_s: float) -> None:
    """Until the fleet's history shows ``shard`` condemned since ``since_wall``: a state polled
    can miss it, as a small engine is back (DEAD, RESTARTING, STALE, HEALTHY) within a second."""
    start = time.monotonic()
    while not any(t["shard"] == shard and t["to"] == "DEAD" and t["wall"] >= since_wall
                  for t in await asyncio.to_thread(up.client.transitions)):
        if time.monotonic() - start > limit_s:
            raise AssertionError(f"shard {shard} not condemned within {limit_s} s")
        await asyncio.sleep(0.1)


async def _router(up: UpProcess) -> dict[str, Any]:
    status = await asyncio.to_thread(up.client.status)
    router: dict[str, Any] = status["router"]
    return router


async def _fault_under(up: UpProcess, name: str, engines: str, shard: int, fault: str,
                       load: Load, then_route: bool = False) -> Figures:
    """Inject ``fault`` into ``shard`` while ``load`` runs (started by the caller, or by this
    function ``then_route``: an idle wedge found by the first routed requests); detect; let
    the load run on until what the fault held is answered and the engines left carry it
    (``Load.carried_on``, at most :data:`_AFTER_DETECTION_S`); stop it; wait for the
    replacement.
    ``fault`` is a ``fleetwarden chaos`` fault, or ``sigstop``: SIGSTOP to the engine's whole
    process group, sent from here (what stops a one-process engine, llama.cpp's, whole).

    The load stops before the replacement starts on purpose: on a 2-core machine a loaded
    surviving engine starves the new one's start-up, and the figure would be the machine's.
    """
    fig = Figures(name, engines)
    before = await _state(up, shard)
    fig.old_url, fig.old_pid = before["base_url"], before["pid"]
    router0 = await _router(up)
    struck, struck_wall = time.monotonic(), time.time()
    if fault == "sigstop":
        os.killpg(before["pid"], signal.SIGSTOP)
    else:
        landed = await asyncio.to_thread(chaos, up, fault, shard)
        struck, struck_wall = struck + (landed - struck_wall), landed  # from the landing
    if then_route:
        await asyncio.sleep(1.0)
        load.start()
    await _until_condemned(up, shard, struck_wall, 120)
    carried_s = await load.carried_on(_AFTER_DETECTION_S)  # what it held is answered
    print(f"\n{name}: the load carried on {carried_s:.1f} s after the condemnation "
          f"(at most {_AFTER_DETECTION_S:g} s)")
    await load.stop()
    await _until_state(up, shard, {"HEALTHY"}, 300)
    # the times the fleet itself recorded, not when this poll happened to look
    history = [t for t in await asyncio.to_thread(up.client.transitions)
               if t["shard"] == shard and t["wall"] >= struck_wall]
    death = next(t for t in history if t["to"] == "DEAD")
    back = next(t for t in history if t["to"] == "HEALTHY" and t["wall"] >= death["wall"])
    fig.cause = death["cause"]
    fig.detected_after_s = round(death["wall"] - struck_wall, 1)
    fig.back_after_s = round(back["wall"] - struck_wall, 1)
    after = await _state(up, shard)
    fig.new_url = after["base_url"]
    router1 = await _router(up)
    fig.rescued = router1["rescues"] - router0["rescues"]
    fig.hedged = router1.get("hedges_won", 0) - router0.get("hedges_won", 0)
    fig.retried = sum(router1["retries"].values()) - sum(router0["retries"].values())
    fig.restarts = after["restart_attempts"] - before["restart_attempts"]
    results = load.results
    fig.requests = len(results)
    fig.client_errors = len(load.failures)
    fig.failures = [f"{r.status} after {r.latency_s:.1f} s: {r.error or r.incomplete}"[:300]
                    for r in load.failures]
    ok = sorted(r.latency_s for r in results if r.ok)
    caught = [r.latency_s for r in results if r.ok and (
        r.started <= struck < r.started + r.latency_s or then_route)]
    if ok and caught:
        fig.extra_latency_s = round(max(caught) - ok[len(ok) // 2], 1)
    return fig


#: Seconds the load runs on after detection at most: until every rescued or retried request
#: is answered and the engines left have answered as many more as the load has clients
#: (``Load.carried_on``), no longer than the fixed 5 s this was before.
_AFTER_DETECTION_S = 5.0


async def wedge_under_load(up: UpProcess, engines: str, shard: int = 0,
                           running: str = "vllm:num_requests_running") -> Figures:
    """SIGSTOP of the engine core (or a simulated wedge; on llama.cpp the compute-only wedge)
    while it runs requests: struck once the engine's ``running`` gauge says so.

    Struck once the engine itself reports requests running, with generations of mixed
    lengths. Its gauges freeze with the core: stopped at a step that left them at 0 (real
    vLLM reads 0 between one request's end and the next one's first step), the engine looks
    idle with the router's requests in flight there, and the watchdog condemns a lost core
    instead of a stuck one; both are this fault, caught.
    """
    load = Load(up.router, concurrency=6, max_tokens_range=(120, 280), timeout_s=300,
                api_key=up.client_key)
    load.start()
    await _in_flight(up, shard)
    url = (await _state(up, shard))["base_url"]
    for _ in range(600):  # 30 s at most
        if await engine_metric(url, running) > 0:
            break
        await asyncio.sleep(0.05)
    return await _fault_under(up, "wedge under load", engines, shard, "wedge", load)


async def sigstop_under_load(up: UpProcess, engines: str, shard: int = 0) -> Figures:
    """SIGSTOP of the engine's whole process group while it runs the router's requests: on a
    one-process engine (llama.cpp) its ``/health`` and ``/metrics`` stop answering too."""
    load = Load(up.router, concurrency=6, max_tokens_range=(120, 280), timeout_s=300,
                api_key=up.client_key)
    load.start()
    await _in_flight(up, shard)
    return await _fault_under(up, "SIGSTOP under load", engines, shard, "sigstop", load)


async def crash_under_load(up: UpProcess, engines: str, shard: int = 1) -> Figures:
    """SIGKILL of the engine core (or a simulated crash) with requests in flight."""
    load = Load(up.router, concurrency=6, max_tokens=200, timeout_s=300,
                api_key=up.client_key)
    load.start()
    await _in_flight(up, shard)
    return await _fault_under(up, "crash under load", engines, shard, "crash", load)


async def idle_wedge(up: UpProcess, engines: str, shard: int = 0) -> Figures:
    """A wedge while nothing runs; then the first routed requests."""
    load = Load(up.router, concurrency=2, max_tokens=16, timeout_s=300,
                api_key=up.client_key)
    return await _fault_under(up, "idle wedge", engines, shard, "wedge", load, then_route=True)


async def _in_flight(up: UpProcess, shard: int) -> None:
    start = time.monotonic()
    while (await _state(up, shard))["in_flight"] < 1:
        if time.monotonic() - start > 60:
            raise AssertionError(f"no request in flight on shard {shard}")
        await asyncio.sleep(0.05)


async def engine_metric(base_url: str, name: str, **labels: str) -> float:
    """The sum of one sample's values in an engine's ``/metrics`` (read straight from it),
    over the samples whose labels include ``labels``."""
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http, \
            http.get(base_url + "/metrics") as r:
        body = await r.text()
    return sum(s.value for fam in text_string_to_metric_families(body)
               for s in fam.samples
               if s.name == name and labels.items() <= s.labels.items())


async def wedge_while_running(up: UpProcess, shard: int,
                              limit_s: float = 60.0) -> tuple[float, float]:
    """Wedge ``shard`` at a moment its engine reports requests running; return when it was
    struck (``time.monotonic()``, ``time.time()``).

    A closed loop of requests still leaves gaps: the batch can empty between one request's
    end and the next one's arrival, and a core stopped then reports nothing running. The
    engine's gauges freeze with the core, so the moment is checked after the stop, not
    timed: caught in a gap, the engine is let go and struck again. Only for load sent straight
    to the engine: with the router's requests in flight, a core stopped in a gap is a lost
    core, which the fleet condemns within a second or two, before the engine is let go.

    The faults go through the admin API in this process, not the CLI: a core caught in a gap
    stays stopped until it is let go, and the CLI's own start (2 s and more on a loaded
    machine) would hold it stopped that long each time.
    """
    first = await _state(up, shard)
    url = first["base_url"]
    deadline = time.monotonic() + limit_s
    tries = 0
    while True:
        asked, asked_wall = time.monotonic(), time.time()
        landed = (await asyncio.to_thread(up.client.chaos, shard, "wedge"))["at"]
        running = await engine_metric(url, "vllm:num_requests_running")
        if running > 0:
            return asked + (landed - asked_wall), landed
        await asyncio.to_thread(up.client.chaos, shard, "unwedge")
        tries += 1
        now = await _state(up, shard)
        taken_out = now["base_url"] != url or now["state"] in ("DEAD", "RESTARTING", "RETIRED")
        if taken_out or time.monotonic() > deadline:
            raise AssertionError(
                f"shard {shard} never caught running ({tries} tries, "
                f"{time.monotonic() - (deadline - limit_s):.1f} s; the last read "
                f"{running:g} running, {await _waiting(url):g} waiting); the fleet shows it "
                f"{now['state']} at {now['base_url']} (was {first['state']} at {url})")
        await asyncio.sleep(0.05)


async def _waiting(url: str) -> float:
    try:
        return await engine_metric(url, "vllm:num_requests_waiting")
    except (aiohttp.ClientError, TimeoutError):
        return float("nan")


def whole(up: UpProcess, limit_s: float = 300.0) -> None:
    """Until every shard of the fleet is HEALTHY (its admin API polled, with a deadline)."""
    deadline = time.monotonic() + limit_s
    while any(s["state"] != "HEALTHY" for s in up.client.shards()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not whole within {limit_s} s: {up.client.shards()}")
        time.sleep(0.2)


class Ejections:
    """What the fleet takes out of service from now on, from its own history: an engine
    ejected from routing (a failed window of real requests), condemned (DEAD) or retired.
    A test adds to ``faulted`` the shards it faults on purpose; any other shard taken out is
    a false ejection (:meth:`false`)."""

    def __init__(self, up: UpProcess) -> None:
        self.up = up
        self.faulted: set[int] = set()
        self.since = self._latest(0)

    def _page(self, since: int) -> list[dict[str, Any]]:
        return self.up.client.transitions(since)

    def _latest(self, since: int) -> int:
        while page := self._page(since):
            since = page[-1]["seq"]
        return since

    def taken_out(self) -> list[dict[str, Any]]:
        out, since = [], self.since
        while page := self._page(since):
            out += [t for t in page if t["to"] in ("DEAD", "RETIRED") or t["event"] == "ejected"]
            since = page[-1]["seq"]
        return out

    def false(self) -> list[str]:
        """Each shard taken out that was not faulted, as ``shard N: FROM -> TO (cause)``."""
        return [f"shard {t['shard']}: {t['from']} -> {t['to']} ({t['cause']})"
                for t in self.taken_out() if t["shard"] not in self.faulted]


@contextlib.contextmanager
def no_false_ejections(up: UpProcess) -> Iterator[set[int]]:
    """Yields the set a test adds the shards it faults on purpose to; on the way out, fails
    if the fleet took out (ejected, condemned, retired) any other."""
    ejections = Ejections(up)
    yield ejections.faulted
    if false := ejections.false():
        raise AssertionError(f"engines taken out that were not faulted: {false}")


@contextlib.contextmanager
def up_fleet(work: Path, toml: str, *, start_timeout_s: float,
             stop_timeout_s: float, env: Mapping[str, str] | None = None,
             client_key: str = "none") -> Iterator[UpProcess]:
    """``fleetwarden up`` on the config ``toml`` (written into ``work``), stopped however the
    caller ends, and checked to leave nothing running. Give the config ports 0: ``up`` picks
    free ones itself, so none probed free beforehand can be taken meanwhile. ``env`` and
    ``client_key``: as :class:`UpProcess` takes them (engines behind a key)."""
    up = UpProcess(work, "--config", str(write_config(work, toml)),
                   start_timeout_s=start_timeout_s, env=env, client_key=client_key)
    try:
        yield up
    finally:
        out = up.stop(timeout_s=stop_timeout_s)
        assert "nothing left running" in out, out[-3000:]


def until_restarted(fleet: UpProcess, shard: dict[str, Any], limit_s: float = 300.0) -> None:
    """Until ``shard`` (as the admin API gave it) runs as another process and the whole fleet
    is HEALTHY: a kill the fleet has not seen yet leaves it looking whole for a moment."""
    deadline = time.monotonic() + limit_s
    while True:
        now = {s["index"]: s for s in fleet.client.shards()}
        if (now[shard["index"]]["pid"] != shard["pid"]
                and all(s["state"] == "HEALTHY" for s in now.values())):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"shard {shard['index']} not back within {limit_s} s: {now}")
        time.sleep(0.2)


def write_config(work: Path, text: str) -> Path:
    path = work / "fleet.toml"
    path.write_text(text)
    return path
