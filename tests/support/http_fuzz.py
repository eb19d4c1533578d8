"""Generated HTTP/1.1 requests, valid and not, and h11's verdict on each (the reference the
data port's decisions are checked against: tests/scenario/test_hostile_fuzz.py).

A case is built from parts, each chosen at random from what clients, proxies and attackers
send: methods, targets, versions, Host and framing headers (lengths, chunking, both, twice),
line endings, folded and malformed lines, chunk sizes. Pure: the same seed gives the same
cases.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

import h11


class Verdict(enum.Enum):
    ACCEPT = "accept"  # a whole request, to be served
    REJECT = "reject"  # an error: 4xx and close
    INCOMPLETE = "incomplete"  # the parser waits for more: no answer but a timeout's


@dataclass(frozen=True)
class Case:
    ident: str
    data: bytes
    #: What the parts were (for the report of a mismatch, and for the router's own rules).
    parts: tuple[str, ...]


def h11_verdict(data: bytes) -> Verdict:
    """What h11, as a server, makes of ``data`` (one request, the connection kept open)."""
    conn = h11.Connection(h11.SERVER)
    try:
        conn.receive_data(data)
        request = False
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                return Verdict.INCOMPLETE
            if isinstance(event, h11.Request):
                request = True
            if isinstance(event, h11.EndOfMessage) and request:
                return Verdict.ACCEPT
            if event is h11.PAUSED:
                # h11 stops at an upgrade or CONNECT: the request itself was whole.
                return Verdict.ACCEPT
    except h11.RemoteProtocolError:
        return Verdict.REJECT


_METHODS = [("POST", "method"), ("GET", "method"), ("P@ST", "bad method"),
            ("POST ", "double space")]
_TARGETS = [("/v1/completions", "target"), ("/v1/completions?x=1", "target"),
            ("http://example/v1/completions", "absolute-form"),
            ("/v1/comp letions", "bad target"), ("/v1/compl\x01etions", "bad target"),
            ("*", "asterisk-form")]
_VERSIONS = [("HTTP/1.1", "1.1"), ("HTTP/1.0", "1.0"), ("HTTP/1.1 ", "bad version"),
             ("HTTP/9.9", "unknown version"), ("HTTX/1.1", "bad version")]


def generate(seed: int, count: int) -> list[Case]:
    """``count`` cases from ``seed``; ``ident`` is in each (an ``X-Case`` header), so that
    the answer to each can be told apart."""
    rng = random.Random(seed)
    return [_case(rng, f"{seed}-{i}") for i in range(count)]


def _case(rng: random.Random, ident: str) -> Case:
    parts: list[str] = []

    def pick(options: list[tuple[str, str]], usual: float = 0.75) -> str:
        value, what = options[0] if rng.random() < usual else rng.choice(options[1:])
        parts.append(what)
        return value

    method = pick(_METHODS)
    target = pick(_TARGETS)
    if method == "GET":  # the route a GET is forwarded on (the body is read all the same)
        target = target.replace("/v1/completions", "/v1/models")
    version = pick(_VERSIONS, 0.85)
    eol = b"\r\n"
    headers: list[bytes] = []
    hosts = rng.choices([1, 0, 2], [0.85, 0.075, 0.075])[0]
    if hosts != 1:
        parts.append(f"{hosts} hosts")
    headers += [b"Host: router"] * hosts
    headers.append(b"X-Case: " + ident.encode())
    body = b'{"prompt": "%b"}' % ident.encode()
    framing = rng.choices(
        ["length", "chunked", "none", "two equal lengths", "two lengths", "length and chunked",
         "bad length", "negative length", "plus length", "chunked twice", "gzip then chunked",
         "bad chunk size", "chunk extension", "trailer"],
        [40, 15, 5, 3, 3, 3, 3, 2, 2, 2, 2, 3, 2, 3])[0]
    parts.append(framing)
    if method == "GET" and framing == "length" and rng.random() < 0.5:
        body = b""
    wire = body
    if framing in ("length", "none"):
        if framing == "length":
            headers.append(b"Content-Length: %d" % len(body))
        else:
            wire = b""
    elif framing == "two equal lengths":
        headers += [b"Content-Length: %d" % len(body)] * 2
    elif framing == "two lengths":
        headers += [b"Content-Length: %d" % len(body), b"Content-Length: %d" % (len(body) + 1)]
    elif framing == "bad length":
        headers.append(b"Content-Length: 1x")
    elif framing == "negative length":
        headers.append(b"Content-Length: -%d" % len(body))
    elif framing == "plus length":
        headers.append(b"Content-Length: +%d" % len(body))
    else:
        chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
        if framing == "bad chunk size":
            chunked = b"%xg\r\n%b\r\n0\r\n\r\n" % (len(body), body)
        elif framing == "chunk extension":
            chunked = b"%x;ext=1\r\n%b\r\n0\r\n\r\n" % (len(body), body)
        elif framing == "trailer":
            chunked = b"%x\r\n%b\r\n0\r\nX-Trailer: t\r\n\r\n" % (len(body), body)
        wire = chunked
        te = {"chunked twice": b"chunked, chunked", "gzip then chunked": b"gzip, chunked"}
        headers.append(b"Transfer-Encoding: " + te.get(framing, b"chunked"))
        if framing == "length and chunked":
            headers.append(b"Content-Length: %d" % len(body))
    line = rng.choices(["crlf", "bare lf", "obs-fold", "space before colon", "nul in value",
                        "bad name", "empty name", "bare cr"], [80, 3, 3, 3, 3, 3, 2, 3])[0]
    if line != "crlf":
        parts.append(line)
        extra = {"obs-fold": b"X-Fold: a\r\n b", "space before colon": b"X-Space : a",
                 "nul in value": b"X-Nul: a\x00b", "bad name": b"X(Bad): a",
                 "empty name": b": a", "bare cr": b"X-Cr: a\rb", "bare lf": b"X-Lf: a\nX-B: b"}
        headers.insert(rng.randrange(len(headers) + 1), extra[line])
    head = f"{method} {target} {version}".encode("latin-1") + eol + eol.join(headers) + eol
    return Case(ident, head + eol + wire, tuple(parts))
