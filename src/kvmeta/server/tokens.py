"""The tokens file (``--auth-file``): which tenant each token belongs to, which pools it may use
and with which rights, and each tenant's quotas.

Parsing is pure (``parse_tokens`` takes the text); ``load_tokens`` adds the file checks (the
mode check, read errors). Tokens are kept only as SHA-256 digests: a presented token is hashed
and looked up by digest, then compared with ``hmac.compare_digest``, so lookup time does not
depend on how much of a secret a guess got right, and the file may hold digests
(``token_sha256``) instead of secrets. Nothing here logs or repeats a token.

Format (every key but ``tenant`` and one of ``token``/``token_sha256`` is optional)::

    [tenants.teamA]
    max_pages = 1000000          # pages across the tenant's pools (absent: a share, see below)
    max_pools = 64               # pools of the tenant (absent: --max-pools-per-tenant)
    requests_per_second = 2000   # token bucket rate (absent: no rate limit)
    burst = 4000                 # bucket size (default: one second of requests)

    [[tokens]]
    token = "..."                # or token_sha256 = "<64 hex digits>"
    tenant = "teamA"
    rights = ["read", "write"]   # read, write, admin (default: read and write)
    ranks = "0-7"                # "3", "0-3,8-11", or an integer (default: every rank)
    namespaces = ["kv", "mamba*"]  # glob patterns of SGLang pool names (default: all)
    name = "teamA workers"       # shown in logs and 403 messages instead of the token

A file naming several tenants (in ``[tenants.*]`` or ``tenant =``) gives each tenant without
``max_pages`` an equal share of ``--max-total-pages`` (``service.limits``).
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import math
import os
import re
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvmeta.errors import ConfigError, Forbidden

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "ALL_ACCESS",
    "BURST_RANGE",
    "MAX_TENANT_PAGES",
    "MAX_TENANT_POOLS",
    "NO_TOKENS",
    "RATE_RANGE",
    "RIGHTS",
    "Scope",
    "TenantQuota",
    "TokenTable",
    "digest",
    "load_tokens",
    "operator_table",
    "parse_tokens",
]

RIGHTS = ("read", "write", "admin")
_DEFAULT_RIGHTS = frozenset(("read", "write"))
_TENANT_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SHA_RE = re.compile(r"[0-9a-fA-F]{64}")
MIN_TOKEN_CHARS = 16
_TOKEN_KEYS = frozenset(
    ("token", "token_sha256", "tenant", "rights", "ranks", "namespaces", "name")
)
_TENANT_KEYS = frozenset(("max_pages", "max_pools", "requests_per_second", "burst"))
_INT64_MAX = (1 << 63) - 1
# Sane ranges of the tenants' quotas: one request per 1000 s at the slowest (a Retry-After of
# 1000 s), 10 million per second at the most (far beyond what one server answers); a bucket
# holds 1 to a billion requests; pages up to 2**53 (exact as a double, as Redis scripts count),
# pools up to 2**32.
RATE_RANGE = (0.001, 10_000_000.0)
BURST_RANGE = (1.0, 1_000_000_000.0)
MAX_TENANT_PAGES = 1 << 53
MAX_TENANT_POOLS = 1 << 32


def digest(token: bytes) -> bytes:
    """The SHA-256 of a token: how tokens are stored and looked up."""
    return hashlib.sha256(token).digest()


@dataclass(frozen=True)
class TenantQuota:
    """One tenant's limits (None: no limit)."""

    max_pages: int | None = None
    max_pools: int | None = None
    requests_per_second: float | None = None
    burst: float | None = None


