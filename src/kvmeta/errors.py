"""Every error kvmeta raises, in one tree, on the server and in the clients alike.

    KvmetaError (RuntimeError)             root; engines' code catches RuntimeError
    +-- InvalidRequest (ValueError)        caller's mistake: 400, names the field and the fix
    |   +-- PayloadTooLarge                a size limit: 413, names the limit and its flag
    |   +-- InvalidPathParameter           a path rank that is not an integer: 422
    |   +-- ConfigError                    a flag, KVMETA_* variable or --backend URL is wrong
    |   +-- NoHashIndex                    prefix_match by hashes on a pool not indexed by them
    |   +-- UnsupportedMediaType           a change sent with a Content-Type other than JSON: 415
    |   +-- PageOutOfRange                 a confirm names a page outside its pool: 400
    +-- NotInitialized (LookupError)       the pool/rank does not exist yet: 404
    +-- NotFound (LookupError)             unknown route: 404
    +-- MethodNotAllowed                   405
    +-- Unauthorized                       missing or wrong auth token: 401
    +-- Forbidden                          the token's scope does not cover the request, or
    |                                      its Host or Origin is not accepted: 403
    +-- QuotaExceeded                      a tenant's page or request-rate quota: 429
    +-- RankInUse                          removing a vLLM rank whose pages are in use: 409
    +-- ServerUnavailable                  client side: the server could not be reached
    +-- ServerError                        client side: the server answered 5xx
    +-- StorageError (OSError)             data directory / journal trouble
    |   +-- JournalCorrupt                 a journal or snapshot fails its checksum
    |   +-- JournalFailed                  the journal cannot be written: 503 until it can
    |       +-- JournalStalled             its fsync hangs (the disk stopped answering): 503
    +-- BackendUnavailable                 the shared backend (Redis) cannot be reached
    |   +-- NotReplicated                  too few replicas acknowledged a write: 503
    |   +-- BackendMisconfigured           Redis may evict kvmeta's keys: no start, /ready 503
    |   +-- PoolDamaged                    a pool's keys partly evicted or deleted: 503
    +-- CannotListen                       serve: the port is taken / not allowed / bad host

All of them subclass ``RuntimeError`` because both engines' stock clients raise
``RuntimeError`` and engine code catches exactly that. Each class has an HTTP ``status`` so the
server maps errors to responses through one attribute, and the clients map responses back to the
same classes (``from_status``), so a message travels unchanged from server to caller.
"""

from __future__ import annotations

__all__ = [
    "BackendMisconfigured",
    "BackendUnavailable",
    "CannotListen",
    "ConfigError",
    "Forbidden",
    "InvalidPathParameter",
    "InvalidRequest",
    "MissingExtra",
    "JournalCorrupt",
    "JournalFailed",
    "JournalStalled",
    "KvmetaError",
    "MethodNotAllowed",
    "NoHashIndex",
    "NotFound",
    "NotInitialized",
    "NotReplicated",
    "PageOutOfRange",
    "PayloadTooLarge",
    "PoolDamaged",
    "QuotaExceeded",
    "RankInUse",
    "ServerError",
    "ServerUnavailable",
    "StorageError",
    "Unauthorized",
    "UnsupportedMediaType",
    "error_for_status",
    "show_number",
]


def show_number(number: int | str) -> str:
    """A number as given, or its size when it is too long to echo (or to print at all)."""
    if isinstance(number, int):
        if abs(number).bit_length() <= 80:
            return str(number)
        digits = int(abs(number).bit_length() * 0.30103) + 1
        return f"a number of about {digits} digits"
    text = number.lstrip("+-")
    return number if len(text) <= 24 else f"a {len(text)}-digit number"


class KvmetaError(RuntimeError):
    """Raised for any kvmeta failure; ``str(err)`` is the message a user acts on."""

    status: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidRequest(KvmetaError, ValueError):
    """Raised when a request is malformed; nothing was changed."""

    status = 400

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class PayloadTooLarge(InvalidRequest):
    """Raised when a request exceeds a configured size limit."""

    status = 413


