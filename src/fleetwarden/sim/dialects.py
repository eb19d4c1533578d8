"""Other engines' ``/metrics`` for the simulator: ``fleetwarden sim --engine llamacpp|sglang``.

Owns: other engines' ``/metrics`` names and quirks for the simulator.
Must not: decide the engine's behaviour (``engine.py`` does).

The simulated engine core (:mod:`fleetwarden.sim.engine`) drives these exactly as it drives
:class:`~fleetwarden.sim.families.VllmFamilies` (the ``on_*`` methods); only the wire differs,
so a fleet test can mix engines and the watchdog reads each in its own dialect
(:mod:`fleetwarden.engines`). When the core is wedged nothing calls them: every series freezes,
as on the real engine.

* **llama.cpp** (``tests/fixtures/llamacpp``): the names, help texts and order of the capture;
  no labels, no start-time family, no ``# EOF``, content type ``version=0.0.4``. The process is
  named by the ``Process-Start-Time-Unix`` header, an uptime-clock number (here: microseconds
  of ``time.monotonic()`` at the simulated start), never Unix time. ``n_decode_total`` +1 per
  step with work; ``tokens_predicted_total`` moves only when a request finishes (by all its
  tokens), as the real one does.
* **SGLang** (``tests/fixtures/sglang``, constructed from source): ``realtime_tokens_total``
  grows on every step (decode: the tokens of the step; prefill: the prompt); the gauges are
  written, as SGLang writes them, on each prefill, every 40th decode step, and when idle at
  most every 30 s — so just after a burst they still read "running".

Keep in sync with the profiles in :mod:`fleetwarden.engines` and the fixtures.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["DIALECTS", "Families", "LlamacppFamilies", "SglangFamilies"]


class Families(Protocol):
    """What the engine core drives and the server exposes, in any engine's dialect."""

    start_time: float

    def on_queues(self, running: int, waiting: int, kv_tokens: int) -> None: ...
    def on_step(self, scheduled_tokens: int, generated: int, step_s: float) -> None: ...
    def on_scheduled(self, queued_s: float) -> None: ...
    def on_prefilled(self, prompt_tokens: int, ttft_s: float) -> None: ...
    def on_prefix_cache(self, queried: int, hits: int) -> None: ...
    def on_finished(self, *, reason: str, prompt_tokens: int, generated: int, max_tokens: int,
                    e2e_s: float, queued_s: float, prefill_s: float, decode_s: float) -> None: ...
    def on_sleep(self, level: int) -> None: ...
    def exposition(self) -> bytes: ...
    def headers(self) -> dict[str, str]: ...

#: What real llama-server sends.
LLAMACPP_CONTENT_TYPE = "text/plain; version=0.0.4"
SGLANG_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Dialect:
    """The part every dialect shares: the engine-core callbacks it may ignore."""

    content_type = "text/plain"
    #: SGLang's default ``decode_log_interval``.
    LOG_INTERVAL_STEPS = 40

    def __init__(self, model: str, *, max_model_len: int, kv_capacity_tokens: int,
                 start_time: float | None = None) -> None:
        self.model = model
        self.start_time = time.time() if start_time is None else start_time

    def on_scheduled(self, queued_s: float) -> None:
        pass

    def on_prefix_cache(self, queried: int, hits: int) -> None:
        pass  # not simulated for llama.cpp and SGLang (SGLang's realtime_tokens_total has a
        # prefill_cache mode; llama.cpp exports no prefix-cache counter)

    def on_sleep(self, level: int) -> None:
        pass  # llama.cpp and SGLang export no sleep state (vLLM's vllm:engine_sleep_state)

    def headers(self) -> dict[str, str]:
        return {"Content-Type": self.content_type}


class LlamacppFamilies(_Dialect):
    content_type = LLAMACPP_CONTENT_TYPE

    def __init__(self, model: str, *, max_model_len: int, kv_capacity_tokens: int,
                 start_time: float | None = None) -> None:
        super().__init__(model, max_model_len=max_model_len,
                         kv_capacity_tokens=kv_capacity_tokens, start_time=start_time)
        #: Not Unix time: an uptime clock's microseconds, as llama-server's header.
        self.process_id = str(int(time.monotonic() * 1e6))
        self.running = self.waiting = 0
        self.n_decode = 0
        self.prompt_tokens = 0
        self.tokens_predicted = 0
        self.n_tokens_max = 0

    def on_queues(self, running: int, waiting: int, kv_tokens: int) -> None:
        self.running, self.waiting = running, waiting

    def on_step(self, scheduled_tokens: int, generated: int, step_s: float) -> None:
        if scheduled_tokens:
            self.n_decode += 1  # one llama_decode() call for every busy slot

    def on_prefilled(self, prompt_tokens: int, ttft_s: float) -> None:
        self.prompt_tokens += prompt_tokens

    def on_finished(self, *, reason: str, prompt_tokens: int, generated: int, max_tokens: int,
                    e2e_s: float, queued_s: float, prefill_s: float, decode_s: float) -> None:
        self.tokens_predicted += generated  # only when the slot is released
        self.n_tokens_max = max(self.n_tokens_max, prompt_tokens + generated)

    def headers(self) -> dict[str, str]:
        return {"Content-Type": self.content_type, "Server": "llama.cpp",
                "Process-Start-Time-Unix": self.process_id}

    def exposition(self) -> bytes:
        rows = (
            ("prompt_tokens_total", "counter",
             "Number of prompt tokens processed, excluding cached tokens", self.prompt_tokens),
            ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the "
             "cache", 0),
            ("prompt_seconds_total", "counter", "Total time spent processing prompts", 0),
            ("tokens_predicted_total", "counter", "Number of generation tokens processed",
             self.tokens_predicted),
            ("tokens_predicted_seconds_total", "counter", "Total time spent generating tokens",
             0),
            ("n_decode_total", "counter", "Total number of llama_decode() calls, excluding "
             "speculative decoding and multimodal decoding", self.n_decode),
            ("n_tokens_max", "counter", "Largest observed sequence length (prompt + "
             "generation)", self.n_tokens_max),
            ("requests_processing", "gauge", "Number of requests processing", self.running),
            ("requests_deferred", "gauge", "Number of requests deferred", self.waiting),
        )
        out = []
        for name, kind, doc, value in rows:
            out.append(f"# HELP llamacpp:{name} {doc}\n# TYPE llamacpp:{name} {kind}\n"
                       f"llamacpp:{name} {value}\n")
        return "".join(out).encode()


