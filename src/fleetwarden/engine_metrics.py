"""An engine's ``/metrics`` text → a small :class:`Sample` of what the judge reads (pure).

Owns: an engine's ``/metrics`` text turned into a :class:`Sample` (reduce, then parse, never
raise).
Must not: do I/O or read a clock (pure), or judge what a sample means (``judge.py``).

Which families are read, and which :class:`Sample` field each fills, is the engine's profile
(:mod:`fleetwarden.engines`): vLLM by default; llama.cpp, SGLang and TGI by name or by
:func:`fleetwarden.engines.detect`.

Two rules:

* **Reduce, then parse.** A real vLLM 0.32 body is ~52 KB, ~630 lines, 92 families; the judge
  reads 9 of them, and 2 more give the prefix cache's hit rate. prometheus-client's text parser
  takes ~10 ms for the whole body and well under 1 ms for the lines of those 9 families
  (``bench/metrics_parse.py``). So :func:`reduce` first
  cuts the text down to the ``# TYPE`` line and the exactly-named sample lines of each judged
  family, with plain string searches, and only that is parsed.
* **Never raise.** Whatever arrives — garbage, a truncated read, a body of any size — the answer
  is a :class:`Sample` or an :class:`Unreadable` naming why. The watchdog turns the latter into
  a ``NO_METRICS`` verdict; nothing here can take a watchdog round down.

Parser pitfalls this module is written around (docs/design.md section 5): counter families lose
``_total`` in their family name, so samples are matched by their exact *sample* name, never by a
family name or a prefix; ``_created`` samples come as families of their own; parse errors
surface while iterating, not at the call; and the OpenMetrics parser rejects vLLM's output even
though its content type says ``version=1.0.0`` — the plain text parser is the one to use.

Every family is summed over its labels (``engine`` for data-parallel engines,
``finished_reason`` for finished requests).

Keep in sync: :data:`fleetwarden.engines.PROFILES`, the fields of :class:`Sample`, and
docs/design.md section 5.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from prometheus_client.parser import text_string_to_metric_families

from fleetwarden.engines import VLLM, EngineProfile, Family

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


#: The families read from vLLM (the default profile), keyed by the name in their ``# TYPE``
#: line. Every profile's table is in :mod:`fleetwarden.engines`.
JUDGED: Mapping[str, Family] = VLLM.families

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
    #: Which process answered, compared between reads only: vLLM's
    #: ``process_start_time_seconds``; llama.cpp's ``Process-Start-Time-Unix`` header (no time).
    start_time: float | None = None
    #: ``vllm:engine_sleep_state``: 0 awake, 1 weights offloaded, 2 everything discarded;
    #: ``None`` when the engine does not export it.
    sleep_level: int | None = None
    #: vLLM's prefix cache, in prompt tokens looked up and found (0 where not exported): the
    #: engine's actual hit rate, beside the cache-aware router's predicted one. Not part of
    #: the work fingerprint (:attr:`COUNTERS`): a lookup is not progress.
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0

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

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens found in the prefix cache over those looked up, since the process
        started; ``None`` before any lookup or where the engine does not count them."""
        if not self.prefix_cache_queries:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

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


def reduce(text: str, profile: EngineProfile = VLLM) -> str:
    """Only the ``# TYPE`` line and the exactly-named sample lines of each judged family.

    A family's block runs from its ``# TYPE`` line to the next comment line (vLLM writes
    ``# HELP`` before ``# TYPE``, and every family's samples together, as the format requires).
    A family that is absent, or whose samples are not in its block, is left out; :func:`parse`
    then reports it missing. Plain ``str.find`` over the body: no regex, no split of the whole
    text, so the cost is a few scans of memory, not one Python step per line.
    """
    kept: list[str] = []
    for name, family in profile.families.items():
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
        sample = family.line
        cut = len(sample)
        for line in lines[1:]:
            if line.startswith(sample) and line[cut : cut + 1] in ("{", " ", "\t"):
                kept.append(line)
    return "\n".join(kept) + "\n"


def parse(body: str | bytes, *, max_bytes: int = MAX_BODY_BYTES,
          profile: EngineProfile = VLLM, start_header: str | None = None) -> Sample | Unreadable:
    """Read a ``/metrics`` body as ``profile`` names it. Never raises: garbage is an
    :class:`Unreadable`.

    ``start_header`` is the value of the profile's start header (llama.cpp's
    ``Process-Start-Time-Unix``), when it has one: it becomes ``start_time``, to be compared
    between reads and never read as a time.
    """
    if not profile.has_metrics:
        return Unreadable(f"the {profile.name} profile reads no /metrics")
    if len(body) > max_bytes:
        return Unreadable(f"body of {len(body)} bytes is over the {max_bytes}-byte limit")
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    by_sample = {f.sample: f for f in profile.families.values()}
    # prometheus-client's name for each family after parsing: counters lose ``_total``.
    parsed_family = {f.sample: name.removesuffix("_total") if f.type == "counter" else name
                     for name, f in profile.families.items()}
    totals: dict[str, float] = {}
    sleep_states: dict[str, list[float]] = {}
    try:
        # The parser raises while iterating, and not only ValueError (IndexError, KeyError and
        # TypeError come out of malformed lines too); any of them means "not a metrics body".
        for family in text_string_to_metric_families(reduce(text, profile)):
            for s in family.samples:
                judged = by_sample.get(s.name)
                if judged is None or family.name != parsed_family[s.name]:
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
    missing = [f.line for f in profile.families.values() if f.required and f.sample not in totals]
    if missing:
        return Unreadable("lacks " + ", ".join(missing))
    values = {f.field: totals[f.sample] for f in profile.families.values() if f.sample in totals}
    start_time = values.get("start_time")
    if start_header is not None:
        start_time = _header_number(start_header)
    return Sample(
        running=values["running"],
        waiting=values["waiting"],
        steps=values["steps"],
        generation_tokens=values.get("generation_tokens", 0.0),
        prompt_tokens=values.get("prompt_tokens", 0.0),
        preemptions=values.get("preemptions", 0.0),
        finished_requests=values.get("finished_requests", 0.0),
        start_time=start_time,
        sleep_level=_sleep_level(sleep_states),
        prefix_cache_queries=values.get("prefix_cache_queries", 0.0),
        prefix_cache_hits=values.get("prefix_cache_hits", 0.0),
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


def _header_number(value: str) -> float | None:
    """A start header's value as a number to compare (``None`` when it is not one)."""
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) else None