class UnsupportedMediaType(InvalidRequest):
    """Raised when a request that may change state declares a body that is not JSON: a form
    or ``text/plain`` body is what a cross-site page can send without the server's consent,
    never what an engine sends. Nothing was changed."""

    status = 415


class PageOutOfRange(InvalidRequest):
    """Raised by a store when a confirm names a page outside its pool; nothing was applied.

    The store knows the page and the pool's size but not the caller's dialect, so it raises
    this in SGLang's field names and the service words it for its caller (``for_caller``) from
    what it carries: no second look at the store. A caller gets a plain ``InvalidRequest``,
    the class a 400 maps back to, so in-process and HTTP callers see the same error.
    """

    def __init__(self, page: int, num_pages: int, in_release: bool) -> None:
        super().__init__(*_page_refusal(page, num_pages, in_release))
        self.page = page
        self.num_pages = num_pages
        self.in_release = in_release  # False: the page is in the confirmed pairs

    def for_caller(self, pairs_field: str, reserve: str) -> InvalidRequest:
        """The refusal in a dialect's words: its pairs field and the call that hands out
        pages."""
        return InvalidRequest(
            *_page_refusal(self.page, self.num_pages, self.in_release, pairs_field, reserve)
        )


def _page_refusal(
    page: int,
    num_pages: int,
    in_release: bool,
    pairs_field: str = "written_keys_to_confirm",
    reserve: str = "reserve",
) -> tuple[str, str]:
    """The one wording of an out-of-range page, and the field it names."""
    field = "pages_to_release" if in_release else pairs_field
    verb = "release" if in_release else "confirm"
    return (
        f"page {show_number(page)} in `{field}` is outside this pool's pages 0..{num_pages - 1}; "
        f"{verb} only pages returned by {reserve}",
        field,
    )


