"""A fleet at scale: 10 to 1,000 simulated engines behind `fleetwarden up --backend`, and the
failover scenarios at 64 and 256 engines.

The engines are one `fleetwarden sim --engines N` process (one event loop, each engine its
own port, state and faults: ``fleetwarden.sim.many``); fleetwarden attaches to them with one
``--backend`` each, at its defaults (tick 5 s), its router in a process of its own as
`fleetwarden up` runs it. At 10 engines by default (``--launched``), fleetwarden also launches
each engine as a process of its own: a thousand processes do not fit on 2 cores.

Steady state, per size: time from `fleetwarden up` to every shard HEALTHY; then a window of
load (closed loop, short generations): the tick's p50/p99, reads per round and per second,
evidence to decision (from the journal's run summary), fleetwarden's and its router's RSS and
CPU over the window (from /proc), the router's added latency (its own histogram) and the
requests per second the clients got.

Failover, at 64 and 256 engines: bench/failover.py's wedge, crash and trickle, driven and
scored by its own code (its Row, table and columns), so the rows compare with its 3-engine
figures; and the time from the fault to the bad engine's ejection and condemnation (the
journal). The load is 48 clients (12 at 3 engines), and the fault waits (up to 60 s after
the warm-up) until the bad engine runs a request, so that it comes under load.

    python bench/scale.py                         # 10, 100, 300, 1000 attached, 10 launched;
                                                  # failover at 64, 256
    python bench/scale.py --sizes 10,100 --failover 64 --scenarios crash
    python bench/scale.py --json scale.json       # also every figure as JSON

Run it on a quiet machine: the load average is printed beside every row.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
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


def start_sims(n: int, folder: Path, slots: int = 4, steps_per_s: float = 20.0
               ) -> tuple[subprocess.Popen[str], list[str]]:
    """One `fleetwarden sim --engines n` process and its engines' URLs."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetwarden", "sim", "--port", "0", "--engines", str(n),
         "--slots", str(slots), "--steps-per-s", f"{steps_per_s:g}"],
        stdout=subprocess.PIPE, stderr=(folder / "sim.err").open("w"), text=True,
        stdin=subprocess.DEVNULL, start_new_session=True)
    assert proc.stdout is not None
    urls: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            stop_group(proc, grace_s=2)
            raise RuntimeError(f"sim ended: {(folder / 'sim.err').read_text()[-500:]}")
        if line.startswith("ready "):
            urls.append(line.split()[1])
        elif line.strip() == f"all ready {n}":
            return proc, urls
    stop_group(proc, grace_s=2)
    raise RuntimeError(f"sim did not start {n} engines in 120 s")


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


def steady(n: int, folder: Path, launched: bool = False) -> Steady:
    """One size: its engines, `fleetwarden up` attached to them (or launching them), the
    window, the figures."""
    row = Steady(n, "launched" if launched else "attach")
    sim, urls = (None, []) if launched else start_sims(n, folder)
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
                             started, up.pid, sim.pid if sim is not None else None))
    except Exception as exc:  # one broken size is a row that says so
        row.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        stop_group(up, grace_s=30.0)  # a clean stop writes the run summary
        if sim is not None:
            stop_group(sim, grace_s=5.0)
    _summary_into(row, journal)
    return row


async def _measure(row: Steady, admin: str, port: int, token: str, started: float,
                   up_pid: int, sim_pid: int | None) -> None:
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
        row.sim_rss_mb = _proc_figures(sim_pid)[0] if sim_pid is not None else 0.0
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


def failover_run(n: int, name: str, folder: Path) -> tuple[failover.Row, FaultTimes]:
    scenario = dataclasses.replace(failover.SCENARIOS[name], clients=FAILOVER_CLIENTS)
    row = failover.Row(f"fleetwarden at {n}", name)
    times = FaultTimes()
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    launcher = failover.Launcher(folder, quick=False)
    try:
        sim, urls = start_sims(n, folder, scenario.slots, scenario.steps_per_s)
        launcher.procs.append(sim)
        bad = urls[failover.BAD]
        engines = failover.Engines(urls, _inject_when_busy, failover.StatsLog([bad]))
        router = launcher.router(failover.ROUTERS["fleetwarden"], urls)
        row.version = router.version
        # failover.Launcher put the admin port on the command line: read it back from there
        argv = [str(a) for a in router.proc.args]  # type: ignore[union-attr]
        admin = f"http://127.0.0.1:{argv[argv.index('--admin-port') + 1]}"
        token_file = folder / "fw-admin.token"
        _wait_for_file(token_file, router.proc, router.log)
        fault_at = asyncio.run(_all_serving_then(n, admin, token_file.read_text().strip(),
                                                 scenario, router,
                                                 engines, row))
        ejected, notes = router.verdicts(fault_at)
        row.healthy_ejected = len(ejected - {bad})
        row.notes = notes[:3]
        times = _fault_times(folder / "fleetwarden.sqlite", fault_at)
    except Exception as exc:
        row.not_run = f"error: {type(exc).__name__}: {exc}"[:200]
    finally:
        launcher.close()
        row.seconds = time.monotonic() - started
        row.load_avg = (load_before, os.getloadavg()[0])
    return row, times


async def _all_serving_then(n: int, admin: str, token: str,
                            scenario: failover.Scenario, router: failover.RunningRouter,
                            engines: failover.Engines, row: failover.Row) -> float | None:
    """Wait for every shard HEALTHY (the fleet's admin status), then the scenario."""
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
    return await failover._drive(scenario, router, engines, row)


def failover_table(runs: list[tuple[int, failover.Row, FaultTimes]]) -> str:
    scenarios = {name: failover.SCENARIOS[name] for name in FAILOVER_SCENARIOS}
    base = failover.table([r for _, r, _ in runs], scenarios).splitlines()
    lines = [base[0] + " out of routing after s | condemned after s |",
             base[1] + "---|---|"]
    for (_, _, t), line in zip(runs, base[2:], strict=True):
        lines.append(line + f" {failover._fmt_s(t.eject_s)} | {failover._fmt_s(t.condemn_s)} |")
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
            row = steady(n, folder)
        steadies.append(row)
        print(steady_table([row]).splitlines()[-1], flush=True)
    for n in launched:
        with _run_folder(f"scale-launched-{n}-", args.keep) as folder:
            row = steady(n, folder, launched=True)
        steadies.append(row)
        print(steady_table([row]).splitlines()[-1], flush=True)
    runs: list[tuple[int, failover.Row, FaultTimes]] = []
    for n in fail_sizes:
        for name in names:
            with _run_folder(f"scale-fail-{n}-{name}-", args.keep) as folder:
                run, times = failover_run(n, name, folder)
            runs.append((n, run, times))
            print(f"{n} {name}: sent {run.sent} failed {run.failed} "
                  f"parked answered {failover._parked_cell(run)} "
                  f"out of routing {failover._fmt_s(times.eject_s)} s "
                  f"condemned {failover._fmt_s(times.condemn_s)} s {run.not_run}", flush=True)
    print()
    if steadies:
        print(steady_table(steadies))
        print()
    if runs:
        print(failover_table(runs))
    if args.json:
        args.json.write_text(json.dumps({
            "when": when, "steady": [dataclasses.asdict(r) for r in steadies],
            "failover": [{"engines": n, **dataclasses.asdict(r), **dataclasses.asdict(t)}
                         for n, r, t in runs]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
