"""Configuration: one TOML file, validated with pydantic. Every default has one home.

Owns: the TOML file, its validation and its messages; defaults that no component owns, each with
its reason.
Must not: repeat a default that a component owns (``ledger.Policy``, ``judge.WatchdogPolicy``,
``router.settings``): it reads them.

A setting that a component's policy owns is declared there, with its default and its reason.
A section exposes it by a field of the same name (or one named in the section's ``_renamed``)
whose default is the policy's and whose type is its validation; everything else is derived
from the policy's fields: the comment ``config --example`` prints, the values each policy is
built from, and the policy's own checks at ``config --check`` (see :class:`_Section`).

The sections follow the picture of docs/design.md section 1: `[fleet]` (the engines), `[router]`,
`[health]` (watchdog and ledger thresholds), `[supervisor]` (restarts), `[journal]` and
`[admin]`. Components take their section as it is; nothing else holds a default.

Invalid input is a :class:`ConfigError` whose lines name the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import string
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self, cast
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fleetwarden.judge import WatchdogPolicy
from fleetwarden.ledger import Policy, WeightsMode
from fleetwarden.refit import DEFAULT_LEASE_S
from fleetwarden.router.settings import DEFAULT_HOST, DEFAULT_PORT, RouterSettings

__all__ = [
    "AdminConfig",
    "Config",
    "ConfigError",
    "FleetConfig",
    "HealthConfig",
    "JournalConfig",
    "RouterConfig",
    "SupervisorConfig",
    "example_toml",
    "load_config",
    "parse_config",
]

#: Defaults that a component defines (with their reasons, beside the code they govern).
_WATCHDOG = WatchdogPolicy()
_LEDGER = Policy()
_ROUTER = RouterSettings()


#: The engine kinds a fleet names (``fleetwarden.engines.ENGINE_NAMES``; a unit test keeps the
#: two in step): ``auto`` recognises each engine from its ``/metrics`` at the first read.
EngineName = Literal["auto", "vllm", "llamacpp", "sglang", "tgi", "openai"]

PositiveFloat = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]
Port = Annotated[int, Field(ge=0, le=65535)]


#: A declared server cap on every request's output (docs/design.md 4.1, "Server caps"): a
#: number of tokens, or "none" (the engine caps nothing: said, so nothing is left unknown).
OutputCap = Annotated[int, Field(ge=1)] | Literal["none"]


def _output_cap(where: str, value: object) -> int | str:
    """A declared ``output_cap`` or ``output_default``, checked here so that the error names
    the entry it is on."""
    if value == "none" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f'{where}: must be an integer >= 1 (tokens) or "none", got {value!r}')


class _Section(BaseModel):
    """One ``[section]`` of the file. It may expose settings that components' policies own
    (``_policies``: frozen dataclasses): a field named as a policy's field stands for it."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    #: The policies whose fields this section exposes.
    _policies: ClassVar[tuple[type[Any], ...]] = ()
    #: A field named otherwise than the policy field it stands for: its name -> the policy's.
    _renamed: ClassVar[dict[str, str]] = {}

    @classmethod
    def policy_fields(cls, policy: type[Any]) -> dict[str, str]:
        """This section's fields that stand for ``policy``'s: field name -> policy field name."""
        if policy not in cls._policies:
            return {}
        owned = {f.name for f in dataclasses.fields(policy)}
        names = {key: cls._renamed.get(key, key) for key in cls.model_fields}
        return {key: name for key, name in names.items() if name in owned}

    @classmethod
    def owner_of(cls, key: str) -> tuple[type[Any], str] | None:
        """The policy and policy field that ``key`` stands for; None: the section's own."""
        for policy in cls._policies:
            name = cls.policy_fields(policy).get(key)
            if name is not None:
                return policy, name
        return None

    def policy_values(self, policy: type[Any]) -> dict[str, Any]:
        """What this section sets of ``policy``: keyword arguments by the policy's names."""
        return {name: getattr(self, key) for key, name in self.policy_fields(policy).items()}

    @model_validator(mode="after")
    def _policies_accept(self) -> Self:
        # Each policy checks what a field alone cannot (RouterSettings: never 504; the ledger's
        # Policy: the ejection backoff grows). Asked here, `config --check` says so, not the
        # fleet's start; the fields' own bounds were checked first.
        for policy in self._policies:
            policy(**self.policy_values(policy))
        return self


#: What an engine command (and its environment's values) may name: the local and Ray
#: launchers fill in these, and only these (``str.format``).
ENGINE_PLACEHOLDERS = frozenset({"host", "port", "shard", "python"})
#: What an attached engine's restart command may name (the attach launcher fills them in).
RESTART_PLACEHOLDERS = frozenset({"shard", "url", "name"})


