"""A fault soak: a fleet under steady load, random faults on random shards, and one SIGKILL and
restart of fleetwarden itself; then the books are checked.

    python bench/soak.py --minutes 10 [--engines 4] [--seed 1] [--json soak.json]

What it runs: `fleetwarden up` (a subprocess, so it can be killed) with 4 simulated engines,
a closed-loop load of ``--concurrency`` clients (the official openai client, its retries off),
and a fault every 6-14 s on a random serving shard: wedge, crash, slow, error5xx, restart,
garbage_metrics (one at a time: the next waits until every shard serves again, or 60 s).
Halfway through, fleetwarden gets SIGKILL and is started again with the same config; its
engines and its router processes (``--router-workers``, default 1) live on, serve on, and are
adopted. ``--router-workers 0`` puts the router back inside fleetwarden (as it ran before
routers had processes of their own):
then every request in flight at the SIGKILL, and every one sent until the restart listens,
fails; those are counted apart.

What it prints: requests sent / answered 200 / deliberate 409 / failed while fleetwarden itself
was down / other failures (lost); condemnations by cause; restarts; ledger invariant violations,
checked on every transition in the journal; engine processes left after the final stop.
Target: no request lost while any shard serves (with router processes: none failed while
fleetwarden was down either), zero violations, zero leftovers (engines and routers).

Timings are compressed to fit many faults in minutes (a 1 s tick, stall_s 4, a canary every
5 s), and the restart budget is set high (1000): the soak measures recovery, and a budget of 5
would retire shards and measure the budget instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _peers import free_port
from fleetwarden.journal import Journal
from fleetwarden.launchers.local import kill_launched, live_launch_ids
from fleetwarden.ledger import TRANSITIONS, Event, ShardState
from fleetwarden.testing.load import Load
from fleetwarden.testing.up import UpProcess

FAULTS = ("wedge", "crash", "slow", "error5xx", "restart", "garbage_metrics")
#: How long a fault that clears itself lasts (wedge and crash last until the engine is replaced).
DURATION_S = {"slow": 10.0, "error5xx": 6.0, "garbage_metrics": 10.0}


def config_toml(engines: int, router_workers: int) -> str:
    return f"""
[fleet]
engines = {engines}
engine_cmd = "{{python}} -m fleetwarden sim --host {{host}} --port {{port}} --steps-per-s 40"
startup_timeout_s = 60

[router]
port = {free_port()}
workers = {router_workers}

[admin]
port = {free_port()}

[health]
probe_interval_s = 1.0
stall_s = 4.0
canary_interval_s = 5.0
canary_timeout_s = 2.0

