"""The fleet's measure of its own work: how long its tick, reads and pushes take.

Owns: :class:`WorkMeter` (what the controller measured of its own work, kept as bounded series
and running totals) and :class:`Series` (one such measure: recent values for quantiles, and a
Prometheus-style histogram since start).
Must not: read a clock or do I/O: the controller measures and hands the figures in
(``controller.py``, ``reads.py``, ``pushes.py``); ``admin/work.py`` exports them, the journal
keeps their summary.

An operator sees a fleet approach its limit here before its engines see it: a tick that takes
longer than ``probe_interval_s`` delays every verdict; a read round that takes most of the tick
leaves no room for a slow engine; evidence that waits long for its decision is time a bad
engine keeps its requests (docs/design.md, "A fleet at scale").
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DURATION_BUCKETS_S", "RECENT", "SIZE_BUCKETS", "Series", "WorkMeter"]

#: Buckets for durations, in seconds: a tick's own work is milliseconds on a small fleet; a
#: read round at a thousand engines, or a read that times out, is seconds.
DURATION_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)
#: Buckets for counts of things (a push's URLs, a round's reads): up to a few thousand engines.
SIZE_BUCKETS: tuple[float, ...] = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096)
#: Values kept per series for its quantiles: the last ten minutes of 1 s ticks; older values
#: live on only in the histogram.
RECENT = 600


@dataclass(slots=True)
class Series:
    """One measure: the last :data:`RECENT` values, and every value since start counted into
    ``buckets`` (cumulative only when exported)."""

    bounds: tuple[float, ...] = DURATION_BUCKETS_S
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    counts: list[int] = field(default_factory=list)
    count: int = 0
    total: float = 0.0
    largest: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound

    def observe(self, value: float) -> None:
        if value < 0 or value != value:  # a clock that went back, or a NaN: not a measure
            raise ValueError(f"a measure is a number >= 0, got {value!r}")
        self.recent.append(value)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value
        self.largest = max(self.largest, value)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile of the recent values (nearest rank); None before the first."""
        if not self.recent:
            return None
        ordered = sorted(self.recent)
        rank = max(0, min(len(ordered) - 1, int(q * len(ordered) + 0.5) - 1))
        return ordered[rank]

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus histogram buckets: (``le``, values at or below it), ``+Inf`` last."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((repr(float(bound)), running))
        out.append(("+Inf", self.count))
        return out

    def summary(self) -> dict[str, Any]:
        p50, p99 = self.quantile(0.5), self.quantile(0.99)
        return {"count": self.count, "p50": _round(p50), "p99": _round(p99),
                "max": _round(self.largest if self.count else None),
                "mean": _round(self.total / self.count if self.count else None)}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


class WorkMeter:
    """What the controller measured of its own work. Every figure comes in as an argument.

    * ``tick``: seconds from a tick's start to its end (reads, supervisor, drains, push,
      rescue);
    * ``read_round``: seconds the tick's watchdog round took, and ``reads`` how many engines
      it read (``reads_per_s``: reads over the time the recent rounds spanned);
    * ``evidence_to_decision``: seconds from a piece of evidence being in hand (a read
      finished, a router's failed attempt reported) to the ledger having decided on it;
    * ``push`` and ``push_size``: seconds a push to every router took, and its URLs.
    """

    def __init__(self) -> None:
        self.tick = Series()
        self.read_round = Series()
        self.round_reads = Series(SIZE_BUCKETS)
        self.evidence_to_decision = Series()
        self.push = Series()
        self.push_size = Series(SIZE_BUCKETS)
        self.reads = 0
        #: (when a round ended, its reads) for the recent rounds: reads per second of wall time.
        self._rounds: deque[tuple[float, int]] = deque(maxlen=RECENT)

    def tick_done(self, duration_s: float) -> None:
        self.tick.observe(duration_s)

    def round_done(self, ended_at: float, duration_s: float, reads: int) -> None:
        self.read_round.observe(duration_s)
        self.round_reads.observe(reads)
        self.reads += reads
        self._rounds.append((ended_at, reads))

    def decided(self, waited_s: float) -> None:
        self.evidence_to_decision.observe(waited_s)

    def pushed(self, duration_s: float, urls: int) -> None:
        self.push.observe(duration_s)
        self.push_size.observe(urls)

    def reads_per_s(self) -> float | None:
        """Reads per second of wall time over the recent rounds: every round's reads but the
        first's, over the time from the first's end to the last's. None before two rounds."""
        if len(self._rounds) < 2:
            return None
        span = self._rounds[-1][0] - self._rounds[0][0]
        if span <= 0:
            return None
        return sum(n for _, n in list(self._rounds)[1:]) / span

    def summary(self) -> dict[str, Any]:
        """Every measure's count, p50, p99, max and mean (seconds; sizes for push_size)."""
        rate = self.reads_per_s()
        return {
            "tick_s": self.tick.summary(),
            "read_round_s": self.read_round.summary(),
            "reads": self.reads,
            "reads_per_round": self.round_reads.summary(),
            "reads_per_s": None if rate is None else round(rate, 1),
            "evidence_to_decision_s": self.evidence_to_decision.summary(),
            "push_s": self.push.summary(),
            "push_size": self.push_size.summary(),
        }
