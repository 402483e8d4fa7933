"""``--backend`` URLs for Redis/Valkey: one endpoint, a Cluster, or a Sentinel group.

Forms (no credential leaves this module unredacted: ``redact_url``)::

    redis://[[user]:pass@]host:port[/db]        one endpoint (a Cluster node is detected)
    rediss://...                                 the same over TLS
    unix:///path/redis.sock[?db=N]               one endpoint on this machine
    redis+cluster://[[user]:pass@]h:p[,h:p...]   Cluster seed nodes (rediss+cluster: TLS)
    redis+sentinel://[[user]:pass@]s:p[,s:p...]/primary-name[?db=N&sentinel_password=...]

Everything a URL can get wrong is refused here, at start-up, with the part and the fix named:
redis-py would read ``/abc`` as database 0 and open TLS files only inside a connection attempt.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, unquote_plus, urlencode, urlsplit, urlunsplit

from kvmeta.errors import ConfigError

__all__ = ["REDACTED", "RESP", "RedisTarget", "check_url", "parse_target", "redact_url"]

# The protocol version every connection kvmeta opens asks for. kvmeta reads replies itself
# (``store.redis.link``) and its scripts' replies are shaped for RESP2; redis-py 8 and later
# would otherwise say HELLO 3 and get maps, doubles and booleans back.
RESP = 2

SINGLE_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_DEFAULT_PORT = {"cluster": 6379, "sentinel": 26379}
# URL query parameters that name a file redis-py opens only when it connects.
_TLS_FILES = ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "ssl_ca_path")
# Query parameters kvmeta reads itself; never passed on to a node's connection.
_OWN_PARAMS = ("db", "sentinel_password")
DB_HINT = (
    "databases are numbered 0..N-1, N being Redis's `databases` setting (16 by default); "
    "write the number after the port, e.g. redis://host:6379/0"
)
# The environment variables that set a flag, for its refusals.
_ENV = {"--backend": "env KVMETA_BACKEND or KVMETA_REDIS_URL"}
_FORMS = (
    "redis://host:port/db, rediss://..., unix:///path/redis.sock, "
    "redis+cluster://host:port[,host:port...] or "
    "redis+sentinel://sentinel:port[,sentinel:port...]/primary-name"
)


# Words in a query parameter's name that mark its value as a credential (redis-py passes any
# parameter on to the connection: ``password``, ``username``, ``sentinel_password``,
# ``ssl_password``, and whatever a later version adds with such a name).
_SECRET_WORDS = ("password", "passwd", "pass", "token", "secret", "user", "auth", "key")
# Parameters whose name contains one of the words above but that name a file, not a secret.
_NOT_SECRET = frozenset(_TLS_FILES) | {"ssl_certfile"}
REDACTED = "***"


def _secret_param(name: str) -> bool:
    low = unquote_plus(name).lower()
    return low not in _NOT_SECRET and any(word in low for word in _SECRET_WORDS)


def _redact_pairs(text: str) -> str:
    """``a=1&password=x`` with each credential's value as ``***``; every other byte kept."""
    out = []
    for pair in text.split("&"):
        name = pair.partition("=")[0]
        out.append(f"{name}={REDACTED}" if _secret_param(name) else pair)
    return "&".join(out)


def redact_url(url: str) -> str:
    """``url`` as every view, reply, exception message and log line shows it: the user name and
    password of the userinfo (``user:pass@``) and the value of every query (or fragment)
    parameter that names a credential (``password=``, ``username=``,
    ``sentinel_password=``, ...) replaced by ``***``. The one place a ``--backend`` URL is
    made safe to show, so a new form of credential is hidden everywhere at once. A URL too
    malformed to split keeps only its scheme."""
    try:
        parts = urlsplit(url)
    except ValueError:
        scheme = url.partition("://")[0] if "://" in url else ""
        return f"{scheme}://{REDACTED}" if scheme.isalnum() else REDACTED
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hosts = netloc.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        netloc = (REDACTED if user else "") + (f":{REDACTED}" if colon else "") + "@" + hosts
    # Put together by hand: urlunsplit would drop the empty host of unix:///path.
    shown = f"{parts.scheme}:" if parts.scheme else ""
    if url[len(shown) :].startswith("//"):
        shown += "//" + netloc
    shown += parts.path
    if parts.query or "?" in url.partition("#")[0]:
        shown += "?" + _redact_pairs(parts.query)
    if parts.fragment:
        shown += "#" + _redact_pairs(parts.fragment)
    return shown


@dataclass(frozen=True)
class RedisTarget:
    """What a ``--backend`` URL names. ``mode`` is "single", "cluster" or "sentinel";
    ``hosts`` are the Cluster seeds or the Sentinels (empty for "single"); ``master`` is the
    Sentinel primary name."""

    url: str
    mode: str
    hosts: tuple[tuple[str, int], ...] = ()
    master: str = ""
    db: int = 0
    sentinel_password: str | None = None

    @functools.cached_property
    def shown(self) -> str:
        """The URL with any password hidden (every log line and error names it)."""
        return redact_url(self.url)

    def node_url(self, host: str, port: int) -> str:
        """A plain ``redis[s]://`` URL for one node, with this URL's credentials, database and
        connection parameters: redis-py builds the node's connections from it."""
        if self.mode == "single":
            return self.url
        parts = urlsplit(self.url)
        scheme = "rediss" if parts.scheme.startswith("rediss") else "redis"
        userinfo = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        where = f"[{host}]" if ":" in host else host
        query = {
            k: v
            for k, v in parse_qs(parts.query, keep_blank_values=True).items()
            if k not in _OWN_PARAMS
        }
        return urlunsplit(
            (scheme, f"{userinfo}{where}:{port}", f"/{self.db}", urlencode(query, doseq=True), "")
        )

    def with_mode(self, mode: str, host: str, port: int) -> RedisTarget:
        """This single endpoint seen as a Cluster seed (a plain URL that named a Cluster node)."""
        return RedisTarget(self.url, mode, ((host, port),), db=self.db)


