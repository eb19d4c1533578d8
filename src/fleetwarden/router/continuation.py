"""Continuing a streamed generation on another engine: the requests sent upstream (pure).

Owns: what goes upstream for a stream the router may continue: the first attempt's request,
read from the client's, and the request that continues it after a cut, or why there is none.
Must not: do I/O or read a clock (pure); read an engine's events (:mod:`fleetwarden.router.
splice` rewrites them, and hands this module what the client has, :class:`Cut`).

* :func:`read_stream_request`: is a request a streamed completion or chat, may it be continued
  (and if not, why), and the body to send upstream (``return_token_ids`` added, so that the
  engine says which tokens it produced).
* :meth:`Cut.continuation`: the request that goes on from what the client has, keeping the
  limits of the engine that began the generation (:func:`output_limit`, :class:`UnknownCap`).

Two ways to continue, and the metrics say which one happened (:class:`Mode`):

* ``tokens`` (exact): where the engine gave token ids (vLLM's ``return_token_ids``), the
  continuation is a completion whose ``prompt`` is the prompt's ids plus the output's ids: a
  chat continues from its rendered template, as a completion, and its chunks are turned back
  into chat chunks.
* ``text``: where it did not, a completion continues from its prompt plus the text produced so
  far, a chat from the partial assistant message with ``continue_final_message``. The output
  may differ from an uninterrupted run where the text does not re-tokenize to the same tokens.

A request is not continuable where a continuation cannot be exact or is not allowed: several
choices (``n`` > 1, ``best_of``, several prompts), ``echo``, prompt logprobs, structured output
or tools (their grammar state would restart), or a client that opted out with
:data:`OPT_OUT_HEADER`. Such a stream, cut after its first bytes, ends with an error event in
the OpenAI shape naming the cause, never silently.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleetwarden.router.pool import CompletionDefault

__all__ = ["CHAT", "COMPLETIONS", "OPT_OUT_HEADER", "Continuation", "Cut", "Mode",
           "StreamRequest", "UnknownCap", "int_or", "output_limit", "read_stream_request",
           "stop_strings", "vllm_json"]

#: A client that wants a cut stream to end rather than go on elsewhere sends this header with
#: ``off`` (or ``0``, ``false``, ``no``).
OPT_OUT_HEADER = "x-fleetwarden-continuation"
_OFF = frozenset({"off", "0", "false", "no"})

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

#: vLLM's and SGLang's ``max_tokens`` for a completion that names none (a chat's is the
#: engine's default, else the context left): :attr:`CompletionDefault.FIXED`.
COMPLETION_DEFAULT_MAX_TOKENS = 16

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

    def names_no_limit(self, completion: CompletionDefault = CompletionDefault.FIXED) -> bool:
        """A request that gets its engine's default limit: a chat naming neither
        ``max_tokens`` nor ``max_completion_tokens``, a completion naming no ``max_tokens``
        where ``completion`` (the rule of the engine it began on) is that default."""
        body = self.body
        if not self.chat:
            return completion is CompletionDefault.ENGINE and body.get("max_tokens") is None
        return body.get("max_tokens") is None and body.get("max_completion_tokens") is None


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
        upstream = vllm_json({**plain, "return_token_ids": True})
        return StreamRequest(chat, parsed, None, wants_ids, upstream, assemble=True,
                             plain_body=vllm_json(plain))
    upstream = body
    if refusal is None and not wants_ids:
        upstream = vllm_json({**parsed, "return_token_ids": True})
    return StreamRequest(chat, parsed, refusal, wants_ids, upstream, plain_body=body)


def _refusal(body: Mapping[str, Any], chat: bool, opted_out: bool) -> str | None:
    if opted_out:
        return f"the client opted out ({OPT_OUT_HEADER})"
    if int_or(body.get("n"), 1) > 1 or int_or(body.get("best_of"), 1) > 1:
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


def int_or(value: Any, default: int) -> int:
    """A request's count as vLLM reads it (``n``, ``min_tokens``): an int, else ``default``;
    one reading for what goes upstream and what the client is told."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def vllm_json(obj: Any) -> bytes:
    """JSON as vLLM writes it: compact, raw UTF-8 (upstream and to the client alike)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Continuation:
    """The request that continues a stream: where, what, and how."""

    path: str
    body: bytes
    mode: Mode
    #: The engine's chunks are completions, to be turned back into chat chunks.
    as_completion: bool
    #: The output's last token ids, whose text the engine had not written when it was cut:
    #: left out of the prompt, generated again, and not sent twice (:meth:`Cut.continuation`).
    replay: tuple[int, ...] = ()
    #: The text the client had of those tokens: not sent twice either.
    replay_text: str = ""
    #: The request's stop strings are the router's to check on this attempt (it is sent
    #: without them): :class:`~fleetwarden.router.splice.StopCheck`.
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


#: A continuation cut again once the ids it was to give again had come, with the text a stop
#: check holds: the client has ids the count no longer shows, and sent again whole, it would
#: get them twice.
_SECOND_CUT = ("a second cut, after ids the client had came again with text a stop string "
               "held back")


@dataclass(frozen=True, slots=True)
class Cut:
    """What the client has of a stream where it was cut, read off its
    :class:`~fleetwarden.router.splice.Splice` (:meth:`~fleetwarden.router.splice.Splice.cut`):
    all that the request that continues it (:meth:`continuation`) goes on from. It is read at
    the cut and planned from at once: its lists are the splice's own, not copies (a cut is
    rare, but a long output's ids are many)."""

    request: StreamRequest
    #: The prompt's token ids (``None``: none came) and the output's, as the engine gave them;
    #: ``ids_complete``: every output chunk carried its ids.
    prompt_ids: list[int] | None
    output_ids: list[int]
    ids_complete: bool
    #: Tokens produced (ids counted, or one per chunk where the engine gave none).
    produced: int
    #: The output's last tokens, whose text the engine had not written yet, and the text that
    #: came with them (:attr:`Continuation.replay`).
    unwritten: int
    tail_text: str
    #: Ids, and their text, that the attempt cut had yet to give again: the client had them.
    replay: list[int]
    replay_text: str
    #: Token ids of the output reached the client: the request cannot be sent again whole.
    ids_sent: bool
    #: The client's text, chunk by chunk.
    text: list[str]
    #: Where the request has stop strings, the stop check's last seam (tokens, characters), and
    #: why it could not prove where vLLM would have cut, if it could not (``stop_seam`` is
    #: ``None``: no stop strings).
    stop_seam: tuple[int, int] | None
    stop_unprovable: str | None
    saw_logprobs: bool
    saw_reasoning: bool
    #: A token generated again came out otherwise than the client had it.
    diverged: bool

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
        if self.produced == 0 and not self.replay:
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
        replay_text = self.tail_text + self.replay_text
        replay = (*self.output_ids[len(self.output_ids) - self.unwritten:], *self.replay) if (
            from_ids and (self.unwritten or self.replay)) else ()
        produced = self.produced - self.unwritten if replay else self.produced
        seam = self.stop_seam
        if seam is not None:
            # The router holds the stop check from here (the splice's ``StopCheck``): the
            # prompt of ids stops at the seam, and the tokens after it are generated again.
            if not from_ids:
                return ("stop strings, without token ids to go on from (the text held back "
                        "at the cut, and a match across it)")
            seam_tokens, seam_chars = seam
            replay = (*self.output_ids[seam_tokens:], *self.replay)
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
                   or self._refused_fields(body, exact, bool(replay), seam is not None,
                                           upstream_fields))
        if refusal is not None:
            return refusal
        again = len(replay) - len(self.replay) if replay else 0  # output ids made again
        ids = (self.prompt_ids or []) + self.output_ids[:len(self.output_ids) - again]
        held = seam is not None
        if exact and request.chat and chat_as_completion:
            plain = {k: body[k] for k in _CHAT_TO_COMPLETION if k in body}
            plain.update(prompt=ids, stream=True,
                         return_token_ids=True, max_tokens=body["max_tokens"])
            return Continuation(COMPLETIONS, vllm_json(plain), Mode.TOKENS, True, replay,
                                replay_text if replay else "", held)
        if exact and not request.chat:
            body["prompt"] = ids
            return Continuation(COMPLETIONS, vllm_json(body), Mode.TOKENS, False, replay,
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
            return Continuation(COMPLETIONS, vllm_json(body), Mode.TEXT, False)
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
        return Continuation(CHAT, vllm_json(body), Mode.TEXT, False)

    def _inexact(self) -> str | None:
        """Why a continuation from here could not be proven the same answer, if it could not.
        Each is a state the engine kept that a new prompt does not carry."""
        body = self.request.body
        if stop_strings(body) is None:
            return "stop strings that are not strings"
        if self.stop_unprovable is not None:
            return self.stop_unprovable
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
