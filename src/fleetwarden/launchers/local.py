"""Engines as local processes, one process group each.

Owns: engines as local process groups: launch, readiness, exit, stop, adoption of an earlier
run's engines.
Must not: decide when: the supervisor does, and the restore policy is ``restore.py``'s.

An engine is started with ``setsid`` (its own session and process group), on a free port, its
output in a log file of its own per incarnation. Stop is SIGTERM to the whole group, SIGKILL
after a grace period, then a check that nothing of the group is left: killing a vLLM API server
alone orphans its EngineCore and Worker, which hold gigabytes for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shlex
import signal
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from fleetwarden.config import FleetConfig, SupervisorConfig
from fleetwarden.launchers import (
    EngineHandle,
    EngineRecord,
    ExitCallback,
    LaunchError,
    LaunchEvents,
)
from fleetwarden.launchers.procs import (
    ProcessInfo,
    describe_group,
    group_members,
    process_info,
    process_start_ticks,
    signal_process,
    spawn_group,
    terminate_group,
)
from fleetwarden.probe import health_status

__all__ = ["LocalLauncher", "carrying", "default_engine_command", "free_port", "kill_launched",
           "launch_id_of", "live_launch_ids", "redacted", "wait_healthy"]

log = logging.getLogger(__name__)

#: Seconds to wait after SIGKILL for the kernel to take the group down.
_KILL_WAIT_S = 5.0
#: Seconds between polls while waiting for an engine or a process group.
_POLL_S = 0.1
#: Free ports asked for before a launch gives up avoiding the URLs shards record.
_PORT_TRIES = 20
#: Seconds one ``/health`` read of a starting engine may take. A live engine answers in
#: milliseconds; a read that hangs longer is abandoned and the next poll tries again, so a
#: slow read never holds the wait past ``startup_timeout_s`` by more than this.
HEALTH_READ_TIMEOUT_S = 2.0


def default_engine_command() -> str:
    """A simulated vLLM engine: what `fleetwarden up` runs when no engine command is given."""
    return "{python} -m fleetwarden sim --host {host} --port {port}"


def free_port(host: str) -> int:
    """A port free now: anything may take it before the caller binds it (an outgoing
    connection's local port, another server). For a process whose start must not fail on that,
    :func:`reserve_port`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def reserve_port(host: str) -> socket.socket:
    """A port of ``host`` held for a process that will listen on it with ``SO_REUSEPORT``:
    a socket bound to it with ``SO_REUSEPORT``, never listening, that the caller keeps until
    that process listens (or for as long as such processes come and go). While it is bound, a
    bind without ``SO_REUSEPORT`` (``SO_REUSEADDR`` or not) is refused and the kernel hands the
    port to no other bind to port 0 nor, as its local port, to an outgoing connection; a
    listener of the same user with ``SO_REUSEPORT`` shares it and takes every connection (a
    socket that does not listen takes none). :func:`free_port`'s port is free only until its
    probe closes."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, 0))
    except BaseException:
        sock.close()
        raise
    return sock


#: prctl(2) option: the signal this process gets when the thread that forked it ends.
_PR_SET_PDEATHSIG = 1


def _term_when_parent_dies() -> None:
    """In the child, before exec: SIGTERM when fleetwarden dies, however it dies (Linux).
    An engine then stops its own children as on any SIGTERM (vLLM's API server ends its
    EngineCore). The fork happens on the event loop's thread, which lives as long as
    fleetwarden does."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def launch_id_of(pid: int) -> str | None:
    """FLEETWARDEN_LAUNCH_ID from a process's environment (children inherit it)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for item in env.split(b"\0"):
        if item.startswith(b"FLEETWARDEN_LAUNCH_ID="):
            return item.split(b"=", 1)[1].decode(errors="replace")
    return None


def carrying(launch_ids: set[str]) -> list[tuple[str, ProcessInfo]]:
    """Every live process whose environment carries one of ``launch_ids``, with the one it
    carries (an engine may be several processes: a shell and its child, a server and its
    engine core)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        launch_id = launch_id_of(int(entry.name))
        if launch_id is not None and launch_id in launch_ids:
            info = process_info(int(entry.name))
            if info is not None and info.state not in ("Z", "X"):
                found.append((launch_id, info))
    return found


def live_launch_ids(launch_ids: set[str]) -> set[str]:
    """Which of ``launch_ids`` a live process still carries. What a check that nothing was
    left behind reads."""
    return {launch_id for launch_id, _ in carrying(launch_ids)}


def kill_launched(launch_ids: set[str]) -> int:
    """SIGKILL every live process carrying one of ``launch_ids`` (a test's or benchmark's last
    resort after a failure, so nothing it started outlives it). Returns how many."""
    killed = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and launch_id_of(int(entry.name)) in launch_ids:
            info = process_info(int(entry.name))
            if info is not None and signal_process(info.pid, info.start_ticks, signal.SIGKILL):
                killed += 1
    return killed


def _alive(p: ProcessInfo) -> bool:
    now = process_info(p.pid)
    return now is not None and now.start_ticks == p.start_ticks and now.state not in ("Z", "X")


async def _pid_exit(pid: int) -> int:
    """Wait for a process that is not our child to exit (Linux pidfd). Its exit status is not
    ours to read: -1."""
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return -1
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return -1


async def wait_healthy(handle: EngineHandle, timeout_s: float, hint: str) -> None:
    """Return when ``handle.url`` answers ``/health`` with 200; :class:`LaunchError` (ending
    with ``hint``, e.g. where the log is) when the engine ends first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    timeout = aiohttp.ClientTimeout(total=HEALTH_READ_TIMEOUT_S)
    last = "no answer yet"
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < deadline:
            if handle.exited:
                raise LaunchError(f"{handle.exit_description} while starting; {hint}")
            status = await health_status(session, handle.url + "/health")
            if status == 200:
                return
            last = f"/health answered {status}" if isinstance(status, int) else status
            await asyncio.sleep(_POLL_S * 2)
    raise LaunchError(f"no /health 200 within {timeout_s:g} s ({last}); {hint}")



#: Options whose value is a key: never written to an engine's log as given.
_KEY_OPTIONS = ("--api-key",)


def redacted(argv: list[str]) -> list[str]:
    """``argv`` as an engine's log may show it: the value of ``--api-key`` (``--api-key K``
    or ``--api-key=K``) as ``***``. A key belongs in a file or a variable
    (docs/operations.md, "Engines with API keys"); one written in a command is at least not
    copied into every log."""
    out: list[str] = []
    hide = False
    for arg in argv:
        if hide:
            out.append("***")
            hide = False
        elif arg in _KEY_OPTIONS:
            out.append(arg)
            hide = True
        elif arg.startswith(tuple(o + "=" for o in _KEY_OPTIONS)):
            out.append(arg.split("=", 1)[0] + "=***")
        else:
            out.append(arg)
    return out

class LocalLauncher:
    """Starts engines from ``fleet.engine_cmd`` as local process groups."""

    def __init__(
        self,
        fleet: FleetConfig,
        supervisor: SupervisorConfig,
        on_exit: ExitCallback,
        *,
        log_dir: Path | None = None,
    ) -> None:
        self.fleet = fleet
        self.grace_s = supervisor.stop_grace_s
        self.template = fleet.engine_cmd or default_engine_command()
        self.log_dir = log_dir or fleet.log_dir
        self._on_exit = on_exit
        #: Told of every engine started and stopped (the journal keeps them, so a restarted
        #: fleetwarden knows what an earlier run left running).
        self.events: LaunchEvents | None = None
        #: The URLs the fleet's shards record (the fleet sets it once its ledger exists).
        self.taken_urls: Callable[[], set[str]] | None = None
        self._handles: dict[str, EngineHandle] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._procs: dict[str, asyncio.subprocess.Process] = {}

    def _fill(self, text: str, shard: int, port: int) -> str:
        return text.format(python=sys.executable, host=self.fleet.host, port=port, shard=shard)

    def _port(self) -> int:
        """A free port whose URL no shard records: the kernel may hand back the port of a DEAD
        or RETIRED shard's engine, and two shards on one URL would share their evidence."""
        taken = self.taken_urls() if self.taken_urls is not None else set()
        for _ in range(_PORT_TRIES):
            port = free_port(self.fleet.host)
            if f"http://{self.fleet.host}:{port}" not in taken:
                return port
        return port  # the ledger refuses the load: one failed attempt, and the next tries again

    async def launch(self, shard: int) -> EngineHandle:
        port = self._port()
        launch_id = f"s{shard}-{uuid.uuid4().hex[:12]}"
        group = self.fleet.group_of(shard)  # a mixed fleet: the group's own command
        template = group.engine_cmd if group is not None else self.template
        extra = {**self.fleet.engine_env, **(group.engine_env if group is not None else {})}
        argv = shlex.split(self._fill(template, shard, port))
        env = dict(os.environ)
        env.update({k: self._fill(v, shard, port) for k, v in extra.items()})
        env.update(FLEETWARDEN_LAUNCH_ID=launch_id, FLEETWARDEN_SHARD=str(shard))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"shard-{shard}-{launch_id}.log"
        handle = EngineHandle(shard=shard, url=f"http://{self.fleet.host}:{port}",
                              launch_id=launch_id, log_path=log_path, launched_at=time.time())
        if self.events is not None:
            # Journaled before the spawn (docs/design.md, "The supervisor and launchers"): an
            # engine whose PID never reaches the journal is still named by its launch id, and
            # the next run stops it. A synchronous SQLite commit (an fsync, seconds on a busy
            # disk): off the loop.
            await asyncio.to_thread(self.events.launching, handle)
        with open(log_path, "ab") as out:  # noqa: ASYNC230 - a local create, microseconds
            out.write(f"# fleetwarden: {shlex.join(redacted(argv))}\n".encode())
            out.flush()
            try:
                proc = await spawn_group(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                    stderr=asyncio.subprocess.STDOUT, env=env,
                    preexec_fn=None if self.fleet.engines_outlive_fleetwarden
                    else _term_when_parent_dies,
                )
            except OSError as exc:
                if self.events is not None:  # no process: its record is closed at once
                    await asyncio.to_thread(self.events.stopped, handle)
                raise LaunchError(f"shard {shard}: cannot start {argv[0]!r}: {exc}") from exc
        handle.pid = handle.pgid = proc.pid
        handle.proc_start_ticks = process_start_ticks(proc.pid)
        self._handles[launch_id] = handle
        self._procs[launch_id] = proc
        if self.events is not None:
            # A synchronous SQLite commit (an fsync, seconds on a busy disk): off the loop.
            await asyncio.to_thread(self.events.launched, handle)
        self._watchers[launch_id] = asyncio.create_task(
            self._watch(handle, proc.wait()), name=f"watch:{launch_id}"
        )
        log.info("shard %d: launched pid %d at %s (log %s)", shard, proc.pid, handle.url, log_path)
        return handle

    async def _watch(self, handle: EngineHandle, exited: Awaitable[int]) -> None:
        handle.returncode = await exited
        if not handle.stopping:
            log.warning("shard %d: engine pid %s exited with code %s",
                        handle.shard, handle.pid, handle.returncode)
            self._on_exit(handle)

    # ------------------------------------------------------------------ an earlier run's engines

    def adoptable(self, saved: EngineRecord) -> bool:
        """The process an earlier run started is still that process: its PID is alive with the
        same start time, and its environment carries the same launch id. A reused PID fails
        the start time or the launch id, and is never adopted (nor signalled)."""
        info = process_info(saved.pid)
        return (info is not None and info.start_ticks == saved.proc_start_ticks
                and info.state not in ("Z", "X") and launch_id_of(saved.pid) == saved.launch_id)

    async def adopt(self, saved: EngineRecord) -> EngineHandle:
        """Take charge of an engine an earlier run started (check :meth:`adoptable` first).
        It is not this process's child: its exit is watched through a pidfd."""
        handle = EngineHandle(
            shard=saved.shard, url=saved.url, launch_id=saved.launch_id, pid=saved.pid,
            pgid=saved.pgid, proc_start_ticks=saved.proc_start_ticks,
            log_path=Path(saved.log_path) if saved.log_path else None,
            launched_at=saved.launched_at,
        )
        self._handles[handle.launch_id] = handle
        self._watchers[handle.launch_id] = asyncio.create_task(
            self._watch(handle, _pid_exit(saved.pid)), name=f"watch:{handle.launch_id}"
        )
        log.info("shard %d: adopted pid %d at %s from an earlier run", handle.shard, saved.pid,
                 handle.url)
        return handle

    async def stop_leftover(self, saved: EngineRecord) -> int:
        """Stop what is left of an earlier run's engine that is not adopted: the members of its
        process group that carry its launch id (an orphaned engine core holds gigabytes).
        Returns how many processes were stopped; a process without the launch id is never
        touched."""
        members = [p for p in await asyncio.to_thread(group_members, saved.pgid)
                   if launch_id_of(p.pid) == saved.launch_id]
        return await self._stop_members(members, saved.shard, saved.launch_id)

    async def stop_unrecorded(self, shard: int, launch_id: str) -> int:
        """Stop what runs of an earlier run's launch whose PID the journal never recorded
        (only its intent, written before the spawn): every live process whose environment
        carries ``launch_id``, wherever its group. Returns how many; a process without the
        launch id is never touched."""
        found = await asyncio.to_thread(carrying, {launch_id})
        return await self._stop_members([p for _, p in found], shard, launch_id)

    async def _stop_members(self, members: list[ProcessInfo], shard: int,
                            launch_id: str) -> int:
        """SIGTERM (and SIGCONT, for a stopped one) to each of ``members``, SIGKILL to those
        alive after the grace. Each signal names the start time: a PID reused meanwhile is
        never signalled."""
        if not members:
            return 0
        for p in members:
            signal_process(p.pid, p.start_ticks, signal.SIGTERM)
            signal_process(p.pid, p.start_ticks, signal.SIGCONT)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in members):  # noqa: ASYNC110
            await asyncio.sleep(_POLL_S)  # /proc has no event to wait on
        for p in members:
            if _alive(p):
                signal_process(p.pid, p.start_ticks, signal.SIGKILL)
        log.warning("shard %d: stopped %d leftover process(es) of %s from an earlier run",
                    shard, len(members), launch_id)
        return len(members)

    async def wait_ready(self, handle: EngineHandle, timeout_s: float) -> None:
        try:
            await wait_healthy(handle, timeout_s, f"see {handle.log_path}")
        except (LaunchError, asyncio.CancelledError):
            # given up (its own timeout, or the attempt's): say in its log what it was doing
            if not handle.exited and handle.pgid is not None and handle.log_path is not None:
                snapshot = describe_group(handle.pgid, redacted)
                with open(handle.log_path, "a") as out:  # noqa: ASYNC230 - a few lines
                    out.write("# fleetwarden: not ready; its processes now:\n"
                              + "".join(f"#   {line}\n" for line in snapshot or ["none"]))
            raise

    async def stop(self, handle: EngineHandle) -> None:
        handle.stopping = True
        left: tuple[ProcessInfo, ...] = ()
        if handle.pgid is not None and self._owns(handle):
            stopped = await asyncio.to_thread(
                terminate_group, handle.pgid, self.grace_s, _KILL_WAIT_S
            )
            left = stopped.left
        watcher = self._watchers.pop(handle.launch_id, None)
        if watcher is not None:
            proc = self._procs.get(handle.launch_id)
            if proc is not None and proc.returncode is None and not left:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(watcher), _KILL_WAIT_S)
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        self._handles.pop(handle.launch_id, None)
        self._procs.pop(handle.launch_id, None)
        if self.events is not None and not left:
            await asyncio.to_thread(self.events.stopped, handle)
        if left:
            raise LaunchError(f"shard {handle.shard}: processes {[p.pid for p in left]} of "
                              f"group {handle.pgid} survived SIGKILL")
        log.info("shard %d: engine %s stopped", handle.shard, handle.launch_id)

    def _owns(self, handle: EngineHandle) -> bool:
        """The group is ours: its leader is our child, or was (same start time), or it is gone
        and only its members remain (a PGID cannot be reused while any member lives)."""
        if handle.pid is None:
            return False
        ticks = process_start_ticks(handle.pid)
        return ticks is None or ticks == handle.proc_start_ticks

    async def close(self) -> None:
        handles = list(self._handles.values())
        results = await asyncio.gather(*(self.stop(h) for h in handles), return_exceptions=True)
        failed = [f"shard {h.shard}: {r}" for h, r in zip(handles, results, strict=True)
                  if isinstance(r, BaseException)]
        if failed:
            raise LaunchError("; ".join(failed))

    @property
    def handles(self) -> list[EngineHandle]:
        return list(self._handles.values())
