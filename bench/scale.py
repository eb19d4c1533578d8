"""A fleet at scale: 10 to 1,000 simulated engines behind `fleetwarden up --backend`, and the
failover scenarios at 64 and 256 engines.

The engines are one `fleetwarden sim --engines N` process by default (one event loop, each
engine its own port, state and faults: ``fleetwarden.sim.many``); fleetwarden attaches to
them with one ``--backend`` each, at its defaults (tick 5 s), its router in a process of its
own as `fleetwarden up` runs it. At 10 engines by default (``--launched``), fleetwarden also
launches each engine as a process of its own: a thousand processes do not fit on 2 cores.

Steady state, per size: time from `fleetwarden up` to every shard HEALTHY; then a window of
load (closed loop, short generations): the tick's p50/p99, reads per round and per second,
evidence to decision (from the journal's run summary), fleetwarden's and its router's RSS and
CPU over the window (from /proc), the router's added latency (its own histogram) and the
requests per second the clients got.

Failover, at 64 and 256 engines: bench/failover.py's wedge, crash and trickle, driven and
scored by its own code (its Row, table and columns), so the rows compare with its 3-engine
figures; and the time from the fault to the bad engine's ejection and condemnation (the
journal). The load is 48 clients (bench/failover.py: 12 at 3 engines; ``--clients``), and
the fault waits (up to 60 s after the warm-up) until the bad engine runs a request, so that it
comes under load. Each failover run also says where the time from the fault to the last parked
answer went (:class:`Split`: the first focused read, the reads' pace, the hedge, the copy's
answer, from the journal's verdict rows and the router's log) and how loaded each process was
meanwhile (the sim processes', fleetwarden's and its router's CPU; how late the bad engine's
sim process and fleetwarden's admin answer a GET).

``--sim-processes K`` serves the engines from K sim processes (engine i in the process whose
share holds it; the bad engine, engine 1, in the first): one process's loop is one core at
most, and K of them can use the machine's others.

    python bench/scale.py                         # 10, 100, 300, 1000 attached, 10 launched;
                                                  # failover at 64, 256
    python bench/scale.py --sizes 10,100 --failover 64 --scenarios crash
    python bench/scale.py --sizes '' --launched '' --failover 3 --clients 12 \
        --sim-processes 3 --scenarios wedge       # bench/failover.py's 3 engines, with the split
    python bench/scale.py --json scale.json       # also every figure as JSON

Run it on a quiet machine: the load average is printed beside every row.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

import failover
from _peers import free_port, stop_group
from fleetwarden.testing.load import Load

ROOT = Path(__file__).resolve().parent.parent
SIZES = (10, 100, 300, 1000)
FAILOVER_SIZES = (64, 256)
FAILOVER_SCENARIOS = ("wedge", "crash", "trickle")
#: Clients of the failover scenarios at scale (bench/failover.py runs 12 against 3 engines).
FAILOVER_CLIENTS = 48
#: The steady-state window: long enough for several 5 s ticks after all are serving.
WINDOW_S = 30.0
#: Clients of the steady-state load; each request 4-8 tokens at 20 steps/s (0.2-0.4 s).
STEADY_CLIENTS = 16
#: From `fleetwarden up` to every shard HEALTHY: the goal is 60 s at 1,000 engines.
SERVING_TIMEOUT_S = 180.0


@dataclasses.dataclass
class Steady:
    engines: int
    #: "attach": one `fleetwarden sim --engines N` process, `--backend` each; "launched":
    #: fleetwarden starts each engine as a process of its own (its default engine command).
    mode: str = "attach"
    serving_s: float | None = None
    ticks: int = 0
    tick_p50_s: float | None = None
    tick_p99_s: float | None = None
    round_p99_s: float | None = None
    reads_per_round_min: float | None = None
    reads_per_s: float | None = None
    decision_p99_s: float | None = None
    push_p99_s: float | None = None
    fw_rss_mb: float = 0.0
    fw_cpu_pct: float = 0.0
    router_rss_mb: float = 0.0
    router_cpu_pct: float = 0.0
    sim_rss_mb: float = 0.0
    added_ms: float | None = None
    req_per_s: float = 0.0
    failed: int = 0
    load_avg: tuple[float, float] = (0.0, 0.0)
    error: str = ""
    #: Ticks inside the loaded window only (the journal's figures include the first round,
    #: with its first canaries): how many, their mean, and the histogram bucket their p99
    #: falls in (an upper bound).
    window_ticks: int = 0
    window_tick_mean_s: float | None = None
    window_tick_p99_le_s: float | None = None


def shares(n: int, processes: int) -> list[int]:
    """How many of ``n`` engines each of ``processes`` sim processes serves: in order, the
    first ones one more where ``n`` does not divide evenly (engine i is in the process whose
    range holds i)."""
    if not 1 <= processes <= n:
        raise ValueError(f"sim processes must be within 1..{n} (the engines), got {processes}")
    return [n // processes + (1 if k < n % processes else 0) for k in range(processes)]


def start_sims(n: int, folder: Path, slots: int = 4, steps_per_s: float = 20.0,
               processes: int = 1) -> tuple[list[subprocess.Popen[str]], list[str]]:
    """``n`` engines as ``processes`` `fleetwarden sim --engines k` processes (each its own
    event loop: one process of 256 engines is one core at most), and the engines' URLs in
    order (the first process's engines first)."""
    procs: list[subprocess.Popen[str]] = []
    for k, count in enumerate(shares(n, processes)):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "fleetwarden", "sim", "--port", "0", "--engines", str(count),
             "--slots", str(slots), "--steps-per-s", f"{steps_per_s:g}"],
            stdout=subprocess.PIPE, stderr=(folder / f"sim{k}.err").open("w"), text=True,
            stdin=subprocess.DEVNULL, start_new_session=True))
    urls: list[str] = []
    try:
        for k, (proc, count) in enumerate(zip(procs, shares(n, processes), strict=True)):
            urls += _ready_urls(proc, count, folder / f"sim{k}.err")
    except BaseException:
        for proc in procs:
            stop_group(proc, grace_s=2)
        raise
    return procs, urls