class SglangFamilies(_Dialect):
    content_type = SGLANG_CONTENT_TYPE
    #: When idle, SGLang refreshes its gauges at most this often.
    IDLE_REFRESH_S = 30.0

    def __init__(self, model: str, *, max_model_len: int, kv_capacity_tokens: int,
                 start_time: float | None = None) -> None:
        super().__init__(model, max_model_len=max_model_len,
                         kv_capacity_tokens=kv_capacity_tokens, start_time=start_time)
        self._actual = (0, 0)  # what the scheduler holds now
        self.shown = (0, 0)  # what the gauges last said
        self._shown_at = time.monotonic()
        self._decode_steps = 0
        self.realtime = {"prefill_compute": 0, "prefill_cache": 0, "decode": 0}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests = 0

    def _log_stats(self) -> None:
        self.shown, self._shown_at = self._actual, time.monotonic()

    def on_queues(self, running: int, waiting: int, kv_tokens: int) -> None:
        self._actual = (running, waiting)

    def on_step(self, scheduled_tokens: int, generated: int, step_s: float) -> None:
        if generated:
            self.realtime["decode"] += generated
            self._decode_steps += 1
            if self._decode_steps % self.LOG_INTERVAL_STEPS == 0:
                self._log_stats()

    def on_prefilled(self, prompt_tokens: int, ttft_s: float) -> None:
        self.realtime["prefill_compute"] += prompt_tokens
        self.prompt_tokens += prompt_tokens
        self._log_stats()  # every prefill batch writes the gauges

    def on_finished(self, *, reason: str, prompt_tokens: int, generated: int, max_tokens: int,
                    e2e_s: float, queued_s: float, prefill_s: float, decode_s: float) -> None:
        self.generation_tokens += generated  # the tokenizer side counts at the end
        self.requests += 1

    def exposition(self) -> bytes:
        if self._actual == (0, 0) and time.monotonic() - self._shown_at >= self.IDLE_REFRESH_S:
            self._log_stats()  # the idle self-check's refresh
        sched = (f'model_name="{self.model}",engine_type="unified",tp_rank="0",'
                 'pp_rank="0"')
        tok = f'model_name="{self.model}"'
        running, waiting = self.shown
        lines = [
            "# HELP sglang:num_running_reqs The number of running requests.",
            "# TYPE sglang:num_running_reqs gauge",
            f"sglang:num_running_reqs{{{sched}}} {float(running)}",
            "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
            "# TYPE sglang:num_queue_reqs gauge",
            f"sglang:num_queue_reqs{{{sched}}} {float(waiting)}",
            "# HELP sglang:realtime_tokens_total Total number of tokens processed (updated on "
            "each log interval). mode: prefill_compute, prefill_cache, decode.",
            "# TYPE sglang:realtime_tokens_total counter",
            *(f'sglang:realtime_tokens_total{{{sched},mode="{mode}"}} {float(n)}'
              for mode, n in self.realtime.items()),
            "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE sglang:prompt_tokens_total counter",
            f"sglang:prompt_tokens_total{{{tok}}} {float(self.prompt_tokens)}",
            "# HELP sglang:generation_tokens_total Number of generation tokens processed.",
            "# TYPE sglang:generation_tokens_total counter",
            f"sglang:generation_tokens_total{{{tok}}} {float(self.generation_tokens)}",
            "# HELP sglang:num_requests_total Number of requests processed.",
            "# TYPE sglang:num_requests_total counter",
            f"sglang:num_requests_total{{{tok}}} {float(self.requests)}",
        ]
        return ("\n".join(lines) + "\n").encode()


#: The simulator's engines other than vLLM, by the profile name.
DIALECTS: dict[str, type[LlamacppFamilies] | type[SglangFamilies]] = {
    "llamacpp": LlamacppFamilies,
    "sglang": SglangFamilies,
}
