"""What a weight sync costs a trainer's rollouts, with fleetwarden in front and with none.

The same simulated vLLM engines serve both runs, one after the other. Rollouts go on all the
time (``--clients`` closed loops, one greedy completion each); every ``--every-s`` the trainer
writes a checkpoint and syncs it:

* **direct**: no fleetwarden. The trainer calls each engine's RL API itself, engines in
  parallel (``/pause?mode=wait``, ``/collective_rpc reload_weights``,
  ``/update_weight_version``, ``/resume``: the calls fleetwarden makes), and the rollouts go
  round-robin straight to the engines. A rollout sent to a paused engine waits there.
* **fleetwarden**: the engines attached to ``fleetwarden up --weights trainer``; the trainer
  calls ``refit_from(path, version)`` (out of routing, drained, the same four calls, the
  engine's own version read back, credited, routed again); the rollouts go through the router,
  and one answered 409 (every engine loading) is sent again after 50 ms.

Printed per run: the sync's time as the trainer waits for it, each engine's load (pause to
resume), and the rollouts' latency, from the first send to the answer: those that overlapped
no sync, those that overlapped one, and the difference of their medians (the latency a sync
adds). A rollout that got no answer is counted as lost.

    python bench/refit_latency.py [--engines 3] [--syncs 20] [--every-s 1.0] [--clients 8]
                                  [--max-tokens 16] [--steps-per-s 100]

One run of each on one machine: compare the two columns, not figures across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from _peers import process
from fleetwarden.testing.up import UpProcess
from fleetwarden.weight_sync import load_checkpoint

#: A rollout re-sent after a 409 (every engine loading) waits this long first, as the trainer
#: loops in tests/scenario/test_refit_from.py and examples/refit_from_loop.py do.
RESEND_AFTER_S = 0.05


@dataclass
class Run:
    name: str
    #: (sent, answered) on the loop's clock, per rollout answered.
    rollouts: list[tuple[float, float]] = field(default_factory=list)
    lost: int = 0
    resent: int = 0
    #: (begun, ended) of each sync, as the trainer waited for it.
    syncs: list[tuple[float, float]] = field(default_factory=list)
    per_engine: list[float] = field(default_factory=list)


async def rollouts(http: aiohttp.ClientSession, urls: list[str], run: Run, stop: asyncio.Event,
                   max_tokens: int, client: int) -> None:
    """One client's closed loop of rollouts until ``stop``."""
    loop = asyncio.get_running_loop()
    n = client
    while not stop.is_set():
        url = urls[n % len(urls)]
        n += 1
        sent = loop.time()
        for attempt in range(400):
            try:
                async with http.post(url + "/v1/completions", json={
                        "model": "tiny", "prompt": f"rollout {n}", "max_tokens": max_tokens,
                        "temperature": 0}) as r:
                    await r.read()
                    if r.status == 200:
                        run.rollouts.append((sent, loop.time()))
                        run.resent += attempt
                        break
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(RESEND_AFTER_S)
        else:
            run.lost += 1


async def trainer(run: Run, syncs: int, every_s: float, ckpts: Path, version0: int,
                  sync: Any) -> None:
    loop = asyncio.get_running_loop()
    for step in range(syncs):
        await asyncio.sleep(every_s)
        path = ckpts / f"ckpt-{run.name}-{step}"
        path.write_text(f"weights of {run.name} after step {step}\n")
        begun = loop.time()
        run.per_engine += await sync(str(path), version0 + step)
        run.syncs.append((begun, loop.time()))


async def measure(run: Run, urls: list[str], sync: Any, args: argparse.Namespace,
                  ckpts: Path, version0: int) -> Run:
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        clients = [asyncio.ensure_future(rollouts(http, urls, run, stop, args.max_tokens, c))
                   for c in range(args.clients)]
        try:
            await trainer(run, args.syncs, args.every_s, ckpts, version0, sync)
            await asyncio.sleep(args.every_s)  # rollouts after the last sync
        finally:
            stop.set()
            await asyncio.gather(*clients)
    return run


