"""Keys on the data port: named client keys, stored hashed, read from a file the router watches.

Owns: the keys file's format (parsing it, naming the line and field of a mistake, writing it
for ``fleetwarden keys``), hashing and checking a presented key, the client's ``Authorization``
replaced toward the engines, and reloading the file when it changes.
Must not: answer a request or count one (``routes.py`` does), or know the engines' own key (it is
given, as a value, by whoever configured it).

The rules (docs/operations.md, "Keys on the data port"):

* A key is presented as ``Authorization: Bearer <key>`` and nowhere else: a key in a query
  string would land in every proxy's access log, so it is never read.
* The file holds each key's name and the SHA-256 of its secret, never the secret. A SHA-256
  without salt, as LiteLLM stores its virtual keys: salting and slow hashing defend guessable
  passwords against a stolen file; a key made by :func:`new_secret` is 256 random bits, which
  no stolen hash helps to find, and an unsalted hash lets a presented key be found with one
  lookup, whatever the number of keys.
* The presented key is hashed, the first bytes of its digest looked up, and the match decided
  by ``hmac.compare_digest`` on the whole digest: the secret itself is never compared, and
  what a timing difference could reveal is bits of a digest, which leads to no key.
* A file that cannot be read or parsed on a reload changes nothing: the keys that were let in
  are let in, and the error is logged once per change of the file. At start it is an error.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fleetwarden.router.serve import RawHeaders

__all__ = ["KEY_PREFIX", "MAX_KEY_BYTES", "RELOAD_EVERY_S", "KeyRing", "KeysFile",
           "KeysFileError", "add_key", "hash_secret", "new_secret", "parse_keys",
           "read_keys", "remove_key", "without_client_key"]

log = logging.getLogger("fleetwarden.router")

#: What every key made here starts with: OpenAI's ``sk-`` (secret scanners and people know it
#: for a secret) and whose key it is.
KEY_PREFIX = "sk-fw-"
#: The longest presented key that is hashed at all: a made key is 49 bytes; a longer one cannot
#: be a key of this file, and is refused without work (an Authorization header may carry up to
#: the data port's head limit).
MAX_KEY_BYTES = 512
#: Seconds between two looks at the keys file's size and time (one ``stat``): a key added or
#: removed is in force within this, in every router process, with no restart and no signal.
RELOAD_EVERY_S = 1.0
#: A key's name: a Prometheus label value and a word on the dashboard.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
_HASH = re.compile(r"sha256:([0-9a-f]{64})")
_BEARER = b"bearer "
#: Bytes of a digest the ring's lookup uses (see :class:`KeyRing`).
_PREFIX_BYTES = 8


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the file, the line and the field."""


def new_secret() -> str:
    """A new key: :data:`KEY_PREFIX` and 256 random bits."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str | bytes) -> str:
    """What the keys file stores of a key: ``sha256:`` and its hex digest."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def parse_keys(text: str, source: str = "keys file") -> dict[str, str]:
    """``{name: "sha256:<hex>"}`` from the file's text: one key a line, ``NAME sha256:HEX``;
    blank lines and ``#`` comments are skipped. A mistake names its line and field."""
    keys: dict[str, str] = {}
    owners: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{source} line {number}"
        if len(words) != 2:
            raise KeysFileError(f"{where}: expected 'NAME sha256:HEX', got {len(words)} "
                                "field(s)")
        name, digest = words
        if _NAME.fullmatch(name) is None:
            raise KeysFileError(f"{where}: name {name[:80]!r} must be 1 to 64 letters, digits "
                                "or _.@- , starting with a letter or digit")
        if _HASH.fullmatch(digest) is None:
            raise KeysFileError(f"{where}: hash of {name!r} must be 'sha256:' and 64 lowercase "
                                "hex digits (write keys with `fleetwarden keys add`)")
        if name in keys:
            raise KeysFileError(f"{where}: name {name!r} is already on another line")
        if digest in owners:
            raise KeysFileError(f"{where}: key {name!r} has the same secret as "
                                f"{owners[digest]!r}: its requests could not be told apart")
        keys[name] = digest
        owners[digest] = name
    return keys