def _check_template(field: str, text: str, known: frozenset[str]) -> None:
    """A command template is filled in with ``str.format`` when an engine starts: a brace that
    is no known placeholder (``{model}``, ``{0}``, a lone ``{`` of a JSON argument) would fail
    there, at the first launch or restart, not when the file was checked. Literal braces are
    written doubled (``{{`` and ``}}``), as ``str.format`` wants them."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
    except ValueError as exc:
        raise ValueError(f"{field}: {exc} in {text!r} (write a literal brace as {{{{ or }}}})"
                         ) from None
    for name in names:
        if name not in known:
            raise ValueError(
                f"{field}: {{{name}}} is not a placeholder; known ones: "
                f"{', '.join('{' + k + '}' for k in sorted(known))} (write a literal brace "
                "as {{ or }})")


def _key_source(literal: str | None, file: Path | None, env: str | None) -> None:
    """A key is read from a file or a variable, never written in the config: a literal one
    would be in every copy, diff and paste of the file. No message repeats it."""
    if literal is not None:
        raise ValueError("api_key: a key is never written in the config file; put it in a "
                         "file (api_key_file, mode 0600) or an environment variable "
                         "(api_key_env)")
    if file is not None and env is not None:
        raise ValueError("api_key_file and api_key_env are both set; name one")
    if env is not None and not env.strip():
        raise ValueError("api_key_env: name an environment variable")


class EngineGroup(_Section):
    """More launched engines, of another command and kind: a mixed fleet. A group's shards are
    numbered after the fleet's own `engines`, in the order the groups are listed (attached
    `backends` come last)."""

    #: Engines of this group.
    engines: PositiveInt = 1
    #: Command that starts one engine of this group; the placeholders of `fleet.engine_cmd`.
    engine_cmd: str
    #: Their kind (as `fleet.engine`).
    engine: EngineName = "auto"
    #: Extra environment for this group's engines, on top of `fleet.engine_env`.
    engine_env: dict[str, str] = Field(default_factory=dict)
    #: The API key this group's engines want (`--api-key`), if not the fleet's: a file that
    #: holds it (mode 0600), or an environment variable. As `fleet.api_key_file`.
    api_key_file: Path | None = None
    api_key_env: str | None = None
    #: Refused: a key is never written in the config (see `fleet.api_key`).
    api_key: str | None = None
    #: The server cap on every request's output of this group's engines, where their command
    #: does not show it (a wrapper script): as `fleet.output_cap`.
    output_cap: OutputCap | None = None
    #: Their default limit of a chat that names none, where this host cannot read their
    #: model's generation config: as `fleet.output_default`.
    output_default: OutputCap | None = None

    @field_validator("output_cap", "output_default", mode="before")
    @classmethod
    def _cap(cls, value: object, info: ValidationInfo) -> object:
        return value if value is None else _output_cap(str(info.field_name), value)

    @model_validator(mode="after")
    def _has_port(self) -> EngineGroup:
        _key_source(self.api_key, self.api_key_file, self.api_key_env)
        _check_template("engine_cmd", self.engine_cmd, ENGINE_PLACEHOLDERS)
        for key, value in self.engine_env.items():
            _check_template(f"engine_env.{key}", value, ENGINE_PLACEHOLDERS)
        if "{port}" not in self.engine_cmd:
            raise ValueError("engine_cmd must contain {port}: each engine gets a free port")
        return self


class FleetConfig(_Section):
    """The engines: launched here (a command template) and/or attached (URLs run elsewhere)."""

    _policies = (Policy,)

    #: Engines to launch. Two is the smallest fleet where one can fail and the other serve.
    engines: Annotated[int, Field(ge=0)] = 2
    #: Command that starts one engine; `{host}`, `{port}`, `{shard}` and `{python}` are
    #: filled in. Unset: a simulated vLLM engine (`fleetwarden sim`), so a newcomer's first
    #: `fleetwarden up` works on any machine.
    engine_cmd: str | None = None
    #: Extra environment for launched engines; values are templates like `engine_cmd`.
    engine_env: dict[str, str] = Field(default_factory=dict)
    #: What kind of engine `engine_cmd` starts (and `backends` are): `vllm`, `llamacpp`,
    #: `sglang`, `tgi`, or `openai` (no /metrics: canaries and the router's evidence only).
    #: `auto` recognises each engine from its /metrics at the first read; an engine with no
    #: known /metrics is judged by canaries until it has. See docs/engines.md.
    engine: EngineName = "auto"
    #: More launched engines with a command and kind of their own (a mixed fleet), e.g.
    #: `[[fleet.groups]]` with `engines = 2`, `engine = "llamacpp"`, `engine_cmd = "..."`.
    groups: list[EngineGroup] = Field(default_factory=list)
    #: Where launched engines listen. Loopback: engines are reached only through the router.
    #: (With `launcher = "ray"`, `{host}` is the IP of the node that runs the engine.)
    host: str = "127.0.0.1"
    #: Seconds an engine may take from launch to `/health` 200. vLLM loads a tiny model on a
    #: CPU in ~30 s (130-140 s beside a loaded engine on 2 cores); real models on GPUs take
    #: minutes. A restart attempt that runs past it fails, and the engine's log then ends
    #: with what its processes were doing (state, wait channel, CPU seconds, threads).
    startup_timeout_s: PositiveFloat = 300.0
    weights: WeightsMode = _LEDGER.weights
    #: Attach mode: engines that something else runs (Kubernetes, systemd, a Ray job): each a
    #: URL, or a `[[fleet.backends]]` table with `url` and what fleetwarden cannot read from
    #: the engine: `output_cap`, its server cap on every request's output (vLLM's
    #: `--override-generation-config '{"max_new_tokens": N}'`), a number of tokens or "none".
    #: An engine's own `GET /server_info` (vLLM with `VLLM_SERVER_DEV_MODE=1`) wins over it.
    backends: list[str] = Field(default_factory=list)
    #: The `output_cap` each `[[fleet.backends]]` table declares, by URL (filled from them).
    backend_output_caps: dict[str, OutputCap] = Field(default_factory=dict)
    #: The `output_default` each table declares (its default limit of a chat that names none:
    #: its model's generation config `max_new_tokens`, or "none"), by URL.
    backend_output_defaults: dict[str, OutputCap] = Field(default_factory=dict)
    #: The server cap on every request's output of the fleet's own launched engines, where
    #: `engine_cmd` does not show it (a wrapper script; their command's
    #: `--override-generation-config` is read otherwise): tokens, or "none". An engine's own
    #: `GET /server_info` wins over both. Unset: the command says.
    output_cap: OutputCap | None = None
    #: The launched engines' default limit of a chat that names none (their model's
    #: `generation_config.json` `max_new_tokens`; "none": it sets none), where this host cannot
    #: read it (a hub name, not a folder here). Unset: read from the command's model folder;
    #: unknown where that cannot be read, and a chat naming no limit cut there is continued
    #: only as far as its finishes proved (docs/design.md 4.1, "Server caps").
    output_default: OutputCap | None = None
    #: Attach mode: how to restart a condemned attached engine, e.g. `kubectl delete pod
    #: {name}` or `systemctl restart vllm@{shard}`; `{shard}`, `{url}`, `{name}` (the
    #: URL's host) are filled in. Unset: a condemned attached engine is only dropped from
    #: routing, and re-admitted when it answers again under a new incarnation.
    restart_command: str | None = None
    #: `true`: launched engines outlive a fleetwarden that dies without stopping them (a
    #: crash, `kill -9`), so that the next `fleetwarden up` on the same journal adopts them
    #: instead of reloading weights. `false`: the kernel sends each engine SIGTERM when its
    #: fleetwarden dies, however it dies (what `fleetwarden demo` uses: its journal is
    #: temporary, so nothing could ever adopt an engine it left).
    engines_outlive_fleetwarden: bool = True
    #: One log file per engine incarnation goes here (with `launcher = "ray"`, on the node that
    #: runs the engine, at this path made absolute on the controller's machine).
    log_dir: Path = Path("fleetwarden-logs")
    #: How launched engines run. `local`: process groups on this machine. `ray`: each engine in
    #: a Ray actor on whichever node of a Ray cluster has `ray_resources` free, so a fleet can
    #: grow past one machine (`pip install fleetwarden[ray]`; see docs/ray.md). Local by
    #: default: it needs nothing but this machine.
    launcher: Literal["local", "ray"] = "local"
    #: With `launcher = "ray"`: the cluster to join, as `ray.init(address=...)` takes it.
    #: `auto` joins the cluster this machine is a node of (`ray start` ran here), where the
    #: controller, ledger and router stay; `host:6379` names a head node's GCS. When the
    #: process already has a Ray connection (a trainer that uses Ray), that one is used.
    ray_address: str = "auto"
    #: With `launcher = "ray"`: what each engine's actor holds while its engine runs, in Ray's
    #: terms: `GPU` and `CPU` as Ray counts them, any other key a custom resource of the nodes
    #: (`ray start --resources`). One GPU per engine, vLLM's usual deployment; an engine with
    #: tensor parallelism N asks for `{GPU = N}`. The actor needs no CPU of its own (it waits
    #: on a process), so `CPU` is 0 unless given.
    ray_resources: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=lambda: {"GPU": 1.0})
    #: With `launcher = "ray"`: `SPREAD` places engines on as many nodes as the resources
    #: allow, so one lost node takes the fewest engines with it; `DEFAULT` is Ray's own
    #: policy (packs a node before using the next).
    ray_scheduling: Literal["SPREAD", "DEFAULT"] = "SPREAD"
    #: The API key the engines want, when they are started with `--api-key` (vLLM's,
    #: llama.cpp's): a file that holds it (its first line; mode 0600, as the admin token),
    #: e.g. `api_key_file = "/etc/fleetwarden/engine.key"`. Every request fleetwarden makes
    #: on its own account carries it (canaries, /v1/models, /metrics, sleep and wake, the
    #: router's continuations); clients' own keys pass through the router as they are. A
    #: group's own key (`[[fleet.groups]] api_key_file`) replaces it for that group. Unset:
    #: requests carry none. See docs/operations.md, "Engines with API keys".
    api_key_file: Path | None = None
    #: ... or the environment variable that holds it, e.g. `api_key_env = "VLLM_API_KEY"`.
    api_key_env: str | None = None
    #: Refused with an error naming the fix: a key written in the config file would be in
    #: every copy, diff and paste of it. Use `api_key_file` or `api_key_env`.
    api_key: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _backend_tables(cls, data: Any) -> Any:
        """`[[fleet.backends]]` tables to URLs, their `output_cap`s to `backend_output_caps`
        and `output_default`s to `backend_output_defaults` (each checked here, so that an error
        names the entry)."""
        if not isinstance(data, dict) or not isinstance(data.get("backends"), list):
            return data
        urls: list[Any] = []
        declared = {name: dict(data.get(f"backend_{name}s") or {})
                    for name in ("output_cap", "output_default")}
        for i, entry in enumerate(data["backends"]):
            if not isinstance(entry, dict):
                urls.append(entry)
                continue
            unknown = sorted(set(entry) - {"url", "output_cap", "output_default"})
            if unknown:
                raise ValueError(f"backends[{i}]: unknown field(s) {', '.join(unknown)}; "
                                 "a backend table takes url, output_cap and output_default")
            url = entry.get("url")
            if not isinstance(url, str):
                raise ValueError(f"backends[{i}].url: give the engine's URL, "
                                 "e.g. http://10.0.0.5:8000")
            urls.append(url)
            for name, table in declared.items():
                if name in entry:
                    table[url.strip().rstrip("/")] = _output_cap(f"backends[{i}].{name}",
                                                                 entry[name])
        return {**data, "backends": urls, **{f"backend_{n}s": t for n, t in declared.items()}}

    @field_validator("output_cap", "output_default", mode="before")
    @classmethod
    def _cap(cls, value: object, info: ValidationInfo) -> object:
        return value if value is None else _output_cap(str(info.field_name), value)

    @field_validator("backends")
    @classmethod
    def _one_spelling(cls, urls: list[str]) -> list[str]:
        """Each URL in the one spelling the router, ledger and watchdog all use (no trailing
        slash): a URL written `http://host:8000/` would otherwise be two shards' worth of
        names for one engine, and its outcomes would match no shard."""
        normal = [url.strip().rstrip("/") for url in urls]
        seen: dict[str, str] = {}
        for raw, url in zip(urls, normal, strict=True):
            if url in seen:
                raise ValueError(f"backends: {raw!r} and {seen[url]!r} are the same engine")
            seen[url] = raw
        return normal

    @model_validator(mode="after")
    def _some_engines(self) -> FleetConfig:
        _key_source(self.api_key, self.api_key_file, self.api_key_env)
        if self.engines == 0 and not self.backends and not self.groups:
            raise ValueError("a fleet needs engines > 0, a group, or at least one backends URL")
        if self.groups and self.launcher == "ray":
            raise ValueError('groups: a mixed fleet runs with launcher = "local" only (yet)')
        for url in self.backends:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backends: {url!r} is not an http(s) URL")
            parts = urlsplit(url)
            if parts.path or parts.query or parts.fragment:
                # The router, the watchdog and the supervisor add their own paths to it.
                raise ValueError(f"backends: {url!r} has a path; give the engine's root, "
                                 f"{parts.scheme}://{parts.netloc} (fleetwarden adds "
                                 "/v1/..., /metrics and /health itself)")
        if self.engine_cmd is not None:
            _check_template("engine_cmd", self.engine_cmd, ENGINE_PLACEHOLDERS)
        for name, table in (("backend_output_caps", self.backend_output_caps),
                            ("backend_output_defaults", self.backend_output_defaults)):
            for url in table:
                if url not in self.backends:
                    raise ValueError(f"{name}: {url!r} is not one of the backends")
        for key, value in self.engine_env.items():
            _check_template(f"engine_env.{key}", value, ENGINE_PLACEHOLDERS)
        if self.restart_command is not None:
            _check_template("restart_command", self.restart_command, RESTART_PLACEHOLDERS)
        if self.engine_cmd is not None and "{port}" not in self.engine_cmd:
            raise ValueError("engine_cmd must contain {port}: each engine gets a free port")
        return self

    @property
    def launched(self) -> int:
        """Engines launched here: the fleet's own, then each group's."""
        return self.engines + sum(g.engines for g in self.groups)

    def group_of(self, shard: int) -> EngineGroup | None:
        """The group a launched shard belongs to; None for the fleet's own (and attached)."""
        first = self.engines
        for group in self.groups:
            if first <= shard < first + group.engines:
                return group
            first += group.engines
        return None

    def declared_output_cap(self, shard: int) -> int | str | None:
        """The `output_cap` the config declares for a shard (a launched one's group's or the
        fleet's own, an attached one's `[[fleet.backends]]` table): tokens, "none", or None
        where it declares nothing."""
        return self._declared(shard, "output_cap", self.backend_output_caps)

    def declared_output_default(self, shard: int) -> int | str | None:
        """The `output_default` the config declares for a shard, as :meth:`declared_output_cap`."""
        return self._declared(shard, "output_default", self.backend_output_defaults)

    def _declared(self, shard: int, name: str, tables: dict[str, OutputCap]) -> int | str | None:
        if shard >= self.launched:
            index = shard - self.launched
            url = self.backends[index] if index < len(self.backends) else None
            return None if url is None else tables.get(url)
        group = self.group_of(shard)
        value: int | str | None = getattr(self if group is None else group, name)
        return value

    def engine_of(self, shard: int) -> str:
        """The engine kind of a shard (``auto``: recognised at its first read)."""
        group = self.group_of(shard)
        return group.engine if group is not None else self.engine


