"""Engine profiles: what the judge needs from each kind of engine, as data (pure).

Owns: the engine profiles as data: each engine's metric names, health path and quirks.
Must not: do I/O (pure), or parse a body (``engine_metrics.py``).

The judge is profile-agnostic: it compares two :class:`~fleetwarden.engine_metrics.Sample` values
(running, waiting, a progress counter, the fingerprint counters, which process answered). A
profile says, for one engine, where each of those comes from — and what the engine cannot prove.
One table, :data:`PROFILES`; no subclass per engine. To add an engine, add one entry (see
``docs/engines.md``).

What each field means:

* ``families`` — the ``/metrics`` families read, keyed by the name in their ``# TYPE`` line,
  each naming the :class:`Sample` field it fills. ``steps`` is the **progress proof**: a counter
  that advances with every engine step, also while requests run and before any finishes. A
  counter that moves only when a request finishes (llama.cpp's ``tokens_predicted_total``,
  SGLang's ``generation_tokens_total``, TGI's ``tgi_request_generated_tokens``) is a fingerprint
  field, never ``steps``: a long generation would read as a stall.
* ``detect`` — a ``# TYPE`` line prefix that only this engine writes: how an engine whose kind
  is not configured is recognised at its first ``/metrics`` read.
* ``start_header`` — a response header that changes when the process does (llama.cpp's
  ``Process-Start-Time-Unix``): compared, never read as a time. Without it (and without a
  start-time family) a restart shows only as counters going backwards.
* ``min_stall_s`` — the shortest stall that proves anything on this engine: an engine whose
  gauges are refreshed only now and then can read "running" with flat counters for that long
  while healthy. The watchdog never concludes STUCK sooner (the policy's ``stall_s`` is raised
  to it), so two reads that are to prove a stall are always further apart than it.
* ``health_path`` — the liveness read used when ``/metrics`` gives no sample: it must never
  start a generation (SGLang's ``/health_generate`` does; its ``/health`` does not).
* ``health_proves_core`` — a failure of the health path means the engine's core is dead even
  while ``/metrics`` answers: vLLM answers ``/health`` 503 once its engine core died, and its
  API server, with frozen gauges, can outlive the core for seconds (docs/design.md section
  12). An engine its failed requests put out of routing is then read there too, and
  condemned on it.
* ``sleep`` — how the engine says it is asleep or paused, where it has such a state (vLLM's
  ``vllm:engine_sleep_state`` is read: the judge's SLEEPING verdict; the others are said here
  so that a sleeping engine is not mistaken for a wedged one).
* ``upstream_fields`` — the engine takes vLLM's own request fields (``return_token_ids``, a
  prompt of token ids, ``continue_final_message``), which an exact continuation needs.
* ``completion_default`` — what a ``/v1/completions`` request that names no ``max_tokens``
  gets there (:data:`COMPLETION_FIXED`, :data:`COMPLETION_ENGINE`, :data:`COMPLETION_UNKNOWN`):
  a stream cut there goes on to the limit it would have had (docs/design.md 4.1).
* ``limits`` — what this profile cannot prove, printed by ``fleetwarden check``.

Sources: vLLM and llama.cpp from captures on this project's machines
(``tests/fixtures/vllm``, ``tests/fixtures/llamacpp``); SGLang and TGI from their source (no
engine runs here): ``tests/fixtures/sglang/README.md`` and ``tests/fixtures/tgi/README.md`` name
the files and commits.

Keep in sync: :data:`PROFILES`, the fixtures' READMEs, ``README.md`` ("Engines").
"""

from __future__ import annotations

import functools
import json
import shlex
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AUTO",
    "COMPLETION_ENGINE",
    "COMPLETION_FIXED",
    "COMPLETION_UNKNOWN",
    "ENGINE_NAMES",
    "LLAMACPP",
    "OPENAI",
    "PROFILES",
    "SGLANG",
    "TGI",
    "VLLM",
    "EngineProfile",
    "Family",
    "detect",
    "profile",
]

#: ``engine = "auto"``: the kind is recognised from ``/metrics`` at the first read.
AUTO = "auto"

