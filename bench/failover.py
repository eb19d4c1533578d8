"""Failover against peer routers: the same faults on the same engines, in one run.

For every router and every scenario: three fresh simulated vLLM engines (``fleetwarden sim``
processes), the router in front of them (a process of its own), a closed loop of clients (the
official ``openai`` client, its retries off, through :class:`fleetwarden.testing.load.Load`),
and one fault on engine 1. What is measured comes from the clients (failures, latencies) and
from the engines themselves (each one's ``/sim/stats`` log records every request's
``x-request-id`` and arrival time), never from the router under test, so every router is
judged the same way.

Routers: fleetwarden (``fleetwarden up`` attached to the engines with ``--backend``, at its
default timings), sglang-router 0.3.2 and vllm-router (each in a virtual environment of its
own, launched as REAL-ENGINES.md does, with their defaults and with a short request timeout
and a low circuit-breaker threshold), and nginx with passive checks (Debian's package, run in
the foreground). A router that cannot be installed or started here is reported as
"not run: cause".

    python bench/failover.py                      # every router, every scenario (~20 min)
    python bench/failover.py --quick              # shorter windows, fleetwarden compressed
    python bench/failover.py --routers fleetwarden,nginx --scenarios wedge,long
    python bench/failover.py --write              # also BENCHMARKS.md and docs/failover.png
    python bench/failover.py --engines real       # wedge and crash on two real vLLM engines
    python bench/failover.py --scenarios stream-crash,stream-wedge --write
                                                  # streams cut mid-answer: their own section
    python bench/failover.py --scenarios wedge,stream-wedge-short
                                                  # parked on a wedge: waiting vs streamed
    python bench/failover.py --scenarios rolling-restart,wedge,sigstop,blackhole
                                                  # back at once, out at once
    python bench/failover.py --scenarios sigstop --control
                                                  # the fault aimed at nothing: its check fails

Each fault is verified on the engine after it ran, by what the router under test cannot fake:
SIGSTOP by the process state the kernel reports (``/proc/PID/stat``: ``T``), a black hole by the
engine's own count of the requests it swallowed, a rolling restart by each engine's new process
start time. ``--control`` sends the fault nowhere and must fail that check (the scenario tests
run it), so a check that passes proves the fault happened.

The machine is small (2 cores hold the engines, the router and the clients): concurrency is
kept modest and the engines slow, and the load average is recorded beside every row.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from _peers import (
    SGLANG_ROUTER,
    VLLM_ROUTER,
    PeerUnavailable,
    ensure_nginx,
    free_port,
    installed_version,
    nginx_config,
    nginx_version,
    peer_python,
    stop_group,
)
from fleetwarden import __version__ as FLEETWARDEN_VERSION
from fleetwarden.testing.faults import check_fault
from fleetwarden.testing.load import Load, RequestResult

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
#: Where --write puts the chart, and the markers of its section in BENCHMARKS.md, by engines.
CHARTS = {"sim": ROOT / "docs" / "failover.png", "real": ROOT / "docs" / "failover-real.png",
          "streams": ROOT / "docs" / "failover-streams.png"}
SECTIONS = {"sim": "Failover against peer routers",
            "real": "Failover against peer routers on real vLLM",
            "streams": "Streams cut mid-answer, against peer routers"}

#: The engine that gets the fault (of engines 0, 1, 2).
BAD = 1
#: A request is "slow" when it took this much longer than its own generation needs.
SLOW_S = 10.0
#: A client that got an error waits this long before its next request (it never re-sends the
#: failed one): a router that fails fast would otherwise turn the closed loop into a busy loop
#: that takes the CPU from the engines and the next run.
PAUSE_AFTER_FAILURE_S = 1.0
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


# ---------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    #: The simulated engine's fault (``POST /sim/fault``): wedge, crash, error5xx, blackhole;
    #: ``sigstop`` (SIGSTOP of its whole process), ``rolling-restart`` (every engine in turn, see
    #: :func:`_rolling_restart`); None: none.
    fault: str | None
    #: Engine shape: slots per engine, engine steps per second (1 token per step).
    slots: int
    steps_per_s: float
    #: Each request's max_tokens, drawn uniformly: its generation takes max_tokens/steps_per_s.
    max_tokens: tuple[int, int]
    clients: int
    #: Load before the fault, and load after it (the window in which it is judged).
    warm_s: float
    observe_s: float
    #: The client's own timeout per request: longer than any legitimate answer here, so what
    #: shows is the router's behaviour, not the client's patience.
    client_timeout_s: float
    #: Idle wedge: the fault comes this long *before* the load starts, on idle engines.
    idle_before_s: float = 0.0
    #: Whose wire each simulated engine speaks (``sim --engine``), engine i the i-th (cycled):
    #: a mixed fleet. The faulted engine is engine BAD (the second).
    sim_engines: tuple[str, ...] = ("vllm",)
    #: Streamed completions: a request counts as answered only when its stream is whole
    #: (every token once, a finish, usage for the whole; see testing.load.Load).
    stream: bool = False

    def longest_generation_s(self) -> float:
        return self.max_tokens[1] / self.steps_per_s

    def quick(self) -> Scenario:
        """The same story in fewer seconds (for --quick and the smoke test)."""
        long = self.name == "long"
        return dataclasses.replace(
            self, warm_s=min(self.warm_s, 2.0), observe_s=min(self.observe_s, 8.0),
            idle_before_s=min(self.idle_before_s, 1.0),
            max_tokens=(60, 160) if long else self.max_tokens,
            client_timeout_s=30.0 if long else min(self.client_timeout_s, 20.0))


def _short(name: str, title: str, fault: str | None, *, warm_s: float, observe_s: float,
           idle_before_s: float = 0.0) -> Scenario:
    """Short generations (0.5-1.5 s) on engines with room for every client: 12 clients,
    4 slots on each of 3 engines."""
    return Scenario(name, title, fault, slots=4, steps_per_s=20.0, max_tokens=(10, 30),
                    clients=12, client_timeout_s=30.0, warm_s=warm_s, observe_s=observe_s,
                    idle_before_s=idle_before_s)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    _short("wedge", "wedge under load", "wedge", warm_s=4, observe_s=20),
    _short("crash", "crash under load", "crash", warm_s=4, observe_s=10),
    _short("trickle", "every generation fails, every probe passes", "error5xx",
           warm_s=4, observe_s=20),
    Scenario("saturated", "healthy, 2x more clients than slots", None, slots=2,
             steps_per_s=20.0, max_tokens=(40, 80), clients=12, warm_s=0, observe_s=15,
             client_timeout_s=30.0),
    _short("idle-wedge", "wedge while idle, then load", "wedge", warm_s=0, observe_s=15,
           idle_before_s=3.0),
    # No request at all for 45 s after the fault: only canaries can find it (the goal:
    # "with no traffic, within one canary interval plus the canary timeout": 35 s).
    _short("quiet-wedge", "wedge with no traffic for 45 s, then load", "wedge", warm_s=0,
           observe_s=10, idle_before_s=45.0),
    Scenario("long", "long generations (20-60 s) + a wedge", "wedge", slots=8,
             steps_per_s=20.0, max_tokens=(400, 1200), clients=12, warm_s=6, observe_s=30,
             client_timeout_s=90.0),
    # Streams of 2-3 s, so that a fault finds every engine's slots mid-answer.
    Scenario("stream-crash", "crash mid-stream", "crash", slots=4, steps_per_s=20.0,
             max_tokens=(40, 60), clients=12, warm_s=4, observe_s=10, client_timeout_s=60.0,
             stream=True),
    Scenario("stream-wedge", "wedge mid-stream", "wedge", slots=4, steps_per_s=20.0,
             max_tokens=(40, 60), clients=12, warm_s=4, observe_s=30, client_timeout_s=60.0,
             stream=True),
    # The wedge under load exactly, its requests streamed: a stream parked on the wedge beside
    # the same scenario's waiting requests (same lengths, clients and window).
    dataclasses.replace(_short("stream-wedge-short", "wedge under load, streamed", "wedge",
                               warm_s=4, observe_s=20), stream=True),
    # Wholly silent under load: /health and /metrics hang too (the kernel still accepts into
    # the backlog). Beside the wedge, whose /health answers and /metrics are frozen.
    _short("sigstop", "SIGSTOP of the whole engine process under load", "sigstop", warm_s=4,
           observe_s=20),
    _short("blackhole", "accepts every connection, answers nothing, under load", "blackhole",
           warm_s=4, observe_s=20),
    # Every engine in turn: its process exits, a new one starts on the same port 2 s later,
    # and the next goes as soon as the new one answers /health (a Kubernetes rolling update
    # with maxUnavailable 1 and a /health readiness probe).
    # Generations of 0.2 s, as the restart was first measured with: a fleet of short
    # requests finds "none left" at once when it has none.
    dataclasses.replace(_short("rolling-restart", "every engine restarted in turn, paced by "
                               "/health", "rolling-restart", warm_s=4, observe_s=20),
                        max_tokens=(4, 4)),
    dataclasses.replace(_short("stream-rolling-restart", "rolling restart, streamed",
                               "rolling-restart", warm_s=4, observe_s=20),
                        max_tokens=(4, 4), stream=True),
]}
#: Seconds between a rolling restart's exit of an engine and the start of its new process.
ROLLING_GAP_S = 2.0
#: Seconds of load at least after a rolling restart's last engine answered /health.
ROLLING_TAIL_S = 3.0
#: What --engines real runs (the tiny model answers in well under a second: no "long").
REAL_SCENARIOS = ("wedge", "crash")


# ---------------------------------------------------------------------- routers


@dataclass(frozen=True)
class RouterSpec:
    name: str
    kind: str  # fleetwarden | sglang | vllm | nginx
    tuned: bool = False
    flags: str = ""  # what differs from its defaults, for the table


#: Tuned flags as REAL-ENGINES.md measured them: a short request timeout and a breaker that
#: opens after 2 failures. Everything else at the router's defaults.
TUNED_TIMEOUT_S = 5
TUNED_RUST = ["--request-timeout-secs", str(TUNED_TIMEOUT_S), "--cb-failure-threshold", "2"]
#: As REAL-ENGINES.md launches them (their own default is cache_aware).
RUST_POLICY = "--policy round_robin"
#: nginx: an upstream that fails twice (within fail_timeout) is left out for fail_timeout.
NGINX_MAX_FAILS = 2
NGINX_FAIL_TIMEOUT_S = 15

ROUTERS: dict[str, RouterSpec] = {r.name: r for r in [
    RouterSpec("fleetwarden", "fleetwarden",
               flags="defaults (tick 5 s; a failed request ejects at once, a request silent "
               "1 s accuses; focused reads every 0.25 s; stall floor 5 s)"),
    # Not in the default set: non-streamed answers continued too (off by default).
    RouterSpec("fleetwarden-answers", "fleetwarden", True,
               "defaults, and [router] continue_answers = true"),
    RouterSpec("sglang-router", "sglang", flags=f"defaults, {RUST_POLICY}"),
    RouterSpec("sglang-router-tuned", "sglang", True, f"{' '.join(TUNED_RUST)}, {RUST_POLICY}"),
    RouterSpec("vllm-router", "vllm", flags=f"defaults, {RUST_POLICY}"),
    RouterSpec("vllm-router-tuned", "vllm", True, f"{' '.join(TUNED_RUST)}, {RUST_POLICY}"),
    # nginx's own failure handling (max_fails=1 fail_timeout=10s, 60 s timeouts, a POST never
    # sent again once sent); the streaming settings any LLM deployment needs are on both nginx.
    RouterSpec("nginx-defaults", "nginx", False,
               "defaults: max_fails=1 fail_timeout=10s proxy_read_timeout=60s "
               "proxy_connect_timeout=60s, proxy_next_upstream error timeout; "
               "proxy_buffering off, HTTP/1.1 keep-alive"),
    RouterSpec("nginx", "nginx", True,
               f"max_fails={NGINX_MAX_FAILS} fail_timeout={NGINX_FAIL_TIMEOUT_S}s "
               f"proxy_read_timeout={TUNED_TIMEOUT_S}s, proxy_next_upstream error timeout "
               "http_500 http_502 http_503 non_idempotent (3 tries)"),
]}


#: Run only when named in --routers.
OPTIONAL_ROUTERS = ("fleetwarden-answers", "nginx-defaults")


@dataclass
class RunningRouter:
    url: str
    version: str
    proc: subprocess.Popen[str]
    log: Path
    #: Called once the scenario is over, with the fault's time: which engines (by URL) it
    #: ejected, and notes.
    verdicts: Callable[[float | None], tuple[set[str], list[str]]] = lambda _: (set(), [])
    #: Polled during the scenario (peers with a Prometheus endpoint).
    poll: Callable[[aiohttp.ClientSession], Any] | None = None


# Quick mode compresses fleetwarden's timings the way the scenario tests do (tick 0.5 s,
# stall 2 s): a default wedge takes ~20 s to condemn, longer than a quick window.
QUICK_HEALTH = {"probe_interval_s": 0.5, "probe_timeout_s": 1.0, "stall_s": 2.0,
                "canary_interval_s": 1.0, "canary_timeout_s": 1.5}


def _toml(sections: dict[str, dict[str, Any]]) -> str:
    out = []
    for name, values in sections.items():
        out.append(f"[{name}]")
        for k, v in values.items():
            out.append(f"{k} = {json.dumps(v)}")
    return "\n".join(out) + "\n"


class Launcher:
    """Starts routers (and engines) for one run; everything it starts is stopped in close()."""

    def __init__(self, folder: Path, quick: bool) -> None:
        self.folder = folder
        self.quick = quick
        self.procs: list[subprocess.Popen[str]] = []
        self.cleanups: list[Callable[[], object]] = []

    def spawn(self, argv: list[str], log: Path, **kwargs: Any) -> subprocess.Popen[str]:
        with log.open("a") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True,
                                    stdin=subprocess.DEVNULL, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for cleanup in reversed(self.cleanups):
            with contextlib.suppress(Exception):
                cleanup()
        for proc in reversed(self.procs):
            stop_group(proc, grace_s=5.0)

    # ------------------------------------------------------------------ engines

    def sims(self, scenario: Scenario, n: int = 3) -> list[str]:
        procs = [self._sim(scenario, i, 0) for i in range(n)]
        urls = [self._ready(proc) for proc in procs]
        #: Each engine's process now, by URL (a rolling restart replaces them).
        self.sim_procs = dict(zip(urls, procs, strict=True))
        self.sim_shape = {url: (scenario, i) for i, url in enumerate(urls)}
        return urls

    def _sim(self, scenario: Scenario, i: int, port: int) -> subprocess.Popen[str]:
        with (self.folder / f"sim{i}.log").open("a") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fleetwarden", "sim", "--port", str(port),
                 "--engine", scenario.sim_engines[i % len(scenario.sim_engines)],
                 "--slots", str(scenario.slots),
                 "--steps-per-s", f"{scenario.steps_per_s:g}"],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
                start_new_session=True)
        self.procs.append(proc)
        return proc

    @staticmethod
    def _ready(proc: subprocess.Popen[str]) -> str:
        line = _readline(proc, 30.0)
        if not line.startswith("ready "):
            raise RuntimeError(f"a simulated engine did not start: {line!r}")
        return line.split()[1]

    def restart_sim(self, url: str) -> None:
        """A deploy's restart of one engine: its process exits (SIGTERM), and a new one is
        started on the same port :data:`ROLLING_GAP_S` later (returns once it is started; its
        /health is the caller's to wait for)."""
        old = self.sim_procs[url]
        stop_group(old, grace_s=5.0)
        time.sleep(ROLLING_GAP_S)
        scenario, i = self.sim_shape[url]
        proc = self._sim(scenario, i, int(url.rpartition(":")[2]))
        started = self._ready(proc)
        if started != url:
            raise RuntimeError(f"the restarted engine came up at {started}, not {url}")
        self.sim_procs[url] = proc

    # ------------------------------------------------------------------ routers

    def router(self, spec: RouterSpec, engines: list[str]) -> RunningRouter:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = self.folder / f"{spec.name}.log"
        if spec.kind == "fleetwarden":
            return self._fleetwarden(port, engines, log, answers=spec.tuned)
        if spec.kind in ("sglang", "vllm"):
            requirement = SGLANG_ROUTER if spec.kind == "sglang" else VLLM_ROUTER
            module = "sglang_router" if spec.kind == "sglang" else "vllm_router"
            python = peer_python(requirement)
            prom = free_port()
            argv = [str(python), "-m", f"{module}.launch_router", "--host", "127.0.0.1",
                    "--port", str(port), "--worker-urls", *engines, *RUST_POLICY.split(),
                    "--log-level", "warn" if spec.kind == "sglang" else "warning",
                    "--prometheus-port", str(prom)]
            proc = self.spawn(argv + (TUNED_RUST if spec.tuned else []), log)
            scraper = _BreakerScraper(f"http://127.0.0.1:{prom}/metrics")
            version = installed_version(python, requirement.split("==")[0])
            return RunningRouter(url, version, proc, log, scraper.verdicts, scraper.poll)
        if spec.kind == "nginx":
            binary = ensure_nginx()
            folder = self.folder / "nginx"
            conf = (nginx_config(folder, port, engines, max_fails=NGINX_MAX_FAILS,
                                 fail_timeout_s=NGINX_FAIL_TIMEOUT_S,
                                 read_timeout_s=TUNED_TIMEOUT_S) if spec.tuned else
                    nginx_config(folder, port, engines, max_fails=1, fail_timeout_s=10,
                                 read_timeout_s=60, connect_timeout_s=60, tries=0,
                                 next_upstream="error timeout"))
            proc = self.spawn([binary, "-c", str(conf), "-p", str(folder), "-e",
                               str(folder / "error.log")], log)
            return RunningRouter(url, nginx_version(binary), proc, log,
                                 lambda _: _nginx_verdicts(folder / "error.log", engines))
        raise ValueError(spec.kind)

    def _fleetwarden(self, port: int, engines: list[str], log: Path,
                     answers: bool = False) -> RunningRouter:
        config: dict[str, dict[str, Any]] = {
            "fleet": {"engines": 0, "log_dir": str(self.folder / "fw-logs")},
            "admin": {"token_file": str(self.folder / "fw-admin.token")},
        }
        if answers:
            config["router"] = {"continue_answers": True}
        if self.quick:
            config["health"] = dict(QUICK_HEALTH)
        conf = self.folder / "fleetwarden.toml"
        # The engines are attached, and the simulated ones cap nothing on a request's output:
        # said, as fleetwarden's warning asks of a user (an engine whose cap is unknown has a
        # stream cut before its first generations finished refused, not guessed: 4 of 44 in
        # the quick stream-wedge, docs/history.md, "An unknown cap learnt from floors").
        conf.write_text(_toml(config) + "".join(
            f'[[fleet.backends]]\nurl = {json.dumps(url)}\noutput_cap = "none"\n'
            for url in engines))
        journal = self.folder / "fleetwarden.sqlite"
        argv = [sys.executable, "-m", "fleetwarden", "up", "--config", str(conf),
                "--port", str(port), "--admin-port", str(free_port()), "--journal", str(journal),
                "--quiet", "--log-level", "warning"]
        proc = self.spawn(argv, log)

        def verdicts(fault_at: float | None) -> tuple[set[str], list[str]]:
            stop_group(proc, grace_s=15.0)  # the journal is complete once it has stopped
            return _fleetwarden_verdicts(journal, engines, fault_at)

        return RunningRouter(f"http://127.0.0.1:{port}", FLEETWARDEN_VERSION, proc, log,
                             verdicts)


def _readline(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline().strip() if ready else ""


def _fleetwarden_verdicts(journal: Path, engines: list[str],
                          fault_at: float | None) -> tuple[set[str], list[str]]:
    from fleetwarden.journal import Journal

    out: set[str] = set()
    notes: list[str] = []
    if not journal.exists():
        return out, ["no journal"]
    with Journal(journal) as j:
        for e in j.transitions(state_changes_only=True):
            if e.to_state in ("DEAD", "RESTARTING", "STALE", "RETIRED") and \
                    e.from_state in ("HEALTHY", "SUSPECT") and 0 <= e.shard < len(engines):
                out.add(engines[e.shard])
                when = f"+{e.wall - fault_at:.1f} s" if fault_at else f"at {e.wall:.0f}"
                notes.append(f"engine {e.shard} {e.to_state} {when}: {e.cause}")
    return out, notes


def _nginx_verdicts(error_log: Path, engines: list[str]) -> tuple[set[str], list[str]]:
    out: set[str] = set()
    disabled = 0
    try:
        text = error_log.read_text(errors="replace")
    except OSError:
        return out, []
    for line in text.splitlines():
        if "upstream server temporarily disabled" in line:
            disabled += 1
            m = re.search(r'upstream: "http://([^/"]+)', line)
            if m:
                out.update(u for u in engines if u.endswith("//" + m.group(1)))
    notes = [f"{disabled} 'upstream server temporarily disabled'"] if disabled else []
    if "no live upstreams" in text:
        notes.append(f"{text.count('no live upstreams')} 'no live upstreams'")
    return out, notes


class _BreakerScraper:
    """sglang-router and vllm-router export per-worker breaker and health state: any worker
    whose breaker opened or whose health check failed during the scenario was ejected."""

    _LINE = re.compile(r'^(\w+)\{([^}]*)\}\s+(\S+)$')

    def __init__(self, url: str) -> None:
        self.url = url
        self.ejected: dict[str, str] = {}
        self.scrapes = 0

    async def poll(self, http: aiohttp.ClientSession) -> None:
        try:
            async with http.get(self.url) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return
        self.scrapes += 1
        for line in text.splitlines():
            m = self._LINE.match(line)
            if not m:
                continue
            name, labels, raw = m.groups()
            worker = re.search(r'worker="([^"]+)"', labels)
            if worker is None:
                continue
            try:
                value = float(raw)
            except ValueError:
                continue
            w = worker.group(1)
            if name.endswith("cb_transitions_total") and 'to="open"' in labels and value > 0:
                self.ejected.setdefault(w, "breaker opened")
            elif name.endswith("cb_state") and value != 0:
                self.ejected.setdefault(w, "breaker open")
            elif name.endswith("worker_health") and value == 0:
                self.ejected.setdefault(w, "health check failed")

    def verdicts(self, fault_at: float | None) -> tuple[set[str], list[str]]:
        notes = [] if self.scrapes else ["its metrics endpoint never answered"]
        return set(self.ejected), notes + [f"{w.rpartition(':')[2]}: {why}"
                                           for w, why in sorted(self.ejected.items())]


# ---------------------------------------------------------------------- one run


@dataclass
class Row:
    router: str
    scenario: str
    version: str = ""
    not_run: str = ""
    sent: int = 0
    ok: int = 0
    failed: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    slow: int = 0
    p50_s: float | None = None
    p99_s: float | None = None
    max_s: float | None = None  # the slowest answer
    #: New requests that reached the bad engine after the fault, and when the last one came
    #: (seconds after the fault); None when there is no bad engine or it exited.
    bad_after: int | None = None
    bad_last_s: float | None = None
    #: Requests the bad engine held unanswered at the fault or received after it, and when the
    #: last of them was answered (by whichever engine; seconds after the fault, as the client
    #: saw it). None where the engines' logs carry no request ids (real engines).
    parked: int | None = None
    parked_answered_s: float | None = None
    #: The last-answered parked request: its id and its max_tokens (what its generation costs
    #: where it is answered; bench/scale.py splits its time from the fault).
    parked_last_id: str = ""
    parked_last_tokens: int | None = None
    bad_still_at_end: bool = False
    bad_exited: bool = False
    healthy_ejected: int = 0
    #: The fault's check on the engine after it ran: "" not checked (no such fault), else
    #: "verified: ..." or "NOT verified: ...".
    fault_check: str = ""
    #: A rolling restart: per engine, seconds from its new process answering /health to the
    #: first client request it received (None: none came).
    comeback_s: list[float | None] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    load_avg: tuple[float, float] = (0.0, 0.0)
    seconds: float = 0.0


class StatsLog:
    """Every engine's /sim/stats log, polled during the run (the log is bounded, and a crashed
    engine takes its log with it): entries de-duplicated by (time, method, path, id)."""

    interval_s = 1.0

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.entries: dict[str, set[tuple[float, str, str, str]]] = {u: set() for u in urls}
        self.gone: set[str] = set()

    async def poll(self, http: aiohttp.ClientSession) -> None:
        async def one(url: str) -> None:
            if url in self.gone:
                return
            try:
                async with http.get(url + "/sim/stats") as resp:
                    data = await resp.json()
            except (aiohttp.ClientError, TimeoutError, ValueError):
                self.gone.add(url)
                return
            for e in data.get("log", []):
                self.entries[url].add((float(e["at"]), e["method"], e["path"],
                                       e.get("request_id") or ""))

        await asyncio.gather(*(one(u) for u in self.urls))

    def arrivals(self, url: str) -> list[tuple[float, str]]:
        return sorted((at, rid) for at, _, path, rid in self.entries[url]
                      if path in GENERATION_PATHS and rid.startswith("load-"))


#: Before an idle wedge, after the router serves: see _drive.
IDLE_SETTLE_S = 2.0


async def _wait_serving(router: RunningRouter, timeout_s: float = 60.0) -> None:
    url = router.url
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while time.monotonic() < deadline:
            if router.proc.poll() is not None:
                tail = router.log.read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"the router exited with status {router.proc.returncode}: "
                                   + " / ".join(tail))
            try:
                async with http.get(url + "/v1/models") as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not serve /v1/models within {timeout_s:.0f} s")


async def _serve_once(urls: list[str]) -> None:
    """One short generation on each engine, sent to it directly before any router starts: an
    engine that wedges while idle in service has served before, and a watchdog may rightly
    treat a process that never generated anything otherwise (its first generation may be slow).
    Without it the idle wedge could land while a router's first probe was in flight, and that
    run then measured a cold start instead. Before the router, so that its first read already
    sees the counters where they stay: idle means idle for every read it takes."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for url in urls:
            async with http.post(url + "/v1/completions", json={
                    "model": "tiny", "prompt": "warm", "max_tokens": 1}) as resp:
                resp.raise_for_status()
                await resp.read()


async def _inject(url: str, mode: str) -> None:
    """A fault sent to a simulated engine's fault endpoint."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        try:
            async with http.post(url + "/sim/fault", json={"mode": mode}) as resp:
                resp.raise_for_status()
        except aiohttp.ServerDisconnectedError:
            if mode != "crash":
                raise


class RequestLog(Protocol):
    """What the engines say reached them: StatsLog (simulated), _LoadGauge (real vLLM)."""

    interval_s: float

    async def poll(self, http: aiohttp.ClientSession) -> None: ...

    def arrivals(self, url: str) -> list[tuple[float, str]]: ...


@dataclass
class Engines:
    urls: list[str]
    inject: Callable[[str, str], Awaitable[None]]  # (url, fault)
    stats: RequestLog
    #: What the fault did, read on the engine after it ran (:func:`check_fault`); None: no check.
    check: Callable[[str, str], Awaitable[str]] | None = None
    #: Restart one engine (a deploy's restart); returns once its new process started.
    restart: Callable[[str], Awaitable[None]] | None = None
    #: Once the load has stopped: a stopped process continued, so that its log (the requests
    #: parked in its socket's backlog included) can be read; returns when (None: nothing done).
    lift: Callable[[str, str], Awaitable[float | None]] | None = None


def sim_engines(launcher: Launcher, urls: list[str], *, control: bool = False) -> Engines:
    """Simulated engines, their faults sent as :func:`_inject` does, SIGSTOP as a signal to
    the engine's process, each checked after it ran (:func:`check_fault`). ``control``: every
    fault is aimed at nothing (the run its check must fail)."""

    async def inject(url: str, fault: str) -> None:
        if control:
            return
        if fault == "sigstop":
            os.kill(launcher.sim_procs[url].pid, signal.SIGSTOP)
            return
        await _inject(url, fault)

    async def check(url: str, fault: str) -> str:
        return await check_fault(url, fault, launcher.sim_procs[url].pid)

    async def restart(url: str) -> None:
        await asyncio.to_thread(launcher.restart_sim, url)

    stats = StatsLog(urls)

    async def lift(url: str, fault: str) -> float | None:
        if control or fault != "sigstop":
            return None
        os.kill(launcher.sim_procs[url].pid, signal.SIGCONT)
        stats.gone.discard(url)
        return time.time()

    return Engines(urls, inject, stats, check, None if control else restart, lift)




async def _drive(scenario: Scenario, router: RunningRouter, engines: Engines,
                 row: Row) -> float | None:
    """One scenario through one router; fills ``row`` and returns the fault's time."""
    bad = engines.urls[BAD]
    await _wait_serving(router)
    # Closed loop, fixed seed: every router sees the same sequence of generation lengths.
    load = Load(router.url, concurrency=scenario.clients,
                max_tokens_range=scenario.max_tokens, seed=8, stream=scenario.stream,
                timeout_s=scenario.client_timeout_s, pause_after_failure_s=PAUSE_AFTER_FAILURE_S)
    polling = True

    async def poller() -> None:
        interval = engines.stats.interval_s
        every = max(1, round(1.0 / interval))  # the router's metrics: about once a second
        n = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
            while polling:
                await engines.stats.poll(http)
                if router.poll is not None and n % every == 0:
                    await router.poll(http)
                n += 1
                await asyncio.sleep(interval)
            await engines.stats.poll(http)
            if router.poll is not None:
                await router.poll(http)

    task = asyncio.create_task(poller(), name="poller")
    lifted: float | None = None
    try:
        fault_at = None
        if scenario.fault and scenario.idle_before_s:
            # A fleet that has run a moment: its first reads and probes are done, as they
            # are long done when a serving fleet's idle engine wedges. A fault that met a
            # router's first probe in flight left that router no reading of the engine
            # from before it (a cold start, which this scenario is not about).
            await asyncio.sleep(IDLE_SETTLE_S)
            await engines.inject(bad, scenario.fault)
            await asyncio.sleep(scenario.idle_before_s)
        load.start()
        load_started = time.time()
        if scenario.idle_before_s:
            fault_at = load_started  # the first moment a router could notice
        await asyncio.sleep(scenario.warm_s)
        restarted: dict[str, float] = {}
        observe_until = time.monotonic() + scenario.observe_s
        if scenario.fault == "rolling-restart":
            fault_at = time.time()
            restarted = await _rolling_restart(engines, row)
        elif scenario.fault and not scenario.idle_before_s:
            await engines.inject(bad, scenario.fault)
            fault_at = time.time()
        # A rolling restart longer than the window still gets a little load after its end:
        # the last engine back must be seen serving.
        tail_s = ROLLING_TAIL_S if restarted else 0.0
        await asyncio.sleep(max(tail_s, observe_until - time.monotonic()))
        if engines.check is not None and scenario.fault in ("sigstop", "blackhole"):
            row.fault_check = await engines.check(bad, scenario.fault)
        load_stopped = time.time()
        await load.stop()  # waits for every request in flight: an answer or the client timeout
        if engines.lift is not None and scenario.fault:
            lifted = await engines.lift(bad, scenario.fault)
            if lifted is not None:
                await asyncio.sleep(1.0)  # it takes in its backlog before the last poll
    finally:
        await load.stop()  # at once when it already stopped; after an error, the load's end
        polling = False
        await task
    if scenario.fault == "rolling-restart":
        _score(scenario, load.results, engines, bad, None, load_stopped, row)
        row.comeback_s = [_first_request_after(engines.stats, url, at)
                          for url, at in restarted.items()]
    else:
        _score(scenario, load.results, engines, bad, fault_at, load_stopped, row, lifted)
    return fault_at


async def _rolling_restart(engines: Engines, row: Row) -> dict[str, float]:
    """Every engine in turn: restarted (:meth:`Launcher.restart_sim`), the next one as soon
    as the new process answers ``/health``. Returns when each answered it (wall time), by
    URL; the check (each engine's new process start time) goes into ``row.fault_check``."""
    answered: dict[str, float] = {}
    if engines.restart is None:  # a control run: nothing restarted
        row.fault_check = "NOT verified: no engine was restarted"
        return answered
    starts_before = {url: await _start_time(url) for url in engines.urls}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as http:
        for url in engines.urls:
            await engines.restart(url)
            while True:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(url + "/health") as resp:
                        if resp.status == 200:
                            break
                await asyncio.sleep(0.02)
            answered[url] = time.time()
            if isinstance(engines.stats, StatsLog):
                engines.stats.gone.discard(url)  # its log is the new process's now
    starts_after = {url: await _start_time(url) for url in engines.urls}
    new = [url for url in engines.urls
           if starts_after[url] is not None and starts_after[url] != starts_before[url]]
    row.fault_check = (f"{'verified' if len(new) == len(engines.urls) else 'NOT verified'}: "
                       f"{len(new)} of {len(engines.urls)} engines answer under a new process "
                       "start time")
    return answered


async def _start_time(url: str) -> float | None:
    """The engine's ``process_start_time_seconds`` from its own ``/metrics``."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http, \
                http.get(url + "/metrics") as resp:
            body = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    found = re.search(r"^process_start_time_seconds(?:\{[^}]*\})? (\S+)$", body, re.M)
    return float(found.group(1)) if found else None


def _first_request_after(stats: RequestLog, url: str, at: float) -> float | None:
    """Seconds from ``at`` to the first client request the engine at ``url`` received."""
    after = [t for t, _ in stats.arrivals(url) if t >= at]
    return round(after[0] - at, 2) if after else None


def _score(scenario: Scenario, results: list[RequestResult], engines: Engines, bad: str,
           fault_at: float | None, load_stopped: float, row: Row,
           lifted: float | None = None) -> None:
    """``lifted``: when a stopped engine was continued; what its log shows from then on
    arrived while it was stopped, at times nobody saw (parked in its backlog): counted as
    parked, never as new requests at the time it logs them."""
    row.sent = len(results)
    row.ok = sum(r.ok for r in results)
    row.failed = row.sent - row.ok
    for r in results:
        if not r.ok:
            key = "cut" if r.incomplete else str(r.status) if r.status else (
                "timeout" if "Timeout" in r.error else "error event" if "APIError" in r.error
                else "no answer")
            row.by_status[key] = row.by_status.get(key, 0) + 1
    row.slow = sum(1 for r in results
                   if r.latency_s > SLOW_S + r.max_tokens / scenario.steps_per_s)
    lat = sorted(r.latency_s for r in results if r.ok)
    if lat:
        row.p50_s = lat[len(lat) // 2]
        row.p99_s = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        row.max_s = lat[-1]
    if fault_at is None:
        return
    row.bad_exited = scenario.fault == "crash"
    arrivals = engines.stats.arrivals(bad)
    ids = {rid for _, rid in arrivals}
    if ids and ids != {"load-?"}:
        # Load times its requests on the monotonic clock; the fault is wall time.
        to_wall = time.time() - time.monotonic()
        parked = [(r.started + r.latency_s + to_wall - fault_at, r) for r in results
                  if r.request_id in ids and r.started + r.latency_s + to_wall > fault_at]
        row.parked = len(parked)
        if parked:
            row.parked_answered_s, last = max(parked, key=lambda p: p[0])
            row.parked_last_id, row.parked_last_tokens = last.request_id, last.max_tokens
    if lifted is not None:
        # Logged once it was continued, these arrived while it was stopped: placed at their
        # client's start, the latest they can have arrived after.
        to_wall = time.time() - time.monotonic()
        sent_at = {r.request_id: r.started + to_wall for r in results}
        arrivals = sorted((sent_at.get(rid, at) if at >= lifted else at, rid)
                          for at, rid in arrivals)
    after = [at for at, _ in arrivals if at >= fault_at]
    row.bad_after = len(after)
    row.bad_last_s = (after[-1] - fault_at) if after else 0.0
    tail = max(3.0, 0.2 * scenario.observe_s)
    row.bad_still_at_end = bool(after) and after[-1] >= load_stopped - tail


def run_one(spec: RouterSpec, scenario: Scenario, quick: bool, keep: bool,
            real: RealEngines | None = None, control: bool = False) -> Row:
    row = Row(spec.name, scenario.name)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    folder = Path(tempfile.mkdtemp(prefix=f"failover-{spec.name}-{scenario.name}-"))
    launcher = Launcher(folder, quick)
    try:
        if real is not None:
            engines = real.start(launcher, folder)
        else:
            urls = launcher.sims(scenario)
            engines = sim_engines(launcher, urls, control=control)
            if scenario.idle_before_s:
                asyncio.run(_serve_once(urls))  # before any router: see _serve_once
        try:
            router = launcher.router(spec, engines.urls)
        except PeerUnavailable as exc:
            row.not_run = str(exc)
            return row
        row.version = router.version
        fault_at = asyncio.run(_drive(scenario, router, engines, row))
        if keep and fault_at is not None:  # the logs' timeline is read from the fault on
            (folder / "fault_at").write_text(f"{fault_at!r}\n")
        ejected, notes = router.verdicts(fault_at)
        # A rolling restart faults every engine in turn: each is rightly taken out.
        faulted = ({engines.urls[BAD]} if scenario.fault != "rolling-restart"
                   else set(engines.urls)) if scenario.fault else set()
        healthy = set(engines.urls) - faulted
        row.healthy_ejected = len(ejected & healthy)
        row.notes = _shorten(notes, engines.urls)
    except Exception as exc:  # one broken run is a row that says so, not a lost benchmark
        row.not_run = f"error: {type(exc).__name__}: {exc}"[:200]
    finally:
        launcher.close()
        row.seconds = time.monotonic() - started
        row.load_avg = (load_before, os.getloadavg()[0])
        if not keep:
            _rmtree(folder)
        else:
            print(f"  kept {folder}", file=sys.stderr)
    return row


def _shorten(notes: list[str], engines: list[str]) -> list[str]:
    out = []
    for note in notes:
        for i, url in enumerate(engines):
            note = note.replace(url, f"engine {i}").replace(url.rpartition(":")[2] + ":",
                                                            f"engine {i}:")
        out.append(note)
    return out


def _rmtree(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------- real vLLM engines


class _LoadGauge:
    """For real vLLM (no /sim/stats): ``GET /load`` (``--enable-server-load-tracking``) counts
    the HTTP requests in the API server, also while its engine core is stopped; every rise
    between two reads is a new request that reached it (on a stopped engine nothing leaves)."""

    interval_s = 0.2

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.last: dict[str, int] = {}
        self.rises: dict[str, list[float]] = {u: [] for u in urls}
        self.gone: set[str] = set()

    async def poll(self, http: aiohttp.ClientSession) -> None:
        for url in self.urls:
            if url in self.gone:
                continue
            try:
                async with http.get(url + "/load") as resp:
                    n = int((await resp.json())["server_load"])
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                self.gone.add(url)
                continue
            if n > self.last.get(url, 0):
                self.rises[url].extend([time.time()] * (n - self.last.get(url, 0)))
            self.last[url] = n

    def arrivals(self, url: str) -> list[tuple[float, str]]:
        return [(t, "load-?") for t in self.rises[url]]


@dataclass
class RealEngines:
    python: Path
    model: Path

    def start(self, launcher: Launcher, folder: Path) -> Engines:
        from fleetwarden.testing.vllm_engine import start_vllm_engine

        engines = [start_vllm_engine(self.python, self.model, folder, shard=i,
                                     extra_args="--enable-server-load-tracking")
                   for i in range(2)]
        for e in engines:
            launcher.cleanups.append(e.stop)
        for e in engines:
            e.wait_ready()
        by_url = {e.base_url: e for e in engines}

        async def inject(url: str, fault: str) -> None:
            from fleetwarden.launchers.procs import signal_group_member

            sig = {"wedge": signal.SIGSTOP, "crash": signal.SIGKILL}[fault]
            await asyncio.to_thread(signal_group_member, by_url[url].pgid, "VLLM::EngineCore",
                                    sig)

        urls = [e.base_url for e in engines]
        return Engines(urls, inject, _LoadGauge(urls))


# ---------------------------------------------------------------------- the report


def _fmt_s(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def _parked_cell(row: Row) -> str:
    if row.parked is None:
        return "—"
    if row.parked == 0 or row.parked_answered_s is None:
        return "none"
    return f"+{row.parked_answered_s:.1f} s ({row.parked})"


def _bad_cell(row: Row) -> str:
    if row.bad_after is None:
        return "—"
    if row.bad_exited:
        return "exited"
    if row.bad_after == 0:
        return "none"
    when = f"+{row.bad_last_s:.1f} s"
    return (f"**still at end** ({row.bad_after}, last {when})" if row.bad_still_at_end
            else f"{when} ({row.bad_after})")


def _failed_cell(row: Row) -> str:
    if not row.failed:
        return "0"
    pct = 100.0 * row.failed / max(1, row.sent)
    detail = ", ".join(f"{k}×{v}" for k, v in sorted(row.by_status.items()))
    return f"**{row.failed}** ({pct:.0f} %: {detail})"


def _load_cell(row: Row) -> str:
    # More runnable processes than cores: the machine was busy beyond this run (others' work).
    busy = max(row.load_avg) > (os.cpu_count() or 1)
    return f"{row.load_avg[0]:.1f}–{row.load_avg[1]:.1f}" + (" ⚠ busy" if busy else "")


def table(rows: list[Row], scenarios: dict[str, Scenario]) -> str:
    lines = ["| scenario | router | sent (whole streams) | client-visible failures "
             "| slow (>10 s extra) "
             "| p50 / p99 / slowest s "
             "| requests parked on the bad engine: last answered (count) "
             "| new requests on the bad engine after the fault: last (count) "
             "| healthy engines ejected | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        title = scenarios[row.scenario].name
        if row.not_run:
            lines.append(f"| {title} | {row.router} | not run: {row.not_run} "
                         "| | | | | | | |")
            continue
        sent = f"{row.sent} ({row.ok} whole)" if scenarios[row.scenario].stream else row.sent
        lines.append(
            f"| {title} | {row.router} | {sent} | {_failed_cell(row)} | {row.slow} "
            f"| {_fmt_s(row.p50_s)} / {_fmt_s(row.p99_s)} / {_fmt_s(row.max_s)} "
            f"| {_parked_cell(row)} "
            f"| {_bad_cell(row)} "
            f"| {row.healthy_ejected} | {_load_cell(row)} |")
    return "\n".join(lines)


def fault_table(rows: list[Row]) -> str:
    """The faults' own checks, and each restarted engine's wait for its first client request
    (empty when no row has either)."""
    checked = [r for r in rows if r.fault_check or r.comeback_s]
    if not checked:
        return ""
    lines = ["| scenario | router | the fault, checked on the engine after it ran "
             "| restarted engines: /health 200 → first client request, s |",
             "|---|---|---|---|"]
    for row in checked:
        back = " / ".join("none" if s is None else f"{s:.2f}" for s in row.comeback_s) or "—"
        lines.append(f"| {row.scenario} | {row.router} | {row.fault_check or '—'} | {back} |")
    return "\n".join(lines)


def describe(scenarios: dict[str, Scenario], routers: list[RouterSpec], rows: list[Row],
             real: bool, quick: bool) -> str:
    lines = ["Scenarios (engine 1 gets the fault; "
             + ("2 real vLLM engines: wedge = SIGSTOP of its `VLLM::EngineCore`, crash = "
                "SIGKILL of it" if real else "3 simulated engines") + "):", ""]
    for s in scenarios.values():
        gen = f"{s.max_tokens[0] / s.steps_per_s:g}–{s.longest_generation_s():g} s"
        timing = (f"fault {s.idle_before_s:g} s before the load, then {s.observe_s:g} s of load"
                  if s.idle_before_s else
                  f"{s.warm_s:g} s of load, the fault, {s.observe_s:g} s more"
                  if s.fault else f"{s.observe_s:g} s of load")
        shape = (f"max_tokens {s.max_tokens[0]}–{s.max_tokens[1]} on the tiny model (well "
                 "under a second each)" if real else
                 f"{s.slots} slots per engine, generations {gen} ({s.max_tokens[0]}–"
                 f"{s.max_tokens[1]} tokens at {s.steps_per_s:g} steps/s)")
        lines.append(f"- **{s.name}** ({s.title}): {s.clients} clients, {shape}; {timing}; "
                     f"client timeout {s.client_timeout_s:g} s.")
    if any(s.stream for s in scenarios.values()):
        lines += ["", "Streamed scenarios: each client reads streamed completions with usage; "
                  "a stream counts as answered only when it is **whole**: one chunk per token, "
                  "a finish, and a usage whose completion tokens equal the chunks received and "
                  "max_tokens. *cut*: a stream that ended without being whole (closed early, "
                  "no finish, tokens missing); *error event*: one that ended with an error "
                  "event (the `openai` client raises it); *timeout*: one still hanging at the "
                  "client's timeout."]
    lines += ["", f"Every client waits {PAUSE_AFTER_FAILURE_S:g} s after a failed request before "
              "its next one (the failed one is not re-sent). *Slow*: answered or not, more than "
              f"{SLOW_S:g} s beyond the request's own generation time. p50/p99: answered "
              "requests. *New requests on the bad engine*: "
              + ("rises of its API server's in-flight count (`GET /load`, "
                 "`--enable-server-load-tracking`, read every 0.2 s: a lower bound)"
                 if real else "from the engine's own request log (`/sim/stats`)")
              + ", requests that arrived after the fault, and when the last one came "
              "(**still at end**: one came in the last fifth of the window; *exited*: the "
              "crashed engine's process is gone). *Ejected*: a healthy engine "
              "that the router took out (its breaker, health check, fleetwarden's ledger, "
              "nginx's max_fails).", "", "Routers:", ""]
    versions = {r.router: r.version for r in rows if r.version}
    for spec in routers:
        flags = spec.flags
        if quick and spec.kind == "fleetwarden":
            flags = ("compressed for --quick: " + ", ".join(f"{k} {v:g}"
                                                           for k, v in QUICK_HEALTH.items()))
        lines.append(f"- **{spec.name}** {versions.get(spec.name, '')}: {flags}")
    return "\n".join(lines)


def chart(rows: list[Row], scenarios: list[str], routers: list[str], path: Path,
          subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(scenarios))
    nrows = (len(scenarios) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols + 1.6, 2.3 * nrows + 1.0),
                             sharey=True, squeeze=False)
    flat = [ax for row_axes in axes for ax in row_axes]
    for ax in flat[len(scenarios):]:
        ax.set_visible(False)
    by_key = {(r.router, r.scenario): r for r in rows}
    colours = ["#2a9d8f", "#e76f51", "#f4a261", "#8d6cab", "#b5a0cc", "#6c757d"]
    for ax, scenario in zip(flat, scenarios, strict=False):
        for i, router in enumerate(routers):
            row = by_key.get((router, scenario))
            if row is None or row.not_run or not row.sent:
                ax.text(0.5, i, "not run", va="center", fontsize=7)
                continue
            failed = 100.0 * row.failed / row.sent
            slow_ok = 100.0 * max(0, row.slow - _slow_failed(row)) / row.sent
            ax.barh(i, failed, color=colours[i % len(colours)])
            ax.barh(i, slow_ok, left=failed, color=colours[i % len(colours)], alpha=0.35,
                    hatch="///", edgecolor="white")
            label = f"{failed:.0f}%" + (f" (+{slow_ok:.0f}% slow)" if slow_ok >= 0.5 else "")
            ax.text(min(failed + slow_ok, 100) + 2, i, label, va="center", fontsize=7)
        ax.set_title(scenario, fontsize=9)
        ax.set_xlim(0, 125)
        ax.set_xlabel("% of requests", fontsize=8)
        ax.tick_params(labelsize=7)
    for row_axes in axes:
        row_axes[0].set_yticks(range(len(routers)), routers)
    axes[0][0].invert_yaxis()
    fig.suptitle("Client-visible failures (solid) and answered-but-slow requests (hatched, "
                 f">{SLOW_S:g} s beyond their generation)\n{subtitle}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _slow_failed(row: Row) -> int:
    # failures counted as slow are already in the solid bar; only answered slow ones go hatched
    return row.by_status.get("timeout", 0)


def write_benchmarks(section: str, engines: str) -> None:
    """Replace this kind's measured block in BENCHMARKS.md (or add it at the end); whatever
    was written by hand around the markers stays."""
    begin = f"<!-- failover-{engines}:begin (written by bench/failover.py --write) -->"
    end = f"<!-- failover-{engines}:end -->"
    text = BENCHMARKS_MD.read_text()
    block = f"{begin}\n{section.rstrip()}\n{end}"
    if begin in text and end in text:
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        text = head + block + tail
    else:
        text = text.rstrip() + f"\n\n## {SECTIONS[engines]}\n\n" + block + "\n"
    BENCHMARKS_MD.write_text(text)


# ---------------------------------------------------------------------- main


def _pick(value: str | None, known: dict[str, Any], what: str) -> list[str]:
    if not value:
        return list(known)
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)}; known: {', '.join(known)}")
    return names


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every router and engine started is stopped."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="shorter windows; fleetwarden's timings compressed (tick 0.5 s, "
                             "stall 2 s) to fit them")
    parser.add_argument("--quick-windows", action="store_true",
                        help="--quick's shorter windows, fleetwarden at its defaults (what the "
                             "scenario tests run: a rolling restart's comeback at the defaults)")
    parser.add_argument("--scenarios", help="comma-separated: " + ",".join(SCENARIOS))
    parser.add_argument("--routers", help="comma-separated: " + ",".join(ROUTERS))
    parser.add_argument("--engines", choices=["sim", "real"], default="sim")
    parser.add_argument("--sim-engines", default="vllm",
                        help="comma-separated kinds the simulated engines speak, cycled "
                             "(vllm, llamacpp, sglang), e.g. vllm,llamacpp,sglang: a mixed "
                             "fleet; the second is the faulted one")
    parser.add_argument("--write", action="store_true",
                        help=f"write the table into {BENCHMARKS_MD.name} and the chart to "
                             f"{CHARTS['sim'].relative_to(ROOT)} (real engines: "
                             f"{CHARTS['real'].relative_to(ROOT)})")
    parser.add_argument("--json", type=Path, help="also write every row as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep each run's folder (logs)")
    parser.add_argument("--control", action="store_true",
                        help="aim every fault at nothing: the run whose fault check must fail "
                             "(never written to BENCHMARKS.md)")
    args = parser.parse_args(argv)

    real = args.engines == "real"
    names = _pick(args.scenarios, SCENARIOS, "scenario")
    # Streamed scenarios have a section of their own, so a run of them alone never replaces
    # the table of the others.
    kind = args.engines
    if not real and names and all(SCENARIOS[n].stream for n in names):
        kind = "streams"
    elif not real and any(SCENARIOS[n].stream for n in names) and args.write:
        raise SystemExit("--write: run the streamed scenarios (stream-*) alone, into their "
                         "own section")
    if real:
        names = [n for n in names if n in REAL_SCENARIOS]
    short = args.quick or args.quick_windows
    scenarios = {n: SCENARIOS[n].quick() if short else SCENARIOS[n] for n in names}
    if real:
        scenarios = {n: dataclasses.replace(s, slots=0, steps_per_s=1000.0, max_tokens=(16, 64),
                                            clients=8) for n, s in scenarios.items()}
    routers = [ROUTERS[n] for n in _pick(args.routers, ROUTERS, "router")
               if args.routers or n not in OPTIONAL_ROUTERS]
    kinds = tuple(k for k in args.sim_engines.split(",") if k)
    from fleetwarden.sim.config import SIM_ENGINES

    if not kinds or set(kinds) - set(SIM_ENGINES):
        parser.error(f"--sim-engines {args.sim_engines!r}: each of {', '.join(SIM_ENGINES)}")
    scenarios = {n: dataclasses.replace(s, sim_engines=kinds) for n, s in scenarios.items()}

    engines_real: RealEngines | None = None
    if real:
        from fleetwarden.testing.tiny_model import ensure_tiny_model
        from fleetwarden.testing.vllm_env import ensure_vllm_env

        python = ensure_vllm_env()
        engines_real = RealEngines(python, ensure_tiny_model(python=python))

    command = "python bench/failover.py " + shlex.join(argv if argv is not None
                                                        else sys.argv[1:])
    started = time.monotonic()
    started_wall = dt.datetime.now().astimezone()
    load_start = os.getloadavg()
    print(f"{command}\nstarted {started_wall:%Y-%m-%d %H:%M %Z}; {os.cpu_count()} CPUs; "
          f"load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}",
          file=sys.stderr)
    rows: list[Row] = []
    with _sigterm_as_interrupt():
        for name, scenario in scenarios.items():
            for spec in routers:
                print(f"[{time.monotonic() - started:6.0f} s] {name:10} {spec.name} ...",
                      file=sys.stderr, end="", flush=True)
                row = run_one(spec, scenario, args.quick, args.keep, engines_real,
                              control=args.control)
                rows.append(row)
                print(f" {row.seconds:.0f} s: " + (f"not run: {row.not_run}" if row.not_run
                      else f"{row.failed}/{row.sent} failed, {row.slow} slow, "
                           f"bad engine {_bad_cell(row)}, ejected {row.healthy_ejected}"
                           + (f"; {'; '.join(row.notes)}" if row.notes else "")),
                      file=sys.stderr, flush=True)
    elapsed = time.monotonic() - started
    load_end = os.getloadavg()
    summary = (f"{started_wall:%Y-%m-%d}, {os.cpu_count()} CPUs, whole run "
               f"{elapsed / 60:.1f} min; load average (1 min) {load_start[0]:.2f} at the start, "
               f"{load_end[0]:.2f} at the end" + (" (--quick)" if args.quick else
                                                  " (--quick-windows)" if short else ""))
    body = "\n\n".join(part for part in [
        f"```\n{command}\n```", summary, table(rows, scenarios), fault_table(rows),
        describe(scenarios, routers, rows, real, args.quick)] if part)
    print("\n" + body)
    notes = [f"- {r.router} / {r.scenario}: {n}" for r in rows for n in r.notes]
    if notes:
        print("\nWhat the routers reported:\n" + "\n".join(notes))
    if args.json:
        args.json.write_text(json.dumps({"command": command, "summary": summary,
                                         "rows": [dataclasses.asdict(r) for r in rows]},
                                        indent=2))
    if args.write and args.control:
        raise SystemExit("--control runs are checks of the checks: never written")
    if args.write:
        where = CHARTS[kind]
        chart(rows, list(scenarios), [r.name for r in routers], where, summary)
        write_benchmarks(body + f"\n\n![failover chart]({where.relative_to(ROOT)})", kind)
        print(f"\nwrote {BENCHMARKS_MD.name} and {where.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
