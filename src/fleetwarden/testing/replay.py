"""Replaying a trace at its recorded schedule, faults during it, and each fault's post-check.

Owns: this project's own trace driver (open loop: every request leaves at its timestamp,
whatever the others do), the engines' counters read during a replay, and the faults a replay
injects with the check, after it ran, that each one happened.
Must not: judge the router (the bench scores; tests assert).

The bench's driver of record is AIPerf (``bench/replay.py``); this driver is the test suite's,
where AIPerf's install (about 1.2 GB) is too heavy to pay for, and the bench's cross-check.

A fault injector that silently does nothing lets a run pass, so every fault here has a
post-check that reads the fault's signature from the engine itself (the kernel's view of its
process, its own counters, what it answers), never from the injector: :meth:`Fault.verify`
returns what is missing, empty when the fault happened. A control aims the same injection at
nothing (:func:`decoys`: a port nobody listens on, a process that is no engine) and must leave
the signature missing.
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
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from fleetwarden.launchers.procs import (
    find_group_member,
    group_members,
    listening_processes,
    process_info,
    signal_process,
)
from fleetwarden.testing.faults import check_fault
from fleetwarden.testing.traces import TraceRecord, prompt_text
from fleetwarden.testing.vllm_env import ENGINE_CORE_PROCESS_NAME

__all__ = ["FAULTS", "POST_CHECK_ID_PREFIX", "REAL_FAULTS", "ROUTER_FAULTS", "BlackHole",
           "Counters", "Crash", "Fault",
           "FleetwardenKill", "Mixed", "RealCrash", "RealRollingRestart", "RealWedge", "Reload",
           "ReplayResult", "RollingRestart", "RouterFault", "RouterKill", "SigStop", "SlowDrain",
           "Target", "TcpReset", "Wedge", "decoys", "replay"]


# ---------------------------------------------------------------------- the driver


@dataclass(frozen=True, slots=True)
class ReplayResult:
    index: int  # the record's place in the trace
    request_id: str
    session_id: str
    scheduled_s: float  # the record's timestamp, seconds after the replay's start
    sent_s: float  # when it left, seconds after the replay's start
    ttft_s: float | None  # to the first token; None when none came
    latency_s: float
    status: int  # 200, the status of a refusal, or 0 when no answer came
    tokens: int  # tokens received
    output_length: int  # tokens asked for
    error: str = ""

    @property
    def ok(self) -> bool:
        """Answered whole: a 200 whose stream carried every token asked for and ended."""
        return self.status == 200 and not self.error and self.tokens == self.output_length


async def _one(http: aiohttp.ClientSession, url: str, model: str, record: TraceRecord,
               index: int, block_tokens: int, t0: float, id_prefix: str) -> ReplayResult:
    rid = f"{id_prefix}{index}"
    scheduled = record.timestamp / 1000.0
    body = {"model": model, "prompt": prompt_text(record, block_tokens),
            "max_tokens": record.output_length, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"x-request-id": rid}
    if record.session_id:
        headers["x-session-id"] = record.session_id
    sent = time.monotonic()
    ttft: float | None = None
    tokens, status, error, finished = 0, 0, "", False
    try:
        async with http.post(url + "/v1/completions", json=body, headers=headers) as resp:
            status = resp.status
            if status != 200:
                error = (await resp.text())[:200]
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        finished = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = f"error event: {chunk['error']}"[:200]
                        break
                    for choice in chunk.get("choices") or ():
                        if choice.get("text") or choice.get("token_ids"):
                            tokens += 1
                            if ttft is None:
                                ttft = time.monotonic() - sent
                if not finished and not error:
                    error = "stream cut before [DONE]"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
    return ReplayResult(index, rid, record.session_id, scheduled, sent - t0, ttft,
                        time.monotonic() - sent, status, tokens, record.output_length, error)


async def replay(records: Sequence[TraceRecord], base_url: str, *, block_tokens: int,
                 model: str = "tiny", timeout_s: float = 60.0, id_prefix: str = "replay-",
                 start_at: float | None = None) -> list[ReplayResult]:
    """Send every record at ``start_at + timestamp`` (``time.monotonic()``; now when None),
    streamed, open loop; one result per record, in trace order."""
    t0 = time.monotonic() if start_at is None else start_at
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:

        async def at_its_time(i: int, r: TraceRecord) -> ReplayResult:
            await asyncio.sleep(max(0.0, t0 + r.timestamp / 1000.0 - time.monotonic()))
            return await _one(http, base_url.rstrip("/"), model, r, i, block_tokens, t0,
                              id_prefix)

        return list(await asyncio.gather(*(at_its_time(i, r) for i, r in enumerate(records))))


# ---------------------------------------------------------------------- the engines' counters


@dataclass
class Counters:
    """Prefix-cache counters read from each engine's ``/metrics`` during a run. A restart
    starts them from zero (a new ``process_start_time_seconds``), so each incarnation's last
    reading is kept and the incarnations summed; a crashed engine's last reading is the one
    before it went."""

    urls: Sequence[str]
    #: (url, start time) -> (queries, hits), the latest reading of that incarnation
    readings: dict[tuple[str, float], tuple[float, float]] = field(default_factory=dict)
    #: url -> every start time seen, in order
    starts: dict[str, list[float]] = field(default_factory=dict)
    #: (seconds since ``t0``, url, queries, hits) per reading, for the cache hit rate over time
    series: list[tuple[float, str, float, float]] = field(default_factory=list)

    async def read(self, http: aiohttp.ClientSession, t0: float) -> None:
        async def one(url: str) -> None:
            values = await metrics(http, url, ("process_start_time_seconds",
                                               "vllm:prefix_cache_queries_total",
                                               "vllm:prefix_cache_hits_total"))
            if values is None:
                return
            start = values["process_start_time_seconds"]
            q, h = values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]
            self.readings[(url, start)] = (q, h)
            seen = self.starts.setdefault(url, [])
            if not seen or seen[-1] != start:
                seen.append(start)
            self.series.append((time.monotonic() - t0, url, q, h))

        await asyncio.gather(*(one(u) for u in self.urls))

    def totals(self) -> tuple[float, float]:
        """Queries and hits over every engine and incarnation."""
        q = sum(v[0] for v in self.readings.values())
        h = sum(v[1] for v in self.readings.values())
        return q, h

    def hit_rate(self) -> float | None:
        q, h = self.totals()
        return h / q if q else None


async def metrics(http: aiohttp.ClientSession, url: str,
                  names: Sequence[str]) -> dict[str, float] | None:
    """The named samples of an engine's ``/metrics`` (summed over labels), or None when it
    does not answer; a name it lacks reads 0."""
    try:
        async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
            if r.status != 200:
                return None
            body = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


# ---------------------------------------------------------------------- faults


@dataclass(frozen=True, slots=True)
class Target:
    """An engine a fault is aimed at: its URL and its process (None: not ours to signal)."""

    url: str
    pid: int | None = None


class Fault(Protocol):
    name: str

    def picks(self, engines: Sequence[Target]) -> list[Target]:
        """The engines this fault is for."""
        ...

    async def before(self, engines: Sequence[Target]) -> None:
        """Read what the post-check compares against, before the fault."""
        ...

    async def inject(self, aimed: Sequence[Target]) -> None:
        """Inject into ``aimed`` (the picks, or decoys in a control); never raises: an
        injection that failed shows in the post-check, as a silent injector's would."""
        ...

    async def verify(self, engines: Sequence[Target]) -> list[str]:
        """What of the fault's signature is missing on the picked engines; empty: it
        happened."""
        ...

    async def undo(self, engines: Sequence[Target]) -> None:
        """Leave the engines so that they can be stopped (a stopped process continued)."""
        ...


