"""Attach mode: engines that something else runs (Kubernetes, systemd, a Ray job).

Owns: attached engines: their restart command, its timeout, and telling a new process from the
old one.
Must not: start engines itself: something else runs them.

fleetwarden routes to them, watches them and judges them as it does its own engines. When one
is condemned, ``restart_command`` (a template such as ``kubectl delete pod {name}`` or
``systemctl restart vllm@{shard}``) asks the system that runs it for a new process, within the
supervisor's budget, backoff and concurrency cap. With no command, fleetwarden only waits for
that system to replace the engine itself. Either way the engine is ready again when it answers
under a new incarnation (``process_start_time_seconds`` changed; ``/health`` 200 where it has
no metrics), and it serves again after the canary (static weights) or the next refit.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import time
import uuid
from urllib.parse import urlsplit

import aiohttp

from fleetwarden.config import FleetConfig, HealthConfig
from fleetwarden.credentials import Secret
from fleetwarden.engine_metrics import Sample, parse
from fleetwarden.engines import VLLM, detect
from fleetwarden.launchers import EngineHandle, LaunchError
from fleetwarden.launchers.procs import kill_and_reap, spawn_group
from fleetwarden.probe import health_status

__all__ = ["AttachLauncher", "read_incarnation"]

log = logging.getLogger(__name__)

#: Seconds between reads while waiting for an attached engine to come back: from the first,
#: doubling to the last. The engine is routed once this wait sees it (and one canary proves
#: it), so the pace is what a comeback waits at most to be seen: half a second, the confirm
#: pace's order, never the tick's 5 s (a rolling restart paced by /health took a restarted
#: engine back 7-10 s after it answered). A refused connect twice a second costs nothing.
_POLL_FIRST_S = 0.1
_POLL_MAX_S = 0.5
#: Seconds between /health reads while a restart command runs: a ``systemctl restart`` has
#: the engine down only while it runs, and an engine with no start time is known new only by
#: having been seen down (a vLLM-sized engine is down for seconds; 0.1 s sees a short one).
_WATCH_S = 0.1


async def read_incarnation(
    session: aiohttp.ClientSession, url: str, key: Secret | None = None
) -> tuple[bool, str | None]:
    """(answers /health 200, which process answers — its start time from /metrics, or its
    start header where the engine has one, llama.cpp's — or None). ``key``: the engine's API
    key, if it wants one (llama.cpp's ``--api-key`` guards /metrics)."""
    headers = None if key is None else key.bearer()
    status = await health_status(session, url + "/health", headers=headers)
    if isinstance(status, str):  # no answer at all
        return False, None
    healthy = status == 200
    try:
        async with session.get(url + "/metrics", headers=headers) as resp:
            if resp.status != 200:
                return healthy, None
            body = await resp.read()
            engine = detect(body.decode("utf-8", errors="replace")) or VLLM
            start = resp.headers.get(engine.start_header) if engine.start_header else None
            sample = parse(body, profile=engine, start_header=start)
    except (aiohttp.ClientError, TimeoutError):
        return healthy, None
    return healthy, sample.incarnation if isinstance(sample, Sample) else None


class AttachLauncher:
    """Restarts attached engines through ``restart_command``; starts nothing itself."""

    def __init__(self, fleet: FleetConfig, health: HealthConfig,
                 key: Secret | None = None) -> None:
        self.command = fleet.restart_command
        #: The attached engines' API key (the fleet's), for the reads of their process.
        self.key = key
        self.urls = {fleet.launched + k: url for k, url in enumerate(fleet.backends)}
        self.read_timeout = aiohttp.ClientTimeout(total=health.probe_timeout_s)
        #: A restart command is part of the attempt, so it gets the attempt's time.
        self.command_timeout_s = fleet.startup_timeout_s
        #: The incarnation each engine had before its restart began.
        self._before: dict[str, str | None] = {}
        #: The engines seen not answering /health since their restart began (the launch read
        #: included): without a start time, the only sign that a new process answers.
        self._seen_down: set[str] = set()

    @property
    def can_restart(self) -> bool:
        return self.command is not None

    async def launch(self, shard: int) -> EngineHandle:
        url = self.urls[shard]
        async with aiohttp.ClientSession(timeout=self.read_timeout) as session:
            answered, before = await read_incarnation(session, url, self.key)
        handle = EngineHandle(shard=shard, url=url, launch_id=f"attach-{uuid.uuid4().hex[:12]}",
                              launched_at=time.time())
        if self.command is not None:
            name = urlsplit(url).hostname or url
            argv = shlex.split(self.command.format(shard=shard, url=url, name=name))
            try:
                proc = await spawn_group(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                )
            except OSError as exc:
                raise LaunchError(f"shard {shard}: cannot run restart command {argv[0]!r}: "
                                  f"{exc}") from exc
            watch = asyncio.create_task(self._seen_down_during(url))
            try:
                out = await self._finish(proc, shard)
            finally:
                down = watch.done() and not watch.cancelled() and watch.result()
                watch.cancel()
            answered = answered and not down
            if proc.returncode != 0:
                tail = out.decode(errors="replace")[-500:].strip()
                raise LaunchError(f"shard {shard}: restart command exited with code "
                                  f"{proc.returncode}: {tail}")
            log.info("shard %d: ran restart command for %s", shard, url)
        # Kept only once the launch succeeded: a failed one has no handle to stop, and an
        # entry for it would stay for good.
        self._before[handle.launch_id] = before
        if not answered:
            self._seen_down.add(handle.launch_id)
        return handle

    async def _seen_down_during(self, url: str) -> bool:
        """Reads /health until it does not answer 200 (``True``), while the restart command
        runs (the caller cancels it when the command ends)."""
        async with aiohttp.ClientSession(timeout=self.read_timeout) as session:
            while True:
                if await health_status(session, url + "/health") != 200:
                    return True
                await asyncio.sleep(_WATCH_S)

    async def _finish(self, proc: asyncio.subprocess.Process, shard: int) -> bytes:
        """The command's output once it exits. A command still running after
        ``startup_timeout_s`` (a hung ``kubectl``), or whose attempt is cancelled (the shard
        retired, fleetwarden stopping), is ended with its whole process group."""
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.command_timeout_s)
        except TimeoutError:
            await kill_and_reap(proc)
            raise LaunchError(f"shard {shard}: restart command still running after "
                              f"{self.command_timeout_s:g} s (startup_timeout_s); "
                              "ended it") from None
        except BaseException:
            await kill_and_reap(proc)
            raise
        return out

    async def wait_ready(self, handle: EngineHandle, timeout_s: float) -> None:
        """Ready when the engine answers under a new incarnation (or, without metrics, when it
        answers /health again after the restart command)."""
        key = handle.launch_id
        before = self._before.get(key)
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        pause = _POLL_FIRST_S
        async with aiohttp.ClientSession(timeout=self.read_timeout) as session:
            while time.monotonic() < deadline:
                healthy, now = await read_incarnation(session, handle.url, self.key)
                if not healthy:
                    self._seen_down.add(key)
                if healthy and now is not None and now != before:
                    self._forget(key)  # the handle goes on under its new name
                    handle.launch_id = now  # the incarnation the watchdog reports, same spelling
                    return
                if healthy and now is None and before is None and key in self._seen_down:
                    # No start time to tell processes apart: /health again after it was seen
                    # not answering since the restart began (the command's run watched too).
                    # A restart command may return before the old process goes (``kubectl
                    # delete pod``): /health just after it may be the old one's. Waiting
                    # passively, the system that runs it replaced it; without this, a passive
                    # wait for an engine with no start time (SGLang, TGI, many attached ones)
                    # never ended, and its shard stayed DEAD with its engine serving again.
                    self._forget(key)
                    return
                last = ("answers under the same incarnation" if healthy and now == before
                        else "not answering /health" if not healthy else "no incarnation")
                await asyncio.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
        raise LaunchError(f"{handle.url} did not come back within {timeout_s:g} s ({last})")

    def _forget(self, key: str) -> None:
        """What was kept for the restart under launch id ``key``: its wait is over."""
        self._before.pop(key, None)
        self._seen_down.discard(key)

    async def stop(self, handle: EngineHandle) -> None:
        self._forget(handle.launch_id)  # someone else runs it: nothing to stop

    async def close(self) -> None:
        self._before.clear()
        self._seen_down.clear()

