"""The engines' API keys: read from a file or an environment variable, never from the config.

Owns: :class:`Secret` (a key that never shows itself in a repr, a log line or a traceback),
:func:`read_key` (one key from its file or variable, with an error naming the field) and
:class:`EngineKeys` (which key each shard's engine wants: its group's, else the fleet's).
Must not: send a request, or decide what an engine's refusal means (the judge does:
``judge.ASKED_WRONG``).

Engines started with ``--api-key`` (vLLM's, llama.cpp's, SGLang's) refuse every request under
their guarded paths without ``Authorization: Bearer <key>``. Every request fleetwarden makes on
its own account carries the key of the engine it goes to: canaries and the model list, the
reads of ``/metrics`` and the health path, sleep and wake, the router's continuations and its
read of ``/v1/models``. A key is never written in the config file (it would be in every copy,
diff and paste of it); the config names where to read it (``api_key_file``, ``api_key_env``).
The key is read once, at the fleet's start, and lives only in memory and in the pushes to the
fleet's own routers (docs/operations.md, "Engines with API keys").
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetwarden.config import EngineGroup, FleetConfig

__all__ = ["CredentialError", "EngineKeys", "Secret", "read_key"]


class CredentialError(ValueError):
    """A key cannot be read; the message names the config field and the fix."""


class Secret:
    """A key. Its repr and str never show it: a config, a report or a traceback that carries
    one prints ``Secret(***)``. :meth:`reveal` is the one way to the text, at the header."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def bearer(self) -> dict[str, str]:
        """The ``Authorization`` header that carries it."""
        return {"Authorization": f"Bearer {self._value}"}

    def __repr__(self) -> str:
        return "Secret(***)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


def read_key(field: str, file: Path | str | None, env: str | None) -> Secret | None:
    """The key that ``file`` holds (its first line, stripped) or that the variable ``env``
    holds; ``None`` when neither is named. ``field`` names the config section in errors
    (``fleet``, ``fleet.groups[0]``). A file others may read is refused, as the admin token's
    is: the key lets its holder use every engine."""
    if file is not None and env is not None:
        raise CredentialError(f"{field}: api_key_file and api_key_env are both set; name one")
    if env is not None:
        value = os.environ.get(env, "").strip()
        if not value:
            raise CredentialError(f"{field}.api_key_env: the environment variable {env} is "
                                  "unset or empty; export the engines' key in it")
        return Secret(value)
    if file is None:
        return None
    path = Path(file).expanduser()
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        text = path.read_text()
    except OSError as exc:
        raise CredentialError(f"{field}.api_key_file: cannot read {path}: "
                              f"{exc.strerror or exc}") from None
    if mode & 0o077:
        raise CredentialError(f"{field}.api_key_file: {path} is readable by others (mode "
                              f"{mode:04o}); run: chmod 600 {path}")
    lines = text.strip().splitlines()
    value = lines[0].strip() if lines else ""
    if not value:
        raise CredentialError(f"{field}.api_key_file: {path} holds no key")
    return Secret(value)


@dataclass(frozen=True)
class EngineKeys:
    """Which key each shard's engine wants: its group's (``[[fleet.groups]]``), else the
    fleet's (``[fleet]``, for its own engines and the attached ``backends``); ``None``: none
    (the engine is asked without ``Authorization``)."""

    fleet: Secret | None = None
    #: Each launched group that names a key, with it (the group itself, as the config holds
    #: it: which shards are whose is ``FleetConfig.group_of``'s to say, not numbered here).
    groups: tuple[tuple[EngineGroup, Secret], ...] = ()
    #: The config that says which group a shard is in (``None``: no group names a key).
    layout: FleetConfig | None = None
    #: Where each key was read, in words (never the key): what the fleet's start logs.
    sources: tuple[str, ...] = ()

    @classmethod
    def of(cls, fleet: FleetConfig) -> EngineKeys:
        """Read every key the config names (at the fleet's start); a :class:`CredentialError`
        names the field whose key cannot be had."""
        own = read_key("fleet", fleet.api_key_file, fleet.api_key_env)
        sources = [_source("fleet", fleet.api_key_file, fleet.api_key_env)] if own else []
        groups: list[tuple[EngineGroup, Secret]] = []
        for k, group in enumerate(fleet.groups):
            key = read_key(f"fleet.groups[{k}]", group.api_key_file, group.api_key_env)
            if key is not None:
                groups.append((group, key))
                sources.append(_source(f"fleet.groups[{k}]", group.api_key_file,
                                       group.api_key_env))
        return cls(own, tuple(groups), fleet if groups else None, tuple(sources))

    def of_shard(self, shard: int) -> Secret | None:
        if self.layout is None:
            return self.fleet
        group = self.layout.group_of(shard)
        # By identity: two groups configured alike are still two groups.
        return next((key for g, key in self.groups if g is group), self.fleet)

    @property
    def any(self) -> bool:
        return self.fleet is not None or bool(self.groups)

    @property
    def uniform(self) -> bool:
        """Every shard's engine wants the same key (or none): no shard needs looking up."""
        return not self.groups


NO_KEYS = EngineKeys()


def _source(field: str, file: Path | None, env: str | None) -> str:
    return f"{field}: from the file {file}" if file is not None else f"{field}: from ${env}"