def _ready_urls(proc: subprocess.Popen[str], count: int, err: Path) -> list[str]:
    """The ``ready URL ...`` lines of one sim process of ``count`` engines (one of more
    engines ends them with ``all ready N``; a single engine prints its one line)."""
    assert proc.stdout is not None
    urls: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"sim ended: {err.read_text()[-500:]}")
        if line.startswith("ready "):
            urls.append(line.split()[1])
        if len(urls) == count and (count == 1 or line.strip() == f"all ready {count}"):
            return urls
    raise RuntimeError(f"a sim process did not start {count} engines in 120 s")


def _proc_figures(pid: int) -> tuple[float, float]:
    """(RSS in MB, CPU seconds so far) of one process, from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return rss_pages * os.sysconf("SC_PAGE_SIZE") / 1e6, (int(stat[11]) + int(stat[12])) / ticks


def _routers(pid: int) -> list[int]:
    """The router processes `fleetwarden up` (``pid``) started (not its engines)."""
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True,
                             timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = []
    for child in (int(x) for x in out.split()):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"route" in argv:
            found.append(child)
    return found


async def _admin(http: aiohttp.ClientSession, admin: str, path: str) -> Any:
    async with http.get(admin + path) as resp:
        resp.raise_for_status()
        return await resp.json() if path != "/metrics" else await resp.text()


def _buckets(text: str, name: str) -> dict[float, float]:
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.split()[-1])
    return out


def _window_ticks(before: str, after: str) -> tuple[int, float | None, float | None]:
    """The ticks between two scrapes of the fleet's /metrics: count, mean, p99 bucket."""
    name = "fleetwarden_tick_seconds"
    count = _metric_sum(after, name + "_count") - _metric_sum(before, name + "_count")
    total = _metric_sum(after, name + "_sum") - _metric_sum(before, name + "_sum")
    if count <= 0:
        return 0, None, None
    b0, b1 = _buckets(before, name), _buckets(after, name)
    p99 = next((le for le in sorted(b1) if b1[le] - b0.get(le, 0.0) >= 0.99 * count), None)
    return int(count), total / count, p99


