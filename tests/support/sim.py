"""Real `fleetwarden sim` processes on 127.0.0.1, and what scenario tests do with them.

Every process a test starts runs in its own process group and is stopped by the fixture that
started it (SIGTERM to its group, then SIGKILL), whatever the test did. Waits poll for a
condition with a deadline; none is a fixed sleep that a slow machine could outrun.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import pytest

from fleetwarden.engine_metrics import Sample, parse
from support.wait import free_port as free_port  # re-exported: the scenario tests' one import
from support.wait import until as until

#: Generous: a loaded 2-core machine may take seconds to start a Python process.
START_TIMEOUT_S = 30.0


class SimProcess:
    """One `fleetwarden sim --port 0 ...` subprocess."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetwarden", "sim", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        line = self._ready_line()
        match = re.match(r"ready (http://\S+) pid=(\d+)", line)
        if match is None:
            self.kill()
            raise RuntimeError(f"sim did not start: {line!r} {self._stderr()}")
        self.url = match.group(1)
        assert int(match.group(2)) == self.proc.pid
        #: Every engine's URL (``--engines N``: one ready line each, then ``all ready N``).
        self.urls = [self.url]
        engines = int(args[args.index("--engines") + 1]) if "--engines" in args else 1
        assert self.proc.stdout is not None
        # The rest come in the same write as the first (one flush after the last): read from
        # the buffer, where a selector on the pipe would wait for bytes already read.
        for _ in range(engines - 1):
            more = re.match(r"ready (http://\S+) pid=(\d+)", self.proc.stdout.readline())
            if more is None:
                self.kill()
                raise RuntimeError(f"sim did not start all {engines} engines")
            self.urls.append(more.group(1))
        if engines > 1 and self.proc.stdout.readline().strip() != f"all ready {engines}":
            self.kill()
            raise RuntimeError(f"sim did not say all {engines} engines were ready")

    def _ready_line(self) -> str:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout=START_TIMEOUT_S):
                self.kill()
                raise RuntimeError(f"sim printed no ready line in {START_TIMEOUT_S} s")
        return self.proc.stdout.readline().strip()

    def _stderr(self) -> str:
        try:
            return self.proc.communicate(timeout=5)[1][-2000:]
        except subprocess.TimeoutExpired:
            return ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """Signal the sim's process group (only the group this object started)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self.terminate(signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.terminate(signal.SIGKILL)
            self.proc.wait(timeout=5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def spawn() -> Iterator[Callable[..., SimProcess]]:
    """``spawn("--slots", "2")`` starts a sim; all of them are stopped after the test."""
    started: list[SimProcess] = []

    def start(*args: str) -> SimProcess:
        sim = SimProcess(*args)
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.kill()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


# ---------------------------------------------------------------------- talking to a sim


async def metrics(http: aiohttp.ClientSession, url: str) -> Sample:
    async with http.get(url + "/metrics") as r:
        sample = parse(await r.read())
    assert isinstance(sample, Sample), sample
    return sample


async def stats(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/sim/stats") as r:
        result: dict[str, Any] = await r.json()
        return result


async def set_fault(http: aiohttp.ClientSession, url: str, mode: str | None,
                    **extra: float) -> None:
    async with http.post(url + "/sim/fault", json={"mode": mode, **extra}) as r:
        assert r.status == 200, await r.text()


def canaries(sim_stats: dict[str, Any]) -> list[dict[str, Any]]:
    from fleetwarden.watchdog import CANARY_ID_PREFIX

    return [e for e in sim_stats["log"]
            if (e["request_id"] or "").startswith(CANARY_ID_PREFIX)]


class Load:
    """Long generations kept in flight against one engine; cancelled (and so aborted in the
    engine, by the closed connection) when the block ends. Bounded by construction: ``n``
    requests, each of ``max_tokens``."""

    def __init__(self, http: aiohttp.ClientSession, url: str, n: int, max_tokens: int,
                 prompt: str = "hello") -> None:
        self.http, self.url, self.n = http, url, n
        self.body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}
        self.tasks: list[asyncio.Task[int]] = []

    async def _one(self) -> int:
        async with self.http.post(self.url + "/v1/completions", json=self.body) as r:
            await r.read()
            return r.status

    async def __aenter__(self) -> Load:
        self.tasks = [asyncio.create_task(self._one()) for _ in range(self.n)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


#: ``fleetwarden check`` with shrunk times: reads 0.3 s apart, a stall is conclusive after
#: 0.8 s, a canary gets 1 s.
CHECK_FAST = ("--interval", "0.3", "--stall-s", "0.8", "--canary-timeout", "1")


async def run_check(url: str, *args: str) -> tuple[int, dict[str, Any]]:
    """``fleetwarden check URL --json`` as a real process: its exit status and its report
    (whose ``exit_code`` must agree with the status)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetwarden", "check", url, *CHECK_FAST, *args, "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    report: dict[str, Any] = json.loads(out) if out else {"stderr": err.decode()}
    assert report.get("exit_code") == proc.returncode, report
    return proc.returncode, report
