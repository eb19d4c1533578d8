"""What continuing streams costs the router: CPU per token chunk in router/splice.py.

A continuable stream is relayed event by event (each event parsed, the ids the router asked
for stripped); a continued one is rewritten; a non-streamed answer with ``continue_answers`` is
assembled from a stream. This times those pure parts on real vLLM 0.32 chunks (the captures in
tests/fixtures/vllm/continuation-and-sleep/), one core, no I/O, in CPU time: the router's
added CPU per generated token.

    python bench/splice_cost.py [--tokens 200000]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from fleetwarden.router.continuation import Continuation, Mode, read_stream_request
from fleetwarden.router.splice import Splice, SseSplitter

CAPTURES = Path(__file__).resolve().parent.parent / "tests/fixtures/vllm/continuation-and-sleep"


def _events(name: str) -> list[bytes]:
    body = (CAPTURES / name).read_bytes().split(b"\n\n", 2)[2]
    return [e for e in body.split(b"\n\n") if e and e != b"data: [DONE]"]


def _per_token(label: str, tokens: int, run: object) -> float:
    assert callable(run)
    start = time.process_time()  # CPU time: on a shared machine, wall time is others' too
    run()
    us = (time.process_time() - start) / tokens * 1e6
    print(f"{label:58} {us:6.2f} µs CPU per token chunk ({1e6 / us / 1000:4.0f}k/s per core)")
    return us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=200_000)
    args = parser.parse_args()
    n = args.tokens
    first, *rest = _events("completions-stream-token-ids.http")
    token_event = rest[0]  # a mid-stream chunk: one token, its ids the router asked for
    wire = b"".join(e + b"\n\n" for e in [first] + [token_event] * (n - 1))
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": n, "stream": True}

    def split_only() -> None:
        splitter = SseSplitter()
        for i in range(0, len(wire), 4096):
            splitter.feed(wire[i:i + 4096])

    def first_attempt() -> None:
        read = read_stream_request("/v1/completions", json.dumps(body).encode(), {})
        assert read is not None
        splice = Splice(read)
        splice.begin_attempt(None)
        splitter = SseSplitter()
        for i in range(0, len(wire), 4096):
            for event in splitter.feed(wire[i:i + 4096]):
                splice.on_event(event)

    def continued() -> None:
        read = read_stream_request("/v1/completions", json.dumps(body).encode(), {})
        assert read is not None
        splice = Splice(read)
        splice.begin_attempt(None)
        splice.on_event(first)
        splice.begin_attempt(Continuation("/v1/completions", b"", Mode.TOKENS, False))
        for _ in range(n):
            splice.on_event(token_event)

    def chat_from_completion() -> None:
        chat = {"model": "tiny", "messages": [], "max_tokens": n, "stream": True}
        read = read_stream_request("/v1/chat/completions", json.dumps(chat).encode(), {})
        assert read is not None
        splice = Splice(read)
        splice.begin_attempt(None)
        splice.begin_attempt(Continuation("/v1/completions", b"", Mode.TOKENS, True))
        for _ in range(n):
            splice.on_event(token_event)

    print(f"{n} token chunks of real vLLM 0.32 streams ({len(token_event)} bytes each)")
    _per_token("cut into SSE events only", n, split_only)
    _per_token("first attempt: parsed, added ids stripped (every stream)", n, first_attempt)
    _per_token("continued completion: rewritten (after a failure only)", n, continued)
    _per_token("chat continued as a completion: turned into chat chunks", n,
               chat_from_completion)


if __name__ == "__main__":
    main()