class NotInitialized(KvmetaError, LookupError):
    """Raised when an operation names a pool or rank that was never initialised."""

    status = 404

    def __init__(self, message: str, rank: int | None = None, namespace: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.namespace = namespace

    @classmethod
    def for_pool(cls, dialect: str, rank: int, namespace: str) -> NotInitialized:
        """The not-initialised error in the wording each dialect's engines expect."""
        if dialect == "v":
            return cls(
                f"Rank {rank} not initialized. POST /rank/{rank}/initialize with "
                f'{{"role": "worker", "num_pages": N}} (N > 0) first; a server restarted '
                "with --in-memory forgets its ranks",
                rank,
                None,
            )
        return cls(
            f"Rank {rank} namespace '{namespace}' not initialized. "
            f"Please call /{rank}/initialize first.",
            rank,
            namespace,
        )

    @classmethod
    def in_process(cls, rank: int, namespace: str) -> NotInitialized:
        """The wording of SGLang's in-process client, which differs from its server's: engines
        match on the sentence, so it comes first, word for word, and kvmeta's advice after it."""
        return cls(
            f"Namespace '{namespace}' for rank {rank} not initialized: call "
            f"initialize({rank}, num_pages, '{namespace}') on this client first (an in-process "
            "client's pools live as long as the client)",
            rank,
            namespace,
        )


class NotFound(KvmetaError, LookupError):
    """Raised when a request names a route that does not exist."""

    status = 404


class MethodNotAllowed(KvmetaError):
    """Raised when a route exists but not for the request's HTTP method."""

    status = 405


class Unauthorized(KvmetaError):
    """Raised when a request lacks the configured auth token."""

    status = 401


class ServerUnavailable(KvmetaError):
    """Raised by clients when the server cannot be reached after all retries."""

    status = 503


class ServerError(KvmetaError):
    """Raised by clients when the server answered 5xx after all retries."""

    status = 500


class StorageError(KvmetaError, OSError):
    """Raised when the data directory, journal or snapshot cannot be read or written."""

    status = 500


class JournalCorrupt(StorageError):
    """Raised at start-up when a journal or snapshot is damaged beyond a torn tail."""


class JournalFailed(StorageError):
    """Raised for every change while the journal cannot be written (disk full, out of file
    descriptors, fsync failing): nothing is changed, and the server retries by itself."""

    status = 503


class BackendUnavailable(KvmetaError):
    """Raised when the shared backend (Redis/Valkey) cannot be reached."""

    status = 503


class CannotListen(KvmetaError):
    """Raised at start-up when the server cannot listen on ``--host``/``--port`` (taken by
    another process, a privileged port, an address this machine does not have)."""

    status = 500


# (Classes added later go here, each at the end of the list.)


class NotReplicated(BackendUnavailable):
    """Raised when a write reached the Redis primary but fewer replicas than
    ``--min-replicas-ack`` acknowledged it in time: it may not survive a failover (503; every
    operation is idempotent, so the request is safe to retry)."""


class InvalidPathParameter(InvalidRequest):
    """Raised when a path segment that must be an integer rank is not one (422, as the
    reference servers' framework answers)."""

    status = 422


class ConfigError(InvalidRequest):
    """Raised when a setting is wrong: a flag, its ``KVMETA_*`` variable or the ``--backend``
    URL. ``field`` names the setting; the message names the flag and the fix. ``kvmeta``
    prints it on one line and exits 2; it is never an HTTP answer (an ``InvalidRequest`` only
    so that code catching that class before keeps catching it)."""


class MissingExtra(ConfigError):
    """Raised when a feature needs an optional dependency that is not installed. A bare
    ``pip install kvmeta`` runs every other command; this one line names the extra to add."""

    def __init__(self, feature: str, extra: str, exc: ImportError, setting: str | None = None):
        missing = f"{exc.name} is not installed" if exc.name else str(exc)
        super().__init__(
            f"{feature} needs kvmeta's {extra!r} extra ({missing}): pip install 'kvmeta[{extra}]'",
            setting,
        )
        self.extra = extra


class NoHashIndex(InvalidRequest):
    """Raised when ``prefix_match`` sends 64-bit block ``hashes`` for a pool that is not
    indexed by them: a vLLM pool (its events publish the keys themselves), or an SGLang pool
    on a server without ``--hash-index`` (400, field ``hashes``; nothing was changed), or an
    SGLang pool whose index is still being built from its stored keys (``building``)."""

    @classmethod
    def for_pool(cls, dialect: str, rank: int, namespace: str) -> NoHashIndex:
        if dialect == "v":
            return cls(
                f"vLLM rank {rank} is matched by `keys`, not `hashes`: vLLM pools' events "
                "publish the page keys themselves as block hashes",
                "hashes",
            )
        return cls(
            f"rank {rank} namespace '{namespace}' keeps no block-hash index: start the "
            "servers with --hash-index (KVMETA_HASH_INDEX=1) to match SGLang pools by "
            "`hashes`, or send `keys` (the KV event feed publishes each hash's key)",
            "hashes",
        )

    @classmethod
    def building(cls, rank: int, namespace: str) -> NoHashIndex:
        """The pool's index is being built from the keys it stored before it had one (a
        server with ``--hash-index`` initialised it): a lookup by hashes could miss some."""
        return cls(
            f"rank {rank} namespace '{namespace}' has its block-hash index being built from "
            "the keys it stored before it had one: retry `hashes` shortly (a few seconds per "
            "million stored keys), or send `keys` meanwhile",
            "hashes",
        )


class Forbidden(KvmetaError):
    """Raised when a valid token's scope (tenant, pools, rights) does not cover the request.
    The message names the scope, never whether the target exists (no existence oracle).

    Also raised when a request's ``Host`` or ``Origin`` header says a browser was led to send
    it (DNS rebinding, a cross-site page; ``server.guard``): the message names the header."""

    status = 403

    @classmethod
    def world_size_change(cls, rank: int, current: int, requested: int) -> Forbidden:
        """A vLLM initialize whose ``world_size`` would move the tenant's pinned one, from a
        token without the ``admin`` right (which ranks make a block complete is the tenant's
        setting, not one worker's); worded the same by every backend. It tells the caller the
        tenant's own world size, which its workers need to know anyway."""
        return cls(
            f"Forbidden: initialize of rank {rank} with `world_size` {requested} would change "
            f"this tenant's vLLM world size from {current}, which needs the 'admin' right; "
            f"nothing was registered. Initialize with `world_size` {current} (or without it), "
            "or have an admin token change it first (POST /v1/vllm/world_size "
            f'{{"world_size": {requested}}}, or initialize with the admin token)'
        )


class QuotaExceeded(KvmetaError):
    """Raised when a tenant is over its page quota or request rate; ``retry_after`` (seconds)
    is sent as ``Retry-After``. Nothing was changed."""

    status = 429

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class JournalStalled(JournalFailed):
    """Raised for changes while the journal's oldest fsync is older than ``--fsync-timeout``
    (a hung mount or a dying disk): a ``JournalFailed`` that ends by itself, when the fsync
    completes, rather than by a recovery snapshot (which the same disk would hold up too)."""


class RankInUse(KvmetaError):
    """Raised when a vLLM rank to remove still has pages in use: reserved by writers, under a
    read lease, or cooling after a release (409; nothing was changed). Registered again, a
    removed rank would hand those pages to new blocks while the old writes and reads may still
    land on them. ``force`` removes it anyway, for workers that are gone for good."""

    status = 409

    @classmethod
    def for_rank(cls, rank: int, reserved: int, seconds: float) -> RankInUse:
        """The refusal, worded the same by every backend (``seconds``: until the last lease on
        the rank's pages ends)."""
        return cls(
            f"vLLM rank {rank} is still in use: {reserved} page(s) reserved by writers, and "
            f"leases on its pages (writes, reads, released pages' grace) run for {seconds:.1f} s "
            "more. Removed now, the rank would hand those pages to new blocks once it registers "
            "again (a running worker does so by itself) while they may still be written or "
            "read. Stop the rank's workers and remove it once the leases end, or, if they are "
            f"gone for good, force it: POST /v1/vllm/ranks/{rank}/remove?force=true (kvmeta's "
            "client: remove_rank(rank, force=True))"
        )


class BackendMisconfigured(BackendUnavailable):
    """Raised when the Redis/Valkey server is set up to lose kvmeta's keys on its own (a
    ``maxmemory-policy`` that evicts any key): kvmeta refuses to start on it, and ``/ready``
    answers 503 with this message while it lasts. The message names the node, the setting and
    the command that fixes it."""


class PoolDamaged(BackendUnavailable):
    """Raised by initialize when some of a pool's Redis keys exist without the one that says
    the pool exists (its ``meta``): Redis evicted, or someone deleted, part of the pool.
    Creating the pool again would hand out pages that its stored keys still name, so nothing
    is changed (503) until an operator deletes the leftover keys."""


_BY_STATUS: dict[int, type[KvmetaError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    405: MethodNotAllowed,
    409: RankInUse,
    413: PayloadTooLarge,
    415: UnsupportedMediaType,
    422: InvalidRequest,
    429: QuotaExceeded,
}


def error_for_status(status: int, detail: str) -> KvmetaError:
    """The error a client raises for an HTTP error ``status`` with the server's ``detail``."""
    if status == 404 and "not initialized" in detail:
        return NotInitialized(detail)
    cls = _BY_STATUS.get(status)
    if cls is not None:
        return cls(detail)
    if status >= 500:
        return ServerError(f"Server error {status}: {detail}")
    return KvmetaError(f"HTTP {status}: {detail}")
