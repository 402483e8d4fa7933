"""``kvmeta serve``: build the backend, the app and the HTTP server, run until signalled."""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import socket
import ssl
from pathlib import Path
from typing import Any

from kvmeta.config import Settings
from kvmeta.core import EVICTION_POLICIES
from kvmeta.errors import ConfigError, MissingExtra
from kvmeta.server.app import App
from kvmeta.server.http import HttpLimits, HttpServer, bind_sockets, in_task
from kvmeta.server.ops_routes import Drain
from kvmeta.service.limits import RequestLimits
from kvmeta.service.ops import Service
from kvmeta.store.base import Backend
from kvmeta.store.disk.local import DurabilityOptions, LocalBackend
from kvmeta.store.disk.memory import MemoryStore

__all__ = ["build_app", "build_backend", "run", "serve", "serve_checks"]

logger = logging.getLogger("kvmeta.server")

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def build_backend(settings: Settings) -> Backend:
    """The backend the settings ask for."""
    if settings.backend:
        try:
            from kvmeta.store.redis.backend import RedisBackend
        except ImportError as exc:
            raise MissingExtra("`--backend`", "redis", exc, "backend") from None
        return RedisBackend(
            settings.backend,
            reservation_ttl=settings.reservation_ttl,
            read_lease=settings.read_lease,
            failover_timeout=settings.failover_timeout,
            min_replicas_ack=settings.min_replicas_ack,
            replica_ack_timeout=settings.replica_ack_timeout,
            hash_index=settings.hash_index,
        )
    store = MemoryStore(
        reservation_ttl=settings.reservation_ttl,
        read_lease=settings.read_lease,
        hash_index=settings.hash_index,
        policy=EVICTION_POLICIES[settings.eviction],
    )
    if settings.in_memory and not settings.persistence_path:
        return LocalBackend(store)
    legacy = Path(settings.persistence_path) if settings.persistence_path else None
    options = DurabilityOptions(
        data_dir=None if settings.in_memory else Path(settings.data_dir),
        fsync=settings.fsync,
        fsync_interval=settings.fsync_interval,
        fsync_timeout=settings.fsync_timeout,
        snapshot_interval=settings.snapshot_interval,
        snapshot_min_records=settings.snapshot_min_records,
        snapshot_journal_bytes=settings.snapshot_journal_bytes,
        snapshot_journal_ratio=settings.snapshot_journal_ratio,
        persistence_path=legacy,
        save_interval=settings.save_interval,
    )
    return LocalBackend(store, options)


def build_app(settings: Settings, service: Service, drain: Drain | None = None) -> App:
    """Every route of every dialect on one app; ``drain`` makes its ``/ready`` answer 503."""
    from kvmeta.server import sglang, vllm

    app = App()
    sglang.add_routes(app, service)
    vllm.add_routes(app, service)
    # Operator routes, auth and metrics: keep this last so it wraps every route above.
    from kvmeta.server import ops_routes

    ops_routes.install(app, service, settings, drain)
    return app


def _limits(settings: Settings) -> RequestLimits:
    return RequestLimits(
        max_keys=settings.max_keys,
        max_key_length=settings.max_key_length,
        max_namespace_length=settings.max_namespace_length,
        max_pages=settings.max_pages,
        max_world_size=settings.max_world_size,
        max_total_pages=settings.max_total_pages,
        max_pools_per_tenant=settings.max_pools_per_tenant,
    )


def _ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """Raises ConfigError naming the flag when the certificate or key cannot be used."""
    if not settings.ssl_certfile or not settings.ssl_keyfile:
        return None
    from kvmeta.server.tls import server_context

    return server_context(settings.ssl_certfile, settings.ssl_keyfile)


# Descriptors kept free of client connections for the journal, snapshots, the fsync helper's
# pipes and backend connections: a connection flood must never starve them.
_FD_RESERVE = 64