class RemoteRouterConfig(_Section):
    """A router in another process (``fleetwarden route --control-port``) that this fleet's
    controller drives like its own: the serving set pushed every tick, outcomes drained."""

    #: The router's control URL, e.g. ``http://10.0.0.5:8090``.
    url: str
    #: The bearer token file of that router's control API.
    token_file: Path


class RouterConfig(_Section):
    """The data path (docs/design.md section 4)."""

    _policies = (RouterSettings,)

    #: Where the router listens for the OpenAI API.
    host: str = DEFAULT_HOST
    #: 0 picks a free port (printed at start), held by `fleetwarden up` while it runs.
    port: Port = DEFAULT_PORT
    backend_timeout_s: PositiveFloat = _ROUTER.backend_timeout_s
    connect_timeout_s: PositiveFloat = _ROUTER.connect_timeout_s
    max_body_bytes: PositiveInt = _ROUTER.max_body_bytes
    client_body_timeout_s: PositiveFloat = _ROUTER.client_body_timeout_s
    max_retries: Annotated[int, Field(ge=0)] = _ROUTER.max_retries
    retry_budget_ratio: Annotated[float, Field(ge=0, le=1)] = _ROUTER.retry_budget_ratio
    retry_budget_min: Annotated[int, Field(ge=0)] = _ROUTER.retry_budget_min
    status_when_others_serve: Annotated[int, Field(ge=400, le=599)] = (
        _ROUTER.status_when_others_serve)
    status_when_none_left: Annotated[int, Field(ge=400, le=599)] = _ROUTER.status_when_none_left
    comeback_wait_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = _ROUTER.comeback_wait_s
    session_header: str | None = _ROUTER.session_header
    affinity_load_factor: Annotated[float, Field(ge=1)] = _ROUTER.affinity_load_factor
    affinity_virtual_nodes: PositiveInt = _ROUTER.affinity_virtual_nodes
    # Its default, and the reason for it, in router/settings.py (the choices are checked
    # against the router's own list by the config tests).
    routing: Literal["cache_aware", "least_in_flight"] = cast(
        Literal["cache_aware", "least_in_flight"], _ROUTER.routing)
    cache_ttl_s: PositiveFloat = _ROUTER.cache_ttl_s
    cache_max_blocks: PositiveInt = _ROUTER.cache_max_blocks
    cache_threshold: Annotated[float, Field(ge=0, lt=1)] = _ROUTER.cache_threshold
    cache_balance_abs: PositiveInt = _ROUTER.cache_balance_abs
    cache_balance_rel: Annotated[float, Field(ge=1)] = _ROUTER.cache_balance_rel
    rl_group_window_s: PositiveFloat = _ROUTER.rl_group_window_s
    rl_group_per_engine: PositiveInt = _ROUTER.rl_group_per_engine
    cache_user_is_session: bool = _ROUTER.cache_user_is_session
    #: With cache_aware: route prompts of token ids by the KV events of the engines that
    #: publish them (vLLM's --kv-events-config; found at GET /kv_event_sources), the guess
    #: elsewhere (docs/design.md 4.3).
    kv_events: bool = _ROUTER.kv_events
    #: Where engines publish their KV events when GET /kv_event_sources does not say:
    #: "BACKEND_URL ENDPOINT [REPLAY_ENDPOINT]" each (a backend named is not asked).
    kv_event_endpoints: tuple[str, ...] = _ROUTER.kv_event_endpoints
    keepalive_timeout_s: PositiveFloat = _ROUTER.keepalive_timeout_s
    shutdown_grace_s: PositiveFloat = _ROUTER.shutdown_grace_s
    drain_s: PositiveFloat = _ROUTER.drain_s
    continue_streams: bool = _ROUTER.continue_streams
    continue_answers: bool = _ROUTER.continue_answers
    # The data port's limits (docs/design.md 4.2; each default's source in router/settings.py).
    #: Request line + headers, and an engine's head (Envoy's 60 KiB): past it, 431.
    max_head_bytes: PositiveInt = _ROUTER.max_head_bytes
    #: Header fields in one head, both sides (Envoy's 100): past it, 431.
    max_headers: PositiveInt = _ROUTER.max_headers
    #: Connect (or a request's first byte) to the end of its head (HAProxy's timeout
    #: http-request): past it, 408. Ends silent connections and slowloris heads.
    client_head_timeout_s: PositiveFloat = _ROUTER.client_head_timeout_s
    #: A kept-alive connection's wait for its next request (uvicorn's 5 s): then closed.
    client_idle_timeout_s: PositiveFloat = _ROUTER.client_idle_timeout_s
    #: An answer's writes without progress (nginx's send_timeout): then the client is dropped
    #: and its engine attempt cancelled, never counted against the engine.
    client_write_timeout_s: PositiveFloat = _ROUTER.client_write_timeout_s
    #: Client connections one router process holds; 0: half its open-file limit, so that
    #: clients alone cannot use up the descriptors its engine connections need.
    max_client_connections: Annotated[int, Field(ge=0)] = _ROUTER.max_client_connections
    #: Bytes of an engine's 5xx body kept: an error message is short; a longer body is not
    #: waited on to its end.
    max_error_body_bytes: PositiveInt = _ROUTER.max_error_body_bytes
    #: A file of named client keys, made with `fleetwarden keys add NAME --file PATH`
    #: (hashes only; docs/operations.md, "Keys on the data port"). Set: every request but
    #: GET /metrics needs `Authorization: Bearer <key>` (else 401), the client's key never
    #: reaches an engine, requests and tokens are counted per key in /metrics and on the
    #: dashboard, and the file is reread within a second of a change. Unset: no keys.
    keys_file: str | None = _ROUTER.keys_file


    #: Whether an engine whose kind the controller does not know (``engine = "auto"``, or a
    #: router given its backends by hand) takes vLLM's own request fields
    #: (``return_token_ids``, a prompt of token ids, ``continue_final_message``), which an
    #: exact continuation needs. A known engine's profile decides for it: only vLLM's says yes.
    #: Off: such engines get the client's request as it came (a strict OpenAI-compatible
    #: server answers 400 to a field it does not know); their streams continue from text or
    #: end with an error event naming the cause.
    upstream_fields: bool = _ROUTER.upstream_fields
    #: Router processes of their own, sharing `port` (SO_REUSEPORT), driven by the controller
    #: over the control API. They keep serving with the last serving set through
    #: fleetwarden's own crash, and its next run adopts them (as it adopts engines). One is
    #: what `fleetwarden up` runs; more use more cores. 0 runs the router inside the fleet's
    #: own process (an embedded `Fleet`, the demo, tests that read `fleet.router`): it then
    #: dies with the fleet.
    workers: Annotated[int, Field(ge=0, le=64)] = 1
    #: Bearer token of the router processes' control API (bound to 127.0.0.1); created
    #: (0600) with a new token if missing. It must outlive a run: the next one adopts the
    #: routers with it.
    control_token_file: Path = Path("fleetwarden-router.token")
    #: More routers for the same fleet, in other processes or on other hosts; none by default.
    remote: list[RemoteRouterConfig] = Field(default_factory=list)

    def settings(self) -> RouterSettings:
        return RouterSettings(**self.policy_values(RouterSettings))


