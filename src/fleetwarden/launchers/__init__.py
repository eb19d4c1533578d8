"""Launchers start and stop engine processes; the supervisor decides when.

Owns: what every launcher offers (:class:`Launcher`) and what it hands back
(:class:`EngineHandle`).
Must not: decide when an engine is started or stopped: the supervisor does.

A launcher knows *how* an engine runs (a local process group, a Ray actor, something another
system runs that a command restarts). It never touches the ledger: it reports an engine's exit
through the callback it was given, and the supervisor turns that into ``condemn``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

__all__ = ["EngineHandle", "EngineRecord", "ExitCallback", "LaunchError", "LaunchEvents",
           "Launcher"]


class LaunchError(Exception):
    """An engine could not be started, or did not become ready."""


@dataclass(eq=False)
class EngineHandle:
    """One incarnation of one shard's engine."""

    shard: int
    url: str
    #: Unique per launch; also in the engine's environment as FLEETWARDEN_LAUNCH_ID, so a
    #: restarted fleetwarden can tell its own engines from a process that reused a PID.
    launch_id: str
    pid: int | None = None
    pgid: int | None = None
    #: The process's start time in clock ticks since boot (/proc/PID/stat field 22).
    proc_start_ticks: int | None = None
    log_path: Path | None = None
    #: Wall-clock time of the launch.
    launched_at: float = 0.0
    #: Set when the process has exited (with ``returncode``).
    returncode: int | None = None
    #: True while the supervisor stops it on purpose: that exit is not a failure.
    stopping: bool = field(default=False)
    #: Why the engine ended when a launcher knows more than an exit code, or knows that no
    #: exit code will ever come (a Ray engine whose actor or node died).
    exit_cause: str = ""

    @property
    def incarnation(self) -> str:
        return self.launch_id

    @property
    def exited(self) -> bool:
        return self.returncode is not None or bool(self.exit_cause)

    @property
    def exit_description(self) -> str:
        """How the engine ended, in words: the condemnation's cause."""
        return self.exit_cause or f"engine process exited with code {self.returncode}"


ExitCallback = Callable[[EngineHandle], None]


@dataclass(frozen=True)
class EngineRecord:
    """What the journal keeps of a launched engine, to find it again after a restart of
    fleetwarden (launch id, PID, process group, start time: together they rule out a reused
    PID)."""

    shard: int
    launch_id: str
    url: str
    pid: int
    pgid: int
    proc_start_ticks: int | None
    log_path: str | None
    launched_at: float

    @classmethod
    def of(cls, handle: EngineHandle) -> EngineRecord:
        assert handle.pid is not None and handle.pgid is not None
        return cls(handle.shard, handle.launch_id, handle.url, handle.pid, handle.pgid,
                   handle.proc_start_ticks, str(handle.log_path) if handle.log_path else None,
                   handle.launched_at)

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)

    @staticmethod
    def intent(handle: EngineHandle) -> dict[str, object]:
        """What the journal keeps of a launch before its process exists: a record's fields,
        the PID, process group and start time ``None``. Written before the spawn, so an
        engine whose PID never reached the journal (fleetwarden killed in between, a failed
        write) is still named, by its launch id, for the next run to stop."""
        return {"shard": handle.shard, "launch_id": handle.launch_id, "url": handle.url,
                "pid": None, "pgid": None, "proc_start_ticks": None,
                "log_path": str(handle.log_path) if handle.log_path else None,
                "launched_at": handle.launched_at}


class LaunchEvents(Protocol):
    """Told of every engine process about to start, started and stopped (the journal
    implements it)."""

    def launching(self, handle: EngineHandle) -> None:
        """Before the spawn: ``handle`` has its launch id, URL and log, no PID yet."""
        ...

    def launched(self, handle: EngineHandle) -> None: ...

    def stopped(self, handle: EngineHandle) -> None: ...


class Launcher(Protocol):
    """How engines are started and stopped. ``on_exit`` is called when a process ends."""

    async def launch(self, shard: int) -> EngineHandle: ...

    async def wait_ready(self, handle: EngineHandle, timeout_s: float) -> None:
        """Return when the engine answers; raise :class:`LaunchError` if it cannot."""
        ...

    async def stop(self, handle: EngineHandle) -> None:
        """Stop the engine and everything it started; verify that nothing is left."""
        ...

    async def close(self) -> None:
        """Stop every engine this launcher started; :class:`LaunchError` if any is left."""
        ...
