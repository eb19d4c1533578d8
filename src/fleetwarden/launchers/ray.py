"""Engines as Ray actors, placed anywhere in a Ray cluster: how a fleet grows past one machine.

Owns: engines as Ray actors: placement, launch through the keeper, exit, stop.
Must not: decide when: the supervisor does.

Each engine incarnation is one Ray actor, placed by Ray on a node with ``fleet.ray_resources``
free (``{"GPU": 1}``, or a custom resource). On that node the actor starts the engine from the
same command template as the local launcher — ``{host}`` is the node's IP, ``{port}`` a free
port there, ``{python}`` the node's Python — through a *keeper* (:mod:`.keeper`): a detached
process that owns the engine's process group and stops all of it when the actor asks, when the
engine exits, or when the actor is gone however it went (``ray.kill``, a lost raylet). The actor
reports the engine's URL (node IP and port) and its incarnation (launch id, PID, start time).

Only engines move: the controller, ledger and router stay in the process that runs this
launcher. Restart is stop (the keeper empties the group, verified; then ``ray.kill``) and a new
actor wherever the resources allow.

Death is conclusive and reported through the exit callback the moment Ray surfaces it: a
watcher awaits ``wait_exit`` on each actor, a method that returns only when the engine process
has ended. It returns the engine's exit code when the engine exits; it raises
:class:`~ray.exceptions.ActorDiedError` when the actor died (killed, its worker crashed, or its
node was declared dead). :class:`~ray.exceptions.ActorUnavailableError` only says that Ray
cannot reach the actor right now: the watcher asks again until Ray knows.

Rules:
- Every call into Ray that may block (connect, create, kill, cluster state) runs in a thread;
  results are awaited as futures. The router's loop never waits on Ray.
- The launcher never touches the ledger; it reports exits, the supervisor condemns.
- A fleetwarden process that dies takes its actors with it (they are not detached), and each
  actor's keeper then stops its engine: nothing runs on without an owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import ray
    from ray.exceptions import ActorUnavailableError, RayActorError, RayError, RayTaskError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(f"launcher = 'ray' needs Ray: pip install 'fleetwarden[ray]' ({exc})"
                      ) from exc

from fleetwarden.config import FleetConfig, SupervisorConfig
from fleetwarden.launchers import EngineHandle, ExitCallback, LaunchError
from fleetwarden.launchers.local import default_engine_command, free_port, wait_healthy
from fleetwarden.launchers.procs import group_members, process_start_ticks, terminate_group

__all__ = ["NAMESPACE", "EngineActor", "RayEngineHandle", "RayLauncher"]

log = logging.getLogger(__name__)

#: The Ray namespace of a connection this launcher opens itself.
NAMESPACE = "fleetwarden"
#: Seconds to wait for a process group to go after SIGKILL (as the local launcher does).
_KILL_WAIT_S = 5.0
#: Seconds a task on a node may take beyond the stop itself: Ray may first start a worker
#: process there (a Python interpreter importing Ray: seconds on a busy machine).
_NODE_TASK_MARGIN_S = 60.0
#: Seconds between asking again after Ray said an actor is unavailable (not yet known dead).
_UNAVAILABLE_RETRY_S = 0.5
#: Seconds to wait for a TCP connection to the GCS before ray.init (which would wait minutes).
_GCS_CONNECT_TIMEOUT_S = 5.0
#: Calls an actor serves at once: wait_exit blocks for the engine's lifetime beside stop.
_ACTOR_CONCURRENCY = 4
#: At close, the longest wait for actor creations still running in their threads (one takes
#: well under a second on a live cluster; Ray's own RPC timeouts bound a dead one).
_CREATE_WAIT_S = 30.0


@dataclass(frozen=True)
class EngineSpec:
    """What an actor needs to start one engine (sent to the node with the call)."""

    shard: int
    launch_id: str
    template: str
    env: dict[str, str]
    log_dir: str
    grace_s: float
    kill_wait_s: float


class EngineActor:
    """Runs inside a Ray worker on the node Ray picked: starts the keeper and, through it, the
    engine; reports where the engine listens; stops it on request.

    Threaded (``max_concurrency``): :meth:`wait_exit` blocks for the engine's whole life while
    :meth:`stop` may be called beside it.
    """

    def __init__(self) -> None:
        self._keeper: subprocess.Popen[bytes] | None = None
        self._started: dict[str, Any] = {}
        self._end: dict[str, Any] = {}
        self._ended = threading.Event()

    def start(self, spec: EngineSpec) -> dict[str, Any]:
        node_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # unannotated in Ray
        port = free_port(node_ip)
        values = {"python": sys.executable, "host": node_ip, "port": port, "shard": spec.shard}
        argv = shlex.split(spec.template.format(**values))
        env = dict(os.environ)  # with what Ray set for this actor, e.g. CUDA_VISIBLE_DEVICES
        env.update({k: v.format(**values) for k, v in spec.env.items()})
        env.update(FLEETWARDEN_LAUNCH_ID=spec.launch_id, FLEETWARDEN_SHARD=str(spec.shard))
        log_dir = Path(spec.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"shard-{spec.shard}-{spec.launch_id}.log"
        keeper_argv = [sys.executable, "-m", "fleetwarden.launchers.keeper",
                       "--grace", str(spec.grace_s), "--kill-wait", str(spec.kill_wait_s),
                       "--log", str(log_path), "--", *argv]
        with open(log_path, "ab") as out:
            out.write(f"# fleetwarden: {shlex.join(argv)}\n".encode())
            out.flush()
            keeper = subprocess.Popen(keeper_argv, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=out, env=env)
        keeper.wait()  # the first keeper process exits as soon as the keeper has detached
        self._keeper = keeper
        first = self._read()
        if first is None or first.get("event") != "started":
            why = first.get("error") if first else "the keeper ended without a word"
            raise RuntimeError(f"engine not started on {node_ip}: {why}; see {log_path}")
        threading.Thread(target=self._follow, name="keeper", daemon=True).start()
        self._started = {
            "node_id": ray.get_runtime_context().get_node_id(), "node_ip": node_ip,
            "port": port, "pid": first["pid"], "start_ticks": first["start_ticks"],
            "start_time": first["start_time"], "keeper_pid": first["keeper_pid"],
            "log_path": str(log_path),
        }
        return self._started

    def _read(self) -> dict[str, Any] | None:
        assert self._keeper is not None and self._keeper.stdout is not None
        line = self._keeper.stdout.readline()
        if not line:
            return None
        event: dict[str, Any] = json.loads(line)
        return event

    def _follow(self) -> None:
        event = self._read()
        while event is not None and event.get("event") != "ended":
            event = self._read()
        # No word at all: the keeper itself was killed; the group's fate is unknown.
        self._end = event or {"event": "ended", "why": "keeper lost", "code": None, "left": []}
        self._ended.set()

    def wait_exit(self) -> dict[str, Any]:
        """Return when the engine has ended (and the keeper emptied its group): how it ended."""
        self._ended.wait()
        return self._end

    def stop(self) -> dict[str, Any]:
        """Stop the engine's whole group through the keeper; then check ``/proc`` here."""
        keeper = self._keeper
        if keeper is not None and keeper.stdin is not None and not self._ended.is_set():
            with contextlib.suppress(OSError):
                keeper.stdin.write(b"stop\n")
                keeper.stdin.flush()
        self._ended.wait()
        end = dict(self._end)
        pid, ticks = self._started.get("pid"), self._started.get("start_ticks")
        if pid is not None:
            end["left"] = _group_left(pid, ticks)
        return end


