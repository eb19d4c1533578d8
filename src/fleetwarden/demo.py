"""`fleetwarden demo`: the whole story on three engines, live, in about two minutes.

Owns: the demo's acts on a real fleet, what it measures and how it tells the story.
Must not: reach into the fleet's parts: it acts and reads through the fleet's surface and
``snapshot()``.

A fleet of three simulated vLLM engines (or two real ones, with ``--engine-cmd``; or, with
``--mixed``, three simulated engines that speak vLLM's, llama.cpp's and SGLang's wire) under steady
load from the official ``openai`` client, and a script of faults: a wedge under load, a
crash, a trickle of failed generations, an idle wedge, and a saturated-but-healthy stretch.
A live view shows shards, states, in-flight requests, requests answered and failed, and the
transitions as they happen. At the end: a summary per fault (time to quarantine, requests
rescued, client errors, restarts), ``summary.json`` and ``timeline.png`` in the report folder.
Exit status 1 if any request was lost, or if an act could not be played (an engine that did
not come back in time, a fault it could not take).

A mixed fleet (``--mixed``) is the fleet's own engine and two ``[[fleet.groups]]``, each judged
by its own profile; the acts fall on engines of different kinds (:data:`MIXED_ACTS`), and the
live view and the summary name each shard's kind and the kind each act hit.

On real engines the trickle needs a simulator and is skipped; each act waits for the whole
fleet to be serving first (a real engine takes tens of seconds to come back); the load pauses
from 5 s after a quarantine until the replacement serves (on a small machine a starting
engine beside loaded ones is starved of CPU); and the saturated stretch is saturated only if
the engines' own slot limit is below the 36 clients (vLLM's ``--max-num-seqs``).

Timings are compressed so the story fits in minutes (a 1 s tick instead of 5 s, ``stall_s``
4 s instead of 15 s, a canary every 5 s instead of 30 s): the logic is the one that runs at the
defaults, only faster. `make demo` runs it; `make demo-mixed` the mixed fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from fleetwarden.admin import views
from fleetwarden.config import parse_config
from fleetwarden.console import fleet_view
from fleetwarden.fleet import Fleet
from fleetwarden.ledger import ShardState
from fleetwarden.snapshot import Snapshot
from fleetwarden.testing.load import Load

__all__ = ["FaultResult", "run_demo"]

SIM = "{python} -m fleetwarden sim --host {host} --port {port} --steps-per-s 40 --slots 8"
#: The mixed fleet's groups after its own (vLLM) engine: shards 1 and 2.
MIXED_GROUPS = ("llamacpp", "sglang")
#: The kind of engine each act falls on in a mixed fleet: a different kind per act where the
#: act allows. Not the idle wedge on SGLang: its gauges are written only every 30 s when idle,
#: so a wedged one still reads "running" after the load stops, and the lost core shows only
#: once they are rewritten: the story would wait half a minute for it (docs/engines.md).
MIXED_ACTS = {"wedge under load": "llamacpp", "crash": "sglang", "trickle": "vllm",
              "idle wedge": "vllm"}
#: The faults a real engine can show (signals to its engine core); the others need a sim.
REAL_ENGINE_PHASES = ("wedge under load", "crash", "idle wedge", "saturated but healthy")


@dataclass
class FaultResult:
    """What one act of the story did, for the summary."""

    name: str
    shard: int | None
    injected_at: float  # seconds since the demo started
    #: The profile the faulted engine was judged by (``fleetwarden.engines``), when known.
    engine: str | None = None
    what_happened: str = ""
    quarantined_after_s: float | None = None
    back_after_s: float | None = None
    rescued: int = 0
    #: Requests answered by a hedge: sent to another engine while the faulted one held them.
    hedged: int = 0
    retried: int = 0
    client_errors: int = 0
    restarts: int = 0
    canaries: int | None = None
    requests: int = 0
    skipped: str = ""
    #: Why the act could not be played as written (a fault refused, an engine not back).
    failed: str = ""


@dataclass
class Story:
    fleet: Fleet
    console: Console
    quick: bool
    real: bool
    #: Seconds to wait for a shard to serve again: the startup timeout and then some.
    back_limit_s: float = 120.0
    #: The shard each act falls on, where it is not the default (see :meth:`target`).
    targets: dict[str, int] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)
    load: Load | None = None
    results: list[FaultResult] = field(default_factory=list)
    _load_shape: tuple[int, int] = (9, 24)
    phase: str = "starting"
    states: list[tuple[float, list[str]]] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)
    finished_loads: list[Load] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def until(self, cond: Callable[[], bool], limit_s: float, what: str) -> float | None:
        start = time.monotonic()
        while not cond():
            if time.monotonic() - start > limit_s:
                self.console.print(f"[yellow]not within {limit_s:g} s: {what}[/yellow]")
                return None
            await asyncio.sleep(0.1)
        return time.monotonic() - start

    def state(self, i: int) -> ShardState:
        return self.fleet.snapshot().shards[i].state

    @property
    def engines(self) -> int:
        return self.fleet.size

    def target(self, act: str, default: int) -> int:
        return self.targets.get(act, default % self.engines)

    def kind(self, i: int, snap: Snapshot | None = None) -> str:
        """The profile shard ``i`` is judged by; its configured kind until it is judged."""
        report = (snap or self.fleet.snapshot()).reports.get(i)
        if report is not None and report.engine is not None:
            return report.engine.name
        return self.fleet.config.fleet.engine_of(i)

    async def whole(self, name: str) -> bool:
        """Wait until every shard serves, so an act starts on a whole fleet (a real engine
        replaced in the act before takes tens of seconds to come back)."""
        return await self.until(lambda: all(self.state(i) is ShardState.HEALTHY
                                            for i in range(self.engines)),
                                self.back_limit_s, f"{name}: the whole fleet serving") is not None

    # ------------------------------------------------------------------ load

    def start_load(self, concurrency: int = 9, max_tokens: int = 24) -> None:
        self._load_shape = (concurrency, max_tokens)
        self.load = Load(self.fleet.router_url, concurrency=concurrency, max_tokens=max_tokens,
                         timeout_s=120)
        self.load.start()

    async def stop_load(self) -> None:
        if self.load is not None:
            await self.load.stop()
            self.finished_loads.append(self.load)
            self.load = None

    def all_results(self) -> list[Any]:
        loads = [*self.finished_loads, *([self.load] if self.load else [])]
        return [r for load in loads for r in load.results]

    def errors_between(self, start: float, end: float) -> int:
        lo, hi = self.t0 + start, self.t0 + end
        return sum(1 for r in self.all_results() if not r.ok and lo <= r.started <= hi)

    def requests_between(self, start: float, end: float) -> int:
        lo, hi = self.t0 + start, self.t0 + end
        return sum(1 for r in self.all_results() if lo <= r.started <= hi)

    # ------------------------------------------------------------------ one fault

    async def fault(self, name: str, shard: int, fault: str,
                    before: Callable[[], Awaitable[None]] | None = None) -> FaultResult:
        """Inject ``fault`` into ``shard``; wait for the quarantine and the way back."""
        fleet = self.fleet
        snap = fleet.snapshot()
        rescues, retries = snap.router.rescues, sum(snap.router.retries.values())
        hedged = snap.router.hedges_won
        restarts = snap.restarts_completed
        kind = self.kind(shard)
        self.phase = f"{name}: {fault} on shard {shard} ({kind})"
        result = FaultResult(name, shard, round(self.now(), 1), engine=kind)
        if not await self.whole(name):
            result.failed = f"the fleet was not whole within {self.back_limit_s:g} s"
            self.results.append(result)
            return result
        result.injected_at = round(self.now(), 1)
        self.marks.append((self.now(), f"{name} (shard {shard}, {kind})"))
        try:
            await fleet.inject_fault(shard, fault, {})
        except (LookupError, ValueError, aiohttp.ClientError) as exc:
            result.failed = f"{fault} could not be injected: {exc}"
            self.results.append(result)
            return result
        if before is not None:
            await before()
        start = time.monotonic()
        seen = await self.until(lambda: self.state(shard) not in (
            ShardState.HEALTHY, ShardState.SUSPECT), 90, f"{name}: quarantine")
        if seen is not None:
            result.quarantined_after_s = round(time.monotonic() - start, 1)
            deaths = [t for t in fleet.admin.events.recent
                      if t["shard"] == shard and t["to"] == "DEAD"]
            result.what_happened = deaths[-1]["cause"][:160] if deaths else ""
        paused = self.real and self.load is not None
        if paused:
            # A real engine starting beside loaded ones on a small machine is starved of CPU,
            # so the load pauses while it starts (docs/design.md section 13): the rescued and
            # retried requests finish first, then the load waits for the replacement.
            await asyncio.sleep(_RESCUES_FINISH_S)
            self.phase = f"{name}: load paused while shard {shard}'s replacement starts"
            await self.stop_load()
        back = await self.until(lambda: self.state(shard) is ShardState.HEALTHY,
                                self.back_limit_s, f"{name}: back")
        if paused:
            self.start_load(*self._load_shape)
        if back is not None:
            result.back_after_s = round(time.monotonic() - start, 1)
        else:
            result.failed = f"shard {shard} not serving again within {self.back_limit_s:g} s"
        await asyncio.sleep(1.0)  # the requests of the act finish before it is counted
        snap = fleet.snapshot()
        result.rescued = snap.router.rescues - rescues
        result.hedged = snap.router.hedges_won - hedged
        result.retried = sum(snap.router.retries.values()) - retries
        result.restarts = snap.restarts_completed - restarts
        result.client_errors = self.errors_between(result.injected_at - 0.5, self.now())
        result.requests = self.requests_between(result.injected_at, self.now())
        self.results.append(result)
        return result

    def skip(self, name: str, why: str) -> None:
        self.results.append(FaultResult(name, None, round(self.now(), 1), skipped=why))

    # ------------------------------------------------------------------ the acts

    async def play(self) -> None:
        q = self.quick
        self.phase = "steady load"
        self.start_load()
        await asyncio.sleep(3 if q else 6)

        await self.fault("wedge under load", self.target("wedge under load", 0), "wedge")
        await self.fault("crash", self.target("crash", 1), "crash")
        if self.real:
            self.skip("trickle", "a real engine cannot be made to fail every generation "
                                 "while answering every probe")
        else:
            await self.fault("trickle", self.target("trickle", 2), "error5xx")

        # idle wedge: nothing runs anywhere; the wedged engine's metrics say nothing at all
        self.phase = "idle: load stopped"
        await self.stop_load()

        async def then_route_requests() -> None:
            await asyncio.sleep(1.5)
            self.phase = "idle wedge: the first routed requests find it (lost core)"
            self.start_load(concurrency=3, max_tokens=8)

        await self.fault("idle wedge", self.target("idle wedge", 0), "wedge",
                         before=then_route_requests)
        await self.stop_load()

        # saturated but healthy: more clients than slots, long generations, for many ticks
        self.phase = "saturated but healthy: 36 clients, long generations"
        fleet = self.fleet
        result = FaultResult("saturated but healthy", None, round(self.now(), 1))
        if not await self.whole(result.name):
            result.failed = f"the fleet was not whole within {self.back_limit_s:g} s"
            self.results.append(result)
            return
        urls, _ = fleet.serving()
        result.injected_at = round(self.now(), 1)
        self.marks.append((self.now(), "saturated but healthy"))
        self.start_load(concurrency=36, max_tokens=120)
        def reports() -> dict[int, Any]:
            return fleet.snapshot().reports

        saturated = await self.until(lambda: len(reports()) >= len(urls) and all(
            r.sample is not None and r.sample.waiting > 0 for r in reports().values()),
            30, "every engine saturated")
        # measured from here: every slot busy, requests waiting, on every engine
        # Canaries: a simulated engine logs each one it receives; a real one does not say, so
        # there the count is the watchdog's own (each tick's reports, kept so none is missed).
        canaries_before = 0 if self.real else await _canaries(urls)
        sent: dict[int, Any] = {}
        before = fleet.snapshot()
        restarts = before.restarts_completed
        seq = fleet.admin.events.seq
        ticks = before.controller["tick"]
        verdicts: set[str] = set()
        deadline = time.monotonic() + (8 if q else 20)
        while time.monotonic() < deadline:
            now = reports()
            verdicts |= {r.verdict.name for r in now.values()}
            sent.update({id(r): r for r in now.values() if r.canary is not None})
            await asyncio.sleep(0.25)
        result.canaries = (len(sent) if self.real
                           else (await _canaries(urls)) - canaries_before)
        await self.stop_load()
        after = fleet.snapshot()
        result.restarts = after.restarts_completed - restarts
        changed = [e for e in fleet.admin.events.recent if e["seq"] > seq]
        how = "saturated" if saturated is not None else "loaded (not every engine saturated)"
        named = "".join(f"; shard {e['shard']} {e['from']}->{e['to']} ({e['cause']})"
                        for e in changed)
        result.what_happened = (f"{after.controller['tick'] - ticks} ticks {how}: "
                                f"{len(changed)} state changes, verdicts {sorted(verdicts)}"
                                f"{named}")
        result.client_errors = self.errors_between(result.injected_at, self.now())
        result.requests = self.requests_between(result.injected_at, self.now())
        self.results.append(result)
        self.phase = "done"

    # ------------------------------------------------------------------ the view

    def view(self) -> Group:
        fleet = self.fleet
        results = self.all_results()
        ok = sum(1 for r in results if r.ok)
        head = Text.assemble(("fleetwarden demo ", "bold"), f"{self.now():5.0f} s  ",
                             (self.phase, "bold cyan"),
                             f"   requests {len(results)}: ", (f"{ok} ok", "green"), ", ",
                             (f"{len(results) - ok} failed",
                              "red" if len(results) > ok else "dim"))
        snap = fleet.snapshot()
        # each shard's kind on a line of its own: the table's kind column is among the first
        # to give way in a narrow terminal
        kinds = Text.assemble("engines: ", "  ".join(
            f"{i} {self.kind(i, snap)}" for i in range(len(snap.shards))), style="dim")
        return Group(head, kinds, fleet_view(views.status_view(snap), views.shards_view(snap),
                                             fleet.admin.events.recent))

    def sample(self) -> None:
        self.states.append((self.now(), [r.state.value for r in self.fleet.snapshot().shards]))


#: Seconds the load runs on after a real engine's quarantine before it pauses (see fault()).
_RESCUES_FINISH_S = 5.0
#: Lost requests printed under the summary (all of them are in summary.json).
_FAILURES_SHOWN = 10


async def _canaries(urls: list[str]) -> int:
    """Canaries the simulated engines received so far (their /sim/stats logs)."""
    total = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for url in urls:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url + "/sim/stats") as resp:
                    if resp.status != 200:
                        continue  # not a simulated engine
                    log = (await resp.json())["log"]
                    total += sum(1 for e in log if (e.get("request_id") or "").startswith(
                        "fleetwarden-canary"))
    return total


def demo_config(work: Path, engine_cmd: str | None, engines: int, mixed: bool = False) -> Any:
    # mixed: the fleet's own engine speaks vLLM's wire, each group another engine's
    kinds: dict[str, Any] = {"engines": 1, "engine": "vllm", "groups": [
        {"engines": 1, "engine": kind, "engine_cmd": f"{SIM} --engine {kind}"}
        for kind in MIXED_GROUPS]} if mixed else {"engines": engines}
    return parse_config({
        "fleet": {**kinds, "engine_cmd": engine_cmd or SIM,
                  "log_dir": str(work / "logs"),
                  "startup_timeout_s": 120 if engine_cmd is None else 300,
                  # its journal is temporary: an engine it left could never be adopted, so
                  # every engine ends with the demo, however the demo ends (even kill -9)
                  "engines_outlive_fleetwarden": False},
        # The router in the demo's own process: the story reads its counters at each act.
        "router": {"port": 0, "workers": 0},
        "health": {"probe_interval_s": 1.0, "stall_s": 4.0, "canary_interval_s": 5.0,
                   "canary_timeout_s": 2.0},
        "supervisor": {"backoff_initial_s": 1.0, "backoff_max_s": 5.0,
                       "max_concurrent_restarts": 2},
        "journal": {"path": str(work / "fleet.sqlite")},
        "admin": {"port": 0, "token_file": str(work / "admin.token")},
    }, "the demo")


async def run_demo(*, quick: bool = False, engine_cmd: str | None = None,
                   engines: int | None = None, mixed: bool = False,
                   report_dir: Path = Path("demo-report"),
                   console: Console | None = None, live: bool = True) -> int:
    """Play the story; 0 if every act was played and no request was lost, else 1.
    ``engines``: 3 simulated, or 2 real ones (what a 2-core machine holds), unless given.
    ``mixed``: three simulated engines of three kinds (vLLM, llama.cpp, SGLang)."""
    console = console or Console(highlight=False)
    if mixed and (engine_cmd is not None or engines is not None):
        raise ValueError("a mixed demo is three simulated engines, one of each kind: "
                         "it takes no engine command and no engine count")
    if engines is None:
        engines = 1 + len(MIXED_GROUPS) if mixed else 3 if engine_cmd is None else 2
    if engines < 2:
        raise ValueError(f"the demo needs at least 2 engines (got {engines}): a fault's "
                         "requests are rescued on another one")
    report_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before anything runs
    with tempfile.TemporaryDirectory(prefix="fleetwarden-demo-") as tmp:
        config = demo_config(Path(tmp), engine_cmd, engines, mixed)
        fleet = Fleet(config)
        what = (" (real)" if engine_cmd else
                f" (simulated: vLLM, {', '.join(MIXED_GROUPS)})" if mixed else " (simulated vLLM)")
        console.print(f"[bold]fleetwarden demo[/bold]: {engines} engines{what}, the router, the "
                      "watchdog, the ledger; a wedge under load, a crash, a trickle of failures, "
                      "an idle wedge, and a saturated-but-healthy stretch.")
        console.print("[dim]timings compressed: tick 1 s, stall_s 4 s, canary every 5 s "
                      "(defaults 5 s, 15 s, 30 s)[/dim]")
        async with fleet:
            targets = {act: next(i for i in range(engines)
                                 if config.fleet.engine_of(i) == kind)
                       for act, kind in MIXED_ACTS.items()} if mixed else {}
            story = Story(fleet, console, quick, real=engine_cmd is not None,
                          back_limit_s=config.fleet.startup_timeout_s + 30, targets=targets)
            controller = asyncio.create_task(fleet.run(), name="controller")
            play = asyncio.create_task(story.play(), name="story")
            try:
                if live:
                    with Live(story.view(), console=console, refresh_per_second=4) as view:
                        while not play.done():
                            story.sample()
                            view.update(story.view())
                            await asyncio.sleep(0.25)
                else:
                    while not play.done():
                        story.sample()
                        await asyncio.sleep(0.25)
                await play
            finally:
                play.cancel()
                with contextlib.suppress(BaseException):
                    await play
                await story.stop_load()
                fleet.request_stop()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(controller, 30)
            story.sample()
            summary = _summary(story)
    _print_summary(console, summary)
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    _timeline(story, report_dir / "timeline.png")
    console.print(f"\nreport: {report_dir / 'summary.json'}, {report_dir / 'timeline.png'}")
    lost = summary["totals"]["client_errors"]
    console.print("[green]no request was lost[/green]" if lost == 0
                  else f"[red]{lost} requests were lost[/red]")
    for failure in summary["failures"][:_FAILURES_SHOWN]:
        console.print(f"  {failure['request_id']} at {failure['started_s']} s: "
                      f"{failure['status']} {failure['error']}", markup=False)
    failed = [f["name"] for f in summary["faults"] if f["failed"]]
    if failed:
        console.print(f"[red]not played as written: {', '.join(failed)}[/red]")
    return 0 if lost == 0 and not failed else 1


def _summary(story: Story) -> dict[str, Any]:
    results = story.all_results()
    snap = story.fleet.snapshot()
    lat = sorted(r.latency_s for r in results if r.ok)
    return {
        # what the fleet's shard view says each engine is judged by, at the end
        "engines": [{"shard": s["index"], "engine": (s["watchdog"] or {}).get("engine"),
                     "configured": story.fleet.config.fleet.engine_of(s["index"])}
                    for s in views.shards_view(snap)],
        "faults": [asdict(r) for r in story.results],
        "totals": {
            "requests": len(results), "ok": sum(1 for r in results if r.ok),
            "client_errors": sum(1 for r in results if not r.ok),
            "rescued": snap.router.rescues,
            "hedged": snap.router.hedges_won,
            "retried": dict(snap.router.retries),
            "restarts": snap.restarts_completed,
            "p50_s": lat[len(lat) // 2] if lat else None,
            "p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
            "duration_s": round(story.now(), 1),
        },
        # what each lost request met, as its client saw it: the first place to look
        "failures": [{"request_id": r.request_id, "started_s": round(r.started - story.t0, 2),
                      "status": r.status, "error": r.error or r.incomplete}
                     for r in results if not r.ok],
        "transitions": [{k: t[k] for k in ("wall", "shard", "from", "to", "cause")}
                        for t in story.fleet.admin.events.recent],
    }


def _print_summary(console: Console, summary: dict[str, Any]) -> None:
    console.print("\n[bold]what happened[/bold]")
    console.print("engines: " + ", ".join(f"shard {e['shard']} {e['engine'] or e['configured']}"
                                          for e in summary["engines"]))
    for f in summary["faults"]:
        where = ("" if f["shard"] is None else f" (shard {f['shard']}, {f['engine']})"
                 if f["engine"] else f" (shard {f['shard']})")
        if f["skipped"]:
            console.print(f"[bold]{f['name']}[/bold]: skipped: {f['skipped']}")
            continue
        if f["failed"]:
            console.print(f"[bold]{f['name']}{where}[/bold]: [red]{f['failed']}[/red]")
        line = Text.assemble((f"{f['name']}{where}: ", "bold"))
        if f["quarantined_after_s"] is not None:
            line.append(f"quarantined after {f['quarantined_after_s']:.1f} s, ")
        if f["back_after_s"] is not None:
            line.append(f"serving again after {f['back_after_s']:.1f} s, ")
        if f["canaries"] is not None:
            line.append(f"{f['canaries']} canaries sent, ")
        line.append(f"{f['rescued']} rescued, {f['hedged']} answered by hedges, "
                    f"{f['retried']} retried, {f['restarts']} restarts, ")
        line.append(f"{f['client_errors']} client errors",
                    style="red" if f["client_errors"] else "green")
        line.append(f" of {f['requests']} requests")
        console.print(line)
        if f["what_happened"]:
            console.print(f"    [dim]{f['what_happened']}[/dim]")
    t = summary["totals"]
    console.print(f"totals: {t['requests']} requests, {t['ok']} ok, {t['client_errors']} "
                  f"client errors; {t['rescued']} rescued, {t['hedged']} answered by hedges, "
                  f"retries {t['retried']}, "
                  f"{t['restarts']} restarts; latency p50 {t['p50_s'] or 0:.2f} s, "
                  f"p99 {t['p99_s'] or 0:.2f} s; {t['duration_s']:.0f} s in all")


def _timeline(story: Story, path: Path) -> None:
    from fleetwarden import timeline

    timeline.draw([(t, list(s)) for t, s in story.states], story.now(), story.marks,
                  story.all_results(), story.t0, path)
