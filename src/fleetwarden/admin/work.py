"""The controller's measure of its own work as Prometheus families (``workmeter.py``).

Owns: :class:`WorkCollector`, read at scrape time from the controller's
:class:`~fleetwarden.workmeter.WorkMeter` (nothing to keep in sync).
Must not: measure anything itself, or act on the fleet.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from fleetwarden.workmeter import Series, WorkMeter

__all__ = ["WorkCollector"]

#: (name, help, the meter's series) of every histogram exported.
_HISTOGRAMS: tuple[tuple[str, str, Callable[[WorkMeter], Series]], ...] = (
    ("fleetwarden_tick_seconds",
     "A controller tick, start to end: the reads' verdicts taken, the supervisor, the routers' "
     "outcomes, the push and the rescue.", lambda m: m.tick),
    ("fleetwarden_read_round_seconds",
     "A read round: every engine with a process read once.", lambda m: m.read_round),
    ("fleetwarden_read_round_reads", "Engines read in one round.", lambda m: m.round_reads),
    ("fleetwarden_evidence_to_decision_seconds",
     "From evidence in hand (a read finished, a router's failed attempt reported) to the "
     "ledger's decision on it.", lambda m: m.evidence_to_decision),
    ("fleetwarden_push_seconds", "A push of the serving set to every router.", lambda m: m.push),
    ("fleetwarden_push_backends", "Backends in one push.", lambda m: m.push_size),
)


class WorkCollector:
    """The fleet's own work: ticks, read rounds, decisions and pushes."""

    def __init__(self, meter: Callable[[], WorkMeter | None]) -> None:
        self._meter = meter

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        meter = self._meter()
        if meter is None:  # not started yet
            return []
        out: list[Metric] = []
        for name, doc, series_of in _HISTOGRAMS:
            series = series_of(meter)
            family = HistogramMetricFamily(name, doc)
            family.add_metric([], series.cumulative(), series.total)
            out.append(family)
        reads = CounterMetricFamily("fleetwarden_engine_reads",
                                    "Engine reads done by the read rounds since start.")
        reads.add_metric([], meter.reads)
        out.append(reads)
        rate = meter.reads_per_s()
        if rate is not None:
            per_s = GaugeMetricFamily("fleetwarden_engine_reads_per_second",
                                      "Engine reads per second of wall time, recent rounds.")
            per_s.add_metric([], rate)
            out.append(per_s)
        return out
