"""Two checkouts' `fleetwarden route`, A/B in interleaved blocks: what a change costs a request.

Both routers run at once in front of the same backend (`bench/router_overhead.py`'s); the
load (concurrency 64, its closed loop) goes to A for a block, then to B, then A again, for
``--blocks`` pairs. Each block's CPU per request is read from /proc for the router that took
it. On a shared machine the other tenants slow both alike within a pair, so the per-pair
ratio B/A holds still where the absolute figures of single runs move by 20 % and more.

    python bench/router_ab.py --baseline /path/to/main/src [--blocks 12] [--seconds 2]
                              [--routing cache_aware] [--keys]

``--keys``: B checks client keys (a keys file of one key) and the load sends that key to both,
so the ratio is what the data port's keys cost a request (A forwards the header untouched).

A is the baseline ``src``; B is this checkout's (the ``PYTHONPATH`` this runs with). Prints
each router's median and best µs of CPU per request, and the median of the pairs' ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _peers import process
from router_overhead import KEY_ENV, _run_load, _wait_until_serving

ROOT = Path(__file__).resolve().parent.parent
OVERHEAD = ROOT / "bench" / "router_overhead.py"


def _route(backend_url: str, src: Path | None, stack: contextlib.ExitStack,
           routing: str | None = None, keys_file: Path | None = None) -> tuple[str, int]:
    """A `fleetwarden route` from ``src`` (None: this checkout's), with ``--routing`` when
    given: its URL and pid."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src.resolve())
    router = stack.enter_context(process(
        [sys.executable, "-m", "fleetwarden", "route", "--port", "0",
         "--backend", backend_url, "--log-level", "error",
         *(("--routing", routing) if routing else ()),
         *(("--keys-file", str(keys_file)) if keys_file else ())], env=env))
    assert router.stdout is not None
    url = router.stdout.readline().split(" on ", 1)[1].split(",")[0]
    _wait_until_serving(url)
    return url, router.pid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True,
                        help="the src folder of A (e.g. the main branch's)")
    parser.add_argument("--blocks", type=int, default=12, help="pairs of blocks (A, then B)")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds of load a block")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--routing", default=None,
                        help="both routers' --routing (e.g. cache_aware: the policy's cost)")
    parser.add_argument("--keys", action="store_true",
                        help="B checks client keys (--keys-file) and the load sends one to "
                             "both: what the data port's keys cost a request")
    args = parser.parse_args()
    keys_file = None
    if args.keys:
        from fleetwarden.router.keys import add_key

        keys_file = Path(tempfile.mkdtemp()) / "keys"
        os.environ[KEY_ENV] = add_key(keys_file, "bench")  # the load processes inherit it
    with process([sys.executable, str(OVERHEAD), "--role", "backend"]) as backend, \
            contextlib.ExitStack() as stack:
        assert backend.stdout is not None
        backend_url = f"http://127.0.0.1:{backend.stdout.readline().strip()}"
        routers = {"A (baseline)": _route(backend_url, args.baseline, stack, args.routing),
                   "B (this checkout)": _route(backend_url, None, stack, args.routing,
                                               keys_file)}
        cpu: dict[str, list[float]] = {name: [] for name in routers}
        for _ in range(args.blocks):
            for name, (url, pid) in routers.items():
                result = _run_load(url, args.concurrency, 0, args.seconds, router=pid)
                answered = result["statuses"]
                assert isinstance(answered, dict) and set(map(str, answered)) == {"200"}, (
                    f"{name} answered {answered}: not the path this measures")
                cpu[name].append(float(result["cpu_us"]))  # type: ignore[arg-type]
    a, b = cpu.values()
    ratios = [y / x for x, y in zip(a, b, strict=True)]
    print(f"{args.blocks} pairs of {args.seconds:g} s blocks, concurrency {args.concurrency}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")
    print("| router | CPU µs/request, median | best block |")
    print("|---|---|---|")
    for name, values in cpu.items():
        print(f"| {name} | {statistics.median(values):.1f} | {min(values):.1f} |")
    print(f"B/A, median of the pairs: {statistics.median(ratios):.3f} "
          f"(pairs from {min(ratios):.3f} to {max(ratios):.3f})")


if __name__ == "__main__":
    main()