def _group_left(pgid: int, start_ticks: int | None) -> list[int]:
    """PIDs still alive in the engine's group (none when its leader's PID now names another
    process: a PID is not reused while a group still carries it as its ID)."""
    ticks = process_start_ticks(pgid)
    if ticks is not None and ticks != start_ticks:
        return []
    return [p.pid for p in group_members(pgid)]


def _reap(pgid: int, start_ticks: int | None, grace_s: float, kill_wait_s: float) -> list[int]:
    """A task on the engine's node after its actor died: stop whatever of the group is left
    (the keeper normally has), and say what could not be stopped."""
    if not _group_left(pgid, start_ticks):
        return []
    return [p.pid for p in terminate_group(pgid, grace_s, kill_wait_s).left]


@dataclass(eq=False)
class RayEngineHandle(EngineHandle):
    """A Ray engine: where it runs. ``pid``/``pgid`` stay unset (they name local processes
    that this machine could signal); the engine's own PID is on ``node_ip``."""

    #: The actor's handle (a ``ray.actor.ActorHandle``).
    actor: Any = None
    node_id: str = ""
    node_ip: str = ""
    #: The engine process on its node: its PID (also its process group) and start time.
    engine_pid: int | None = None
    engine_start_ticks: int | None = None
    engine_started_at: float | None = None
    keeper_pid: int | None = None
    #: The incarnation's log file, on the node.
    node_log_path: str = ""
    #: When the launcher saw the engine end (time.monotonic()); None while it runs.
    ended_at: float | None = field(default=None)

    @property
    def where(self) -> str:
        return f"node {self.node_ip or '?'} ({self.node_id[:8] or 'not placed'})"