[supervisor]
max_restart_attempts = 1000
backoff_initial_s = 1.0
backoff_max_s = 5.0
"""


# ---------------------------------------------------------------------- the books

def check_invariants(journal: Journal) -> list[str]:
    """Every transition the journal holds, against docs/design.md section 2. Returns violations."""
    violations = []
    last: dict[int, dict[str, Any]] = {}
    for e in journal.transitions():
        rec, src, dst = e.record, ShardState(e.from_state), ShardState(e.to_state)
        where = f"seq {e.seq} shard {e.shard} {src}->{dst} ({e.event}: {e.cause})"
        event = Event(e.event)
        if TRANSITIONS.get(src, {}).get(event) is not dst:
            violations.append(f"{where}: not a move in the table")
        if src is ShardState.DEAD and dst is ShardState.HEALTHY:
            violations.append(f"{where}: DEAD -> HEALTHY")
        if src in (ShardState.DEAD, ShardState.RESTARTING) and dst is ShardState.SUSPECT:
            violations.append(f"{where}: absent -> SUSPECT")
        if src is ShardState.STALE and dst is not ShardState.STALE and event not in (
                Event.REFIT, Event.REFIT_STILL_SUSPECT, Event.CONDEMNED,
                Event.SILENT_PARTICIPANT, Event.RETIRED_BY_OPERATOR):
            violations.append(f"{where}: STALE left by {event}")
        if src is ShardState.RETIRED:
            violations.append(f"{where}: RETIRED changed")
        if event is Event.LOADED and (
                rec["consecutive_probe_failures"] or rec["consecutive_probe_successes"]
                or rec["consecutive_reported_failures"] or rec["state_before_partial"]):
            violations.append(f"{where}: a new process with history")
        before = last.get(e.shard)
        if before is not None:
            if before["state"] != e.from_state:
                violations.append(f"{where}: follows {before['state']}, not {e.from_state}")
            if rec["restart_attempts"] < before["restart_attempts"]:
                violations.append(f"{where}: restart_attempts decreased")
        last[e.shard] = rec
    return violations


def cause_of(text: str) -> str:
    for key, name in (("exited", "process exited"), ("STUCK", "stuck (no progress)"),
                      ("LOST_CORE", "lost core"), ("failed request windows", "failed requests"),
                      ("failed probes", "failed probes"), ("unreachable", "unreachable"),
                      ("silent participant", "silent participant"), ("first start", "start")):
        if key in text:
            return name
    return text[:40]


def leftovers(journal: Journal) -> set[str]:
    return live_launch_ids(journal.launch_ids() | journal.router_launch_ids())


# ---------------------------------------------------------------------- the run

async def soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    config = work / "fleet.toml"
    config.write_text(config_toml(args.engines, args.router_workers))
    up = await asyncio.to_thread(UpProcess, work, "--config", str(config))
    router = up.router
    started = time.monotonic()
    end = started + args.minutes * 60
    kill_at = started + args.minutes * 30
    down_window: tuple[float, float] | None = None
    faults: list[dict[str, Any]] = []
    load = Load(router, concurrency=args.concurrency, max_tokens=24, think_s=0.05,
                timeout_s=60)
    load.start()
    try:
        while time.monotonic() < end:
            await asyncio.sleep(rng.uniform(6, 14))
            if time.monotonic() >= end:
                break
            if down_window is None and time.monotonic() >= kill_at:
                t0 = time.monotonic()
                await asyncio.to_thread(up.kill9)
                up = await asyncio.to_thread(UpProcess, work, "--config", str(config))
                down_window = (t0, time.monotonic())
                print(f"  {t0 - started:6.1f} s  fleetwarden SIGKILLed; back after "
                      f"{down_window[1] - t0:.1f} s", flush=True)
                continue
            shards = await asyncio.to_thread(up.client.shards)
            serving = [s["index"] for s in shards if s["state"] == "HEALTHY"]
            if len(serving) < len(shards):
                continue  # one fault at a time: wait for the last one to be repaired
            shard, fault = rng.choice(serving), rng.choice(FAULTS)
            options: dict[str, Any] = {}
            if fault in DURATION_S:
                options["duration_s"] = DURATION_S[fault]
            try:
                await asyncio.to_thread(up.client.chaos, shard, fault, **options)
            except Exception as exc:  # the engine may be mid-restart; note it and go on
                print(f"  chaos {fault} on {shard} refused: {exc}")
                continue
            faults.append({"at_s": round(time.monotonic() - started, 1), "shard": shard,
                           "fault": fault})
            print(f"  {time.monotonic() - started:6.1f} s  {fault} on shard {shard}", flush=True)
    finally:
        await load.stop()
        final_states = [s["state"] for s in await asyncio.to_thread(up.client.shards)]
        await asyncio.to_thread(up.stop)

    with Journal(work / "fleetwarden.sqlite") as journal:
        violations = check_invariants(journal)
        deaths = Counter(cause_of(e.cause) for e in journal.transitions(state_changes_only=True)
                         if e.to_state == "DEAD")
        restarts = Counter(r["outcome"] for r in journal.restarts())
        left = leftovers(journal)
        # counted above; none may outlive the soak
        kill_launched(journal.launch_ids() | journal.router_launch_ids())

    def during_down(r: Any) -> bool:
        return down_window is not None and down_window[0] - 1 <= r.started <= down_window[1]

    ok = sum(1 for r in load.results if r.ok)
    deliberate = sum(1 for r in load.results if r.status == 409)
    down = [r for r in load.results if not r.ok and r.status != 409 and during_down(r)]
    lost = [r for r in load.results if not r.ok and r.status != 409 and not during_down(r)]
    return {
        "minutes": args.minutes, "engines": args.engines, "concurrency": args.concurrency,
        "seed": args.seed, "router_workers": args.router_workers,
        "requests": {"sent": len(load.results), "ok_200": ok, "deliberate_409": deliberate,
                     "failed_while_fleetwarden_down": len(down), "lost": len(lost)},
        "lost_examples": [f"{r.request_id}: {r.status} {r.error[:120]}" for r in lost[:5]],
        "fleetwarden_down_s": None if down_window is None else round(
            down_window[1] - down_window[0], 1),
        "faults": dict(Counter(f["fault"] for f in faults)),
        "faults_injected": len(faults),
        "condemnations_by_cause": dict(deaths),
        "restarts": dict(restarts),
        "invariant_violations": len(violations),
        "violation_examples": violations[:5],
        "leftover_processes": len(left),
        "final_states": final_states,
        "latency": {k: load.summary()[k] for k in ("p50_s", "p99_s", "max_s")},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--router-workers", type=int, default=1,
                   help="router processes ([router] workers); 0: inside fleetwarden")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    print(f"soak: {args.minutes:g} min, {args.engines} engines, {args.concurrency} clients, "
          f"{args.router_workers} router worker(s), seed {args.seed}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fleetwarden-soak-") as tmp:
        result = asyncio.run(soak(args, Path(tmp)))
    r = result["requests"]
    print(f"\nrequests: {r['sent']} sent, {r['ok_200']} answered 200, {r['deliberate_409']} "
          f"deliberate 409, {r['failed_while_fleetwarden_down']} failed while fleetwarden "
          f"itself was down ({result['fleetwarden_down_s']} s), {r['lost']} lost")
    for example in result["lost_examples"]:
        print(f"  lost: {example}")
    print(f"faults injected: {result['faults_injected']} {result['faults']}")
    print(f"condemnations by cause: {result['condemnations_by_cause']}")
    print(f"restarts: {result['restarts']}")
    print(f"ledger invariant violations: {result['invariant_violations']}")
    for example in result["violation_examples"]:
        print(f"  violation: {example}")
    print(f"leftover engine and router processes: {result['leftover_processes']}")
    print(f"final states: {result['final_states']}; latency {result['latency']}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    met = (r["lost"] == 0 and result["invariant_violations"] == 0
           and result["leftover_processes"] == 0
           and (args.router_workers == 0 or r["failed_while_fleetwarden_down"] == 0))
    print("target met" if met else "target NOT met")
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()