async def _post_fault(url: str, mode: str, **extra: float) -> None:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http, \
                http.post(url + "/sim/fault", json={"mode": mode, **extra}) as resp:
            await resp.read()


async def _sim_stats(url: str, timeout_s: float = 3.0) -> dict[str, object] | None:
    """The simulated engine's own account (``/sim/stats``), or None when it does not answer."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as h, \
                h.get(url + "/sim/stats") as resp:
            body = await resp.json()
            return body if isinstance(body, dict) else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def _count(stats: dict[str, object] | None, key: str) -> int:
    value = None if stats is None else stats.get(key)
    return int(value) if isinstance(value, int | float) else 0


async def _answers(url: str, path: str, timeout_s: float) -> int | None:
    """The status ``GET url+path`` answers within ``timeout_s``; None when none came."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as h, \
                h.get(url + path) as resp:
            return resp.status
    except (aiohttp.ClientError, TimeoutError):
        return None


#: The ``x-request-id`` of every request a post-check sends an engine itself, so that what the
#: engine's log says the router sent it leaves them out.
POST_CHECK_ID_PREFIX = "replay-post-check-"


async def _generates(url: str, timeout_s: float) -> bool:
    """Whether a one-token completion sent straight to the engine is answered in time."""
    body = {"model": "tiny", "prompt": "post-check", "max_tokens": 1}
    headers = {"x-request-id": POST_CHECK_ID_PREFIX + uuid.uuid4().hex[:12]}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as h, \
                h.post(url + "/v1/completions", json=body, headers=headers) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


