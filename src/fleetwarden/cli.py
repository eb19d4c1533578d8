"""The ``fleetwarden`` command.

Owns: the ``fleetwarden`` command: its options, its output and its exit codes.
Must not: hold any rule of its own: it parses, calls the module that owns the work, and prints.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from fleetwarden import __version__
from fleetwarden.judge import DEFAULT_POLICY
from fleetwarden.router.settings import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    ROUTING_POLICIES,
    RouterSettings,
)
from fleetwarden.sim.config import SIM_ENGINES, FaultMode, KVEventsConfig, SimConfig

if TYPE_CHECKING:
    from fleetwarden.router import Router
    from fleetwarden.watchdog import Check

#: The router's defaults, shown in ``fleetwarden route --help`` (defined once, in settings).
_ROUTER_DEFAULTS = RouterSettings()

app = typer.Typer(
    help="Keep a fleet of LLM inference engines serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fleetwarden {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Keep a fleet of LLM inference engines serving."""


@app.command()
def demo(
    quick: Annotated[bool, typer.Option("--quick", help="Shorter acts (CI).")] = False,
    engine_cmd: Annotated[str | None, typer.Option(
        "--engine-cmd", help="Run the story on real engines (a command template, as for up).")
    ] = None,
    engines: Annotated[int | None, typer.Option(
        "--engines", min=2, help="How many engines (default: 3 simulated, 2 real).")] = None,
    mixed: Annotated[bool, typer.Option(
        "--mixed", help="A mixed fleet: three simulated engines that speak vLLM's, llama.cpp's "
                        "and SGLang's wire, each judged by its own profile.")] = False,
    report: Annotated[Path, typer.Option(
        "--report", help="Where summary.json and timeline.png go.")] = Path("demo-report"),
    no_live: Annotated[bool, typer.Option("--no-live", help="No live view (logs only).")] = False,
    ledger_story: Annotated[bool, typer.Option(
        "--ledger-story", help="Instead: the note-001 story through the ledger alone.")] = False,
) -> None:
    """The whole story on a fleet: a wedge under load, a crash, a trickle of failures, an idle
    wedge, a saturated-but-healthy stretch; a summary and a timeline picture. Exit 1 if a
    request was lost or an act could not be played."""
    if ledger_story:
        _ledger_story()
        return
    if mixed and (engine_cmd is not None or engines is not None):
        typer.echo("demo --mixed: three simulated engines, one of each kind; it takes no "
                   "--engine-cmd and no --engines", err=True)
        raise typer.Exit(2)
    from fleetwarden.demo import run_demo

    logging.basicConfig(level=logging.ERROR)
    code = 0

    async def main() -> None:
        nonlocal code
        # SIGTERM (a test's timeout, a CI job cancelled) and Ctrl-C end the story the way an
        # exception does: through the fleet's stop, which stops every engine it started.
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, task.cancel)
        try:
            code = await run_demo(quick=quick, engine_cmd=engine_cmd, engines=engines,
                                  mixed=mixed, report_dir=report, live=not no_live)
        except asyncio.CancelledError:
            typer.echo("demo: stopped by a signal; every engine it started is stopped", err=True)
            code = 1

    _run(main())
    raise typer.Exit(code)


def _ledger_story() -> None:
    """Play the note-001 story through the real ledger and print every transition."""
    from fleetwarden.ledger import Policy
    from fleetwarden.story import play_note_001

    policy = Policy()  # the story plays on the default policy
    console = Console(highlight=False)
    console.print("[bold]Note 001: a restarted engine has no history[/bold]")
    console.print(f"4 shards, default policy ({policy.unhealthy_threshold} failures condemn, "
                  f"{policy.max_restart_attempts} restarts); shard 1 fails.\n")
    for n, s in enumerate(play_note_001(), 1):
        console.print(f"[bold]{n}. {s.title}[/bold]")
        for t in s.transitions:
            if t.shard == 1:
                console.print(f"   {t.from_state} → {t.to_state}: {t.cause}")
        r = s.record
        console.print(
            f"   [dim]now {r.state}, reported streak {r.consecutive_reported_failures}, "
            f"state_before_partial {r.state_before_partial or 'none'}, "
            f"restarts {r.restart_attempts}/{policy.max_restart_attempts}, {r.base_url}[/dim]"
        )
    console.print("\nThe replacement came back [green]HEALTHY with streak 0[/green]; "
                  "one failed request made it SUSPECT, not DEAD.")


@app.command()
def config(
    example: bool = typer.Option(False, "--example", help="Print a commented example config."),
    check: str = typer.Option(None, "--check", metavar="FILE", help="Validate a config file."),
) -> None:
    """Print a commented example configuration, or validate a file."""
    from fleetwarden.config import ConfigError, example_toml, load_config
    from fleetwarden.credentials import CredentialError, EngineKeys

    if check:
        try:
            # The engines' keys too: a file or a variable that cannot be read fails here, in
            # this environment, not at the fleet's start.
            EngineKeys.of(load_config(check).fleet)
        except (ConfigError, CredentialError) as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from None
        typer.echo(f"{check}: valid")
        return
    if not example:
        typer.echo("use --example to print an example, or --check FILE", err=True)
        raise typer.Exit(2)
    typer.echo(example_toml(), nl=False)


def _parse_since(value: str) -> float:
    """'90s', '10m', '2h', '1d' ago, or an ISO-8601 time; returns a wall-clock timestamp."""
    import datetime as dt
    import time

    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if value and value[-1] in units and value[:-1].replace(".", "", 1).isdigit():
        return time.time() - float(value[:-1]) * units[value[-1]]
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r}: use 90s, 10m, 2h, 1d or an ISO time") from None
    if when.tzinfo is None:
        when = when.astimezone()
    return when.timestamp()


