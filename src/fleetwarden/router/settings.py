"""The router's settings: every default in one place, each with its reason (docs/design.md 4).

Owns: every router default with its reason, and the checks on them.
Must not: do I/O (pure).

Pure: no I/O. A setting that is out of range is an error naming the field and what it allows.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "FORBIDDEN_STATUS", "GENERATE", "MIN_VERSION_HEADER",
           "ROUTING_POLICIES", "SHARD_HEADER", "WEIGHT_VERSIONS_HEADER", "WEIGHT_VERSION_HEADER",
           "RouterSettings"]

#: Where ``fleetwarden route`` listens unless told otherwise. Loopback: exposing a fleet is a
#: decision (``--host 0.0.0.0``), never an accident.
DEFAULT_HOST = "127.0.0.1"
#: 8080, not vLLM's 8000: the router often runs on a host whose engines use 8000 and up.
DEFAULT_PORT = 8080

#: The one status the router never answers with: clients (NeMo-Gym among them) retry a 504
#: without bound, so a wedged engine would turn into an endless retry loop.
FORBIDDEN_STATUS = 504

#: On every answer an engine produced through the router: the weight version the controller's
#: last push gave that engine, and its shard index (an RL trainer must know which policy
#: produced each rollout). Left off when the push did not say (a router nobody manages).
WEIGHT_VERSION_HEADER = "x-fleetwarden-weight-version"
SHARD_HEADER = "x-fleetwarden-shard"
#: vLLM's token-in/token-out endpoint: each finished choice reports ``weight_versions``
#: spans (the engine's own word on which weights sampled which tokens).
GENERATE = "/inference/v1/generate"
#: In its place on an answer whose engine loaded other weights while it was there (a ``keep``
#: pause): every version that may have produced its tokens, in order, comma-separated.
WEIGHT_VERSIONS_HEADER = "x-fleetwarden-weight-versions"
#: A request carrying it (an integer >= 0) is only ever sent to an engine whose weight version
#: is at least that; when none is, the router answers ``status_when_none_left`` itself.
MIN_VERSION_HEADER = "x-fleetwarden-min-weight-version"

#: The routing policies a router knows (``RouterSettings.routing``).
ROUTING_POLICIES = ("cache_aware", "least_in_flight")


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """How the router forwards, retries and answers when it cannot serve."""

    #: Total time one attempt on a backend may take, headers to last byte. Long: a real
    #: generation can run for minutes, and only the controller (progress counters, rescue) can
    #: tell a long generation from a wedge. A timeout here is the last resort, not the detector.
    backend_timeout_s: float = 600.0
    #: Time to open a connection to a backend. Short: a local engine accepts in microseconds,
    #: so seconds without a connection mean it is gone, and such a request is retried for free.
    connect_timeout_s: float = 5.0
    #: Largest request body buffered (bodies are buffered so they can be re-sent). 32 MiB holds
    #: any chat with long contexts, and a few images; larger bodies are refused with 413.
    max_body_bytes: int = 32 * 1024 * 1024
    #: Re-sends of a request an engine may have worked on (reset, timeout, 5xx). Two: one
    #: failure is a bad engine, a second in a row on another one suggests the request.
    #: Requests that never reached an engine (refused, connect timeout) are re-sent freely.
    max_retries: int = 2
    #: Such re-sends in flight at once, as a share of the requests in flight (Envoy's retry
    #: budget): retries must never multiply the load on a struggling fleet.
    retry_budget_ratio: float = 0.2
    #: ... but at least this many, so a small or idle fleet can still retry.
    retry_budget_min: int = 3
    #: Status when this request failed but other backends still serve. 500 is in the bounded
    #: retry set of clients such as NeMo-Gym: it re-sends that one call.
    status_when_others_serve: int = 500
    #: Status when no backend is left. 409 is not retried by those clients: with nothing to
    #: route to, failing the row is the right answer.
    status_when_none_left: int = 409
    #: Seconds a request that finds no backend waits for one while the controller says an
    #: engine is coming back (restarting, or answering again and being proven), before it is
    #: answered ``status_when_none_left``. A rolling restart leaves a fleet of one or two engines
    #: none for the second between the next one's stop and the last one's admission (a restarted
    #: engine is routed within a second of answering: one poll, one canary); 5 s covers that
    #: and a slow canary with room, and is short beside a generation, so a client whose fleet
    #: stays empty still learns it within seconds. 0 turns the wait off (409 at once). When
    #: nothing is coming back, the 409 is at once whatever this says.
    comeback_wait_s: float = 5.0
    #: Seconds a client may take to send its request body. The body is read whole before a
    #: backend is picked (so it can be re-sent), so a client that stalls holds no engine slot,
    #: only its own handler; 30 s is ample for 32 MiB on any link a client would use.
    client_body_timeout_s: float = 30.0
    #: Header that names a session (a multi-turn rollout). Requests carrying it go to the
    #: engine that holds the session's prefix cache; ``None`` turns affinity off.
    session_header: str | None = "x-session-id"
    #: A session's engine is used only while its in-flight count is below this factor times
    #: the fleet's average (consistent hashing with bounded loads): a hot session must not
    #: overload one engine while others idle.
    affinity_load_factor: float = 1.25
    #: Points per backend on the hash ring. 64 spreads sessions within a few per cent.
    affinity_virtual_nodes: int = 64
    #: How a new request picks its engine: ``cache_aware`` (router/affinity.py: the engine
    #: that likely holds the prompt's prefix in its KV cache, within a load guard; RL groups
    #: kept together; sessions as hints; least in flight where nothing is cached) or
    #: ``least_in_flight`` (fewest requests in flight, plus the session ring above).
    #: cache_aware by default: where prompts share prefixes its hit rate is the higher, and
    #: where they do not it places as least_in_flight does. Measured (BENCHMARKS.md,
    #: "Cache-aware by KV events beside the guess"; ``bench/cache.py --events --seeds 3``):
    #: 0.82-0.85 against 0.56 on four simulated engines; 0.77 against 0.63 on two real vLLM
    #: engines (tests/vllm/test_real_cache.py), and by KV events it keeps that with 2 and 4
    #: router workers. Its load guard (``cache_balance_abs``, ``cache_balance_rel``) keeps a
    #: hot prefix from stacking one engine while others idle; an RL group's siblings share
    #: one engine up to ``rl_group_per_engine`` by design.
    routing: str = "cache_aware"
    #: How long the router takes an engine to keep a prefix it sent there, after its last
    #: use. 120 s: an engine under steady load evicts within minutes (sglang-router evicts
    #: its tree every 120 s); a prefix believed held too long costs only a miss.
    cache_ttl_s: float = 120.0
    #: Prompt blocks the index keeps (least recently used out first): bounds its memory to a
    #: few tens of MB (one entry per block, a dict of holders each) whatever the traffic.
    cache_max_blocks: int = 200_000
    #: Share of a prompt's blocks an engine must hold to be chosen for its cache (else the
    #: session hint, else least in flight); sglang-router's cache_threshold, 0.3.
    cache_threshold: float = 0.3
    #: The load guard: an engine is used for its cache only while, with the request, it
    #: holds at most this many more than the fleet's mean in flight, and at most this many in
    #: all while another engine idles (router/affinity.py's load_bound; a conversation at
    #: home, the mean's bound alone) ... 4
    #: (bench/cache_model.py, fleets of 2 to 8 engines): at 2, free-running agents are
    #: moved off their engine, whole history and all, on every burst (0.62-0.70 of their
    #: tokens hit, against 0.71); at 5, a quiet fleet stacks a shared system prompt's
    #: conversations again (the busiest engine 1.67x the mean). The slack used to be 8
    #: over the least loaded engine, as sglang-router's 64: it never fires in a fleet whose
    #: concurrency is below it (8 conversations all on one of two engines). RL groups are
    #: bounded by their share instead.
    cache_balance_abs: int = 4
    #: ... growing with load to this times the mean in flight, so a busy fleet keeps its
    #: affinity (the bounded-load rule of consistent hashing; sglang-router's
    #: balance_rel_threshold, 1.5).
    cache_balance_rel: float = 1.5
    #: RL groups: requests with the same whole prompt within this many seconds of the first
    #: are siblings. 1 s: a GRPO group's samples arrive within milliseconds of each other,
    #: and the next epoch's same prompt must not count against this epoch's share (it goes
    #: where its prefix is, as any request does).
    rl_group_window_s: float = 1.0
    #: ... and stay on one engine up to this many (then the next engine takes the next
    #: share), past the load guard: a group of 8 is prefilled once, not on every engine.
    rl_group_per_engine: int = 8
    #: Take a request's OpenAI ``user`` field as its session (off: ``user`` often names an
    #: account with many unrelated conversations). ``prompt_cache_key`` always is one.
    cache_user_is_session: bool = False
    #: With ``cache_aware``: listen to the KV events of every engine that publishes them
    #: (vLLM's ``--kv-events-config``, found at its ``GET /kv_event_sources``) and route
    #: prompts of token ids by what each engine's cache holds now, evictions included,
    #: instead of the guess (router/kv_index.py). On: it costs one read per engine start and
    #: nothing where no engine publishes; an engine's events count only while they are whole.
    kv_events: bool = True
    #: Where engines publish their KV events when they do not say so at ``GET
    #: /kv_event_sources`` (a vLLM before it, a port forwarded elsewhere): ``"BACKEND
    #: ENDPOINT [REPLAY]"`` each, e.g. ``"http://10.0.0.5:8000 tcp://10.0.0.5:5557
    #: tcp://10.0.0.5:5558"``. A backend named here is not asked. Empty: each is asked.
    kv_event_endpoints: tuple[str, ...] = ()
    #: Continue a streamed completion or chat on another engine when its engine fails it
    #: after the first bytes reached the client (router/splice.py). On: a crash or a wedge
    #: then costs a stream a pause, not the generation. The router asks engines for
    #: ``return_token_ids`` (vLLM 0.32 knows it; other OpenAI servers ignore unknown fields)
    #: and strips them from what the client did not ask for. Off: streams pass through
    #: untouched, and one cut mid-answer is cut for its client too.
    continue_streams: bool = True
    #: Also continue non-streamed completions and chats: the router asks the engine for a
    #: stream and assembles the answer in vLLM's shape, so a long generation rescued from a
    #: wedge or cut by a crash goes on elsewhere instead of starting over. Off by default: it
    #: costs the router the parsing of every token's chunk (BENCHMARKS.md), and requests with
    #: logprobs are not assembled.
    continue_answers: bool = False
    #: Whether a backend the controller's push says nothing of (a router given its backends by
    #: hand, or ``engine = "auto"``) takes vLLM's own request fields (``return_token_ids``, a
    #: prompt of token ids, ``continue_final_message``), which an exact continuation needs.
    #: On: the router is made for vLLM fleets, and vLLM takes them. Off: such a backend gets
    #: the client's request as it came, and its streams continue from text or are refused. A
    #: push's word (the engine's profile) always wins.
    upstream_fields: bool = True
    #: How long an idle pooled connection to a backend is kept. Below uvicorn's 5 s (vLLM's
    #: server): a connection is never reused at the moment the engine closes it, so a reset
    #: means the engine, not the pool.
    keepalive_timeout_s: float = 4.0
    #: How long :meth:`Router.stop` lets requests in flight finish before it cuts them. Short
    #: requests complete; a long generation would not finish within any reasonable grace, and
    #: a stop must never hang on a wedged engine.
    shutdown_grace_s: float = 5.0
    #: How long a router being replaced (a reload, ``kill -HUP`` of ``fleetwarden up``: the
    #: old router gets SIGUSR1) lets what it holds finish after it stopped accepting: long
    #: generations and streams included, up to this bound; then it stops as on SIGTERM. Ten
    #: minutes: ``backend_timeout_s``, the longest one attempt may take anyway.
    drain_s: float = 600.0
    #: A file of named client keys (``fleetwarden keys add``; router/keys.py): set, every
    #: request but ``GET /metrics`` needs ``Authorization: Bearer`` with one of them (else
    #: 401), the client's key goes no further than the router, and requests and tokens are
    #: counted per key. Unset by default: the router stays as open as the engines behind it,
    #: and a request pays nothing for keys.
    keys_file: str | None = None

    # -- Limits on what one client (or one engine) may make the router hold. The defaults
    # are the ones users know from the proxies and servers they run (docs/design.md,
    # "Limits on the data port"): one client must never hurt the fleet.

    #: Most bytes of a request's line and headers, and of an engine's status line and headers
    #: (Envoy's ``max_request_headers_kb``: 60 KiB). A head past it is answered 431 and its
    #: connection closed (an engine's is a broken answer); llhttp itself bounds nothing, so a
    #: header line that never ends would otherwise be buffered whole.
    max_head_bytes: int = 60 * 1024
    #: Most header fields in one head, on both sides (Envoy's ``max_headers_count``: 100).
    #: Past it: 431. Every header is scanned on the way through, so 2,000 of them cost work.
    max_headers: int = 100
    #: Seconds a client has, from its connection (or the first byte of its next request on a
    #: kept-alive one) to the end of that request's head (HAProxy's ``timeout http-request``,
    #: 10 s in its documented example). Past it: 408, and the connection closes. A connection
    #: that sends nothing, or a head a byte at a time (a slowloris), holds nothing longer.
    client_head_timeout_s: float = 10.0
    #: Seconds a kept-alive client connection may wait for its next request (uvicorn's and
    #: h11-based servers' ``timeout_keep_alive``: 5 s). Then it is closed without an answer.
    client_idle_timeout_s: float = 5.0
    #: Seconds an answer may wait on a client that does not read (nginx's ``send_timeout``:
    #: 60 s between two writes that make progress). Then the client is dropped and its
    #: engine attempt cancelled (the engine aborts the generation): never counted against the
    #: engine. Well below ``backend_timeout_s``, so a client that stops reading is let go
    #: before the backend timeout could blame a healthy engine for the wait.
    client_write_timeout_s: float = 60.0
    #: Most client connections one router process holds at once; 0: half the process's open
    #: file limit (``RLIMIT_NOFILE``), the other half left for its engine connections, so
    #: clients alone can never exhaust descriptors. At the cap an idle kept-alive connection
    #: is closed to make room; when none is idle the new one is answered 503 and closed.
    max_client_connections: int = 0
    #: Most bytes of an engine's 5xx body that are kept (it is passed through, or shown in the
    #: router's own answer). An error message is short; past the bound the engine's
    #: connection is dropped and the client is told so, never left waiting for the rest.
    max_error_body_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for name in ("backend_timeout_s", "connect_timeout_s", "keepalive_timeout_s",
                     "client_body_timeout_s", "client_head_timeout_s", "client_idle_timeout_s",
                     "client_write_timeout_s",
                     "affinity_load_factor", "shutdown_grace_s", "drain_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RouterSettings.{name} must be > 0, got {getattr(self, name)}")
        if self.affinity_load_factor < 1:
            raise ValueError("RouterSettings.affinity_load_factor must be at least 1 (1 = even "
                             f"load), got {self.affinity_load_factor}")
        for name in ("max_body_bytes", "affinity_virtual_nodes", "max_head_bytes",
                     "max_headers", "max_error_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"RouterSettings.{name} must be at least 1, "
                                 f"got {getattr(self, name)}")
        if not 0 <= self.comeback_wait_s < float("inf"):
            raise ValueError(f"RouterSettings.comeback_wait_s must be a finite number >= 0, "
                             f"got {self.comeback_wait_s}")
        for name in ("max_retries", "retry_budget_min", "max_client_connections"):
            if getattr(self, name) < 0:
                raise ValueError(f"RouterSettings.{name} must be at least 0, "
                                 f"got {getattr(self, name)}")
        if not 0 <= self.retry_budget_ratio <= 1:
            raise ValueError("RouterSettings.retry_budget_ratio must be between 0 and 1, "
                             f"got {self.retry_budget_ratio}")
        for name in ("status_when_others_serve", "status_when_none_left"):
            status = getattr(self, name)
            if not 400 <= status <= 599 or status == FORBIDDEN_STATUS:
                raise ValueError(f"RouterSettings.{name} must be a 4xx or 5xx status other "
                                 f"than {FORBIDDEN_STATUS}, got {status}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"RouterSettings.routing must be one of "
                             f"{', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        for name in ("cache_ttl_s", "rl_group_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RouterSettings.{name} must be > 0, got {getattr(self, name)}")
        if not self.cache_balance_rel >= 1:
            raise ValueError("RouterSettings.cache_balance_rel must be at least 1, "
                             f"got {self.cache_balance_rel}")
        for name in ("cache_max_blocks", "cache_balance_abs", "rl_group_per_engine"):
            if getattr(self, name) < 1:
                raise ValueError(f"RouterSettings.{name} must be at least 1, "
                                 f"got {getattr(self, name)}")
        if not 0 <= self.cache_threshold < 1:
            raise ValueError("RouterSettings.cache_threshold must be in [0, 1), "
                             f"got {self.cache_threshold}")
        object.__setattr__(self, "kv_event_endpoints", tuple(self.kv_event_endpoints))
        self.kv_event_sources()  # each entry well formed, or the error naming it
        if self.keys_file is not None and not self.keys_file.strip():
            raise ValueError("RouterSettings.keys_file must be a path or None")
        if self.session_header is not None and not self.session_header.strip():
            raise ValueError("RouterSettings.session_header must be a header name or None")

    def kv_event_sources(self) -> dict[str, tuple[str, str | None]]:
        """``kv_event_endpoints`` by backend: (endpoint, replay endpoint or None)."""
        found: dict[str, tuple[str, str | None]] = {}
        for entry in self.kv_event_endpoints:
            parts = entry.split()
            if (len(parts) not in (2, 3) or not parts[0].startswith(("http://", "https://"))
                    or not all(p.startswith(("tcp://", "ipc://")) for p in parts[1:])):
                raise ValueError("RouterSettings.kv_event_endpoints: each entry is 'BACKEND_URL "
                                 f"ENDPOINT [REPLAY_ENDPOINT]' (tcp:// or ipc://), got {entry!r}")
            found[parts[0].rstrip("/")] = (parts[1], parts[2] if len(parts) == 3 else None)
        return found