def direct_sync(urls: list[str]) -> Any:
    async def sync(path: str, version: int) -> list[float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            done = await asyncio.gather(*(load_checkpoint(http, u, path, version,
                                                          pause_mode="wait") for u in urls))
        failed = [r.error for r in done if not r.took]
        if failed:
            raise RuntimeError(f"a direct load failed: {failed}")
        return [r.seconds for r in done]
    return sync


def fleet_sync(up: UpProcess) -> Any:
    async def sync(path: str, version: int) -> list[float]:
        done = await asyncio.to_thread(up.client.refit_from, path, version)
        if len(done["credited"]) != len(done["engines"]):
            raise RuntimeError(f"a fleetwarden load failed: {done}")
        return [e["seconds"] for e in done["engines"]]
    return sync


def report(run: Run) -> dict[str, float]:
    def overlaps(sent: float, answered: float) -> bool:
        return any(sent < end and answered > begun for begun, end in run.syncs)

    during = [a - s for s, a in run.rollouts if overlaps(s, a)]
    outside = [a - s for s, a in run.rollouts if not overlaps(s, a)]
    syncs = [end - begun for begun, end in run.syncs]
    q = statistics.quantiles
    return {
        "sync_p50_ms": statistics.median(syncs) * 1000,
        "sync_max_ms": max(syncs) * 1000,
        "engine_p50_ms": statistics.median(run.per_engine) * 1000,
        "engine_p99_ms": q(run.per_engine, n=100)[98] * 1000,
        "outside_p50_ms": statistics.median(outside) * 1000,
        "during_p50_ms": statistics.median(during) * 1000,
        "during_p99_ms": q(during, n=100)[98] * 1000,
        "added_p50_ms": (statistics.median(during) - statistics.median(outside)) * 1000,
        "rollouts": len(run.rollouts), "during": len(during), "lost": run.lost,
        "resent": run.resent,
    }


ROWS = [("a sync, as the trainer waits (p50 / max)", "sync_p50_ms", "sync_max_ms"),
        ("one engine's load, pause to resume (p50 / p99)", "engine_p50_ms", "engine_p99_ms"),
        ("rollout latency, no sync under way (p50)", "outside_p50_ms", None),
        ("rollout latency, across a sync (p50 / p99)", "during_p50_ms", "during_p99_ms"),
        ("latency a sync adds to a rollout (p50)", "added_p50_ms", None)]


def table(results: dict[str, dict[str, float]]) -> str:
    names = list(results)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, a, b in ROWS:
        cells = [f"{r[a]:.0f}" + (f" / {r[b]:.0f}" if b else "") + " ms"
                 for r in results.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    counts = [f"{r['rollouts']:.0f} ({r['during']:.0f} across a sync), lost {r['lost']:.0f}, "
              f"re-sent {r['resent']:.0f}" for r in results.values()]
    lines.append("| rollouts answered | " + " | ".join(counts) + " |")
    return "\n".join(lines)


def start_engines(stack: contextlib.ExitStack, n: int, steps_per_s: float) -> list[str]:
    urls = []
    for _ in range(n):
        proc = stack.enter_context(process(
            [sys.executable, "-m", "fleetwarden", "sim", "--port", "0", "--steps-per-s",
             str(steps_per_s)]))
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.match(r"ready (http://\S+) pid=", line)
        if match is None:
            raise RuntimeError(f"a simulated engine did not start: {line!r}")
        urls.append(match.group(1))
    return urls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--syncs", type=int, default=20)
    p.add_argument("--every-s", type=float, default=1.0, help="seconds between syncs")
    p.add_argument("--clients", type=int, default=8, help="rollouts under way at once")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--steps-per-s", type=float, default=100.0,
                   help="the simulated engines' speed")
    args = p.parse_args()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="refit-latency-") as tmp, \
            contextlib.ExitStack() as stack:
        ckpts = Path(tmp)
        urls = start_engines(stack, args.engines, args.steps_per_s)
        print(f"engines: {' '.join(urls)}", flush=True)
        direct = asyncio.run(measure(Run("direct"), urls, direct_sync(urls), args, ckpts, 1))
        results["direct to the engines"] = report(direct)
        workdir = ckpts / "fleet"
        workdir.mkdir()
        up = UpProcess(workdir, "--weights", "trainer",
                       *(a for u in urls for a in ("--backend", u)))
        try:
            deadline = time.monotonic() + 60
            while len(up.client.shards()) < args.engines or any(
                    s["state"] not in ("HEALTHY", "STALE") for s in up.client.shards()):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engines were not attached: {up.client.shards()}")
                time.sleep(0.2)
            # The first load credits every engine (attached in trainer mode, they wait in
            # STALE for it), then the measured loop.
            up.client.refit_from(str(ckpts / f"ckpt-direct-{args.syncs - 1}"), 1000)
            fleet = asyncio.run(measure(Run("fleetwarden"), [up.router], fleet_sync(up), args,
                                        ckpts, 1001))
            results["through fleetwarden"] = report(fleet)
        finally:
            up.stop()
    print(f"\n{args.engines} simulated engines ({args.steps_per_s:g} steps/s), {args.clients} "
          f"rollouts under way ({args.max_tokens} tokens each), a sync every "
          f"{args.every_s:g} s, {args.syncs} syncs per run, pause mode wait:\n")
    print(table(results))
    if any(r["lost"] for r in results.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
