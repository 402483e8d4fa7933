"""The engines' request cycles over a minimal keep-alive HTTP/1.1 client.

Keys are 64-hex-character SHA-256 chain digests, as SGLang HiCache makes them: each page's key
hashes the previous key with the page's tokens, so every batch is a fresh prefix chain. A
cycle writes one batch of new keys, so a pool fills up and then every reserve evicts.

The client is a raw socket with prebuilt request heads rather than ``requests``: the benchmark
runs on the same few cores as the server, and a lighter client leaves more of them to the
server (the server's CPU per request, which is what we report, does not depend on it).
"""

from __future__ import annotations

import hashlib
import re
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import msgspec

from kvmeta.client.urls import split_credentials
from kvmeta.errors import InvalidRequest, KvmetaError

__all__ = [
    "DIALECTS",
    "BenchHttpError",
    "HttpClient",
    "KeyChain",
    "cycle_for",
    "initialize_pool",
    "pool_size",
]

DIALECTS = ("s", "v")
_encode = msgspec.json.encode
_decode = msgspec.json.decode


class BenchHttpError(KvmetaError):
    """Raised when the server under test answers something other than 2xx."""

    def __init__(self, message: str, status: int = 0, path: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.path = path


class HttpClient:
    """One keep-alive connection; ``post`` returns (status, body bytes)."""

    def __init__(self, url: str, timeout: float = 30.0, auth_token: str | None = None) -> None:
        """``auth_token`` goes with every request as ``Authorization: Bearer``; without it, the
        password of ``url`` (``http://:TOKEN@host:port``) does.

        Raises:
        InvalidRequest: ``url`` is not ``http://host[:port][/prefix]``."""
        target = split_credentials(url)
        parts = urlsplit(target.url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme != "http" or not parts.hostname or port == -1:
            raise InvalidRequest(
                f"--url must be http://HOST:PORT of a running server (the benchmark speaks plain "
                f"HTTP), got {target.shown!r}"
            )
        auth_token = auth_token or target.token
        self.host = parts.hostname
        self.port = port or 80
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self._auth = f"Authorization: Bearer {auth_token}\r\n" if auth_token else ""
        self.sock: socket.socket | None = None
        self._buf = b""
        self._heads: dict[str, bytes] = {}

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._buf = b""
        return sock

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = self._heads.get(path)
        if head is None:
            head = (
                f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"{self._auth}Content-Type: application/json\r\nContent-Length: "
            ).encode()
            self._heads[path] = head
        return self._exchange(b"%s%d\r\n\r\n%s" % (head, len(body), body))

    def get(self, path: str) -> tuple[int, bytes]:
        """GET ``path`` (not timed: only set-up uses it)."""
        head = (
            f"GET {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self._auth}\r\n"
        )
        return self._exchange(head.encode())

    def _exchange(self, data: bytes) -> tuple[int, bytes]:
        sock = self.sock or self._connect()
        try:
            sock.sendall(data)
            return self._read_response()
        except (ConnectionError, BenchHttpError):
            self.close()
            raise

    def _read_response(self) -> tuple[int, bytes]:
        end = self._buf.find(b"\r\n\r\n")
        while end < 0:
            self._fill()
            end = self._buf.find(b"\r\n\r\n")
        head = self._buf[:end].decode("latin-1")
        self._buf = self._buf[end + 4 :]
        lines = head.split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = self._read_chunked()
        else:
            length = int(headers.get("content-length", "0"))
            while len(self._buf) < length:
                self._fill()
            body, self._buf = self._buf[:length], self._buf[length:]
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, body

    def _read_chunked(self) -> bytes:
        chunks = []
        while True:
            end = self._buf.find(b"\r\n")
            while end < 0:
                self._fill()
                end = self._buf.find(b"\r\n")
            size = int(self._buf[:end].split(b";")[0], 16)
            self._buf = self._buf[end + 2 :]
            while len(self._buf) < size + 2:
                self._fill()
            chunks.append(self._buf[:size])
            self._buf = self._buf[size + 2 :]
            if size == 0:
                return b"".join(chunks)

    def _fill(self) -> None:
        assert self.sock is not None
        data = self.sock.recv(262144)
        if not data:
            raise ConnectionError("server closed the connection")
        self._buf += data

    def call(self, path: str, obj: object) -> object:
        """POST ``obj`` as JSON; the decoded reply (None when empty).

        Raises:
            BenchHttpError: the server answered non-2xx.
        """
        status, body = self.post(path, _encode(obj))
        if not 200 <= status < 300:
            raise BenchHttpError(f"POST {path} -> {status}: {body[:300]!r}", status, path)
        return _decode(body) if body else None


class KeyChain:
    """Fresh 64-hex-char SHA-256 chain keys; ``seed`` keeps clients' chains apart."""

    def __init__(self, seed: str) -> None:
        self.last = hashlib.sha256(seed.encode()).hexdigest()
        self.count = 0

    def batch(self, n: int) -> list[tuple[str, str | None]]:
        """``n`` (key, prefix_key) pairs continuing the chain; the first prefix is None."""
        out: list[tuple[str, str | None]] = []
        prev: str | None = None
        for _ in range(n):
            self.count += 1
            key = hashlib.sha256(b"%s:%d" % (self.last.encode(), self.count)).hexdigest()
            out.append((key, prev))
            prev = key
            self.last = key
        return out


# A cycle runs one engine round trip set, calling ``timed(path, body)`` for each request, and
# returns how many of its keys got no page (refused: nothing evictable, e.g. all read-leased).
Timed = Callable[[str, object], object]


def _s_cycle(rank: int, timed: Timed, pairs: list[tuple[str, str | None]]) -> int:
    keys = [k for k, _ in pairs]
    timed(f"/{rank}/exists", {"keys": keys})
    reply = timed(f"/{rank}/reserve_and_allocate_page_indices", {"keys": pairs})
    indices = reply["indices"]  # type: ignore[index]
    written = [[k, p] for k, (hit, p) in zip(keys, indices, strict=True) if not hit and p >= 0]
    timed(f"/{rank}/confirm_write", {"written_keys_to_confirm": written, "pages_to_release": []})
    timed(f"/{rank}/get_page_indices", {"keys": keys})
    return len(keys) - len(written)


def _v_cycle(rank: int, timed: Timed, pairs: list[tuple[str, str | None]]) -> int:
    keys = [k for k, _ in pairs]
    timed("/keys/batch_exists", {"keys": keys})
    reply = timed("/keys/batch_allocate", {"rank": rank, "keys": pairs})
    results = reply["results"]  # type: ignore[index]
    confirmations = [[k, p] for k, p in results if p >= 0]
    timed(
        "/keys/confirm_write",
        {"rank": rank, "confirmations": confirmations, "pages_to_release": []},
    )
    timed("/keys/get_locations", {"rank": rank, "keys": keys})
    return len(keys) - len(confirmations)


def cycle_for(dialect: str) -> Callable[[int, Timed, list[tuple[str, str | None]]], int]:
    """The cycle function of ``dialect`` ("s" or "v")."""
    if dialect == "s":
        return _s_cycle
    if dialect == "v":
        return _v_cycle
    raise ValueError(f"dialect must be one of {DIALECTS}, got {dialect!r}")


def initialize_pool(client: HttpClient, dialect: str, rank: int, num_pages: int) -> object:
    """Create the pool (idempotent on both dialects); the server's reply (None when empty)."""
    if dialect == "s":
        return client.call(f"/{rank}/initialize", {"num_pages": num_pages})
    return client.call(f"/rank/{rank}/initialize", {"role": "worker", "num_pages": num_pages})


_INITIALIZED_RE = re.compile(r"initialized with (\d+) pages")


def pool_size(client: HttpClient, dialect: str, rank: int, init_reply: object) -> int | None:
    """The size of the pool the benchmark will drive, as the server reports it; None when the
    server does not say.

    A pool that already existed keeps its size whatever ``initialize`` asked for (both dialects
    answer success), so the size is read back: from kvmeta's ``/v1/pools``, else from the vLLM
    dialect's ``initialize`` message ("Rank 0 initialized with N pages").
    """
    status, body = client.get("/v1/pools")
    if status == 200:
        try:
            pools = _decode(body).get("pools", [])
        except (msgspec.DecodeError, AttributeError):
            pools = []
        namespace = "kv" if dialect == "s" else ""
        for view in pools:
            if (view.get("dialect"), view.get("rank"), view.get("namespace")) == (
                dialect,
                rank,
                namespace,
            ):
                return int(view["num_pages"])
    if isinstance(init_reply, dict):
        match = _INITIALIZED_RE.search(str(init_reply.get("message", "")))
        if match:
            return int(match.group(1))
    return None


def prefill(
    client: HttpClient, dialect: str, rank: int, num_pages: int, chain: KeyChain, step: int = 8192
) -> int:
    """Fill the pool with stored keys in large batches, so measured cycles evict; returns keys."""
    done = 0
    cycle = cycle_for(dialect)
    while done < num_pages:
        n = min(step, num_pages - done)
        pairs = chain.batch(n)
        # exists/get are skipped: only reserve + confirm matter for filling.
        cycle(rank, _fill_only(client), pairs)
        done += n
    return done


def _fill_only(client: HttpClient) -> Timed:
    def timed(path: str, body: object) -> object:
        if path.endswith(("exists", "get_page_indices", "get_locations")):
            return None
        return client.call(path, body)

    return timed


def now() -> float:
    return time.perf_counter()
