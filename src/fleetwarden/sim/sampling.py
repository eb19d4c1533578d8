"""The simulated engine's sampling and output processing, as strict as vLLM 0.32 (no I/O).

Owns: what a generation's parameters mean (defaults, validation), which token comes next, when
a generation stops, and what text each step shows (vLLM's detokenizer hold-back).
Must not: do I/O or read a clock (the server and the engine core drive it).

Each rule is vLLM's, read in its source (``vllm/sampling_params.py``, ``vllm/v1/core/sched/
utils.py`` ``check_stop``, ``vllm/v1/engine/detokenizer.py``, ``serving_chat.py``,
``serving_completion.py``) and checked against the captures in
``tests/fixtures/vllm/defaults-and-stops/``:

* ``max_tokens`` absent: 16 for a completion, the context left (``max_model_len`` less the
  prompt) for a chat; a chat's ``max_completion_tokens`` wins over its ``max_tokens``. In the
  llama.cpp dialect a completion gets a chat's (:data:`_COMPLETION_AS_CHAT`).
* A step's order of checks is the scheduler's: the length cap first, then nothing before
  ``min_tokens`` (the min-tokens logits processor masks EOS and ``stop_token_ids`` there, so
  they are never sampled), then EOS (unless ``ignore_eos``), then ``stop_token_ids``
  (``stop_reason`` the id). A stop token's text is left out unless
  ``include_stop_str_in_output``.
* Stop strings are matched by the detokenizer on the output text, only once more than
  ``min_tokens`` tokens came, and only in the text new since the last check (plus the string's
  length). Unless ``include_stop_str_in_output``, the last ``max(len(stop)) - 1`` characters are
  held back from every chunk while the generation runs: a chunk can carry its new token ids and
  no text. The matched string never reaches the client; ``stop_reason`` is the string.
* Penalties change the next token as a function of the output so far (presence: whether a
  token occurred; frequency: how often), never of the prompt: a generation continued from
  ``prompt + output`` as a prompt forgets them, as vLLM's would.

The model is greedy and deterministic: the next token depends only on the bytes of the context
(and, with penalties, on the output's counts), so an uninterrupted run is the reference any
continuation is compared with. At a ``temperature`` above 0 a token is drawn from the scores'
softmax: with a ``seed``, from one generator seeded at the generation's start, one draw a token
(vLLM's per-request generator: a continuation's draws start again, and differ); without one,
from a draw that is a function of the context alone (vLLM's come from its global generator and
repeat nothing; here a continuation from the same tokens draws the same, so the oracle can
compare a sampled continuation with its uninterrupted run). ``eos_period`` makes the model
end on its own now and then (vLLM's EOS); 0 keeps the simulator's older behaviour of a model
that never does.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fleetwarden.sim import wire

__all__ = ["EOS", "Generation", "Params", "Step", "parse_params"]

#: The end-of-sequence token (a special token: it spells nothing in the output text).
EOS = wire.FIRST_PIECE + len(wire._PIECES)
EOS_TEXT = "</s>"  # its string, as logprobs name it
#: vLLM's completions default when a request has no ``max_tokens``.
COMPLETION_DEFAULT_MAX_TOKENS = 16
#: The dialects whose engines give a completion that names no limit their default, as a chat
#: (llama-server's ``-n``: ``engines.COMPLETION_ENGINE``), not 16.
_COMPLETION_AS_CHAT = frozenset({"llamacpp"})
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
_VOCAB = len(wire._PIECES)


@dataclass(frozen=True, slots=True)
class Params:
    """One request's sampling parameters, validated, with vLLM's defaults applied."""

    max_tokens: int
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: Logprobs per output token (``None``: not asked), and how many alternatives each.
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    #: The chat's reasoning (thinking) is on: its first tokens are reasoning output.
    reasoning: bool = False
    #: Sampling: 0 (or none named: the simulator's greedy model) picks the best token; above
    #: it, a token is drawn from the scores' softmax at that temperature.
    temperature: float = 0.0
    #: vLLM's per-request generator: seeded once at the generation's start, one draw a token.
    seed: int | None = None


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_params(body: Mapping[str, Any], *, chat: bool, prompt_tokens: int,
                 max_model_len: int, reasoning_parser: bool,
                 override_max_new_tokens: int | None = None,
                 default_max_new_tokens: int | None = None,
                 engine: str = "vllm") -> Params | dict[str, Any]:
    """The request's :class:`Params`, or vLLM's 400 body for what it refuses.

    The output limit is vLLM's ``get_max_tokens`` (``entrypoints/serve/utils/api_utils.py``):
    the least of the context left, the request's limit (or, naming none, the generation
    config's ``max_new_tokens``, which ``--override-generation-config`` replaces) and the
    override's ``max_new_tokens``, which caps even a request that names a larger one. A
    completion that names none has pydantic's 16 (a chat's in the ``engine`` dialects of
    :data:`_COMPLETION_AS_CHAT`)."""
    raw = body.get("max_completion_tokens") if chat else None
    if raw is None:
        raw = body.get("max_tokens")
    default = (default_max_new_tokens if override_max_new_tokens is None
               else override_max_new_tokens)
    as_chat = chat or engine in _COMPLETION_AS_CHAT
    if raw is None:
        max_tokens = (max_model_len - prompt_tokens if as_chat
                      else COMPLETION_DEFAULT_MAX_TOKENS)
        if as_chat and default is not None:
            max_tokens = min(max_tokens, default)
    elif not _int(raw) or raw < 1:
        return wire.invalid(f"max_tokens must be at least 1, got {raw!r}.", "max_tokens")
    else:
        max_tokens = raw
    if max_tokens > max_model_len:
        return wire.max_tokens_too_large(max_tokens, max_model_len)
    if prompt_tokens > max_model_len:
        return wire.prompt_too_long(max_model_len)
    if prompt_tokens + max_tokens > max_model_len:
        return wire.context_too_long(max_model_len, prompt_tokens, max_tokens)
    if override_max_new_tokens is not None:
        max_tokens = min(max_tokens, override_max_new_tokens)
    min_tokens = body.get("min_tokens") or 0
    if not _int(min_tokens) or min_tokens < 0:
        return wire.invalid(f"min_tokens must be greater than or equal to 0, got {min_tokens}.",
                            "min_tokens")
    if min_tokens > max_tokens:
        return wire.invalid(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                            f"got {min_tokens}.", "min_tokens")
    stops = _stops(body)
    if isinstance(stops, dict):
        return stops
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_int(t) for t in stop_ids):
        return wire.invalid("stop_token_ids must be a list of integers", "stop_token_ids")
    penalties = []
    for key in ("presence_penalty", "frequency_penalty"):
        value = body.get(key)
        value = 0.0 if value is None else value
        if not _number(value) or not -2.0 <= value <= 2.0:
            return wire.invalid(f"{key} must be in [-2, 2], got {value}.", key)
        penalties.append(float(value))
    n = body.get("n")
    n = 1 if n is None else n
    if not _int(n) or n < 1:
        return wire.invalid(f"n must be at least 1, got {n}.", "n")
    temperature = body.get("temperature")
    if n > 1 and temperature is not None and _number(temperature) and temperature == 0:
        # vLLM 0.32 on the real-vLLM tier: several choices of one greedy sample are refused.
        return wire.invalid(f"n must be 1 when using greedy sampling, got {n}.", None)
    logprobs, top = _logprobs(body, chat)
    if isinstance(top, dict):
        return top
    kwargs = body.get("chat_template_kwargs")
    thinking = (chat and reasoning_parser and isinstance(kwargs, dict)
                and kwargs.get("enable_thinking") is True)
    return Params(max_tokens=max_tokens, min_tokens=min_tokens, stop=stops,
                  stop_token_ids=frozenset(stop_ids),
                  include_stop_str_in_output=body.get("include_stop_str_in_output") is True,
                  ignore_eos=body.get("ignore_eos") is True,
                  presence_penalty=penalties[0], frequency_penalty=penalties[1],
                  logprobs=logprobs, top_logprobs=top, n=n, reasoning=thinking,
                  temperature=float(temperature) if isinstance(temperature, int | float)
                  else 0.0,
                  seed=body.get("seed") if _int(body.get("seed")) else None)


def _stops(body: Mapping[str, Any]) -> tuple[str, ...] | dict[str, Any]:
    """The request's stop strings (empty ones dropped, as vLLM does), or its 400 body."""
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    return wire.invalid("stop must be a string or a list of strings", "stop")


