"""The simulated engine core: a scheduler with a slot limit that takes steps.

Owns: the simulated scheduler: waiting, running, steps.
Must not: do I/O or read a clock (the server steps it).

No I/O and no clock: the server's loop calls :meth:`EngineCore.step` at the configured rate and
passes the time in. What a step does follows vLLM's V1 scheduler closely enough for a watchdog
to be fooled the same ways:

* each step has a token budget (``max_num_batched_tokens``): running decodes first, one
  ``tokens_per_step`` each, then prompt prefill in chunks with what is left — so a long prompt
  takes several steps that produce **no output token** while the step count still advances
  (note 002's lesson: judge steps, not tokens);
* requests wait (``num_requests_waiting``) until one of ``slots`` frees, then run (vLLM
  counts a request as running only once the step's budget reaches it; here it holds its slot
  from then on, the gauge the watchdog's tests of a slot-bound batch are written against);
* a prefix cache is looked up when a request's prefill first gets some of a step's budget,
  which goes in arrival order, and caches a prompt's blocks as their chunk is scheduled (vLLM's
  ``allocate_slots``), so a request scheduled after another in the same step finds that step's
  chunk, never a chunk not scheduled yet;
* the step that completes a prompt's prefill samples its first token and only then counts its
  prompt tokens (``vllm:prompt_tokens_total``), as vLLM's iteration stats do;
* a request finishes with reason ``length`` once it has ``max_tokens`` tokens; an aborted one
  (client gone) leaves without counting as a success;
* an engine with nothing to do takes no steps: every counter stays flat while idle.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from fleetwarden.sim.dialects import Families
from fleetwarden.sim.prefix_cache import PrefixCache
from fleetwarden.sim.sampling import Generation
from fleetwarden.sim.weights import DEFAULT_VERSION


@dataclass(eq=False)
class SimRequest:
    """One generation inside the engine."""

    id: str
    prompt_tokens: int
    max_tokens: int
    arrived_at: float
    #: Picks this request's output tokens (deterministic, so tests can compare texts) and may
    #: stop it before ``max_tokens`` (EOS, a stop token, a stop string:
    #: :mod:`fleetwarden.sim.sampling`).
    generation: Generation = field(repr=False)
    computed: int = 0  # prompt tokens prefilled so far
    output: list[int] = field(default_factory=list)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finish_reason: str | None = None
    #: The prompt's token ids, for the prefix cache (empty: the request finds nothing there).
    prompt_ids: Sequence[int] = field(repr=False, default=())
    #: Prompt tokens the prefix cache held when it was scheduled (vLLM's cached tokens).
    cached: int = 0
    #: The engine's step count when the request arrived, and the number of the step that
    #: sampled its first token: their difference is the steps it took to its first token
    #: (a bench's breakdown of TTFT: queueing, prefill chunks, the step boundary).
    arrival_step: int = 0
    first_token_step: int | None = None
    #: Whether its prompt was looked up in the prefix cache yet (when its prefill first gets
    #: some of a step's budget, as vLLM schedules it).
    looked_up: bool = False
    #: Where each weight version began in the output: (version, index of its first token), a
    #: new entry only when the version changes (vLLM's ``track_weight_version``).
    version_starts: list[tuple[str, int]] = field(default_factory=list)

    def weight_versions(self) -> list[dict[str, object]]:
        """The output's spans as vLLM's ``WeightVersionSpan``: tokens ``[start, end)`` were
        sampled by the weights labelled ``version``."""
        starts = self.version_starts
        ends = [start for _, start in starts[1:]] + [len(self.output)]
        return [{"version": v, "start": s, "end": e} for (v, s), e in zip(starts, ends,
                                                                          strict=True)]

    @property
    def prefilled(self) -> bool:
        return self.computed >= self.prompt_tokens

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.output)


@dataclass(frozen=True, slots=True)
class StepResult:
    #: Output tokens each request produced in this step, in the order they were scheduled.
    produced: list[tuple[SimRequest, list[int]]]
    finished: list[SimRequest]
    scheduled_tokens: int


class EngineCore:
    def __init__(self, families: Families, *, slots: int, tokens_per_step: int,
                 max_num_batched_tokens: int, prefix_cache: PrefixCache | None = None) -> None:
        if slots < 1 or tokens_per_step < 1 or max_num_batched_tokens < 1:
            raise ValueError("slots, tokens_per_step and max_num_batched_tokens must be >= 1")
        self.families = families
        self.slots = slots
        self.tokens_per_step = tokens_per_step
        self.budget = max_num_batched_tokens
        #: KV blocks kept after their requests, whose hits shorten a prefill (None: no cache).
        self.prefix_cache = prefix_cache
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        #: The label of the weights loaded now, attached to every token a step samples (vLLM's
        #: EngineCore stamps its outputs with it; ``"default"`` until someone sets one).
        self.weight_version = DEFAULT_VERSION
        self.steps = 0
        self._last_step_at: float | None = None
        self._publish()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: SimRequest) -> None:
        request.arrival_step = self.steps
        self.waiting.append(request)
        self._publish()

    def abort(self, request: SimRequest) -> bool:
        """The client went away: drop the request (vLLM aborts it; no success is counted)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            return False
        request.finish_reason = "abort"
        self._publish()
        return True

    def step(self, now: float) -> StepResult:
        f = self.families
        while self.waiting and len(self.running) < self.slots:
            r = self.waiting.popleft()
            r.scheduled_at = now
            f.on_scheduled(now - r.arrived_at)
            self.running.append(r)

        budget = self.budget
        produced: list[tuple[SimRequest, list[int]]] = []
        for r in self.running:  # decodes first, as vLLM's scheduler serves running requests
            if r.prefilled and budget > 0:
                n = min(self.tokens_per_step, r.remaining, budget)
                budget -= n
                produced.append((r, _sample(r, n)))
        for r in self.running:  # then prefill, in chunks of what the budget has left
            if not r.looked_up:
                cache = self.prefix_cache
                if cache is not None and r.prompt_ids:
                    if budget <= 0:
                        continue  # looked up when the budget reaches it, as vLLM schedules
                    # It finds the blocks of every request scheduled before it, in this step
                    # too (vLLM caches a block as its chunk is scheduled), and no other.
                    r.cached = r.computed = cache.lookup(r.prompt_ids)
                r.looked_up = True
                f.on_prefix_cache(r.prompt_tokens, r.cached)
            if not r.prefilled and budget > 0:
                budget = self._prefill(r, budget, now, produced)
        scheduled = self.budget - budget

        step_s = 0.0 if self._last_step_at is None else now - self._last_step_at
        self._last_step_at = now
        self.steps += 1
        finished: list[SimRequest] = []
        generated = 0
        for r, tokens in produced:
            version = self.weight_version
            if tokens and (not r.version_starts or r.version_starts[-1][0] != version):
                r.version_starts.append((version, len(r.output)))
            r.output.extend(tokens)
            generated += len(tokens)
            if r.remaining <= 0 or r.generation.finish_reason is not None:
                r.finish_reason = r.generation.finish_reason or "length"
                finished.append(r)
        f.on_step(scheduled, generated, step_s)
        for r in finished:
            self.running.remove(r)
            if self.prefix_cache is not None and r.prompt_ids:
                # vLLM caches every full block it computed, the output's too: a conversation's
                # next turn, which re-sends this answer, finds it.
                self.prefix_cache.insert([*r.prompt_ids, *r.output])
            first = r.first_token_at if r.first_token_at is not None else now
            scheduled_at = r.scheduled_at if r.scheduled_at is not None else r.arrived_at
            f.on_finished(reason=r.finish_reason or "length", prompt_tokens=r.prompt_tokens,
                          generated=len(r.output), max_tokens=r.max_tokens,
                          e2e_s=now - r.arrived_at, queued_s=scheduled_at - r.arrived_at,
                          prefill_s=first - scheduled_at, decode_s=now - first)
        self._publish()
        return StepResult(produced, finished, scheduled)

    def _prefill(self, r: SimRequest, budget: int, now: float,
                 produced: list[tuple[SimRequest, list[int]]]) -> int:
        """Schedule the next chunk of ``r``'s prompt out of ``budget``; what is left of it."""
        chunk = min(budget, r.prompt_tokens - r.computed)
        r.computed += chunk
        if self.prefix_cache is not None and r.prompt_ids:
            # vLLM caches the full blocks of the tokens scheduled so far, and no more: a request
            # scheduled after this one finds them; one whose prefix is not scheduled yet (a
            # later chunk) does not, however soon it comes.
            self.prefix_cache.insert(r.prompt_ids[:r.computed])
        if r.prefilled:  # the step that completes the prompt samples its first token
            r.first_token_at = now
            r.first_token_step = self.steps + 1
            self.families.on_prefilled(r.prompt_tokens, now - r.arrived_at)
            produced.append((r, _sample(r, 1)))
        return budget - chunk

    def publish(self) -> None:
        """Write the queues into the gauges again (after a sleep showed them empty)."""
        self._publish()

    def _publish(self) -> None:
        kv = sum(r.computed + len(r.output) for r in self.running)
        self.families.on_queues(len(self.running), len(self.waiting), kv)


def _sample(r: SimRequest, n: int) -> list[int]:
    """Up to ``n`` next tokens of ``r``: fewer where its generation stops on one."""
    tokens = []
    for _ in range(n):
        token = r.generation.sample()
        if token is None:
            break
        tokens.append(token)
        if r.generation.finish_reason is not None:
            break
    return tokens