@dataclass(frozen=True, eq=False)
class Scope:
    """What one token may do: its tenant, rights, ranks and SGLang pool names.

    ``all_access`` is the ``--auth-token`` (or no auth at all): every tenant's pools and every
    route. ``ranks`` is a tuple of inclusive (low, high) ranges, None for every rank;
    ``namespaces`` a tuple of glob patterns, None for every name."""

    tenant: str
    rights: frozenset[str]
    ranks: tuple[tuple[int, int], ...] | None = None
    namespaces: tuple[str, ...] | None = None
    name: str = ""
    all_access: bool = False
    key: bytes = field(default=b"", repr=False)  # the token's SHA-256 digest
    _ns_cache: dict[str, bool] = field(default_factory=dict, repr=False, compare=False)

    def describe(self) -> str:
        """The scope in words, for 403 messages (never the token)."""
        if self.all_access:
            return "all access"
        ranks = (
            "all"
            if self.ranks is None
            else ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.ranks)
        )
        names = "all" if self.namespaces is None else ", ".join(self.namespaces)
        who = f"token '{self.name}' of " if self.name else ""
        return (
            f"{who}tenant '{self.tenant}': rights {', '.join(sorted(self.rights)) or 'none'}; "
            f"ranks {ranks}; namespaces {names}"
        )

    def has_rank(self, rank: int) -> bool:
        if self.ranks is None:
            return True
        return any(lo <= rank <= hi for lo, hi in self.ranks)

    def has_namespace(self, namespace: str) -> bool:
        if self.namespaces is None:
            return True
        hit = self._ns_cache.get(namespace)
        if hit is None:
            hit = any(fnmatch.fnmatchcase(namespace, pat) for pat in self.namespaces)
            if len(self._ns_cache) < 4096:
                self._ns_cache[namespace] = hit
        return hit

    def forbid(self, what: str) -> Forbidden:
        """The 403 for ``what`` (the caller's own request, in words). Depends only on the
        scope and the request, never on the state: no existence oracle."""
        return Forbidden(
            f"Forbidden: {what} is outside this token's scope ({self.describe()}). Use a token "
            "whose scope covers it, or widen this token's entry in the tokens file "
            "(--auth-file) and send SIGHUP to the server"
        )

    def check_rank(self, rank: int, what: str) -> None:
        if not self.has_rank(rank):
            raise self.forbid(what)

    def check_pool(self, rank: int, namespace: str) -> None:
        """Raises Forbidden unless the SGLang pool (rank, namespace) is in scope."""
        if not (self.has_rank(rank) and self.has_namespace(namespace)):
            raise self.forbid(f"rank {rank} namespace '{namespace}'")


ALL_ACCESS = Scope("", frozenset(RIGHTS), all_access=True, name="--auth-token")


@dataclass(frozen=True)
class TokenTable:
    """A parsed tokens file: token digest -> scope, tenant -> quota, and every tenant it
    names (with a token or a quota table)."""

    scopes: Mapping[bytes, Scope]
    tenants: Mapping[str, TenantQuota]
    names: frozenset[str] = frozenset()

    def lookup(self, token: bytes) -> Scope | None:
        """The scope of a presented token: hashed, looked up by digest, and the stored digest
        compared with ``hmac.compare_digest`` (a guess's timing never depends on how many of
        a secret's characters it got right: only digests are ever compared)."""
        return self.find(digest(token))

    def find(self, token_digest: bytes) -> Scope | None:
        """``lookup`` for a token already hashed (one hash serves several tables)."""
        hit = self.scopes.get(token_digest)
        if hit is None:
            return None
        return hit if hmac.compare_digest(hit.key, token_digest) else None


NO_TOKENS = TokenTable({}, {})


def operator_table(token: str) -> TokenTable:
    """``--auth-token`` as a token table: one entry, all access (tenant ``""``), so one lookup
    serves it and a tokens file alike.

    Raises:
        ConfigError: an empty token (leave ``--auth-token`` unset to turn auth off).
    """
    if not token:
        raise ConfigError(
            "--auth-token is empty; give a token, or leave it unset to turn auth off",
            "auth_token",
        )
    d = digest(token.encode())
    return TokenTable({d: replace(ALL_ACCESS, key=d)}, {})


def _where(path: str | None) -> str:
    return f"tokens file {path}" if path else "tokens file"


def _err(path: str | None, where: str, message: str, fix: str) -> ConfigError:
    return ConfigError(f"{_where(path)}: `{where}` {message}; {fix}", "auth_file")


def _check_tenant(path: str | None, where: str, value: Any) -> str:
    if not isinstance(value, str) or not _TENANT_RE.fullmatch(value):
        raise _err(
            path,
            where,
            f"must be a tenant name of 1-64 characters [A-Za-z0-9_.-], got {value!r}",
            'e.g. tenant = "teamA"',
        )
    return value


