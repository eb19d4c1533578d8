"""The model-based test of the whole fleet, long: thousands of random operator operations on
fleets behind ``fleetwarden up``, the contract checked after each one.

    python bench/fleet_model.py --operations 5000 [--seed 1] [--budget-min 120] [--concurrent]
        [--json out.json]

What it runs: :func:`fleetwarden.testing.fleet_model.run_model` (the suite runs 300 operations
of it in tests/scenario/test_fleet_model.py). What it prints: every operation, every violation
as it is found, then operations by kind, requests and their failures by circumstance, and the
violations (those under a gate, if one is open in ``fleet_model.GATES``, counted apart).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from fleetwarden.testing.fleet_model import GATES, run_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--operations", type=int, default=5000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--budget-min", type=float, default=120.0,
                   help="stop drawing operations after this long (a bound, not a target)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--concurrent", action="store_true",
                   help="run the epochs' fleets side by side (each its own generator) until "
                        "together they have drawn the operations")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleetwarden-model-") as tmp:
        report = asyncio.run(run_model(args.seed, args.operations, args.budget_min * 60,
                                       Path(tmp), concurrent=args.concurrent,
                                       pooled=args.concurrent))
    print(f"\noperations: {report.steps} {dict(sorted(report.operations.items()))}")
    print(f"requests: {report.requests}, failed: {dict(report.failed) or 'none'}")
    print(f"violations: {len(report.ungated)}")
    for v in report.ungated:
        print(f"  {v}")
    for gate, n in sorted(report.gated.items()):
        print(f"gated {gate} ({GATES[gate]}): {n}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "seed": args.seed, "operations": report.steps, "by_kind": dict(report.operations),
            "seconds": round(report.seconds), "requests": report.requests,
            "failed": dict(report.failed), "violations": [str(v) for v in report.ungated],
            "gated": dict(report.gated)}, indent=2))
    sys.exit(0 if not report.ungated else 1)


if __name__ == "__main__":
    main()