def _logprobs(body: Mapping[str, Any], chat: bool) -> tuple[bool, int | dict[str, Any]]:
    """(asked, alternatives per token) as vLLM reads them: a chat's ``logprobs`` is a bool
    with ``top_logprobs`` beside it, a completion's an int (the alternatives)."""
    if chat:
        asked = body.get("logprobs")
        top = body.get("top_logprobs")
        if asked not in (None, True, False):
            return False, wire.invalid("logprobs must be a boolean", "logprobs")
        if top is not None and (not _int(top) or not 0 <= top <= MAX_LOGPROBS):
            return False, wire.invalid(f"top_logprobs must be between 0 and {MAX_LOGPROBS}",
                                       "top_logprobs")
        if top and not asked:
            return False, wire.invalid("when using `top_logprobs`, `logprobs` must be set to "
                                       "true.", "top_logprobs")
        return asked is True, top or 0
    asked = body.get("logprobs")
    if asked is None:
        return False, 0
    if not _int(asked) or not 0 <= asked <= MAX_LOGPROBS:
        return False, wire.invalid(f"logprobs must be between 0 and {MAX_LOGPROBS}",
                                   "logprobs")
    return True, asked


def token_text(token: int) -> str:
    """A token's text in the output (a special token spells nothing)."""
    return "" if token == EOS else wire.piece(token)