#: What a ``/v1/completions`` request that names no ``max_tokens`` (or names ``null``) gets,
#: by engine kind (:attr:`EngineProfile.completion_default`; the router's words for it,
#: ``CompletionDefault`` in ``router/splice.py``). Each from the engine's source or measured:
#:
#: * vLLM 0.32: 16, its ``CompletionRequest``'s ``max_tokens: int | None = 16``
#:   (``vllm/entrypoints/openai/completion/protocol.py`` line 63; ``normalize_null_max_tokens``,
#:   line 432, turns ``null`` into it): its generation config's default is a chat's only.
#: * SGLang: 16, ``CompletionRequest.max_tokens: int = 16`` (sgl-project/sglang
#:   ``python/sglang/srt/entrypoints/openai/protocol.py`` at 004c82e0), passed as
#:   ``max_new_tokens`` (``serving_completions.py``, ``_build_sampling_params``).
#: * llama.cpp ``llama-server``: its own default, ``-n`` (-1: none, to the end of text or its
#:   context), as for a chat: measured on the pinned build (tests/llamacpp): started with
#:   ``-n 8`` a completion and a chat naming no limit got 8 tokens each.
#: * TGI: the context left, as for a chat: ``CompletionRequest.max_tokens: Option<u32>``
#:   (``router/src/lib.rs`` line 505 at db931fcf; its schema's "1024" is a chunk size) goes
#:   on as ``max_new_tokens`` (``router/src/server.rs`` line 739), and ``validate_input``
#:   (``router/src/validation.rs`` line 164) gives ``None`` ``max_total_tokens -
#:   input_length``.
#: * any other OpenAI-compatible server: not known (OpenAI's own API says 16; Ollama and
#:   others differ): such a completion, cut, is not continued.
COMPLETION_FIXED = "fixed"  # 16 tokens, whatever the engine's default
COMPLETION_ENGINE = "engine"  # the engine's default limit, else the context left: a chat's
COMPLETION_UNKNOWN = "unknown"  # not known: not continued


@dataclass(frozen=True, slots=True)
class Family:
    """One family the judge reads: as its ``# TYPE`` line names it, and the sample it sums."""

    type: str  # the family's type in the ``# TYPE`` line
    sample: str  # the sample name as prometheus-client's parser reports it; values are summed
    field: str  # the :class:`Sample` field it fills
    required: bool  # without it there is no verdict (NO_METRICS); optional ones default to 0
    #: The sample name as the engine writes it, where the parser reports another: TGI's Rust
    #: exporter writes counters without ``_total``, which the parser then adds.
    written: str = ""

    @property
    def line(self) -> str:
        """The sample name at the start of the body's lines."""
        return self.written or self.sample


@dataclass(frozen=True, slots=True, eq=False)
class EngineProfile:
    """What the judge needs from one kind of engine (see the module's docstring). Each profile
    is one object in :data:`PROFILES`: compared by identity."""

    name: str  # the config value: ``engine = "llamacpp"``
    title: str  # for people: "llama.cpp llama-server"
    families: Mapping[str, Family]  # empty: the engine has no /metrics (``openai``)
    detect: str  # a ``# TYPE`` prefix only this engine writes; "" for none
    progress: str  # what proves progress, in words
    health_path: str = "/health"
    health_proves_core: bool = False
    start_header: str | None = None
    min_stall_s: float = 0.0
    sleep: str = "none known"
    limits: tuple[str, ...] = ()
    #: It takes vLLM's own request fields that continuing a generation exactly needs:
    #: ``return_token_ids``, a prompt of token ids, ``continue_final_message``. A router sends
    #: them to no other engine (a strict OpenAI-compatible server answers 400 to a field it
    #: does not know): a stream there continues from text, or is refused.
    upstream_fields: bool = False
    #: What a completion that names no ``max_tokens`` gets (:data:`COMPLETION_FIXED`,
    #: :data:`COMPLETION_ENGINE`, :data:`COMPLETION_UNKNOWN`).
    completion_default: str = COMPLETION_UNKNOWN
    #: The fields of :class:`Sample` this profile fills (the rest read 0 / unknown).
    fields: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", frozenset(f.field for f in self.families.values()))
        if self.families:
            for needed in ("running", "waiting", "steps"):
                if not any(f.field == needed and f.required for f in self.families.values()):
                    raise ValueError(f"profile {self.name}: a required {needed!r} family is "
                                     "needed to judge progress")

    @property
    def has_metrics(self) -> bool:
        return bool(self.families)


