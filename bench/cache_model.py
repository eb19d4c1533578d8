"""The cache-aware policy's load guard in virtual time: quick to rerun, apart from the machine.

bench/cache.py measures routers as processes on a shared 2-core machine, where each run takes
minutes and its timings carry the machine's load. This model runs the router's pure pieces
(``router/affinity.py`` and ``router/pool.py``) in front of the simulated engine's pure core
(``sim/engine.py`` with its prefix cache, bench/cache.py's engine settings: 8 slots, a 512-token
step budget, a step every 20 ms) on a virtual clock, so a guard setting is compared across fleet
sizes and seeds in seconds, and a run replays exactly. It measures the policy, not the router's
cost or the network: TTFT here is the time to the first token's step (queueing and prefill).

Workloads as bench/cache.py's agents: ``--sessions`` conversations of 6 turns, each thinking
0-200 ms (seeded) between turns, with ``x-session-id``, with and without a shared system prompt.

    python bench/cache_model.py [--engines 2,4,8] [--sessions N,..] [--abs 4] [--rel 1.5]
                                [--seeds 1,2,3] [--guard mean|least] [--baseline SRC] [--pinned]

``--guard least``: the guard before this model was written, a slack over the least loaded
engine (``max(abs, (rel - 1) * mean)`` requests above it), for comparison in the same run.
``--baseline SRC``: also another source folder's policy (before a change), on the same seeds;
``--pinned``: also the ideal placement (session k on engine k mod n, no router). Per run: hit
rate, TTFT p50/p99, the first turns' p99 and the later turns' p50/p99 (each request is taken
apart: turn, engine, cached tokens, time queued, steps), conversations moved, the busiest
engine over the mean, and the policy's own time per request (choose and record, CPU time).
"""

from __future__ import annotations

import argparse
import heapq
import importlib.util
import json
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

from cache import SYSTEM, pct  # the same system prompt and quantiles as bench/cache.py
from fleetwarden.router import affinity
from fleetwarden.router.affinity import Affinity, AffinitySettings, query_of
from fleetwarden.router.pool import Pool
from fleetwarden.sim import wire
from fleetwarden.sim.engine import EngineCore, SimRequest
from fleetwarden.sim.prefix_cache import PrefixCache

STEP_S = 0.02  # bench/cache.py's engines: 50 steps/s
SLOTS = 8
BUDGET = 512
CACHE_BLOCKS = 4096
TURNS = 6
MAX_TOKENS = 8


class _Quiet:
    """The engine core's metric families, unread here."""

    start_time = 0.0

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class _Answer:
    """A generation that spells a fixed answer (the next turn re-sends it)."""

    finish_reason: str | None = None

    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0

    def sample(self) -> int:
        token = ord(self.text[self.i % len(self.text)])
        self.i += 1
        return token


def least_guard(candidates: Sequence[str], loads: Mapping[str, int], balance_abs: int,
                balance_rel: float) -> list[str]:
    """The earlier guard: a slack over the least loaded engine."""
    counts = [loads.get(u, 0) for u in candidates]
    least = min(counts)
    slack = max(balance_abs, (balance_rel - 1) * (sum(counts) + 1) / len(counts))
    return [u for u, n in zip(candidates, counts, strict=True) if n - least < slack]


