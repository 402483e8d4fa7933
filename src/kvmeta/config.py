"""One frozen ``Settings`` for the server, merged once: defaults < the ``--config`` file <
``KVMETA_*`` env < flags.

Nothing else in kvmeta reads ``os.environ``. Every option is declared once in ``OPTIONS``;
``add_arguments`` turns that table into argparse flags whose help shows the env var and default,
and ``settings_from_args`` does the merge and validation, naming both forms on error.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvmeta.config_values import MAX_WORKERS
from kvmeta.config_values import allowed_hosts as _allowed_hosts
from kvmeta.config_values import boolean as _bool
from kvmeta.config_values import byte_size as _bytes
from kvmeta.config_values import medium as _medium
from kvmeta.config_values import non_negative_int as _non_negative_int
from kvmeta.config_values import port as _port
from kvmeta.config_values import positive_float as _positive_float
from kvmeta.config_values import positive_int as _positive_int
from kvmeta.config_values import ratio as _ratio
from kvmeta.config_values import seconds as _seconds
from kvmeta.config_values import workers as _workers
from kvmeta.config_values import zmq_endpoint as _zmq_endpoint
from kvmeta.errors import ConfigError
from kvmeta.store.disk.datadir import DurabilityOptions
from kvmeta.store.redis.url import redact_url

__all__ = [
    "OPTIONS",
    "Option",
    "Settings",
    "add_arguments",
    "env_setting",
    "settings_from_args",
    "unknown_env",
]


_DURABILITY = DurabilityOptions(data_dir=None)


@dataclass(frozen=True)
class Settings:
    """Everything ``kvmeta serve`` can be told."""

    host: str = "127.0.0.1"
    port: int = 18000
    reservation_ttl: float = 300.0
    read_lease: float = 5.0
    eviction: str = "prefix"  # "lru" with a Redis backend (``settings_from_args``)
    # durability
    data_dir: str = "./kvmeta-data"
    in_memory: bool = False
    # (defaults are the durable store's own, so they are written down once)
    fsync: str = _DURABILITY.fsync
    fsync_interval: float = _DURABILITY.fsync_interval
    fsync_timeout: float = _DURABILITY.fsync_timeout
    snapshot_interval: float = _DURABILITY.snapshot_interval
    snapshot_min_records: int = _DURABILITY.snapshot_min_records
    snapshot_journal_bytes: int = _DURABILITY.snapshot_journal_bytes
    snapshot_journal_ratio: float = _DURABILITY.snapshot_journal_ratio
    persistence_path: str | None = None
    save_interval: float = _DURABILITY.save_interval
    # scale-out
    backend: str | None = None
    workers: int = 1
    # operations
    auth_token: str | None = None
    # Host names a server not bound to loopback answers (None: any; see server/guard.py)
    allowed_hosts: tuple[str, ...] | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_keys: int = 65536
    max_key_length: int = 1024
    max_namespace_length: int = 128
    max_pages: int = 1 << 24
    log_level: str = "info"
    log_format: str = "text"
    access_log: bool = False
    # resource limits on pools (each page costs ~26 bytes of memory once it is first used)
    max_world_size: int = 4096
    max_total_pages: int = 1 << 27
    max_pools_per_tenant: int = 4096
    # connections and operator routes (see server/http.py and server/ops_routes.py)
    header_timeout: float = 10.0
    idle_timeout: float = 300.0
    max_connections: int = 4096
    metrics_max_pools: int = 256
    # shutdown: /ready answers 503 this long after SIGTERM while requests are still served
    drain_seconds: float = 5.0
    # Redis high availability (see store/redis/calls.py and probes.py)
    failover_timeout: float = 5.0
    min_replicas_ack: int = 0
    replica_ack_timeout: float = 1.0
    # KV events (see kvmeta.events and docs/events.md)
    events: str | None = None
    events_replay: str | None = None
    events_buffer: int = 10_000
    events_buffer_mb: int = 256
    events_queue: int = 1_000
    events_replay_clients: int = 8
    events_replay_queue_mb: int = 64
    events_replay_timeout: float = 30.0
    events_format: str = "map"
    events_medium: str = "EXTERNAL"
    events_keys: bool = True
    # router reads: prefix_match by block hashes (see core/hash_index.py)
    hash_index: bool = False
    # tenants: scoped tokens and quotas (see server/tokens.py, docs/tenants.md)
    auth_file: str | None = None

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        if shown["auth_token"]:
            shown["auth_token"] = "***"
        if shown["backend"]:
            shown["backend"] = redact_url(shown["backend"])
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


@dataclass(frozen=True)
class Option:
    name: str  # Settings field
    help: str
    parse: Callable[[str], Any] = str
    choices: tuple[str, ...] = ()
    flag_only: bool = False  # boolean switch


# The value parsers (``config_values``) keep their short names here, so each option's line in
# the table below reads as it always has.

OPTIONS: tuple[Option, ...] = (
    Option("host", "address to bind; 127.0.0.1 serves this machine only, 0.0.0.0 every interface"),
    Option("port", "TCP port 0..65535 (engines' clients default to 18000; 0: a free one)", _port),
    Option(
        "reservation_ttl",
        "seconds a reserved page waits for confirm/release (> 0)",
        _seconds,
    ),
    Option(
        "read_lease",
        "seconds a page is safe from eviction after a lookup (0: off)",
        _positive_float,
    ),
    Option(
        "eviction",
        "which stored page a full pool gives up: prefix (pages no stored page follows first, "
        "a request's pages together, least recently used first; for pools behind engines' "
        "host caches) or lru (least recently used; the only one, and the default, with a "
        "Redis --backend)",
        str,
        ("lru", "prefix"),
    ),
    Option("data_dir", "directory for the journal and snapshots"),
    Option("in_memory", "keep state in memory only (lost on restart)", _bool, flag_only=True),
    Option("fsync", "when the journal is fsynced", str, ("always", "batch", "never")),
    Option(
        "fsync_interval", "batch mode: longest wait before a group fsync, seconds (> 0)", _seconds
    ),
    Option(
        "fsync_timeout",
        "seconds a journal fsync may take before the disk counts as stalled: /ready 503, "
        "changes 503 until it completes (> 0)",
        _seconds,
    ),
    Option("snapshot_interval", "seconds between snapshots (0: only at shutdown)", _positive_float),
    Option(
        "snapshot_min_records",
        "journal records before a periodic snapshot is worth taking",
        _positive_int,
    ),
    Option(
        "snapshot_journal_bytes",
        "take a snapshot once the journal since the last one holds this many bytes (or the "
        "snapshot's own size, if larger), bounding the data directory and the replay after a "
        "crash; a number of bytes or one with KiB, MiB or GiB (0: no byte limit)",
        _bytes,
    ),
    Option(
        "snapshot_journal_ratio",
        "take a snapshot once the journal since the last one is this many times that "
        "snapshot's size (or 16 MiB, if larger); the sooner of this and "
        "--snapshot-journal-bytes wins (0: no ratio limit)",
        _ratio,
    ),
    Option(
        "persistence_path",
        "SGLang reference server's JSON state file: imported on first "
        "start, rewritten every --save-interval for rollback",
    ),
    Option("save_interval", "seconds between writes of --persistence-path", _positive_float),
    Option("backend", "shared state URL, e.g. redis://host:6379/0; unset: state in this process"),
    Option(
        "workers",
        f"server processes on one port, 1..{MAX_WORKERS} (needs a shared --backend)",
        _workers,
    ),
    Option("auth_token", "require this token (Bearer, or as the password in the URL)"),
    Option(
        "allowed_hosts",
        "comma-separated host names the Host header may carry (*.domain for a whole domain, "
        "* for any), besides localhost and, unless bound to loopback, IP addresses; unset: "
        "loopback names only when bound to loopback, else any (DNS-rebinding defence)",
        _allowed_hosts,
    ),
    Option("ssl_certfile", "TLS certificate (PEM) to serve https"),
    Option("ssl_keyfile", "TLS private key (PEM)"),
    Option("max_body_bytes", "largest request body accepted", _positive_int),
    Option("max_keys", "most keys in one request", _positive_int),
    Option("max_key_length", "longest key accepted, characters", _positive_int),
    Option("max_namespace_length", "longest namespace accepted, characters", _positive_int),
    Option(
        "max_pages",
        "largest num_pages of one pool (memory follows the pages used, ~26 bytes each)",
        _positive_int,
    ),
    Option("log_level", "logging level", str, ("debug", "info", "warning", "error")),
    Option("log_format", "log line format", str, ("text", "json")),
    Option("access_log", "log one line per request", _bool, flag_only=True),
    # resource limits on pools
    Option("max_world_size", "largest vLLM world_size accepted", _positive_int),
    Option(
        "max_total_pages",
        "num_pages of all pools together: the most pages they may use (~26 bytes of memory each "
        "once used), checked before a pool is made",
        _positive_int,
    ),
    Option(
        "max_pools_per_tenant",
        "pools one tenant may have (the default tenant too; a tokens file's max_pools "
        "overrides it per tenant), checked before a pool is made",
        _positive_int,
    ),
    # connections and operator routes
    Option(
        "header_timeout",
        "seconds a client has to send a whole request (headers and body; a new connection's "
        "first from the accept, TLS handshake included); later: 408, closed. Also the idle "
        "timeout of a connection that sent no request with a valid token yet",
        _seconds,
    ),
    Option(
        "idle_timeout",
        "seconds an idle keep-alive connection that sent a valid token is kept open (and one "
        "whose replies go unread)",
        _seconds,
    ),
    Option(
        "max_connections",
        "open client connections at most (also capped by the open-file limit minus a "
        "reserve); at most half may have sent no valid token yet, the oldest of them make room",
        _positive_int,
    ),
    Option(
        "metrics_max_pools",
        "pools with their own /metrics series; the rest are summed per dialect as rank _other",
        _positive_int,
    ),
    Option(
        "drain_seconds",
        "on SIGTERM, seconds /ready answers 503 while requests are still served, so load "
        "balancers stop sending before the server stops; a second signal (or SIGINT) stops at "
        "once (0: off)",
        _positive_float,
    ),
    # Redis high availability
    Option(
        "failover_timeout",
        "Redis backend: seconds a request retries across a failover, slot move or lost "
        "connection before it answers 503",
        _seconds,
    ),
    Option(
        "min_replicas_ack",
        "Redis backend: replicas that must acknowledge each change (WAIT) before it is "
        "answered; fewer within --replica-ack-timeout: 503 (0: the primary's word)",
        _non_negative_int,
    ),
    Option(
        "replica_ack_timeout",
        "Redis backend: seconds to wait for --min-replicas-ack replicas",
        _seconds,
    ),
    # KV events
    Option(
        "events",
        "publish KV events (stores, removals, clears) on this ZeroMQ PUB address, e.g. "
        "tcp://127.0.0.1:5557 (events name every tenant's keys: keep it on loopback); unset: off",
        _zmq_endpoint,
    ),
    Option(
        "events_replay",
        "ZeroMQ ROUTER address answering replay requests (batches from a sequence number), "
        "e.g. tcp://127.0.0.1:5558; unset: no replay",
        _zmq_endpoint,
    ),
    Option(
        "events_buffer",
        "event batches kept for replay (with --events-replay; the oldest go first)",
        _positive_int,
    ),
    Option(
        "events_buffer_mb",
        "MiB of event batches kept for replay at most (with --events-replay; whichever of "
        "this and --events-buffer is reached first)",
        _positive_int,
    ),
    Option(
        "events_queue",
        "event batches queued for a subscriber that is not reading, at most; beyond them it "
        "misses batches (it sees a gap in sequence numbers and replays) rather than the "
        "server holding them all in memory",
        _positive_int,
    ),
    Option(
        "events_replay_clients",
        "replay answers under way at once, at most (with --events-replay); a request beyond "
        "them is answered busy at once (the end marker with a 'busy' text) and asks again",
        _positive_int,
    ),
    Option(
        "events_replay_queue_mb",
        "MiB of replay answers handed to ZeroMQ and not yet written to their connections, all "
        "answers together (with --events-replay; each answer gets its share, and waits while "
        "its requester has not read it)",
        _positive_int,
    ),
    Option(
        "events_replay_timeout",
        "seconds a replay requester may read nothing while its answer waits, before the "
        "kernel drops its connection and frees its answer's slot (TCP only: TCP_USER_TIMEOUT)",
        _seconds,
    ),
    Option(
        "events_format",
        "how events are encoded: map (the current vLLM and SGLang releases) or array "
        "(positional, their older releases)",
        str,
        ("map", "array"),
    ),
    Option("events_medium", "the medium field of every event (the tier's name)", _medium),
    Option(
        "events_keys",
        "on|off: SGLang pools' BlockStored events carry the page keys (kvmeta's keys field, "
        "about three quarters of the payload bytes); off: block hashes only, the keys from "
        "GET /v1/dump",
        _bool,
    ),
    # router reads
    Option(
        "hash_index",
        "index SGLang pools' stored keys by their 64-bit block hash, so POST /v1/prefix_match "
        "takes the hashes of the KV event feed (about 80 bytes more per stored key)",
        _bool,
        flag_only=True,
    ),
    # tenants
    Option(
        "auth_file",
        "tokens file (TOML, mode 600): per-tenant tokens, scopes and quotas; reloaded on "
        "SIGHUP; --auth-token stays the all-access token",
    ),
)


def _flag(opt: Option) -> str:
    return "--" + opt.name.replace("_", "-")


def _env(opt: Option) -> str:
    return "KVMETA_" + opt.name.upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per option; defaults stay None so the merge can tell 'not given'."""
    defaults = Settings()
    for opt in OPTIONS:
        default = _shown_default(getattr(defaults, opt.name))
        choices = f"one of {'|'.join(opt.choices)}; " if opt.choices else ""
        help_text = f"{opt.help} ({choices}default {default}; env {_env(opt)})"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %
        if opt.flag_only:
            parser.add_argument(
                _flag(opt), action="store_const", const=True, default=None, help=help_text
            )
        else:
            metavar = "{" + ",".join(opt.choices) + "}" if opt.choices else opt.name.upper()
            parser.add_argument(_flag(opt), default=None, metavar=metavar, help=help_text)