# fmt: off
#: vLLM (0.32 captured). ``vllm:iteration_tokens_total`` is a histogram whose family name ends
#: in ``_total``; its ``_count`` advances once per engine step, also while a long prompt is read
#: and no output token appears (note 002: count steps, not tokens).
VLLM = EngineProfile(
    name="vllm", title="vLLM",
    families={
        "vllm:num_requests_running":   Family("gauge", "vllm:num_requests_running", "running",
                                              True),
        "vllm:num_requests_waiting":   Family("gauge", "vllm:num_requests_waiting", "waiting",
                                              True),
        "vllm:iteration_tokens_total": Family("histogram", "vllm:iteration_tokens_total_count",
                                              "steps", True),
        "vllm:generation_tokens_total": Family("counter", "vllm:generation_tokens_total",
                                               "generation_tokens", True),
        "vllm:prompt_tokens_total":    Family("counter", "vllm:prompt_tokens_total",
                                              "prompt_tokens", False),
        "vllm:num_preemptions_total":  Family("counter", "vllm:num_preemptions_total",
                                              "preemptions", False),
        "vllm:request_success_total":  Family("counter", "vllm:request_success_total",
                                              "finished_requests", False),
        "process_start_time_seconds":  Family("gauge", "process_start_time_seconds",
                                              "start_time", False),
        # The prefix cache, in tokens, counted as a prompt is scheduled: read for the actual
        # hit rate set beside the cache-aware router's prediction (never judged).
        "vllm:prefix_cache_queries_total": Family("counter", "vllm:prefix_cache_queries_total",
                                                  "prefix_cache_queries", False),
        "vllm:prefix_cache_hits_total": Family("counter", "vllm:prefix_cache_hits_total",
                                               "prefix_cache_hits", False),
        # Sleep mode, one series per ``sleep_state`` label: ``awake`` 0 while asleep,
        # ``weights_offloaded`` 1 at level 1, ``discard_all`` 1 at level 2 (read per label,
        # never summed). Engines before sleep mode lack it: the level is then unknown.
        "vllm:engine_sleep_state":     Family("gauge", "vllm:engine_sleep_state",
                                              "sleep_level", False),
    },
    detect="vllm:", health_proves_core=True, upstream_fields=True,
    completion_default=COMPLETION_FIXED,
    progress="vllm:iteration_tokens_total_count: +1 per engine step",
    sleep="vllm:engine_sleep_state (read: the SLEEPING verdict); /sleep, /wake_up and "
          "/is_sleeping with VLLM_SERVER_DEV_MODE=1",
    limits=("a wedged EngineCore leaves the API server answering /metrics and /health: the "
            "frozen step counter is the proof, after stall_s",),
)

#: llama.cpp ``llama-server --metrics`` (build 0.6.0-dev, captured: tests/fixtures/llamacpp).
#: One process: no labels, no start-time family; the ``Process-Start-Time-Unix`` header changes
#: on a restart (its value is an uptime clock, not Unix time).
LLAMACPP = EngineProfile(
    name="llamacpp", title="llama.cpp llama-server",
    families={
        "llamacpp:requests_processing": Family("gauge", "llamacpp:requests_processing",
                                               "running", True),
        "llamacpp:requests_deferred":   Family("gauge", "llamacpp:requests_deferred",
                                               "waiting", True),
        "llamacpp:n_decode_total":      Family("counter", "llamacpp:n_decode_total", "steps",
                                               True),
        "llamacpp:tokens_predicted_total": Family("counter", "llamacpp:tokens_predicted_total",
                                                  "generation_tokens", False),
        "llamacpp:prompt_tokens_total": Family("counter", "llamacpp:prompt_tokens_total",
                                               "prompt_tokens", False),
    },
    detect="llamacpp:", completion_default=COMPLETION_ENGINE,
    progress="llamacpp:n_decode_total: +1 per llama_decode() call (one call for all busy slots)",
    start_header="Process-Start-Time-Unix",
    sleep="none read (llama-server has no sleep state in /metrics)",
    limits=(
        "tokens_predicted_total moves only when a request finishes: a fingerprint, never "
        "the progress proof",
        "one long prefill (a prompt of -b tokens) keeps n_decode_total flat for its whole "
        "batch: stall_s must outlast the slowest single batch",
        "a restart shows only in the Process-Start-Time-Unix header (compared, not a time) "
        "and in counters starting again from 0",
        "SIGSTOP freezes /metrics and /health too (the engine is one process): silent "
        "with requests there, unreachable idle; not stuck",
    ),
)