class HealthConfig(_Section):
    """Watchdog and ledger thresholds (docs/design.md sections 3.2, 5 and 6)."""

    _policies = (WatchdogPolicy, Policy)
    _renamed = {"probe_timeout_s": "read_timeout_s"}

    #: Seconds between controller ticks. A crash is seen at once (process exit); this paces
    #: the metrics reads and the outcome drains.
    probe_interval_s: PositiveFloat = 5.0
    probe_timeout_s: PositiveFloat = _WATCHDOG.read_timeout_s
    silence_read_s: PositiveFloat = _WATCHDOG.silence_read_s
    unhealthy_threshold: PositiveInt = _LEDGER.unhealthy_threshold
    healthy_threshold: PositiveInt = _LEDGER.healthy_threshold
    stall_s: PositiveFloat = _WATCHDOG.stall_s
    stall_factor: Annotated[float, Field(ge=1)] = _WATCHDOG.stall_factor
    stall_max_s: PositiveFloat = _WATCHDOG.stall_max_s
    stall_waits: PositiveInt = _WATCHDOG.stall_waits
    canary_interval_s: PositiveFloat = _WATCHDOG.canary_interval_s
    canary_timeout_s: PositiveFloat = _WATCHDOG.canary_timeout_s
    min_serving_shards: PositiveInt = _LEDGER.min_serving_shards
    ejection_base_s: Annotated[float, Field(ge=0)] = _LEDGER.ejection_base_s
    ejection_max_s: Annotated[float, Field(ge=0)] = _LEDGER.ejection_max_s
    #: Envoy's panic threshold, in percent of the fleet's shards (all but RETIRED ones): below
    #: it, ejected engines that are not condemned are routed again, rather than a 409 for
    #: every client (or a few survivors taking everything). 50, Envoy's default; 0: never.
    #: See docs/design.md section 3.5.
    panic_threshold_percent: Annotated[float, Field(ge=0, le=100)] = (
        _LEDGER.panic_threshold_percent)
    #: Seconds between the focused reads of an accused engine (a failed request, a request
    #: silent for ``silent_after_s``, a stall or an unreachable read at the tick). A reduced
    #: ``/metrics`` read costs ~0.3 ms of CPU (``bench/metrics_parse.py``), so four a second
    #: per accused engine is nothing, and a stall floor of 5 s is then judged on ~20 reads.
    confirm_interval_s: PositiveFloat = 0.25
    #: A request that has received nothing for this long makes its engine accused: the
    #: controller reads it at once and at ``confirm_interval_s`` (reads only: a busy engine
    #: that shows progress is never sent a canary). Short generations here take 0.5-1.5 s;
    #: a longer wait costs a few reads of an engine that is simply busy, never more.
    silent_after_s: PositiveFloat = 1.0
    #: A request the router holds while its engine shows work and takes not one step for
    #: this long (every progress counter flat, on the focused reads) is sent to another
    #: engine as well: the first answer is the client's, the other is cancelled. The engine
    #: is held out of the pushes while its reads show no step (until the stall limit
    #: condemns it, or a step ends the hold), and a lost race is no failure of the engine (a
    #: long step looks the same until it ends, and real vLLM's gauges show no work during a
    #: first step after idle; only the stall limit condemns).
    #: vLLM steps every 10-125 ms (the
    #: captures), so a second without a step is 8 times its slowest one seen; a healthy
    #: engine that does pause that long (one long prefill step) costs the duplicate work of
    #: what it held, within the router's retry budget, and no new request until it steps; a
    #: pause it came back from is learned (its cadence), and a hedge then waits past it.
    #: 0: never.
    hedge_after_s: Annotated[float, Field(ge=0)] = 1.0
    #: How often the controller asks its in-process routers which engines hold silent
    #: requests (a router in another process is asked by a long poll of its control API,
    #: which looks every 0.25 s). An in-memory scan of the waiting requests.
    evidence_poll_s: PositiveFloat = 0.5
    #: The longest a run of focused reads goes on without a conclusion, before the tick takes
    #: over again: twice the longest stall floor anyone sets here, and a bound on the reads.
    confirm_max_s: PositiveFloat = 60.0
    #: Engines the tick's round reads at once; the rest wait for a free reader. All at once,
    #: a thousand reads open a thousand connections in the same instant: their answers queue
    #: behind each other in the engines' and this process's loops, and reads time out on
    #: engines that are fine (measured: 637 of 1,000 healthy simulated engines condemned).
    #: 64 readers keep a round's burst bounded whatever the fleet's size, and still read a
    #: fleet of a thousand in well under a tick (docs/design.md, "A fleet at scale"). A
    #: read that hangs holds its reader at most ``probe_timeout_s``.
    max_concurrent_reads: PositiveInt = 64

    def watchdog_policy(self) -> WatchdogPolicy:
        return WatchdogPolicy(**self.policy_values(WatchdogPolicy))


