"""A model-based test of the whole fleet: random operator sequences, the contract checked after
each one.

Owns: a seeded generator of operations on a real fleet (``fleetwarden up`` as a process, its
engines simulated, every profile the simulator speaks) under a steady light load, and the
checks of the fleet's contract (docs/design.md, "The fleet's contract") after every operation.
Must not: decide anything about health, or repair what it checks: it drives, reads and reports.

One run is a few *epochs*, each a fleet of its own in a directory of its own: one with static
weights (faults, restarts of engines and of fleetwarden, router reloads, edited configs) and
one with a trainer's weights (the same faults, refits completed, aborted, overrun and with a
participant restarted during the lease, sleep at levels 1 and 2 and wake). Engines of each
profile are attached (``--backend``: the model plays the system that runs them, and replaces
one that is condemned, as Kubernetes would) beside engines fleetwarden launches itself.

Every draw comes from one ``random.Random(seed)``; the seed is printed first, and the same
seed draws the same operations (the fleet's timing still varies: a failure replays its
operations, not its every interleaving). Invariants the fleet does not yet hold in every case
are *gated*: their checks still run and their violations are counted apart, named by the gate
and printed, never hidden (:data:`GATES`); every other violation fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import selectors
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from fleetwarden.client import FleetClient, FleetClientError
from fleetwarden.launchers.local import free_port, kill_launched, launch_id_of, live_launch_ids
from fleetwarden.launchers.procs import process_info
from fleetwarden.sim.server import POISON_PROMPT
from fleetwarden.testing.load import Load, RequestResult
from fleetwarden.testing.up import UpProcess

__all__ = ["GATES", "Epoch", "ModelReport", "Violation", "run_model"]

#: Known ways the fleet still breaks its contract (docs/design.md, "The fleet's contract"):
#: their checks run; a violation under a gate is reported under its name, apart from the
#: others, and does not fail the run. A gate comes off when its rule holds.
GATES: dict[str, str] = {}

#: Compressed timings (as tests/support/fleet.py's): a 0.5 s tick, a 2 s stall, a lease of 2 s.
PROBE_INTERVAL_S = 0.5
LEASE_S = 2.0
#: "Within one push": a transition pushes at once and every tick pushes a change; a reflex
#: drop by a router lasts until the ledger has judged the evidence, a few ticks. Past this, a
#: HEALTHY shard out of a router's serving set is a violation.
PUSH_BOUND_S = 6 * PROBE_INTERVAL_S + 1.0
#: A router worker just started (a reload, a storm of them) answers within this.
ROUTER_START_BOUND_S = 30.0
#: A process that lost its weights (restarted, slept at level 2) may serve until the watchdog's
#: next read tells it apart: a few ticks.
DETECT_BOUND_S = 8 * PROBE_INTERVAL_S + 1.0
#: A replaced router worker drains and exits within the router's drain_s; past it (and this
#: margin) one still alive is an orphan. Long enough for what a reload's old worker holds
#: (a request on a wedged engine waits for its rescue): at 2 s, a storm of reloads cut such
#: requests at the bound, by design of the bound, not a fault of the fleet.
DRAIN_S = 30.0
ORPHAN_MARGIN_S = 10.0
#: The load: two clients, short generations, a pause between requests: light and steady.
LOAD_CLIENTS = 2
LOAD_TOKENS = 8
LOAD_THINK_S = 0.1
SIM_ARGS = ("--steps-per-s", "40")
#: A shard whose engine the model broke less than this long before a request is not counted
#: as a healthy engine for it: a crash or a wedge is condemned and its engine replaced well
#: within it while fleetwarden runs, a trickle lasts 3 s. A wedge is remembered longer: from
#: the last time the model saw its process still the one wedged (``FleetModel.wedged``).
FAULT_MEMORY_S = 15.0
#: What an operation returns when the fleet has too few HEALTHY shards for it (faults one at
#: a time over a serving fleet): not counted; the model waits a moment and draws again.
SKIPPED = "skipped: fewer than two HEALTHY shards"
SKIP_WAIT_S = 0.3
SIM_START_TIMEOUT_S = 30.0
#: First starts of one attached engine before the model gives up on finding a free port.
SIM_START_TRIES = 3


class _PortTaken(RuntimeError):
    """The simulated engine exited at start because its port was bound by someone else."""


@dataclass(frozen=True)
class Violation:
    epoch: str
    step: int
    op: str
    invariant: str
    detail: str
    gate: str | None = None

    def __str__(self) -> str:
        gate = f" [gated: {self.gate}]" if self.gate else ""
        return (f"{self.epoch} step {self.step} after {self.op}: {self.invariant}{gate}: "
                f"{self.detail}")


@dataclass(frozen=True)
class Epoch:
    """One fleet: its weights mode, engines and the operations drawn on it (name -> weight)."""

    name: str
    weights: str
    launched: int
    attached: tuple[str, ...]  # the simulator's --engine of each attached engine
    router_workers: int
    ops: dict[str, int]


#: Operation -> weight. The cheap ones (a fault is one admin call) are drawn most; a restart
#: of fleetwarden or an edited config costs seconds, so it is drawn a few times a run.
STATIC_OPS = {"crash": 10, "wedge": 8, "idle_wedge": 5, "trickle": 10, "poison": 4,
              "restart_outside": 7, "kill9_restart": 2, "clean_restart": 1, "reload": 3,
              "reload_fail": 2, "sighup_storm": 1, "config_edit": 1, "pause": 4}
TRAINER_OPS = {"crash": 6, "wedge": 4, "trickle": 6, "restart_outside": 5, "kill9_restart": 1,
               "reload": 1, "refit_complete": 16, "refit_abort": 5, "refit_overrun": 2,
               "refit_participant_restarted": 4, "sleep1": 5, "sleep2": 4, "wake": 8,
               "pause": 4}
EPOCHS = (
    Epoch("static", "static", launched=1, attached=("llamacpp", "sglang", "vllm"),
          router_workers=2, ops=STATIC_OPS),
    Epoch("trainer", "trainer", launched=1, attached=("vllm", "sglang"), router_workers=1,
          ops=TRAINER_OPS),
)


@dataclass
class ModelReport:
    seed: int
    steps: int = 0
    operations: Counter[str] = field(default_factory=Counter)
    violations: list[Violation] = field(default_factory=list)
    requests: int = 0
    #: Failed requests: while the fleet was stopped on purpose, while no shard was HEALTHY,
    #: and the others (each of those a violation).
    failed: Counter[str] = field(default_factory=Counter)
    #: Operations drawn while too few shards were HEALTHY for them: not run, not counted.
    skipped: int = 0
    #: Pauses drawn (the load runs on for a moment, then the contract is checked): not
    #: counted as operations either.
    pauses: int = 0
    seconds: float = 0.0

    @property
    def ungated(self) -> list[Violation]:
        return [v for v in self.violations if v.gate is None]

    @property
    def gated(self) -> Counter[str]:
        return Counter(v.gate for v in self.violations if v.gate is not None)

    def summary(self) -> str:
        return (f"seed {self.seed}: {self.steps} operations in {self.seconds:.0f} s "
                f"({dict(sorted(self.operations.items()))}); {self.requests} requests, "
                f"failed: {dict(self.failed) or 'none'}; {self.skipped} draws skipped, "
                f"{self.pauses} pauses; "
                f"violations {len(self.ungated)} "
                f"(gated: {dict(self.gated) or 'none'})")


# ---------------------------------------------------------------------- processes we run


class AttachedEngine:
    """A simulated engine the model runs itself, as the system behind ``--backend`` would: on
    a port of its own, replaced (stopped, started again on the same port) at will."""

    def __init__(self, engine: str, port: int, cwd: Path) -> None:
        self.engine, self.port, self.cwd = engine, port, cwd
        self.proc: subprocess.Popen[str] | None = None
        #: Processes this engine has had (the identity a refit's credit is checked against).
        self.generation = 0
        #: One start, stop or restart at a time: a repair (in a thread) and an operation may
        #: replace the same engine at once, and two processes on one port do not start.
        self._lock = threading.RLock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """The first start. The port was only free when it was drawn: a test running beside
        this one may have bound it since, so an engine that exits before it is ready (the
        port taken) is started again on a newly drawn port, before anything knows its URL."""
        with self._lock:
            self._start_trying(lambda: setattr(self, "port", free_port("127.0.0.1")))

    def _start_trying(self, port_taken: Callable[[], None]) -> None:
        """:meth:`_start`, with ``port_taken`` done before each try after a port was taken."""
        for attempt in range(SIM_START_TRIES):
            try:
                self._start()
                return
            except _PortTaken:
                if attempt == SIM_START_TRIES - 1:
                    raise
                port_taken()

    def _start(self) -> None:
        self.generation += 1
        err_path = self.cwd / f"sim-{self.port}-{self.generation}.err"
        with err_path.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fleetwarden", "sim", "--port", str(self.port),
                 "--engine", self.engine, *SIM_ARGS],
                cwd=self.cwd, stdout=subprocess.PIPE, stderr=err, text=True,
                start_new_session=True)
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout=SIM_START_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if line.startswith("ready "):
            return
        if ready:
            # Its stdout at an end comes a moment before its exit status (a loaded machine
            # widens the moment): a process that closed it is waited for, not judged alive.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5.0)
        code = self.proc.poll()
        exited = code is not None
        self._stop()
        said = err_path.read_text(errors="replace")[-800:]
        how = (f"exited {code}" if exited
               else "still running" if ready else f"not ready in {SIM_START_TIMEOUT_S:.0f} s")
        why = f"sim {self.engine} on {self.port} did not start ({how}): {line!r}; stderr: {said!r}"
        if exited and "address already in use" in said.lower():
            raise _PortTaken(why)
        raise RuntimeError(why)

    def stop(self) -> None:
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait_s)
        if proc.stdout is not None:
            proc.stdout.close()

    def restart(self) -> None:
        """A new process on the same port (its URL is the fleet's): a port taken while the
        engine was down (a connection's ephemeral port) is waited out a moment at a time."""
        with self._lock:
            self._stop()
            self._start_trying(lambda: time.sleep(1.0))


async def sim_restarts(url: str) -> int | None:
    """How many times the simulated engine at ``url`` restarted in place (``/sim/stats``), or
    ``None`` when it did not answer."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http, \
                http.get(url + "/sim/stats") as resp:
            return int((await resp.json())["engine"]["restarts"])
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
        return None


async def stamp_version(urls: list[str], version: int) -> None:
    """The end of a trainer's weight push on vLLM: each engine told the version it now holds
    (``POST /update_weight_version``), which the completion reads back; an engine that does
    not answer (or has no such endpoint) is left to the completion to judge."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
        for url in urls:
            try:
                async with http.post(url + "/update_weight_version",
                                     json={"new_version": str(version)}):
                    pass
            except (aiohttp.ClientError, TimeoutError):
                continue


# ---------------------------------------------------------------------- one epoch

class _ModelState:
    """The model's state and plumbing: its fleet's files and process, the reads of it, and
    what the model remembers of what it did (the faults, wedges, repairs, downtime)."""

    def __init__(self, epoch: Epoch, rng: random.Random, workdir: Path, report: ModelReport,
                 log: Callable[[str], None]) -> None:
        self.epoch, self.rng, self.workdir, self.report, self.log = (
            epoch, rng, workdir, report, log)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.sims_dir = workdir / "attached"
        self.sims_dir.mkdir(exist_ok=True)
        self.config_path = workdir / "fleet.toml"
        self.journal_path = workdir / "fleetwarden.sqlite"
        self.router_token = workdir / "router.token"
        self.router_port, self.admin_port = free_port("127.0.0.1"), free_port("127.0.0.1")
        self.attached = [AttachedEngine(e, free_port("127.0.0.1"), self.sims_dir)
                         for e in epoch.attached]
        self.retired_engines: list[AttachedEngine] = []
        self.up: UpProcess | None = None
        self.client: FleetClient | None = None
        self.load: Load | None = None
        self.step = 0
        self.op = "start"
        #: When the fleet was stopped on purpose (a clean restart, an edited config): no router
        #: listens, and requests fail by design.
        self.down: list[tuple[float, float]] = []
        #: (monotonic time, shards HEALTHY) at every check: when a failed request had one.
        self.healthy_seen: list[tuple[float, frozenset[int]]] = []
        #: When the model last broke each shard's engine (a fault, a restart, a sleep): the
        #: ledger may call it HEALTHY for a tick or two after, but it is no healthy engine.
        self.faulted_at: dict[int, float] = {}
        #: Shards the model wedged, and the identity of the process wedged (:meth:`identity`):
        #: a wedged engine stays wedged until its process is replaced or restarted, however
        #: long that takes (a clean restart of fleetwarden took 15.6 s in a long run, past
        #: FAULT_MEMORY_S, and a poison request's first try then failed on the wedge, not
        #: on the poison). :meth:`remember_wedges` keeps their fault time current.
        self.wedged: dict[int, tuple[int, int | None]] = {}
        #: Restarts the model made of launched engines in place (the simulator's own restart).
        self.restarts_by_model: Counter[int] = Counter()
        #: Repairs under way (the system that runs attached engines is slow to replace one).
        self.repairs: set[asyncio.Task[None]] = set()
        self.failures_seen = 0
        self.version = 0
        #: Shards whose process lost its weights since the last refit credited them, and when.
        self.lost_weights: dict[int, tuple[float, str | None]] = {}
        #: When the model last replaced each attached engine (by URL).
        self.replaced_since: dict[str, float] = {}
        #: When each router worker was first seen replaced in its slot (by launch id).
        self.orphan_since: dict[str, float] = {}
        self.poison_sent = 0
        self.poison_at = -1e9
        #: Router slots in the journal at the last read, and those with a worker that answered
        #: and accepts connections.
        self.slots = 0
        self.slots_serving = 0

    def violation(self, invariant: str, detail: str, gate: str | None = None) -> None:
        v = Violation(self.epoch.name, self.step, self.op, invariant, detail, gate)
        self.report.violations.append(v)
        self.log(f"  VIOLATION {v}")

    def write_config(self) -> None:
        backends = ", ".join(json.dumps(a.url) for a in self.attached)
        self.config_path.write_text(f"""
[fleet]
engines = {self.epoch.launched}
engine_cmd = "{{python}} -m fleetwarden sim --host {{host}} --port {{port}} {' '.join(SIM_ARGS)}"
backends = [{backends}]
weights = "{self.epoch.weights}"
startup_timeout_s = 30
log_dir = "{self.workdir / 'logs'}"

[router]
port = {self.router_port}
workers = {self.epoch.router_workers}
control_token_file = "{self.router_token}"
drain_s = {DRAIN_S}

[admin]
port = {self.admin_port}
token_file = "{self.workdir / 'admin.token'}"

[health]
probe_interval_s = {PROBE_INTERVAL_S}
probe_timeout_s = 1.0
stall_s = 2.0
canary_interval_s = 1.0
canary_timeout_s = 1.5

[supervisor]
max_restart_attempts = 1000
backoff_initial_s = 0.5
backoff_max_s = 2
stop_grace_s = 3

[refit]
lease_s = {LEASE_S}

[journal]
path = "{self.journal_path}"
""")

    async def start_fleet(self) -> None:
        self.write_config()
        self.up = await asyncio.to_thread(UpProcess, self.workdir, "--config",
                                          str(self.config_path), drain=True)
        self.client = self.up.client

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def shards(self) -> list[dict[str, Any]]:
        assert self.client is not None
        result: list[dict[str, Any]] = await self.call(self.client.shards)
        return result

    def journal_rows(self, sql: str) -> list[tuple[Any, ...]]:
        with contextlib.closing(sqlite3.connect(f"file:{self.journal_path}?mode=ro",
                                                uri=True, timeout=10)) as conn:
            return list(conn.execute(sql))

    def routers(self) -> list[dict[str, Any]]:
        rows = self.journal_rows("SELECT worker, record, launched_wall FROM routers "
                                 "WHERE stopped_wall IS NULL ORDER BY launched_wall")
        return [{**json.loads(r), "worker": w, "launched_wall": t} for w, r, t in rows]

    async def router_sets(self, http: aiohttp.ClientSession) -> dict[str, dict[str, Any]]:
        """Every router worker the journal says is running that answers and still accepts
        connections: launch id -> its /status (what it serves). A reload's old worker is one
        of them until it closes its listeners: it takes requests, so it must be pushed to as
        its replacement is (docs/design.md section 4). ``self.slots`` is the number of slots;
        ``self.slots_serving`` those with a worker here (a slot whose workers are all still
        starting, or all stopped accepting in a storm of reloads, is not)."""
        rows = self.routers()
        self.slots = len({r["worker"] for r in rows})
        token = self.router_token.read_text().strip()
        out: dict[str, dict[str, Any]] = {}
        serving: set[int] = set()
        for r in rows:
            if "control_url" not in r:
                continue  # only its launch's intent is journaled yet: still starting
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(r["control_url"] + "/status",
                                    headers={"Authorization": f"Bearer {token}"}) as resp:
                    status = await resp.json() if resp.status == 200 else None
                    if status is not None and status.get("accepting", True):
                        out[r["launch_id"]] = status
                        serving.add(r["worker"])
        self.slots_serving = len(serving)
        return out

    async def healthy_shard(self, *, idle: bool = False) -> dict[str, Any] | None:
        """A HEALTHY shard to act on, while at least one other stays HEALTHY: faults one at a
        time over a serving fleet, as an operator's fault drill."""
        shards = await self.shards()
        healthy = [s for s in shards if s["state"] == "HEALTHY"]
        if len(healthy) < 2:
            return None
        if idle:
            healthy = [s for s in healthy if not s["in_flight"]] or healthy
        return self.rng.choice(healthy)

    def attached_of(self, shard: dict[str, Any]) -> AttachedEngine | None:
        for a in self.attached:
            if a.url == shard["base_url"]:
                return a
        return None

    def identity(self, s: dict[str, Any]) -> tuple[int, int | None]:
        """The identity of shard ``s``'s process now, as the model knows it (participants)."""
        a = self.attached_of(s)
        return (a.generation, 0) if a is not None else (self.restarts_by_model[s["index"]],
                                                         s["pid"])

    def remember_wedges(self, shards: list[dict[str, Any]]) -> None:
        """A wedge lasts as long as the process wedged: each shard whose wedged process is
        still its process is faulted now (its fault memory runs from the last time it was
        seen wedged); one whose process changed (restarted, replaced) is forgotten."""
        now = time.monotonic()
        by_index = {s["index"]: s for s in shards}
        for i, wedged in list(self.wedged.items()):
            s = by_index.get(i)
            if s is not None and self.identity(s) == wedged:
                self.faulted_at[i] = now
            else:
                del self.wedged[i]


class _Contract(_ModelState):
    """The fleet's contract (docs/design.md section 14), checked after every operation."""

    async def check(self, http: aiohttp.ClientSession) -> None:
        await self.check_healthy_routed(http)
        await self.check_processes_journaled()
        self.check_orphans()
        self.check_client_failures()
        if self.epoch.weights == "trainer":
            await self.check_lost_weights(http)

    async def check_healthy_routed(self, http: aiohttp.ClientSession) -> None:
        """Every shard the ledger calls HEALTHY is routed by every router within one push; and
        every router routes only the engines configured (attached: this run's --backend list;
        launched: the shards' current engines)."""
        started = time.monotonic()
        #: When this check first saw each URL's shard HEALTHY (and every read since): the push
        #: bound runs from then, not from the check's start (a shard that turns HEALTHY late
        #: in a check has its own push to wait for).
        since: dict[str, float] = {}
        while True:
            shards = await self.shards()
            self.remember_wedges(shards)
            now = time.monotonic()
            healthy = {s["base_url"]: s["index"] for s in shards if s["state"] == "HEALTHY"}
            since = {u: since.get(u, now) for u in healthy}
            self.healthy_seen.append((now, frozenset(healthy.values())))
            sets = await self.router_sets(http)
            configured = ({a.url for a in self.attached}
                          | {s["base_url"] for s in shards if self.attached_of(s) is None})
            missing = sorted((healthy[u], launch) for launch, st in sets.items()
                             for u in healthy if u not in st["serving"])
            young = any(now - since[u] <= PUSH_BOUND_S for st in sets.values()
                        for u in healthy if u not in st["serving"])
            foreign = sorted({u for st in sets.values() for u in st["serving"]
                              if u not in configured})
            every = bool(sets) and self.slots_serving == self.slots
            if every and not missing and not foreign:
                break
            waited = time.monotonic() - started
            if (every and waited > PUSH_BOUND_S and not young) or waited > ROUTER_START_BOUND_S:
                if not every:
                    self.violation("every router answers its control API",
                                   f"{self.slots_serving} of {self.slots} router slot(s) answered "
                                   f"within {ROUTER_START_BOUND_S:g} s")
                if missing:
                    self.violation("HEALTHY implies routed by every router within one push",
                                   f"(shard, router) not routed: {missing}")
                if foreign:
                    self.violation("the engines routed are the engines configured",
                                   f"routed but not configured: {foreign}")
                break
            await asyncio.sleep(0.1)
        attached_urls = {s["index"]: s["base_url"] for s in shards}
        launched = self.epoch.launched
        for k, a in enumerate(self.attached):
            if attached_urls.get(launched + k) != a.url:
                self.violation("the engines routed are the engines configured",
                               f"shard {launched + k} records {attached_urls.get(launched + k)}"
                               f", the config names {a.url}")

    def ours(self) -> dict[int, str]:
        """Live processes started from this fleet's directory that carry a launch id."""
        found: dict[int, str] = {}
        workdir = str(self.workdir.resolve())
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                cwd = os.readlink(f"/proc/{entry.name}/cwd")
            except OSError:
                continue
            if cwd != workdir:
                continue
            launch = launch_id_of(int(entry.name))
            info = process_info(int(entry.name))
            if launch and info is not None and info.state not in ("Z", "X"):
                found[int(entry.name)] = launch
        return found

    def journaled(self) -> set[str]:
        rows = self.journal_rows("SELECT launch_id FROM engines UNION "
                                 "SELECT launch_id FROM routers")
        return {str(r[0]) for r in rows}

    async def check_processes_journaled(self) -> None:
        unknown = {pid: launch for pid, launch in self.ours().items()
                   if launch not in self.journaled()}
        if unknown:
            # A process may be a moment ahead of its journal row: look once more.
            await asyncio.sleep(0.2)  # the other fleet's operations go on meanwhile
            known = self.journaled()
            unknown = {p: lid for p, lid in unknown.items() if lid not in known
                       and process_info(p) is not None}
        if unknown:
            self.violation("every process fleetwarden started is in the journal",
                           f"not journaled: {unknown}")

    def check_orphans(self) -> None:
        """A router worker replaced in its slot drains and exits; one alive long after is an
        orphan (nothing drives it)."""
        rows = self.routers()
        latest: dict[int, str] = {}
        for r in rows:
            latest[r["worker"]] = r["launch_id"]
        now = time.monotonic()
        for r in rows:
            if latest[r["worker"]] == r["launch_id"]:
                continue
            first = self.orphan_since.setdefault(r["launch_id"], now)
            if now - first > DRAIN_S + ORPHAN_MARGIN_S and live_launch_ids({r["launch_id"]}):
                self.violation("no router worker outlives its replacement",
                               f"{r['launch_id']} (pid {r['pid']}) replaced "
                               f"{now - first:.0f} s ago and still running")
                self.orphan_since[r["launch_id"]] = float("inf")  # said once

    def check_client_failures(self) -> None:
        """No client request fails while a healthy engine exists (the fleet stopped on purpose
        excepted: no router listens then)."""
        assert self.load is not None
        results = self.load.results
        new, self.failures_seen = results[self.failures_seen:], len(results)
        for r in new:
            if r.ok:
                continue
            if self.in_down_window(r):
                self.report.failed["fleet stopped on purpose"] += 1
                continue
            if not self.had_healthy(r):
                self.report.failed["no healthy engine"] += 1
                continue
            self.report.failed["a healthy engine existed"] += 1
            self.violation("no client request fails while a healthy engine exists",
                           f"{r.request_id}: {r.status} {r.error[:160]}")

    def in_down_window(self, r: RequestResult) -> bool:
        end = r.started + r.latency_s
        return any(t0 - 1.0 <= end and r.started <= t1 + 1.0 for t0, t1 in self.down)

    def had_healthy(self, r: RequestResult) -> bool:
        """A healthy engine all through the request: a shard HEALTHY at every check from a
        little before it to its end, that the journal shows never leaving HEALTHY in that time
        (checks are samples: a shard can leave between two of them, as an attached one with no
        start time does when fleetwarden starts again in trainer mode), and whose engine the
        model did not break in that time."""
        start, end = r.started - PUSH_BOUND_S, r.started + r.latency_s
        seen = [h for t, h in self.healthy_seen if start <= t <= end]
        if not seen:
            return False
        always = frozenset.intersection(*seen) - self.left_healthy(start, end)
        return any(self.faulted_at.get(i, -1e9) < r.started - FAULT_MEMORY_S for i in always)

    def left_healthy(self, start: float, end: float) -> set[int]:
        """Shards the journal shows leaving HEALTHY between two monotonic times."""
        offset = time.time() - time.monotonic()  # the journal's times are wall-clock
        if not self.journal_path.exists():
            return set()
        rows = self.journal_rows(
            "SELECT DISTINCT shard FROM transitions WHERE from_state = 'HEALTHY' "
            f"AND to_state != 'HEALTHY' AND wall BETWEEN {start + offset - 0.05} "
            f"AND {end + offset + 0.05}")
        return {int(row[0]) for row in rows}

    async def check_lost_weights(self, http: aiohttp.ClientSession) -> None:
        """An engine that lost its weights never serves under a version label: once the
        watchdog could tell (a few ticks), its shard is neither HEALTHY nor routed."""
        now = time.monotonic()
        overdue = {i: why for i, (t, why) in self.lost_weights.items()
                   if now - t > DETECT_BOUND_S}
        if not overdue:
            return
        shards = {s["index"]: s for s in await self.shards()}
        sets = await self.router_sets(http)
        for i, why in overdue.items():
            s = shards[i]
            routed = any(s["base_url"] in st["serving"] for st in sets.values())
            if s["state"] == "HEALTHY" or (routed and s["state"] == "SUSPECT"):
                self.violation("an engine that lost its weights never serves under a version "
                               "label", f"shard {i} ({why}) is {s['state']} v"
                               f"{s['weight_version']}, routed {routed}")
                self.lost_weights.pop(i)  # said once; a refit may credit it again

    def check_nothing_left(self, when: str) -> None:
        launched = self.journaled()
        left = live_launch_ids(launched) | set(self.ours().values())
        if left:
            self.violation("after the final stop no process fleetwarden started is left",
                           f"{when}: still running: {sorted(left)}")
            kill_launched(left)


class FleetModel(_Contract):
    """One epoch of the model: the operations on a fleet, the repair of what they broke, and
    the run that draws them at random and checks the contract after each."""

    # ------------------------------------------------------------------ the operations

    async def chaos(self, fault: str, *, idle: bool = False, **options: Any) -> str:
        s = await self.healthy_shard(idle=idle)
        if s is None:
            return SKIPPED
        assert self.client is not None
        self.faulted_at[s["index"]] = time.monotonic()
        # A wedge stays until the process is replaced or restarted; any other fault replaces
        # it (the simulator has one fault at a time).
        if fault == "wedge":
            self.wedged[s["index"]] = self.identity(s)
        else:
            self.wedged.pop(s["index"], None)
        try:
            await self.call(self.client.chaos, s["index"], fault, **options)
        except FleetClientError as exc:
            return f"refused: {exc}"
        return f"shard {s['index']}"

    async def op_crash(self) -> str:
        return await self.chaos("crash")

    async def op_wedge(self) -> str:
        return await self.chaos("wedge")

    async def op_idle_wedge(self) -> str:
        return await self.chaos("wedge", idle=True)

    async def op_trickle(self) -> str:
        return await self.chaos("error5xx", duration_s=3.0)

    async def op_poison(self, http: aiohttp.ClientSession) -> str:
        assert self.up is not None
        shards = await self.shards()
        self.remember_wedges(shards)
        before = {s["index"]: s["state"] for s in shards}
        seq = await self.last_seq()
        body = {"model": "tiny", "prompt": POISON_PROMPT, "max_tokens": 4}
        status = 0
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with http.post(self.up.router + "/v1/completions", json=body) as resp:
                status = resp.status
        self.poison_sent += 1
        self.poison_at = time.monotonic()
        await asyncio.sleep(3 * PROBE_INTERVAL_S)  # the router's window reaches the ledger
        for shard, cause in self.journal_rows(
                f"SELECT shard, cause FROM transitions WHERE seq > {seq} AND event = 'ejected'"):
            # A shard the model broke lately is no healthy engine: its own requests fail (a
            # trickle, a crash) and eject it, poison or not.
            broken = self.faulted_at.get(shard, -1e9) >= self.poison_at - FAULT_MEMORY_S
            if before.get(shard) == "HEALTHY" and not broken:
                self.violation("no healthy engine is ejected by a request that failed "
                               "everywhere", f"shard {shard}: {cause}")
        return f"answered {status}"

    async def last_seq(self) -> int:
        rows = self.journal_rows("SELECT COALESCE(MAX(seq), 0) FROM transitions")
        return int(rows[0][0])

    async def restart_engine(self, s: dict[str, Any]) -> str:
        """Its engine restarted outside fleetwarden: an attached one by the model (a new
        process on the same port), a launched one by its own hand (the simulator's restart:
        counters back to zero, a new start time)."""
        a = self.attached_of(s)
        self.faulted_at[s["index"]] = time.monotonic()
        if a is not None:
            await asyncio.to_thread(a.restart)
        else:
            assert self.client is not None
            before = await sim_restarts(s["base_url"])
            with contextlib.suppress(FleetClientError):
                await self.call(self.client.chaos, s["index"], "restart")
            # Only a restart the simulator made: a crashed one (its API server outliving its
            # core, as vLLM's does) takes no more orders, and a restart counted that never
            # happened reads as a process changed during a lease.
            if before is None or await sim_restarts(s["base_url"]) != before:
                self.restarts_by_model[s["index"]] += 1
        if self.epoch.weights == "trainer":
            engine = a.engine if a is not None else "vllm"
            self.lost_weights[s["index"]] = (time.monotonic(), engine)
        return f"shard {s['index']} ({'attached' if a else 'launched'})"

    async def op_restart_outside(self) -> str:
        s = await self.healthy_shard()
        return SKIPPED if s is None else await self.restart_engine(s)

    async def op_kill9_restart(self) -> str:
        assert self.up is not None
        await asyncio.to_thread(self.up.kill9)
        await self.start_fleet()  # its engines and router workers lived on: adopted
        return "fleetwarden SIGKILLed and started again"

    async def stop_fleet(self) -> None:
        assert self.up is not None
        await self.repaired()
        t0 = time.monotonic()
        out = await asyncio.to_thread(self.up.stop)
        self.down.append((t0, float("inf")))
        if "nothing left running" not in out:
            self.violation("a clean stop leaves nothing running", out[-500:])
        self.check_nothing_left("after a clean stop")

    async def restarted(self) -> None:
        await self.start_fleet()
        t0, _ = self.down[-1]
        self.down[-1] = (t0, time.monotonic())

    async def op_clean_restart(self) -> str:
        await self.stop_fleet()
        await self.restarted()
        return "stopped cleanly and started again"

    async def op_config_edit(self) -> str:
        """One --backend replaced by a new engine (of the same profile, on a new port)."""
        await self.stop_fleet()
        k = self.rng.randrange(len(self.attached))
        old = self.attached[k]
        new = AttachedEngine(old.engine, free_port("127.0.0.1"), self.sims_dir)
        await asyncio.to_thread(new.start)
        self.attached[k] = new
        self.retired_engines.append(old)  # it serves on: routed to, it would be a violation
        await self.restarted()
        return f"backend {k}: {old.url} -> {new.url}"

    async def op_reload(self) -> str:
        assert self.up is not None
        os.kill(self.up.proc.pid, signal.SIGHUP)
        await asyncio.sleep(1.0)
        return "SIGHUP"

    async def op_sighup_storm(self) -> str:
        assert self.up is not None
        for _ in range(3):
            os.kill(self.up.proc.pid, signal.SIGHUP)
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        return "3 SIGHUPs"

    async def op_reload_fail(self) -> str:
        """A reload whose new worker cannot start (its token file is readable by others)."""
        assert self.up is not None
        t0 = time.time()
        self.router_token.chmod(0o644)
        try:
            os.kill(self.up.proc.pid, signal.SIGHUP)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until a worker of this reload has exited
                rows = self.journal_rows(
                    f"SELECT COUNT(*) FROM routers WHERE launched_wall > {t0} "
                    "AND stopped_wall IS NOT NULL")
                if rows[0][0]:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # the roll-back's push
        finally:
            self.router_token.chmod(0o600)
        return "SIGHUP with a new worker that cannot start"

    async def participants(self) -> dict[int, tuple[int, int | None]]:
        """Shard -> the identity of its process now, as the model knows it (not as fleetwarden
        has seen it yet): its count of processes for an attached engine; for a launched one
        the PID fleetwarden started and the model's count of the restarts it made in place."""
        return {s["index"]: self.identity(s) for s in await self.shards()}

    async def refit(self, *, finish: str, restart_one: bool = False, overrun: bool = False
                    ) -> str:
        assert self.client is not None
        self.version += 1
        v = self.version
        try:
            lease = await self.call(self.client.begin_refit, v)
        except FleetClientError as exc:
            return f"begin refused: {exc}"
        before = await self.participants()
        shards = await self.shards()
        restarted: set[int] = set()
        if restart_one:
            live = [s for s in shards if s["state"] not in ("DEAD", "RESTARTING", "RETIRED")]
            if live:
                s = self.rng.choice(live)
                was = self.identity(s)
                await self.restart_engine(s)
                if self.identity(s) != was:  # a crashed engine takes no restart order
                    restarted.add(s["index"])
        if overrun:
            await asyncio.sleep(LEASE_S + 2 * PROBE_INTERVAL_S)
        if finish != "complete":
            # An abort leaves every participant's weights partial (STALE, by the trainer's
            # word): no healthy engine from then on, whatever the last check saw.
            for p in lease["participants"]:
                self.faulted_at[p["shard"]] = time.monotonic()
        if finish == "complete":
            await stamp_version([p["url"] for p in lease["participants"]], v)
        try:
            if finish == "complete":
                await self.call(self.client.complete_refit, v)
            else:
                await self.call(self.client.abort_refit, v, "the trainer gave up")
        except FleetClientError as exc:
            return f"{finish} refused: {exc}"
        after = await self.participants()
        for s in await self.shards():
            i = s["index"]
            if s["weight_version"] != v or finish != "complete":
                continue
            now_proc = after.get(i)
            gone = now_proc is not None and now_proc[1] is None  # a launched one, no PID
            # A process gone by the time the model reads (no PID) may have died after the
            # completion, credited while alive: only another live process is a violation.
            if (before.get(i) != now_proc and not gone) or i in restarted:
                # The model replaced its engine during the lease (the operation, or a
                # repair): the read at the completion must have told.
                self.violation("a refit credits a version only to a process alive through "
                               "the whole lease", f"shard {i} holds v{v}; its process changed "
                               f"during the lease ({before.get(i)} -> {after.get(i)})")
            else:
                self.lost_weights.pop(i, None)  # credited: its weights are current again
        return f"v{v} {finish} over {[p['shard'] for p in lease['participants']]}" + (
            f", shard(s) {sorted(restarted)} restarted during it" if restarted else "")

    async def op_refit_complete(self) -> str:
        return await self.refit(finish="complete")

    async def op_refit_abort(self) -> str:
        return await self.refit(finish="abort")

    async def op_refit_overrun(self) -> str:
        return await self.refit(finish="complete", overrun=True)

    async def op_refit_participant_restarted(self) -> str:
        return await self.refit(finish="complete", restart_one=True)

    async def sleep(self, level: int) -> str:
        s = await self.healthy_shard()
        if s is None:
            return SKIPPED
        assert self.client is not None
        self.faulted_at[s["index"]] = time.monotonic()
        result = await self.call(self.client.sleep, level, [s["index"]])
        if level == 2:
            self.lost_weights[s["index"]] = (time.monotonic(), "level 2")
        return f"shard {s['index']}: {result.get('shards')}"

    async def op_sleep1(self) -> str:
        return await self.sleep(1)

    async def op_sleep2(self) -> str:
        return await self.sleep(2)

    async def op_wake(self) -> str:
        assert self.client is not None
        result = await self.call(self.client.wake)
        return f"{result.get('shards')}"

    async def op_pause(self) -> str:
        await asyncio.sleep(self.rng.uniform(0.2, 1.0))
        return "the load runs on"

    # ------------------------------------------------------------------ repair (not an op)

    async def repair(self) -> None:
        """The system that runs the attached engines replaces one fleetwarden condemned (the
        passive wait's other half), at most once every few seconds."""
        now = time.monotonic()
        for s in await self.shards():
            a = self.attached_of(s)
            if a is None or s["state"] != "DEAD":
                continue
            if now - self.replaced_since.get(a.url, 0.0) < 3.0:
                continue
            self.replaced_since[a.url] = now
            self.faulted_at[s["index"]] = now
            task = asyncio.create_task(asyncio.to_thread(a.restart), name=f"repair {a.url}")
            self.repairs.add(task)
            task.add_done_callback(self.repairs.discard)
            if self.epoch.weights == "trainer":
                self.lost_weights[s["index"]] = (now, a.engine)

    async def repaired(self) -> None:
        """Every repair under way, finished (before the model stops or replaces engines)."""
        while self.repairs:
            await asyncio.gather(*self.repairs, return_exceptions=True)

    # ------------------------------------------------------------------ the run

    async def run(self, operations: int, deadline: float, *, shared: bool = False) -> None:
        """Draw ``operations`` operations on this fleet before ``deadline``; ``shared``: until
        the whole run (every epoch's fleet, side by side) has drawn that many."""
        names = sorted(self.epoch.ops)
        weights = [self.epoch.ops[n] for n in names]
        for a in self.attached:
            await asyncio.to_thread(a.start)
        await self.start_fleet()
        assert self.up is not None
        self.load = Load(self.up.router, concurrency=LOAD_CLIENTS, max_tokens=LOAD_TOKENS,
                         think_s=LOAD_THINK_S, pause_after_failure_s=0.2, timeout_s=30)
        self.load.start()
        ops: dict[str, Callable[..., Awaitable[str]]] = {
            n: getattr(self, f"op_{n}") for n in names}
        timeout = aiohttp.ClientTimeout(total=10)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http:
                await self.check(http)
                done = 0
                while ((self.report.steps if shared else done) < operations
                       and time.monotonic() < deadline):
                    self.op = self.rng.choices(names, weights)[0]
                    self.step += 1
                    t0 = time.monotonic()
                    fn = ops[self.op]
                    what = await (fn(http) if self.op == "poison" else fn())
                    if what == SKIPPED:
                        self.step -= 1
                        self.report.skipped += 1
                        await asyncio.sleep(SKIP_WAIT_S)
                        await self.repair()
                        continue
                    t1 = time.monotonic()
                    await self.repair()
                    await self.check(http)
                    if self.op == "pause":  # the load ran on; checked, not an operation
                        self.step -= 1
                        self.report.pauses += 1
                        continue
                    done += 1
                    self.report.steps += 1
                    self.report.operations[self.op] += 1
                    self.log(f"  {self.epoch.name} {self.step:4d} {self.op:<28} "
                             f"{t1 - t0:5.1f} s + check {time.monotonic() - t1:4.1f} s  {what}")
        finally:
            try:
                await self.repaired()
                await self.load.stop()
                self.check_client_failures()
                self.report.requests += len(self.load.results)
                if self.up is not None and self.up.proc.poll() is None:
                    await self.stop_fleet()
            finally:
                self.last_resort()

    def last_resort(self) -> None:
        """Whatever happened (a failure, an interrupt), nothing the model started lives on:
        fleetwarden SIGKILLed if it still runs, every process of its journal, every engine
        the model ran. Synchronous, so a cancellation cannot cut it short."""
        if self.up is not None and self.up.proc.poll() is None:
            self.up.kill9()
        with contextlib.suppress(sqlite3.Error):
            kill_launched(self.journaled())
        for a in [*self.attached, *self.retired_engines]:
            a.stop()


async def run_model(seed: int, operations: int, budget_s: float, workdir: Path,
                    log: Callable[[str], None] = print,
                    epochs: tuple[Epoch, ...] = EPOCHS, *,
                    concurrent: bool = False, pooled: bool = False) -> ModelReport:
    """Draw ``operations`` operations (split evenly over the epochs) within ``budget_s``.

    ``concurrent``: the epochs' fleets run side by side, each drawing from a generator of its
    own (seeded from ``seed`` and the epoch's name: a replay draws the same sequence on
    each); a fleet leaves most of a run waiting, and side by side the run takes as long as
    its slowest epoch, not their sum. ``pooled`` (with ``concurrent``): not an even split,
    but until together they have drawn ``operations``, each at its own pace (the static
    fleet's restarts take seconds, a refit milliseconds). Otherwise one after the other,
    from one generator."""
    report = ModelReport(seed)
    rng = random.Random(seed)
    started = time.monotonic()
    log(f"fleet model: seed {seed}, {operations} operations, budget {budget_s:g} s"
        f"{', epochs side by side' if concurrent else ''} (replay: the same seed)")
    runs = []
    for k, epoch in enumerate(epochs):
        share = operations // len(epochs) + (1 if k < operations % len(epochs) else 0)
        if concurrent:
            model = FleetModel(epoch, random.Random(f"{seed}/{epoch.name}"),
                               workdir / epoch.name, report, log)
            runs.append(model.run(operations if pooled else share, started + budget_s,
                                  shared=pooled))
            continue
        deadline = started + budget_s * (k + 1) / len(epochs)
        model = FleetModel(epoch, rng, workdir / epoch.name, report, log)
        await model.run(share, deadline)
    if runs:
        await asyncio.gather(*runs)
    report.seconds = time.monotonic() - started
    log(report.summary())
    return report
