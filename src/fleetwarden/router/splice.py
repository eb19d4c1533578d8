"""Continuing a streamed generation on another engine: the pure parts (no I/O, no clock).

Owns: how a broken stream continues on another engine: the prompt, the chunks, the seam.
Must not: do I/O or read a clock (pure).

When an engine fails a stream whose first bytes already reached the client (a crash, a reset,
a rescue from a wedge), the router does not cut it: it asks another engine to go on from the
tokens already produced, and splices that engine's chunks into the client's stream, so the
client sees one unbroken stream: every token once, in order, one ``[DONE]``, and a final
``finish_reason`` and ``usage`` that cover the whole generation. The forwarding shell
(:mod:`fleetwarden.router.forward`) does the I/O; this module decides and rewrites:

* :func:`read_stream_request`: is a request a streamed completion or chat, may it be continued
  (and if not, why), and the body to send upstream (``return_token_ids`` added, so that the
  engine says which tokens it produced).
* :class:`SseSplitter`: bytes from the engine into whole SSE events.
* :class:`Splice`: one client stream across its attempts: what each upstream event becomes for
  the client (fields the router added stripped, ids and ``created`` of the first attempt,
  completion chunks turned back into chat chunks, ``usage`` summed), and the request that
  continues it (:meth:`Splice.continuation`).

Two ways to continue, and the metrics say which one happened:

* ``tokens`` (exact): where the engine gave token ids (vLLM's ``return_token_ids``), the
  continuation is a completion whose ``prompt`` is the prompt's ids plus the output's ids: a
  chat continues from its rendered template, as a completion, and its chunks are turned back
  into chat chunks.
* ``text``: where it did not, a completion continues from its prompt plus the text produced so
  far, a chat from the partial assistant message with ``continue_final_message``. The output
  may differ from an uninterrupted run where the text does not re-tokenize to the same tokens.

Stop strings are the router's to check across a cut (:class:`StopCheck`): the continuation
goes on from the last token boundary whose text the router knows, without the stop strings,
and the router runs vLLM's own check over the text known from the start.

A request is not continuable where a continuation cannot be exact or is not allowed: several
choices (``n`` > 1, ``best_of``, several prompts), ``echo``, prompt logprobs, structured output
or tools (their grammar state would restart), or a client that opted out with
:data:`OPT_OUT_HEADER`. Such a stream, cut after its first bytes, ends with an error event in
the OpenAI shape naming the cause, never silently.
"""

from __future__ import annotations

import enum
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fleetwarden.router.pool import CompletionDefault

__all__ = ["OPT_OUT_HEADER", "CompletionDefault", "EngineLimits", "Mode", "Splice",
           "SseSplitter", "StreamRequest", "UnknownCap", "error_event", "output_limit",
           "read_stream_request"]

#: A client that wants a cut stream to end rather than go on elsewhere sends this header with
#: ``off`` (or ``0``, ``false``, ``no``).
OPT_OUT_HEADER = "x-fleetwarden-continuation"
_OFF = frozenset({"off", "0", "false", "no"})

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

DONE = b"data: [DONE]\n\n"
#: vLLM's and SGLang's ``max_tokens`` for a completion that names none (a chat's is the
#: engine's default, else the context left): :attr:`CompletionDefault.FIXED`.
COMPLETION_DEFAULT_MAX_TOKENS = 16

#: What an engine's ``return_token_ids`` adds to a chunk, when the router asked for it and the
#: client did not: set back to ``null``, as vLLM writes them when not asked (byte for byte).
_ADDED_IDS = re.compile(rb'"(prompt_token_ids|token_ids)":\s*\[[0-9,\s]*\]')
_EVENT_END = re.compile(rb"\r?\n\r?\n")

#: Sampling and output fields a chat continued as a completion keeps (everything else in a chat
#: request is about messages, templates or tools, which the rendered prompt already holds).
_CHAT_TO_COMPLETION = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty",
    "ignore_eos", "logit_bias", "bad_words", "allowed_token_ids", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "priority", "user", "stream_options", "cache_salt", "vllm_xargs", "kv_transfer_params",
)
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs", "guided_decoding_backend")


class Mode(enum.Enum):
    """How a generation was continued. Values are metric labels."""

    TOKENS = "tokens"  # exact: from the prompt's and the output's token ids
    TEXT = "text"  # from the prompt and the text produced so far
    RESTART = "restart"  # nothing produced yet: the request itself, sent again


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """A client's streamed completion or chat request, as the router reads it."""

    chat: bool
    #: The client's body, parsed.
    body: Mapping[str, Any]
    #: Why it cannot be continued, or ``None`` if it can.
    refusal: str | None
    #: The client asked for ``return_token_ids`` itself: the ids stay in what it receives.
    wants_ids: bool
    #: What goes upstream on the first attempt.
    upstream_body: bytes
    #: A non-streamed request whose answer the router assembles from a stream it asked the
    #: engine for (``continue_answers``), so that it too can go on elsewhere.
    assemble: bool = False
    #: What goes upstream to an engine that does not take vLLM's own fields: the client's
    #: request with nothing of the router's added but what any OpenAI server takes.
    plain_body: bytes = b""

    def body_for(self, upstream_fields: bool) -> bytes:
        """The first attempt's body for an engine that does (or does not) take vLLM's own
        request fields."""
        return self.upstream_body if upstream_fields or not self.plain_body else self.plain_body


def read_stream_request(path: str, body: bytes, headers: Mapping[str, str], *,
                        assemble_answers: bool = False) -> StreamRequest | None:
    """The streamed completion or chat in ``body``, or ``None`` for anything else (which the
    router relays as it always has). With ``assemble_answers``, a non-streamed completion or
    chat that could be continued is read too: it goes upstream streamed, and the router
    assembles its answer (one with logprobs is not: their merge is not done here)."""
    if path not in (COMPLETIONS, CHAT) or (not assemble_answers and b'"stream"' not in body):
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    chat = path == CHAT
    refusal = _refusal(parsed, chat, headers.get(OPT_OUT_HEADER, "").strip().lower() in _OFF)
    wants_ids = parsed.get("return_token_ids") is True
    if parsed.get("stream") is not True:
        if (not assemble_answers or refusal is not None
                or _asks_logprobs(parsed) or parsed.get("stream") not in (None, False)):
            return None
        plain = {**parsed, "stream": True, "stream_options": {"include_usage": True}}
        upstream = _dumps({**plain, "return_token_ids": True})
        return StreamRequest(chat, parsed, None, wants_ids, upstream, assemble=True,
                             plain_body=_dumps(plain))
    upstream = body
    if refusal is None and not wants_ids:
        upstream = _dumps({**parsed, "return_token_ids": True})
    return StreamRequest(chat, parsed, refusal, wants_ids, upstream, plain_body=body)