class SupervisorConfig(_Section):
    """Restarts (docs/design.md section 7)."""

    _policies = (Policy,)

    max_restart_attempts: Annotated[int, Field(ge=0)] = _LEDGER.max_restart_attempts
    #: Seconds before retrying a failed restart, doubling up to `backoff_max_s`.
    backoff_initial_s: PositiveFloat = 2.0
    backoff_max_s: PositiveFloat = 60.0
    #: Restarts in progress at once, fleet-wide. Unset: a quarter of the fleet (at least one),
    #: so a fleet-wide fault never takes every engine down for reloads at the same time.
    max_concurrent_restarts: PositiveInt | None = None
    #: Seconds between SIGTERM to an engine's process group and SIGKILL. vLLM exits cleanly on
    #: SIGTERM in ~1.5 s on a CPU.
    stop_grace_s: PositiveFloat = 10.0

    def concurrency_cap(self, fleet_size: int) -> int:
        if self.max_concurrent_restarts is not None:
            return self.max_concurrent_restarts
        return max(1, fleet_size // 4)


class RefitConfig(_Section):
    """The weight-sync API for RL trainers (docs/design.md section 8)."""

    #: Seconds a weight sync may take before its lease overruns and its participants are
    #: marked SUSPECT. Loading weights takes seconds to a few minutes. NeMo-RL gives up on a
    #: refit after its ``refit_timeout_s`` of 300 s: a lease longer than the trainer's own
    #: timeout would excuse stalls after the trainer has stopped waiting, so 300 s. A trainer
    #: need not wait for it: the lease names a silent participant within a tick.
    lease_s: PositiveFloat = DEFAULT_LEASE_S
    #: What an engine does with the requests still running on it when a load that fleetwarden
    #: runs (``refit_from``) pauses it, once the routers have drained it for ``drain_s``
    #: (vLLM's ``/pause?mode=``): ``wait`` lets them finish under the old weights first, so
    #: every answer comes from one checkpoint and says so; the sync waits for the longest.
    #: ``abort`` ends them at once (``finish_reason`` ``abort``: the trainer re-sends them);
    #: ``keep`` freezes them and lets them go on under the new weights: a mixed answer, whose
    #: spans say so on ``/inference/v1/generate`` and whose OpenAI answer the router labels
    #: with both versions. ``wait``: every answer from one checkpoint, none lost (docs/rl.md).
    pause_mode: Literal["wait", "abort", "keep"] = "wait"
    #: How long ``refit_from`` lets the routers' requests on an engine finish (nothing new is
    #: sent there) before it pauses it. The same 30 s as the sleep bracket's drain: rollouts
    #: of a step are usually in before the trainer syncs, and past it ``pause_mode`` decides.
    drain_s: Annotated[float, Field(ge=0)] = 30.0
    #: How long each call of one engine's load (its pause, its reload, its stamp, its resume)
    #: may take: loading a large checkpoint from disk takes minutes, and a ``wait`` pause
    #: lasts as long as what still runs. Past it the engine's load failed (it stays STALE).
    load_timeout_s: PositiveFloat = 600.0


class JournalConfig(_Section):
    #: SQLite file of every transition, verdict and restart; restored on the next start.
    path: Path = Path("fleetwarden.sqlite")


class AdminConfig(_Section):
    #: Loopback by default: the admin API can retire and restart engines.
    host: str = "127.0.0.1"
    port: Port = DEFAULT_PORT + 1
    #: Bearer token file, created 0600 with a random token when missing.
    token_file: Path = Path("fleetwarden-admin.token")


class Config(_Section):
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)
    refit: RefitConfig = Field(default_factory=RefitConfig)
    journal: JournalConfig = Field(default_factory=JournalConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)

    def ledger_policy(self) -> Policy:
        """The ledger's policy, from every section that exposes a field of it ([health]'s
        thresholds, [supervisor]'s restarts, [fleet]'s weights)."""
        values: dict[str, Any] = {}
        for name in type(self).model_fields:
            section: _Section = getattr(self, name)
            values.update(section.policy_values(Policy))
        return Policy(**values)