def _metric_sum(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def _wait_for_file(path: Path, proc: subprocess.Popen[str], log: Path) -> None:
    """Until ``path`` exists (the admin token ``fleetwarden up`` writes once it listens)."""
    deadline = time.monotonic() + SERVING_TIMEOUT_S
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"fleetwarden up exited: {log.read_text()[-300:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {path.name} within {SERVING_TIMEOUT_S:.0f} s")
        time.sleep(0.1)


def steady(n: int, folder: Path, launched: bool = False, sim_processes: int = 1) -> Steady:
    """One size: its engines, `fleetwarden up` attached to them (or launching them), the
    window, the figures."""
    row = Steady(n, "launched" if launched else "attach")
    sims, urls = ([], []) if launched else start_sims(n, folder, processes=sim_processes)
    fleet: dict[str, Any] = ({"engines": n} if launched else {"engines": 0, "backends": urls})
    port, admin_port = free_port(), free_port()
    token_file = folder / "admin.token"
    conf = folder / "fleet.toml"
    conf.write_text(failover._toml({
        "fleet": {**fleet, "log_dir": str(folder / "logs")},
        "admin": {"token_file": str(token_file)},
    }))
    journal = folder / "fleet.sqlite"
    started = time.monotonic()
    up = subprocess.Popen(
        [sys.executable, "-m", "fleetwarden", "up", "--config", str(conf), "--port", str(port),
         "--admin-port", str(admin_port), "--journal", str(journal), "--quiet",
         "--log-level", "warning"],
        stdout=(folder / "up.log").open("w"), stderr=subprocess.STDOUT, text=True,
        stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for_file(token_file, up, folder / "up.log")
        asyncio.run(_measure(row, f"http://127.0.0.1:{admin_port}", port,
                             token_file.read_text().strip(),
                             started, up.pid, [sim.pid for sim in sims]))
    except Exception as exc:  # one broken size is a row that says so
        row.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        stop_group(up, grace_s=30.0)  # a clean stop writes the run summary
        for sim in sims:
            stop_group(sim, grace_s=5.0)
    _summary_into(row, journal)
    return row


async def _measure(row: Steady, admin: str, port: int, token: str, started: float,
                   up_pid: int, sim_pids: list[int]) -> None:
    n = row.engines
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=10)) as http:
        while time.monotonic() - started < SERVING_TIMEOUT_S:
            try:
                status = await _admin(http, admin, "/admin/status")
                # Attached engines start HEALTHY on trust: serving means a whole read round
                # (and its first canaries) has confirmed every one.
                rounds = _metric_sum(await _admin(http, admin, "/metrics"),
                                     "fleetwarden_read_round_seconds_count")
                if status["counts"].get("HEALTHY", 0) == n and rounds >= 1:
                    row.serving_s = time.monotonic() - started
                    break
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.25)
        if row.serving_s is None:
            row.error = f"not all serving within {SERVING_TIMEOUT_S:.0f} s"
        routers = _routers(up_pid)
        before = {p: _proc_figures(p) for p in [up_pid, *routers]}
        metrics_before = await _admin(http, admin, "/metrics")
        load_before = os.getloadavg()[0]
        window_start = time.monotonic()
        async with Load(f"http://127.0.0.1:{port}", concurrency=STEADY_CLIENTS,
                        max_tokens_range=(4, 8), seed=8, timeout_s=30.0) as load:
            await asyncio.sleep(WINDOW_S)
        window = time.monotonic() - window_start
        after = {p: _proc_figures(p) for p in [up_pid, *routers]}
        metrics_after = await _admin(http, admin, "/metrics")
        row.window_ticks, row.window_tick_mean_s, row.window_tick_p99_le_s = _window_ticks(
            metrics_before, metrics_after)
        row.load_avg = (load_before, os.getloadavg()[0])
        row.req_per_s = sum(r.ok for r in load.results) / window
        row.failed = sum(not r.ok for r in load.results)
        row.fw_rss_mb = after[up_pid][0]
        row.fw_cpu_pct = 100 * (after[up_pid][1] - before[up_pid][1]) / window
        row.router_rss_mb = sum(after[p][0] for p in routers)
        row.router_cpu_pct = sum(100 * (after[p][1] - before[p][1]) / window
                                 for p in routers)
        row.sim_rss_mb = sum(_proc_figures(pid)[0] for pid in sim_pids)
        name = "fleetwarden_router_added_latency_seconds"
        count = (_metric_sum(metrics_after, name + "_count")
                 - _metric_sum(metrics_before, name + "_count"))
        total = (_metric_sum(metrics_after, name + "_sum")
                 - _metric_sum(metrics_before, name + "_sum"))
        row.added_ms = 1000 * total / count if count else None


