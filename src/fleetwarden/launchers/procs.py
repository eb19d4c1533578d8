"""Process groups as ``/proc`` shows them: the engine processes a launcher and ``chaos`` act on.

Owns: process groups as ``/proc`` shows them, and signals to them.
Must not: know shards or health: it speaks of processes only.

A local engine runs in a process group of its own (``setsid``); for vLLM that group holds the
API server, ``VLLM::EngineCore``, ``VLLM::Worker`` and helpers such as a resource tracker.
Killing only the API server orphans the engine core and its worker, which hold gigabytes for
good, so an engine is stopped as a group and the stop is verified (:func:`terminate_group`).

Rules:
- Read ``/proc`` only (Linux); no psutil. Every reader tolerates a process that exits while it
  is being read: it is then simply absent.
- Zombies are not members: a zombie holds no memory, runs nothing and cannot be signalled
  into doing anything; it waits for its parent to reap it.
- A PID alone is no identity (PIDs are reused). A caller that keeps a PID across time keeps its
  :attr:`ProcessInfo.start_ticks` too and checks it before signalling (:func:`signal_process`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "GroupStop",
    "ProcessInfo",
    "boot_time",
    "find_group_member",
    "group_members",
    "kill_and_reap",
    "listening_processes",
    "process_info",
    "process_start_ticks",
    "process_start_time",
    "signal_group_member",
    "signal_process",
    "spawn_group",
    "terminate_group",
    "wait_group_empty",
]

_PROC = Path("/proc")
_GONE_STATES = frozenset("ZX")  # zombie, dead


@dataclass(frozen=True)
class ProcessInfo:
    """One process, read from ``/proc/PID/stat`` and ``/proc/PID/cmdline``."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str  # R, S, D, T (stopped), t, Z, X, I
    comm: str  # the kernel's name: at most 15 bytes (a process title is cut there)
    start_ticks: int  # field 22: clock ticks after boot; with pid, the identity of a process
    cmdline: tuple[str, ...]

    @property
    def title(self) -> str:
        """What ``ps`` shows: the command line, or ``[comm]`` for a kernel thread."""
        return " ".join(self.cmdline) if self.cmdline else f"[{self.comm}]"

    @property
    def stopped(self) -> bool:
        return self.state in ("T", "t")

    def is_named(self, name: str) -> bool:
        """True when ``name`` is this process's title (``setproctitle``), program or comm.

        vLLM titles its processes ``VLLM::EngineCore`` and ``VLLM::Worker``; a title rewrites
        the command line, and comm keeps only its first 15 bytes (``VLLM::EngineCor``), so
        both are checked.
        """
        if self.cmdline:
            first = self.cmdline[0]
            if first == name or first.split(" ", 1)[0] == name or Path(first).name == name:
                return True
        return self.comm == name[:15]


@dataclass(frozen=True)
class GroupStop:
    """What :func:`terminate_group` did."""

    pgid: int
    members_at_start: int
    killed: bool  # SIGTERM was not enough: the group got SIGKILL after the grace period
    seconds: float  # until no member was left
    left: tuple[ProcessInfo, ...]  # members still alive at the end (empty on success)

    @property
    def clean(self) -> bool:
        return not self.left


