"""Continuing a streamed generation on another engine: the events (pure: no I/O, no clock).

Owns: what a continued stream's client gets: each engine's events rewritten into one stream,
and the answer assembled from them.
Must not: do I/O or read a clock (pure); plan what goes upstream
(:mod:`fleetwarden.router.continuation`, which plans from what this module says the client
has: :meth:`Splice.cut`).

When an engine fails a stream whose first bytes already reached the client (a crash, a reset,
a rescue from a wedge), the router does not cut it: it asks another engine to go on from the
tokens already produced, and splices that engine's chunks into the client's stream, so the
client sees one unbroken stream: every token once, in order, one ``[DONE]``, and a final
``finish_reason`` and ``usage`` that cover the whole generation. The forwarding shell
(:mod:`fleetwarden.router.forward`) does the I/O; this module rewrites:

* :class:`SseSplitter`: bytes from the engine into whole SSE events.
* :class:`Splice`: one client stream across its attempts: what each upstream event becomes for
  the client (fields the router added stripped, ids and ``created`` of the first attempt,
  completion chunks turned back into chat chunks, ``usage`` summed), and what the client has
  where it was cut (:meth:`Splice.cut`).
* :func:`assembled_answer`, :func:`error_answer`: the non-streamed answer the router assembles
  from the stream(s).

Stop strings are the router's to check across a cut (:class:`StopCheck`): the continuation
goes on from the last token boundary whose text the router knows, without the stop strings,
and the router runs vLLM's own check over the text known from the start.
"""

from __future__ import annotations

import enum
import json
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from fleetwarden.router.continuation import (
    Continuation,
    Cut,
    Mode,
    StreamRequest,
    UnknownCap,
    int_or,
    output_limit,
    stop_strings,
    vllm_json,
)
from fleetwarden.router.pool import CompletionDefault

__all__ = ["CompletionDefault", "EngineLimits", "Splice", "SseSplitter", "assembled_answer",
           "error_answer", "error_event"]

DONE = b"data: [DONE]\n\n"

#: What an engine's ``return_token_ids`` adds to a chunk, when the router asked for it and the
#: client did not: set back to ``null``, as vLLM writes them when not asked (byte for byte).
_ADDED_IDS = re.compile(rb'"(prompt_token_ids|token_ids)":\s*\[[0-9,\s]*\]')
_EVENT_END = re.compile(rb"\r?\n\r?\n")


#: A stream's ``error`` when its engine aborted it (``finish_reason`` "abort"); the one object,
#: so the forwarder tells it from an engine's own error event by identity.
ABORTED_ERROR: dict[str, Any] = {"message": "the engine aborted the generation", "code": 500}