def connection_cap(wanted: int, quiet: bool = False) -> int:
    """``--max-connections``, lowered to fit the open-file limit minus a reserve (said in the
    log unless ``quiet``: a ``--workers`` process other than the first)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    reserve = min(_FD_RESERVE, soft // 2)
    cap = max(1, soft - reserve)
    if cap < wanted:
        if quiet:
            return cap
        logger.info(
            "--max-connections lowered from %d to %d: the open-file limit (ulimit -n) is %d and "
            "%d descriptors are kept for the journal, snapshots and backend; raise the limit "
            "to allow more",
            wanted,
            cap,
            soft,
            reserve,
        )
        return cap
    return wanted


def _http_limits(settings: Settings, quiet: bool = False) -> HttpLimits:
    return HttpLimits(
        max_body_bytes=settings.max_body_bytes,
        header_timeout=settings.header_timeout,
        idle_timeout=settings.idle_timeout,
        max_connections=connection_cap(settings.max_connections, quiet),
    )


async def run(
    settings: Settings,
    ready: asyncio.Event | None = None,
    sockets: list[socket.socket] | None = None,
    announce: bool = True,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until signalled (see ``_on_signal``), or until ``stop`` is set.

    ``sockets``: listening sockets made by the ``--workers`` parent; else the port is bound
    here, before the state is loaded, so a taken port fails at once. ``announce``: log the
    start-up facts (a ``--workers`` group logs them once, from its first worker; each worker
    still logs its own listening line with its pid). ``stop``: set by the caller to stop; no
    signal handlers are installed then (only a main thread may own them, and a server in a
    test process runs in a thread of its own).
    """
    loop = asyncio.get_running_loop()
    if sockets is None:
        sockets = bind_sockets(settings.host, settings.port)
    backend = build_backend(settings)
    await backend.start()
    service = Service(backend, _limits(settings))
    publisher = _start_events(settings, backend, service, loop) if settings.events else None
    drain = Drain()
    app = build_app(settings, service, drain)
    from kvmeta.server.oplog import access_logged, log_startup, refusals_logged

    handler = access_logged(app, bool(settings.auth_file)) if settings.access_log else app
    refused = refusals_logged(bool(settings.auth_file)) if settings.access_log else None
    if settings.backend:
        # A shared backend waits on the network in every request, and redis-py's timeouts
        # need a Task from the first line on (see server.stepping).
        handler = in_task(handler)
    server = HttpServer(
        handler,
        _http_limits(settings, quiet=not announce),
        loop,
        head_check=app.head_check,
        epoch=lambda: backend.epoch,
        refused=refused,
    )
    app.head_checked = True  # token and guard are checked on the headers, before any body
    ctx = _ssl_context(settings)
    addrs = await server.listen(sockets, ssl_context=ctx)
    # Signals are ours before the listening line: whoever waits for that line (a supervisor,
    # a test) and then signals must reach the handlers below, not Python's or asyncio's
    # defaults (SIGTERM would kill the process without its final snapshot; SIGINT would stop
    # it with exit 130).
    if stop is None:
        stop = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, _on_signal, signum, settings, drain, stop, loop)
    scheme = "https" if ctx else "http"
    for host, port in addrs:
        logger.info("kvmeta listening on %s://%s:%d (pid %d)", scheme, host, port, os.getpid())
    if announce:
        log_startup(settings, backend.describe)
        if settings.host in _LOOPBACK:
            logger.info(
                "serving this machine only; to serve engines on other nodes pass --host 0.0.0.0 "
                "(and set --auth-token)"
            )
        elif not (settings.auth_token or settings.auth_file or settings.allowed_hosts):
            from kvmeta.server.guard import bound_to_loopback

            if not bound_to_loopback(settings.host):
                logger.warning(
                    "--host %s is reachable from other machines without --auth-token: whoever "
                    "reaches the port can change every pool, and so can any web page opened in a "
                    "browser there, through a DNS name of its own pointed at this server (DNS "
                    "rebinding); set --auth-token, or at least --allowed-hosts with the names "
                    "engines use",
                    settings.host or "''",
                )
    tasks = [loop.create_task(job()) for job in app.background]
    if publisher is not None:
        tasks.append(loop.create_task(publisher.resync(backend)))
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if publisher is not None:
            await publisher.cancel_resyncs()
        await server.shutdown()
        await backend.close()
        if publisher is not None:
            backend.set_change_listener(None)
            publisher.close()
        logger.info("kvmeta stopped")


