"""What a simulated engine is told at start: its size, its speed, and its fault (no imports
of the server, so the command line can show these defaults cheaply).

Owns: what a simulated engine is told at start, and its fault modes.
Must not: do I/O.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["SIM_ENGINES", "FaultMode", "KVEventsConfig", "SimConfig"]

#: The engines whose wire the simulator speaks.
SIM_ENGINES = ("vllm", "llamacpp", "sglang")


class FaultMode(enum.Enum):
    WEDGE = "wedge"
    CRASH = "crash"
    REFUSE = "refuse"
    SLOW = "slow"
    ERROR5XX = "error5xx"
    NO_METRICS = "no_metrics"
    GARBAGE_METRICS = "garbage_metrics"
    RESTART = "restart"
    #: A weight reload (vLLM's ``reload_weights`` through ``/collective_rpc``) takes
    #: ``factor`` seconds; everything else runs as usual.
    SLOW_LOAD = "slow_load"
    BLACKHOLE = "blackhole"
    #: A share (``factor``, at most 1) of the generation requests that arrive have their
    #: connection reset (a TCP RST, before any answer): a flaky network path or proxy.
    RESET = "reset"
    #: The engine drains, slowly: its listening socket closes (new connections refused, as
    #: ``refuse``) while what it holds finishes at ``factor`` times its step time, as an
    #: engine told to shut down gracefully finishes its long streams. Give it ``duration_s``.
    DRAIN = "drain"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``: the JSON of ``--kv-events-config``, with its defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:  # vLLM's __post_init__: zmq when enabled, else null
            object.__setattr__(self, "publisher",
                               "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher: 'zmq' or 'null', got "
                             f"{self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be >= 1, got "
                                 f"{getattr(self, name)}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv_events_config.{name}: a zmq endpoint (tcp://, ipc://, "
                                 f"inproc://), got {value!r}")

    @property
    def on(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse ``--kv-events-config``; a bad value is an error naming the field."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"kv_events_config: not JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError("kv_events_config: a JSON object is wanted")
        known = {f.name: f for f in fields(cls)}
        for name, value in raw.items():
            if name not in known:
                raise ValueError(f"kv_events_config.{name}: unknown field (known: "
                                 f"{', '.join(known)})")
            wanted: tuple[type, ...] = {
                "enable_kv_cache_events": (bool,), "buffer_steps": (int,), "hwm": (int,),
                "max_queue_size": (int,)}.get(name, (str, type(None)))
            if not isinstance(value, wanted) or (bool not in wanted and isinstance(value, bool)):
                raise ValueError(f"kv_events_config.{name}: wrong type {type(value).__name__}")
        return cls(**raw)

    def as_source(self) -> dict[str, Any]:
        """The entry vLLM's ``GET /kv_event_sources`` shows for this publisher."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port; the bound one is in Sim.url and the ready line
    model: str = "tiny"  # the served name of the captures' model
    #: Requests in the running batch at once (vLLM's max_num_seqs); more wait. 8: a handful of
    #: test clients can fill it, so "every slot busy" is cheap to arrange.
    slots: int = 8
    #: Engine steps per second while there is work. 20 keeps a test machine's CPU quiet; a
    #: request of max_tokens 2000 then takes 100 s, a long generation a watchdog must respect.
    steps_per_s: float = 20.0
    #: Output tokens each running request gains per step (1, as vLLM without speculation).
    tokens_per_step: int = 1
    #: The step's token budget (vLLM's max_num_batched_tokens, 2048 as vLLM's chunked-prefill
    #: default): longer prompts prefill over several steps that emit no token.
    max_num_batched_tokens: int = 2048
    #: Room for a long prompt and a 2,000-token generation (the captures' model had 512).
    max_model_len: int = 8192
    fault: FaultMode | None = None
    fault_factor: float = 4.0  # the default slowdown of ``slow``
    #: After ``crash``: how long the dying process still answers (503 /health) before it goes.
    #: Real vLLM refused connections ~0.4 s after its EngineCore was killed.
    crash_exit_s: float = 0.4
    #: After ``crash``: how long before the API server notices its core is gone. Meanwhile it
    #: holds what it took, steps nothing, answers /health 200 and /metrics with the gauges
    #: frozen at the kill, as vLLM 0.32's API server does until its monitor thread sees the
    #: core process end (``MPClient.start_engine_core_monitor``; every call then raises
    #: ``EngineDeadError``, answered 500). 0: at once. On a loaded machine that thread waits
    #: for the CPU: requests held a second or more were hedged on the real engines.
    crash_notice_s: float = 0.0
    #: Whether it honours vLLM's ``return_token_ids``. False: an engine that ignores it (an
    #: OpenAI-compatible server that is not vLLM 0.32), whose streams a router can continue
    #: only from text.
    token_ids: bool = True
    #: The model ends on its own (vLLM's EOS) where its context's hash says so, about once in
    #: this many tokens; 0: never (a model that always runs to ``max_tokens``, which the
    #: older scenario tests count on). The exactness oracle runs with it on.
    eos_period: int = 0
    #: Started with a reasoning parser (vLLM's ``--reasoning-parser``): a chat sent with
    #: ``chat_template_kwargs: {"enable_thinking": true}`` opens with ``reasoning_content``.
    reasoning_parser: bool = False
    #: Entries kept in the /sim/stats log (the counts by path are never trimmed).
    stats_log_size: int = 2000
    #: Whose wire to speak: ``vllm``, or ``llamacpp`` / ``sglang`` (their /metrics names,
    #: llama.cpp's /health body, /slots and start header; ``fleetwarden.sim.dialects``).
    engine: str = "vllm"
    #: KV blocks (16 tokens each) the prefix cache keeps; its hits shorten a prefill. None:
    #: the whole KV capacity (``slots * max_model_len`` tokens), as vLLM caches in every free
    #: block; 0: prefix caching off. A benchmark makes it small to show eviction.
    prefix_cache_blocks: int | None = None
    #: Started with ``--api-key`` (several accepted): every path under /v1, /v2, /inference
    #: and /cohere then wants ``Authorization: Bearer <one of them>``, as vLLM's middleware
    #: guards them; with ``engine = "llamacpp"``, every path but /health, /models and their
    #: /v1 forms, as llama-server's; with ``sglang``, all but /health* and /metrics*, as
    #: SGLang's (``server.py``, ``_vllm_auth``). Empty: nothing guarded.
    api_keys: tuple[str, ...] = ()
    #: With ``api_keys``, guard vLLM's dev endpoints too (sleep, the RL API: /pause,
    #: /collective_rpc, /weight_info, ..., and /server_info), as a proxy in front of vLLM
    #: that wants the key on every path would; vLLM itself leaves them open. False: vLLM's
    #: own rule. What lets a test fail when fleetwarden's calls of the weight API (or its
    #: read of /server_info) go without the engine's key.
    guard_dev_api: bool = False
    #: vLLM's ``--override-generation-config '{"max_new_tokens": N}'``: a server cap on every
    #: request's output, even one that names a larger ``max_tokens`` (RL stacks set it).
    #: None: no cap.
    override_max_new_tokens: int | None = None
    #: The model's ``generation_config.json`` ``max_new_tokens`` (vLLM's ``--generation-config
    #: auto``): the default of a request that names no limit (a chat's; a completion's pydantic
    #: default, 16, wins, but for ``engine`` llamacpp, where it is llama-server's ``-n``), no
    #: cap on one that names it. None: the model sets none.
    default_max_new_tokens: int | None = None
    #: vLLM's ``--model`` where the model is served under another name
    #: (``--served-model-name``): the path ``GET /server_info`` shows as ``model``, whose
    #: ``generation_config.json`` sets ``default_max_new_tokens``. None: the served name.
    model_path: str | None = None
    #: vLLM's ``VLLM_SERVER_DEV_MODE=1`` (``fleetwarden sim`` reads the variable as vLLM does):
    #: ``GET /server_info`` is served, its ``vllm_config.model_config`` showing the
    #: generation-config fields above as vLLM's does; without it, 404, as vLLM.
    dev_mode: bool = False
    #: The checkpoint the process loads at its start, and again at each restart (a file or a
    #: directory: ``fleetwarden.sim.weights``). None: the base weights (the simulator's older
    #: answers).
    weights_path: str | None = None
    #: vLLM's ``--enable-scale-out``: ``POST /inference/v1/generate`` (token in, token out,
    #: with per-request weight version spans) is served; without it vLLM answers 403.
    enable_scale_out: bool = False
    #: vLLM's ``--kv-events-config``: with ``enable_kv_cache_events`` and the ``zmq``
    #: publisher, the prefix cache's KV events go out as vLLM's (``sim/kv_events.py``) and
    #: ``GET /kv_event_sources`` says where. None: no events, as vLLM by default.
    kv_events: KVEventsConfig | None = None

    def __post_init__(self) -> None:
        if self.slots < 1 or self.tokens_per_step < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("slots, tokens_per_step and max_num_batched_tokens must be >= 1")
        if self.engine not in SIM_ENGINES:
            raise ValueError(f"engine {self.engine!r}: the simulator speaks "
                             f"{', '.join(SIM_ENGINES)}")
        if self.eos_period < 0:
            raise ValueError("eos_period must be >= 0")


        if self.prefix_cache_blocks is not None and self.prefix_cache_blocks < 0:
            raise ValueError(f"prefix_cache_blocks must be >= 0 or None, got "
                             f"{self.prefix_cache_blocks}")
        for name in ("override_max_new_tokens", "default_max_new_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if not self.steps_per_s > 0 or not self.fault_factor > 0:
            raise ValueError("steps_per_s and fault_factor must be > 0")