def _refusal(body: Mapping[str, Any], chat: bool, opted_out: bool) -> str | None:
    if opted_out:
        return f"the client opted out ({OPT_OUT_HEADER})"
    if _number(body.get("n"), 1) > 1 or _number(body.get("best_of"), 1) > 1:
        return "several choices (n > 1)"
    if body.get("echo"):
        return "echo"
    if body.get("prompt_logprobs") is not None:
        return "prompt logprobs"
    response_format = body.get("response_format")
    if ((isinstance(response_format, dict) and response_format.get("type", "text") != "text")
            or any(body.get(k) is not None for k in _STRUCTURED)):
        return "structured output"
    if body.get("tools") or body.get("functions") or body.get("tool_choice") not in (
            None, "none", "auto"):
        return "tools"
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(
                isinstance(t, int) for t in prompt) and len(prompt) > 1:
            return "several prompts"
    return None


def _number(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _dumps(obj: Any) -> bytes:
    """JSON as vLLM writes it: compact, raw UTF-8."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


#: A stream's ``error`` when its engine aborted it (``finish_reason`` "abort"); the one object,
#: so the forwarder tells it from an engine's own error event by identity.
ABORTED_ERROR: dict[str, Any] = {"message": "the engine aborted the generation", "code": 500}


def error_event(message: str, error_type: str, code: int, **extra: object) -> bytes:
    """An error in the OpenAI shape as an SSE event (vLLM ends a failed stream this way too;
    the ``openai`` client raises it as an ``APIError``)."""
    error = {"message": message, "type": error_type, "param": None, "code": code, **extra}
    return b"data: " + _dumps({"error": error}) + b"\n\n"


class SseSplitter:
    """Cuts the bytes of an SSE stream into whole events (without their blank line)."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer + data if self._buffer else data
        if b"\r" in buffer:  # not vLLM's LF-only framing: the general (slower) way
            events = []
            start = 0
            for match in _EVENT_END.finditer(buffer):
                events.append(buffer[start:match.start()])
                start = match.end()
            self._buffer = buffer[start:]
            return events
        *events, self._buffer = buffer.split(b"\n\n")
        return events


def _data(event: bytes) -> bytes | None:
    """The data of an event (its ``data:`` lines joined), or ``None`` if it has none."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # vLLM's: one data line
    lines = [line[5:].removeprefix(b" ") for line in event.splitlines()
             if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


class EventAction(enum.Enum):
    """What the router does with one event of an engine's stream (:meth:`Splice.on_event`)."""

    SEND = "send"  # write the event's bytes to the client
    SKIP = "skip"  # nothing for the client
    DONE = "done"  # the engine's ``[DONE]``: the generation is complete
    ENGINE_ERROR = "engine_error"  # the engine ended the stream with an error event, or aborted
    #: An error event coded below 500: the request's fault, not the engine's. A stream's client
    #: gets it as it came; an answer being assembled ends as that error (:meth:`Splice.
    #: error_answer`), never as a 200 with the content so far.
    CLIENT_ERROR = "client_error"


@dataclass(frozen=True, slots=True)
class Continuation:
    """The request that continues a stream: where, what, and how."""

    path: str
    body: bytes
    mode: Mode
    #: The engine's chunks are completions, to be turned back into chat chunks.
    as_completion: bool
    #: The output's last token ids, whose text the engine had not written when it was cut:
    #: left out of the prompt, generated again, and not sent twice (:meth:`Splice.continuation`).
    replay: tuple[int, ...] = ()
    #: The text the client had of those tokens: not sent twice either.
    replay_text: str = ""
    #: The request's stop strings are the router's to check on this attempt (it is sent
    #: without them): :class:`StopCheck`.
    held_stop: bool = False


@dataclass(frozen=True)
class UnknownCap:
    """An engine's limit that nothing told (``why``): its server cap on every request, or its
    default limit of a chat that names none (``default``); only that it is at least ``floor``
    tokens, the most one such request there produced. A continuation is exact where the floors
    cover it: the engine that began it would not have ended it before the limit, and the next
    one will not end it before what is left (docs/design.md 4.1, "Server caps")."""

    floor: int
    why: str
    default: bool = False

    def short_of(self, tokens: int, which: str) -> str | None:
        """Why ``tokens`` are not proven to fit under this limit on ``which`` engine."""
        if tokens <= self.floor:
            return None
        what, key = (("default limit", "output_default") if self.default
                     else ("server cap", "output_cap"))
        return (f"the {what} of {which} is unknown ({self.why}; {self.floor} tokens proven of "
                f"the {tokens} needed; declare its {key}, or run vLLM with "
                "VLLM_SERVER_DEV_MODE=1)")



def _cap_refusal(next_cap: int | None, began: UnknownCap | None, next_: UnknownCap | None,
                 produced: int, left: int) -> str | None:
    """Why a continuation that asks ``left`` after ``produced`` would not end where the first
    engine would have: the next engine's known cap below ``left``, or a floor short of the
    generation's limit on the engine that began it or of ``left`` on the next one."""
    if next_cap is not None and left > next_cap:
        return f"the next engine's server cap ({next_cap} tokens), below the {left} left"
    return ((began and began.short_of(produced + left, "the engine that began it"))
            or (next_ and next_.short_of(left, "the next engine")) or None)


@dataclass(slots=True)
class EngineLimits:
    """What the router knows of each engine's output limits, which a continuation must keep.

    vLLM's output limit (``get_max_tokens``, ``entrypoints/serve/utils/api_utils.py``) is the
    least of the context left, the request's limit (naming none: the generation config's
    ``max_new_tokens``, else 16 for a completion) and ``--override-generation-config``'s
    ``max_new_tokens``, which caps even a request that names more. The context length is read
    from ``/v1/models`` in the background (never on a request's path); the caps and the
    default come in the controller's push where it could read them (docs/design.md 4.1),
    else a ``"length"`` finish below the limit a request asked reveals them
    (:meth:`Splice.revealed_cap`); until then, what requests there produced proves a floor
    (:class:`UnknownCap`)."""

    #: ``max_model_len``, by backend.
    context: dict[str, int] = field(default_factory=dict)
    #: A cap on every request's output (the override's ``max_new_tokens``), by backend.
    cap: dict[str, int] = field(default_factory=dict)
    #: A cap on the output of a chat that names no limit (the generation config's
    #: ``max_new_tokens`` too), by backend.
    default_cap: dict[str, int] = field(default_factory=dict)
    #: Why a backend's cap on every request is not known (the push's word), until a finish
    #: reveals it: a continuation that its floor does not cover is refused.
    unknown: dict[str, str] = field(default_factory=dict)
    #: Why a backend's default limit of a chat that names none is not known (the push's word),
    #: until a finish reveals it.
    default_unknown: dict[str, str] = field(default_factory=dict)
    #: The most tokens one request produced on a backend: its cap, known or not, is at least
    #: that (vLLM ends every request at its cap); one chat that named no limit: its default.
    floor: dict[str, int] = field(default_factory=dict)
    default_floor: dict[str, int] = field(default_factory=dict)
    #: What each backend gives a completion that names no limit (the push's word).
    completion: dict[str, CompletionDefault] = field(default_factory=dict)
    #: ... for a backend the push said nothing of: vLLM's rule where the router's
    #: ``upstream_fields`` setting takes its engines for vLLM, else not known.
    unsaid: CompletionDefault = CompletionDefault.FIXED

    def completion_rule(self, backend: str | None) -> CompletionDefault:
        """What ``backend`` gives a completion that names no limit."""
        return self.unsaid if backend is None else self.completion.get(backend, self.unsaid)

    def forget(self, keep: set[str]) -> None:
        """Forget backends that left (one that comes back may have been started otherwise)."""
        for table in self._tables():
            for url in [u for u in table if u not in keep]:
                del table[url]

    def forget_backend(self, backend: str) -> None:
        """Forget all that was learnt of ``backend``: a new process answers there (its caps,
        its context and what it produced may all differ from the old one's)."""
        for table in self._tables():
            table.pop(backend, None)

    def _tables(self) -> tuple[dict[str, int] | dict[str, str]
                               | dict[str, CompletionDefault], ...]:
        return (self.context, self.cap, self.default_cap, self.unknown, self.floor,
                self.default_unknown, self.default_floor, self.completion)

    def learn_cap(self, backend: str, revealed: tuple[int, bool]) -> None:
        """A cap a finish revealed: ``(tokens, whether it caps every request)``."""
        tokens, everyone = revealed
        table = self.cap if everyone else self.default_cap
        table[backend] = min(tokens, table.get(backend, tokens))
        (self.unknown if everyone else self.default_unknown).pop(backend, None)

    def produced(self, backend: str, tokens: int, names_no_limit: bool) -> None:
        """One request on ``backend`` produced ``tokens``: its cap is at least that (and its
        default, where the request named no limit)."""
        for table, counts in ((self.floor, True), (self.default_floor, names_no_limit)):
            if counts and tokens > table.get(backend, 0):
                table[backend] = tokens

    def unknown_cap(self, backend: str | None, names_no_limit: bool = False,
                    ) -> UnknownCap | None:
        """``backend``'s limit on such a request where it is not known: why, and the least it
        can be (its floor); the cap on every request, and for a chat that names no limit its
        default too (the lower floor binds). ``None``: known, or no push said it is not."""
        if backend is None:
            return None
        unknown = [UnknownCap(self.floor.get(backend, 0), why)
                   for why in [self.unknown.get(backend)] if why is not None]
        if names_no_limit and (why := self.default_unknown.get(backend)) is not None:
            unknown.append(UnknownCap(self.default_floor.get(backend, 0), why, default=True))
        return min(unknown, key=lambda u: u.floor, default=None)

    def output_cap(self, backend: str | None, names_no_limit: bool) -> int | None:
        """The least cap known on ``backend``'s output for such a request (``None``: none)."""
        if backend is None:
            return None
        caps = [self.cap.get(backend)]
        if names_no_limit:
            caps.append(self.default_cap.get(backend))
        known = [c for c in caps if c is not None]
        return min(known) if known else None


def stop_strings(body: Mapping[str, Any]) -> tuple[str, ...] | None:
    """A request's stop strings as vLLM reads them (one string is a list of one); ``None``
    where they are not strings."""
    stop = body.get("stop")
    if stop is None or stop == []:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        return tuple(stop)
    return None


def check_stop_strings(text: str, new_chars: int, stops: tuple[str, ...],
                       include: bool) -> tuple[str, int] | None:
    """vLLM 0.32's ``check_stop_strings`` (``vllm/v1/engine/detokenizer.py``), line for line:
    of the stop strings found in the text new since the last check (plus a string's length
    before it), the one that completes earliest (ties: list order); returns it and where the
    text is cut (its start; with ``include``, its end, or -1 where that is the text's end)."""
    if not new_chars or not stops:
        return None
    best: str | None = None
    best_index = 0
    best_end = sys.maxsize
    for stop in stops:
        index = text.find(stop, 1 - new_chars - len(stop))
        if index == -1:
            continue
        end = index + len(stop)
        if end < best_end:
            best, best_index, best_end = stop, index, end
    if best is None:
        return None
    if include:
        return (best, -1) if best_end >= len(text) else (best, best_end)
    return best, best_index


@dataclass(slots=True)
class StopCheck:
    """vLLM's stop-string check on one generation, which the router holds across a cut.

    vLLM matches stop strings in its detokenizer's output text, only in the text new since its
    last check, and, unless ``include_stop_str_in_output``, holds back the last
    ``max(len(stop)) - 1`` characters from every chunk while a stop string might begin. A
    continuation's engine would lose both: the held text (it never reached the router) and a
    match that begins before the cut. So a continuation is sent without the stop strings and
    the router checks them itself, over the text known from the generation's start, exactly as
    vLLM does (:func:`check_stop_strings`), holding back from the client what vLLM would; it
    goes on from the last *seam*: a token boundary whose text is known, where the held text's
    tokens are generated again (at temperature 0 they come the same, and their text, which
    the client partly had, is checked against it). Where it cannot prove where vLLM would have
    cut (a match inside a chunk of several tokens: which token completed it is unknown), it
    refuses (:attr:`unprovable`)."""

    stops: tuple[str, ...]
    include: bool
    min_tokens: int
    #: The characters vLLM holds back from the client (0 with ``include_stop_str_in_output``).
    hold: int
    #: The output text known from its start (vLLM's ``output_text``) and the tokens it covers,
    #: while the router holds the check; before that, the client's text is what is known.
    text: str = ""
    tokens: int = 0
    #: Characters of the output text the client has.
    sent: int = 0
    #: The last token boundary whose text is known: (tokens, characters).
    seam: tuple[int, int] = (0, 0)
    #: On the first attempt: boundaries whose text the engine still held back from the client.
    pending: list[tuple[int, int]] = field(default_factory=list)
    #: The router holds the check (an attempt sent without the stop strings).
    active: bool = False
    #: The router matched a stop string: the generation ended here.
    stopped: bool = False
    unprovable: str | None = None

    def engine_chunk(self, ids: list[int], text: str, produced: int) -> None:
        """A chunk of an attempt that carried the stop strings (the engine held text back),
        ``produced`` tokens in: a one-token chunk with text ends where the engine's
        detokenizer wrote everything (vLLM writes a token's text once its character is
        whole), and its output text then ends ``hold`` characters past what the client has."""
        self.sent += len(text)
        if len(ids) == 1 and text:
            self.pending.append((produced, self.sent + self.hold))
        while self.pending and self.pending[0][1] <= self.sent:
            self.seam = self.pending.pop(0)

    def begin(self, known: str) -> None:
        """An attempt sent without the stop strings, going on from the seam; ``known``: the
        output text known so far (the client's, or the router's own)."""
        self.active, self.pending = True, []
        self.tokens, self.text = self.seam[0], known[:self.seam[1]]

    def chunk(self, ids: list[int], text: str, finished: bool) -> tuple[str, str | None]:
        """One chunk of such an attempt (its ids and its whole text): the text the client gets
        for it, and the stop string that ends the generation here, if one does."""
        before, start = self.tokens, len(self.text)
        self.text += text
        self.tokens += len(ids)
        if len(ids) == 1 and text:
            self.seam = (self.tokens, len(self.text))
        found = None
        if self.tokens > self.min_tokens:
            # vLLM checks from the token after the first ``min_tokens``: inside a chunk of
            # several, where that token's text begins is unknown.
            first = max(self.min_tokens - before, 0)
            found = check_stop_strings(self.text, len(self.text) - start, self.stops,
                                       self.include)
            if found is not None and (first > 0 or len(ids) > 1):
                self.unprovable = ("a stop string matched inside a chunk of several tokens "
                                   "(which token completed it is unknown)")
                return "", None
        if found is not None:
            if found[1] != -1:
                self.text = self.text[:found[1]]
            self.stopped = finished = True
        end = len(self.text) if finished else len(self.text) - self.hold
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out, None if found is None else found[0]


#: A continuation cut again once the ids it was to give again had come, with the text a stop
#: check holds: the client has ids the count no longer shows, and sent again whole, it would
#: get them twice.
_SECOND_CUT = ("a second cut, after ids the client had came again with text a stop string "
               "held back")


class Splice:
    """One client stream, across the attempts that produce it."""

    def __init__(self, request: StreamRequest) -> None:
        self.request = request
        self.attempts = 0  # attempts whose events reached this splice
        self.events_sent = 0  # events written to the client
        #: The first attempt's chunk id and creation time: every chunk the client sees has them.
        self.id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.usage: dict[str, Any] | None = None  # the whole generation's, once it came
        self.stop_reason: Any = None
        self.fingerprint: str | None = None
        self.prompt_ids: list[int] | None = None
        self.output_ids: list[int] = []
        #: Every output chunk so far carried its token ids.
        self.ids_complete = True
        #: Output tokens since the last chunk that carried text: ids the engine's detokenizer
        #: had not written yet (the start of a character whose bytes span tokens, or a
        #: skipped special token).
        self.unwritten = 0
        #: Token ids the current attempt generates again before its own (``Continuation.replay``):
        #: the client had their chunks, with no text.
        self._replay: list[int] = []
        self._replay_text = ""
        #: The text that came with the ``unwritten`` tokens (a chunk of several tokens may write
        #: text and still end inside a character: only a one-token chunk with text is known to
        #: end where the engine's detokenizer wrote everything).
        self._tail_text = ""
        #: A replayed token came out otherwise than the first time, where the client had seen it.
        self.diverged = False
        self.text: list[str] = []
        self.reasoning: list[str] = []
        #: A chat's reasoning (thinking) output came: a continuation as a completion would
        #: turn it into content, so none is made.
        self.saw_reasoning = False
        #: Logprobs came with the output.
        self.saw_logprobs = False
        #: Token ids of the output reached the client (it asked for them), whatever text a
        #: stop check held back with them: the request can no longer be sent again whole.
        self.ids_sent = False
        #: Tokens produced (ids counted, or one per chunk where the engine gave none).
        self.produced = 0
        self.finish_reason: str | None = None
        #: The choices whose final chunk came (``n`` of them: the generation is whole).
        self.finished_choices: set[Any] = set()
        self.usage_sent = False
        self.error: Any = None  # the engine's error event, if it ended with one
        #: How the current attempt continues (``None``: the first attempt).
        self.mode: Mode | None = None
        self._as_completion = False
        #: Tokens produced before the current attempt began: its prompt holds them.
        self._before = 0
        #: Where the next logprobs' ``text_offset`` falls in the client's stream: vLLM counts
        #: offsets by the tokens' own strings (each token decoded alone), not by the text
        #: written, and the two differ where a character's bytes span tokens.
        self._offset_end: int | None = None
        #: ``_offset_end`` when the current attempt began (the client's text, where no offsets
        #: came): its offsets count from there.
        self._chars_before = 0
        #: The stop-string check, where the request has stop strings (``None``: it has none,
        #: or they are not strings, which a continuation refuses).
        self.stop_check: StopCheck | None = None
        stops = stop_strings(request.body)
        if stops:
            include = request.body.get("include_stop_str_in_output") is True
            min_tokens = _number(request.body.get("min_tokens"), 0)
            self.stop_check = StopCheck(stops, include, min_tokens,
                                        0 if include else max(map(len, stops)) - 1)

    # ------------------------------------------------------------------ events

    def begin_attempt(self, continuation: Continuation | None) -> None:
        self.attempts += 1
        self._chars_before = (sum(map(len, self.text)) if self._offset_end is None
                              else self._offset_end)
        if continuation is not None:
            if continuation.mode is Mode.RESTART and self.stop_check is not None:
                # from the start: the engine holds the stop strings again
                self.stop_check = StopCheck(self.stop_check.stops, self.stop_check.include,
                                            self.stop_check.min_tokens, self.stop_check.hold)
            self.mode = continuation.mode
            self._as_completion = continuation.as_completion
            # The output stops where its text was last written; the tokens after it (those
            # of the output, and any a cut replay had yet to give again) come again from this
            # attempt, and are counted again as they come.
            drop = len(continuation.replay) - len(self._replay)
            if drop:
                del self.output_ids[len(self.output_ids) - drop:]
                self.produced -= drop
                self.unwritten = 0
            chars = len(continuation.replay_text) - len(self._replay_text)
            if continuation.held_stop and self.stop_check is not None:
                # The client's text stays whole: what the client gets is counted by the
                # check, from the seam's known text.
                check = self.stop_check
                known = check.text if check.active else "".join(self.text)
                check.begin(known)
                self.unwritten, self._tail_text = 0, ""
            elif chars:
                self.text = ["".join(self.text)[:-chars]]
                self._tail_text = ""
            self._replay = list(continuation.replay)
            self._replay_text = continuation.replay_text
        self._before = self.produced

    def on_event(self, event: bytes) -> tuple[EventAction, bytes]:
        """What one upstream event means, and the bytes (if any) the client gets for it."""
        data = _data(event)
        if data is None:
            return (EventAction.SKIP, b"") if self.mode is not None else (EventAction.SEND,
                                                                         event + b"\n\n")
        if data.strip() == b"[DONE]":
            return EventAction.DONE, DONE
        try:
            chunk = json.loads(data)
        except ValueError:
            return EventAction.SEND, event + b"\n\n"  # not ours to judge: passed on as it came
        if not isinstance(chunk, dict):
            return EventAction.SEND, event + b"\n\n"
        if "error" in chunk and "choices" not in chunk:
            error = chunk["error"]
            code = error.get("code") if isinstance(error, dict) else None
            if isinstance(code, int) and code < 500:  # the request's fault: the client's to see
                self.error = error
                return EventAction.CLIENT_ERROR, event + b"\n\n"
            self.error = error
            return EventAction.ENGINE_ERROR, b""
        if any(isinstance(c, dict) and c.get("finish_reason") == "abort"
               for c in chunk.get("choices") or ()):
            # The engine aborted the generation (vLLM shut down with SIGTERM ends what it holds
            # so): a failure of the engine, not an end the client asked for. Its last tokens
            # are not taken; the next engine goes on from what the client has.
            self.error = ABORTED_ERROR
            return EventAction.ENGINE_ERROR, b""
        replayed = self._take_replay(chunk) if self._replay or self._replay_text else (0, 0)
        if replayed is None:
            self.diverged = True
            self.error = {"message": "the continuation generated other tokens than those the "
                                     "client had", "code": 500}
            return EventAction.ENGINE_ERROR, b""
        check = self.stop_check
        if check is not None and check.active:
            if not self._check_stops(chunk, check):
                self.error = {"message": check.unprovable, "code": 500}
                return EventAction.ENGINE_ERROR, b""
            replayed = (replayed[0], 0)  # the check counted the client's text already
        self._observe(chunk)
        if self.mode is None:  # the first attempt: the engine's bytes, less what we added
            if self.request.wants_ids or self.request.refusal is not None:
                return EventAction.SEND, event + b"\n\n"
            return EventAction.SEND, _ADDED_IDS.sub(rb'"\1":null', event) + b"\n\n"
        out = self._rewrite(chunk, replayed)
        if check is not None and check.stopped:
            # The router matched a stop string: the generation ends here, as vLLM ends it
            # (the final chunk, the usage asked for, ``[DONE]``); its engine is let go.
            prompt = len(self.prompt_ids or ())
            self.usage = {"prompt_tokens": prompt, "total_tokens": prompt + self.produced,
                          "completion_tokens": self.produced}
            final = b"" if out is None else b"data: " + _dumps(out) + b"\n\n"
            return EventAction.DONE, final + (self.closing_usage() or b"") + DONE
        if out is None:
            return EventAction.SKIP, b""
        return EventAction.SEND, b"data: " + _dumps(out) + b"\n\n"

    def _check_stops(self, chunk: dict[str, Any], check: StopCheck) -> bool:
        """The router's stop check on a chunk of an attempt sent without the stop strings: its
        text becomes what the client gets, and a match ends the generation (``False``: where
        vLLM would have cut cannot be proven)."""
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            ids = choice.get("token_ids")
            text = choice.get("text")
            if not isinstance(ids, list) or not isinstance(text, str):
                check.unprovable = "stop strings, with a chunk without token ids or text"
                return False
            out, stop = check.chunk(ids, text, choice.get("finish_reason") is not None)
            if check.unprovable is not None:
                return False
            choice["text"] = out
            if stop is not None:
                choice["finish_reason"], choice["stop_reason"] = "stop", stop
        return True

    def _take_replay(self, chunk: dict[str, Any]) -> tuple[int, int] | None:
        """How many of a chunk's first ids and characters the client had already (tokens
        generated again, and their text); ``None`` where they came out otherwise."""
        ids_n = chars_n = 0
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            ids = choice.get("token_ids")
            if isinstance(ids, list) and self._replay:
                ids_n = min(len(ids), len(self._replay))
                if ids[:ids_n] != self._replay[:ids_n]:
                    return None
                del self._replay[:ids_n]
            text = choice.get("text")
            if isinstance(text, str) and text and self._replay_text:
                chars_n = min(len(text), len(self._replay_text))
                if text[:chars_n] != self._replay_text[:chars_n]:
                    return None
                self._replay_text = self._replay_text[chars_n:]
        return ids_n, chars_n

    def _observe(self, chunk: dict[str, Any]) -> None:
        if self.id is None:
            self.id = chunk.get("id")
            self.created = chunk.get("created")
            self.model = chunk.get("model")
        if chunk.get("usage") is not None and not chunk.get("choices"):
            self.usage_sent = True
        if self.mode is None and isinstance(chunk.get("usage"), dict):
            self.usage = dict(chunk["usage"])
        if chunk.get("system_fingerprint") is not None:
            self.fingerprint = chunk["system_fingerprint"]
        if self.mode is None and self.request.chat and chunk.get("prompt_token_ids"):
            self.prompt_ids = list(chunk["prompt_token_ids"])
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if self.mode is None and choice.get("prompt_token_ids"):
                self.prompt_ids = list(choice["prompt_token_ids"])
            delta = choice.get("delta")
            if choice.get("logprobs"):
                self.saw_logprobs = True
                if self.mode is None:
                    self._offsets_seen(choice["logprobs"], 0)
            if isinstance(delta, dict):
                if "role" in delta and not delta.get("content"):
                    continue  # the chat's role chunk: no token
                text = delta.get("content")
                thought = delta.get("reasoning_content", delta.get("reasoning"))
                if thought is not None:
                    self.saw_reasoning = True
                    if isinstance(thought, str):
                        self.reasoning.append(thought)
            else:
                text = choice.get("text")
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.output_ids.extend(ids)
                self.produced += len(ids)
                self.ids_sent = self.ids_sent or (bool(ids) and self.request.wants_ids)
            else:
                self.ids_complete = False
                self.produced += 1
            if isinstance(text, str):
                self.text.append(text)
            check = self.stop_check
            if check is not None and not check.active and isinstance(ids, list):
                check.engine_chunk(ids, text if isinstance(text, str) else "", self.produced)
            if isinstance(ids, list):
                if text and len(ids) == 1:
                    self.unwritten, self._tail_text = 0, ""
                else:
                    self.unwritten += len(ids)
                    self._tail_text += text if isinstance(text, str) else ""
            if choice.get("finish_reason") is not None:
                self.finished_choices.add(choice.get("index", 0))
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")

    def _rewrite(self, chunk: dict[str, Any],
                 replayed: tuple[int, int] = (0, 0)) -> dict[str, Any] | None:
        """A continuation's chunk as the client's stream goes on: its ids, its shape.
        ``replayed``: its first ids were the client's already (their chunks came, with no text)."""
        chat = self.request.chat
        wants_ids = self.request.wants_ids
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            usage = self.usage = self._whole_usage(usage)
        if any(replayed):
            choices_ = []
            for c in chunk.get("choices") or ():
                ids = c.get("token_ids")
                c = {**c, "token_ids": ids[replayed[0]:]} if isinstance(ids, list) else c
                if isinstance(c.get("text"), str):
                    c["text"] = c["text"][replayed[1]:]
                text = c.get("text", (c.get("delta") or {}).get("content"))
                if c.get("token_ids") or text or c.get("finish_reason") is not None:
                    choices_.append(c)
            if chunk.get("choices") and not choices_:
                return None  # a token the client had: its chunk came, text and all
            chunk = {**chunk, "choices": choices_}
        if self._as_completion:  # a completion chunk back into a chat chunk
            out: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk",
                                   "created": self.created, "model": chunk.get("model")}
            choices = []
            for c in chunk.get("choices") or ():
                choice: dict[str, Any] = {"index": c.get("index", 0),
                                          "delta": {"content": c.get("text", "")},
                                          "logprobs": None,
                                          "finish_reason": c.get("finish_reason")}
                if c.get("finish_reason") is not None:
                    choice["stop_reason"] = c.get("stop_reason")
                choice["token_ids"] = c.get("token_ids") if wants_ids else None
                choices.append(choice)
            out["choices"] = choices
            if usage is not None:
                out["usage"] = usage
            for key in ("system_fingerprint",):
                if key in chunk:
                    out[key] = chunk[key]
            return out
        out = dict(chunk)
        out["id"] = self.id
        out["created"] = self.created
        choices = []
        for c in chunk.get("choices") or ():
            c = dict(c)
            delta = c.get("delta")
            if chat and isinstance(delta, dict) and "role" in delta:
                if not delta.get("content") and c.get("finish_reason") is None:
                    continue  # the client had its role chunk from the first attempt
                c["delta"] = {k: v for k, v in delta.items() if k != "role"}
            if "prompt_token_ids" in c:
                c["prompt_token_ids"] = None  # the client had them once, from the first attempt
            if "token_ids" in c and not wants_ids:
                c["token_ids"] = None
            logprobs = c.get("logprobs")
            if (self._chars_before and isinstance(logprobs, dict)
                    and isinstance(logprobs.get("text_offset"), list)):
                # vLLM counts a completion's offsets from the start of its own output: the
                # continuation's output begins where the client's text ends.
                c["logprobs"] = {**logprobs, "text_offset": [
                    o + self._chars_before if isinstance(o, int) else o
                    for o in logprobs["text_offset"]]}
            if isinstance(logprobs, dict):
                self._offsets_seen(logprobs, self._chars_before)
            choices.append(c)
        if chunk.get("choices") and not choices:
            return None
        out["choices"] = choices
        if "prompt_token_ids" in out:
            out["prompt_token_ids"] = None
        if usage is not None:
            out["usage"] = usage
        return out

    def _offsets_seen(self, logprobs: Any, moved: int) -> None:
        """Where the offsets of a completion's logprobs go on after these (moved on by
        ``moved``): the last token's offset plus the length of its string."""
        offsets = logprobs.get("text_offset") if isinstance(logprobs, dict) else None
        tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
        if (isinstance(offsets, list) and isinstance(tokens, list) and offsets and tokens
                and isinstance(offsets[-1], int) and isinstance(tokens[-1], str)):
            self._offset_end = offsets[-1] + moved + len(tokens[-1])

    def _whole_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """An attempt's usage as the whole generation's: its prompt held what came before."""
        before = self._before
        out = dict(usage)
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            out["prompt_tokens"] = prompt - before
            out["completion_tokens"] = completion + before
            out["total_tokens"] = prompt + completion
        return out

    def closing_usage(self) -> bytes | None:
        """What a generation that was whole but lost its end still owes its client: the usage
        event, where it asked for one and none came (``b""`` where it owes nothing; ``None``
        where the router cannot count it: the prompt's length is unknown)."""
        options = self.request.body.get("stream_options")
        if self.usage_sent or not isinstance(options, dict) or not options.get("include_usage"):
            return b""
        if self.prompt_ids is None or not self.ids_complete:
            return None
        prompt = len(self.prompt_ids)
        return b"data: " + _dumps({
            "id": self.id,
            "object": "chat.completion.chunk" if self.request.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": [],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt + self.produced,
                      "completion_tokens": self.produced},
            "system_fingerprint": self.fingerprint,
        }) + b"\n\n"

    def versions_event(self, versions: list[int]) -> bytes:
        """The event that ends a stream whose tokens may come from several weight versions
        (loaded under it), naming them in order: shaped as a usage chunk (no choices), which
        OpenAI clients read without complaint; the head named the first only."""
        return b"data: " + _dumps({
            "id": self.id, "object": ("chat.completion.chunk" if self.request.chat
                                      else "text_completion"),
            "created": self.created, "model": self.model, "choices": [],
            "fleetwarden_weight_versions": versions}) + b"\n\n"

    def error_answer(self) -> tuple[int, bytes]:
        """The non-streamed answer to a request whose stream ended with an error event of the
        request's own (:attr:`EventAction.CLIENT_ERROR`): its code and its error, as vLLM
        answers a request that fails before it streams."""
        code = self.error.get("code") if isinstance(self.error, dict) else None
        return (code if isinstance(code, int) and 400 <= code < 500 else 400,
                _dumps({"error": self.error}))

    def answer(self) -> bytes:
        """The non-streamed answer, assembled from the stream(s), in vLLM 0.32's shape
        (``completions.http``, ``chat.http``, ``completions-token-ids.http``)."""
        text = "".join(self.text)
        ids = self.output_ids if self.request.wants_ids else None
        prompt_ids = self.prompt_ids if self.request.wants_ids else None
        usage = self.usage or {}
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens", self.produced)
        whole_usage = {"prompt_tokens": prompt,
                       "total_tokens": None if prompt is None else prompt + completion,
                       "completion_tokens": completion, "prompt_tokens_details": None,
                       "completion_tokens_details": None}
        head = {"id": self.id,
                "object": "chat.completion" if self.request.chat else "text_completion",
                "created": self.created, "model": self.model}
        if self.request.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None,
                                       "annotations": None, "audio": None,
                                       "function_call": None, "reasoning": None}
            if self.saw_reasoning:
                message["reasoning_content"] = "".join(self.reasoning)
            return _dumps({**head, "choices": [{
                "index": 0, "message": message, "logprobs": None,
                "finish_reason": self.finish_reason, "stop_reason": self.stop_reason,
                "token_ids": ids, "routed_experts": None}],
                "service_tier": None, "system_fingerprint": self.fingerprint,
                "usage": whole_usage, "prompt_logprobs": None, "prompt_token_ids": prompt_ids,
                "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None,
                "metrics": None})
        return _dumps({**head, "choices": [{
            "index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason, "token_ids": ids, "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids, "routed_experts": None}],
            "service_tier": None, "system_fingerprint": self.fingerprint, "usage": whole_usage,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None})

    # ------------------------------------------------------------------ the next attempt

    def names_no_limit(self, completion: CompletionDefault = CompletionDefault.FIXED) -> bool:
        """A request that gets its engine's default limit: a chat naming neither
        ``max_tokens`` nor ``max_completion_tokens``, a completion naming no ``max_tokens``
        where ``completion`` (the rule of the engine it began on) is that default."""
        body = self.request.body
        if not self.request.chat:
            return completion is CompletionDefault.ENGINE and body.get("max_tokens") is None
        return body.get("max_tokens") is None and body.get("max_completion_tokens") is None

    def revealed_cap(self, max_model_len: int | None,
                     completion: CompletionDefault = CompletionDefault.FIXED,
                     ) -> tuple[int, bool] | None:
        """The server cap a whole generation revealed: a ``"length"`` finish below the limit
        asked (vLLM refuses a request past its context: only a cap ends one short). ``(tokens,
        whether it caps every request)``: a chat naming no limit reveals only its default."""
        if (self.mode not in (None, Mode.RESTART) or not self.finished() or not self.ids_complete
                or self.finish_reason != "length" or self.produced_here() is None):
            return None
        asked = self._tokens_left(max_model_len, 0, None, completion)
        if isinstance(asked, str) or self.produced >= asked:
            return None
        return self.produced, not self.names_no_limit(completion)

    def produced_here(self) -> int | None:
        """Tokens the last attempt made, at least: by ids, else a chunk each but the last."""
        gone = 0 if self.ids_complete or not self.finished() else 1
        counted = _number(self.request.body.get("n"), 1) == 1
        return max(0, self.produced - self._before - gone) if counted else None

    def ended_by_router(self) -> bool:
        """The router matched a stop string and ended the generation before its engine did."""
        return self.stop_check is not None and self.stop_check.stopped

    def finished(self) -> bool:
        """The generation is whole: its final chunk (``finish_reason`` set) was read, whatever
        became of ``[DONE]``. It is never continued past its end."""
        return len(self.finished_choices) >= max(1, _number(self.request.body.get("n"), 1))

    def continuation(self, chat_as_completion: bool = True, *, max_model_len: int | None = None,
                     upstream_fields: bool = True, output_cap: int | None = None,
                     next_output_cap: int | None = None, began_unknown: UnknownCap | None = None,
                     next_unknown: UnknownCap | None = None,
                     completion: CompletionDefault = CompletionDefault.FIXED) -> Continuation | str:
        """The request that continues this stream, or why there can be none (docs/design.md,
        "Continuing a generation"; where in doubt, refuse). ``upstream_fields``: the next
        engine takes vLLM's own request fields (else only what any OpenAI server takes is sent,
        and only a completion of text can go on). ``max_model_len``, ``output_cap``: the
        context and server cap of the engine that began it (its limit is kept);
        ``next_output_cap``: the next one's; ``began_unknown``, ``next_unknown``: either's cap
        where unknown, whose floor must cover the limit (the first) or what is left (next);
        ``completion``: what the first gives a completion that names no limit."""
        request = self.request
        if request.refusal is not None:
            return request.refusal
        if self.produced == 0 and not self._replay:
            if self.ids_sent:
                return _SECOND_CUT
            # Nothing of the generation reached the client (a chat's role chunk at most): the
            # request itself goes again, and its role chunk is not repeated. (Tokens still to
            # be generated again did reach it: their chunks came, and perhaps some text.)
            path = CHAT if request.chat else COMPLETIONS
            return Continuation(path, request.body_for(upstream_fields), Mode.RESTART, False)
        if (refusal := self._inexact()) is not None:
            return refusal
        body = dict(request.body)
        # A prompt of ids is vLLM's to take.
        exact = self.prompt_ids is not None and self.ids_complete and upstream_fields
        # Where the last tokens came with no text (the start of a character whose bytes span
        # tokens, or a skipped special token), the prompt of ids stops before them and they
        # are generated again: vLLM's detokenizer starts a prompt of ids that decodes to text
        # ending inside a character with no prefix, and would write the whole decoded prompt
        # in front of its first chunk. At temperature 0 they come again the same; the client,
        # who had their chunks with no text, is not sent them twice.
        from_ids = exact and (chat_as_completion or not request.chat)
        replay_text = self._tail_text + self._replay_text
        replay = (*self.output_ids[len(self.output_ids) - self.unwritten:], *self._replay) if (
            from_ids and (self.unwritten or self._replay)) else ()
        produced = self.produced - self.unwritten if replay else self.produced
        check = self.stop_check
        if check is not None:
            # The router holds the stop check from here (:class:`StopCheck`): the prompt of
            # ids stops at the seam, and the tokens after it are generated again.
            if not from_ids:
                return ("stop strings, without token ids to go on from (the text held back "
                        "at the cut, and a match across it)")
            seam_tokens, seam_chars = check.seam
            replay = (*self.output_ids[seam_tokens:], *self._replay)
            client = "".join(self.text)
            replay_text = client[seam_chars:]
            produced = seam_tokens
            if replay and not _greedy(body):
                return ("stop strings in a sampled generation, cut where the engine held text "
                        "back (its tokens, generated again, would not come the same)")
            body.pop("stop", None)
        left = self._tokens_left(max_model_len, produced, output_cap, completion)
        if isinstance(left, str):
            return left
        if refusal := _cap_refusal(next_output_cap, began_unknown, next_unknown, produced, left):
            return refusal
        refusal = (self._continued_fields(body, left, produced, upstream_fields)
                   or self._refused_fields(body, exact, bool(replay), check is not None,
                                           upstream_fields))
        if refusal is not None:
            return refusal
        again = len(replay) - len(self._replay) if replay else 0  # output ids made again
        ids = (self.prompt_ids or []) + self.output_ids[:len(self.output_ids) - again]
        held = check is not None
        if exact and request.chat and chat_as_completion:
            plain = {k: body[k] for k in _CHAT_TO_COMPLETION if k in body}
            plain.update(prompt=ids, stream=True,
                         return_token_ids=True, max_tokens=body["max_tokens"])
            return Continuation(COMPLETIONS, _dumps(plain), Mode.TOKENS, True, replay,
                                replay_text if replay else "", held)
        if exact and not request.chat:
            body["prompt"] = ids
            return Continuation(COMPLETIONS, _dumps(body), Mode.TOKENS, False, replay,
                                replay_text if replay else "", held)
        return self._from_text(body)

    def _continued_fields(self, body: dict[str, Any], left: int, produced: int,
                          upstream_fields: bool) -> str | None:
        """Set the continuation's limits and stream fields in ``body``; or why it cannot."""
        request = self.request
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = left
        min_tokens = body.get("min_tokens")
        if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens:
            body["min_tokens"] = max(0, min_tokens - produced)
        if upstream_fields:
            body["return_token_ids"] = True
        elif not request.wants_ids:
            body.pop("return_token_ids", None)
        else:
            return "the client's return_token_ids, which the next engine does not take"
        if request.assemble:  # the client's request was not streamed; its continuation is
            body.update(stream=True, stream_options={"include_usage": True})
        return None

    def _refused_fields(self, body: dict[str, Any], exact: bool, replay: bool, held: bool,
                        upstream_fields: bool) -> str | None:
        """Why the continuation's fields cannot be continued exactly, or ``None``."""
        request = self.request
        logprobs = self.saw_logprobs or _asks_logprobs(body)
        if logprobs and (request.chat or not exact):
            # A completion's continue from its ids, their text offsets moved on by the text
            # the client has; a chat's would come in a completion's shape, from which its own
            # (token bytes, alternatives by rank) cannot be rebuilt without the tokenizer.
            return "logprobs (a chat's, or without token ids)"
        if not upstream_fields and request.chat:
            return "a chat, on an engine that takes no continue_final_message"
        if exact and replay and logprobs:
            if held:
                return ("logprobs, at a cut where stop strings held text back (the text "
                        "offsets of the tokens generated again)")
            return ("logprobs, at a cut inside a character (the text offsets of the tokens "
                    "generated again)")
        if exact and replay and not _greedy(body):
            return ("a cut inside a character of a sampled generation (its last tokens would "
                    "not come again the same)")
        return None

    def _tokens_left(self, max_model_len: int | None, produced: int,
                     output_cap: int | None = None,
                     completion: CompletionDefault = CompletionDefault.FIXED) -> int | str:
        """How many tokens the continuation may generate: the generation's limit
        (:func:`output_limit`) less the ``produced`` its prompt holds; or why not known."""
        prompt = None if self.prompt_ids is None else len(self.prompt_ids)
        limit = output_limit(self.request, prompt, max_model_len, output_cap, completion)
        if isinstance(limit, str):
            return limit
        if limit - produced < 1:
            return "nothing left to generate"
        return limit - produced

    def _from_text(self, body: dict[str, Any]) -> Continuation | str:
        """The continuation from the text the client has (no token ids to go on from):
        ``body`` is the continuation's, its limits already set."""
        request = self.request
        options = request.body.get("stream_options")
        if request.assemble or (isinstance(options, dict) and options.get("include_usage")):
            # From text, the continuation's prompt tokens are the text re-read, not the
            # tokens produced: the whole generation's usage could only be estimated.
            return "usage, which a continuation from text cannot count"
        text = "".join(self.text)
        if not request.chat:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                return "a prompt of token ids, and no token ids from the engine"
            body["prompt"] = prompt + text
            return Continuation(COMPLETIONS, _dumps(body), Mode.TEXT, False)
        messages = list(body.get("messages") or [])
        if body.get("continue_final_message") and messages:
            last = dict(messages[-1])
            content = last.get("content")
            if isinstance(content, list):
                last["content"] = [*content, {"type": "text", "text": text}]
            else:
                last["content"] = ("" if content is None else str(content)) + text
            messages[-1] = last
        else:
            messages.append({"role": "assistant", "content": text})
        body.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
        return Continuation(CHAT, _dumps(body), Mode.TEXT, False)

    def _inexact(self) -> str | None:
        """Why a continuation from here could not be proven the same answer, if it could not.
        Each is a state the engine kept that a new prompt does not carry."""
        body = self.request.body
        if stop_strings(body) is None:
            return "stop strings that are not strings"
        if self.stop_check is not None and self.stop_check.unprovable is not None:
            return self.stop_check.unprovable
        if body.get("seed") is not None and not _greedy(body):
            # vLLM draws a seeded request's tokens from one generator, seeded once at its start:
            # a continuation's generator starts again at the cut, and its tokens after it are
            # not the reproducible ones the seed promised (at temperature 0 nothing is drawn).
            return "a seeded sampled generation (its random draws would restart at the cut)"
        if any(isinstance(body.get(k), int | float) and body.get(k)
               for k in ("presence_penalty", "frequency_penalty")):
            return "presence or frequency penalties (they count the output before the cut)"
        if self.saw_reasoning or (self.request.chat and isinstance(
                body.get("chat_template_kwargs"), dict)
                and body["chat_template_kwargs"].get("enable_thinking")):
            return "reasoning output (its parser's state does not carry over)"
        if self.request.chat and _multimodal(body.get("messages")):
            return "images or other non-text content (a prompt of ids does not carry them)"
        if self.diverged:
            return "the continuation generated other tokens than those the client had"
        return None


