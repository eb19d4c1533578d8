"""Stop strings across a cut (router/splice.py ``StopCheck``), against an uninterrupted run.

An oracle in pure code: the engine is the simulator's generation (``sim/sampling.py``: vLLM's
detokenizer hold-back and ``check_stop_strings``), each seeded random case runs once whole
and once cut (once or twice) and continued from the :class:`Splice`'s continuation request.
The continued answer must be the uninterrupted one (text, token ids, finish and stop reason)
or a refusal naming its cause; the seed is printed (``FLEETWARDEN_STOP_SEED`` replays).
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from typing import Any

import pytest

from fleetwarden.router.continuation import Mode, read_stream_request
from fleetwarden.router.splice import EventAction, Splice
from fleetwarden.sim import wire
from fleetwarden.sim.sampling import Generation, parse_params

CASES = int(os.environ.get("FLEETWARDEN_STOP_CASES", "1500"))
_TEXT = "".join(wire._PIECES)


def _engine(prompt: list[int], body: dict[str, Any], eos_period: int) -> Generation:
    params = parse_params(body, chat=False, prompt_tokens=len(prompt), max_model_len=4096,
                          reasoning_parser=False)
    assert not isinstance(params, dict), params
    return Generation(list(prompt), params, eos_period=eos_period)


def _events(gen: Generation, per_chunk: int) -> list[bytes]:
    """The engine's stream: a chunk per step of ``per_chunk`` tokens, then ``[DONE]``."""
    events = []
    first = True
    while gen.finish_reason is None:
        for _ in range(per_chunk):
            if gen.sample() is None or gen.finish_reason is not None:
                break
        step = gen.take()
        chunk = wire.completion_chunk("cmpl-1", 1, "tiny", step.text, step.finish_reason,
                                      False, step.token_ids,
                                      gen.prompt_ids if first else None)
        chunk["choices"][0]["stop_reason"] = step.stop_reason
        events.append(b"data: " + wire.dumps(chunk))
        first = False
    return [*events, b"data: [DONE]"]


def _client(out: list[bytes]) -> dict[str, Any]:
    """What the client received, reduced to what must not change."""
    got: dict[str, Any] = {"text": "", "ids": [], "finish": [], "stop_reason": None}
    for data in b"".join(out).split(b"\n\n"):
        if not data.startswith(b"data: ") or data == b"data: [DONE]":
            continue
        chunk = json.loads(data[6:])
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            got["text"] += c.get("text") or ""
            got["ids"] += c.get("token_ids") or []
            if c.get("finish_reason") is not None:
                got["finish"].append(c["finish_reason"])
                got["stop_reason"] = c.get("stop_reason")
    assert b"".join(out).endswith(b"data: [DONE]\n\n")
    return got


def _draw(seed: int, index: int) -> tuple[dict[str, Any], list[int], int, list[int]]:
    rng = random.Random(f"{seed}:{index}")
    stops = []
    for _ in range(rng.randint(1, 3)):
        start = rng.randrange(len(_TEXT) - 12)
        stops.append(_TEXT[start:start + rng.randint(1, 12)])
    body: dict[str, Any] = {"model": "tiny", "prompt": " ".join(
        rng.choice(("steady", "engines", "the", "work", "flow")) for _ in range(3)),
        "stream": True, "return_token_ids": True, "temperature": 0,
        "max_tokens": rng.randint(1, 40), "stop": stops if rng.random() < 0.7 else stops[0]}
    if rng.random() < 0.4:
        body["include_stop_str_in_output"] = True
    if rng.random() < 0.2:
        body["min_tokens"] = rng.randint(1, body["max_tokens"])
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    # Tokens per chunk of the first engine and each continuation's (several: speculative
    # decoding, or chunks merged under load).
    chunking = [rng.choice((1, 1, 1, 2, 3)) for _ in range(3)]
    cuts = [rng.randint(1, 30)] + ([rng.randint(1, 20)] if rng.random() < 0.4 else [])
    return body, chunking, rng.choice((0, 9, 40)), cuts


def _run(seed: int, index: int) -> tuple[str, str]:
    body, chunking, eos_period, cuts = _draw(seed, index)
    prompt = wire.encode(body["prompt"])
    whole = _client([e + b"\n\n" for e in _events(_engine(prompt, body, eos_period),
                                                   chunking[0])])
    read = read_stream_request("/v1/completions", json.dumps(body).encode(), {})
    assert read is not None
    splice = Splice(read)
    out: list[bytes] = []
    events = _events(_engine(prompt, body, eos_period), chunking[0])
    plan = None
    for attempt in range(len(cuts) + 1):
        splice.begin_attempt(plan)
        cut = cuts[attempt] if attempt < len(cuts) else len(events)
        done = False
        for event in events[:cut]:
            action, data = splice.on_event(event)
            assert action is not EventAction.ENGINE_ERROR or splice.stop_check is not None
            if action is EventAction.ENGINE_ERROR:
                break
            out.append(data)
            if action is EventAction.DONE:
                done = True
                break
        if done:
            return "exact" if _client(out) == whole else "inexact", repr(
                (_client(out), whole, body, chunking, cuts))
        if splice.finished():
            return "whole", ""
        next_plan = splice.cut().continuation()
        if isinstance(next_plan, str):
            return "refused", next_plan
        plan = next_plan
        continued = json.loads(plan.body)
        # The router holds the stop check from a seam on; a request sent again whole (nothing
        # of it reached the client) takes its stop strings to the engine, as the first did.
        assert plan.mode is Mode.RESTART or "stop" not in continued, plan
        ids = prompt if plan.mode is Mode.RESTART else continued["prompt"]
        events = _events(_engine(ids, continued, eos_period),
                         chunking[min(attempt + 1, 2)])
    raise AssertionError("unreachable")