def _shown_default(value: Any) -> str:
    """A default as a user would type it (or what leaving the flag out means)."""
    if value is None:
        return "unset"
    if value is True or value is False:
        return "on" if value else "off"
    return str(value)


# Variables read besides one per option: KVMETA_REDIS_URL, the conventional name, as a fallback
# for --backend; KVMETA_CONFIG, the settings file (kvmeta.config_file). KVMETA_TEST_* belong to
# kvmeta's test suite, which sets them for itself.
_OTHER_ENV = frozenset({"KVMETA_REDIS_URL", "KVMETA_CONFIG"})
_NOT_OURS = ("KVMETA_TEST_",)


def unknown_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per ``KVMETA_*`` variable that is no kvmeta setting, naming the closest one
    that is: a misspelt variable is otherwise ignored without a word, and the server runs with
    a default the operator believes they changed. Values are never shown (one may be a token).
    """
    env = os.environ if environ is None else environ
    known = sorted({_env(opt) for opt in OPTIONS} | _OTHER_ENV)
    lines = []
    for name in sorted(env):
        if not name.startswith("KVMETA_") or name in known or name.startswith(_NOT_OURS):
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "`kvmeta serve --help` lists them"
        lines.append(f"{name} is not a kvmeta setting ({hint})")
    return lines


def env_setting(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """One option's ``KVMETA_*`` variable (for commands other than ``serve``), or None."""
    env = os.environ if environ is None else environ
    return env.get("KVMETA_" + name.upper()) or None