def _signal(aimed: Sequence[Target], sig: int) -> None:
    """Send ``sig`` to each target's process; one that is gone or not ours is skipped (the
    post-check shows it)."""
    for t in aimed:
        if t.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(t.pid, sig)


@dataclass
class _One:
    """A fault for one engine, engine ``index`` of the fleet."""

    index: int = 1

    def picks(self, engines: Sequence[Target]) -> list[Target]:
        return [engines[self.index]]

    async def before(self, engines: Sequence[Target]) -> None:
        return None

    async def undo(self, engines: Sequence[Target]) -> None:
        return None


@dataclass
class Crash(_One):
    """The engine dies (``/sim/fault crash``: vLLM's 500 to what it holds, then exit 1).
    Signature: the kernel has no running process left (gone or a zombie) and its port refuses."""

    name: str = "crash"

    async def inject(self, aimed: Sequence[Target]) -> None:
        await asyncio.gather(*(_post_fault(t.url, "crash") for t in aimed))

    async def verify(self, engines: Sequence[Target]) -> list[str]:
        problems: list[str] = []
        for t in self.picks(engines):
            for _ in range(30):  # a dying engine answers 503 for a moment before it exits
                info = process_info(t.pid) if t.pid is not None else None
                running = info is not None and info.state not in "ZX"
                answers = await _answers(t.url, "/health", 2.0)
                if not running and answers is None:
                    break
                await asyncio.sleep(0.1)
            else:
                if running:
                    problems.append(f"{t.url}: process {t.pid} still running")
                if answers is not None:
                    problems.append(f"{t.url}: still answers /health ({answers})")
        return problems


@dataclass
class Wedge(_One):
    """The engine's loop stops (``/sim/fault wedge``, as a SIGSTOPped EngineCore): it still
    answers ``/health`` but generates nothing. Signature: ``/health`` 200 and a one-token
    completion sent straight to it unanswered after ``probe_s``."""

    name: str = "wedge"
    probe_s: float = 2.0

    async def inject(self, aimed: Sequence[Target]) -> None:
        await asyncio.gather(*(_post_fault(t.url, "wedge") for t in aimed))

    async def verify(self, engines: Sequence[Target]) -> list[str]:
        problems = []
        for t in self.picks(engines):
            health = await _answers(t.url, "/health", 2.0)
            if health != 200:
                problems.append(f"{t.url}: /health answered {health}, not 200 (not a wedge)")
            if await _generates(t.url, self.probe_s):
                problems.append(f"{t.url}: generated a token within {self.probe_s:g} s")
        return problems