def _summary_into(row: Steady, journal: Path) -> None:
    from fleetwarden.journal import Journal

    if not journal.exists():
        return
    with Journal(journal) as j:
        summary = j.run_summary()
    if summary is None:
        row.error = row.error or "no run summary in the journal"
        return
    work = summary["work"]
    row.ticks = summary["ticks"]
    row.tick_p50_s, row.tick_p99_s = work["tick_s"]["p50"], work["tick_s"]["p99"]
    row.round_p99_s = work["read_round_s"]["p99"]
    row.reads_per_round_min = work["reads_per_round"]["p50"]
    row.reads_per_s = work["reads_per_s"]
    row.decision_p99_s = work["evidence_to_decision_s"]["p99"]
    row.push_p99_s = work["push_s"]["p99"]


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{1000 * x:.0f}"


def steady_table(rows: list[Steady]) -> str:
    lines = ["| engines | mode | all serving after | ticks | tick p50 / p99 ms | round p99 ms "
             "| reads per round (p50) | reads/s | evidence→decision p99 ms | push p99 ms "
             "| ticks in the window: n, mean / p99 ≤ ms "
             "| fleetwarden RSS MB / CPU % | router RSS MB / CPU % | sim RSS MB "
             "| router added ms (mean) | req/s (failed) | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        serving = "—" if r.serving_s is None else f"{r.serving_s:.1f} s"
        note = f" ({r.error})" if r.error else ""
        lines.append(
            f"| {r.engines}{note} | {r.mode} | {serving} | {r.ticks} "
            f"| {_ms(r.tick_p50_s)} / {_ms(r.tick_p99_s)} | {_ms(r.round_p99_s)} "
            f"| {'—' if r.reads_per_round_min is None else f'{r.reads_per_round_min:.0f}'} "
            f"| {'—' if r.reads_per_s is None else f'{r.reads_per_s:.0f}'} "
            f"| {_ms(r.decision_p99_s)} | {_ms(r.push_p99_s)} "
            f"| {r.window_ticks}, {_ms(r.window_tick_mean_s)} / {_ms(r.window_tick_p99_le_s)} "
            f"| {r.fw_rss_mb:.0f} / {r.fw_cpu_pct:.1f} | {r.router_rss_mb:.0f} / "
            f"{r.router_cpu_pct:.1f} | {f'{r.sim_rss_mb:.0f}' if r.sim_rss_mb else '—'} "
            f"| {'—' if r.added_ms is None else f'{r.added_ms:.2f}'} "
            f"| {r.req_per_s:.1f} ({r.failed}) | {r.load_avg[0]:.1f}–{r.load_avg[1]:.1f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- failover at scale


@dataclasses.dataclass
class FaultTimes:
    eject_s: float | None = None
    condemn_s: float | None = None


def _fault_times(journal: Path, fault_at: float | None) -> FaultTimes:
    from fleetwarden.journal import Journal

    out = FaultTimes()
    if fault_at is None or not journal.exists():
        return out
    with Journal(journal) as j:
        for e in j.transitions(shard=failover.BAD):
            if e.wall < fault_at:
                continue
            if out.eject_s is None and (e.event == "ejected" or e.to_state != e.from_state):
                out.eject_s = e.wall - fault_at  # out of routing: ejected, or condemned at once
            if out.condemn_s is None and e.to_state == "DEAD":
                out.condemn_s = e.wall - fault_at
    return out


#: The longest the fault waits for the bad engine to hold a request.
BUSY_WAIT_S = 60.0


async def _inject_when_busy(url: str, mode: str) -> None:
    """The fault, once the bad engine runs a request: among 256 engines a closed loop of 48
    clients reaches any one engine about once in 256 requests, and a fault on an idle engine
    would measure nothing of a fault under load."""
    deadline = time.monotonic() + BUSY_WAIT_S
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while time.monotonic() < deadline:
            async with http.get(url + "/sim/stats") as resp:
                if (await resp.json())["engine"]["running"] >= 1:
                    break
            await asyncio.sleep(0.05)
    await failover._inject(url, mode)


@dataclasses.dataclass
class Split:
    """Where the time from a fault to its parked requests' answers went, in seconds after the
    fault: a request silent for ``silent_after_s`` accuses the engine, focused reads (one every
    ``confirm_interval_s`` plus the read) find it flat, the routers hedge what it holds, and
    another engine answers the hedge's copy. From the journal's verdict rows, the router's
    log and the clients; beside them, how loaded each process was while it ran."""

    #: When the last-answered parked request reached the bad engine (its own log; below 0:
    #: before the fault).
    parked_arrived_s: float | None = None
    #: The first verdict on the bad engine after the fault that the journal keeps (any but
    #: BUSY and IDLE): the first focused read, done.
    first_read_s: float | None = None
    #: Reads of the bad engine the journal kept from the fault to its condemnation, and the
    #: mean and longest time between two of them (the focused reads' pace).
    reads: int = 0
    read_gap_mean_s: float | None = None
    read_gap_max_s: float | None = None
    #: The router's first hedge (or stream moved) off the bad engine after the fault.
    hedged_s: float | None = None
    #: The last-answered parked request's max_tokens, and their time at the engines' step
    #: rate on an idle engine (what its copy should take).
    copy_tokens: int | None = None
    copy_ideal_s: float | None = None
    #: GET /health on the bad engine's sim process and GET /admin/status on fleetwarden's,
    #: every LAG_PROBE_S while the load ran: p50 and slowest (how late each loop answers).
    sim_lag: tuple[float, float] | None = None
    admin_lag: tuple[float, float] | None = None
    #: CPU while the load ran, in % of one core: every sim process together, the busiest one,
    #: fleetwarden's own process, its router's.
    sim_cpu_pct: float = 0.0
    sim_cpu_max_pct: float = 0.0
    fw_cpu_pct: float = 0.0
    router_cpu_pct: float = 0.0
    #: Engine reads a second while the load ran (the fleet's verdicts counter): the spread
    #: steady reads (the fleet over ``probe_interval_s``) and every focused read.
    reads_per_s: float | None = None


#: How often the lag probes ask (each a GET of a handler that does nothing but answer).
LAG_PROBE_S = 0.25

_HEDGE_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+: "
                         r"(?:hedged \d+ request\(s\)|moved \d+ stream\(s\)) held on (\S+)")


def hedge_times(lines: list[str], url: str) -> list[float]:
    """When the router's log says it hedged (or moved streams) off ``url``: wall times (the
    log's asctime is local time)."""
    out = []
    for line in lines:
        m = _HEDGE_LINE.match(line)
        if m and m.group(2).rstrip(",") == url:
            out.append(dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def verdict_times(verdicts: list[dict[str, Any]], fault_at: float,
                  until: float | None) -> list[float]:
    """The walls of the journal's verdict rows from ``fault_at`` to ``until`` (its
    condemnation; None: to the end), in order."""
    return [v["wall"] for v in verdicts
            if v["wall"] >= fault_at and (until is None or v["wall"] <= until + 1e-3)]


def split_from(split: Split, folder: Path, bad_url: str, fault_at: float | None,
               times: FaultTimes, row: failover.Row, steps_per_s: float,
               arrivals: list[tuple[float, str]]) -> None:
    """Fill ``split`` from a finished run's journal, router log and row."""
    from fleetwarden.journal import Journal

    if fault_at is None:
        return
    journal = folder / "fleetwarden.sqlite"
    if journal.exists():
        with Journal(journal) as j:
            verdicts = j.verdicts(shard=failover.BAD, limit=100_000)
        until = None if times.condemn_s is None else fault_at + times.condemn_s
        walls = verdict_times(verdicts, fault_at, until)
        split.reads = len(walls)
        if walls:
            split.first_read_s = walls[0] - fault_at
        gaps = [b - a for a, b in itertools.pairwise(walls)]
        if gaps:
            split.read_gap_mean_s, split.read_gap_max_s = sum(gaps) / len(gaps), max(gaps)
    lines: list[str] = []
    for log in sorted((folder / "fw-logs").glob("router-*.log")):
        lines += log.read_text(errors="replace").splitlines()
    hedges = [t - fault_at for t in hedge_times(lines, bad_url) if t >= fault_at]
    split.hedged_s = min(hedges, default=None)
    if row.parked_last_tokens is not None:
        split.copy_tokens = row.parked_last_tokens
        split.copy_ideal_s = row.parked_last_tokens / steps_per_s
    came = [at for at, rid in arrivals if rid == row.parked_last_id]
    if came:
        split.parked_arrived_s = came[0] - fault_at


async def _lag(http: aiohttp.ClientSession, url: str, out: list[float],
               stop: asyncio.Event) -> None:
    """Time a GET of ``url`` every LAG_PROBE_S until ``stop`` (failures are not timed)."""
    while not stop.is_set():
        sent = time.monotonic()
        try:
            async with http.get(url) as resp:
                await resp.read()
            out.append(time.monotonic() - sent)
        except (aiohttp.ClientError, TimeoutError):
            pass
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), LAG_PROBE_S)