def _on_signal(
    signum: int,
    settings: Settings,
    drain: Drain,
    stop: asyncio.Event,
    loop: asyncio.AbstractEventLoop,
) -> None:
    """SIGTERM drains for ``--drain-seconds`` (``/ready`` 503, requests still served), then
    stops; SIGINT (Ctrl-C at a terminal), or a second signal while draining, stops without
    waiting; a signal while stopping exits at once, skipping the final snapshot (the journal
    is crash-safe, so that damages nothing)."""
    name = signal.Signals(signum).name
    if stop.is_set():
        logger.warning("received %s while stopping: exiting now", name)
        os._exit(1)
    if drain.active:
        logger.info("received %s while draining: finishing in-flight requests", name)
        stop.set()
        return
    if signum == signal.SIGTERM and settings.drain_seconds > 0:
        drain.begin(settings.drain_seconds)
        logger.info(
            "received SIGTERM: draining for %g s (pid %d): /ready answers 503, requests are "
            "still served; a second signal stops at once",
            settings.drain_seconds,
            os.getpid(),
        )

        def drained() -> None:
            if not stop.is_set():
                logger.info("drained: finishing in-flight requests")
                stop.set()

        loop.call_later(settings.drain_seconds, drained)
        return
    logger.info("received %s: finishing in-flight requests", name)
    stop.set()


def _start_events(
    settings: Settings, backend: Backend, service: Service, loop: asyncio.AbstractEventLoop
) -> Any:
    """Bind the event sockets and attach the publisher to the backend's change feed."""
    try:
        from kvmeta.events.publisher import Publisher
    except ImportError as exc:
        raise MissingExtra("`--events`", "events", exc, "events") from None
    import zmq

    assert settings.events is not None
    try:
        publisher = Publisher(
            settings.events,
            replay_endpoint=settings.events_replay,
            buffer=settings.events_buffer,
            buffer_bytes=settings.events_buffer_mb << 20,
            queue=settings.events_queue,
            replay_clients=settings.events_replay_clients,
            replay_queue_bytes=settings.events_replay_queue_mb << 20,
            replay_timeout=settings.events_replay_timeout,
            encoding=settings.events_format,
            medium=settings.events_medium,
            epoch=backend.epoch,
            keys=settings.events_keys,
        )
    except zmq.ZMQError as exc:
        raise ConfigError(
            f"cannot bind the events address {settings.events} (or --events-replay "
            f"{settings.events_replay}): {exc}. Pick a free port or stop what holds it",
            "events",
        ) from None
    backend.set_change_listener(publisher.on_changes)
    publisher.start(loop)
    service.reserve_observer = publisher.note_reserve
    from kvmeta.server import metrics

    metrics.EVENTS[:] = [publisher.stats]
    replay = f", replay on {publisher.replay.endpoint}" if publisher.replay else ""
    logger.info(
        "kvmeta events on %s (topic %s, format %s%s)",
        publisher.endpoint,
        publisher.topic.decode(),
        settings.events_format,
        replay,
    )
    host = settings.events.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if settings.events.startswith("tcp://") and host not in _LOOPBACK:
        logger.warning(
            "--events %s is reachable from other machines: events name the keys of every "
            "tenant and carry no authentication; bind it to 127.0.0.1 unless the network is "
            "trusted",
            settings.events,
        )
    return publisher


def serve_checks(settings: Settings) -> None:
    """Refuse, before anything is bound, a tokens file or certificate that cannot be used."""
    if settings.auth_file:
        from kvmeta.server.tokens import load_tokens

        load_tokens(settings.auth_file)
    _ssl_context(settings)


def serve(settings: Settings) -> None:
    """Run the server in this process (or ``--workers`` processes), on uvloop when available."""
    serve_checks(settings)
    if settings.workers > 1:
        from kvmeta.server.workers import run_workers

        raise SystemExit(run_workers(settings, _serve_one))
    _serve_one(settings)


def _serve_one(
    settings: Settings, sockets: list[socket.socket] | None = None, announce: bool = True
) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(run(settings, sockets=sockets, announce=announce))
    else:
        uvloop.run(run(settings, sockets=sockets, announce=announce))