def error_event(message: str, error_type: str, code: int, **extra: object) -> bytes:
    """An error in the OpenAI shape as an SSE event (vLLM ends a failed stream this way too;
    the ``openai`` client raises it as an ``APIError``)."""
    error = {"message": message, "type": error_type, "param": None, "code": code, **extra}
    return b"data: " + vllm_json({"error": error}) + b"\n\n"


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
    #: gets it as it came; an answer being assembled ends as that error (:func:`error_answer`),
    #: never as a 200 with the content so far.
    CLIENT_ERROR = "client_error"


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

    def rewrite(self, chunk: dict[str, Any]) -> bool:
        """The check on an engine's chunk of an attempt sent without the stop strings (in
        place): its text becomes what the client gets, and a match ends the generation
        (``False``: where vLLM would have cut cannot be proven)."""
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            ids = choice.get("token_ids")
            text = choice.get("text")
            if not isinstance(ids, list) or not isinstance(text, str):
                self.unprovable = "stop strings, with a chunk without token ids or text"
                return False
            out, stop = self.chunk(ids, text, choice.get("finish_reason") is not None)
            if self.unprovable is not None:
                return False
            choice["text"] = out
            if stop is not None:
                choice["finish_reason"], choice["stop_reason"] = "stop", stop
        return True


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
            min_tokens = int_or(request.body.get("min_tokens"), 0)
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
            if not check.rewrite(chunk):
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
            final = b"" if out is None else b"data: " + vllm_json(out) + b"\n\n"
            return EventAction.DONE, final + (self.closing_usage() or b"") + DONE
        if out is None:
            return EventAction.SKIP, b""
        return EventAction.SEND, b"data: " + vllm_json(out) + b"\n\n"

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
            usage = self.usage = _whole_usage(usage, self._before)
        if any(replayed):
            unseen = _unseen(chunk, replayed)
            if unseen is None:
                return None  # a token the client had: its chunk came, text and all
            chunk = unseen
        if self._as_completion:  # a completion chunk back into a chat chunk
            return _as_chat_chunk(chunk, self.id, self.created, usage, wants_ids)
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
        return b"data: " + vllm_json({
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
        return b"data: " + vllm_json({
            "id": self.id, "object": ("chat.completion.chunk" if self.request.chat
                                      else "text_completion"),
            "created": self.created, "model": self.model, "choices": [],
            "fleetwarden_weight_versions": versions}) + b"\n\n"

    # ------------------------------------------------------------------ the next attempt

    def revealed_cap(self, max_model_len: int | None,
                     completion: CompletionDefault = CompletionDefault.FIXED,
                     ) -> tuple[int, bool] | None:
        """The server cap a whole generation revealed: a ``"length"`` finish below the limit
        asked (vLLM refuses a request past its context: only a cap ends one short). ``(tokens,
        whether it caps every request)``: a chat naming no limit reveals only its default."""
        if (self.mode not in (None, Mode.RESTART) or not self.finished() or not self.ids_complete
                or self.finish_reason != "length" or self.produced_here() is None):
            return None
        prompt = None if self.prompt_ids is None else len(self.prompt_ids)
        asked = output_limit(self.request, prompt, max_model_len, None, completion)
        if isinstance(asked, str) or self.produced >= asked:
            return None
        return self.produced, not self.request.names_no_limit(completion)

    def produced_here(self) -> int | None:
        """Tokens the last attempt made, at least: by ids, else a chunk each but the last."""
        gone = 0 if self.ids_complete or not self.finished() else 1
        counted = int_or(self.request.body.get("n"), 1) == 1
        return max(0, self.produced - self._before - gone) if counted else None

    def ended_by_router(self) -> bool:
        """The router matched a stop string and ended the generation before its engine did."""
        return self.stop_check is not None and self.stop_check.stopped

    def finished(self) -> bool:
        """The generation is whole: its final chunk (``finish_reason`` set) was read, whatever
        became of ``[DONE]``. It is never continued past its end."""
        return len(self.finished_choices) >= max(1, int_or(self.request.body.get("n"), 1))

    def cut(self) -> Cut:
        """What the client has of the stream, read where it was cut: what the request that
        continues it goes on from (:meth:`Cut.continuation`)."""
        check = self.stop_check
        return Cut(request=self.request, prompt_ids=self.prompt_ids, output_ids=self.output_ids,
                   ids_complete=self.ids_complete, produced=self.produced,
                   unwritten=self.unwritten, tail_text=self._tail_text, replay=self._replay,
                   replay_text=self._replay_text, ids_sent=self.ids_sent, text=self.text,
                   stop_seam=None if check is None else check.seam,
                   stop_unprovable=None if check is None else check.unprovable,
                   saw_logprobs=self.saw_logprobs, saw_reasoning=self.saw_reasoning,
                   diverged=self.diverged)


def error_answer(splice: Splice) -> tuple[int, bytes]:
    """The non-streamed answer to a request whose stream ended with an error event of the
    request's own (:attr:`EventAction.CLIENT_ERROR`): its code and its error, as vLLM
    answers a request that fails before it streams."""
    code = splice.error.get("code") if isinstance(splice.error, dict) else None
    return (code if isinstance(code, int) and 400 <= code < 500 else 400,
            vllm_json({"error": splice.error}))


def assembled_answer(splice: Splice) -> bytes:
    """The non-streamed answer, assembled from the stream(s), in vLLM 0.32's shape
    (``completions.http``, ``chat.http``, ``completions-token-ids.http``)."""
    text = "".join(splice.text)
    ids = splice.output_ids if splice.request.wants_ids else None
    prompt_ids = splice.prompt_ids if splice.request.wants_ids else None
    usage = splice.usage or {}
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens", splice.produced)
    whole_usage = {"prompt_tokens": prompt,
                   "total_tokens": None if prompt is None else prompt + completion,
                   "completion_tokens": completion, "prompt_tokens_details": None,
                   "completion_tokens_details": None}
    head = {"id": splice.id,
            "object": "chat.completion" if splice.request.chat else "text_completion",
            "created": splice.created, "model": splice.model}
    if splice.request.chat:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None,
                                   "annotations": None, "audio": None,
                                   "function_call": None, "reasoning": None}
        if splice.saw_reasoning:
            message["reasoning_content"] = "".join(splice.reasoning)
        return vllm_json({**head, "choices": [{
            "index": 0, "message": message, "logprobs": None,
            "finish_reason": splice.finish_reason, "stop_reason": splice.stop_reason,
            "token_ids": ids, "routed_experts": None}],
            "service_tier": None, "system_fingerprint": splice.fingerprint,
            "usage": whole_usage, "prompt_logprobs": None, "prompt_token_ids": prompt_ids,
            "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None,
            "metrics": None})
    return vllm_json({**head, "choices": [{
        "index": 0, "text": text, "logprobs": None, "finish_reason": splice.finish_reason,
        "stop_reason": splice.stop_reason, "token_ids": ids, "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids, "routed_experts": None}],
        "service_tier": None, "system_fingerprint": splice.fingerprint, "usage": whole_usage,
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None})


def _unseen(chunk: dict[str, Any], replayed: tuple[int, int]) -> dict[str, Any] | None:
    """A continuation's chunk less its first ``replayed`` ids and characters, which the client
    had already; ``None`` where it had all of it."""
    choices = []
    for c in chunk.get("choices") or ():
        ids = c.get("token_ids")
        c = {**c, "token_ids": ids[replayed[0]:]} if isinstance(ids, list) else c
        if isinstance(c.get("text"), str):
            c["text"] = c["text"][replayed[1]:]
        text = c.get("text", (c.get("delta") or {}).get("content"))
        if c.get("token_ids") or text or c.get("finish_reason") is not None:
            choices.append(c)
    if chunk.get("choices") and not choices:
        return None
    return {**chunk, "choices": choices}


def _as_chat_chunk(chunk: dict[str, Any], id_: str | None, created: int | None,
                   usage: Any, wants_ids: bool) -> dict[str, Any]:
    """A completion's chunk (a chat continued as a completion) as the chat chunk the client's
    stream goes on with: the stream's ``id_`` and ``created``, the whole generation's
    ``usage``, the token ids only where the client asked for them."""
    out: dict[str, Any] = {"id": id_, "object": "chat.completion.chunk",
                           "created": created, "model": chunk.get("model")}
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


def _whole_usage(usage: dict[str, Any], before: int) -> dict[str, Any]:
    """An attempt's usage as the whole generation's: its prompt held the ``before`` tokens
    produced before it."""
    out = dict(usage)
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        out["prompt_tokens"] = prompt - before
        out["completion_tokens"] = completion + before
        out["total_tokens"] = prompt + completion
    return out
