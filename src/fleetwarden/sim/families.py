"""vLLM 0.32's ``/metrics`` families, as prometheus-client objects in a registry of their own.

Owns: vLLM's metric families as prometheus-client objects for the simulator.
Must not: decide when they move (the engine core does).

Names, types, label names, bucket bounds and help texts are those of the real capture
(``tests/fixtures/vllm/metrics-*.txt``); ``tests/scenario/test_sim.py`` checks them family by
family. Values are driven by the simulated engine core through the ``on_*`` methods, and only
by it: when the core is wedged nothing calls them, so every series is frozen, as it is on a real
vLLM whose EngineCore is stopped.

``process_start_time_seconds`` is the simulated process's start, not this Python process's: a
simulated restart (``restart`` fault) gets a new one, with every counter from zero, in a new
registry.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_1_0_0, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

#: What real vLLM 0.32 sends (prometheus-client 0.26): note ``version=1.0.0``, not 0.0.4.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_1_0_0

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class _SimulatedProcess(Collector):
    """The ``process_*`` families of this process, with the simulated start time."""

    def __init__(self, start_time: float) -> None:
        self.start_time = start_time
        self._real = ProcessCollector(registry=None)

    def collect(self) -> Iterable[Metric]:
        for family in self._real.collect():
            if family.name == "process_start_time_seconds":
                yield GaugeMetricFamily(family.name, family.documentation, value=self.start_time)
            else:
                yield family


class VllmFamilies:
    """One simulated process's metrics. A restart makes a new instance (counters from zero)."""

    def __init__(self, model: str, *, max_model_len: int, kv_capacity_tokens: int,
                 start_time: float | None = None) -> None:
        self.start_time = time.time() if start_time is None else start_time
        self.registry = reg = CollectorRegistry(auto_describe=True)
        GCCollector(registry=reg)
        PlatformCollector(registry=reg)
        reg.register(_SimulatedProcess(self.start_time))
        self._kv_capacity = max(1, kv_capacity_tokens)
        labels = ("model_name", "engine")
        values = (model, "0")

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(name, doc, labels + extra, registry=reg)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Gauge(name, doc, labels + extra, registry=reg)

        def histogram(name: str, doc: str, buckets: Iterator[float] | tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=tuple(buckets), registry=reg).labels(
                *values)

        flops = "(for Model Flops Utilization calculations)."
        for what, doc in (("flops", "floating point operations"),
                          ("read_bytes", "bytes read from memory"),
                          ("write_bytes", "bytes written to memory")):
            counter(f"vllm:estimated_{what}_per_gpu",
                    f"Estimated number of {doc} per GPU {flops}").labels(*values)
        self.running = gauge("vllm:num_requests_running",
                             "Number of requests in model execution batches.").labels(*values)
        self.waiting = gauge("vllm:num_requests_waiting",
                             "Number of requests waiting to be processed.").labels(*values)
        by_reason = gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            ("reason",))
        self.waiting_for_capacity = by_reason.labels(*values, "capacity")
        by_reason.labels(*values, "deferred")
        sleep = gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.", ("sleep_state",))
        self._sleep_awake = sleep.labels(*values, "awake")
        self._sleep_awake.set(1)
        self._sleep_level_1 = sleep.labels(*values, "weights_offloaded")
        self._sleep_level_2 = sleep.labels(*values, "discard_all")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.").labels(*values)
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.").labels(*values)
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.").labels(*values)
        counter("vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, "
                "in terms of number of queried tokens.").labels(*values)
        counter("vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, in "
                "terms of number of cached tokens.").labels(*values)
        counter("vllm:mm_cache_queries",
                "Multi-modal cache queries, in terms of number of queried items.").labels(*values)
        counter("vllm:mm_cache_hits",
                "Multi-modal cache hits, in terms of number of cached items.").labels(*values)
        self.preemptions = counter("vllm:num_preemptions",
                                   "Cumulative number of preemption from the engine.").labels(
                                       *values)
        self.prompt_tokens = counter("vllm:prompt_tokens",
                                     "Number of prefill tokens processed.").labels(*values)
        by_source = counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                            ("source",))
        self.prompt_tokens_computed = by_source.labels(*values, "local_compute")
        self.prompt_tokens_hit = by_source.labels(*values, "local_cache_hit")
        by_source.labels(*values, "external_kv_transfer")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).").labels(*values)
        #: Hit tokens of prompts scheduled and not yet prefilled: their prefill counts only
        #: what it computed as ``local_compute``.
        self._hits_unsettled = 0
        cached_by_source = counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
            "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.", ("source",))
        self.cached_on_device = cached_by_source.labels(*values, "device")
        for source in ("host", "p2p", "disk", "external_unspecified"):
            cached_by_source.labels(*values, source)
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.").labels(*values)
        success = counter("vllm:request_success", "Count of successfully processed requests.",
                          ("finished_reason",))
        self.success = {reason: success.labels(*values, reason) for reason in FINISHED_REASONS}
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ("model_name", "reason"), registry=reg)
        rejections.labels(model, "max_num_queued_reqs")
        rejections.labels(model, "max_num_queued_tokens")
        token_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            token_buckets)
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            ITERATION_TOKEN_BUCKETS)
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", token_buckets)
        self.params_n = histogram("vllm:request_params_n",
                                  "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            token_buckets)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    LATENCY_BUCKETS)
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.",
                                      LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.",
                                     LATENCY_BUCKETS)
        self.request_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.", PREEMPTION_BUCKETS)
        self.prefill_kv_tokens = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets)
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     ("block_size", "cache_dtype", "enable_prefix_caching", "engine",
                      "gpu_memory_utilization", "kv_cache_size_tokens", "num_gpu_blocks"),
                     registry=reg)
        info.labels("16", "auto", "True", "0", "0.92", str(kv_capacity_tokens),
                    str(kv_capacity_tokens // 16)).set(1)

    # ------------------------------------------------------------------ driven by the core

    def on_queues(self, running: int, waiting: int, kv_tokens: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.waiting_for_capacity.set(waiting)
        self.kv_usage.set(min(1.0, kv_tokens / self._kv_capacity))

    def on_sleep(self, level: int) -> None:
        """vLLM's sleep state: level 0 awake, 1 weights offloaded, 2 everything discarded."""
        self._sleep_awake.set(1 if level == 0 else 0)
        self._sleep_level_1.set(1 if level == 1 else 0)
        self._sleep_level_2.set(1 if level == 2 else 0)

    def on_step(self, scheduled_tokens: int, generated: int, step_s: float) -> None:
        self.iteration_tokens.observe(scheduled_tokens)
        if generated:
            self.generation_tokens.inc(generated)
            for _ in range(generated):
                self.itl.observe(step_s)

    def on_scheduled(self, queued_s: float) -> None:
        self.queue_time.observe(queued_s)

    def on_prefilled(self, prompt_tokens: int, ttft_s: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        settled = min(self._hits_unsettled, prompt_tokens)
        self._hits_unsettled -= settled
        self.prompt_tokens_computed.inc(prompt_tokens - settled)
        self.ttft.observe(ttft_s)

    def on_prefix_cache(self, queried: int, hits: int) -> None:
        """A prompt was looked up as it was scheduled (vLLM counts both then, in tokens)."""
        self.prefix_queries.inc(queried)
        if hits:
            self.prefix_hits.inc(hits)
            self.prompt_tokens_hit.inc(hits)
            self.prompt_tokens_cached.inc(hits)
            self.cached_on_device.inc(hits)
            self._hits_unsettled += hits

    def on_finished(self, *, reason: str, prompt_tokens: int, generated: int, max_tokens: int,
                    e2e_s: float, queued_s: float, prefill_s: float, decode_s: float) -> None:
        self.success[reason].inc()
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated)
        self.max_generation_tokens.observe(max_tokens)
        self.params_n.observe(1)
        self.params_max_tokens.observe(max_tokens)
        self.e2e.observe(e2e_s)
        self.inference_time.observe(prefill_s + decode_s)
        self.prefill_time.observe(prefill_s)
        self.decode_time.observe(decode_s)
        self.tpot.observe(decode_s / max(1, generated - 1))
        self.request_preemptions.observe(0)
        self.prefill_kv_tokens.observe(prompt_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def headers(self) -> dict[str, str]:
        return {"Content-Type": CONTENT_TYPE}