def _parse_ranks(path: str | None, where: str, value: Any) -> tuple[tuple[int, int], ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return ((value, value),)
    if not isinstance(value, str) or not value.strip():
        raise _err(path, where, f"must be a rank range string, got {value!r}", 'e.g. ranks = "0-7"')
    out = []
    for part in value.split(","):
        part = part.strip()
        m = re.fullmatch(r"(-?\d{1,19})(?:\s*-\s*(-?\d{1,19}))?", part)
        if m is None:
            raise _err(
                path, where, f"has {part!r}, not a rank or range", 'use e.g. "0-7" or "0-3,8-11"'
            )
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if lo > hi:
            raise _err(path, where, f"range {part!r} runs backwards", f'write "{hi}-{lo}"')
        out.append((lo, hi))
    return tuple(out)


def _parse_token_entry(
    path: str | None, i: int, entry: Any, tenants: Mapping[str, TenantQuota]
) -> tuple[bytes, Scope]:
    where = f"tokens[{i}]"
    if not isinstance(entry, dict):
        raise _err(path, where, "must be a table", "write each token as a [[tokens]] table")
    unknown = sorted(set(entry) - _TOKEN_KEYS)
    if unknown:
        raise _err(
            path,
            f"{where}.{unknown[0]}",
            "is not a known key",
            f"the keys of a token are {', '.join(sorted(_TOKEN_KEYS))}",
        )
    has_token, has_sha = "token" in entry, "token_sha256" in entry
    if has_token == has_sha:
        raise _err(
            path,
            where,
            "needs exactly one of `token` and `token_sha256`",
            "give the secret, or its SHA-256 in hex (sha256sum) so the file holds no secret",
        )
    if has_token:
        token = entry["token"]
        if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
            raise _err(
                path,
                f"{where}.token",
                f"must be a string of at least {MIN_TOKEN_CHARS} characters",
                "generate one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'",
            )
        d = digest(token.encode())
    else:
        hexd = entry["token_sha256"]
        if not isinstance(hexd, str) or not _SHA_RE.fullmatch(hexd):
            raise _err(
                path,
                f"{where}.token_sha256",
                "must be 64 hex digits",
                "compute it with: printf %s TOKEN | sha256sum",
            )
        d = bytes.fromhex(hexd)
    if "tenant" not in entry:
        raise _err(path, f"{where}.tenant", "is missing", 'add e.g. tenant = "teamA"')
    tenant = _check_tenant(path, f"{where}.tenant", entry["tenant"])
    rights_raw = entry.get("rights", sorted(_DEFAULT_RIGHTS))
    if (
        not isinstance(rights_raw, list)
        or not rights_raw
        or not all(isinstance(r, str) and r in RIGHTS for r in rights_raw)
    ):
        raise _err(
            path,
            f"{where}.rights",
            f"must be a non-empty list of {', '.join(RIGHTS)}, got {rights_raw!r}",
            'e.g. rights = ["read", "write"]',
        )
    ranks = None
    if "ranks" in entry:
        ranks = _parse_ranks(path, f"{where}.ranks", entry["ranks"])
    namespaces = None
    if "namespaces" in entry:
        ns = entry["namespaces"]
        if isinstance(ns, str):
            ns = [ns]
        if not isinstance(ns, list) or not ns or not all(isinstance(p, str) and p for p in ns):
            raise _err(
                path,
                f"{where}.namespaces",
                f"must be a non-empty list of glob patterns, got {ns!r}",
                'e.g. namespaces = ["kv", "mamba*"]',
            )
        namespaces = tuple(ns)
    name = entry.get("name", "")
    if not isinstance(name, str) or len(name) > 128:
        raise _err(path, f"{where}.name", "must be a string of at most 128 characters", "")
    scope = Scope(tenant, frozenset(rights_raw), ranks, namespaces, name or f"tokens[{i}]", key=d)
    return d, scope


def _number(
    path: str | None,
    where: str,
    table: dict[str, Any],
    key: str,
    allowed: tuple[float, float],
    fix: str,
) -> float | None:
    """``table[key]`` as a float in the ``allowed`` range, None when absent. The range keeps
    every number derived from it finite: a rate of 1e-310 requests/s would make the wait
    before the next request (Retry-After) overflow."""
    value = table.get(key)
    if value is None:
        return None
    low, high = allowed
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise _err(
            path,
            f"{where}.{key}",
            f"must be a number from {low:g} to {high:,.0f}, got {value!r}",
            fix,
        )
    return float(value)


def _parse_tenant(path: str | None, name: str, table: Any) -> TenantQuota:
    where = f"tenants.{name}"
    _check_tenant(path, where, name)
    if not isinstance(table, dict):
        raise _err(path, where, "must be a table", f"write [tenants.{name}] with its quotas")
    unknown = sorted(set(table) - _TENANT_KEYS)
    if unknown:
        raise _err(
            path,
            f"{where}.{unknown[0]}",
            "is not a known key",
            f"the keys of a tenant are {', '.join(sorted(_TENANT_KEYS))}",
        )
    max_pages = table.get("max_pages")
    if max_pages is not None and (
        not isinstance(max_pages, int)
        or isinstance(max_pages, bool)
        or not 0 <= max_pages <= MAX_TENANT_PAGES
    ):
        raise _err(
            path,
            f"{where}.max_pages",
            f"must be an integer from 0 to {MAX_TENANT_PAGES:,}, got {max_pages!r}",
            "omit it for the tenant's share of --max-total-pages",
        )
    max_pools = table.get("max_pools")
    if max_pools is not None and (
        not isinstance(max_pools, int)
        or isinstance(max_pools, bool)
        or not 0 <= max_pools <= MAX_TENANT_POOLS
    ):
        raise _err(
            path,
            f"{where}.max_pools",
            f"must be an integer from 0 to {MAX_TENANT_POOLS:,}, got {max_pools!r}",
            "omit it for --max-pools-per-tenant",
        )
    rate = _number(path, where, table, "requests_per_second", RATE_RANGE, "omit it for no limit")
    burst = _number(path, where, table, "burst", BURST_RANGE, "omit it for one second of requests")
    if burst is not None and rate is None:
        raise _err(path, f"{where}.burst", "needs requests_per_second", "set both, or neither")
    if rate is not None and burst is None:
        burst = min(max(1.0, rate), BURST_RANGE[1])  # one second of requests
    return TenantQuota(
        max_pages=max_pages, max_pools=max_pools, requests_per_second=rate, burst=burst
    )


def parse_tokens(text: str, path: str | None = None) -> TokenTable:
    """Parse and check a tokens file's text.

    Raises:
        ConfigError: naming the line (TOML syntax) or the key path (``tokens[2].ranks``) that
            is wrong, and the fix.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{_where(path)} is not valid TOML: {exc}", "auth_file") from None
    unknown = sorted(set(data) - {"tenants", "tokens"})
    if unknown:
        raise _err(
            path, unknown[0], "is not a known top-level key", "use [tenants.NAME] and [[tokens]]"
        )
    tenants_raw = data.get("tenants", {})
    if not isinstance(tenants_raw, dict):
        raise _err(path, "tenants", "must be a table", "write [tenants.NAME] tables")
    tenants = {name: _parse_tenant(path, name, t) for name, t in tenants_raw.items()}
    entries = data.get("tokens", [])
    if not isinstance(entries, list):
        raise _err(path, "tokens", "must be an array of tables", "write each token as [[tokens]]")
    scopes: dict[bytes, Scope] = {}
    for i, entry in enumerate(entries):
        d, scope = _parse_token_entry(path, i, entry, tenants)
        if d in scopes:
            raise _err(
                path,
                f"tokens[{i}]",
                f"repeats the token of {scopes[d].name}",
                "give every token entry its own token",
            )
        scopes[d] = scope
    names = frozenset(tenants) | {scope.tenant for scope in scopes.values()}
    return TokenTable(scopes, tenants, names)


def check_mode(path: Path) -> None:
    """Refuse a tokens file that group or others may read or write."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(
            f"cannot read tokens file {path} (--auth-file): {exc.strerror}; check the path",
            "auth_file",
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"tokens file {path} (--auth-file) is readable or writable by group or others "
            f"(mode {stat.S_IMODE(mode):04o}); it holds secrets: run `chmod 600 {path}`",
            "auth_file",
        )


def load_tokens(path: str | os.PathLike[str]) -> TokenTable:
    """Read, mode-check and parse the tokens file.

    Raises:
        ConfigError: the file cannot be read, has a loose mode, or does not parse.
    """
    p = Path(path)
    check_mode(p)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"cannot read tokens file {p} (--auth-file): {exc}; check the path", "auth_file"
        ) from None
    return parse_tokens(text, str(p))
