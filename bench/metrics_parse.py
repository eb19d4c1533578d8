"""The cost of reading one real vLLM /metrics body: whole-body parse vs reduce-then-parse.

The body is a real vLLM 0.32 capture (52 KB, ~630 lines, 92 families). Three ways to read it:

* whole body: prometheus-client's text parser over every family, then pick the judged samples
  (what a watchdog does when it parses first and asks questions later);
* reduce: only ``engine_metrics.reduce`` — cutting the text to the judged families' lines;
* reduce + parse: ``engine_metrics.parse`` — what the watchdog does per engine per round.

    python bench/metrics_parse.py [--repeat 300] [--engines 64]

Also prints what each costs a watchdog round over ``--engines`` engines: CPU time on the event
loop per round, and the longest single stretch the loop is blocked (one body).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from fleetwarden.engine_metrics import JUDGED, Sample, parse, reduce

CAPTURE = Path(__file__).parent.parent / "tests" / "fixtures" / "vllm" / "metrics-busy-1.txt"
WANTED = {f.sample for f in JUDGED.values()}


def whole_body(text: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in WANTED:
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    return sums


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    fn()  # warm up
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--engines", type=int, default=64)
    args = parser.parse_args()
    body = CAPTURE.read_bytes()
    text = body.decode()
    sample = parse(body)
    assert isinstance(sample, Sample)
    expected = whole_body(text)
    assert all(getattr(sample, f.field) == expected[f.sample] for f in JUDGED.values())

    runs = {
        "whole body": timed(lambda: whole_body(text), args.repeat),
        "reduce only": timed(lambda: reduce(text), args.repeat),
        "reduce + parse": timed(lambda: parse(body), args.repeat),
    }
    print(f"{CAPTURE.name}: {len(body)} bytes, {len(text.splitlines())} lines; reduced to "
          f"{len(reduce(text))} bytes, {len(reduce(text).splitlines())} lines; "
          f"{args.repeat} runs each")
    print(f"{'':15} {'median us':>10} {'p99 us':>8} {f'per round of {args.engines} ms':>20}")
    for name, durations in runs.items():
        durations.sort()
        median = statistics.median(durations)
        p99 = durations[max(0, int(len(durations) * 0.99) - 1)]
        print(f"{name:15} {median * 1e6:>10.0f} {p99 * 1e6:>8.0f} "
              f"{median * args.engines * 1e3:>20.1f}")
    whole = statistics.median(runs["whole body"])
    reduced = statistics.median(runs["reduce + parse"])
    print(f"whole body / reduce + parse (median): {whole / reduced:.1f}x")


if __name__ == "__main__":
    main()
