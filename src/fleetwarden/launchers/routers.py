"""The router as processes of its own: ``[router] workers`` of ``fleetwarden route``, sharing one
port (``SO_REUSEPORT``), each driven by the controller over its control API.

Owns: starting, watching, adopting and stopping router processes, and one link per worker
(:class:`WorkerLink`) that the controller drives like any other router. Must not touch the
ledger or decide anything about health: the controller pushes, the workers obey.

Why processes: a router inside fleetwarden dies with it, and every request in flight dies
with it. A worker runs in a session of its own, so a SIGKILLed fleetwarden leaves it serving
with the last serving set it was pushed. The next run adopts it exactly as it adopts engines:
the journal records each worker at start and stop; a worker is adopted only when its PID is
alive with the recorded start time, its environment carries the recorded launch id, and its
control API answers our token. Anything else recorded as running is stopped (never a process
without the launch id). A clean stop stops every worker: SIGTERM, on which a worker stops
accepting at once and lets what it holds finish, up to ``shutdown_grace_s``.

A worker that exits on its own is started again on the same port, with the last serving set,
after :data:`RESTART_DELAY_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import shlex
import signal
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from fleetwarden.config import RouterConfig
from fleetwarden.launchers import LaunchError
from fleetwarden.launchers.local import (
    _pid_exit,
    _term_when_parent_dies,
    carrying,
    launch_id_of,
    reserve_port,
)
from fleetwarden.launchers.procs import (
    ProcessInfo,
    group_members,
    listening_processes,
    process_info,
    process_start_ticks,
    signal_process,
    terminate_group,
)
from fleetwarden.router.affinity import Predicted
from fleetwarden.router.handover import KeptListeners
from fleetwarden.router.keys import KeysFileError, read_keys
from fleetwarden.router.links import RemoteRouter, RouterLink
from fleetwarden.router.ops import OPERATIONS, SERVING, Operation
from fleetwarden.router.pool import BackendFacts
from fleetwarden.router.settings import RouterSettings
from fleetwarden.router.stats import KeyTally, RouterStats
from fleetwarden.tasks import TaskOwner

if TYPE_CHECKING:
    from fleetwarden.journal import Journal

__all__ = ["RouterRecord", "RouterWorkers", "WorkerLink", "WorkerStatuses", "worker_argv"]

R = TypeVar("R")
log = logging.getLogger(__name__)

#: Seconds a router process may take from launch to its control API answering. A Python
#: process that imports aiohttp starts in about a second; a loaded 2-core machine, several.
START_TIMEOUT_S = 30.0
#: Seconds before a worker that exited on its own is started again: no tight crash loop.
RESTART_DELAY_S = 1.0
#: Seconds between reads of each worker's status (its counters and in-flight requests, for the
#: views and the dashboard's rates).
STATUS_EVERY_S = 1.0
#: Seconds after SIGTERM's grace (the router's own ``shutdown_grace_s``) before SIGKILL.
_STOP_MARGIN_S = 5.0
#: Seconds between polls while waiting for a worker to answer.
_POLL_S = 0.1
#: The longest a reload waits for an old worker to close its listeners (an in-memory close:
#: milliseconds; one that takes longer falls back to closing its own on SIGUSR1).
_STOP_ACCEPTING_S = 3.0


@dataclass(frozen=True)
class RouterRecord:
    """What the journal keeps of a router process, to find it again after a restart."""

    worker: int
    launch_id: str
    url: str
    control_url: str
    pid: int
    pgid: int
    proc_start_ticks: int | None
    log_path: str
    launched_at: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RouterRecord:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


class WorkerLink(RouterLink):
    """One worker slot, as the controller drives it (:class:`~fleetwarden.router.links.RouterLink`).

    The slot outlives its processes: when a worker is replaced, the link talks to the new one.
    It remembers the last push, so a replacement starts with the serving set at once. Each
    operation goes where its row's ``fan`` says (:data:`~fleetwarden.router.ops.Fan`).
    """

    in_process = False

    def __init__(self, worker: int, token: str) -> None:
        self.worker = worker
        self._listeners: list[Callable[[str, str], None]] = []
        self._token = token
        self._remote: RemoteRouter | None = None
        #: The workers this slot's worker replaces in a reload, while they may still take a
        #: request (control URL -> link): each gets every push the slot gets, until it exits.
        #: Both generations accept on the same sockets until the reload closes the old ones'
        #: listeners (seconds, on a loaded machine, while every slot's new worker starts), and a
        #: request on an old one's open connection is served after that: a worker that takes
        #: a request is routed by the last push, or a shard that turned HEALTHY meanwhile is
        #: never routed by it (docs/design.md section 4, "The reload").
        self._predecessors: dict[str, RemoteRouter] = {}
        self.last_push: list[str] = []
        self.last_facts: Mapping[str, BackendFacts] | None = None
        #: The last push's count of shards coming back (resent with it to a new worker).
        self.last_coming = 0
        #: The shards on trial and the Retry-After last pushed: a replacement gets them too.
        #: Every push operation's last arguments, by operation (resent to a new worker).
        self._pushed: dict[Operation[Any], dict[str, Any]] = {}

    @property
    def url(self) -> str:
        """The control URL of the worker now in the slot (the controller's name for it)."""
        return self._remote.url if self._remote is not None else f"router worker {self.worker}"

    @property
    def name(self) -> str:
        return self.url

    def _now(self) -> RemoteRouter:
        if self._remote is None:
            raise ConnectionError(f"router worker {self.worker} is not running")
        return self._remote

    async def connect(self, control_url: str, *, keep_predecessor: bool = False) -> None:
        """Drive the worker at ``control_url`` from now on. ``keep_predecessor`` (a reload):
        the worker driven until now keeps getting every push until :meth:`release` says it
        exited."""
        if keep_predecessor and self._remote is not None:
            self._predecessors[self._remote.url] = self._remote
            self._remote = None
        await self._close_current()
        self._remote = RemoteRouter(control_url, self._token)

    def keep_predecessor(self, control_url: str) -> None:
        """A worker of this slot that a reload replaced and that may still take a request (one
        left draining by a reload that a SIGKILL interrupted): pushes and rescues reach it
        until :meth:`release`."""
        url = control_url.rstrip("/")
        if url not in self._predecessors:
            self._predecessors[url] = RemoteRouter(url, self._token)

    async def release(self, control_url: str) -> None:
        """A predecessor is gone (or back in the slot, a roll-back): no more pushes to it."""
        remote = self._predecessors.pop(control_url.rstrip("/"), None)
        if remote is not None:
            await remote.close()

    async def _close_current(self) -> None:
        if self._remote is not None:
            await self._remote.close()
            self._remote = None

    async def disconnect(self) -> None:
        await self._close_current()
        for url in list(self._predecessors):
            await self.release(url)

    async def call(self, op: Operation[R], **args: Any) -> R:
        """``op`` on the slot's worker (its failure raised), then, for a push or a sum, on
        every predecessor still here (a push even where the slot's worker failed it). A push
        is remembered for a replacement; a sum adds the answers (a request a predecessor holds
        on a wedged engine is rescued like any other, not left until its drain's bound cuts
        it)."""
        if op.fan == "now":
            return await self._now().call(op, **args)
        if op.fan == "push":
            if op is SERVING:
                self.last_push, self.last_facts = list(args["urls"]), args["facts"]
                self.last_coming = args["coming_back"]
            else:
                self._pushed[op] = args
            try:
                return await self._now().call(op, **args)
            finally:
                await self._on_predecessors(op, args)
        result = await self._now().call(op, **args)
        for more in await self._on_predecessors(op, args):
            result += more  # type: ignore[operator]  # a sum's rows answer counts
        return result

    async def _on_predecessors(self, op: Operation[R], args: dict[str, Any]) -> list[R]:
        """``op`` on every predecessor still here: their answers. A predecessor's failure is
        logged, never raised: it is exiting (its drain is over), and the slot's worker got
        the call."""
        answers = []
        for url, remote in list(self._predecessors.items()):
            try:
                answers.append(await remote.call(op, **args))
            except Exception as exc:
                log.info("router worker %d: %s on its predecessor %s failed: %s",
                         self.worker, op.name, url, exc)
        return answers

    async def push_last(self) -> None:
        """Everything last pushed, again: for the process now in the slot (a replacement),
        in the table's order."""
        await self.set_serving_backends(self.last_push, self.last_facts,
                                        coming_back=self.last_coming)
        for op in OPERATIONS:
            if op in self._pushed:
                await self.call(op, **self._pushed[op])

    async def metrics_text(self) -> str:
        return await self._now().metrics_text()

    def listen(self, callback: Callable[[str, str], None]) -> Callable[[], None]:
        """As :meth:`RemoteRouter.listen`, whichever worker is in the slot: each failed
        attempt an evidence answer counts."""
        self._listeners.append(callback)

        def unsubscribe() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return unsubscribe

    def _heard(self, failed: int) -> None:
        for callback in list(self._listeners) * failed:
            callback("", "remote")


class WorkerStatuses:
    """What each worker process last said of itself (its ``GET /status`` and ``/metrics``),
    added up for the views, the dashboard's rates and the fleet's ``/metrics``."""

    def __init__(self) -> None:
        #: Each worker process's last status, by its control URL: during a reload a slot's
        #: old and new workers both count, each once, until the old one is retired.
        self._last: dict[str, dict[str, Any]] = {}
        self._metrics: dict[int, str] = {}
        #: Counters of workers that are gone, so the fleet's totals never go backwards.
        self._gone = RouterStats()

    @property
    def stats(self) -> RouterStats:
        """Every worker's counters added up, as of the last status read (at most
        :data:`STATUS_EVERY_S` old), with those of workers that are gone."""
        total = RouterStats()
        _add(total, self._gone)
        for status in self._last.values():
            _add_status(total, status.get("stats", {}))
        return total

    def in_flight(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for status in self._last.values():
            for url, n in status.get("in_flight", {}).items():
                total[url] = total.get(url, 0) + int(n)
        return total

    def cache_predictions(self) -> dict[str, Predicted]:
        """Every worker's cache-aware tallies per backend added up, as of the last status read
        (each worker keeps its own index: a connection stays with one worker)."""
        total: dict[str, Predicted] = {}
        for status in self._last.values():
            for url, t in status.get("cache", {}).items():
                p = total.setdefault(url, Predicted())
                p.requests += int(t.get("requests", 0))
                p.blocks += int(t.get("blocks", 0))
                p.hit_blocks += int(t.get("predicted_hit_blocks", 0))
        return total

    def collector(self) -> Collector:
        """Every worker's own metrics (each series labelled ``worker="N"``), as last read: for
        the fleet's ``/metrics``, so that one scrape sees the whole router. (A scrape of the
        router's port reaches one worker, whichever the kernel picks.)"""
        return _WorkersCollector(self._metrics)

    def retire(self, worker: int, control_url: str) -> None:
        """The worker process at ``control_url`` of slot ``worker`` is gone, or going: its
        last totals join those of the gone (its own: the slot's new worker may have been
        read already)."""
        self._metrics.pop(worker, None)
        status = self._last.pop(control_url.rstrip("/"), None)
        if status is not None:
            _add_status(self._gone, status.get("stats", {}))

    async def read(self, links: Sequence[WorkerLink]) -> None:
        """Each slot's worker now, read once (one that does not answer keeps its last)."""
        for link in links:
            answering = link.url.rstrip("/")  # the worker now in the slot
            with contextlib.suppress(Exception):
                self._last[answering] = await link.status()
                self._metrics[link.worker] = await link.metrics_text()


def worker_argv(config: RouterConfig, port: int, token_file: Path, worker: int,
                control_port: int, backends: Sequence[str] = (),
                take_from: Sequence[str] = ()) -> list[str]:
    """The command line of router worker ``worker``: every setting as JSON (the keys file's
    path made absolute: the worker's own directory may differ), its first serving set, and
    the launch ids of the workers whose listening sockets it takes (a reload)."""
    settings = {k: getattr(config, k) for k in RouterSettings.__dataclass_fields__}
    if settings["keys_file"] is not None:
        settings["keys_file"] = str(Path(settings["keys_file"]).expanduser().resolve())
    argv = [sys.executable, "-m", "fleetwarden", "route",
            "--host", config.host, "--port", str(port), "--reuse-port",
            "--control-port", str(control_port), "--token-file", str(token_file),
            "--settings-json", json.dumps(settings), "--managed", "--worker", str(worker),
            "--log-level", "info"]
    for url in backends:
        argv += ["--backend", url]
    for launch_id in take_from:
        argv += ["--take-listeners", launch_id]
    return argv


async def _journal_write(write: Callable[..., None], *args: Any) -> None:
    """A journal row, written off the loop (its commit's fsync never holds the workers'
    control). The journal counts and reports a failed write itself; whatever else goes
    wrong is logged here, never raised: a watcher that raised would never start its
    worker again."""
    try:
        await asyncio.to_thread(write, *args)
    except Exception as exc:
        log.error("router workers: a journal write failed: %s", exc)


def _alive(saved: RouterRecord) -> bool:
    info = process_info(saved.pid)
    return (info is not None and info.start_ticks == saved.proc_start_ticks
            and info.state not in ("Z", "X") and launch_id_of(saved.pid) == saved.launch_id)


async def _answers(control_url: str, token: str) -> bool:
    try:
        async with RemoteRouter(control_url, token, timeout_s=3.0) as remote:
            await remote.status()
        return True
    except Exception:
        return False


async def _stop_leftover(saved: RouterRecord, grace_s: float) -> None:
    """Stop what is left of an earlier run's worker that is not adopted: the members of its
    process group that carry its launch id (never a process without it)."""
    members = [p for p in await asyncio.to_thread(group_members, saved.pgid)
               if launch_id_of(p.pid) == saved.launch_id]
    if await _stop_all(members, grace_s):
        log.warning("router worker %d: stopped %s of an earlier run (not adoptable)",
                    saved.worker, saved.launch_id)


async def _stop_unrecorded(launch_id: str, grace_s: float) -> None:
    """Stop an earlier run's worker whose PID the journal never recorded (only its intent,
    written before the spawn): every live process carrying ``launch_id``."""
    if await _stop_all([p for _, p in await asyncio.to_thread(carrying, {launch_id})], grace_s):
        log.warning("router workers: stopped %s of an earlier run (its PID never journaled)",
                    launch_id)


async def _stop_all(members: list[ProcessInfo], grace_s: float) -> int:
    """SIGTERM to each of ``members``, SIGKILL to those alive past the grace (and a margin);
    each signal names the start time, so a PID reused meanwhile is never signalled."""
    for p in members:
        signal_process(p.pid, p.start_ticks, signal.SIGTERM)
    deadline = time.monotonic() + grace_s + _STOP_MARGIN_S
    while time.monotonic() < deadline and any(  # noqa: ASYNC110 - /proc has no event
            _same(p.pid, p.start_ticks) for p in members):
        await asyncio.sleep(_POLL_S)
    for p in members:
        signal_process(p.pid, p.start_ticks, signal.SIGKILL)
    return len(members)


@dataclass(eq=False)
class _Process:
    record: RouterRecord
    proc: asyncio.subprocess.Process | None  # None: adopted, not our child
    watcher: asyncio.Task[None] | None = None
    stopping: bool = False


class RouterWorkers:
    """``config.workers`` router processes on one port, adopted or started by :meth:`start`."""

    def __init__(self, config: RouterConfig, token: str, token_file: Path, log_dir: Path,
                 journal: Journal | None = None, *, outlive: bool = True) -> None:
        if config.workers < 1:
            raise ValueError("RouterWorkers needs [router] workers >= 1")
        self.config = config
        self.token = token
        self.token_file = token_file
        self.log_dir = log_dir
        self.journal = journal
        #: False: the workers get SIGTERM when this process dies (as engines do with
        #: ``engines_outlive_fleetwarden = false``): nothing would adopt them.
        self.outlive = outlive
        self.links = [WorkerLink(i, token) for i in range(config.workers)]
        self.port = config.port
        self.adopted = 0
        self.started = 0
        self._procs: dict[int, _Process] = {}
        #: What each worker last said of itself: what the views read.
        self.statuses = WorkerStatuses()
        #: Replaced workers being reaped as they drain (:meth:`_reap`).
        self._reaps = TaskOwner()
        #: Replaced workers still draining (a reload).
        self._replaced: list[_Process] = []
        self._status_task: asyncio.Task[None] | None = None
        self._closing = False
        #: A copy of the listening sockets, so that the lone worker's death leaves its
        #: connections queued for its replacement instead of refused.
        self._kept = KeptListeners(token, enabled=config.workers == 1)
        #: The data port picked for ``port`` 0, held bound while the fleet runs
        #: (:func:`~fleetwarden.launchers.local.reserve_port`).
        self._reserved: socket.socket | None = None
        #: One reload at a time, and a stop waits for the one under way: a reload swaps
        #: ``_procs`` entries for processes it is still starting, so a stop in the middle of
        #: one would miss the generation not yet recorded (docs/design.md section 13).
        self._reloading = asyncio.Lock()

    # ------------------------------------------------------------------ what the views read

    @property
    def url(self) -> str:
        """``http://host:port`` the workers share."""
        return f"http://{self.config.host}:{self.port}"

    @property
    def stats(self) -> RouterStats:
        return self.statuses.stats

    def in_flight(self) -> dict[str, int]:
        return self.statuses.in_flight()

    def cache_predictions(self) -> dict[str, Predicted]:
        return self.statuses.cache_predictions()

    def collector(self) -> Collector:
        return self.statuses.collector()

    # ------------------------------------------------------------------ start / stop

    async def start(self, backends: Sequence[str]) -> None:
        """Adopt the workers an earlier run left serving, stop what is not adoptable, start
        the rest with ``backends`` as their first serving set."""
        await self._adopt_or_stop()
        if self.port == 0:
            # Held while the fleet runs: one picked free and let go may be taken before the
            # first worker binds it, which then exits at start (reserve_port).
            self._reserved = reserve_port(self.config.host)
            self.port = self._reserved.getsockname()[1]
        elif not self.adopted:
            # SO_REUSEPORT lets any process of this user bind a port our workers would share:
            # a second fleet on it would silently take half of the first one's requests.
            # Adopted workers hold the port as ours; with none, whoever holds it is not.
            refuse_if_taken(self.config.host, self.port)
        missing = [link.worker for link in self.links if link.worker not in self._procs]
        if missing and self.config.keys_file is not None:
            try:  # said here, not as workers that exit at start
                read_keys(self.config.keys_file)
            except KeysFileError as exc:
                raise LaunchError(f"[router] keys_file: {exc}") from None
        for worker in missing:
            self.links[worker].last_push = list(backends)
        await asyncio.gather(*(self._launch(worker) for worker in missing))
        self._status_task = asyncio.create_task(self._read_statuses(), name="router-status")

    async def _adopt_or_stop(self) -> None:
        if self.journal is None:
            return
        # Newest first: a fleetwarden killed in the middle of a reload leaves two generations
        # recorded as running, and the newer one holds the listeners (the older may already
        # have closed its own and be draining). Adopting the older and stopping the newer
        # left no listener at all (the fleet model measured connections refused for 30 s).
        for d in reversed(self.journal.running_routers()):
            if d.get("pid") is None:  # its intent only: stopped wherever its launch id runs
                await _stop_unrecorded(str(d.get("launch_id")), self.config.shutdown_grace_s)
                await _journal_write(self.journal.router_stopped, str(d.get("launch_id")))
                continue
            try:
                saved = RouterRecord.from_dict(d)
            except (KeyError, TypeError):
                continue
            port = int(saved.url.rsplit(":", 1)[1])
            fits = (saved.worker < self.config.workers and saved.worker not in self._procs
                    and saved.url.startswith(f"http://{self.config.host}:")
                    and (self.config.port in (0, port))
                    and (self.port in (0, port)))
            holder = self._procs.get(saved.worker)
            if (holder is not None and holder.record.url == saved.url and _alive(saved)
                    and await _answers(saved.control_url, self.token)):
                # The predecessor in its slot of the worker just adopted: a reload that a
                # SIGKILL interrupted. Finish it as the reload would have: stopping it
                # (SIGTERM, up to shutdown_grace_s, then SIGKILL) cut the requests it held,
                # one on a wedged engine among them, which nothing could rescue.
                await self._finish_handover(saved)
                continue
            if fits and _alive(saved) and await _answers(saved.control_url, self.token):
                self.port = port
                self._procs[saved.worker] = _Process(saved, None)
                self._watch(saved.worker, _pid_exit(saved.pid))
                link = self.links[saved.worker]
                await link.connect(saved.control_url)
                await self._kept.keep(saved.worker, saved.launch_id, saved.pid)
                with contextlib.suppress(Exception):  # what it serves: a replacement's start
                    link.last_push = list((await link.status())["serving"])
                self.adopted += 1
                log.info("router worker %d: adopted pid %d on %s from an earlier run",
                         saved.worker, saved.pid, saved.url)
                continue
            await _stop_leftover(saved, self.config.shutdown_grace_s)
            await _journal_write(self.journal.router_stopped, saved.launch_id)

    async def _finish_handover(self, saved: RouterRecord) -> None:
        """A reload's old worker found running beside its adopted replacement: pushed and
        rescued through the slot's link, told to stop accepting, then SIGUSR1 (a drain up to
        ``drain_s``) and reaped as a reload reaps, its stop journaled when it exits."""
        old = _Process(saved, None, stopping=True)
        self.links[saved.worker].keep_predecessor(saved.control_url)
        await self._stop_accepting(old)
        self._drain(old)
        log.warning("router worker %d: %s, replaced by a reload that did not finish, drains "
                    "(up to %g s)", saved.worker, saved.launch_id, self.config.drain_s)

    async def _launch(self, worker: int, take_from: Sequence[str] = ()) -> None:
        """Start worker ``worker``. ``take_from``: launch ids of the workers it replaces (a
        reload); it listens on their listening sockets instead of binding its own."""
        with reserve_port("127.0.0.1") as control:  # held till its API answers there
            await self._launch_on(worker, control.getsockname()[1], take_from)

    async def _launch_on(self, worker: int, control_port: int, take_from: Sequence[str]) -> None:
        launch_id = f"r{worker}-{uuid.uuid4().hex[:12]}"
        argv = worker_argv(self.config, self.port, self.token_file, worker, control_port,
                           self.links[worker].last_push, take_from)
        env = {**os.environ, "FLEETWARDEN_LAUNCH_ID": launch_id}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"router-{worker}-{launch_id}.log"
        if self.journal is not None:  # before the spawn: a SIGKILL after it leaves no orphan
            await _journal_write(self.journal.router_launched, launch_id, worker,
                                 {"launch_id": launch_id, "worker": worker, "pid": None})
        with open(log_path, "ab") as out:  # noqa: ASYNC230 - a local create, microseconds
            out.write(f"# fleetwarden: {shlex.join(argv)}\n".encode())
            out.flush()
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=None if self.outlive else _term_when_parent_dies)
        record = RouterRecord(
            worker=worker, launch_id=launch_id, url=f"http://{self.config.host}:{self.port}",
            control_url=f"http://127.0.0.1:{control_port}", pid=proc.pid, pgid=proc.pid,
            proc_start_ticks=process_start_ticks(proc.pid), log_path=str(log_path),
            launched_at=time.time())
        self._procs[worker] = _Process(record, proc)
        if self.journal is not None:
            await _journal_write(self.journal.router_launched, launch_id, worker,
                                      record.to_dict())
        self._watch(worker, proc.wait())
        await _wait_answering(record, proc, self.token)
        # (A worker started again after a death takes the kept copy: its link has no worker
        # connected, so there is no predecessor to keep.)
        await self.links[worker].connect(record.control_url, keep_predecessor=bool(take_from))
        await self._kept.keep(worker, launch_id, proc.pid)
        self.started += 1
        log.info("router worker %d: pid %d on %s (control %s)", worker, proc.pid, record.url,
                 record.control_url)

    def _watch(self, worker: int, exited: Awaitable[int]) -> None:
        p = self._procs[worker]

        async def watch() -> None:
            code = await exited
            if p.stopping or self._closing:
                return
            log.warning("router worker %d (pid %d) exited with code %s; starting another",
                        worker, p.record.pid, code)
            if self.journal is not None:
                await _journal_write(self.journal.router_stopped, p.record.launch_id)
            self.statuses.retire(worker, p.record.control_url)
            await self.links[worker].disconnect()
            await asyncio.sleep(RESTART_DELAY_S)
            if self._closing or self._procs.get(worker) is not p:
                return
            await self._start_again(worker)

        p.watcher = asyncio.create_task(watch(), name=f"router-watch:{worker}")

    async def _start_again(self, worker: int) -> None:
        """A new worker in slot ``worker``, whose worker died, with the last push, on the
        dead one's listening sockets (kept here: the connections queued since are served)."""
        kept = self._kept.launch_id(worker)
        try:
            await self._launch(worker, [kept] if kept else ())
        except Exception as exc:  # its own watcher starts another once it exits
            log.error("router worker %d: could not start again: %s", worker, exc)
            await self._kept.drop(worker)  # queued with no one to accept: refused instead
            return
        # Its command line names the last serving set, not the facts that go with it
        # (weight versions, the shards on trial): without this push a replacement serves
        # without them until the controller's next change, which may be an hour away.
        await self._push_last(worker)

    async def _read_statuses(self) -> None:
        while not self._closing:
            await self.statuses.read(self.links)
            await asyncio.sleep(STATUS_EVERY_S)

    async def reload(self) -> None:
        """Replace every worker with no request failed: new processes (the code installed
        now) take the old ones' listening sockets (:mod:`fleetwarden.router.handover`), get
        the serving set and take the slots; then each old one gets SIGUSR1: it stops
        accepting and finishes what it holds, up to ``drain_s`` (:meth:`Router.drain`), then
        exits. One still there past that bound (and a margin) is killed. Reloads asked for
        while one is under way run after it; none once the workers are stopping."""
        async with self._reloading:
            if not self._closing:
                await self._reload()

    async def _reload(self) -> None:
        olds = {w: p for w, p in self._procs.items()}
        for old in olds.values():
            old.stopping = True  # its exit is not a failure: nothing is started for it
        # Old worker i's sockets go to new worker i mod N (the count may change with the
        # config): every old socket lives on, so nothing queued on one is ever reset.
        n = len(self.links)
        take_from = {link.worker: [old.record.launch_id for w, old in sorted(olds.items())
                                   if w % n == link.worker] for link in self.links}
        # Every new worker first, then every old one told at once: a client that an old one
        # tells to reconnect finds only new listeners.
        started = await asyncio.gather(*(self._replace(link.worker, take_from[link.worker])
                                         for link in self.links), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            # All or nothing: an old worker that is neither replaced nor driven any more
            # serves a frozen serving set, and one no slot holds outlives the stop.
            await self._roll_back(olds)
            raise LaunchError(f"router reload rolled back, the old workers serve on: "
                              f"{'; '.join(str(e) for e in failed)}")
        # Every old listener closed, and each has said so, before any old router answers a
        # request with "Connection: close": a client reconnecting finds only new listeners (a
        # connection queued at a listener as it closes is reset by the kernel). One that does
        # not answer closes its own on SIGUSR1 and waits HANDOVER_SETTLE_S for the others.
        await asyncio.gather(*(self._stop_accepting(old) for old in olds.values()))
        for worker, old in olds.items():
            self.statuses.retire(worker, old.record.control_url)
            self._drain(old)
        log.info("router workers replaced: %s", [p.record.pid for p in self._procs.values()])

    async def _replace(self, worker: int, take_from: Sequence[str]) -> None:
        """Start slot ``worker``'s new worker and push it everything at once: it accepts
        from its start (on its predecessor's sockets) with only the serving set of its command
        line, and pushes made while it started went to its predecessor alone. Waiting for the
        other slots' new workers first left it serving without them for seconds."""
        await self._launch(worker, take_from)
        await self._push_last(worker)

    def _drain(self, old: _Process) -> None:
        """SIGUSR1 to a replaced worker whose listeners are closed: it finishes what it holds,
        up to ``drain_s``, and exits; :meth:`_reap` waits for that (and kills it past it)."""
        self._replaced.append(old)
        signal_process(old.record.pid, old.record.proc_start_ticks or 0, signal.SIGUSR1)
        self._reaps.start(self._reap(old), f"router-drain:{old.record.worker}")

    async def _roll_back(self, olds: Mapping[int, _Process]) -> None:
        """A reload that could not start every new worker: stop the new ones it started
        (they hold duplicates of the old listeners, which stay open in the old workers: no
        queued connection is lost), put the old ones back in their slots and push them the
        last serving set and its facts, so they are driven as before."""
        news = [p for w, p in self._procs.items() if p is not olds.get(w)]
        for p in news:
            p.stopping = True
        grace_s = self.config.shutdown_grace_s
        results = await asyncio.gather(*(_stop_worker(p, grace_s, self.journal) for p in news),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.error("router reload roll-back: %s", r)
        for worker, old in olds.items():
            await self.links[worker].release(old.record.control_url)
            if not _same(old.record.pid, old.record.proc_start_ticks):
                # It died during the reload, while its exit was no failure (its watcher
                # started nothing): put back, its slot would hold a dead worker that nothing
                # replaces. A new one takes the slot, as after any worker's death.
                log.warning("router worker %d (pid %d) died during the reload; starting "
                            "another", worker, old.record.pid)
                self._procs[worker] = old
                if self.journal is not None:
                    await _journal_write(self.journal.router_stopped,
                                              old.record.launch_id)
                self.statuses.retire(worker, old.record.control_url)
                await self.links[worker].disconnect()
                await self._start_again(worker)
                continue
            old.stopping = False  # its exit is a failure again: another is started for it
            self._procs[worker] = old
            await self.links[worker].connect(old.record.control_url)
            await self._kept.keep(worker, old.record.launch_id, old.record.pid)
            await self._push_last(worker)
        log.error("router reload rolled back: the workers %s serve on",
                  [p.record.pid for p in self._procs.values()])

    async def _push_last(self, worker: int) -> None:
        """Push the last serving set, its facts, the trial set and the Retry-After to the
        worker now in slot ``worker``."""
        try:
            await self.links[worker].push_last()
        except Exception as exc:  # the controller's next push tries again
            log.warning("router worker %d: the last push could not be repeated: %s",
                        worker, exc)

    async def _stop_accepting(self, old: _Process) -> None:
        try:
            async with RemoteRouter(old.record.control_url, self.token,
                                    timeout_s=_STOP_ACCEPTING_S) as remote:
                await remote.stop_accepting()
        except Exception as exc:
            log.warning("router worker %d: its listeners could not be closed ahead of the "
                        "handover (%s); it closes them itself", old.record.worker, exc)

    async def _reap(self, old: _Process) -> None:
        """Wait for a replaced worker to finish its drain; kill it past the bound."""
        try:
            await self._reap_now(old)
        finally:
            with contextlib.suppress(ValueError):
                self._replaced.remove(old)
            await self.links[old.record.worker].release(old.record.control_url)

    async def _reap_now(self, old: _Process) -> None:
        rec = old.record
        deadline = time.monotonic() + self.config.drain_s + _STOP_MARGIN_S
        while _same(rec.pid, rec.proc_start_ticks) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_POLL_S)
        if _same(rec.pid, rec.proc_start_ticks):
            log.warning("router worker %d: %s still draining after %g s: killed", rec.worker,
                        rec.launch_id, self.config.drain_s)
            await asyncio.to_thread(terminate_group, rec.pgid, 0.0, 5.0)
        if old.proc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(old.proc.wait(), 5.0)
        if old.watcher is not None:
            old.watcher.cancel()
        if self.journal is not None:
            await _journal_write(self.journal.router_stopped, rec.launch_id)

    async def stop(self) -> None:
        """Stop every worker (SIGTERM: they stop accepting and finish what they hold, up to
        ``shutdown_grace_s``), verify, and record each stop in the journal."""
        self._closing = True
        async with self._reloading:  # the reload under way, if any, ends first
            pass
        # First: a copy left open would queue connections after the workers stop accepting.
        await self._kept.close()
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None
        if self._status_task is not None:
            self._status_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._status_task
        for link in self.links:
            await link.disconnect()
        # Replaced workers still draining are stopped with the rest: taken before their reaps
        # are cancelled, whose cleanup drops them from ``_replaced`` (awaited, it left them
        # running after a clean stop).
        replaced = list(self._replaced)
        await self._reaps.cancel_all()
        procs = list(self._procs.values()) + replaced
        for p in procs:
            p.stopping = True
        grace_s = self.config.shutdown_grace_s
        results = await asyncio.gather(*(_stop_worker(p, grace_s, self.journal) for p in procs),
                                       return_exceptions=True)
        self._procs.clear()
        failed = [str(r) for r in results if isinstance(r, BaseException)]
        if failed:
            raise LaunchError("; ".join(failed))


async def _wait_answering(record: RouterRecord, proc: asyncio.subprocess.Process,
                          token: str) -> None:
    """Until a starting worker's control API answers; :class:`LaunchError` if it exits first
    or does not answer within ``START_TIMEOUT_S``."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise LaunchError(f"router worker {record.worker} exited with code "
                              f"{proc.returncode} while starting; see {record.log_path}")
        if await _answers(record.control_url, token):
            return
        await asyncio.sleep(_POLL_S)
    raise LaunchError(f"router worker {record.worker}: no control API within "
                      f"{START_TIMEOUT_S:g} s; see {record.log_path}")


async def _stop_worker(p: _Process, grace_s: float, journal: Journal | None) -> None:
    """SIGTERM to a worker's group (it finishes what it holds, up to ``grace_s``), then SIGKILL;
    its stop journaled."""
    rec = p.record
    if _same(rec.pid, rec.proc_start_ticks) or p.proc is not None:
        stopped = await asyncio.to_thread(
            terminate_group, rec.pgid, grace_s + _STOP_MARGIN_S, 5.0)
        if stopped.left:
            raise LaunchError(f"router worker {rec.worker}: processes "
                              f"{[x.pid for x in stopped.left]} survived SIGKILL")
    if p.proc is not None:
        with contextlib.suppress(ProcessLookupError):
            await asyncio.wait_for(p.proc.wait(), 5.0)
    if p.watcher is not None:
        p.watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await p.watcher
    if journal is not None:
        await _journal_write(journal.router_stopped, rec.launch_id)
    log.info("router worker %d: stopped %s", rec.worker, rec.launch_id)


def refuse_if_taken(host: str, port: int) -> None:
    """Raise :class:`LaunchError`, naming the holder, when something listens on ``port``.

    The probe binds without ``SO_REUSEPORT`` (which every router worker sets, so the kernel
    refuses it while any listener holds the port) and with ``SO_REUSEADDR`` (so connections
    of a stopped fleet still in TIME_WAIT do not count).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            return
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise LaunchError(f"router port {port} on {host}: {exc}") from exc
    holders = listening_processes(port)
    named = "; ".join(f"pid {p.pid}: {p.title[:200]}" for p in holders) or (
        "a process this user cannot see")
    raise LaunchError(
        f"router port {port} on {host} is already served by {named}. Another fleet (or "
        "another program) holds it; stop it first, or give this fleet another [router] port")


class _WorkersCollector(Collector):
    def __init__(self, texts: Mapping[int, str]) -> None:
        self._texts = texts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for _, text in sorted(self._texts.items()):
            try:
                parsed = list(text_string_to_metric_families(text))
            except ValueError:
                continue
            for family in parsed:
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()


def _same(pid: int, start_ticks: int | None) -> bool:
    info = process_info(pid)
    return info is not None and info.start_ticks == start_ticks and info.state not in ("Z", "X")


def _add(total: RouterStats, more: RouterStats) -> None:
    total.requests += more.requests
    for status, n in more.responses.items():
        total.responses[status] = total.responses.get(status, 0) + n
    for key, n in more.backend_failures.items():
        total.backend_failures[key] = total.backend_failures.get(key, 0) + n
    for kind, n in more.retries.items():
        total.retries[kind] = total.retries.get(kind, 0) + n
    total.rescues += more.rescues
    total.hedges += more.hedges
    total.hedges_won += more.hedges_won
    total.poison_requests += more.poison_requests
    total.comeback_waits += more.comeback_waits
    total.comeback_served += more.comeback_served
    total.local_exhaustion += more.local_exhaustion
    for reason, n in more.connections_closed.items():
        total.connections_closed[reason] = total.connections_closed.get(reason, 0) + n
    for name, tally in more.keys.items():
        total.key(name).add(tally)
    for why, n in more.key_refusals.items():
        total.key_refusals[why] = total.key_refusals.get(why, 0) + n


def _add_status(total: RouterStats, stats: Mapping[str, Any]) -> None:
    """Add a worker's ``status()["stats"]`` (JSON: statuses as strings, failures a sum)."""
    total.requests += int(stats.get("requests", 0))
    for status, n in stats.get("responses", {}).items():
        total.responses[int(status)] = total.responses.get(int(status), 0) + int(n)
    failures = int(stats.get("backend_failures", 0))
    if failures:
        key = ("(router workers)", "any")
        total.backend_failures[key] = total.backend_failures.get(key, 0) + failures
    for kind, n in stats.get("retries", {}).items():
        total.retries[kind] = total.retries.get(kind, 0) + int(n)
    total.rescues += int(stats.get("rescues", 0))
    total.hedges += int(stats.get("hedges", 0))
    total.hedges_won += int(stats.get("hedges_won", 0))
    total.poison_requests += int(stats.get("poison_requests", 0))
    total.comeback_waits += int(stats.get("comeback_waits", 0))
    total.comeback_served += int(stats.get("comeback_served", 0))
    total.local_exhaustion += int(stats.get("local_exhaustion", 0))
    for reason, n in stats.get("connections_closed", {}).items():
        total.connections_closed[reason] = total.connections_closed.get(reason, 0) + int(n)
    for name, counts in stats.get("keys", {}).items():
        total.key(name).add(KeyTally(*(int(n) for n in counts[:3])))
    for why, n in stats.get("key_refusals", {}).items():
        total.key_refusals[why] = total.key_refusals.get(why, 0) + int(n)