class ConfigError(Exception):
    """Invalid configuration. `str()` names each bad key, its value and what is allowed."""


def _describe(exc: ValidationError, source: str) -> ConfigError:
    lines = [f"invalid configuration in {source}:"]
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            parent = ".".join(str(p) for p in err["loc"][:-1])
            allowed = _allowed_keys(parent)
            msg = f"unknown key; allowed here: {', '.join(allowed)}"
        elif err["type"] == "literal_error" and "expected" in err.get("ctx", {}):
            msg = f"must be one of {err['ctx']['expected']}"
        value = err.get("input")
        # A literal key is never repeated: the error would carry it into logs and terminals.
        secret = err["loc"][-1:] == ("api_key",) if err["loc"] else False
        shown = ("" if err["type"] == "missing" or isinstance(value, dict) or secret
                 else f" = {value!r}")
        lines.append(f"  {key}{shown}: {msg}")
    return ConfigError("\n".join(lines))


def _allowed_keys(section: str) -> list[str]:
    model: type[BaseModel] = Config
    for part in filter(None, section.split(".")):
        field = model.model_fields.get(part)
        if field is None or not isinstance(field.annotation, type) or not issubclass(
            field.annotation, BaseModel
        ):
            return []
        model = field.annotation
    return sorted(model.model_fields)


