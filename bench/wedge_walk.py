"""The wedge walk, traced: which of fleetwarden's files one wedge crosses, from the requests it
holds silent to the supervisor's restart.

A fleet of three simulated engines in this process (the router too: ``workers`` 0, so one trace
sees both sides), a closed loop of clients, and engine 1 wedged once it holds two requests: its
``/health`` answers 200, its ``/metrics`` freeze, nothing it holds is ever answered. The tick is
a minute, so that what happens in the window happened on evidence, as in the running fleet.
From the wedge to the end of the supervisor's restart of shard 1 (its replacement's process
answers: the shard leaves RESTARTING), every call into a file of the package is recorded with
``sys.setprofile`` (a coroutine resumed is no new call), by the task it ran in, named by its
outermost function of the package (its *root*).

The roots fall in four groups: the wedge's own (the evidence poll, the focused reads, the
pushes, the supervisor, the hedges the router sends), the clients' requests (the router's
HTTP server and the connections to the engines, the same for every request), the round's reads
of every engine, and the router's background loops. What it prints: per root, its files in
order of first entry, its crossings (calls from one file of the package into another) and,
for the focused reads, crossings per read; every file with its first entry (seconds after the
wedge), entries, crossings into it and its groups; then :data:`CHAIN`, the files where the
wedge is acted on, in the order of its course, each checked to have been entered by the
wedge's own roots (a file of the chain not entered fails the run).

    python bench/wedge_walk.py            # ~20 s
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import fleetwarden.config
from fleetwarden.config import parse_config
from fleetwarden.fleet import Fleet
from fleetwarden.ledger import ShardState, Transition
from fleetwarden.testing.load import Load

PACKAGE = str(Path(fleetwarden.config.__file__).parent) + "/"
SIM = "{python} -m fleetwarden sim --host {host} --port {port} --steps-per-s 40"
#: Roots by group, by the file of the root function (the wedge's own: every other root).
GROUPS = {
    "requests": ("router/serve.py", "router/upstream.py", "testing/load.py"),
    "round": ("watchdog.py:reader", "reads.py:loop"),
    "router loops": ("router/cache_sync.py", "router/background.py"),
}
#: Where the wedge is acted on, in the order of its course: what a newcomer reads to follow it.
#: A router in another process adds its control server (router/control.py) after waiting.py,
#: where the link's HTTP call arrives.
CHAIN = (
    ("router/waiting.py", "requests held on the engine, silent; the router's read of them"),
    ("router/links.py", "the controller asks each router what it holds there (and later tells "
     "it to hedge, pushes, rescues)"),
    ("reads.py", "Evidence: silent for silent_after_s, accused; Focus: read at once and again; "
     "ReportBook: each report entered"),
    ("watchdog.py", "GET /metrics, and /health or a canary when the watch asks"),
    ("engine_metrics.py", "the body parsed into a Sample"),
    ("judge.py", "the accusation's plan for each read; the verdict (STUCK) and its report"),
    ("ledger.py", "the reading condemns: DEAD (holds and the routed set beside it)"),
    ("controller.py", "the one transition channel hands DEAD to the pushes"),
    ("pushes.py", "the routed set pushed without it; what it held rescued"),
    ("supervisor.py", "the restart: budget, backoff, the rescue awaited, the old process "
     "stopped"),
    ("launchers/local.py", "the replacement spawned"),
)
#: A coroutine, a generator or an async generator: a frame that is resumed.
_RESUMABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR


@dataclass
class Walk:
    started: float = field(default_factory=time.monotonic)
    first: dict[str, float] = field(default_factory=dict)
    entries: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    crossings: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    by_root: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    #: When the wedge's own roots first entered each file.
    first_by_wedge: dict[str, float] = field(default_factory=dict)
    #: Per root: calls that crossed from one file of the package into another, and the
    #: watchdog's reads (``Watchdog.probe``) made in it.
    root_crossings: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    root_reads: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: The coroutine and generator frames begun in the window: the profiler reports each
    #: resumption as a call, which is no new call (kept alive so that no id is reused).
    begun: dict[int, FrameType] = field(default_factory=dict)

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        name = frame.f_code.co_filename
        if not name.startswith(PACKAGE):
            return
        file = name[len(PACKAGE):]
        if frame.f_code.co_flags & _RESUMABLE:
            if id(frame) in self.begun:
                return
            self.begun[id(frame)] = frame
        if file not in self.first:
            self.first[file] = time.monotonic() - self.started
        self.entries[file] += 1
        caller = frame.f_back
        crossed = (caller is not None and caller.f_code.co_filename.startswith(PACKAGE)
                   and caller.f_code.co_filename != name)
        if crossed:
            self.crossings[file] += 1
        root, f = frame, frame.f_back
        while f is not None:
            if f.f_code.co_filename.startswith(PACKAGE):
                root = f
            f = f.f_back
        key = f"{root.f_code.co_filename[len(PACKAGE):]}:{root.f_code.co_name}"
        if file not in self.by_root[key]:
            self.by_root[key].append(file)
        if file not in self.first_by_wedge and group_of(key) == "wedge":
            self.first_by_wedge[file] = time.monotonic() - self.started
        self.root_crossings[key] += crossed
        if file == "watchdog.py" and frame.f_code.co_name == "probe" and crossed:
            self.root_reads[key] += 1


async def walk(tmp: Path) -> tuple[Walk, float]:
    config = parse_config({
        "fleet": {"engines": 3, "engine_cmd": SIM, "log_dir": str(tmp / "logs"),
                  "startup_timeout_s": 30},
        "router": {"port": 0, "workers": 0},
        "health": {"probe_interval_s": 60.0, "probe_timeout_s": 1.0, "stall_s": 2.0,
                   "canary_interval_s": 1.0, "canary_timeout_s": 1.5},
        "supervisor": {"backoff_initial_s": 0.5, "backoff_max_s": 2, "stop_grace_s": 3},
        "journal": {"path": str(tmp / "fleet.sqlite")},
        "admin": {"port": 0, "token_file": str(tmp / "admin.token")},
    }, "wedge-walk")
    fleet = Fleet(config)
    await fleet.start()
    loop = asyncio.create_task(fleet.run(), name="controller")
    restarted = asyncio.Event()

    def seen(t: Transition) -> None:
        if t.shard == 1 and t.from_state is ShardState.RESTARTING:
            sys.setprofile(None)
            restarted.set()

    fleet.ledger.subscribe(seen)
    try:
        async with Load(fleet.router_url, concurrency=9, max_tokens=40):
            url = fleet.ledger.shard(1).base_url
            deadline = time.monotonic() + 30
            while fleet.router.in_flight().get(url, 0) < 2:
                if time.monotonic() > deadline:
                    raise SystemExit("engine 1 never held two requests")
                await asyncio.sleep(0.01)
            await fleet.inject_fault(1, "wedge", {})
            w = Walk()
            sys.setprofile(w.profile)
            try:
                await asyncio.wait_for(restarted.wait(), 60)
            finally:
                sys.setprofile(None)
            return w, time.monotonic() - w.started
    finally:
        fleet.request_stop()
        await asyncio.wait_for(loop, 30)
        await fleet.stop()


def group_of(root: str) -> str:
    for group, prefixes in GROUPS.items():
        if any(root == p or root.startswith(p + ":") for p in prefixes):
            return group
    return "wedge"


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        w, took = asyncio.run(walk(Path(tmp)))
    print(f"wedge to its replacement's process: {took:.2f} s; "
          f"{len(w.first)} files of the package entered\n")
    groups: dict[str, set[str]] = defaultdict(set)
    for root, files in sorted(w.by_root.items(), key=lambda kv: (group_of(kv[0]), kv[0])):
        groups[group_of(root)].update(files)
        reads = w.root_reads.get(root, 0)
        per_read = f", {w.root_crossings[root] / reads:.0f} per read" if reads else ""
        print(f"[{group_of(root)}] {root}: {len(files)} files, {w.root_crossings[root]} "
              f"crossings, {reads} reads{per_read}\n    " + " -> ".join(files))
    print("\nfile                                first s  entries  crossed into  groups")
    for file in sorted(w.first, key=w.first.__getitem__):
        in_groups = ", ".join(g for g in sorted(groups) if file in groups[g])
        print(f"{file:36s}{w.first[file]:7.2f}{w.entries[file]:9d}{w.crossings[file]:14d}"
              f"  {in_groups}")
    print(f"\n{len(groups['wedge'])} files entered by the wedge's own roots; "
          f"{len(set(w.first) - groups['wedge'])} by the others alone")
    print(f"\nthe chain, in the order of the wedge's course ({len(CHAIN)} files; first entered "
          "by the wedge's own roots):")
    missing = []
    for n, (file, what) in enumerate(CHAIN, 1):
        entered = file in groups["wedge"]
        if not entered:
            missing.append(file)
        first = f"{w.first_by_wedge[file]:5.2f} s" if entered else "   never"
        print(f"{n:3d}. {file:22s}{first}  {what}")
    if missing:
        raise SystemExit(f"not entered by the wedge's own roots: {', '.join(missing)}")


if __name__ == "__main__":
    main()