@dataclass
class SigStop(_One):
    """The whole engine process stopped by SIGSTOP (nothing answers, not even ``/health``).
    Signature: the kernel reports the process stopped (state T)."""

    name: str = "sigstop"

    async def inject(self, aimed: Sequence[Target]) -> None:
        _signal(aimed, signal.SIGSTOP)

    async def verify(self, engines: Sequence[Target]) -> list[str]:
        problems = []
        for t in self.picks(engines):
            state = "?"
            for _ in range(20):  # the kernel may take a moment to report T
                info = process_info(t.pid) if t.pid is not None else None
                state = info.state if info is not None else "gone"
                if state in "Tt":
                    break
                await asyncio.sleep(0.1)
            else:
                problems.append(f"{t.url}: process {t.pid} in state {state}, not stopped")
        return problems

    async def undo(self, engines: Sequence[Target]) -> None:
        for t in self.picks(engines):
            if t.pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(t.pid, signal.SIGCONT)


@dataclass
class TcpReset(_One):
    """A share of the engine's connections reset (``/sim/fault reset``: every
    ``1/share``-th generation that arrives gets a TCP RST before any answer), for
    ``duration_s``. Signature: the engine's own count of the connections it reset."""

    share: float = 0.3
    duration_s: float = 20.0
    name: str = "tcp-reset"
    _before: int = 0

    async def before(self, engines: Sequence[Target]) -> None:
        self._before = _count(await _sim_stats(self.picks(engines)[0].url), "reset")

    async def inject(self, aimed: Sequence[Target]) -> None:
        await asyncio.gather(*(_post_fault(t.url, "reset", factor=self.share,
                                           duration_s=self.duration_s) for t in aimed))

    async def verify(self, engines: Sequence[Target]) -> list[str]:
        problems = []
        for t in self.picks(engines):
            n = _count(await _sim_stats(t.url), "reset") - self._before
            if n <= 0:
                problems.append(f"{t.url}: the engine reset no connection")
        return problems


@dataclass
class BlackHole(_One):
    """The engine accepts every connection and answers nothing (``/sim/fault blackhole``),
    ``/health`` and ``/metrics`` included. Signature: its ``/health`` unanswered within
    ``probe_s``, and its own count of the requests it swallowed
    (``fleetwarden.testing.faults.check_fault``, which ``bench/failover.py`` reads too)."""

    probe_s: float = 2.0
    name: str = "blackhole"

    async def inject(self, aimed: Sequence[Target]) -> None:
        await asyncio.gather(*(_post_fault(t.url, "blackhole") for t in aimed))

    async def verify(self, engines: Sequence[Target]) -> list[str]:
        problems = []
        for t in self.picks(engines):
            health = await _answers(t.url, "/health", self.probe_s)
            if health is not None:
                problems.append(f"{t.url}: /health answered {health} (not a black hole)")
            checked = await check_fault(t.url, "blackhole", t.pid or 0)
            if not checked.startswith("verified"):
                problems.append(f"{t.url}: {checked}")
        return problems

    async def undo(self, engines: Sequence[Target]) -> None:
        # What it holds is let go, so that the engine stops at once when asked.
        for t in self.picks(engines):
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as h, \
                        h.delete(t.url + "/sim/fault") as resp:
                    await resp.read()


@dataclass
class SlowDrain(_One):
    """The engine drains slowly (``/sim/fault drain``): new connections refused, its streams
    in flight finished at ``factor`` times its step time, for ``duration_s``; then it listens
    again. Signature, read once it listens again: the engine's own count of the drains it
    took and of the times it closed its listening socket. (How many streams it finished
    during the drain is the router's doing: one that moves them elsewhere leaves none.)"""

    factor: float = 4.0
    duration_s: float = 12.0
    name: str = "slow-drain"
    _before: tuple[int, int] = (0, 0)

    async def _counts(self, url: str, wait_s: float) -> tuple[int, int] | None:
        deadline = time.monotonic() + wait_s
        while True:  # refused while it drains: read once it listens again
            stats = await _sim_stats(url)
            if stats is not None:
                taken = stats.get("faults_taken")
                drains = int(taken.get("drain", 0)) if isinstance(taken, dict) else 0
                return drains, _count(stats, "listener_closed")
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.2)

    async def before(self, engines: Sequence[Target]) -> None:
        self._before = await self._counts(self.picks(engines)[0].url, 0.0) or (0, 0)

    async def inject(self, aimed: Sequence[Target]) -> None:
        await asyncio.gather(*(_post_fault(t.url, "drain", factor=self.factor,
                                           duration_s=self.duration_s) for t in aimed))

    async def verify(self, engines: Sequence[Target]) -> list[str]:
        problems = []
        for t in self.picks(engines):
            now = await self._counts(t.url, self.duration_s + 5.0)
            if now is None:
                problems.append(f"{t.url}: not listening again after the drain")
                continue
            if now[0] <= self._before[0]:
                problems.append(f"{t.url}: the engine took no drain")
            if now[1] <= self._before[1]:
                problems.append(f"{t.url}: the engine never closed its listening socket")
        return problems