def parse_config(data: dict[str, Any], source: str = "configuration") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise _describe(exc, source) from None


def load_config(path: str | Path | None,
                overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Config:
    """Read a TOML file (`None`: the defaults), lay ``overrides`` over it (a key whose value is
    ``None`` is not overridden: the command line's unset options), and validate the two
    together, so a bad value is named wherever it came from."""
    data: dict[str, Any] = {}
    source = "the defaults"
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except OSError as exc:
            raise ConfigError(f"config file {p} cannot be read: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
        source = str(p)
    given = {section: {k: v for k, v in values.items() if v is not None}
             for section, values in (overrides or {}).items()}
    given = {section: values for section, values in given.items() if values}
    if given:
        source = "the command line" if path is None else f"{source} and the command line"
    for section, values in given.items():
        written = data.setdefault(section, {})
        if isinstance(written, dict):  # else the validation names the section's bad value
            written.update(values)
    if path is None and not given:
        return Config()
    return parse_config(data, source)


def example_toml() -> str:
    """A commented example with every key at its default, the comments taken from this file."""
    import inspect
    import sys

    source = inspect.getsource(sys.modules[__name__])
    out = ["# fleetwarden configuration. Every key is optional; shown here at its default."]
    for name, field in Config.model_fields.items():
        model = field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        out.append(f"\n[{name}]")
        if model.__doc__:
            out.append(f"# {model.__doc__.strip().splitlines()[0]}")
        assert issubclass(model, _Section)
        for key, sub in model.model_fields.items():
            if key == "api_key":
                continue  # refused, never to be written (FleetConfig.api_key)
            comments = _comments_for(source, model.__name__, key)
            owner = model.owner_of(key)
            if not comments and owner is not None:  # the reason lives beside the default
                policy, policy_key = owner
                comments = _comments_for(inspect.getsource(sys.modules[policy.__module__]),
                                         policy.__name__, policy_key)
            for comment in comments:
                out.append(f"# {comment}")
            default = sub.get_default(call_default_factory=True)
            out.append(_toml_line(key, default))
    return ("\n".join(out) + "\n").replace("``", "`")


def _comments_for(source: str, class_name: str, key: str) -> list[str]:
    lines = source.splitlines()
    try:
        start = next(i for i, line in enumerate(lines)
                     if line.startswith((f"class {class_name}(", f"class {class_name}:")))
    except StopIteration:
        return []
    comments: list[str] = []
    for line in lines[start + 1:]:
        if line.startswith("class "):
            break
        stripped = line.strip()
        if stripped.startswith("#:") or (comments and stripped.startswith("#")):
            comments.append(stripped.lstrip("#:").strip())
            continue
        if stripped.startswith(f"{key}:"):
            return comments
        comments = []
    return []


def _toml_line(key: str, value: Any) -> str:
    if value is None:
        return f"# {key} = (unset)"
    if isinstance(value, bool):
        return f"{key} = {'true' if value else 'false'}"
    if isinstance(value, int | float):
        return f"{key} = {value!r}"
    if isinstance(value, Path):
        return f'{key} = "{value}"'
    if isinstance(value, str):
        return f"{key} = {value!r}".replace("'", '"')
    if isinstance(value, list | tuple):
        return f"{key} = {json.dumps(list(value))}"
    if isinstance(value, dict):
        items = ", ".join(f"{json.dumps(str(k))} = {json.dumps(v)}" for k, v in value.items())
        return f"{key} = {{ {items} }}" if value else f"{key} = {{}}"
    return f"{key} = {value!r}"