def process_info(pid: int) -> ProcessInfo | None:
    """The process ``pid``, or None when there is none (or it exited while being read)."""
    try:
        stat = (_PROC / str(pid) / "stat").read_bytes()
        raw_cmd = (_PROC / str(pid) / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return _parse(pid, stat, raw_cmd)


#: ``/proc/net/tcp``'s state of a listening socket (TCP_LISTEN).
_TCP_LISTEN = "0A"


def listening_processes(port: int) -> list[ProcessInfo]:
    """The processes holding a TCP socket that listens on ``port`` (any address, IPv4 or 6):
    the sockets' inodes from ``/proc/net/tcp*``, their holders from ``/proc/*/fd``. Empty when
    none is found (or the holder's ``fd`` cannot be read: another user's process)."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in (_PROC / "net" / table).read_text().splitlines()[1:]:
                fields = line.split()
                if (len(fields) > 9 and fields[3] == _TCP_LISTEN
                        and int(fields[1].rsplit(":", 1)[1], 16) == port):
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return []
    holders = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # it exited, or it is not ours to read
            continue
        info = process_info(int(entry.name)) if any(_links_to(fd, inodes) for fd in fds) else None
        if info is not None:
            holders.append(info)
    return holders


def _links_to(fd: Path, inodes: set[str]) -> bool:
    """Whether ``fd`` (a ``/proc/PID/fd`` entry) is one of ``inodes``. An fd closed since its
    directory was listed is none of them: listing this process's own directory opens an fd
    and closes it before it is read, and taken as the process gone, it hid every socket this
    process holds whose number came after it."""
    try:
        return os.readlink(fd) in inodes
    except OSError:
        return False


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of ``/proc/PID/stat``: when the process started, in clock ticks after boot."""
    info = process_info(pid)
    return info.start_ticks if info else None


def process_start_time(pid: int) -> float | None:
    """When the process started, in seconds since the epoch (to 1 / ``SC_CLK_TCK``)."""
    ticks = process_start_ticks(pid)
    return None if ticks is None else boot_time() + ticks / os.sysconf("SC_CLK_TCK")


def boot_time() -> float:
    """The ``btime`` line of ``/proc/stat``: when the machine booted, in epoch seconds."""
    for line in (_PROC / "stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise RuntimeError("/proc/stat has no btime line")


def group_members(pgid: int) -> list[ProcessInfo]:
    """The live (not zombie) processes of process group ``pgid``, in PID order."""
    members = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        info = process_info(int(entry.name))
        if info and info.pgid == pgid and info.state not in _GONE_STATES:
            members.append(info)
    return sorted(members, key=lambda p: p.pid)


def describe_group(pgid: int,
                   shown: Callable[[list[str]], list[str]] = lambda argv: argv) -> list[str]:
    """One line per live member of group ``pgid``: what a start that never finished was doing
    when it was given up (its state, where the kernel has it waiting, CPU seconds, threads).
    A start that hangs before the engine prints anything leaves nothing else to go on.
    ``shown``: each command line as it may be shown (a launcher hides its keys)."""
    lines = []
    for p in group_members(pgid):
        base = _PROC / str(p.pid)
        try:
            wchan = (base / "wchan").read_text().strip() or "-"
            fields = (base / "stat").read_bytes().rsplit(b")", 1)[1].split()
            status = (base / "status").read_text()
        except OSError:
            continue  # it ended while being read
        ticks = os.sysconf("SC_CLK_TCK")
        cpu_s = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14, 15)
        field = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        # What the scheduler gives it: its nice and policy (stat fields 19 and 41), the CPUs
        # it may run on, how often it gave up or lost the CPU, and its threads by state: a
        # runnable start that gets no CPU shows here.
        sched = (f"nice {int(fields[16])} policy {int(fields[38])} "
                 f"cpus {field.get('Cpus_allowed_list', '?').strip()} "
                 f"switches {field.get('voluntary_ctxt_switches', '?').strip()}/"
                 f"{field.get('nonvoluntary_ctxt_switches', '?').strip()}")
        title = " ".join(shown(list(p.cmdline))) if p.cmdline else f"[{p.comm}]"
        lines.append(f"pid {p.pid} state {p.state} wchan {wchan} cpu {cpu_s:.1f} s "
                     f"threads {field.get('Threads', '?').strip()} ({_thread_states(base)}) "
                     f"{sched}: {title[:160]!r}")
    return lines


def _thread_states(base: Path) -> str:
    """``base``'s threads counted by state (``R 2 S 30``), "?" where they cannot be read."""
    counts: dict[str, int] = {}
    try:
        for task in (base / "task").iterdir():
            with contextlib.suppress(OSError, IndexError):
                state = (task / "stat").read_bytes().rsplit(b")", 1)[1].split()[0].decode()
                counts[state] = counts.get(state, 0) + 1
    except OSError:
        return "?"
    return " ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def find_group_member(pgid: int, name: str) -> ProcessInfo | None:
    """The member of group ``pgid`` named ``name`` (see :meth:`ProcessInfo.is_named`), the
    oldest one if several are."""
    found = [p for p in group_members(pgid) if p.is_named(name)]
    return min(found, key=lambda p: (p.start_ticks, p.pid)) if found else None


def signal_process(pid: int, start_ticks: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process that started at ``start_ticks``.

    Returns False when that process is gone (or a new one took its PID). The check and the
    kill are two steps; the window between them is microseconds, against PID reuse that takes
    the whole PID space to wrap around.
    """
    info = process_info(pid)
    if info is None or info.start_ticks != start_ticks or info.state in _GONE_STATES:
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def signal_group_member(pgid: int, name: str, sig: int) -> ProcessInfo:
    """Send ``sig`` to the member of group ``pgid`` named ``name`` and return it.

    Raises :class:`ProcessLookupError` when the group has no such member (or it exited before
    the signal reached it).
    """
    member = find_group_member(pgid, name)
    if member is None or not signal_process(member.pid, member.start_ticks, sig):
        raise ProcessLookupError(f"process group {pgid} has no live process named {name!r}")
    return member


def wait_group_empty(pgid: int, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Poll until group ``pgid`` has no live member; False if some are left at the timeout."""
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def terminate_group(pgid: int, grace_s: float = 10.0, kill_wait_s: float = 5.0) -> GroupStop:
    """Stop a whole process group: SIGTERM, then SIGKILL after ``grace_s``, then verify.

    A stopped (SIGSTOP) member would never act on SIGTERM, so the group gets SIGCONT right
    after it. Blocking: an event loop calls it through ``asyncio.to_thread``.
    """
    started = time.monotonic()
    at_start = len(group_members(pgid))
    killed = False
    if at_start:
        _kill_group(pgid, signal.SIGTERM)
        _kill_group(pgid, signal.SIGCONT)
        if not wait_group_empty(pgid, grace_s):
            killed = True
            _kill_group(pgid, signal.SIGKILL)
            wait_group_empty(pgid, kill_wait_s)
    return GroupStop(pgid=pgid, members_at_start=at_start, killed=killed,
                     seconds=time.monotonic() - started, left=tuple(group_members(pgid)))


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group emptied meanwhile
        os.killpg(pgid, sig)


def _parse(pid: int, stat: bytes, raw_cmd: bytes) -> ProcessInfo | None:
    # "pid (comm) state ppid pgrp session ..." — comm may hold spaces and parentheses, so it
    # ends at the last ')'.
    text = stat.decode(errors="replace")
    open_, close = text.find("("), text.rfind(")")
    if open_ < 0 or close < 0:
        return None
    rest = text[close + 2:].split()
    if len(rest) < 20:
        return None
    # rest[0] is field 3 (state); field N is rest[N - 3].
    cmdline = tuple(a for a in raw_cmd.decode(errors="replace").split("\0") if a)
    return ProcessInfo(pid=pid, ppid=int(rest[1]), pgid=int(rest[2]), sid=int(rest[3]),
                       state=rest[0], comm=text[open_ + 1:close], start_ticks=int(rest[19]),
                       cmdline=cmdline)


async def spawn_group(*argv: str, **kwargs: Any) -> asyncio.subprocess.Process:
    """``asyncio.create_subprocess_exec`` in a session (and process group) of its own, that
    never loses a process: cancelled while the process is being set up (a retire, a stop, an
    attempt's timeout), the process may already run; it is then killed with its group and
    reaped before the cancellation goes on. Without this, a cancel at the wrong moment leaves
    a restart command or an engine that nothing will ever stop."""
    creating = asyncio.ensure_future(
        asyncio.create_subprocess_exec(*argv, start_new_session=True, **kwargs))
    try:
        return await asyncio.shield(creating)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await kill_and_reap(await creating)
        raise


async def kill_and_reap(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL ``proc``'s process group (it leads one: :func:`spawn_group`) and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        await asyncio.shield(proc.wait())