def agents(engines: int, sessions: int, *, system: bool, seed: int,
           settings: AffinitySettings, pinned: bool = False,
           policy_class: type[Affinity] = Affinity) -> dict[str, Any]:
    """One run; ``pinned``: session k always on engine k mod ``engines``, no router (the
    ideal placement of these sessions: every engine holds an equal share of them, and no
    conversation ever moves). ``policy_class``: another version's policy (``--baseline``)."""
    urls = [f"http://e{i}" for i in range(engines)]
    cores = {u: EngineCore(_Quiet(), slots=SLOTS, tokens_per_step=1,
                           max_num_batched_tokens=BUDGET, prefix_cache=PrefixCache(CACHE_BLOCKS))
             for u in urls}
    policy = policy_class(settings)
    policy_s = 0.0
    pool = Pool(urls)
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": SYSTEM}] if system else [] for _ in range(sessions)]
    rngs = [random.Random(f"{seed}-{k}") for k in range(sessions)]
    arrivals: list[tuple[float, int, int]] = []
    for k in range(sessions):
        heapq.heappush(arrivals, (rngs[k].uniform(0.0, 0.2), k, 0))
    inflight: dict[SimRequest, tuple[str, int, int]] = {}
    ttft: list[float] = []
    trace: list[dict[str, Any]] = []
    queried = hits = 0
    served = dict.fromkeys(urls, 0)
    now = 0.0
    while arrivals or inflight:
        while arrivals and arrivals[0][0] <= now:
            at, k, t = heapq.heappop(arrivals)
            histories[k].append({"role": "user", "content": (
                f"Agent {k}, turn {t}: here is the tool output you asked for. " * 5)})
            query = query_of({"messages": histories[k]}, f"agent-{k}", settings)
            assert query is not None
            started = time.process_time()
            url = urls[k % engines] if pinned else pool.pick(
                session=query.session, prefer=partial(policy.choose, query, now=now))
            assert url is not None
            policy.placed(query, url, now)
            policy_s += time.process_time() - started
            pool.dispatched(url)
            served[url] += 1
            ids = wire.encode(wire.chat_prompt(histories[k]))
            request = SimRequest(id=f"{k}-{t}", prompt_tokens=len(ids), max_tokens=MAX_TOKENS,
                                 arrived_at=at, generation=_Answer(f"A{k}t{t}ok."),  # type: ignore[arg-type]
                                 prompt_ids=ids)
            cores[url].add(request)
            inflight[request] = (url, k, t)
        for url, core in cores.items():
            if not core.has_work:
                continue
            result = core.step(now)
            for request, _ in result.produced:
                if request.first_token_at == now and len(request.output) <= 1:
                    ttft.append(now - request.arrived_at)
                    _, k, t = inflight[request]
                    trace.append(_traced(request, urls.index(url), k, t, now))
            for request in result.finished:
                _, k, t = inflight.pop(request)
                queried += request.prompt_tokens
                hits += request.cached
                pool.finished(url)
                histories[k].append({"role": "assistant",
                                     "content": "".join(map(chr, request.output))})
                if t + 1 < TURNS:
                    heapq.heappush(arrivals, (now + rngs[k].uniform(0.0, 0.2), k, t + 1))
        now = round(now + STEP_S, 6)
    trace.sort(key=lambda r: (r["session"], r["turn"]))
    after = [r["ttft_ms"] for r in trace if r["turn"] > 0]
    first = [r["ttft_ms"] for r in trace if r["turn"] == 0]
    return {"hit_rate": hits / queried,
            "first_turn_p99_ms": pct(first, 0.99),
            "after_first_p50_ms": pct(after, 0.5),
            "after_first_p99_ms": pct(after, 0.99),
            "moves": sum(1 for a, b in pairwise(trace)
                         if a["session"] == b["session"] and a["engine"] != b["engine"]),
            "policy_us_per_request": 1e6 * policy_s / len(trace),
            "ttft_p50_ms": pct([1000 * t for t in ttft], 0.5),
            "ttft_p99_ms": pct([1000 * t for t in ttft], 0.99),
            "requests_per_engine": list(served.values()),
            "busiest_over_mean": max(served.values()) / statistics.fmean(served.values()),
            "trace": trace}


def _traced(request: SimRequest, engine: int, session: int, turn: int, now: float
            ) -> dict[str, Any]:
    """One request's first token, taken apart: where it went, what it found cached, how long
    it waited for a slot, and how many engine steps it took."""
    scheduled = request.scheduled_at if request.scheduled_at is not None else now
    assert request.first_token_step is not None
    return {"session": session, "turn": turn, "engine": engine,
            "prompt_tokens": request.prompt_tokens, "cached": request.cached,
            "queued_ms": round(1000 * (scheduled - request.arrived_at), 1),
            "steps": request.first_token_step - request.arrival_step,
            "ttft_ms": round(1000 * (now - request.arrived_at), 1)}


def baseline_policy(src: Path) -> type[Affinity]:
    """The ``Affinity`` of another source folder (another checkout's ``src``: before a change),
    loaded beside this one's."""
    spec = importlib.util.spec_from_file_location("baseline_affinity",
                                                  src / "fleetwarden/router/affinity.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    policy: type[Affinity] = module.Affinity
    return policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="2,4,8")
    parser.add_argument("--sessions", default="",
                        help="comma-separated agents per run (3 and 6 per engine by default)")
    parser.add_argument("--abs", type=int, default=AffinitySettings().balance_abs)
    parser.add_argument("--rel", type=float, default=AffinitySettings().balance_rel)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--guard", choices=("mean", "least"), default="mean")
    parser.add_argument("--baseline", type=Path, default=None, metavar="SRC",
                        help="also the policy of this source folder (e.g. the main checkout's "
                             "src), on the same seeds")
    parser.add_argument("--pinned", action="store_true",
                        help="also the ideal placement: session k on engine k mod n")
    args = parser.parse_args()
    if args.guard == "least":
        affinity.within_guard = least_guard
    settings = AffinitySettings(balance_abs=args.abs, balance_rel=args.rel)
    seeds = [int(s) for s in args.seeds.split(",")]
    policies: list[tuple[str, type[Affinity], bool]] = [("this", Affinity, False)]
    if args.baseline is not None:
        policies.insert(0, ("baseline", baseline_policy(args.baseline), False))
    if args.pinned:
        policies.append(("pinned", Affinity, True))
    for engines in (int(n) for n in args.engines.split(",")):
        counts = ([int(n) for n in args.sessions.split(",")] if args.sessions
                  else sorted({3 * engines, 6 * engines}))
        for sessions in counts:
            for system in (False, True):
                for name, policy, pinned in policies:
                    rows = [agents(engines, sessions, system=system, seed=s,
                                   settings=settings, pinned=pinned, policy_class=policy)
                            for s in seeds]
                    print(json.dumps({
                        "policy": name, "guard": args.guard, "abs": args.abs,
                        "engines": engines, "sessions": sessions, "system_prompt": system,
                        **{k: [round(r[k], 3 if k == "hit_rate" else
                                     2 if k == "busiest_over_mean" else 1) for r in rows]
                           for k in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms",
                                     "first_turn_p99_ms", "after_first_p50_ms",
                                     "after_first_p99_ms", "busiest_over_mean", "moves",
                                     "policy_us_per_request")}}),
                        flush=True)


if __name__ == "__main__":
    main()
