"""The exactness oracle at length: many random cut generations, each exact or refused.

The test tier (tests/scenario/test_exactness_oracle.py) runs 2,000 cases; this runs as many as
asked (20,000 by default) on the same rig: simulated engines as strict as vLLM 0.32 behind the
real router on 127.0.0.1, each case's reference straight from an engine, then the same request
through the router with its engine cut (crash, reset, wedge rescued, cut after the final chunk,
cut inside a chunk). Prints cases run, continued exactly, refused by cause, and any inexact
case with its seed and index (exit status 1 if there is one).

    python bench/exactness.py [--cases 20000] [--seed N] [--concurrency 48]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys

from fleetwarden.testing.oracle_rig import oracle


async def _run(seed: int, cases: int, concurrency: int, batch: int) -> int:
    inexact = 0
    async with oracle() as o:
        totals = None
        for first in range(0, cases, batch):
            result = await o.run(seed, min(batch, cases - first), first=first,
                                 concurrency=concurrency)
            if totals is None:
                totals = result
            else:
                totals.cases += result.cases
                totals.cut += result.cut
                totals.continued += result.continued
                totals.verdicts.update(result.verdicts)
                totals.refused.update(result.refused)
                totals.by_cut.update(result.by_cut)
                totals.by_kind.update(result.by_kind)
                totals.inexact += result.inexact
                totals.seconds += result.seconds
        assert totals is not None
        print(totals.summary())
        print("by cut:")
        for cut in sorted({c for c, _ in totals.by_cut}):
            row = {v: totals.by_cut[(cut, v)] for v in ("exact", "refused", "inexact")}
            print(f"  {cut:12} exact {row['exact']:6d}  refused {row['refused']:6d}  "
                  f"inexact {row['inexact']:3d}")
        print("by request:")
        for kind in sorted({k for k, _ in totals.by_kind}):
            row = {v: totals.by_kind[(kind, v)] for v in ("exact", "refused", "inexact")}
            print(f"  {kind:18} exact {row['exact']:6d}  refused {row['refused']:6d}  "
                  f"inexact {row['inexact']:3d}")
        inexact = totals.verdicts["inexact"]
    return inexact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--batch", type=int, default=2_000,
                        help="cases drawn at once (bounds the tasks alive together)")
    args = parser.parse_args()
    seed = random.randrange(2**31) if args.seed is None else args.seed
    print(f"exactness oracle: --seed {seed} --cases {args.cases}", flush=True)
    # The engines log every connection the cuts break; the figures are what matters here.
    logging.getLogger("aiohttp").setLevel(logging.CRITICAL)
    logging.getLogger("fleetwarden").setLevel(logging.ERROR)
    inexact = asyncio.run(_run(seed, args.cases, args.concurrency, args.batch))
    sys.exit(1 if inexact else 0)


if __name__ == "__main__":
    main()
