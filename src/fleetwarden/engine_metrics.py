"""vLLM's ``/metrics`` text → a small :class:`Sample` of what the judge reads (pure).

Two rules:

* **Reduce, then parse.** A real vLLM 0.32 body is ~52 KB, ~630 lines, 92 families; the judge
  reads 9 of them. prometheus-client's text parser takes ~10 ms for the whole body and well under
  1 ms for the lines of those 9 families (``bench/metrics_parse.py``). So :func:`reduce` first
  cuts the text down to the ``# TYPE`` line and the exactly-named sample lines of each judged
  family, with plain string searches, and only that is parsed.
* **Never raise.** Whatever arrives — garbage, a truncated read, a body of any size — the answer
  is a :class:`Sample` or an :class:`Unreadable` naming why. The watchdog turns the latter into
  a ``NO_METRICS`` verdict; nothing here can take a watchdog round down.

Parser pitfalls this module is written around (SYSTEM.md section 5): counter families lose
``_total`` in their family name, so samples are matched by their exact *sample* name, never by a
family name or a prefix; ``_created`` samples come as families of their own; parse errors
surface while iterating, not at the call; and the OpenMetrics parser rejects vLLM's output even
though its content type says ``version=1.0.0`` — the plain text parser is the one to use.

Every family is summed over its labels (``engine`` for data-parallel engines,
``finished_reason`` for finished requests).

Keep in sync: :data:`JUDGED`, the fields of :class:`Sample`, and SYSTEM.md section 5.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "JUDGED",
    "MAX_BODY_BYTES",
    "Family",
    "Sample",
    "Unreadable",
    "parse",
    "reduce",
]

#: The largest body :func:`parse` accepts. A real body is ~52 KB for one engine; data-parallel
#: engines and LoRA adapters multiply the series of some families, not by 80. Anything larger is
#: not vLLM's ``/metrics`` (or is a runaway exporter) and is refused unread.
MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Family:
    """One family the judge reads: as its ``# TYPE`` line names it, and the sample it sums."""

    type: str  # the family's type in the ``# TYPE`` line
    sample: str  # the exact sample name whose values are summed
    field: str  # the :class:`Sample` field it fills
    required: bool  # without it there is no verdict (NO_METRICS); optional ones default to 0


# fmt: off
#: The families the judge reads, keyed by the name in their ``# TYPE`` line. Note the histogram
#: ``vllm:iteration_tokens_total``: its family name ends in ``_total`` but it is no counter; its
#: ``_count`` advances once per engine step — also while a long prompt is read and no output
#: token appears (note 002: count steps, not tokens).
JUDGED: Mapping[str, Family] = {
    "vllm:num_requests_running":   Family("gauge", "vllm:num_requests_running", "running", True),
    "vllm:num_requests_waiting":   Family("gauge", "vllm:num_requests_waiting", "waiting", True),
    "vllm:iteration_tokens_total": Family("histogram", "vllm:iteration_tokens_total_count",
                                          "steps", True),
    "vllm:generation_tokens_total": Family("counter", "vllm:generation_tokens_total",
                                           "generation_tokens", True),
    "vllm:prompt_tokens_total":    Family("counter", "vllm:prompt_tokens_total",
                                          "prompt_tokens", False),
    "vllm:num_preemptions_total":  Family("counter", "vllm:num_preemptions_total",
                                          "preemptions", False),
    "vllm:request_success_total":  Family("counter", "vllm:request_success_total",
                                          "finished_requests", False),
    "process_start_time_seconds":  Family("gauge", "process_start_time_seconds",
                                          "start_time", False),
    # vLLM 0.32's sleep mode, one series per ``sleep_state`` label: ``awake`` 0 while asleep,
    # ``weights_offloaded`` 1 at level 1, ``discard_all`` 1 at level 2 (read per label, never
    # summed: see :func:`_sleep_level`). Older engines lack it: the level is then unknown.
    "vllm:engine_sleep_state":     Family("gauge", "vllm:engine_sleep_state", "sleep_level",
                                          False),
}
# fmt: on

_BY_SAMPLE: Mapping[str, Family] = {f.sample: f for f in JUDGED.values()}
#: prometheus-client's name for each family after parsing: counters lose ``_total``.
_PARSED_FAMILY: Mapping[str, str] = {
    f.sample: name.removesuffix("_total") if f.type == "counter" else name
    for name, f in JUDGED.items()
}


