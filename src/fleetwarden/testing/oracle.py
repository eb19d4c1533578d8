"""The exactness oracle's pure half: random requests, random cuts, each answer's exactness (no I/O).

Owns: what a case is (a request as clients send them, and how its engine is cut), what a
client received, reduced to what must not change (text, token ids when asked, finish and stop
reason, usage, logprobs, reasoning), and its exactness: exact, refused, or inexact.
Must not: do I/O (``fleetwarden.testing.oracle_rig`` runs the cases).

A continued answer is worth having only if it is the answer the client would have had: each
case runs once uninterrupted (the reference) and once through the router with its engine cut
(a crash, a reset, a wedge rescued, a cut after the final chunk, a cut inside a chunk). The
second must end in exactly one of two ways: the reference, or the documented refusal (an error
event of type ``stream_interrupted`` naming the cause). Anything else is ``inexact``: a third
outcome the router must never produce (docs/design.md, "Continuing a generation").

Cases are drawn from ``random.Random(f"{seed}:{index}")``: any one replays alone from its seed
and index.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

__all__ = ["CUTS", "Case", "Exactness", "compare", "draw", "normalize"]

#: How an engine is cut: ``fleetwarden.sim.server``'s per-request fault directives.
CUTS = ("crash", "reset", "wedge", "split", "after_final")
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

_WORDS = ("tell", "me", "about", "engines", "and", "tokens", "the", "router", "keeps",
          "serving", "while", "steps", "flow", "a", "model", "busy")
#: Stop strings likely to occur in the simulated model's output (its word pieces), some
#: spanning two pieces, some inside one.
_STOPS = (" the", " engine", " takes a", ",", " is busy", "ow", " st", "s.", "\n", " and ev",
          " model serves", "e")
_PIECE_IDS = tuple(range(257, 289))


@dataclass(frozen=True, slots=True)
class Case:
    seed: int
    index: int
    path: str
    body: dict[str, Any]
    cut: str  # one of CUTS
    cut_after: int  # token chunks the engine writes before the cut
    #: Sent to the engines started with a server cap (``--override-generation-config``).
    capped: bool = False
    #: Sent to the engines whose model's ``generation_config.json`` sets the default limit of
    #: a chat that names none (vLLM's ``--generation-config auto``).
    defaulted: bool = False

    @property
    def chat(self) -> bool:
        return self.path == CHAT

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    @property
    def held_back(self) -> bool:
        """Its stop strings hold text back while they might begin (vLLM's detokenizer)."""
        return bool(self.body.get("stop")) and not self.body.get("include_stop_str_in_output")

    @property
    def kind(self) -> str:
        """greedy, sampled or seeded (sampled with a seed); ``capped`` appended where it went
        to the engines with a server cap, ``defaulted`` to those with a model default."""
        sampled = self.body.get("temperature") not in (0, None)
        kind = ("seeded" if self.body.get("seed") is not None else "sampled") if sampled else (
            "greedy")
        return kind + (", capped" if self.capped else "") + (
            ", defaulted" if self.defaulted else "")

    def describe(self) -> str:
        return (f"seed={self.seed} index={self.index} {self.path} cut={self.cut}@"
                f"{self.cut_after}{' capped' if self.capped else ''}"
                f"{' defaulted' if self.defaulted else ''} "
                f"body={json.dumps(self.body, sort_keys=True)}")


def _prompt(rng: random.Random, chat: bool, real: bool) -> dict[str, Any]:
    """A case's prompt: a few words, as a chat's messages (now and then a system message, or
    an image beside the words where not ``real``) or a completion's prompt."""
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 6)))
    if not chat:
        return {"prompt": words}
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "be brief"})
    if rng.random() < 0.05 and not real:  # multimodal: an image beside the text
        messages.append({"role": "user", "content": [
            {"type": "text", "text": words},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]})
    else:
        messages.append({"role": "user", "content": words})
    return {"messages": messages}