@dataclass
class RollingRestart:
    """Every engine restarted in turn, ``gap_s`` apart (``/sim/fault restart``: a new
    process, its requests in flight dropped). Signature: each engine's own
    ``process_start_time_seconds`` moved past the one read before, and it serves again."""

    gap_s: float = 5.0
    name: str = "rolling-restart"
    _before: dict[str, float] = field(default_factory=dict)

    def picks(self, engines: Sequence[Target]) -> list[Target]:
        return list(engines)

    async def _starts(self, engines: Sequence[Target]) -> dict[str, float]:
        out = {}
        async with aiohttp.ClientSession() as http:
            for t in engines:
                values = await metrics(http, t.url, ("process_start_time_seconds",))
                if values is not None:
                    out[t.url] = values["process_start_time_seconds"]
        return out

    async def before(self, engines: Sequence[Target]) -> None:
        self._before = await self._starts(engines)

    async def inject(self, aimed: Sequence[Target]) -> None:
        for i, t in enumerate(aimed):
            if i:
                await asyncio.sleep(self.gap_s)
            await _post_fault(t.url, "restart")

    async def verify(self, engines: Sequence[Target]) -> list[str]:
        now = await self._starts(engines)
        problems = []
        for t in engines:
            was, is_ = self._before.get(t.url), now.get(t.url)
            if was is None or is_ is None:
                problems.append(f"{t.url}: no start time read (before {was}, after {is_})")
            elif not is_ > was:
                problems.append(f"{t.url}: not restarted (process start {is_:.3f} as before)")
            elif await _answers(t.url, "/health", 2.0) != 200:
                problems.append(f"{t.url}: restarted but not serving")
        return problems

    async def undo(self, engines: Sequence[Target]) -> None:
        return None


# ---------------------------------------------------------------------- real engines' faults
# The same faults on real vLLM engines (``fleetwarden.testing.vllm_engine``: each in a process
# group of its own whose id is its API server's pid, the Target's pid). Injected through the
# kernel, not an endpoint; each keeps its simulated twin's post-check, read from the engine.


@dataclass
class RealCrash(Crash):
    """A real engine dies: SIGKILL to its whole process group (API server, ``VLLM::EngineCore``,
    its workers). Signature: the simulated crash's (its API server not running, its port
    refusing) and no live process left in its group."""

    async def inject(self, aimed: Sequence[Target]) -> None:
        for t in aimed:
            if t.pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(t.pid, signal.SIGKILL)

    async def verify(self, engines: Sequence[Target]) -> list[str]:
        problems = await super().verify(engines)
        for t in self.picks(engines):
            left = group_members(t.pid) if t.pid is not None else []
            if left:
                problems.append(f"{t.url}: group {t.pid} still has live processes "
                                f"{[(p.pid, p.comm) for p in left]}")
        return problems


def _signal_core(aimed: Sequence[Target], sig: int) -> None:
    """Send ``sig`` to each target group's ``VLLM::EngineCore``; a group without one (gone,
    or no vLLM) is skipped: the post-check shows it."""
    for t in aimed:
        core = find_group_member(t.pid, ENGINE_CORE_PROCESS_NAME) if t.pid is not None else None
        if core is not None:
            signal_process(core.pid, core.start_ticks, sig)


