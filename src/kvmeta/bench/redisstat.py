"""CPU time of a Redis deployment's primaries, read from ``INFO cpu``.

The pid of redis-server (``procstat``) is the steadier source, but only on the same machine and
for one process; ``INFO cpu`` (``used_cpu_sys`` + ``used_cpu_user``: every thread of the server,
microsecond resolution) works for a Redis anywhere and for each primary of a cluster, so a
sharded run shows where the CPU went. Replicas are not counted: they replay writes, they do
not run the scripts.

A ``--backend-url`` is read by ``store.redis.url`` (as the server reads its ``--backend``) and
each node is reached with the URL the server's own connections use (``RedisTarget.node_url``):
the benchmark reaches Redis exactly as the server it measures does.
"""

from __future__ import annotations

import logging
import re
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvmeta.errors import KvmetaError, MissingExtra
from kvmeta.store.redis.url import RESP, RedisTarget, parse_target

if TYPE_CHECKING:
    import redis

__all__ = ["RedisCpu", "backend_url_of", "check_backend_url", "primaries_of"]

logger = logging.getLogger(__name__)

_FLAG = "--backend-url"
_TIMEOUT = 10.0
# The URL inside a server's backend description ("redis at redis://h:p/0").
_URL_IN_TEXT = re.compile(r"\b((?:rediss?(?:\+cluster|\+sentinel)?|unix)://\S+)")


def check_backend_url(url: str) -> None:
    """Refuse a ``--backend-url`` the benchmark cannot read before anything runs.

    Raises:
        ConfigError: naming the flag, the part of the URL and the fix.
    """
    parse_target(url, _FLAG)


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


_OPTIONS: dict[str, Any] = {
    "socket_timeout": _TIMEOUT,
    "socket_connect_timeout": _TIMEOUT,
    "decode_responses": True,
    "protocol": RESP,
}


def _client(node_url: str) -> redis.Redis:
    """A connection to one node, its address, credentials, TLS and database read from
    ``node_url`` by redis-py, as the server's connections are."""
    client: redis.Redis = _redis().Redis.from_url(node_url, **_OPTIONS)
    return client


def _sentinel(target: RedisTarget, host: str, port: int) -> redis.Redis:
    """A connection to one Sentinel, with the URL's ``sentinel_password`` (as
    ``store.redis.sentinel`` connects)."""
    tls = target.url.startswith("rediss+")
    options = {**_OPTIONS, "password": target.sentinel_password, "ssl": tls}
    client: redis.Redis = _redis().Redis(host=host, port=port, **options)
    return client


def _address(client: redis.Redis) -> tuple[str, int]:
    """Where ``client`` connects: (host, port), or (path, 0) for a unix socket."""
    options = client.connection_pool.connection_kwargs
    if "path" in options:
        return str(options["path"]), 0
    return str(options.get("host", "localhost")), int(options.get("port", 6379))


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


def _resolve(target: RedisTarget) -> dict[str, str]:
    """The primaries to sample, by name, each with its URL: the Sentinel master, every primary
    of a cluster (asked of the first seed that answers), or the one node of a plain URL."""
    if target.mode == "sentinel":
        return _sentinel_primary(target)
    redis_error = _redis().RedisError
    errors = []
    if target.mode == "single":
        seeds = [target.url]
    else:
        seeds = [target.node_url(host, port) for host, port in target.hosts]
    for seed in seeds:
        client = _client(seed)
        host, port = _address(client)
        try:
            with client:
                if int(client.info("cluster").get("cluster_enabled", 0)) == 1:
                    cluster = target
                    if target.mode == "single":  # a plain URL naming a Cluster node
                        cluster = target.with_mode("cluster", host, port)
                    found = _cluster_primaries(client, host)
                    return {_name(h, p): cluster.node_url(h, p) for h, p in found}
                return {_name(host, port): seed}
        except (redis_error, OSError) as exc:
            errors.append(f"{_name(host, port)}: {exc}")
    raise _unreachable(errors)


def _sentinel_primary(target: RedisTarget) -> dict[str, str]:
    redis_error = _redis().RedisError
    errors = []
    for host, port in target.hosts:
        try:
            with _sentinel(target, host, port) as client:
                found = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", target.master)
        except (redis_error, OSError) as exc:
            errors.append(f"{_name(host, port)}: {exc}")
            continue
        if found:
            primary, primary_port = str(found[0]), int(found[1])
            return {_name(primary, primary_port): target.node_url(primary, primary_port)}
        errors.append(f"{_name(host, port)}: does not know {target.master!r}")
    raise _unreachable(errors)


def _unreachable(errors: list[str]) -> KvmetaError:
    return KvmetaError(
        "cannot read redis-server CPU: no node of the backend answered ("
        + "; ".join(errors)
        + "); check --backend-url, or pass --backend-pid for a local redis-server"
    )


def primaries_of(url: str) -> list[str]:
    """``host:port`` of every primary behind ``url`` (a cluster's are discovered)."""
    return list(_resolve(parse_target(url, _FLAG)))


class RedisCpu:
    """CPU seconds of each primary behind a backend URL, found once at construction."""

    def __init__(self, url: str) -> None:
        found = _resolve(parse_target(url, _FLAG))
        self._clients = {name: _client(node_url) for name, node_url in found.items()}

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