@app.command()
def history(
    config_file: str = typer.Option(None, "--config", "-c", help="Config file (for its journal)."),
    journal: str = typer.Option(None, "--journal", help="Journal file (overrides the config)."),
    shard: int = typer.Option(None, "--shard", help="Only this shard."),
    since: str = typer.Option(None, "--since", help="Only after this: 10m, 2h, 1d or ISO time."),
    all_changes: bool = typer.Option(False, "--all", help="Include counter-only updates."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
    summary: bool = typer.Option(False, "--summary", help="The last run's own work instead "
                                 "(tick, read rounds, evidence to decision, pushes), as JSON."),
) -> None:
    """What happened to the fleet: transitions from the journal, with their causes."""
    import datetime as dt
    import json
    from pathlib import Path

    from fleetwarden.config import ConfigError, load_config
    from fleetwarden.journal import Journal, JournalError

    try:
        path = Path(journal) if journal else load_config(config_file).journal.path
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if not path.exists():
        typer.echo(f"no journal at {path}", err=True)
        raise typer.Exit(2)
    if summary:
        try:
            with Journal(path) as j:
                found = j.run_summary()
        except JournalError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from None
        if found is None:
            typer.echo(f"no run summary in {path}: no run has stopped cleanly with it", err=True)
            raise typer.Exit(1)
        typer.echo(json.dumps(found, indent=2, sort_keys=True))
        return
    try:
        with Journal(path) as j:
            entries = j.transitions(
                shard=shard, since_wall=_parse_since(since) if since else None,
                state_changes_only=not all_changes,
            )
    except JournalError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    for e in entries:
        if as_json:
            typer.echo(json.dumps({"seq": e.seq, "wall": e.wall, "shard": e.shard,
                                   "from": e.from_state, "to": e.to_state, "event": e.event,
                                   "cause": e.cause, "record": e.record}))
        else:
            when = dt.datetime.fromtimestamp(e.wall).isoformat(sep=" ", timespec="seconds")
            typer.echo(f"{when}  shard {e.shard}  {e.from_state} -> {e.to_state}  {e.cause}")
    if not entries and not as_json:
        typer.echo("no transitions recorded")

_SIM = SimConfig()  # the simulator's defaults, shown in --help
_FAULTS = tuple(m.value for m in FaultMode)


def _max_new_tokens(raw: str | None) -> int | None:
    """``max_new_tokens`` of an ``--override-generation-config`` JSON object (None: unset)."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        raise typer.BadParameter(f"{raw!r} is not JSON",
                                 param_hint="--override-generation-config") from None
    cap = value.get("max_new_tokens") if isinstance(value, dict) else None
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise typer.BadParameter(f"max_new_tokens must be an integer >= 1, got {cap!r}",
                                 param_hint="--override-generation-config")
    return cap


def _sim_default_max_new_tokens(model: str, cap: int | None) -> int | None:
    """The default limit of a chat that names none, as vLLM's ``--generation-config auto``
    (its default) takes it from ``--model``'s folder (:func:`fleetwarden.engines.
    generation_limits`): a served name that is no folder here sets none."""
    from fleetwarden.engines import generation_limits
    from fleetwarden.model_files import generation_config_file

    default = generation_limits(model, "auto", {} if cap is None else {"max_new_tokens": cap},
                                read=generation_config_file)[1]
    return default if isinstance(default, int) else None


# The longest options of `fleetwarden sim`, written out here so its signature reads at once.
_SIM_OVERRIDE_GENERATION_CONFIG = typer.Option(
    None, help="vLLM's flag, as JSON: '{\"max_new_tokens\": N}' caps every request's "
    "output at N, even one that names more (the only key the simulator reads).")

_SIM_WEIGHTS = typer.Option(
    None, help="The checkpoint (a file or a folder) loaded at start and at each restart; "
    "its bytes change every answer, as POST /collective_rpc reload_weights does. Default: "
    "the base weights.")

_SIM_ENABLE_SCALE_OUT = typer.Option(
    False, "--enable-scale-out", help="Serve POST /inference/v1/generate, as vLLM's flag "
    "does (without it: 403).")

_SIM_KV_EVENTS_CONFIG = typer.Option(
    None, help="vLLM's flag, as JSON ('{\"enable_kv_cache_events\": true, \"endpoint\": "
    "\"tcp://*:0\", \"replay_endpoint\": \"tcp://*:0\"}'): publish the prefix cache's "
    "KV events over ZMQ as vLLM does; GET /kv_event_sources says where (tcp://*:0: a free "
    "port on --host, one per engine with --engines).")

_SIM_GUARD_DEV_API = typer.Option(
    False, "--guard-dev-api", help="With --api-key, guard the dev endpoints too (sleep, "
    "the RL API: /pause, /collective_rpc, /weight_info, ...), as a proxy in front of vLLM "
    "would; vLLM leaves them open.")


def _check_sim_choices(fault: str | None, engine: str) -> None:
    if fault is not None and fault not in _FAULTS:
        raise typer.BadParameter(f"{fault!r}; choose one of: {', '.join(_FAULTS)}",
                                 param_hint="--fault")
    if engine not in SIM_ENGINES:
        raise typer.BadParameter(f"{engine!r}; choose one of: {', '.join(SIM_ENGINES)}",
                                 param_hint="--engine")


def _sim_kv_events(kv_events_config: str | None) -> KVEventsConfig | None:
    try:
        return (None if kv_events_config is None
                else KVEventsConfig.from_json(kv_events_config))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kv-events-config") from None


@app.command()
def sim(
    port: int = typer.Option(8000, help="Port to listen on; 0 picks a free one (see the "
                             "ready line)."),
    host: str = typer.Option(_SIM.host, help="Address to listen on."),
    slots: int = typer.Option(_SIM.slots, min=1, help="Requests running at once (vLLM's "
                              "max_num_seqs); more wait."),
    steps_per_s: float = typer.Option(_SIM.steps_per_s, min=0.001,
                                      help="Engine steps per second while there is work."),
    tokens_per_step: int = typer.Option(_SIM.tokens_per_step, min=1,
                                        help="Output tokens per running request per step."),
    max_num_batched_tokens: int = typer.Option(
        _SIM.max_num_batched_tokens, min=1,
        help="Token budget of one step: longer prompts prefill over several steps."),
    max_model_len: int = typer.Option(_SIM.max_model_len, min=2,
                                      help="Context length (prompt + output)."),
    model: str = typer.Option(_SIM.model, help="Served model name; a local folder's "
                              "generation_config.json max_new_tokens is then the default "
                              "limit of a chat that names none, as vLLM's."),
    fault: str | None = typer.Option(
        None, help="Start with a fault: " + ", ".join(_FAULTS) + "."),
    factor: float = typer.Option(_SIM.fault_factor, min=0.001,
                                 help="Slowdown of the 'slow' fault."),
    crash_notice_s: float = typer.Option(
        _SIM.crash_notice_s, min=0.0, help="After a crash, seconds before the API server "
        "notices (requests held, /health 200, /metrics frozen), as vLLM's does until its "
        "monitor sees the core gone; 0: at once."),
    engine: str = typer.Option(_SIM.engine, help="Whose wire to speak: "
                               + ", ".join(SIM_ENGINES) + " (their /metrics names and "
                               "endpoints)."),
    engines: int = typer.Option(1, min=1, help="How many engines this one process serves, "
                                "each on its own port with its own state and faults (--port P: "
                                "P, P+1, ...; --port 0: a free port each). A crash ends that "
                                "engine alone."),
    prefix_cache_blocks: int | None = typer.Option(
        None, min=0, help="KV blocks (16 tokens) the prefix cache keeps; default: the whole "
        "KV capacity (slots x max-model-len); 0 turns prefix caching off."),
    api_key: Annotated[list[str] | None, typer.Option(
        "--api-key", help="Guard /v1, /v2, /inference and /cohere as vLLM's --api-key does "
        "(Authorization: Bearer KEY), or with --engine llamacpp / sglang as theirs (all but "
        "/health and /models / all but /health* and /metrics*); repeat for several keys.")
    ] = None,
    override_generation_config: str | None = _SIM_OVERRIDE_GENERATION_CONFIG,
    weights: str | None = _SIM_WEIGHTS,
    enable_scale_out: bool = _SIM_ENABLE_SCALE_OUT,
    kv_events_config: str | None = _SIM_KV_EVENTS_CONFIG,
    guard_dev_api: bool = _SIM_GUARD_DEV_API,
) -> None:
    """Run one simulated engine (OpenAI API, /metrics, faults) until SIGTERM: vLLM by default,
    or llama.cpp's or SGLang's metrics and endpoints with --engine. With --engines N, N of
    them on one event loop (one "ready URL ..." line each, then "all ready N").

    Prints "ready URL ..." once it listens. Change its fault at run time with
    POST /sim/fault {"mode": "wedge"}; {"mode": null} or DELETE /sim/fault clears it.
    GET /sim/stats lists every request it received.
    """
    from fleetwarden.sim import serve

    _check_sim_choices(fault, engine)
    cap = _max_new_tokens(override_generation_config)
    default = _sim_default_max_new_tokens(model, cap)
    kv_events = _sim_kv_events(kv_events_config)
    config = SimConfig(host=host, port=port, model=model, slots=slots, steps_per_s=steps_per_s,
                       tokens_per_step=tokens_per_step, max_model_len=max_model_len,
                       max_num_batched_tokens=max_num_batched_tokens,
                       fault=None if fault is None else FaultMode(fault), fault_factor=factor,
                       crash_notice_s=crash_notice_s,
                       engine=engine, prefix_cache_blocks=prefix_cache_blocks,
                       api_keys=tuple(api_key or ()),
                       override_max_new_tokens=cap, default_max_new_tokens=default,
                       weights_path=weights, enable_scale_out=enable_scale_out,
                       kv_events=kv_events, guard_dev_api=guard_dev_api,
                       # vLLM reads it as bool(int(...)): "1" on, "0" or unset off
                       dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip() not in
                       ("", "0"))
    if engines > 1:
        from fleetwarden.sim.many import serve_many

        raise typer.Exit(serve_many(config, engines))
    raise typer.Exit(serve(config))


@app.command()
def check(
    url: str = typer.Argument(..., help="The engine's base URL, e.g. http://127.0.0.1:8000"),
    proxy: bool = typer.Option(False, "--proxy", help="URL is a load balancer: only "
                               "GET /v1/models is read through it."),
    interval: float = typer.Option(DEFAULT_POLICY.check_interval_s, min=0.0,
                                   help="Seconds between reads."),
    stall_s: float = typer.Option(DEFAULT_POLICY.stall_s, min=0.0,
                                  help="How long a stall must last, over two waits, to be "
                                  "STUCK."),
    in_flight: int = typer.Option(0, min=0, help="Requests a router has in flight there: "
                                  "with an idle engine that is a lost core."),
    model: str | None = typer.Option(None, help="Model for the canary (default: the first "
                                     "from /v1/models)."),
    timeout: float = typer.Option(DEFAULT_POLICY.read_timeout_s, min=0.001,
                                  help="Timeout of one read."),
    canary_timeout: float = typer.Option(DEFAULT_POLICY.canary_timeout_s, min=0.001,
                                         help="Timeout of the canary."),
    engine: str = typer.Option("auto", help="The engine's kind: auto (recognised from "
                               "/metrics), vllm, llamacpp, sglang, tgi or openai (no /metrics)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    api_key_file: Annotated[Path | None, typer.Option(
        "--api-key-file", help="File holding the engine's API key (its --api-key), "
        "sent with every request (mode 0600).")] = None,
    api_key_env: Annotated[str | None, typer.Option(
        "--api-key-env", help="Environment variable holding the engine's API key, "
        "e.g. VLLM_API_KEY.")] = None,
) -> None:
    """Judge one engine once from its /metrics, the way the fleet's watchdog does.

    Exit status: 0 healthy (busy, or idle with a good canary), 1 stuck or lost-core (or an idle
    engine's canary failed), 2 unreachable, 3 cannot judge.
    """
    import asyncio
    import json
    from dataclasses import replace

    from fleetwarden.credentials import CredentialError, read_key
    from fleetwarden.engines import ENGINE_NAMES
    from fleetwarden.watchdog import check as run_check

    if engine not in ENGINE_NAMES:
        raise typer.BadParameter(f"{engine!r}; choose one of: {', '.join(ENGINE_NAMES)}",
                                 param_hint="--engine")
    try:
        key = read_key("check", api_key_file, api_key_env)
    except CredentialError as exc:
        raise typer.BadParameter(str(exc).replace("check.", "--").replace("_", "-"),
                                 param_hint="--api-key-file / --api-key-env") from None
    policy = replace(DEFAULT_POLICY, stall_s=stall_s, read_timeout_s=timeout,
                     canary_timeout_s=canary_timeout, check_interval_s=interval)
    result = asyncio.run(run_check(url, proxy=proxy, in_flight=in_flight, policy=policy,
                                   model=model, engine=engine, key=key))
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        _print_check(result)
    raise typer.Exit(result.exit_code)


def _print_check(result: Check) -> None:
    """`fleetwarden check`'s report in words: verdict, evidence, engine, faults, canary."""
    from fleetwarden.engines import CapUnknown

    report = result.report
    console = Console(highlight=False)
    colour = {0: "green", 1: "red", 2: "red", 3: "yellow"}[result.exit_code]
    console.print(f"{report.url}  [bold {colour}]{report.verdict.value.upper()}[/] "
                  f"({report.health.value})")
    console.print(f"  {report.evidence.summary}", markup=False)
    details = [f"{result.reads} reads"]
    if report.tokens_per_s is not None:
        details.append(f"{report.tokens_per_s:.0f} tokens/s")
    kind = report.engine
    if report.incarnation is not None:
        details.append(f"process {report.incarnation} (from the {kind.start_header} header: "
                       "compared, not a time)" if kind is not None and kind.start_header
                       else f"process started {report.incarnation}")
    console.print("  " + "; ".join(details), markup=False)
    console.print(f"  engine: {kind.title if kind else 'not recognised'}"
                  + (f"; progress proof: {kind.progress}" if kind else ""), markup=False)
    for limit in kind.limits if kind is not None else ():
        console.print(f"  limit: {limit}", markup=False)
    cap = result.output_cap
    if not (isinstance(cap, CapUnknown) and not cap.settled):  # asked, and it answered
        # What a continuation there must not ask past (docs/design.md 4.1, "Server caps").
        console.print("  output cap: " + (
            "[bold yellow]unknown[/] " + escape(f"({cap.why}; in a fleet, declare output_cap "
                                                "on its [[fleet.backends]] table)")
            if isinstance(cap, CapUnknown)
            else "none" if cap is None else f"{cap} tokens (from its /server_info)"))
    default = result.output_default
    if not (isinstance(default, CapUnknown) and not default.settled):
        # What a chat that names no limit is held to there, from the same answer.
        console.print("  output default: " + (
            "[bold yellow]unknown[/] " + escape(f"({default.why}; in a fleet, declare "
                                                "output_default on its [[fleet.backends]] "
                                                "table)")
            if isinstance(default, CapUnknown)
            else "none" if default is None
            else f"{default} tokens (its model's generation config)"))
    for fault in report.faults:
        # Never held against the engine (it proves nothing either way): a config fix.
        console.print(f"  [bold red]config fault[/]: {escape(fault)}")
    canary = report.canary
    if canary is not None:
        said = ("answered" if canary.ok else "REFUSED, proves nothing" if canary.refused
                else "FAILED")
        console.print(f"  canary: {said} in "
                      f"{canary.latency_s:.2f} s" + (f" ({canary.error})" if canary.error
                                                    else ""), markup=False)
    else:
        console.print(f"  canary: none sent ({report.canary_rule.value})", markup=False)


#: The options of `fleetwarden route`, one each (the command takes them in this order).
_RouteBackend = Annotated[list[str] | None, typer.Option(
    "--backend", "-b", help="An engine's base URL (http://host:port); repeat for each. "
                            "May be left out with --control-port: a controller pushes "
                            "them.")]
_RouteHost = Annotated[str, typer.Option(
    help="Address to listen on (0.0.0.0: every one).")]
_RoutePort = Annotated[int, typer.Option(
    help="Port to listen on (0: any free port).")]
_RouteReusePort = Annotated[bool, typer.Option(
    "--reuse-port", help="Share the port with other router processes (SO_REUSEPORT).")
]
_RouteBackendTimeout = Annotated[float, typer.Option(
    "--backend-timeout",
    help="Seconds one attempt on a backend may take, headers to last byte.")
]
_RouteConnectTimeout = Annotated[float, typer.Option(
    "--connect-timeout", help="Seconds to open a connection to a backend.")
]
_RouteMaxRetries = Annotated[int, typer.Option(
    "--max-retries",
    help="Re-sends of a request an engine may have worked on (0: none). Requests that "
         "never reached an engine are always re-sent.")]
_RouteMaxBodyBytes = Annotated[int, typer.Option(
    "--max-body-bytes", help="Largest request body; larger ones are answered 413.")
]
_RouteSessionHeader = Annotated[str, typer.Option(
    "--session-header", help="Header naming a session for affinity ('' turns it off).")
]
_RouteContinueStreams = Annotated[bool, typer.Option(
    "--continue-streams/--no-continue-streams",
    help="Continue a stream its engine cut mid-answer on another engine.")
]
_RouteContinueAnswers = Annotated[bool, typer.Option(
    "--continue-answers/--no-continue-answers",
    help="Continue non-streamed answers too (streamed from the engine, assembled here).")
]
_RouteUpstreamFields = Annotated[bool, typer.Option(
    "--upstream-fields/--no-upstream-fields",
    help="The backends take vLLM's own request fields (return_token_ids, token-id "
         "prompts, continue_final_message); off for other OpenAI-compatible servers.")
]
_RouteRouting = Annotated[str, typer.Option(
    "--routing", help="How a request picks its engine: "
    + " or ".join(ROUTING_POLICIES) + " (docs/design.md 4.3).")
]
_RouteKeysFile = Annotated[Path | None, typer.Option(
    "--keys-file",
    help="Client keys (`fleetwarden keys add`): every request needs one, else 401.")
]
_RouteControlPort = Annotated[int | None, typer.Option(
    "--control-port",
    help="Also serve the control API at this port (needs --token-file).")
]
_RouteControlHost = Annotated[str, typer.Option(
    "--control-host", help="Address the control API listens on (still behind the "
                           "token): 0.0.0.0 lets a controller on another host drive it.")
]
_RouteTokenFile = Annotated[Path | None, typer.Option(
    "--token-file",
    help="Bearer token of the control API; created (0600) with a new token if missing.")
]
_RouteSettingsJson = Annotated[str | None, typer.Option(
    "--settings-json", hidden=True,
    help="Every RouterSettings field as JSON (what `fleetwarden up` gives its router "
         "processes); overrides the options above.")]
_RouteManaged = Annotated[bool, typer.Option(
    "--managed", hidden=True,
    help="Started by a fleet's controller: the reflex drop is armed from the start.")
]
_RouteWorker = Annotated[int | None, typer.Option(
    "--worker", hidden=True, min=0,
    help="Worker N of several router processes on one port: its metrics carry "
         "worker=\"N\".")]
_RouteTakeListeners = Annotated[list[str] | None, typer.Option(
    "--take-listeners", hidden=True,
    help="Launch id of a router this one replaces (a reload): listen on that router's "
         "own listening sockets, taken from it, instead of binding one; repeat for "
         "each.")]
_RouteLogLevel = Annotated[str, typer.Option(
    "--log-level", help="debug, info, warning or error.")]


@app.command()
def route(
    backend: _RouteBackend = None,
    host: _RouteHost = DEFAULT_HOST,
    port: _RoutePort = DEFAULT_PORT,
    reuse_port: _RouteReusePort = False,
    backend_timeout: _RouteBackendTimeout = _ROUTER_DEFAULTS.backend_timeout_s,
    connect_timeout: _RouteConnectTimeout = _ROUTER_DEFAULTS.connect_timeout_s,
    max_retries: _RouteMaxRetries = _ROUTER_DEFAULTS.max_retries,
    max_body_bytes: _RouteMaxBodyBytes = _ROUTER_DEFAULTS.max_body_bytes,
    session_header: _RouteSessionHeader = _ROUTER_DEFAULTS.session_header or "",
    continue_streams: _RouteContinueStreams = _ROUTER_DEFAULTS.continue_streams,
    continue_answers: _RouteContinueAnswers = _ROUTER_DEFAULTS.continue_answers,
    upstream_fields: _RouteUpstreamFields = _ROUTER_DEFAULTS.upstream_fields,
    routing: _RouteRouting = _ROUTER_DEFAULTS.routing,
    keys_file: _RouteKeysFile = None,
    control_port: _RouteControlPort = None,
    control_host: _RouteControlHost = DEFAULT_HOST,
    token_file: _RouteTokenFile = None,
    settings_json: _RouteSettingsJson = None,
    managed: _RouteManaged = False,
    worker: _RouteWorker = None,
    take_listeners: _RouteTakeListeners = None,
    log_level: _RouteLogLevel = "warning",
) -> None:
    """Run the router alone in front of a static list of engines.

    No health management: retries move failed requests to other engines; no engine is dropped,
    until a controller drives it over the control API (then a failing engine is dropped at
    once, until the controller's next push).

    Stops on Ctrl-C or SIGTERM: it stops accepting at once and lets the requests it holds
    finish, up to the shutdown grace. SIGUSR1 is the same for a replacement (another router
    on the same port with --reuse-port): it lets them finish up to the drain bound.
    """
    import json

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    def refuse(message: str) -> NoReturn:
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(2)

    backends = backend or []
    for url in backends:
        if not url.startswith(("http://", "https://")):
            refuse(f"--backend {url!r} is not an http:// or https:// URL")
    if control_port is not None and token_file is None:
        refuse("--control-port needs --token-file")
    if not backends and control_port is None:
        refuse("give at least one --backend, or a --control-port for a controller to push "
               "them")
    try:
        if settings_json is not None:
            settings = RouterSettings(**json.loads(settings_json))
        else:
            settings = RouterSettings(
                backend_timeout_s=backend_timeout, connect_timeout_s=connect_timeout,
                max_retries=max_retries, max_body_bytes=max_body_bytes,
                session_header=session_header or None, continue_streams=continue_streams,
                continue_answers=continue_answers, upstream_fields=upstream_fields,
                routing=routing, keys_file=None if keys_file is None else str(keys_file))
        if settings.keys_file is not None:
            from fleetwarden.router.keys import read_keys

            read_keys(settings.keys_file)  # a file that cannot be used is said here, not later
        from fleetwarden.auth import load_or_create_token

        token = load_or_create_token(token_file) if token_file is not None else None
    except (ValueError, TypeError, OSError) as exc:
        refuse(str(exc))
    if take_listeners and token is None:
        refuse("--take-listeners needs --token-file (the old router's control token)")
    _run(_serve_router(backends, settings, host, port, control_port, token,
                       control_host=control_host, reuse_port=reuse_port, managed=managed,
                       worker=worker, take_from=take_listeners or []))


#: A router process's youngest-generation threshold for Python's cycle collector (default 700).
#: A request's objects die by reference count, but 64 requests in flight hold more than 700 at
#: once, so the default ran a collection every ~20 requests that found nothing: 0.5 s of a
#: 6.5 s run's CPU (bench/router_overhead.py's load at concurrency 64, gc.callbacks timing it);
#: with 20,000, none ran. What startup built is frozen out of the collector's view; cyclic
#: garbage, if any, is still collected.
ROUTER_GC_THRESHOLD = 20_000


async def _serve_router(backends: list[str], settings: RouterSettings, host: str, port: int,
                        control_port: int | None, token: str | None, *,
                        control_host: str = DEFAULT_HOST, reuse_port: bool = False,
                        managed: bool = False, worker: int | None = None,
                        take_from: Sequence[str] = ()) -> None:
    from fleetwarden.router import Router
    from fleetwarden.router.handover import ListenerHandover

    sockets = await _take_listeners(take_from, token) if take_from else []
    router: Router = Router(backends, settings, health_managed=managed, worker=worker)
    # A managed router's control port is held bound by the `fleetwarden up` that launched it
    # until the API answers there (launchers.local.reserve_port): shared, SO_REUSEPORT.
    await router.start(host, port, control_port=control_port, control_token=token,
                       control_host=control_host, reuse_port=reuse_port,
                       control_reuse_port=managed, sockets=sockets)
    # A managed router hands its listening sockets to the one that replaces it (a reload):
    # see fleetwarden.router.handover.
    launch_id = os.environ.get("FLEETWARDEN_LAUNCH_ID")
    giver = (ListenerHandover(launch_id, token, router.listening_sockets)
             if managed and token is not None and launch_id else None)
    gc.freeze()
    gc.set_threshold(ROUTER_GC_THRESHOLD, *gc.get_threshold()[1:])
    try:
        if giver is not None:
            await giver.start()
        typer.echo(f"fleetwarden route: listening on {router.url}, "
                   f"{len(backends)} backend(s)")
        if router.control_url is not None:
            typer.echo(f"fleetwarden route: control API on {router.control_url}")
        sys.stdout.flush()
        stop = asyncio.Event()
        drain = False

        def handover() -> None:
            nonlocal drain
            drain = True
            stop.set()

        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        loop.add_signal_handler(signal.SIGUSR1, handover)
        await stop.wait()
        # SIGTERM: stop accepting, let what is in flight finish within shutdown_grace_s.
        # SIGUSR1 (a reload: another router took the port): the same, up to drain_s, and
        # without racing a keep-alive client's next request.
        await router.drain(settings.drain_s if drain else settings.shutdown_grace_s)
    finally:
        if giver is not None:
            await giver.close()
        await router.stop()


async def _take_listeners(launch_ids: Sequence[str], token: str | None) -> list[socket.socket]:
    """The listening sockets of the routers this one replaces. One that cannot be had is
    replaced by a socket of our own (``--reuse-port``): the port is served either way, with the
    old listener's queue at risk as before the handover existed."""
    from fleetwarden.router.handover import HandoverError, take_listeners

    assert token is not None
    taken: list[socket.socket] = []
    for launch_id in launch_ids:
        try:
            taken += await asyncio.to_thread(take_listeners, launch_id, token)
        except HandoverError as exc:
            logging.getLogger("fleetwarden.router").warning(
                "could not take the listeners of router %s (%s): binding a socket of our own",
                launch_id, exc)
    return taken


keys_app = typer.Typer(help="Client keys of the router's data port (`[router] keys_file`).",
                       no_args_is_help=True)
app.add_typer(keys_app, name="keys")

_KeysFileOpt = Annotated[Path | None, typer.Option(
    "--file", "-f", help="The keys file (default: the config's [router] keys_file).")]
_KeysConfigOpt = Annotated[Path | None, typer.Option(
    "--config", "-c", help="The fleet's config file, for its [router] keys_file.")]


def _keys_file(file: Path | None, config_file: Path | None) -> Path:
    """The keys file named on the command line, else the config's."""
    if file is not None:
        return file
    configured = _load_config(config_file, {}).router.keys_file
    if configured is None:
        typer.echo("error: give --file, or a --config whose [router] keys_file is set",
                   err=True)
        raise typer.Exit(2)
    return Path(configured)


@keys_app.command("add")
def keys_add(
    name: Annotated[str, typer.Argument(help="The key's name: in /metrics and on the "
                                        "dashboard.")],
    file: _KeysFileOpt = None, config_file: _KeysConfigOpt = None,
) -> None:
    """Make a new key, store its hash, and print the key (once: it is stored nowhere).
    Running routers take it within a second, without a restart."""
    from fleetwarden.router.keys import KeysFileError, add_key

    path = _keys_file(file, config_file)
    try:
        secret = add_key(path, name)
    except (KeysFileError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"key {name!r} added to {path}; give this to its client (shown once):",
               err=True)
    typer.echo(secret)


@keys_app.command("remove")
def keys_remove(
    name: Annotated[str, typer.Argument(help="The key's name.")],
    file: _KeysFileOpt = None, config_file: _KeysConfigOpt = None,
) -> None:
    """Remove a key: running routers refuse it within a second, without a restart."""
    from fleetwarden.router.keys import KeysFileError, remove_key

    path = _keys_file(file, config_file)
    try:
        remove_key(path, name)
    except (KeysFileError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"key {name!r} removed from {path}")


@keys_app.command("list")
def keys_list(file: _KeysFileOpt = None, config_file: _KeysConfigOpt = None) -> None:
    """The names of the keys in the file (their secrets are not in it)."""
    from fleetwarden.router.keys import KeysFileError, read_keys

    try:
        names = read_keys(_keys_file(file, config_file))
    except KeysFileError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for name in names:
        typer.echo(name)


def _load_config(config_file: Path | None, overrides: dict[str, dict[str, Any]]) -> Any:
    """The config file (or the defaults) with command-line overrides, validated together."""
    from fleetwarden.config import ConfigError, load_config

    try:
        return load_config(config_file, overrides)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None


@app.command()
def up(
    config_file: Annotated[Path | None, typer.Option(
        "--config", "-c", help="TOML config file (see `fleetwarden config --example`).")] = None,
    engines: Annotated[int | None, typer.Option(
        "--engines", "-n", help="Engines to launch (default 2, or 0 with --backend).")] = None,
    engine_cmd: Annotated[str | None, typer.Option(
        "--engine-cmd", help="Command that starts one engine; {host}, {port}, {shard} and "
                             "{python} are filled in. Default: a simulated vLLM engine.")] = None,
    engine: Annotated[str | None, typer.Option(
        "--engine", help="The kind of --engine-cmd's (and --backend's) engines: auto (from "
                         "/metrics), vllm, llamacpp, sglang, tgi or openai (no /metrics).")
    ] = None,
    group: Annotated[list[str] | None, typer.Option(
        "--group", help="More engines of another kind and command (a mixed fleet), as "
                        "KIND:COUNT:COMMAND, e.g. 'llamacpp:2:llama-server --port {port} ...' "
                        "(repeat).")] = None,
    backend: Annotated[list[str] | None, typer.Option(
        "--backend", "-b", help="Attach an engine something else runs (repeat).")] = None,
    restart_command: Annotated[str | None, typer.Option(
        "--restart-command", help="Restarts a condemned attached engine; {shard}, {url}, "
                                  "{name} are filled in.")] = None,
    api_key_file: Annotated[Path | None, typer.Option(
        "--api-key-file", help="File holding the engines' API key (their --api-key; mode "
        "0600): every request of fleetwarden's own carries it.")] = None,
    api_key_env: Annotated[str | None, typer.Option(
        "--api-key-env", help="Environment variable holding the engines' API key, e.g. "
        "VLLM_API_KEY.")] = None,
    weights: Annotated[str | None, typer.Option(
        "--weights", help="static (plain serving) or trainer (an RL trainer refits).")] = None,
    launcher: Annotated[str | None, typer.Option(
        "--launcher", help="local (process groups here) or ray (Ray actors on a cluster; "
                           "see docs/ray.md).")] = None,
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", help="The Ray cluster for --launcher ray (default auto: the one this "
                              "machine is a node of).")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Router port.")] = None,
    router_workers: Annotated[int | None, typer.Option(
        "--router-workers", help="Router processes sharing the router port (default 1); 0 "
                                 "runs the router inside this process.")] = None,
    admin_port: Annotated[int | None, typer.Option("--admin-port", help="Admin port.")] = None,
    journal: Annotated[Path | None, typer.Option("--journal", help="Journal file.")] = None,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="No live status table; log lines only.")] = False,
    log_level: Annotated[str, typer.Option(
        "--log-level", help="debug, info, warning or error.")] = "info",
) -> None:
    """Run a fleet: engines, router, watchdog, controller, supervisor, admin API.

    With no options: two simulated vLLM engines on this machine. Ctrl-C or SIGTERM stops
    every engine it started and leaves nothing running.
    """
    if backend and engines is None:
        engines = 0
    cfg = _load_config(config_file, {
        "fleet": {"engines": engines, "engine_cmd": engine_cmd, "backends": backend or None,
                  "engine": engine, "groups": [_group(g) for g in group] if group else None,
                  "restart_command": restart_command, "weights": weights,
                  "launcher": launcher, "ray_address": ray_address,
                  "api_key_file": str(api_key_file) if api_key_file else None,
                  "api_key_env": api_key_env},
        "router": {"port": port, "workers": router_workers}, "admin": {"port": admin_port},
        "journal": {"path": str(journal) if journal else None},
    })
    if cfg.router.keys_file is not None:
        from fleetwarden.router.keys import KeysFileError, read_keys

        try:  # said before anything starts, not as a router that cannot
            read_keys(cfg.router.keys_file)
        except KeysFileError as exc:
            typer.echo(f"error: [router] keys_file: {exc}", err=True)
            raise typer.Exit(2) from None
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not quiet:
        logging.getLogger().setLevel(max(logging.WARNING, logging.getLogger().level))
    _run(_up(cfg, quiet))


def _group(spec: str) -> dict[str, Any]:
    """``--group KIND:COUNT:COMMAND`` as a ``[[fleet.groups]]`` table (validated with the rest
    of the config, so a bad kind or command is named like any config error)."""
    kind, _, rest = spec.partition(":")
    count, _, command = rest.partition(":")
    if not (kind and count.isdigit() and command):
        typer.echo(f"--group {spec!r}: expected KIND:COUNT:COMMAND, e.g. "
                   "'llamacpp:2:llama-server -m tiny.gguf --port {port} --metrics'", err=True)
        raise typer.Exit(2)
    return {"engine": kind, "engines": int(count), "engine_cmd": command}


async def _up(cfg: Any, quiet: bool) -> None:
    from rich.live import Live

    from fleetwarden.admin import views
    from fleetwarden.console import fleet_view
    from fleetwarden.fleet import Fleet
    from fleetwarden.tasks import TaskOwner

    fleet = Fleet(cfg)

    def stop_on_signal() -> None:
        # A Ray driver (launcher = "ray") catches SIGTERM in C++ first and arms a 3 s alarm
        # that aborts the process; a graceful stop of every engine takes longer. Disarm it.
        signal.alarm(0)
        fleet.request_stop()

    reloads = TaskOwner()

    async def reload() -> None:
        try:
            await fleet.reload_routers()
        except Exception as exc:
            logging.getLogger("fleetwarden").error("router reload failed: %s", exc)

    def reload_on_signal() -> None:
        reloads.start(reload(), "router-reload")

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop_on_signal)
    # SIGHUP: new router processes on the same port, the old ones drain and exit.
    loop.add_signal_handler(signal.SIGHUP, reload_on_signal)
    console = Console(highlight=False)
    console.print(f"fleetwarden {__version__}: starting {cfg.fleet.launched} engine(s)"
                  + (f" and attaching {len(cfg.fleet.backends)}" if cfg.fleet.backends else ""))
    try:
        await fleet.start()
    except Exception as exc:
        await fleet.stop()
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    try:
        console.print(f"router     {fleet.router_url}/v1   (OpenAI API)")
        console.print(f"admin      {fleet.admin_url}/admin/status   "
                      f"(token in {cfg.admin.token_file})", soft_wrap=True)
        # The one place the token is shown (the terminal, never a log): one line, unwrapped,
        # so that it can be copied whole however narrow the terminal.
        console.print(f"dashboard  {fleet.admin_url}/?token={fleet.admin.token}", soft_wrap=True)
        console.print(f"journal    {cfg.journal.path}   logs {cfg.fleet.log_dir}/")
        console.print("Ctrl-C stops the fleet and every engine it started.\n")
        if quiet:
            await fleet.run()
            return

        async def live() -> None:
            with Live(console=console, refresh_per_second=2, transient=False) as view:
                while not fleet.stopping:
                    snap = fleet.snapshot()
                    view.update(fleet_view(views.status_view(snap), views.shards_view(snap),
                                           fleet.admin.events.recent))
                    await asyncio.sleep(0.5)

        async with asyncio.TaskGroup() as group:
            group.create_task(fleet.run())
            group.create_task(live())
    finally:
        console.print("stopping: every engine this fleet started ...")
        await fleet.stop()
        console.print("stopped; nothing left running.")


def _client(config_file: Path | None, admin: str | None, token_file: Path | None) -> Any:
    from fleetwarden.client import FleetClient, FleetClientError

    cfg = _load_config(config_file, {})
    url = admin or f"http://{cfg.admin.host}:{cfg.admin.port}"
    try:
        return FleetClient(url, token_file=token_file or cfg.admin.token_file)
    except FleetClientError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None


ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", "-c", help="The fleet's config file (for its admin address and token).")]
AdminOpt = Annotated[str | None, typer.Option(
    "--admin", help="Admin API URL (default: the config's [admin] host and port; "
    "`fleetwarden config --example` shows their defaults).")]
TokenOpt = Annotated[Path | None, typer.Option(
    "--token-file", help="Admin token file (default: from the config).")]


@app.command()
def status(
    config_file: ConfigOpt = None, admin: AdminOpt = None, token_file: TokenOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The running fleet's shards, states and counters (from its admin API)."""
    import json

    from fleetwarden.client import FleetClientError
    from fleetwarden.console import fleet_view

    client = _client(config_file, admin, token_file)
    try:
        st, shards = client.status_and_shards()  # one snapshot: the headline is the rows'
        transitions = client.transitions()
    except FleetClientError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps({"status": st, "shards": shards}, indent=2))
        return
    Console(highlight=False).print(fleet_view(st, shards, transitions))


@app.command()
def chaos(
    fault: Annotated[str, typer.Argument(
        help="wedge, unwedge, crash, slow, error5xx, refuse, restart, no_metrics, "
             "garbage_metrics or clear")],
    shard: Annotated[int, typer.Argument(help="The shard's index.")],
    factor: Annotated[float | None, typer.Option(help="For slow: how many times slower.")] = None,
    duration: Annotated[float | None, typer.Option(
        "--duration", help="Seconds until a simulated engine clears the fault by itself.")] = None,
    config_file: ConfigOpt = None, admin: AdminOpt = None, token_file: TokenOpt = None,
) -> None:
    """Inject a fault into one shard's engine (simulated: its fault endpoint; real local vLLM:
    SIGSTOP / SIGCONT / SIGKILL of its EngineCore; local llama-server: wedge ptrace-stops its
    busiest compute thread, /health and /metrics still answering, as root)."""
    from fleetwarden.client import FleetClientError

    client = _client(config_file, admin, token_file)
    options: dict[str, Any] = {}
    if factor is not None:
        options["factor"] = factor
    if duration is not None:
        options["duration_s"] = duration
    try:
        result = client.chaos(shard, fault, **options)
    except FleetClientError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    import datetime as dt

    landed = dt.datetime.fromtimestamp(result["at"], dt.UTC)
    typer.echo(f"shard {shard}: {result['how']}, at {landed.isoformat(timespec='milliseconds')}")


def _run(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop when it is installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