#: SGLang (``--enable-metrics``), from source: sgl-project/sglang
#: ``python/sglang/srt/managers/scheduler_components/metrics_reporter.py`` (00df707e) and the
#: collector (``SchedulerMetricsCollector``). ``sglang:realtime_tokens_total`` (label ``mode``:
#: prefill_compute, prefill_cache, decode) is increased on every decode iteration (by the batch
#: size) and on every prefill batch: the progress counter. The gauges are *not* per step: they
#: are written on each prefill batch, every ``decode_log_interval`` (40) decode iterations, and
#: when idle only every 30 s — so an engine that just went idle can read "running" with flat
#: counters for up to ~30 s. Hence ``min_stall_s`` 45. Its metrics come through prometheus
#: multiprocess mode: no ``process_start_time_seconds``.
SGLANG = EngineProfile(
    name="sglang", title="SGLang",
    families={
        "sglang:num_running_reqs":       Family("gauge", "sglang:num_running_reqs", "running",
                                                True),
        "sglang:num_queue_reqs":         Family("gauge", "sglang:num_queue_reqs", "waiting",
                                                True),
        "sglang:realtime_tokens_total":  Family("counter", "sglang:realtime_tokens_total",
                                                "steps", True),
        "sglang:generation_tokens_total": Family("counter", "sglang:generation_tokens_total",
                                                 "generation_tokens", False),
        "sglang:prompt_tokens_total":    Family("counter", "sglang:prompt_tokens_total",
                                                "prompt_tokens", False),
        "sglang:num_requests_total":     Family("counter", "sglang:num_requests_total",
                                                "finished_requests", False),
    },
    detect="sglang:", completion_default=COMPLETION_FIXED,
    progress="sglang:realtime_tokens_total (all modes): + batch size per decode iteration, "
             "+ prompt tokens per prefill batch",
    min_stall_s=45.0,
    sleep="sglang:num_paused_reqs (requests paused by a weight sync); not read yet",
    limits=(
        "the running/waiting gauges are refreshed every 40 decode iterations and only every "
        "30 s when idle: no stall is concluded in under 45 s",
        "generation_tokens_total moves only when a request finishes: a fingerprint, never the "
        "progress proof",
        "no start-time family (multiprocess metrics): a restart shows only as counters going "
        "backwards",
        "older SGLang without sglang:realtime_tokens_total has no progress proof: NO_METRICS, "
        "canaries only",
        "constructed from source, not captured: no SGLang engine runs on these machines",
    ),
)

#: Text Generation Inference (router v2/v3 backends), from source: huggingface/
#: text-generation-inference ``backends/v2/src/backend.rs`` (``prefill``/``decode``). Its Rust
#: exporter writes counters without ``_total``. ``tgi_batch_inference_count`` (label
#: ``method``) is increased at the start of every prefill and decode call: one per step.
#: ``tgi_batch_current_size`` is set each decode loop and back to 0 when the batch empties.
TGI = EngineProfile(
    name="tgi", title="Text Generation Inference",
    families={
        "tgi_batch_current_size":    Family("gauge", "tgi_batch_current_size", "running", True),
        "tgi_queue_size":            Family("gauge", "tgi_queue_size", "waiting", True),
        "tgi_batch_inference_count": Family("counter", "tgi_batch_inference_count_total",
                                            "steps", True, written="tgi_batch_inference_count"),
        "tgi_request_generated_tokens": Family("histogram", "tgi_request_generated_tokens_sum",
                                               "generation_tokens", False),
        "tgi_request_success":       Family("counter", "tgi_request_success_total",
                                            "finished_requests", False,
                                            written="tgi_request_success"),
    },
    detect="tgi_", completion_default=COMPLETION_ENGINE,
    progress="tgi_batch_inference_count (prefill + decode): +1 at the start of every step",
    sleep="none",
    limits=(
        "tgi_request_generated_tokens moves only when a request finishes: a fingerprint",
        "the step counter is increased as a step starts: a step that never returns leaves it "
        "flat, as it should, but one read may land between the count and the step",
        "no start-time family: a restart shows only as counters going backwards",
        "/health may run a one-token prefill when TGI's last generation failed",
        "constructed from source, not captured: no TGI engine runs on these machines",
    ),
)