def output_limit(request: StreamRequest, prompt: int | None, max_model_len: int | None,
                 output_cap: int | None, completion: CompletionDefault) -> int | str:
    """The limit of a whole generation (docs/design.md 4.1): the client's; or, naming none,
    the engine's default: a completion's 16 (:attr:`CompletionDefault.FIXED`), else the
    context left (its ``max_model_len`` less the ``prompt``'s tokens); and the server cap
    (``output_cap``, with such a request's default) where less. Or why it is not known."""
    body = request.body
    limit = body.get("max_completion_tokens") if request.chat else None
    if limit is None:
        limit = body.get("max_tokens")
    if limit is None:
        if not request.chat and completion is CompletionDefault.UNKNOWN:
            return ("a completion sent without max_tokens, on an engine of no known kind "
                    "(engine \"openai\", or \"auto\" not recognised yet): what it gives one "
                    "naming no limit is not known")
        if not request.chat and completion is CompletionDefault.FIXED:
            limit = COMPLETION_DEFAULT_MAX_TOKENS
        elif max_model_len is not None and prompt is not None:
            limit = max_model_len - prompt
        elif not request.chat and output_cap is not None:
            # No token ids tell the context left, and the default is known: it is the limit
            # (an engine that gives a completion its default, llama.cpp, ends a generation at
            # its context itself, where the continuation's prompt, as long, ends it too).
            limit = output_cap
        else:
            return (f"a {'chat' if request.chat else 'completion'} sent without max_tokens, "
                    "and the engine's context length (its default) is unknown")
    if not isinstance(limit, int) or isinstance(limit, bool):
        return "max_tokens is not a number"
    return limit if output_cap is None else min(limit, output_cap)


def _greedy(body: Mapping[str, Any]) -> bool:
    """Temperature 0: the same prompt gives the same tokens (vLLM's default is 1)."""
    temperature = body.get("temperature")
    return isinstance(temperature, int | float) and temperature == 0


def _asks_logprobs(body: Mapping[str, Any]) -> bool:
    """A completion's ``logprobs`` is a count (0 asks for the chosen token's alone), a chat's a
    flag: either way, anything but absent or false asks."""
    value = body.get("logprobs")
    return (value is not None and value is not False) or bool(body.get("top_logprobs"))


def _multimodal(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(
        isinstance(p, dict) and p.get("type", "text") != "text" for p in m["content"])
        for m in messages)