def read_keys(path: str | Path) -> dict[str, str]:
    """The keys in the file at ``path`` (:func:`parse_keys`); a file that cannot be read is a
    :class:`KeysFileError` naming it."""
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise KeysFileError(f"keys file {p} does not exist (create it with `fleetwarden keys "
                            "add NAME --file ...`)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysFileError(f"keys file {p} cannot be read: {exc}") from None
    return parse_keys(text, f"keys file {p}")


class KeyRing:
    """The keys in force: who a presented ``Authorization`` value is, if anyone."""

    __slots__ = ("_by_prefix", "_names")

    def __init__(self, keys: Mapping[str, str]) -> None:
        #: The first bytes of each key's digest -> (the whole digest, its name): the lookup
        #: narrows by a part that decides nothing; ``hmac.compare_digest`` on the whole digest
        #: decides.
        self._by_prefix: dict[bytes, list[tuple[bytes, str]]] = {}
        for name, h in keys.items():
            digest = bytes.fromhex(h.removeprefix("sha256:"))
            self._by_prefix.setdefault(digest[:_PREFIX_BYTES], []).append((digest, name))
        self._names = sorted(keys)

    def __len__(self) -> int:
        return len(self._names)

    def names(self) -> list[str]:
        return list(self._names)

    def name_for(self, authorization: bytes) -> str | None:
        """The key's name for an ``Authorization`` header's value, or ``None``: not a Bearer
        credential, or no key of the ring."""
        if authorization[:7].lower() != _BEARER:
            return None
        presented = authorization[7:].strip()
        if not presented or len(presented) > MAX_KEY_BYTES:
            return None
        digest = hashlib.sha256(presented).digest()
        for stored, name in self._by_prefix.get(digest[:_PREFIX_BYTES], ()):
            if hmac.compare_digest(stored, digest):
                return name
        return None


def without_client_key(headers: RawHeaders, engine_authorization: bytes | None) -> RawHeaders:
    """The client's headers as they go to the engines when the router checks keys: every
    ``Authorization`` removed (the client's key is the router's to read, never an engine's),
    and the engines' own credential added when one is configured (``Bearer <key>``)."""
    out = [(k, v) for k, v in headers if k.lower() != b"authorization"]
    if engine_authorization is not None:
        out.append((b"Authorization", engine_authorization))
    return out


@dataclass(frozen=True, slots=True)
class _Seen:
    """What a ``stat`` of the file said: a change in any of them is a change of the file."""

    mtime_ns: int
    size: int
    inode: int


class KeysFile:
    """The keys file at ``path`` and the ring read from it, reread when it changes
    (:meth:`reload_if_changed`, every :data:`RELOAD_EVERY_S` by the router)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self._seen = self._stat()
        #: Raises :class:`KeysFileError`: a router told to check keys never starts without.
        self.ring = KeyRing(read_keys(self.path))
        #: The last reload's error, until a reload succeeds (for the log: said once).
        self.error: str | None = None

    def _stat(self) -> _Seen | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return _Seen(st.st_mtime_ns, st.st_size, st.st_ino)

    def reload_if_changed(self) -> bool:
        """Reread the file if its time, size or inode changed; returns whether the keys in
        force changed. A file that cannot be read or parsed leaves them as they were."""
        seen = self._stat()
        if seen == self._seen:
            return False
        self._seen = seen
        try:
            keys = read_keys(self.path)
        except KeysFileError as exc:
            if str(exc) != self.error:
                log.error("%s; the %d key(s) read before stay in force", exc, len(self.ring))
            self.error = str(exc)
            return False
        self.error = None
        before = set(self.ring.names())
        self.ring = KeyRing(keys)
        after = set(keys)
        log.info("keys file %s reread: %d key(s); added %s, removed %s", self.path, len(after),
                 sorted(after - before) or "none", sorted(before - after) or "none")
        return True


def _write(path: Path, keys: Mapping[str, str]) -> None:
    """Replace the file at once (a temporary file renamed over it): a router rereading it sees
    the old file or the new one, never half of one. 0600: only its owner edits it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "# fleetwarden keys: NAME sha256:HEX (edit with `fleetwarden keys`)\n" + "".join(
        f"{name} {digest}\n" for name, digest in keys.items())
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def add_key(path: str | Path, name: str) -> str:
    """Add a key named ``name`` to the file (created if missing); returns its secret, which
    exists nowhere else from then on."""
    p = Path(path).expanduser()
    if _NAME.fullmatch(name) is None:
        raise KeysFileError(f"name {name[:80]!r} must be 1 to 64 letters, digits or _.@- , "
                            "starting with a letter or digit")
    keys = read_keys(p) if p.exists() else {}
    if name in keys:
        raise KeysFileError(f"keys file {p} already has a key named {name!r} (remove it first "
                            "to replace it)")
    secret = new_secret()
    _write(p, {**keys, name: hash_secret(secret)})
    return secret


def remove_key(path: str | Path, name: str) -> None:
    """Remove the key named ``name`` from the file."""
    p = Path(path).expanduser()
    keys = read_keys(p)
    if name not in keys:
        raise KeysFileError(f"keys file {p} has no key named {name!r} (it has: "
                            f"{', '.join(keys) or 'none'})")
    _write(p, {k: v for k, v in keys.items() if k != name})