@dataclass
class RealWedge(Wedge):
    """A real engine's loop stops: SIGSTOP of its ``VLLM::EngineCore`` (what ``chaos wedge``
    does); its API server still answers ``/health``. Signature: the simulated wedge's
    (``/health`` 200, a one-token completion straight to it unanswered after ``probe_s``).
    Undone by SIGCONT."""

    async def inject(self, aimed: Sequence[Target]) -> None:
        await asyncio.to_thread(_signal_core, aimed, signal.SIGSTOP)

    async def undo(self, engines: Sequence[Target]) -> None:
        await asyncio.to_thread(_signal_core, self.picks(engines), signal.SIGCONT)


#: Stops one engine and starts it again on the same port, as an operator's process manager
#: would; returns once it serves again. Raises when it does not.
Restart = Callable[[Target], Awaitable[None]]


@dataclass
class RealRollingRestart(RollingRestart):
    """Every real engine stopped and started again in turn on the same port by the caller's
    :data:`Restart` (bound with :meth:`bind` before the run), ``gap_s`` apart counting from
    the previous one serving again. Signature: the simulated rolling restart's (each engine's
    ``process_start_time_seconds`` moved, ``/health`` 200) and a one-token completion straight
    to each answered."""

    restart: Restart | None = None
    probe_s: float = 10.0
    #: (url, wall time its stop began, wall time it served again) per engine restarted: when
    #: each handover fell in the trace.
    handovers: list[tuple[str, float, float]] = field(default_factory=list)
    _failed: list[str] = field(default_factory=list)

    def bind(self, restart: Restart) -> None:
        self.restart = restart

    async def inject(self, aimed: Sequence[Target]) -> None:
        for i, t in enumerate(aimed):
            if i:
                await asyncio.sleep(self.gap_s)
            if self.restart is None:
                self._failed.append("no restart bound")
                return
            began = time.time()
            try:
                await self.restart(t)
            except (RuntimeError, OSError) as exc:  # shows in the post-check, as said
                self._failed.append(f"{t.url}: restart failed: {exc}"[:300])
            else:
                self.handovers.append((t.url, began, time.time()))

    async def verify(self, engines: Sequence[Target]) -> list[str]:
        problems = await super().verify(engines) + self._failed
        for t in engines:
            if not any(p.startswith(t.url) for p in problems) \
                    and not await _generates(t.url, self.probe_s):
                problems.append(f"{t.url}: restarted but no token within {self.probe_s:g} s")
        return problems


#: Starts a process (its argv, in its working directory) as the fleet's own was started.
Spawn = Callable[[list[str], str | None], "subprocess.Popen[str]"]


def _router_listeners(port: int, controller: int | None) -> set[int]:
    """The kernel's view: the processes listening on the router's port, the controller left
    out (it may hold the socket it hands over)."""
    return {p.pid for p in listening_processes(port) if p.pid != controller}


async def _within(wait_s: float, missing: Callable[[], str]) -> list[str]:
    """Read ``missing`` every 0.5 s until it says nothing is (""), for at most ``wait_s``:
    what it said last, or nothing."""
    deadline = time.monotonic() + wait_s
    while True:
        problem = missing()
        if not problem or time.monotonic() >= deadline:
            return [problem] if problem else []
        await asyncio.sleep(0.5)


@dataclass
class RouterFault:
    """A fault of fleetwarden's own (its router processes, its controller), not an engine's.
    The bench binds it to the running fleetwarden (:meth:`bind`) before the run: the router's
    URL, the controller's process, and how to start a process as the supervisor would."""

    name: str = ""
    url: str = ""
    controller: subprocess.Popen[str] | None = None
    #: Starts a process (argv) as the fleet's own was started, and keeps it to stop later.
    spawn: Spawn | None = None
    _listeners: set[int] = field(default_factory=set)

    def bind(self, url: str, controller: subprocess.Popen[str], spawn: Spawn) -> None:
        self.url, self.controller, self.spawn = url, controller, spawn

    @property
    def port(self) -> int:
        return int(self.url.rstrip("/").rpartition(":")[2])

    @property
    def pid(self) -> int | None:
        return None if self.controller is None else self.controller.pid

    def picks(self, engines: Sequence[Target]) -> list[Target]:
        return [Target(self.url, self.pid)]

    async def before(self, engines: Sequence[Target]) -> None:
        self._listeners = _router_listeners(self.port, self.pid)

    async def undo(self, engines: Sequence[Target]) -> None:
        return None