def token_name(token: int) -> str:
    """A token's string as logprobs name it."""
    return EOS_TEXT if token == EOS else wire.piece(token)


@dataclass(slots=True)
class Step:
    """What one engine step showed of a generation: for the client's chunk."""

    token_ids: list[int]
    text: str  # new output text, past the hold-back
    reasoning: str  # new reasoning text (a chat with thinking on)
    finish_reason: str | None
    stop_reason: str | int | None
    #: Per token: (logprob, [(alternative, logprob), ...]) when logprobs were asked.
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None


@dataclass(slots=True)
class Generation:
    """One request's generation: its next token, its stop, and its text as the client sees it.

    The engine core calls :meth:`sample` once per token (``None``: the generation stopped on
    that token); the server calls :meth:`take` after each step for what the step showed.
    """

    prompt_ids: list[int]
    params: Params
    eos_period: int = 0
    #: The loaded weights' salt (:mod:`fleetwarden.sim.weights`): mixed into every next-token
    #: choice, so two checkpoints answer the same prompt differently. Empty: the base weights,
    #: whose answers are the simulator's older ones. The engine changes it under a generation
    #: that was kept across a weight reload: its later tokens are the new weights'.
    salt: bytes = b""
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    #: The detokenizer's state: the output text so far (truncated at a matched stop string).
    text: str = ""
    _sent: int = 0  # characters of ``text`` the client was given
    _taken: int = 0  # output tokens reported so far
    _stop_check_from: int = 0
    _reasoning_chars: int | None = None  # where reasoning ends in ``text`` (None: not yet)
    _reasoning_tokens: int = 0
    _counts: dict[int, int] = field(default_factory=dict)
    _context: Any = None
    _logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    _rng: random.Random | None = None

    def __post_init__(self) -> None:
        if self.params.temperature > 0 and self.params.seed is not None:
            self._rng = random.Random(self.params.seed)
        self._context = hashlib.blake2b(wire.token_bytes(self.prompt_ids), digest_size=8)
        if self.params.reasoning:
            # How long the model thinks: a function of the prompt only.
            self._reasoning_tokens = 2 + self._context.digest()[2] % 6
        else:
            self._reasoning_chars = 0

    @property
    def hold_back(self) -> int:
        """Characters vLLM's detokenizer holds back while a stop string might begin."""
        p = self.params
        if p.stop and not p.include_stop_str_in_output:
            return max(len(s) for s in p.stop) - 1
        return 0

    # ------------------------------------------------------------------ the model

    def _logits(self) -> list[float]:
        """One score per vocabulary piece, then EOS; greedy picks the highest."""
        d = self._context.digest()
        if self.salt:
            d = hashlib.blake2b(d, digest_size=8, key=self.salt).digest()
        best = d[0] % _VOCAB
        p = self.params
        logits = [2.0 if j == best else ((d[j % 7 + 1] ^ (j * 53)) & 0xFF) / 128.0
                  for j in range(_VOCAB)]
        if p.presence_penalty or p.frequency_penalty:
            for token, count in self._counts.items():
                j = token - wire.FIRST_PIECE
                if 0 <= j < _VOCAB:
                    logits[j] -= p.presence_penalty + p.frequency_penalty * count
        # EOS wins outright now and then, where the model may end (and scores lowest elsewhere).
        ends = self.eos_period > 0 and d[1] % self.eos_period == 0
        logits.append(4.5 if ends else -1.0)
        return logits

    def sample(self) -> int | None:
        """The next token, appended; returns ``None`` once the generation has finished."""
        if self.finish_reason is not None:
            return None
        p = self.params
        logits = self._logits()
        masked = set()
        if len(self.output) < p.min_tokens or p.ignore_eos:
            masked.add(_VOCAB)  # EOS
        if len(self.output) < p.min_tokens:
            masked.update(t - wire.FIRST_PIECE for t in p.stop_token_ids)
        allowed = [j for j in range(len(logits)) if j not in masked]
        choice = max(allowed, key=lambda j: (logits[j], -j))
        if p.temperature > 0:
            choice = self._draw(allowed, logits, p.temperature)
        token = EOS if choice == _VOCAB else wire.FIRST_PIECE + choice
        if p.logprobs:
            self._logprobs.append(self._logprob_entry(token, logits))
        self.output.append(token)
        self._counts[token] = self._counts.get(token, 0) + 1
        if token != EOS:
            self._context.update(wire._PIECES[token - wire.FIRST_PIECE].encode())
        self._check_stop(token)
        return token

    def _draw(self, allowed: list[int], logits: list[float], temperature: float) -> int:
        """A token drawn from the softmax of the allowed scores at ``temperature``."""
        if self._rng is not None:
            u = self._rng.random()
        else:
            d = hashlib.blake2b(self._context.digest() + self.salt, digest_size=8).digest()
            u = int.from_bytes(d, "big") / 2**64
        top = max(logits[j] for j in allowed)
        weights = [math.exp((logits[j] - top) / temperature) for j in allowed]
        u *= sum(weights)
        for j, w in zip(allowed, weights, strict=True):
            u -= w
            if u < 0:
                return j
        return allowed[-1]

    def _logprob_entry(self, token: int, logits: list[float]
                       ) -> tuple[int, float, list[tuple[int, float]]]:
        top = max(logits)
        total = top + math.log(sum(math.exp(x - top) for x in logits))
        index = _VOCAB if token == EOS else token - wire.FIRST_PIECE
        ranked = sorted(range(len(logits)), key=lambda j: (-logits[j], j))
        alternatives = [(EOS if j == _VOCAB else wire.FIRST_PIECE + j,
                         round(logits[j] - total, 6)) for j in ranked[:self.params.top_logprobs]]
        return token, round(logits[index] - total, 6), alternatives

    def _check_stop(self, token: int) -> None:
        """The scheduler's ``check_stop``, then the detokenizer's stop strings."""
        p = self.params
        stop_token = False
        if len(self.output) >= p.max_tokens:
            self.finish_reason = "length"
        elif len(self.output) >= p.min_tokens:
            if token == EOS and not p.ignore_eos:
                self.finish_reason, stop_token = "stop", True
            elif token in p.stop_token_ids:
                self.finish_reason, self.stop_reason, stop_token = "stop", token, True
        # The detokenizer: a stop token's text is left out unless asked for.
        if not stop_token or p.include_stop_str_in_output:
            self.text += token_text(token)
        if len(self.output) <= p.min_tokens:
            self._stop_check_from = len(self.text)
        if self._reasoning_chars is None and len(self.output) >= self._reasoning_tokens:
            self._reasoning_chars = len(self.text)
        if p.stop and len(self.output) > p.min_tokens:
            new_chars = len(self.text) - self._stop_check_from
            self._stop_check_from = len(self.text)
            found = _check_stop_strings(self.text, new_chars, p.stop,
                                        p.include_stop_str_in_output)
            if found is not None:
                self.finish_reason, self.stop_reason = "stop", found[0]
                if found[1] != -1:
                    self.text = self.text[:found[1]]

    # ------------------------------------------------------------------ what the client sees

    def take(self) -> Step:
        """The tokens since the last call, and the text they release past the hold-back."""
        new = self.output[self._taken:]
        self._taken = len(self.output)
        finished = self.finish_reason is not None
        end = len(self.text) if finished else max(self._sent, len(self.text) - self.hold_back)
        start, self._sent = self._sent, end
        split = len(self.text) if self._reasoning_chars is None else self._reasoning_chars
        reasoning = self.text[start:min(end, split)] if start < split else ""
        content = self.text[max(start, split):end]
        logprobs = None
        if self.params.logprobs:
            logprobs = self._logprobs[len(self._logprobs) - len(new):]
        return Step(new, content, reasoning, self.finish_reason if finished else None,
                    self.stop_reason, logprobs)

    @property
    def content(self) -> str:
        split = len(self.text) if self._reasoning_chars is None else self._reasoning_chars
        return self.text[split:]

    @property
    def reasoning(self) -> str | None:
        if not self.params.reasoning:
            return None
        split = len(self.text) if self._reasoning_chars is None else self._reasoning_chars
        return self.text[:split]

    @property
    def all_logprobs(self) -> list[tuple[int, float, list[tuple[int, float]]]]:
        return list(self._logprobs)


