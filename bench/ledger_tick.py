"""The ledger work of one controller tick for a large fleet, with and without the journal.

Per tick, for every shard: one ``report_outcomes`` (the router's window) and one ``record_probe``
(the watchdog's verdict), then one ``serving_urls()`` (the push). A small share of shards fail
each tick and condemned shards are restarted, so the journal has real transitions to write.

    python bench/ledger_tick.py [--shards 1000] [--ticks 400] [--fail-rate 0.01]

Target: under 5 ms median per tick without the journal, on a 2-core machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from fleetwarden.journal import Journal
from fleetwarden.ledger import Ledger, Policy, ShardState


def run(shards: int, ticks: int, fail_rate: float, journal_path: Path | None) -> dict[str, float]:
    rng = random.Random(42)
    ledger = Ledger([f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(shards)],
                    Policy(max_restart_attempts=10**9))
    journal = None
    if journal_path is not None:
        journal = Journal(journal_path)
        journal.attach(ledger)
    transitions = 0

    def count(_: object) -> None:
        nonlocal transitions
        transitions += 1

    ledger.subscribe(count)
    port = 20000
    durations = []
    for _ in range(ticks):
        failing = {i for i in range(shards) if rng.random() < fail_rate}
        start = time.perf_counter()
        for i in range(shards):
            if i in failing:
                ledger.report_outcomes(i, 0, 3, 3)
                ledger.record_probe(i, ok=False, error="timeout")
            else:
                ledger.report_outcomes(i, 12, 0, 0)
                ledger.record_probe(i, ok=True)
        ledger.serving_urls()
        durations.append(time.perf_counter() - start)
        # the supervisor's part, outside the timed ledger work of the tick
        for i in range(shards):
            state = ledger.state(i)
            if state is ShardState.DEAD:
                ledger.mark_restarting(i)
            elif state is ShardState.RESTARTING:
                port += 1
                ledger.mark_loaded(i, f"http://10.1.0.1:{port}", f"launch-{port}")
            elif state is ShardState.STALE:
                ledger.report_refit(i, 1)
    if journal is not None:
        flush_start = time.perf_counter()
        journal.close()
        flush = time.perf_counter() - flush_start
    else:
        flush = 0.0
    durations.sort()
    return {
        "median_ms": statistics.median(durations) * 1e3,
        "p99_ms": durations[int(len(durations) * 0.99) - 1] * 1e3,
        "transitions_per_tick": transitions / ticks,
        "final_flush_ms": flush * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--ticks", type=int, default=400)
    parser.add_argument("--fail-rate", type=float, default=0.01)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            "ledger alone": run(args.shards, args.ticks, args.fail_rate, None),
            "with journal": run(args.shards, args.ticks, args.fail_rate,
                                Path(tmp) / "bench.sqlite"),
        }
    print(f"ledger tick: {args.shards} shards, {args.ticks} ticks, "
          f"{args.fail_rate:.0%} of shards failing per tick")
    print(f"{'':14} {'median ms':>10} {'p99 ms':>8} {'transitions/tick':>17} {'close ms':>9}")
    for name, r in results.items():
        print(f"{name:14} {r['median_ms']:>10.2f} {r['p99_ms']:>8.2f} "
              f"{r['transitions_per_tick']:>17.1f} {r['final_flush_ms']:>9.1f}")
    base = results["ledger alone"]["median_ms"]
    print(f"journal / alone (median): {results['with journal']['median_ms'] / base:.2f}x")


if __name__ == "__main__":
    main()