@dataclass(frozen=True)
class _Setting:
    """The setting a URL came from (the server's ``--backend``, the benchmark's
    ``--backend-url``) and the URL as a message may show it: each refusal names both."""

    flag: str
    shown: str

    @property
    def field(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _fail(where: _Setting, what: str) -> ConfigError:
    return ConfigError(f"`{where.flag}` URL {where.shown}: {what}", where.field)


def _hosts(where: _Setting, netloc: str, default: int) -> tuple[tuple[str, int], ...]:
    hostlist = netloc.rsplit("@", 1)[-1]
    out = []
    for item in hostlist.split(","):
        item = item.strip()
        if not item:
            raise _fail(where, "an empty host in the host list; write host:port[,host:port...]")
        if item.startswith("["):  # [ipv6]:port
            host, _, rest = item[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        else:
            host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
        if not host:
            raise _fail(where, f"no host name in {item!r}; write host:port")
        if port_text and not (port_text.isascii() and port_text.isdecimal()):
            raise _fail(where, f"port {port_text!r} of {host} is not a number")
        port = int(port_text) if port_text else default
        if not 0 < port <= 65535:
            raise _fail(where, f"port {port} of {host} is outside 1..65535")
        out.append((host, port))
    return tuple(out)


def _db(where: _Setting, text: str) -> int:
    if not (text.isascii() and text.isdecimal()):
        raise _fail(where, f"the database {text!r} is not a number; {DB_HINT}")
    return int(text)


def parse_target(url: str, flag: str = "--backend") -> RedisTarget:
    """Read a ``--backend`` URL into a ``RedisTarget``: the one reading of a Redis URL, which
    ``kvmeta bench`` shares for its ``--backend-url`` (``flag``, named in each refusal), so
    the benchmark reaches Redis exactly as the server it measures does.

    Raises:
        ConfigError: naming the flag, the part of the URL and the fix.
    """
    where = _Setting(flag, redact_url(url))
    parts = urlsplit(url)
    query = parse_qs(parts.query, keep_blank_values=True)
    for param in _TLS_FILES:
        for value in query.get(param, []):
            if not Path(value).exists():
                raise _fail(
                    where,
                    f"{param}={value}: file not found (the path is read on the machine running "
                    "kvmeta; fix it or drop the parameter)",
                )
    if any(value != str(RESP) for value in query.get("protocol", [])):
        raise _fail(
            where,
            f"protocol={query['protocol'][-1]}: kvmeta speaks RESP{RESP} to Redis (it reads "
            "the replies itself); drop the protocol parameter",
        )
    if parts.scheme in SINGLE_SCHEMES:
        return _single(url, where, parts.scheme, parts.path, query)
    if parts.scheme in CLUSTER_SCHEMES:
        hosts = _hosts(where, parts.netloc, _DEFAULT_PORT["cluster"])
        dbs = query.get("db", []) + (
            [unquote(parts.path[1:])] if parts.path not in ("", "/") else []
        )
        for text in dbs:
            if _db(where, text) != 0:
                raise _fail(
                    where,
                    f"Redis Cluster has only database 0, the URL asks for {text}: drop the "
                    "database from the URL (or give each deployment its own cluster)",
                )
        return RedisTarget(url, "cluster", hosts)
    if parts.scheme in SENTINEL_SCHEMES:
        hosts = _hosts(where, parts.netloc, _DEFAULT_PORT["sentinel"])
        path = unquote(parts.path.strip("/"))
        if not path:
            raise _fail(
                where,
                "no primary name: write the name the Sentinels monitor after the hosts, e.g. "
                "redis+sentinel://s1:26379,s2:26379,s3:26379/mymaster",
            )
        if "/" in path:
            raise _fail(
                where,
                f"{path!r} is not one primary name; give the database as ?db=N, e.g. "
                "redis+sentinel://s1:26379/mymaster?db=0",
            )
        db = [_db(where, text) for text in query.get("db", [])]
        password = query.get("sentinel_password", [None])[-1]
        return RedisTarget(url, "sentinel", hosts, path, db[-1] if db else 0, password)
    env = _ENV.get(flag)
    raise ConfigError(
        f"Expected `{flag}` to be a redis://, rediss:// or unix:// URL ({_FORMS}), got "
        f"{where.shown!r}" + (f" ({env})" if env else ""),
        where.field,
    )


def _single(
    url: str, where: _Setting, scheme: str, path: str, query: dict[str, list[str]]
) -> RedisTarget:
    try:
        urlsplit(url).port  # noqa: B018  (raises on a port that is not a number 0..65535)
    except ValueError as exc:
        raise _fail(where, str(exc)) from None
    dbs = [f"db={v}" for v in query.get("db", [])]
    if scheme != "unix" and path not in ("", "/"):
        dbs.append(path)
    db = 0
    for shown_db in dbs:
        number = shown_db[3:] if shown_db.startswith("db=") else unquote(shown_db[1:])
        if not (number.isascii() and number.isdecimal()):
            raise _fail(where, f"the database {shown_db!r} is not a number; {DB_HINT}")
        db = int(number)
    return RedisTarget(url, "single", db=db)


def check_url(url: str, flag: str = "--backend") -> None:
    """Refuse a ``--backend`` URL that redis-py would misread or fail on only when connecting.

    Raises:
        ConfigError: naming the flag, the part of the URL and the fix.
    """
    parse_target(url, flag)