async def _verdicts_total(http: aiohttp.ClientSession, admin: str) -> float | None:
    try:
        return _metric_sum(await _admin(http, admin, "/metrics"), "fleetwarden_verdicts_total")
    except (aiohttp.ClientError, TimeoutError):
        return None


def _p50_max(xs: list[float]) -> tuple[float, float] | None:
    return (sorted(xs)[len(xs) // 2], max(xs)) if xs else None


def failover_run(n: int, name: str, folder: Path, clients: int = FAILOVER_CLIENTS,
                 sim_processes: int = 1) -> tuple[failover.Row, FaultTimes, Split]:
    scenario = dataclasses.replace(failover.SCENARIOS[name], clients=clients)
    label = f"fleetwarden at {n}" + (f", {sim_processes} sims" if sim_processes > 1 else "")
    row = failover.Row(label, name)
    times = FaultTimes()
    split = Split()
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    launcher = failover.Launcher(folder, quick=False)
    try:
        sims, urls = start_sims(n, folder, scenario.slots, scenario.steps_per_s, sim_processes)
        launcher.procs += sims
        bad = urls[failover.BAD]
        stats = failover.StatsLog([bad])
        engines = failover.Engines(urls, _inject_when_busy, stats)
        router = launcher.router(failover.ROUTERS["fleetwarden"], urls)
        row.version = router.version
        # failover.Launcher put the admin port on the command line: read it back from there
        argv = [str(a) for a in router.proc.args]  # type: ignore[union-attr]
        admin = f"http://127.0.0.1:{argv[argv.index('--admin-port') + 1]}"
        token_file = folder / "fw-admin.token"
        _wait_for_file(token_file, router.proc, router.log)
        fault_at = asyncio.run(_all_serving_then(n, admin, token_file.read_text().strip(),
                                                 scenario, router, engines, row, split,
                                                 [p.pid for p in sims]))
        ejected, notes = router.verdicts(fault_at)
        row.healthy_ejected = len(ejected - {bad})
        row.notes = notes[:3]
        times = _fault_times(folder / "fleetwarden.sqlite", fault_at)
        split_from(split, folder, bad, fault_at, times, row, scenario.steps_per_s,
                   stats.arrivals(bad))
    except Exception as exc:
        row.not_run = f"error: {type(exc).__name__}: {exc}"[:200]
    finally:
        launcher.close()
        row.seconds = time.monotonic() - started
        row.load_avg = (load_before, os.getloadavg()[0])
    return row, times, split


async def _all_serving_then(n: int, admin: str, token: str,
                            scenario: failover.Scenario, router: failover.RunningRouter,
                            engines: failover.Engines, row: failover.Row, split: Split,
                            sim_pids: list[int]) -> float | None:
    """Wait for every shard HEALTHY (the fleet's admin status), then the scenario, with the
    lag probes and the processes' CPU beside it."""
    deadline = time.monotonic() + SERVING_TIMEOUT_S
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=10)) as http:
        while time.monotonic() < deadline:
            try:
                status = await _admin(http, admin, "/admin/status")
                if status["counts"].get("HEALTHY", 0) == n:
                    break
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.25)
        up_pid = router.proc.pid
        routers = _routers(up_pid)
        pids = [*sim_pids, up_pid, *routers]
        before = {p: _proc_figures(p)[1] for p in pids}
        verdicts_before = await _verdicts_total(http, admin)
        clock = time.monotonic()
        stop = asyncio.Event()
        sim_lag: list[float] = []
        admin_lag: list[float] = []
        probes = [asyncio.create_task(_lag(http, engines.urls[failover.BAD] + "/health",
                                           sim_lag, stop)),
                  asyncio.create_task(_lag(http, admin + "/admin/status", admin_lag, stop))]
        try:
            fault_at = await failover._drive(scenario, router, engines, row)
        finally:
            stop.set()
            await asyncio.gather(*probes)
        span = time.monotonic() - clock
        cpu = {p: 100 * (_proc_figures(p)[1] - before[p]) / span for p in pids}
        verdicts_after = await _verdicts_total(http, admin)
        if verdicts_before is not None and verdicts_after is not None:
            split.reads_per_s = (verdicts_after - verdicts_before) / span
    split.sim_lag, split.admin_lag = _p50_max(sim_lag), _p50_max(admin_lag)
    split.sim_cpu_pct = sum(cpu[p] for p in sim_pids)
    split.sim_cpu_max_pct = max((cpu[p] for p in sim_pids), default=0.0)
    split.fw_cpu_pct = cpu[up_pid]
    split.router_cpu_pct = sum(cpu[p] for p in routers)
    return fault_at