class RayLauncher:
    """Starts engines from ``fleet.engine_cmd`` in Ray actors across a Ray cluster."""

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
        #: Absolute: the actors run elsewhere, in other working folders.
        self.log_dir = (log_dir or fleet.log_dir).absolute()
        self._on_exit = on_exit
        self._handles: dict[str, RayEngineHandle] = {}
        #: Actor creations still running in their threads (a launch cancelled meanwhile
        #: leaves its thread running): ``close`` waits for them before it disconnects.
        self._creating: set[threading.Event] = set()
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._connect_lock = asyncio.Lock()
        self._connected = False
        #: True when this launcher opened the Ray connection (and so closes it).
        self._owns_connection = False
        self._actor_class: Any = None
        self._reaper: Any = None

    # ------------------------------------------------------------------ connection

    async def connect(self) -> None:
        """Join the cluster (``fleet.ray_address``), or use the process's Ray connection."""
        async with self._connect_lock:
            if self._connected:
                return
            if not ray.is_initialized():
                address = self.fleet.ray_address
                try:
                    # Ray waits minutes for a GCS that is not there; a refused port is clear.
                    await asyncio.to_thread(_check_gcs_port, address)
                    await asyncio.to_thread(ray.init, address=address, namespace=NAMESPACE,
                                            log_to_driver=False)
                except Exception as exc:  # ConnectionError, ValueError, RuntimeError, ...
                    raise LaunchError(f"cannot join the Ray cluster at {address!r}: "
                                      f"{exc}") from exc
                self._owns_connection = True
            self._actor_class = ray.remote(EngineActor)
            self._reaper = ray.remote(_reap)
            self._connected = True
            log.info("joined the Ray cluster at %s", self.fleet.ray_address)

    def _actor_options(self) -> dict[str, Any]:
        custom = dict(self.fleet.ray_resources)  # what is left after Ray's own names
        options: dict[str, Any] = {
            "num_cpus": custom.pop("CPU", 0.0),
            "num_gpus": custom.pop("GPU", 0.0),
            "max_restarts": 0,  # a restart is the supervisor's, within its budget
            "max_concurrency": _ACTOR_CONCURRENCY,
        }
        if "memory" in custom:
            options["memory"] = custom.pop("memory")
        options["resources"] = custom
        if self.fleet.ray_scheduling == "SPREAD":
            options["scheduling_strategy"] = "SPREAD"
        return options

    # ------------------------------------------------------------------ launch

    async def launch(self, shard: int) -> EngineHandle:
        await self.connect()
        launch_id = f"s{shard}-{uuid.uuid4().hex[:12]}"
        options = self._actor_options()
        created = threading.Event()
        self._creating.add(created)

        def create() -> Any:
            try:
                return self._actor_class.options(name=f"fleetwarden-{launch_id}",
                                                 **options).remote()
            finally:
                created.set()

        try:
            actor = await asyncio.to_thread(create)
            self._creating.discard(created)
        except Exception as exc:  # invalid options, lost connection: Ray's own errors vary
            raise LaunchError(f"shard {shard}: cannot create a Ray actor: {exc}") from exc
        handle = RayEngineHandle(shard=shard, url="", launch_id=launch_id,
                                 launched_at=time.time(), actor=actor)
        self._handles[launch_id] = handle
        spec = EngineSpec(shard=shard, launch_id=launch_id, template=self.template,
                          env=dict(self.fleet.engine_env), log_dir=str(self.log_dir),
                          grace_s=self.grace_s, kill_wait_s=_KILL_WAIT_S)
        timeout = self.fleet.startup_timeout_s
        try:
            info: dict[str, Any] = await _result(actor.start.remote(spec), timeout)
        except TimeoutError:
            await self._discard(handle)
            raise LaunchError(
                f"shard {shard}: no node had {self.fleet.ray_resources} free within {timeout:g} s"
                f" (the cluster has {await asyncio.to_thread(_cluster_summary)})") from None
        except RayError as exc:
            await self._discard(handle)
            raise LaunchError(f"shard {shard}: the Ray actor could not start the engine: "
                              f"{_first_line(exc)}") from exc
        host = info["node_ip"]
        host = f"[{host}]" if ":" in host else host
        handle.url = f"http://{host}:{info['port']}"
        handle.node_id, handle.node_ip = info["node_id"], info["node_ip"]
        handle.engine_pid, handle.engine_start_ticks = info["pid"], info["start_ticks"]
        handle.engine_started_at, handle.keeper_pid = info["start_time"], info["keeper_pid"]
        handle.node_log_path = info["log_path"]
        self._watchers[launch_id] = asyncio.create_task(
            self._watch(handle), name=f"watch:{launch_id}")
        log.info("shard %d: launched on %s at %s (pid %s there, log %s)", shard, handle.where,
                 handle.url, handle.engine_pid, handle.node_log_path)
        return handle

    async def _discard(self, handle: RayEngineHandle) -> None:
        """A launch that failed: its actor goes (its keeper, if any, then stops the engine)."""
        handle.stopping = True
        self._handles.pop(handle.launch_id, None)
        await asyncio.to_thread(_kill, handle.actor)

    async def _watch(self, handle: RayEngineHandle) -> None:
        unreachable_since: float | None = None
        while True:
            try:
                end: dict[str, Any] = await _result(handle.actor.wait_exit.remote())
            except ActorUnavailableError as exc:
                # Ray cannot reach the actor now (its node may be dying, or the network
                # blinks); it raises ActorDiedError once it knows the actor is dead.
                if unreachable_since is None:
                    unreachable_since = time.monotonic()
                    log.warning("shard %d: Ray cannot reach its actor on %s (%s); waiting "
                                "for Ray's verdict", handle.shard, handle.where,
                                _first_line(exc))
                await asyncio.sleep(_UNAVAILABLE_RETRY_S)
                continue
            except RayActorError as exc:
                handle.exit_cause = f"its Ray actor died on {handle.where}: {_death_reason(exc)}"
                break
            except RayError as exc:
                handle.exit_cause = f"its Ray actor failed on {handle.where}: {_first_line(exc)}"
                break
            handle.returncode = end.get("code")
            handle.exit_cause = (
                f"engine process exited with code {handle.returncode} on {handle.where}"
                if handle.returncode is not None
                else f"the keeper of its process group was lost on {handle.where}")
            break
        handle.ended_at = time.monotonic()
        if not handle.stopping:
            log.warning("shard %d: %s", handle.shard, handle.exit_cause)
            self._on_exit(handle)

    async def wait_ready(self, handle: EngineHandle, timeout_s: float) -> None:
        where = handle.where if isinstance(handle, RayEngineHandle) else "its node"
        log_path = handle.node_log_path if isinstance(handle, RayEngineHandle) else "?"
        await wait_healthy(handle, timeout_s, f"see {log_path} on {where}")

    # ------------------------------------------------------------------ stop

    async def stop(self, handle: EngineHandle) -> None:
        assert isinstance(handle, RayEngineHandle), handle
        handle.stopping = True
        stop_s = self.grace_s + _KILL_WAIT_S
        left: list[int] | None = None  # None: not verified on the node (yet)
        if handle.engine_pid is not None:
            try:
                end: dict[str, Any] = await _result(handle.actor.stop.remote(), stop_s + 5.0)
                left = list(end.get("left", []))
            except (RayError, TimeoutError) as exc:
                log.info("shard %d: its actor cannot stop it (%s); checking %s",
                         handle.shard, _first_line(exc), handle.where)
        await asyncio.to_thread(_kill, handle.actor)
        if left is None and handle.engine_pid is not None:
            left = await self._reap_on_node(handle, stop_s)
        watcher = self._watchers.pop(handle.launch_id, None)
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        self._handles.pop(handle.launch_id, None)
        if left:
            raise LaunchError(f"shard {handle.shard}: processes {left} of group "
                              f"{handle.engine_pid} on {handle.where} survived SIGKILL")
        log.info("shard %d: engine %s stopped on %s", handle.shard, handle.launch_id,
                 handle.where)

    async def _reap_on_node(self, handle: RayEngineHandle, stop_s: float) -> list[int]:
        """The actor is gone: stop and verify on its node with a one-off task there. A node
        that Ray declared dead cannot be reached; what ran there went with its actor's
        worker (the keeper stops the group when its actor's end of the pipe closes)."""
        if not await asyncio.to_thread(_node_alive, handle.node_id):
            log.info("shard %d: %s is gone; nothing there to stop", handle.shard, handle.where)
            return []
        strategy = NodeAffinitySchedulingStrategy(handle.node_id, soft=False)
        ref = self._reaper.options(num_cpus=0, scheduling_strategy=strategy).remote(
            handle.engine_pid, handle.engine_start_ticks, self.grace_s, _KILL_WAIT_S)
        try:
            left: list[int] = await _result(ref, stop_s + _NODE_TASK_MARGIN_S)
        except (RayError, TimeoutError) as exc:
            if not await asyncio.to_thread(_node_alive, handle.node_id):
                return []  # the node died meanwhile
            raise LaunchError(f"shard {handle.shard}: cannot check on {handle.where} that "
                              f"engine group {handle.engine_pid} is gone: "
                              f"{_first_line(exc)}") from exc
        return left

    async def close(self) -> None:
        handles = list(self._handles.values())
        results = await asyncio.gather(*(self.stop(h) for h in handles), return_exceptions=True)
        failed = [f"shard {h.shard}: {r}" for h, r in zip(handles, results, strict=True)
                  if isinstance(r, BaseException)]
        # An actor creation that ray.shutdown cuts never returns (Ray's get_actor waits on a
        # closed connection), and its thread then holds this process's exit forever (seen in
        # the Ray tier: a fleet stopped while the supervisor retried a failed launch).
        creating = [e for e in self._creating if not e.is_set()]
        self._creating.clear()
        if creating:
            deadline = time.monotonic() + _CREATE_WAIT_S
            await asyncio.to_thread(
                lambda: all(e.wait(max(0.0, deadline - time.monotonic())) for e in creating))
        if self._owns_connection:
            await asyncio.to_thread(ray.shutdown)
            self._owns_connection = self._connected = False
        if failed:
            raise LaunchError("; ".join(failed))

    @property
    def handles(self) -> list[RayEngineHandle]:
        return list(self._handles.values())