def _given(name: str, sources: Mapping[str, str]) -> str:
    """An option as an error names it: its flag, and the variable when that set it."""
    flag = f"`--{name.replace('_', '-')}`"
    return flag if sources[name].startswith("--") else f"{flag} (set by {sources[name]})"


def _from_file(
    opt: Option, file_values: Mapping[str, tuple[Any, str]] | None, env: Mapping[str, str]
) -> tuple[Any, str] | None:
    """An option's (value, source) from the settings file, unless the environment has it: the
    conventional KVMETA_REDIS_URL is the environment's word on --backend too."""
    if not file_values or opt.name not in file_values:
        return None
    if opt.name == "backend" and env.get("KVMETA_REDIS_URL"):
        return None
    return file_values[opt.name]


def settings_from_args(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    file_values: Mapping[str, tuple[Any, str]] | None = None,
) -> Settings:
    """Merge defaults < settings file < env < flags into Settings.

    ``file_values``: option name -> (value already checked by ``kvmeta.config_file``, where it
    was set), for the error messages below.

    Raises:
        ConfigError: a value does not parse, or values conflict; the message names the flag
            and env var.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for opt in OPTIONS:
        given = getattr(args, opt.name, None)
        source = _flag(opt)
        if given is None and _env(opt) in env:
            given, source = env[_env(opt)], f"env {_env(opt)}"
        if given is None and (from_file := _from_file(opt, file_values, env)) is not None:
            given, source = from_file
        if given is None:
            continue
        sources[opt.name] = source
        if given is True and opt.flag_only:
            values[opt.name] = True
            continue
        try:
            value = opt.parse(given) if isinstance(given, str) else given
        except ValueError as exc:
            raise ConfigError(
                f"Expected `{_flag(opt)}` ({_env(opt)}) to be a valid {opt.name} value, got "
                f"{given!r} from {source}: {exc}",
                opt.name,
            ) from None
        if opt.choices and value not in opt.choices:
            raise ConfigError(
                f"Expected `{_flag(opt)}` in {'|'.join(opt.choices)}, got {given!r} "
                f"(from {source}; env {_env(opt)})",
                opt.name,
            )
        values[opt.name] = value
    if "backend" not in values and env.get("KVMETA_REDIS_URL"):
        values["backend"] = env["KVMETA_REDIS_URL"]  # the conventional name, as a fallback
    settings = Settings(**values)
    if settings.workers > 1 and not settings.backend:
        raise ConfigError(
            "`--workers` > 1 needs a shared `--backend` (e.g. redis://127.0.0.1:6379/0): "
            "separate processes cannot share in-process state",
            "workers",
        )
    # Local state options next to a shared backend: kvmeta would silently ignore them.
    local = [name for name in ("data_dir", "in_memory", "persistence_path") if name in values]
    if settings.backend and local:
        given = ", ".join(_given(name, sources) for name in local)
        raise ConfigError(
            f"{given} conflicts with `--backend`: with a shared backend all state lives there "
            "and no local data directory is used. Drop the local-state option (or its "
            "KVMETA_* variable), or drop `--backend` to keep state locally",
            local[0],
        )
    # --data-dir has a default an in-memory server ignores; only one given explicitly
    # contradicts --in-memory (and would be silently unused).
    if settings.in_memory and "data_dir" in values:
        raise ConfigError(
            f"{_given('in_memory', sources)} conflicts with {_given('data_dir', sources)}: an "
            "in-memory server keeps no data directory. Drop `--data-dir` (or its KVMETA_* "
            "variable) to keep state in memory only, or drop `--in-memory` to keep it in that "
            "directory",
            "data_dir",
        )
    if settings.backend and settings.eviction != "lru":
        if "eviction" not in values:
            # The default names local state's policy; the Redis backend has LRU only.
            settings = dataclasses.replace(settings, eviction="lru")
        else:
            raise ConfigError(
                f"{_given('eviction', sources)} with `--backend`: the Redis backend evicts "
                "least recently used pages only (its scripts keep no parent links). Drop "
                "`--eviction` (or use `--eviction lru`), or drop `--backend` to keep state "
                "locally",
                "eviction",
            )
    if settings.events and settings.workers > 1:
        raise ConfigError(
            "`--events` with `--workers` > 1: every worker process would bind the same events "
            "address. Run one server per events address (each publishes what it executed)",
            "events",
        )
    if settings.events_replay and not settings.events:
        raise ConfigError(
            "`--events-replay` needs `--events` (the replay socket answers from the batches "
            "published there)",
            "events_replay",
        )
    if bool(settings.ssl_certfile) != bool(settings.ssl_keyfile):
        raise ConfigError(
            "`--ssl-certfile` and `--ssl-keyfile` go together; give both to serve https",
            "ssl_certfile",
        )
    return settings