@dataclasses.dataclass
class FailoverRun:
    engines: int
    row: failover.Row
    times: FaultTimes
    split: Split
    sim_processes: int = 1


def failover_table(runs: list[FailoverRun]) -> str:
    scenarios = {name: failover.SCENARIOS[name] for name in FAILOVER_SCENARIOS}
    base = failover.table([r.row for r in runs], scenarios).splitlines()
    lines = [base[0] + " out of routing after s | condemned after s |",
             base[1] + "---|---|"]
    for r, line in zip(runs, base[2:], strict=True):
        lines.append(line + f" {failover._fmt_s(r.times.eject_s)} "
                     f"| {failover._fmt_s(r.times.condemn_s)} |")
    return "\n".join(lines)


def _at(x: float | None) -> str:
    return "—" if x is None else f"{x:+.1f}"


def _lag_cell(lag: tuple[float, float] | None) -> str:
    return "—" if lag is None else f"{1000 * lag[0]:.0f} / {1000 * lag[1]:.0f}"


def split_table(runs: list[FailoverRun]) -> str:
    """Where each run's time from the fault to the last parked answer went (Split)."""
    lines = ["| engines | sim processes | scenario | parked request reached the bad engine "
             "| first focused read done | focused reads to condemnation: n, gap mean / max s "
             "| hedged | condemned | parked answered | its copy: tokens, at 20 steps/s, "
             "hedge to answer s | sim /health lag p50 / max ms "
             "| admin lag p50 / max ms | CPU % of a core: sims (busiest) / fleetwarden / "
             "router | engine reads/s | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s, row = r.split, r.row
        gap = ("—" if s.read_gap_mean_s is None
               else f"{s.read_gap_mean_s:.2f} / {s.read_gap_max_s:.2f}")
        took = (None if s.hedged_s is None or row.parked_answered_s is None
                else row.parked_answered_s - s.hedged_s)
        copy = ("—" if s.copy_tokens is None else
                f"{s.copy_tokens}, {s.copy_ideal_s:.2f}, "
                f"{'—' if took is None else f'{took:.1f}'}")
        lines.append(
            f"| {r.engines} | {r.sim_processes} | {row.scenario} | {_at(s.parked_arrived_s)} "
            f"| {_at(s.first_read_s)} | {s.reads}, {gap} | {_at(s.hedged_s)} "
            f"| {_at(r.times.condemn_s)} | {_at(row.parked_answered_s)} | {copy} "
            f"| {_lag_cell(s.sim_lag)} | {_lag_cell(s.admin_lag)} "
            f"| {s.sim_cpu_pct:.0f} ({s.sim_cpu_max_pct:.0f}) / {s.fw_cpu_pct:.0f} / "
            f"{s.router_cpu_pct:.0f} "
            f"| {'—' if s.reads_per_s is None else f'{s.reads_per_s:.0f}'} "
            f"| {failover._load_cell(row)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- main


def _list(value: str, known: tuple[str, ...] | None = None) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if known is not None:
        bad = [v for v in items if v not in known]
        if bad:
            raise SystemExit(f"unknown: {', '.join(bad)}; choose from {', '.join(known)}")
    return items


@contextlib.contextmanager
def _run_folder(prefix: str, keep: Path | None) -> Iterator[Path]:
    """One run's folder: a temporary one, or one kept under ``keep``."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix=prefix) as temporary:
            yield Path(temporary)
        return
    keep.mkdir(parents=True, exist_ok=True)
    kept = Path(tempfile.mkdtemp(prefix=prefix, dir=keep))
    print(f"kept: {kept}", flush=True)
    yield kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="steady-state fleet sizes (empty: none)")
    parser.add_argument("--launched", default="10",
                        help="sizes also run with fleetwarden launching each engine as a "
                        "process of its own (empty: none; each costs ~40 MB and a start)")
    parser.add_argument("--failover", default=",".join(map(str, FAILOVER_SIZES)),
                        help="fleet sizes of the failover scenarios (empty: none)")
    parser.add_argument("--scenarios", default=",".join(FAILOVER_SCENARIOS))
    parser.add_argument("--clients", type=int, default=FAILOVER_CLIENTS,
                        help="clients of the failover scenarios (bench/failover.py runs 12 "
                             "against its 3 engines)")
    parser.add_argument("--sim-processes", type=int, default=1,
                        help="serve the engines from this many sim processes, each its own "
                             "share (one process's loop is at most one core)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--keep", type=Path,
                        help="keep each run's folder (journal, logs) under this one, to trace "
                             "what a figure came from (default: removed after the run)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in _list(args.sizes)]
    launched = [int(s) for s in _list(args.launched)]
    fail_sizes = [int(s) for s in _list(args.failover)]
    names = _list(args.scenarios, FAILOVER_SCENARIOS)
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"bench/scale.py, {when}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
          flush=True)
    steadies: list[Steady] = []
    for n in sizes:
        with _run_folder(f"scale-{n}-", args.keep) as folder:
            row = steady(n, folder, sim_processes=args.sim_processes)
        steadies.append(row)
        print(steady_table([row]).splitlines()[-1], flush=True)
    for n in launched:
        with _run_folder(f"scale-launched-{n}-", args.keep) as folder:
            row = steady(n, folder, launched=True)
        steadies.append(row)
        print(steady_table([row]).splitlines()[-1], flush=True)
    runs: list[FailoverRun] = []
    for n in fail_sizes:
        for name in names:
            with _run_folder(f"scale-fail-{n}-{name}-", args.keep) as folder:
                run, times, split = failover_run(n, name, folder, args.clients,
                                                 args.sim_processes)
            runs.append(FailoverRun(n, run, times, split, args.sim_processes))
            print(f"{n} {name}: sent {run.sent} failed {run.failed} "
                  f"parked answered {failover._parked_cell(run)} "
                  f"out of routing {failover._fmt_s(times.eject_s)} s "
                  f"condemned {failover._fmt_s(times.condemn_s)} s "
                  f"healthy ejected {run.healthy_ejected} {run.not_run}", flush=True)
            print(split_table(runs[-1:]).splitlines()[-1], flush=True)
    print()
    if steadies:
        print(steady_table(steadies))
        print()
    if runs:
        print(failover_table(runs))
        print()
        print(split_table(runs))
    if args.json:
        args.json.write_text(json.dumps({
            "when": when, "steady": [dataclasses.asdict(r) for r in steadies],
            "failover": [{"engines": r.engines, "sim_processes": r.sim_processes,
                          **dataclasses.asdict(r.row), **dataclasses.asdict(r.times),
                          "split": dataclasses.asdict(r.split)} for r in runs]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
