"""CPU time of a Redis deployment's primaries, read from ``INFO cpu``.

The pid of redis-server (``procstat``) is the steadier source, but only on the same machine and
for one process; ``INFO cpu`` (``used_cpu_sys`` + ``used_cpu_user``: every thread of the server,
microsecond resolution) works for a Redis anywhere and for each primary of a cluster, so a
sharded run shows where the CPU went. Replicas are not counted: they replay writes, they do
not run the scripts.

URLs are split here, minimally (hosts, credentials, TLS): the benchmark only needs to reach
each node, not the server's full ``--backend`` parsing.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote

from kvmeta.errors import InvalidRequest, KvmetaError, MissingExtra
from kvmeta.store.redis.url import RESP, redact_url

if TYPE_CHECKING:
    import redis

__all__ = ["RedisCpu", "backend_url_of", "check_backend_url", "primaries_of"]

logger = logging.getLogger(__name__)

_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel")
_TIMEOUT = 10.0
# The URL inside a server's backend description ("redis at redis://h:p/0").
_URL_IN_TEXT = re.compile(r"\b((?:rediss?(?:\+cluster|\+sentinel)?|unix)://\S+)")


@dataclass(frozen=True)
class _Target:
    scheme: str
    hosts: tuple[tuple[str, int], ...]  # (host, port); (path, 0) for a unix socket
    username: str | None
    password: str | None
    tls: bool
    master: str  # the Sentinel master name


def check_backend_url(url: str) -> None:
    """Refuse a ``--backend-url`` the benchmark cannot read before anything runs.

    Raises:
        InvalidRequest: naming the flag and the forms accepted.
    """
    _parse(url)


def _parse(url: str) -> _Target:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise InvalidRequest(
            f"--backend-url {redact_url(url)!r} is not a Redis URL: give "
            "redis://[:PASSWORD@]HOST:PORT, rediss://..., unix:///PATH, "
            "redis+cluster://HOST:PORT[,HOST:PORT...] or "
            "redis+sentinel://HOST:PORT[,...]/MASTERNAME",
            "backend_url",
        )
    rest = rest.split("?", 1)[0] if scheme != "unix" else rest
    userinfo, _, rest = rest.rpartition("@")
    username = password = None
    if userinfo:  # as redis-py reads it: USER:PASSWORD, :PASSWORD, or USER alone
        user, has_pw, pw = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(pw) if has_pw else None
    if scheme == "unix":
        path, _, query = rest.partition("?")
        given = parse_qs(query).get("password")
        return _Target(scheme, ((path, 0),), username, given[0] if given else password, False, "")
    netloc, _, path = rest.partition("/")
    hosts = []
    for item in filter(None, netloc.split(",")):
        host, colon, port = item.rpartition(":")
        if not colon:
            host, port = item, "26379" if scheme == "redis+sentinel" else "6379"
        if not port.isdecimal() or not host:
            raise InvalidRequest(
                f"--backend-url {redact_url(url)!r}: {item!r} is not HOST:PORT", "backend_url"
            )
        hosts.append((host.strip("[]"), int(port)))
    if not hosts:
        raise InvalidRequest(f"--backend-url {redact_url(url)!r} names no host", "backend_url")
    master = unquote(path.split("/", 1)[0]) if scheme == "redis+sentinel" else ""
    if scheme == "redis+sentinel" and not master:
        raise InvalidRequest(
            f"--backend-url {redact_url(url)!r}: a Sentinel URL ends with /MASTERNAME",
            "backend_url",
        )
    return _Target(scheme, tuple(hosts), username, password, scheme.startswith("rediss"), master)


def backend_url_of(describe: str) -> str | None:
    """The Redis URL in a server's backend description (``/v1/pools`` ``server.backend``), or
    None: not Redis, or the password is hidden (``***``; pass ``--backend-url`` then)."""
    match = _URL_IN_TEXT.search(describe)
    if match is None or "***" in match.group(1):
        return None
    return match.group(1)


def _redis() -> ModuleType:
    """redis-py, imported on first use: a bare install benchmarks servers of any backend and
    only reading redis-server CPU needs the Redis extra."""
    try:
        import redis
    except ImportError as exc:
        raise MissingExtra("reading redis-server CPU", "redis", exc, "backend_url") from None
    return redis


def _client(target: _Target, host: str, port: int, password: str | None = None) -> redis.Redis:
    module = _redis()
    kwargs: dict[str, Any] = {
        "username": target.username,
        "password": target.password if password is None else password,
        "socket_timeout": _TIMEOUT,
        "socket_connect_timeout": _TIMEOUT,
        "decode_responses": True,
        "protocol": RESP,
    }
    if port == 0:
        client: redis.Redis = module.Redis(unix_socket_path=host, **kwargs)
    else:
        client = module.Redis(host=host, port=port, ssl=target.tls, **kwargs)
    return client


def _name(host: str, port: int) -> str:
    return f"unix:{host}" if port == 0 else f"{host}:{port}"


def _cluster_primaries(client: redis.Redis, seed_host: str) -> list[tuple[str, int]]:
    """Every primary not marked failed, from CLUSTER NODES."""
    text = client.execute_command("CLUSTER", "NODES")  # type: ignore[no-untyped-call]
    lines = text.splitlines() if isinstance(text, str) else []
    out = []
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        flags = fields[2].split(",")
        if "master" not in flags or "fail" in flags or "noaddr" in flags:
            continue
        address = fields[1].split("@", 1)[0]
        host, _, port = address.rpartition(":")
        out.append((host or seed_host, int(port)))
    return sorted(out)


def _resolve(target: _Target) -> list[tuple[str, int]]:
    """The primaries to sample: the Sentinel master, every primary of a cluster (asked of the
    first seed that answers), or the one node of a plain URL."""
    redis_error = _redis().RedisError
    errors = []
    for host, port in target.hosts:
        if target.scheme == "redis+sentinel":
            for password in (None, target.password):  # Sentinels often have no password
                try:
                    with _client(target, host, port, password or "") as client:
                        found = client.execute_command(
                            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", target.master
                        )
                except (redis_error, OSError) as exc:
                    errors.append(f"{_name(host, port)}: {exc}")
                    continue
                if found:
                    return [(str(found[0]), int(found[1]))]
                errors.append(f"{_name(host, port)}: does not know {target.master!r}")
                break
            continue
        try:
            with _client(target, host, port) as client:
                if int(client.info("cluster").get("cluster_enabled", 0)) == 1:
                    return _cluster_primaries(client, host)
                return [(host, port)]
        except (redis_error, OSError) as exc:
            errors.append(f"{_name(host, port)}: {exc}")
    raise KvmetaError(
        "cannot read redis-server CPU: no node of the backend answered ("
        + "; ".join(errors)
        + "); check --backend-url, or pass --backend-pid for a local redis-server"
    )


def primaries_of(url: str) -> list[str]:
    """``host:port`` of every primary behind ``url`` (a cluster's are discovered)."""
    return [_name(h, p) for h, p in _resolve(_parse(url))]


class RedisCpu:
    """CPU seconds of each primary behind a backend URL, found once at construction."""

    def __init__(self, url: str) -> None:
        target = _parse(url)
        self._clients = {_name(h, p): _client(target, h, p) for h, p in _resolve(target)}

    @property
    def nodes(self) -> list[str]:
        return list(self._clients)

    def sample(self) -> dict[str, float]:
        """Each primary's ``used_cpu_sys + used_cpu_user`` now (seconds).

        Raises:
            KvmetaError: a primary did not answer (failover during the run, or unreachable).
        """
        redis_error = _redis().RedisError
        out = {}
        for node, client in self._clients.items():
            try:
                info = client.info("cpu")
            except (redis_error, OSError) as exc:
                raise KvmetaError(
                    f"cannot read INFO cpu of redis-server {node}: {exc} (pass --backend-pid "
                    "for a local redis-server instead)"
                ) from None
            out[node] = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        return out

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