SECOND_CUT = ("a second cut, after ids the client had came again with text a stop string held "
              "back")


@pytest.mark.parametrize(("seed", "index"), [(1157693645, 277), (1, 17), (4, 566)])
def test_a_second_cut_after_the_ids_came_again_is_refused_not_sent_again_whole(
        seed: int, index: int) -> None:
    # Seeds the oracle found: the first cut after one token whose text the check held, the
    # second once its id had come again; sent again whole, the client had that id twice.
    assert _run(seed, index) == ("refused", SECOND_CUT)


def test_stop_strings_across_cuts_come_out_as_the_uninterrupted_run() -> None:
    seed = int(os.environ.get("FLEETWARDEN_STOP_SEED") or random.randrange(2**31))
    print(f"\nstop strings across cuts: FLEETWARDEN_STOP_SEED={seed} cases={CASES}")
    verdicts: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    inexact = []
    for index in range(CASES):
        verdict, detail = _run(seed, index)
        verdicts[verdict] += 1
        if verdict == "refused":
            refused[detail] += 1
        elif verdict == "inexact":
            inexact.append((index, detail))
    print(dict(verdicts), dict(refused))
    assert not inexact, f"seed {seed}: {inexact[:3]}"
    # The check proves most of them: refusals only where a match fell inside a chunk of
    # several tokens.
    assert set(refused) <= {"a stop string matched inside a chunk of several tokens (which "
                            "token completed it is unknown)", SECOND_CUT}, refused
    assert verdicts["exact"] > CASES // 2, verdicts


def _begun(body: dict[str, Any], chunks: int) -> tuple[Splice, list[bytes]]:
    """A splice whose first attempt gave its client ``chunks`` chunks (one token each)."""
    read = read_stream_request("/v1/completions", json.dumps(body).encode(), {})
    assert read is not None
    splice = Splice(read)
    splice.begin_attempt(None)
    events = _events(_engine(wire.encode(body["prompt"]), body, 0), 1)
    return splice, [splice.on_event(e)[1] for e in events[:chunks]]


def _go_on(splice: Splice, plan: Any, out: list[bytes]) -> dict[str, Any]:
    """The continuation ``plan`` run to its end; what the client got in all."""
    splice.begin_attempt(plan)
    continued = json.loads(plan.body)
    for event in _events(_engine(continued["prompt"], continued, 0), 1):
        action, data = splice.on_event(event)
        out.append(data)
        if action is EventAction.DONE:
            break
    return _client(out)


def test_the_router_matches_a_stop_string_across_the_cut_and_ends_there() -> None:
    """The match begins in the text the engine held back at the cut and ends in the
    continuation's: the router finds it, ends the generation there, lets the engine go."""
    body: dict[str, Any] = {"model": "tiny", "prompt": "the", "stream": True,
                            "temperature": 0, "max_tokens": 30}
    text = _engine(wire.encode("the"), body, 0)
    while text.sample() is not None:
        pass
    # a stop string spanning tokens 4 and 5 of the uninterrupted output
    pieces = [wire.piece(t) for t in text.output]
    stop = pieces[3][-2:] + pieces[4][:2]
    body["stop"] = [stop]
    whole = _client([e + b"\n\n" for e in _events(_engine(wire.encode("the"), body, 0), 1)])
    assert whole["stop_reason"] == stop
    splice, out = _begun(body, 4)
    plan = splice.cut().continuation()
    assert not isinstance(plan, str) and plan.held_stop
    got = _go_on(splice, plan, out)
    assert splice.ended_by_router()
    assert {k: got[k] for k in ("text", "finish", "stop_reason")} == {
        k: whole[k] for k in ("text", "finish", "stop_reason")}


def test_a_cut_before_the_tokens_generated_again_came_goes_on_from_the_seam() -> None:
    """Cut again before any of the tokens to be generated again came: the client had their
    chunks (and some of their text), so the request is not sent again from the start (it
    would write that text twice); it goes on from the seam again."""
    body = {"model": "tiny", "prompt": "the", "stream": True, "temperature": 0,
            "max_tokens": 30, "stop": ["zzzzzzzzzzzz"], "return_token_ids": True}
    splice, out = _begun(body, 4)
    assert _client([*out, b"data: [DONE]\n\n"])["text"]  # the client has some text
    plan = splice.cut().continuation()
    assert not isinstance(plan, str) and plan.replay and plan.held_stop
    splice.begin_attempt(plan)
    assert splice.produced == 0
    again = splice.cut().continuation()  # cut before its first chunk
    assert not isinstance(again, str) and again.mode is plan.mode and again.replay == plan.replay
    whole = _client([e + b"\n\n" for e in _events(_engine(wire.encode("the"), body, 0), 1)])
    assert _go_on(splice, again, out) == whole