#: Any OpenAI-compatible server without a Prometheus ``/metrics`` (a hosted endpoint, Ollama):
#: nothing proves progress. Liveness is ``GET /v1/models``; the canary when nothing of the
#: router's is in flight, and the router's own outcomes, are the only evidence.
OPENAI = EngineProfile(
    name="openai", title="OpenAI-compatible (no /metrics)",
    families={},
    detect="",
    progress="none: no /metrics",
    health_path="/v1/models",
    limits=(
        "no /metrics: no progress proof and no wedge detection from counters",
        "a busy engine is never probed, so a wedge under load shows only in the router's "
        "failed or timed-out requests (the ledger's failure windows)",
        "an idle engine is proved by a canary (one max_tokens-1 completion) when due",
        "a restart is invisible except through failed requests",
    ),
)
# fmt: on

#: Every profile, by its config name.
PROFILES: Mapping[str, EngineProfile] = {
    p.name: p for p in (VLLM, LLAMACPP, SGLANG, TGI, OPENAI)
}
#: What ``engine =`` accepts.
ENGINE_NAMES: tuple[str, ...] = (AUTO, *PROFILES)


def profile(name: str) -> EngineProfile:
    """The profile of that name; a clear error naming the choices otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"engine {name!r} is not known; choose one of: "
                         f"{', '.join(ENGINE_NAMES)}") from None


def detect(body: str) -> EngineProfile | None:
    """The engine whose families a ``/metrics`` body holds, or None.

    Plain string searches for each profile's ``# TYPE`` prefix (no parse). vLLM's body also
    holds ``process_*`` families of its own, which no other profile's prefix matches.
    """
    for p in PROFILES.values():
        if p.detect and ("\n# TYPE " + p.detect in body or body.startswith("# TYPE " + p.detect)):
            return p
    return None


#: vLLM's flag for generation-config overrides; its ``max_new_tokens`` caps every request.
OVERRIDE_GENERATION_CONFIG = "--override-generation-config"
#: vLLM's flag naming where the default sampling parameters come from: ``auto`` (its
#: default: the model's own ``generation_config.json``), ``vllm`` (none) or a folder.
GENERATION_CONFIG = "--generation-config"
#: The flags of a vLLM command that the output limits depend on (the model's folder too).
_LIMIT_FLAGS = (OVERRIDE_GENERATION_CONFIG, GENERATION_CONFIG, "--model", "--hf-config-path")


@functools.lru_cache(maxsize=256)
def _limit_args(command: str) -> dict[str, str] | None:
    """The flags of :data:`_LIMIT_FLAGS` a command names (the last of each, as argparse),
    and ``serve``'s positional model as ``--model`` (vLLM's ``serve`` sets ``args.model``
    from it, over ``--model``). The command is a template (``str.format``: literal braces
    doubled), read with its placeholders left blank. ``None``: it cannot be read."""
    try:
        names = {n for _, n, _, _ in string.Formatter().parse(command) if n}
        words = shlex.split(command.format(**dict.fromkeys(names, "0")))
    except (ValueError, KeyError, IndexError):
        return None
    found: dict[str, str] = {}
    positional = None
    for i, word in enumerate(words):
        flag, eq, value = word.partition("=")
        if flag in _LIMIT_FLAGS:
            if eq:
                found[flag] = value
            elif i + 1 < len(words):
                found[flag] = words[i + 1]
        elif word == "serve" and i + 1 < len(words) and not words[i + 1].startswith("-"):
            positional = words[i + 1]
    if positional is not None:
        found["--model"] = positional
    return found


#: Reads a folder's generation config (what vLLM's ``try_get_generation_config`` reads there:
#: its ``generation_config.json``, else the model's ``config.json``): its object, or ``None``
#: where there is none to read (a hub name, another host's path). The shell's
#: ``model_files.generation_config_file``: this module reads no file itself.
ConfigReader = Callable[[str], "dict[str, Any] | None"]


def _no_file(folder: str) -> dict[str, Any] | None:
    return None


def _tokens(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 \
        else None


def generation_limits(model: str | None, source: str, override: Mapping[str, Any],
                      hf_config_path: str | None = None, read: ConfigReader = _no_file,
                      ) -> tuple[int | CapUnknown | None, int | CapUnknown | None]:
    """``(cap, default)`` of a vLLM 0.32 engine's output, mirroring its source line for line:
    ``default`` is ``ModelConfig.get_diff_sampling_param()``'s ``max_tokens`` (the serving
    classes' ``default_sampling_params``), the limit ``get_max_tokens`` gives a request that
    names none (a chat; a completion's pydantic default is 16): no file under
    ``--generation-config vllm``, else ``ModelConfig.try_get_generation_config``'s file (the
    ``hf_config_path`` or model folder under ``auto``, the named folder otherwise), updated
    with ``--override-generation-config`` (its ``max_new_tokens``, even ``null``, replaces the
    file's). ``cap`` is the serving classes' ``override_max_tokens``, on every request: under
    ``auto`` or ``vllm`` the override's ``max_new_tokens``, under a folder the default.
    ``None``: none; :class:`CapUnknown`: the file that decides cannot be read here
    (``read``: how a folder's file is read; by default none is)."""
    config: dict[str, Any] | None = {}
    if source != "vllm":
        folder = (hf_config_path or model) if source == "auto" else source
        config = None if folder is None else read(folder)
        if config is None and "max_new_tokens" not in override:
            return (None if source == "auto" else CapUnknown(
                        f"--generation-config {source}: the max_new_tokens of its "
                        "generation_config.json caps every request, and that file is not "
                        "readable on this host"),
                    CapUnknown(f"the model's generation_config.json is not readable in "
                               f"{folder!r} on this host"))
    tokens = {**(config or {}), **override}.get("max_new_tokens")
    default: int | CapUnknown | None = None if tokens is None else (
        _tokens(tokens) or CapUnknown(f"max_new_tokens {tokens!r} is not an integer >= 1"))
    if source not in ("auto", "vllm"):
        return default, default
    cap = override.get("max_new_tokens")
    return (None if cap is None else _tokens(cap) or CapUnknown(
        f"--override-generation-config max_new_tokens {cap!r} is not an integer >= 1")), default


#: llama-server's flags for its default output limit: a request that names no limit gets it,
#: one that names a limit is not held to it (build 10434: started with ``-n 8``, a completion
#: asking 20 tokens got 20, one asking none got 8); -1 (its default) and -2 mean none.
_LLAMACPP_PREDICT_FLAGS = ("-n", "--n-predict", "--predict")


@functools.lru_cache(maxsize=256)
def _llamacpp_default(command: str) -> tuple[bool, int | CapUnknown | None]:
    """Whether ``command`` runs ``llama-server``, and its default output limit
    (:data:`_LLAMACPP_PREDICT_FLAGS`, the last one named)."""
    try:
        names = {n for _, n, _, _ in string.Formatter().parse(command) if n}
        words = shlex.split(command.format(**dict.fromkeys(names, "0")))
    except (ValueError, KeyError, IndexError):
        return False, None
    if not any(w.rsplit("/", 1)[-1].startswith("llama-server") for w in words):
        return False, None
    value: str | None = None
    for i, word in enumerate(words):
        flag, eq, rest = word.partition("=")
        if flag in _LLAMACPP_PREDICT_FLAGS:
            value = rest if eq else (words[i + 1] if i + 1 < len(words) else "")
    if value is None:
        return True, None
    try:
        tokens = int(value)
    except ValueError:
        return True, CapUnknown(f"llama-server -n {value!r} is not an integer")
    return True, tokens if tokens >= 1 else None


def _command_limits(command: str | None, read: ConfigReader,
                    ) -> tuple[int | CapUnknown | None, int | CapUnknown | None]:
    llamacpp, default = (False, None) if not command else _llamacpp_default(command)
    if llamacpp:  # it caps no request: its -n is only a default
        return None, default
    args = None if not command else _limit_args(command)
    if args is None:
        return None, None
    raw = args.get(OVERRIDE_GENERATION_CONFIG)
    try:
        override = {} if raw is None else json.loads(raw)
    except ValueError:
        override = None
    if not isinstance(override, dict):
        return CapUnknown(f"{OVERRIDE_GENERATION_CONFIG}: not a JSON object"), None
    return generation_limits(args.get("--model"), args.get(GENERATION_CONFIG, "auto"),
                             override, args.get("--hf-config-path"), read)


def output_cap_of(command: str | None, read: ConfigReader = _no_file) -> int | None:
    """The server cap on every request's output that an engine command sets
    (:func:`generation_limits`: ``--override-generation-config '{"max_new_tokens": N}'``,
    or under ``--generation-config FOLDER`` that folder's ``max_new_tokens``, read from
    this host's disk; a ``llama-server`` command sets none). ``None``: it sets none, or it
    cannot be read (then a continuation learns the cap only from a ``"length"`` finish)."""
    cap = _command_limits(command, read)[0]
    return None if isinstance(cap, CapUnknown) else cap


def output_default_of(command: str | None,
                      read: ConfigReader = _no_file) -> int | CapUnknown | None:
    """The default limit of a request that names none (a chat's) that an engine command
    sets (:func:`generation_limits`: the model folder's ``generation_config.json``
    ``max_new_tokens`` under vLLM's ``--generation-config auto``, read from this host's
    disk; ``llama-server``'s ``-n``). ``None``: none; :class:`CapUnknown`: its file is not
    readable here."""
    return _command_limits(command, read)[1]


#: vLLM's dev-mode endpoint (``VLLM_SERVER_DEV_MODE=1``) that shows the engine's config: the
#: one place a running vLLM says its server cap. JSON, not the default text.
SERVER_INFO_PATH = "/server_info?config_format=json"


@dataclass(frozen=True, slots=True)
class CapUnknown:
    """Why an engine's server cap is not known. ``settled``: it was asked and will say no more
    in this process (no ``/server_info``, or one that does not tell); else not asked yet, or
    no answer came (asked again at its next read)."""

    why: str
    settled: bool = True


def _server_info_limits(body: bytes, read: ConfigReader,
                        ) -> tuple[int | CapUnknown | None, int | CapUnknown | None]:
    """``(cap, default)`` as a vLLM 0.32 ``GET /server_info`` (JSON) shows them
    (:func:`generation_limits`): its ``vllm_config.model_config`` holds ``model`` (the path
    or hub name), ``hf_config_path``, ``generation_config`` and
    ``override_generation_config``, not the file's content: that is read where the path is a
    folder on this host. Never raises."""
    try:
        info = json.loads(body)
    except ValueError:
        unknown = CapUnknown("GET /server_info: not JSON")
        return unknown, unknown
    config = info.get("vllm_config") if isinstance(info, dict) else None
    model = config.get("model_config") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        unknown = CapUnknown("GET /server_info: no vllm_config.model_config")
        return unknown, unknown
    source = model.get("generation_config", "auto")
    override = model.get("override_generation_config") or {}
    path, hf_path = model.get("model"), model.get("hf_config_path")
    if not isinstance(source, str) or not isinstance(override, dict):
        unknown = CapUnknown("GET /server_info: generation_config or its override unreadable")
        return unknown, unknown
    return generation_limits(path if isinstance(path, str) else None, source, override,
                             hf_path if isinstance(hf_path, str) else None, read)


def output_cap_of_server_info(body: bytes, read: ConfigReader = _no_file,
                              ) -> int | CapUnknown | None:
    """The server cap on every request's output that a vLLM 0.32 ``GET /server_info`` (JSON)
    shows (:func:`generation_limits`, the ``override_max_tokens`` of vLLM's serving classes):
    ``None``: it caps none. Under a folder, known where the override names
    ``max_new_tokens`` or the folder is readable on this host. Never raises."""
    return _server_info_limits(body, read)[0]


def output_default_of_server_info(body: bytes,
                                  read: ConfigReader = _no_file) -> int | CapUnknown | None:
    """The default limit of a request that names none that a vLLM 0.32 ``GET /server_info``
    shows (:func:`generation_limits`): the model folder's ``max_new_tokens`` where that path
    is readable on this host (an engine elsewhere: :class:`CapUnknown`)."""
    return _server_info_limits(body, read)[1]
