"""Many simulated engines in one process: one event loop, each engine its own port and state.

Owns: running several :class:`~fleetwarden.sim.server.Sim` side by side in one process, and
what one engine's end does to the others (nothing).
Must not: hold an engine's behaviour (``server.py``) or share anything between the engines.

A fleet of a thousand engines cannot be a thousand Python processes on a 2-core machine (each
costs ~40 MB and a start of a second or more); it can be a thousand :class:`Sim` objects on one
loop, since an idle engine is a listener and a task waiting on an event. Each engine is the
same object a single ``fleetwarden sim`` runs: its own port, its own scheduler, metrics, fault
and control endpoints, so ``POST /sim/fault`` on one port touches that engine alone.

What stands in for a process here is the engine itself: a ``crash`` ends that engine (its
listener closes, its connections drop, as when a real engine's process dies) and the others
serve on; the process ends only on SIGTERM/SIGINT (status 0) or when every engine has crashed
(status 1, as a single engine's crash ends its process with 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from fleetwarden.sim.config import SimConfig
from fleetwarden.sim.dialects import Families
from fleetwarden.sim.engine import EngineCore
from fleetwarden.sim.server import Sim, loop_runner

__all__ = ["SimGroup", "files_needed", "serve_many"]

#: Open files one engine may need at once: its listener, and a connection from each of the
#: controller's watchdog and a router, with room for a probe and a canary beside them.
FILES_PER_ENGINE = 8


def files_needed(engines: int) -> int:
    """The open-file limit a process of ``engines`` engines asks for (the stdio and the
    loop's own descriptors on top)."""
    return engines * FILES_PER_ENGINE + 64


def raise_file_limit(wanted: int) -> int:
    """Raise this process's soft limit on open files toward ``wanted`` (never past the hard
    limit, never down). Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


def configs(base: SimConfig, engines: int) -> list[SimConfig]:
    """Each engine's config: ``base`` with its port. Port 0 gives every engine a free port of
    its own; port P gives engine i the port P + i (a range an operator can list)."""
    if engines < 1:
        raise ValueError(f"engines must be >= 1, got {engines}")
    return [replace(base, port=0 if base.port == 0 else base.port + i) for i in range(engines)]


class _CachedFamilies:
    """An engine's metric families whose ``/metrics`` body is rendered once per change.

    Rendering vLLM's families costs ~9 ms of CPU (prometheus-client's exposition of ~45 KB):
    a thousand engines read once a tick would cost the process 9 s of CPU per round, more than
    a tick. The body changes only through the ``on_*`` calls the engine core makes; an idle
    engine's is the same bytes read after read. The price: the ``process_*`` families (CPU
    seconds, memory) are those of the last change, and in a process of many engines they
    are the shared process's anyway; its start time, which a watchdog reads, is the
    engine's own and fixed.
    """

    def __init__(self, inner: Families) -> None:
        self._inner = inner
        self._body: bytes | None = None

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name.startswith("on_") and callable(value):
            def changed(*args: Any, **kwargs: Any) -> Any:
                self._body = None
                return value(*args, **kwargs)
            return changed
        return value

    def exposition(self) -> bytes:
        if self._body is None:
            self._body = self._inner.exposition()
        return self._body


class _GroupSim(Sim):
    """A :class:`Sim` of a group: the same engine, its ``/metrics`` body kept between
    changes (:class:`_CachedFamilies`)."""

    def _new_process(self, previous_start: float | None) -> tuple[Families, EngineCore]:
        families, core = super()._new_process(previous_start)
        cached = _CachedFamilies(families)
        core.families = cached  # the same calls, observed
        return cached, core


class SimGroup:
    """Several simulated engines on the running loop.

    ``async with SimGroup([SimConfig(), SimConfig()]) as group:`` serves ``group.sims``, each at
    its own ``url``. An engine that crashes is stopped by the group (its connections dropped,
    as its process's end would) and stays in ``sims`` with ``exited`` set; the others are not
    touched. ``all_exited`` is set once every engine has.
    """

    def __init__(self, configs: Sequence[SimConfig]) -> None:
        self.sims: list[Sim] = [_GroupSim(c) for c in configs]
        self.all_exited = asyncio.Event()
        self._reapers: set[asyncio.Task[None]] = set()

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.sims]

    async def start(self) -> None:
        """Start every engine, in order (a port taken fails here, naming the engine)."""
        for i, sim in enumerate(self.sims):
            try:
                await sim.start()
            except OSError as e:
                await self.stop()
                raise OSError(e.errno, f"engine {i} on {sim.config.host}:{sim.config.port}: "
                              f"{e.strerror or e}") from e
            task = asyncio.ensure_future(self._reap(sim))
            self._reapers.add(task)
            task.add_done_callback(self._reapers.discard)

    async def _reap(self, sim: Sim) -> None:
        await sim.exited.wait()
        await sim.stop()  # the engine's process is gone: nothing of it stays open
        if all(s.exited.is_set() for s in self.sims):
            self.all_exited.set()

    async def stop(self) -> None:
        for task in list(self._reapers):
            task.cancel()
        for task in list(self._reapers):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(s.stop() for s in self.sims), return_exceptions=True)

    async def __aenter__(self) -> SimGroup:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def _serve(engines: list[SimConfig], ready: Callable[[int, Sim], None]) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    group = SimGroup(engines)
    try:
        await group.start()
    except OSError as e:
        print(f"fleetwarden sim: cannot listen: {e.strerror or e}", file=sys.stderr)
        return 1
    for i, sim in enumerate(group.sims):
        ready(i, sim)
    stopping = asyncio.ensure_future(stop.wait())
    ended = asyncio.ensure_future(group.all_exited.wait())
    try:
        await asyncio.wait({stopping, ended}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        ended.cancel()
        await group.stop()
    return 1 if group.all_exited.is_set() else 0


def serve_many(base: SimConfig, engines: int) -> int:
    """Run ``engines`` simulated engines in this process until SIGTERM/SIGINT (status 0), or
    until every one has crashed (1).

    Prints one ``ready URL pid=N engine=I ...`` line per engine on stdout once all listen, in
    engine order, then ``all ready N``.
    """
    all_configs = configs(base, engines)
    limit = raise_file_limit(files_needed(engines))
    if limit < files_needed(engines):
        print(f"fleetwarden sim: {engines} engines may need {files_needed(engines)} open files; "
              f"this process may open {limit}", file=sys.stderr)

    def ready(i: int, sim: Sim) -> None:
        c = sim.config
        print(f"ready {sim.url} pid={os.getpid()} engine={i} model={c.model} slots={c.slots} "
              f"steps_per_s={c.steps_per_s:g} fault={c.fault or 'none'}")
        if i == engines - 1:
            print(f"all ready {engines}", flush=True)

    with loop_runner() as runner:
        code: int = runner.run(_serve(all_configs, ready))
    sys.stdout.flush()
    return code