async def _result(ref: Any, timeout_s: float | None = None) -> Any:
    """Await a Ray ObjectRef from the event loop (Ray completes the future from its own
    thread), within ``timeout_s``."""
    future = asyncio.wrap_future(ref.future())
    if timeout_s is None:
        return await future
    return await asyncio.wait_for(future, timeout_s)


def _check_gcs_port(address: str) -> None:
    """For a ``host:port`` address, that something listens there (OSError if not)."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return  # "auto", "local", "ray://...": ray.init knows what to do
    socket.create_connection((host.strip("[]"), int(port)), timeout=_GCS_CONNECT_TIMEOUT_S).close()


def _kill(actor: Any) -> None:
    with contextlib.suppress(Exception):  # already dead, or its node is gone: nothing to kill
        ray.kill(actor, no_restart=True)


def _node_alive(node_id: str) -> bool:
    nodes = ray.nodes()  # type: ignore[no-untyped-call]  # unannotated in Ray
    return any(n["NodeID"] == node_id and n["Alive"] for n in nodes)


def _cluster_summary() -> str:
    try:
        total = ray.cluster_resources()  # type: ignore[no-untyped-call]  # unannotated in Ray
        free = ray.available_resources()  # type: ignore[no-untyped-call]  # unannotated in Ray
    except Exception as exc:
        return f"resources unknown: {exc}"
    keys = sorted(k for k in total if not k.startswith("node:") and k != "object_store_memory"
                  and k != "memory")
    return ", ".join(f"{k} {free.get(k, 0):g} free of {total[k]:g}" for k in keys) or "nothing"


def _first_line(exc: BaseException) -> str:
    """The gist of an error. A failure inside an actor method arrives as a RayTaskError
    (also an instance of the original's class) whose text opens with a traceback: the
    original exception is its cause."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, RayTaskError) and isinstance(cause, BaseException):
        exc = cause
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]


def _death_reason(exc: BaseException) -> str:
    """Ray's own words for why the actor died: the lines after its key-value block, e.g.
    "The actor is dead because it was killed by `ray.kill`." or "The actor died because its
    node has died. ..."."""
    lines = [ln.strip() for ln in str(exc).splitlines()[1:]
             if ln.strip() and not ln.startswith("\t")]
    return " ".join(lines)[:300] if lines else _first_line(exc)