def draw(seed: int, index: int, model: str = "tiny", *, real: bool = False,
         sampling: bool = True) -> Case:
    """Case ``index`` of the run seeded ``seed``: what clients really send, cut somewhere.
    ``real``: for a real engine serving a text-only model with no reasoning parser nor tool
    parser (no images, tools, structured output, thinking, or the simulator's stop strings
    and token ids; a stop string is then ``"<from the reference>"``, for the caller to take
    from the reference's text). ``sampling``: a third of the cases at a temperature above 0,
    half of them with a ``seed`` (on a real engine all of them: an unseeded sample repeats
    nothing to compare with); a quarter (not ``real``) go to the engines with a server cap,
    a quarter of the rest to those with a model default."""
    rng = random.Random(f"{seed}:{index}")
    chance = rng.random
    chat = chance() < 0.5
    body: dict[str, Any] = {"model": model, **_prompt(rng, chat, real)}
    stream = chance() < 0.8
    if stream:
        body["stream"] = True
        if chance() < 0.5:
            body["stream_options"] = {"include_usage": True}
    limit = None
    roll = chance()
    if roll < 0.5:
        limit = rng.randint(1, 48)
        body["max_tokens"] = limit
    elif chat and roll < 0.65:
        limit = rng.randint(1, 48)
        body["max_completion_tokens"] = limit
    if chance() < (0.5 if real else 0.25):
        body["stop"] = ["<from the reference>"] if real else rng.sample(_STOPS,
                                                                       rng.randint(1, 2))
        if chance() < 0.3:
            body["include_stop_str_in_output"] = True
    if chance() < 0.15 and not real:
        body["stop_token_ids"] = rng.sample(_PIECE_IDS, rng.randint(1, 2))
    if chance() < 0.15:
        body["min_tokens"] = rng.randint(1, min(8, limit or 8))
    if chance() < 0.1:
        body["ignore_eos"] = True
    if chance() < 0.15:
        body[rng.choice(("presence_penalty", "frequency_penalty"))] = rng.choice((0.5, 1.5))
    if chance() < 0.15:
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 3)
        else:
            body["logprobs"] = rng.randint(0, 3)
    several = chance() < 0.05
    if several:
        body["n"] = 2
    if chance() < 0.05 and not real:
        if chat:
            body["tools"] = [{"type": "function", "function": {
                "name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
        else:
            body["response_format"] = {"type": "json_object"}
    if chat and chance() < 0.15 and not real:
        body["chat_template_kwargs"] = {"enable_thinking": True}
    if chance() < 0.2:
        body["return_token_ids"] = True
    # Greedy, so that a request has one answer; several choices of a greedy sample vLLM
    # refuses, so those sample, seeded.
    body.update({"temperature": 0.5, "seed": 7} if several else {"temperature": 0})
    cut = rng.choice(CUTS)
    # Mostly inside what the generation will produce (its limit, or vLLM's default of 16 for a
    # completion), now and then past a short one's end: then it runs whole, and must be exact.
    cut_after = rng.randint(0, max(0, min(limit or 16, 24) - 1))
    # Drawn apart, so that the draws above (and the cases kept by seed and index) stay as
    # they were before these were added.
    more = random.Random(f"{seed}:{index}:sampling")
    if sampling and not several and more.random() < 1 / 3:
        body["temperature"] = more.choice((0.6, 1.0))
        if real or more.random() < 0.5:
            body["seed"] = more.randrange(2**31)
    capped = not real and more.random() < 0.25
    defaulted = not real and not capped and more.random() < 0.25
    return Case(seed, index, CHAT if chat else COMPLETIONS, body, cut, cut_after, capped,
                defaulted)


# ---------------------------------------------------------------------- what the client got


@dataclass(frozen=True, slots=True)
class Exactness:
    """How a cut case's answer compares with its uninterrupted reference."""

    #: ``exact``, ``refused`` or ``inexact``.
    outcome: str
    #: The refusal's reason, or what differs.
    detail: str = ""


def normalize(status: int, body: bytes, *, chat: bool, stream: bool,
              held_back: bool = False) -> Any:
    """What must not change in an answer, as comparable data; a refusal as
    ``("refused", reason)``; a malformed stream as ``("malformed", why)``. ``held_back``: the
    request's stop strings hold text back (its logprob offsets follow the engine's chunks)."""
    answer = _normalize(status, body, chat=chat, stream=stream)
    if isinstance(answer, dict):
        answer["held_back"] = held_back and stream
    return answer


def _normalize(status: int, body: bytes, *, chat: bool, stream: bool) -> Any:
    if status != 200:
        return _error_answer(status, body)
    if not stream:
        return _normalize_answer(body, chat)
    text = body.decode("utf-8", "replace")
    if not text.endswith("data: [DONE]\n\n"):
        return ("malformed", "no [DONE] at the end", text[-200:])
    events = text.split("\n\n")[:-1]
    if events.count("data: [DONE]") != 1:
        return ("malformed", "[DONE] more than once")
    chunks = []
    for event in events[:-1]:
        if not event.startswith("data: "):
            return ("malformed", "not a data event", event[:200])
        chunk = json.loads(event[6:])
        if "error" in chunk:
            error = chunk["error"]
            if error.get("type") == "stream_interrupted" and error.get("reason"):
                return ("refused", error["reason"])
            return ("malformed", "an error event that names no cause", error)
        chunks.append(chunk)
    if len({c.get("id") for c in chunks}) != 1 or len({c.get("created") for c in chunks}) != 1:
        return ("malformed", "more than one id or created in one stream")
    choices: dict[int, dict[str, Any]] = {}
    usage = []
    prompt_ids = []
    roles = 0
    for chunk in chunks:
        if chunk.get("usage"):
            usage.append(_usage(chunk["usage"]))
        if chunk.get("prompt_token_ids"):
            prompt_ids.append(chunk["prompt_token_ids"])
        for c in chunk.get("choices") or ():
            out = choices.setdefault(c["index"], {"text": "", "reasoning": "", "ids": [],
                                                  "finish": [], "stop_reason": None,
                                                  "logprobs": []})
            if c.get("prompt_token_ids"):
                prompt_ids.append(c["prompt_token_ids"])
            if out["finish"] and out["finish"][-1] is not None:
                return ("malformed", "a chunk after the choice's finish")
            delta = c.get("delta")
            if chat:
                if "role" in delta:
                    roles += 1
                out["text"] += delta.get("content") or ""
                out["reasoning"] += (delta.get("reasoning_content") or delta.get("reasoning")
                                     or "")
            else:
                out["text"] += c.get("text") or ""
            out["ids"] += c.get("token_ids") or []
            if c.get("finish_reason") is not None:
                out["finish"].append(c["finish_reason"])
                out["stop_reason"] = c.get("stop_reason")
            if c.get("logprobs"):
                out["logprobs"].append(c["logprobs"])
    if chat and roles != len(choices):
        return ("malformed", f"{roles} role chunks for {len(choices)} choices")
    if len(usage) > 1:
        return ("malformed", "usage more than once")
    shaped = {}
    for index, out in sorted(choices.items()):
        if len(out["finish"]) != 1:
            return ("malformed", f"choice {index} finished {len(out['finish'])} times")
        shaped[index] = {"text": out["text"], "reasoning": out["reasoning"], "ids": out["ids"],
                         "finish_reason": out["finish"][0], "stop_reason": out["stop_reason"],
                         "logprobs": _merge_logprobs(out["logprobs"], chat)}
    return {"choices": shaped, "usage": usage, "prompt_token_ids": prompt_ids}


def _merge_logprobs(parts: list[dict[str, Any]], chat: bool) -> Any:
    if not parts:
        return None
    if chat:
        return [entry for p in parts for entry in p.get("content") or ()]
    merged: dict[str, list[Any]] = {}
    for p in parts:
        for key, values in p.items():
            merged.setdefault(key, []).extend(values)
    return merged


def _usage(usage: dict[str, Any]) -> tuple[Any, Any, Any]:
    return usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens")


def _error_of(body: bytes) -> Any:
    try:
        return json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace")


def _error_answer(status: int, body: bytes) -> Any:
    error = _error_of(body)
    if status >= 500 and isinstance(error, dict) and error.get("cause"):
        # The router's own answer where nothing had reached the client and it could not start
        # again (no engine left to try): a refusal that names its cause.
        return ("refused", f"{error.get('type')}: {error['cause']}")
    return ("status", status, error)


def _normalize_answer(body: bytes, chat: bool) -> Any:
    answer = json.loads(body)
    shaped = {}
    for c in answer["choices"]:
        if chat:
            message = c["message"]
            text = message.get("content") or ""
            reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
        else:
            text, reasoning = c.get("text") or "", ""
        shaped[c["index"]] = {"text": text, "reasoning": reasoning,
                              "ids": c.get("token_ids") or [],
                              "finish_reason": c.get("finish_reason"),
                              "stop_reason": c.get("stop_reason"),
                              "logprobs": c.get("logprobs")}
    return {"choices": shaped, "usage": [_usage(answer.get("usage") or {})],
            "prompt_token_ids": answer.get("prompt_token_ids")}


def compare(reference: Any, got: Any) -> Exactness:
    """Exact, refused (with its reason), or inexact (with what differs)."""
    if isinstance(reference, tuple) and reference[0] == "status" and 400 <= reference[1] < 500:
        # The engine refuses the request itself: through the router, the same refusal.
        return Exactness("exact" if got == reference else "inexact", f"{got!r}")
    if isinstance(reference, tuple):
        return Exactness("inexact", f"the reference itself failed: {reference!r}")
    if isinstance(got, tuple) and got[0] == "refused":
        return Exactness("refused", str(got[1]))
    if got == reference:
        return Exactness("exact")
    if _same_but_offsets(reference, got):
        return Exactness("exact")
    return Exactness("inexact", _difference(reference, got))


def _same_but_offsets(reference: Any, got: Any) -> bool:
    """Equal but for a completion's logprob ``text_offset`` where a stop string holds text
    back: vLLM counts each chunk's offsets from the text it has sent, so with text held back
    they follow where the engine's chunks fell (its step timing), which differs from engine
    to engine even uninterrupted. Everything else must be equal."""
    if not isinstance(got, dict) or not got.get("held_back"):
        return False

    def without(answer: dict[str, Any]) -> Any:
        return {**answer, "choices": {
            i: {**c, "logprobs": None if c["logprobs"] is None else {
                k: v for k, v in c["logprobs"].items() if k != "text_offset"}}
            for i, c in answer["choices"].items()}}

    return bool(without(reference) == without(got))


def _difference(reference: Any, got: Any) -> str:
    if not isinstance(got, dict):
        return f"got {got!r}"
    for key in ("usage", "prompt_token_ids"):
        if got.get(key) != reference.get(key):
            return f"{key}: {got.get(key)!r} != reference {reference.get(key)!r}"
    ref_choices, choices = reference["choices"], got["choices"]
    if set(ref_choices) != set(choices):
        return f"choices {sorted(choices)} != reference {sorted(ref_choices)}"
    for index, ref in ref_choices.items():
        for key, value in ref.items():
            if choices[index][key] != value:
                return (f"choice {index} {key}: {choices[index][key]!r} != reference "
                        f"{value!r}")
    return "differs"