@dataclass
class Reload(RouterFault):
    """fleetwarden's own upgrade under load: ``kill -HUP`` to ``fleetwarden up`` starts new
    router processes on the same port and drains the old ones (docs/operations.md, "Replacing
    the routers"). Signature, the kernel's: the processes listening on the router's port
    afterwards are all new (none of those before), and there is one."""

    name: str = "reload"
    wait_s: float = 30.0

    async def inject(self, aimed: Sequence[Target]) -> None:
        _signal(aimed, signal.SIGHUP)

    async def verify(self, engines: Sequence[Target]) -> list[str]:
        if not self._listeners:
            return [f"{self.url}: no router process listened before the reload"]

        def replaced() -> str:  # the old ones exit once their streams are done
            now = _router_listeners(self.port, self.pid)
            return "" if now and not now & self._listeners else (
                f"{self.url}: router processes before {sorted(self._listeners)}, after "
                f"{sorted(now)}: not replaced")

        return await _within(self.wait_s, replaced)


@dataclass
class RouterKill(RouterFault):
    """``kill -9`` of fleetwarden's router process(es) under load: the controller's supervisor
    starts another on the same port (docs/operations.md, "The router processes"). Aimed at the
    processes the kernel shows listening on the router's port. Signature, the kernel's: each
    of them gone, and a new one listening within ``wait_s``."""

    name: str = "router-kill"
    wait_s: float = 30.0

    def picks(self, engines: Sequence[Target]) -> list[Target]:
        return [Target(self.url, pid) for pid in sorted(self._listeners)]

    async def inject(self, aimed: Sequence[Target]) -> None:
        _signal(aimed, signal.SIGKILL)

    async def verify(self, engines: Sequence[Target]) -> list[str]:
        if not self._listeners:
            return [f"{self.url}: no router process listened before the kill"]

        def replaced() -> str:
            alive = {p for p in self._listeners
                     if (info := process_info(p)) is not None and info.state not in "ZX"}
            now = _router_listeners(self.port, self.pid)
            return "" if not alive and now else (
                f"{self.url}: router processes {sorted(alive)} still alive, listening now "
                f"{sorted(now)}")

        return await _within(self.wait_s, replaced)


@dataclass
class FleetwardenKill(RouterFault):
    """``kill -9`` of ``fleetwarden up`` under load, and its restart ``restart_after_s`` later
    with the same command line, as a supervisor (systemd's ``Restart=always``) would do once
    it sees the process gone (docs/operations.md, "When fleetwarden itself dies": the router
    processes serve on, and the next run adopts them). Signature, the kernel's: the
    controller ended by SIGKILL, the router processes listening before still listen, and a
    new controller runs."""

    name: str = "fleetwarden-kill"
    restart_after_s: float = 3.0
    _argv: list[str] = field(default_factory=list)
    _cwd: str = ""
    _restarted: subprocess.Popen[str] | None = None

    async def before(self, engines: Sequence[Target]) -> None:
        await super().before(engines)
        info = process_info(self.pid) if self.pid is not None else None
        self._argv = list(info.cmdline) if info is not None else []
        with contextlib.suppress(OSError):
            self._cwd = os.readlink(f"/proc/{self.pid}/cwd")

    async def inject(self, aimed: Sequence[Target]) -> None:
        _signal(aimed, signal.SIGKILL)
        await asyncio.sleep(self.restart_after_s)
        # The supervisor's rule: restart the process it runs once that one has exited.
        if (self.controller is not None and self.controller.poll() is not None
                and self._argv and self.spawn is not None):
            self._restarted = self.spawn(self._argv, self._cwd or None)

    async def verify(self, engines: Sequence[Target]) -> list[str]:
        problems = []
        code = None if self.controller is None else self.controller.poll()
        if code != -signal.SIGKILL:
            problems.append(f"{self.url}: controller {self.pid} not ended by SIGKILL "
                            f"(exit status {code})")
        if not self._listeners:
            problems.append(f"{self.url}: no router process listened before the kill")
        else:
            now = _router_listeners(self.port, None)
            if not self._listeners <= now:
                problems.append(f"{self.url}: router processes {sorted(self._listeners)} "
                                f"did not serve on (now {sorted(now)})")
        new = self._restarted
        if new is None or new.poll() is not None:
            problems.append(f"{self.url}: no new controller running")
        return problems

    async def undo(self, engines: Sequence[Target]) -> None:
        new = self._restarted
        if new is not None and new.poll() is None:
            # Stopped here so that its journal is complete before the bench reads it; it
            # stops the router processes it adopted.
            new.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(new.wait, 20.0)
        if self.controller is not None and self.controller.poll() is not None:
            # No controller left to stop the router processes it started (the restart
            # failed, or never came): they are this run's, so they are ended here.
            for pid in self._listeners | _router_listeners(self.port, None):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


