"""Request traces in Mooncake's JSONL format, generated seeded from the published traces' shape.

Owns: the shape of a generated trace, its records, reading and writing them, and the prompt
text a record stands for.
Must not: send anything, or read a clock (the replay drivers do: ``testing.replay``,
``bench/replay.py``).

A record is one request, as in the Mooncake FAST'25 release (``mooncake_trace.jsonl``) and as
AIPerf's ``mooncake_trace`` loader reads it: ``timestamp`` (ms after the trace's start),
``input_length`` and ``output_length`` (tokens), ``hash_ids`` (one id per ``block_tokens`` of
the prompt, the last block possibly partial; two prompts that share leading ids share that
prefix), plus ``session_id`` (the conversation it belongs to). No public trace file ships in a
package registry (the Mooncake release and BurstGPT's CSVs are on GitHub only; ``mooncake`` on
PyPI is an unrelated package), so a trace is generated here from the published shape. Every
parameter of :class:`TraceShape` says where its value comes from: a figure the trace's paper or
release publishes ("published"), or a value of ours inside the published shape, scaled to this
project's small machines ("ours"):

- Mooncake: Qin et al., "Mooncake: Trading More Storage for Less Computation", FAST'25, and its
  open trace (``FAST25-release/arxiv-trace/mooncake_trace.jsonl``: 23,608 requests over about an
  hour; average input 7,590 tokens, output 182; 512-token blocks; about half of all prompt
  blocks found again in an earlier request with an unbounded cache).
- BurstGPT: Wang et al., "BurstGPT: A Real-World Workload Dataset to Optimize LLM Serving
  Systems" (arXiv 2401.17644): arrivals are bursty, their inter-arrival times fitted by a Gamma
  distribution (burstier than Poisson: coefficient of variation above 1, a shape below 1);
  request and response lengths long-tailed (Zipf); conversations of several turns.

How a trace is built: sessions start by a Gamma renewal process; each session has a geometric
number of turns, separated by exponential think times. A session's first prompt opens, with
probability ``shared_prefix_p``, with one of ``prefix_groups`` shared prefixes (a system prompt
or a document), picked by Zipf popularity; a later turn re-sends the conversation so far (the
previous prompt's full blocks and the previous answer's), then new text. That is where the
prefix reuse comes from, and :func:`reuse_ratio` measures it on the result.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["CONTEXT_HEADROOM", "TraceRecord", "TraceShape", "fit_context", "generate",
           "prompt_text", "read_jsonl", "reuse_ratio", "write_jsonl"]


@dataclass(frozen=True, slots=True)
class TraceShape:
    """What a generated trace looks like; each default's source is beside it."""

    #: Requests in the trace. Ours: a short run on 2 cores (the Mooncake trace has 23,608).
    requests: int = 240
    #: Mean arrival rate, requests per second. Ours: what 4 simulated engines on 2 cores serve
    #: with room to lose one (the Mooncake trace averages 23,608 / 3,600 s = 6.6/s on a cluster).
    rate_per_s: float = 3.0
    #: Shape of the Gamma distribution of the sessions' inter-arrival times. Published shape
    #: (BurstGPT: Gamma-fitted, burstier than Poisson); the value 0.5 (coefficient of variation
    #: 1.41) is ours.
    burst_shape: float = 0.5
    #: Tokens per hash id. Published 512 (Mooncake), scaled by 1/8 with the lengths below.
    block_tokens: int = 64
    #: Mean prompt length, tokens. Published 7,590 (Mooncake), scaled by 1/8.
    input_mean: float = 950.0
    #: Spread of the log-normal prompt lengths (a long tail: BurstGPT's Zipf-like request
    #: lengths). Ours.
    input_sigma: float = 0.8
    #: Longest prompt, tokens. Ours: within a simulated engine's context.
    input_max: int = 3072
    #: Mean answer length, tokens. Published 182 (Mooncake), scaled by 1/4 (the simulated
    #: engines decode 50 tokens a second).
    output_mean: float = 45.0
    #: Spread of the log-normal answer lengths. Ours (BurstGPT's response lengths: long-tailed).
    output_sigma: float = 0.7
    output_max: int = 400
    #: Shortest answer, tokens. Ours: 1 (any); a real tiny model's text for one or two tokens
    #: may be empty (a piece of a character), which a load generator counts as no answer.
    output_min: int = 1
    #: Mean turns per session (geometric). Ours, inside BurstGPT's conversation logs' shape
    #: (most conversations a few turns, a long tail).
    turns_mean: float = 2.5
    #: Mean think time between a session's turns, seconds (exponential). Ours, scaled to a
    #: run of about a minute.
    think_mean_s: float = 4.0
    #: Shared prefixes (system prompts, documents) and how often a session opens with one;
    #: their popularity is Zipf(``prefix_zipf``). Ours, set so that :func:`reuse_ratio` comes
    #: out near Mooncake's published one-half of blocks found again.
    prefix_groups: int = 8
    prefix_blocks: tuple[int, int] = (4, 10)
    shared_prefix_p: float = 0.6
    prefix_zipf: float = 1.1
    #: New text a later turn adds after the conversation so far, in blocks. Ours.
    new_turn_blocks: tuple[int, int] = (1, 6)

    def __post_init__(self) -> None:
        positive = ("requests", "rate_per_s", "burst_shape", "block_tokens", "input_mean",
                    "input_max", "output_mean", "output_max", "output_min", "turns_mean",
                    "think_mean_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"trace shape: {name} must be > 0, got {getattr(self, name)}")
        if self.turns_mean < 1:
            raise ValueError(f"trace shape: turns_mean must be >= 1, got {self.turns_mean}")
        if not 0 <= self.shared_prefix_p <= 1:
            raise ValueError(f"trace shape: shared_prefix_p must be in [0, 1], got "
                             f"{self.shared_prefix_p}")
        for name in ("prefix_blocks", "new_turn_blocks"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"trace shape: {name} must be (lo, hi) with 1 <= lo <= hi, "
                                 f"got {(lo, hi)}")


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace, Mooncake's fields plus its session."""

    timestamp: int  # ms after the trace's start
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str = ""
    #: The turn within its session (0: the first). Not a Mooncake field: written as it is.
    turn: int = 0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["hash_ids"] = list(self.hash_ids)
        return out


#: The share of an engine's context a fitted trace's longest prompt plus longest answer may
#: take: a load generator builds each prompt from text in the model's tokenizer, and the engine
#: counts it again, a few tokens off (a start-of-text token, merges across block edges).
CONTEXT_HEADROOM = 0.9


def fit_context(shape: TraceShape, max_model_len: int,
                headroom: float = CONTEXT_HEADROOM) -> TraceShape:
    """``shape`` with every length (the prompts' and answers' means and caps, the block size)
    times one factor, so that its longest prompt plus its longest answer fit in ``headroom`` of
    an engine's context of ``max_model_len`` tokens; the trace keeps its proportions and its
    reuse. Unchanged when it fits already."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    budget = int(max_model_len * headroom)
    need = shape.input_max + shape.output_max
    if need <= budget:
        return shape
    f = budget / need
    return dataclasses.replace(
        shape, block_tokens=max(1, round(shape.block_tokens * f)),
        input_mean=max(1.0, shape.input_mean * f), input_max=max(1, int(shape.input_max * f)),
        output_mean=max(1.0, shape.output_mean * f),
        output_max=max(1, int(shape.output_max * f)))


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    """A log-normal draw with this mean (not median): mu = ln(mean) - sigma^2 / 2."""
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def _zipf_pick(rng: random.Random, n: int, s: float) -> int:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights=weights)[0]


def generate(shape: TraceShape, seed: int) -> list[TraceRecord]:
    """A trace of ``shape.requests`` requests, the same for the same shape and seed."""
    rng = random.Random(seed)
    next_id = 0

    def new_blocks(n: int) -> list[int]:
        nonlocal next_id
        out = list(range(next_id, next_id + n))
        next_id += n
        return out

    groups = [new_blocks(rng.randint(*shape.prefix_blocks)) for _ in range(shape.prefix_groups)]
    # Sessions arrive at rate / turns_mean; Gamma(k, theta) has mean k * theta.
    session_rate = shape.rate_per_s / shape.turns_mean
    theta = 1.0 / (session_rate * shape.burst_shape)
    bt = shape.block_tokens
    records: list[TraceRecord] = []
    start_s, session = 0.0, 0
    # Enough sessions to fill the trace once they are merged by time; cut to ``requests``.
    while len(records) < 4 * shape.requests:
        turns = 1
        while rng.random() > 1.0 / shape.turns_mean:
            turns += 1
        at = start_s
        context: list[int] = []  # the full blocks of the conversation so far
        for turn in range(turns):
            if turn == 0:
                prefix = (list(groups[_zipf_pick(rng, len(groups), shape.prefix_zipf)])
                          if rng.random() < shape.shared_prefix_p else [])
                want = max(len(prefix) * bt + 1, round(_lognormal(rng, shape.input_mean,
                                                                  shape.input_sigma)))
            else:
                prefix = context
                want = len(prefix) * bt + rng.randint(*shape.new_turn_blocks) * bt - \
                    rng.randrange(bt)
            want = min(want, shape.input_max)
            if len(prefix) * bt >= want:  # a conversation grown past input_max starts over
                prefix = []
            blocks = -(-want // bt)
            hash_ids = prefix + new_blocks(blocks - len(prefix))
            output = max(shape.output_min, min(shape.output_max,
                                round(_lognormal(rng, shape.output_mean, shape.output_sigma))))
            records.append(TraceRecord(round(at * 1000), want, output, tuple(hash_ids),
                                       f"s{session}", turn))
            full = hash_ids[: want // bt]
            context = full + new_blocks(output // bt)
            at += rng.expovariate(1.0 / shape.think_mean_s)
        session += 1
        start_s += rng.gammavariate(shape.burst_shape, theta)
    records.sort(key=lambda r: (r.timestamp, r.session_id, r.turn))
    return records[: shape.requests]


def reuse_ratio(records: Iterable[TraceRecord]) -> float:
    """Share of all prompt blocks whose hash id appeared in an earlier request of the trace
    (Mooncake's "reusable with an unbounded cache"); 0.0 for an empty trace."""
    seen: set[int] = set()
    total = reused = 0
    for r in sorted(records, key=lambda r: r.timestamp):
        for h in r.hash_ids:
            total += 1
            reused += h in seen
        seen.update(r.hash_ids)
    return reused / total if total else 0.0


def _block_text(hash_id: int, size: int) -> str:
    """``size`` characters of text that stand for block ``hash_id`` (ASCII: one byte each)."""
    out = ""
    n = 0
    while len(out) < size:
        out += hashlib.blake2b(f"{hash_id}:{n}".encode(), digest_size=32).hexdigest()
        n += 1
    return out[:size]


def prompt_text(record: TraceRecord, block_tokens: int) -> str:
    """The prompt a record stands for, one ASCII character per token (the simulated engine's
    tokenizer): each hash id ``block_tokens`` characters of its own, the last block cut to
    ``input_length``. Two records that share leading hash ids share that prefix exactly."""
    text = "".join(_block_text(h, block_tokens) for h in record.hash_ids)
    return text[: record.input_length]


def write_jsonl(records: Sequence[TraceRecord], path: Path) -> None:
    path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))


def read_jsonl(path: Path) -> list[TraceRecord]:
    """A Mooncake trace file; a line without a field it needs is an error naming it."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        data = json.loads(line)
        for name in ("timestamp", "input_length", "output_length"):
            if not isinstance(data.get(name), int | float):
                raise ValueError(f"{path}:{n}: {name} must be a number, got {data.get(name)!r}")
        out.append(TraceRecord(int(data["timestamp"]), int(data["input_length"]),
                               int(data["output_length"]), tuple(data.get("hash_ids", ())),
                               str(data.get("session_id", "")), int(data.get("turn", 0))))
    return out
