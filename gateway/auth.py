"""API keys with scopes: who may call which route, and the key id every record of a call is tagged with.

Keys come from a file (``GatewayConfig.api_keys``) or, when no file is given, from the environment
variable ``STREAMRL_API_KEYS``; both hold one key a line::

    # key                              scopes             id (optional)  policies (optional)
    sk-4f1c0e...                        inference,rewards  team-a         policies=support,sql
    sk-9a72d1...                        admin              ops

The id is what records carry (``key_id``) and what logs may name; without one it is ``key-`` and the first
12 hex digits of the key's sha256, never the key. ``policies=`` limits a key to those policies (several on
one gateway, ``GatewayConfig.policies``): it may generate from and reward only them, and ``/v1/models`` shows
it only them; without it (or with ``admin``) a key reaches every policy. In the environment variable, ``;`` separates entries as
a newline does.

The per-request cost is one sha256 of the presented token and one dict lookup: keys are stored by their
digest, so no scan over keys happens and no comparison ever runs over the secret's bytes themselves
(``hmac.compare_digest`` confirms the digest the lookup found). Routes map to scopes in ``ROUTE_SCOPES``;
a path not listed needs ``admin``, so that a route added later is closed until it is placed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from streamrl.broker.schema import RecordError, check_policy

SCOPES: tuple[str, ...] = ("inference", "rewards", "admin")
OPEN = "open"
"""A route anyone may call (``/health``'s liveness answer); a key, if sent, is still checked."""

ROUTE_SCOPES: dict[str, str] = {
    "/v1/chat/completions": "inference",
    "/v1/completions": "inference",
    "/v1/models": "inference",
    "/v1/rewards": "rewards",
    "/v1/trajectories/end": "inference",
    "/metrics": "admin",
    "/health": OPEN,
    "/openapi.json": OPEN,
    "/dashboard": OPEN,
    "/dashboard/static/dashboard.js": OPEN,
    "/dashboard/static/dashboard.css": OPEN,
    "/dashboard/data": "admin",
}
"""The scope each route needs; any other path needs ``admin``. The dashboard's page and assets hold no data
(a browser sends no key when it opens a page); its data needs ``admin``, which the page asks for."""

PINNED_VERSION_SCOPE = "admin"
"""A request naming a pinned policy version (``policy@v<N>``) rather than the policy name needs this scope
too: which version serves a tenant is the operator's choice."""

ENV_VAR = "STREAMRL_API_KEYS"
MIN_KEY_LENGTH = 16
"""Shorter keys are refused: a key is a bearer secret and should be random (``openssl rand -hex 24``)."""
KEY_STATE = "streamrl.key"
"""Where the authenticated ``ApiKey`` of a request is kept in its ASGI scope."""
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _is_policy(name: str) -> bool:
    try:
        check_policy(name)
    except RecordError:
        return False
    return True


class KeyFileError(ValueError):
    """A bad line in a key file or in ``STREAMRL_API_KEYS``; the message names the source and line."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str
    scopes: frozenset[str]
    digest: bytes
    """sha256 of the key (the key itself is not kept)."""
    policies: frozenset[str] | None = None
    """The policies the key may generate from and reward; None: every one."""

    def __repr__(self) -> str:
        limit = "" if self.policies is None else f", policies={sorted(self.policies)}"
        return f"ApiKey({self.key_id!r}, scopes={sorted(self.scopes)}{limit})"

    def may_use(self, policy: str | None) -> bool:
        """Whether the key may generate from or reward ``policy`` (None: a model that is no policy, such as the
        base model asked for by name, which a key limited to policies may not use)."""
        return self.policies is None or "admin" in self.scopes or policy in self.policies


def default_key_id(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class KeyRing:
    """The keys a gateway accepts, by the sha256 of the key."""

    def __init__(self, keys: list[ApiKey] | tuple[ApiKey, ...] = ()) -> None:
        self._by_digest = {k.digest: k for k in keys}

    def __len__(self) -> int:
        return len(self._by_digest)

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    @property
    def ids(self) -> list[str]:
        return sorted(k.key_id for k in self._by_digest.values())

    def unknown_policies(self, served: tuple[str, ...]) -> list[tuple[str, list[str]]]:
        """(key id, policy names it lists that are not in ``served``) for each key that lists some."""
        return [(k.key_id, sorted(k.policies - set(served))) for k in self._by_digest.values()
                if k.policies is not None and k.policies - set(served)]

    def lookup(self, token: bytes) -> ApiKey | None:
        digest = hashlib.sha256(token).digest()
        key = self._by_digest.get(digest)
        if key is None or not hmac.compare_digest(key.digest, digest):
            return None
        return key


def parse_keys(text: str, source: str, *, separator: str | None = None) -> KeyRing:
    """Parse key lines (``KEY SCOPES[,SCOPE...] [ID] [policies=NAME[,NAME...]]``; ``#`` comments and blank
    lines skipped). Every error names ``source`` and the line (entry) number, and never the key."""
    entries = text.split(separator) if separator else text.splitlines()
    keys: list[ApiKey] = []
    ids: set[str] = set()
    digests: set[bytes] = set()
    for number, raw in enumerate(entries, start=1):
        line = raw.split("#", 1)[0].strip()  # so a key holds no '#' (nor whitespace)
        if not line:
            continue
        where = f"{source} line {number}" if separator is None else f"{source} entry {number}"
        parts = line.split()
        policies: frozenset[str] | None = None
        if len(parts) > 2 and parts[-1].startswith("policies="):
            names = [n for n in parts.pop()[len("policies="):].split(",") if n]
            bad = next((n for n in names if not _is_policy(n)), None)
            if not names or bad is not None:
                raise KeyFileError(f"{where}: policies= needs one or more policy names separated by commas"
                                   + (f" (not {bad!r})" if bad is not None else ""))
            policies = frozenset(names)
        if len(parts) not in (2, 3):
            raise KeyFileError(f"{where}: expected 'KEY SCOPES [ID] [policies=A,B]', got {len(parts)} field(s)")
        key, scope_text = parts[0], parts[1]
        if len(key) < MIN_KEY_LENGTH:
            raise KeyFileError(f"{where}: the key is shorter than {MIN_KEY_LENGTH} characters")
        scopes = frozenset(s for s in scope_text.split(",") if s)
        unknown = sorted(scopes - set(SCOPES))
        if unknown or not scopes:
            raise KeyFileError(f"{where}: unknown scope(s) {', '.join(unknown) or '(none given)'}; "
                               f"scopes are {', '.join(SCOPES)}")
        key_id = parts[2] if len(parts) == 3 else default_key_id(key)
        if not _ID.fullmatch(key_id):
            raise KeyFileError(f"{where}: the id {key_id!r} must be 1-64 letters, digits, '.', '_' or '-'")
        digest = hashlib.sha256(key.encode()).digest()
        if digest in digests:
            raise KeyFileError(f"{where}: the same key is listed twice")
        if key_id in ids:
            raise KeyFileError(f"{where}: the id {key_id!r} is used twice")
        digests.add(digest)
        ids.add(key_id)
        keys.append(ApiKey(key_id, scopes, digest, policies))
    return KeyRing(keys)


def load_keys(path: str | Path | None, environ: Mapping[str, str]) -> KeyRing:
    """The keys of ``path``, else of ``STREAMRL_API_KEYS`` in ``environ``; an empty ring when neither."""
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise KeyFileError(f"API key file {path}: {exc.strerror or exc}") from None
        ring = parse_keys(text, str(path))
        if not ring:
            raise KeyFileError(f"API key file {path} holds no key")
        return ring
    text = environ.get(ENV_VAR, "")
    return parse_keys(text.replace("\n", ";"), ENV_VAR, separator=";") if text.strip() else KeyRing()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_bind(host: str, keys: KeyRing, insecure: bool) -> None:
    """Refuse to serve without keys on an address other hosts can reach, unless ``insecure`` says so."""
    if not keys and not insecure and not is_loopback(host):
        raise ValueError(f"the gateway would listen on {host} with no API keys: anyone who can reach it could "
                         f"generate, post rewards and read metrics. Give --api-keys FILE (or {ENV_VAR}), bind "
                         "to 127.0.0.1, or pass --insecure to serve without keys anyway")


def _error(status: int, message: str, code: str) -> bytes:
    kind = "AuthenticationError" if status == 401 else "PermissionDeniedError"
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})


def request_key(scope: Scope) -> ApiKey | None:
    """The authenticated key of a request (None when the gateway checks no keys, or on an open route
    called without one)."""
    return scope.get(KEY_STATE)


def has_scope(scope: Scope, wanted: str, auth_on: bool) -> bool:
    """Whether the request may do what ``wanted`` guards (always, when the gateway checks no keys)."""
    if not auth_on:
        return True
    key = scope.get(KEY_STATE)
    return key is not None and wanted in key.scopes


class AuthMiddleware:
    """Pure ASGI: check the bearer token of each HTTP request against the route's scope before the app
    sees it. 401 for a missing or unknown key, 403 for a key without the scope; OpenAI-style bodies."""

    def __init__(self, app: ASGIApp, keys: KeyRing) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        needed = ROUTE_SCOPES.get(scope["path"], "admin")
        token = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                token = value
                break
        if token is None:
            if needed == OPEN:
                await self.app(scope, receive, send)
                return
            await self._deny(send, 401, "Missing API key: send it as 'Authorization: Bearer <key>'.",
                             "missing_api_key")
            return
        scheme, _, secret = token.partition(b" ")
        key = self.keys.lookup(secret.strip()) if scheme.lower() == b"bearer" else None
        if key is None:
            await self._deny(send, 401, "Incorrect API key provided.", "invalid_api_key")
            return
        if needed != OPEN and needed not in key.scopes:
            await self._deny(send, 403, f"This API key ({key.key_id}) lacks the '{needed}' scope needed for "
                                        f"{scope['path']}.", "insufficient_scope")
            return
        scope[KEY_STATE] = key
        await self.app(scope, receive, send)

    @staticmethod
    async def _deny(send: Send, status: int, message: str, code: str) -> None:
        body = _error(status, message, code)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