def _check_stop_strings(text: str, new_chars: int, stop: tuple[str, ...],
                        include: bool) -> tuple[str, int] | None:
    """vLLM 0.32's ``check_stop_strings``: of the strings found in the new text, the one that
    completes earliest (ties: list order); (the string, where the text is cut or -1), or
    None."""
    if not new_chars:
        return None
    best: tuple[str, int, int] | None = None
    for s in stop:
        index = text.find(s, max(0, len(text) + 1 - new_chars - len(s)))
        if index != -1 and (best is None or index + len(s) < best[2]):
            best = (s, index, index + len(s))
    if best is None:
        return None
    s, index, end = best
    if include:
        return (s, -1) if end >= len(text) else (s, end)
    return s, index


# ---------------------------------------------------------------------- logprobs on the wire


def completion_logprobs(entries: list[tuple[int, float, list[tuple[int, float]]]],
                        offset: int) -> dict[str, Any]:
    """A completion's ``logprobs`` for some tokens, as vLLM's ``_create_completion_logprobs``
    writes them: the first offset is ``offset`` (the output text sent before them), each next
    one the previous plus the length of its token's string."""
    offsets = []
    for token, _, _ in entries:
        offsets.append(offset)
        offset += len(token_name(token))
    return {"text_offset": offsets,
            "token_logprobs": [lp for _, lp, _ in entries],
            "tokens": [token_name(t) for t, _, _ in entries],
            "top_logprobs": [{token_name(a): alp for a, alp in alts} for _, _, alts in entries]}


def chat_logprobs(entries: list[tuple[int, float, list[tuple[int, float]]]]) -> dict[str, Any]:
    """A chat's ``logprobs`` for some tokens."""
    def one(token: int, lp: float) -> dict[str, Any]:
        name = token_name(token)
        return {"token": name, "logprob": lp, "bytes": list(name.encode())}

    return {"content": [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in alts]}
                        for t, lp, alts in entries]}