@dataclass
class Mixed:
    """Several faults in one run, ``gap_s`` apart, each on an engine of its own: a crash of
    engine 1, a wedge of engine 2, TCP resets on engine 3 (engine 0 stays healthy).
    Signature: every part's own."""

    gap_s: float = 8.0
    name: str = "mixed"
    parts: list[Fault] = field(default_factory=lambda: [
        Crash(index=1), Wedge(index=2), TcpReset(index=3)])

    def picks(self, engines: Sequence[Target]) -> list[Target]:
        return [t for part in self.parts for t in part.picks(engines)]

    async def before(self, engines: Sequence[Target]) -> None:
        for part in self.parts:
            await part.before(engines)

    async def inject(self, aimed: Sequence[Target]) -> None:
        at = 0
        for i, part in enumerate(self.parts):
            if i:
                await asyncio.sleep(self.gap_s)
            n = len(part.picks(aimed)) if isinstance(part, RollingRestart) else 1
            await part.inject(aimed[at:at + n])
            at += n

    async def verify(self, engines: Sequence[Target]) -> list[str]:
        problems = []
        for part in self.parts:
            problems += [f"{part.name}: {p}" for p in await part.verify(engines)]
        return problems

    async def undo(self, engines: Sequence[Target]) -> None:
        for part in self.parts:
            await part.undo(engines)


#: The faults by name, each a fresh one (several keep readings from before the fault).
FAULTS: dict[str, type[Fault]] = {
    "crash": Crash, "wedge": Wedge, "sigstop": SigStop, "tcp-reset": TcpReset,
    "blackhole": BlackHole, "slow-drain": SlowDrain, "rolling-restart": RollingRestart,
    "reload": Reload, "router-kill": RouterKill, "fleetwarden-kill": FleetwardenKill,
    "mixed": Mixed}
#: The faults a replay on real vLLM engines injects, by the same names.
REAL_FAULTS: dict[str, type[Fault]] = {
    "crash": RealCrash, "wedge": RealWedge, "rolling-restart": RealRollingRestart}
#: The faults of fleetwarden's own processes: for fleetwarden only, bound to it before a run.
ROUTER_FAULTS = frozenset({"reload", "router-kill", "fleetwarden-kill"})


def decoys(n: int) -> tuple[list[Target], subprocess.Popen[bytes]]:
    """``n`` targets that are no engine: each a port nobody listens on, and one process that
    is not an engine (a sleeping Python). A control run aims its fault at them. The caller
    stops the process (``proc.kill(); proc.wait()``)."""
    import socket

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                            stdin=subprocess.DEVNULL, start_new_session=True)
    targets = []
    for _ in range(n):
        with socket.socket() as s:  # bound and closed: nothing listens there afterwards
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        targets.append(Target(f"http://127.0.0.1:{port}", proc.pid))
    return targets, proc