@dataclass(frozen=True, slots=True)
class Sample:
    """What one read of ``/metrics`` says about an engine, summed over its labels."""

    running: float  # requests in the engine's running batch (a gauge)
    waiting: float  # requests queued in the engine, not yet scheduled (a gauge)
    steps: float  # engine steps taken: ``vllm:iteration_tokens_total_count``
    generation_tokens: float  # output tokens produced
    prompt_tokens: float = 0.0  # prompt tokens whose prefill completed
    preemptions: float = 0.0
    finished_requests: float = 0.0  # every ``finished_reason``
    start_time: float | None = None  # ``process_start_time_seconds``: which process answered
    #: ``vllm:engine_sleep_state``: 0 awake, 1 weights offloaded, 2 everything discarded;
    #: ``None`` when the engine does not export it.
    sleep_level: int | None = None

    #: The counters that only grow within one process: the work fingerprint, and steps.
    COUNTERS: ClassVar[tuple[str, ...]] = (
        "steps", "generation_tokens", "prompt_tokens", "preemptions", "finished_requests")

    @property
    def idle(self) -> bool:
        """Nothing running and nothing waiting in the engine."""
        return self.running == 0 and self.waiting == 0

    @property
    def sleeping(self) -> bool:
        """The engine says it is asleep (vLLM's sleep mode): it generates nothing until woken."""
        return self.sleep_level is not None and self.sleep_level > 0

    @property
    def incarnation(self) -> str | None:
        """The process start time as a string: what the ledger stores as the incarnation."""
        return None if self.start_time is None else repr(self.start_time)

    def counters(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.COUNTERS}

    def to_dict(self) -> dict[str, float | None]:
        return {
            "running": self.running,
            "waiting": self.waiting,
            **self.counters(),
            "start_time": self.start_time,
            "sleep_level": self.sleep_level,
        }


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A ``/metrics`` body that yields no :class:`Sample`, and why."""

    reason: str


def reduce(text: str) -> str:
    """Only the ``# TYPE`` line and the exactly-named sample lines of each judged family.

    A family's block runs from its ``# TYPE`` line to the next comment line (vLLM writes
    ``# HELP`` before ``# TYPE``, and every family's samples together, as the format requires).
    A family that is absent, or whose samples are not in its block, is left out; :func:`parse`
    then reports it missing. Plain ``str.find`` over the body: no regex, no split of the whole
    text, so the cost is a few scans of memory, not one Python step per line.
    """
    kept: list[str] = []
    for name, family in JUDGED.items():
        key = f"# TYPE {name} "
        start = 0 if text.startswith(key) else text.find("\n" + key)
        if start < 0:
            continue
        if start:
            start += 1  # past the newline
        end = text.find("\n#", start + len(key))
        block = text[start:] if end < 0 else text[start:end]
        lines = block.split("\n")
        kept.append(lines[0])
        sample = family.sample
        cut = len(sample)
        for line in lines[1:]:
            if line.startswith(sample) and line[cut : cut + 1] in ("{", " ", "\t"):
                kept.append(line)
    return "\n".join(kept) + "\n"


def parse(body: str | bytes, *, max_bytes: int = MAX_BODY_BYTES) -> Sample | Unreadable:
    """Read a ``/metrics`` body. Never raises: garbage is an :class:`Unreadable`."""
    if len(body) > max_bytes:
        return Unreadable(f"body of {len(body)} bytes is over the {max_bytes}-byte limit")
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    totals: dict[str, float] = {}
    sleep_states: dict[str, list[float]] = {}
    try:
        # The parser raises while iterating, and not only ValueError (IndexError, KeyError and
        # TypeError come out of malformed lines too); any of them means "not a metrics body".
        for family in text_string_to_metric_families(reduce(text)):
            for s in family.samples:
                judged = _BY_SAMPLE.get(s.name)
                if judged is None or family.name != _PARSED_FAMILY[s.name]:
                    continue
                if family.type != judged.type:
                    return Unreadable(f"{s.name} is a {family.type}, not a {judged.type}")
                value = float(s.value)
                if not math.isfinite(value) or value < 0:
                    return Unreadable(f"{s.name} has the value {s.value!r}")
                if judged.field == "sleep_level":
                    sleep_states.setdefault(s.labels.get("sleep_state", ""), []).append(value)
                elif judged.field == "start_time":  # one process answers; take its start
                    totals[s.name] = max(totals.get(s.name, 0.0), value)
                else:
                    totals[s.name] = totals.get(s.name, 0.0) + value
    except Exception as e:  # the contract is "never raise" (see above)
        return Unreadable(f"unparseable: {type(e).__name__}: {e}"[:300])
    missing = [f.sample for f in JUDGED.values() if f.required and f.sample not in totals]
    if missing:
        return Unreadable("lacks " + ", ".join(missing))
    values = {f.field: totals[f.sample] for f in JUDGED.values() if f.sample in totals}
    return Sample(
        running=values["running"],
        waiting=values["waiting"],
        steps=values["steps"],
        generation_tokens=values["generation_tokens"],
        prompt_tokens=values.get("prompt_tokens", 0.0),
        preemptions=values.get("preemptions", 0.0),
        finished_requests=values.get("finished_requests", 0.0),
        start_time=values.get("start_time"),
        sleep_level=_sleep_level(sleep_states),
    )


def _sleep_level(states: Mapping[str, list[float]]) -> int | None:
    """The sleep level from ``vllm:engine_sleep_state``'s series, by ``sleep_state`` label:
    asleep when any engine's ``awake`` is 0 (data-parallel engines sleep together), level 2
    when one says ``discard_all``, else 1. ``None`` without an ``awake`` series."""
    awake = states.get("awake")
    if not awake:
        return None
    if min(awake) > 0:
        return 0
    return 2 if max(states.get("discard_all", [0.0])) > 0 else 1
