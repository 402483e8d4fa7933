"""Refusing the requests a web browser can be led to send: every request's ``Host``, and the
``Origin`` and ``Content-Type`` of every request that may change state.

Why: engines call kvmeta from programs, but an operator's browser can reach it too, and a page
of any site opened in that browser can make the browser send requests to it:

- cross-site request forgery: a form (``text/plain``, urlencoded, multipart) or a ``no-cors``
  ``fetch`` POSTs to kvmeta; a top-level form carries the operator's cached status-page login,
  and a server without a token needs none. Browsers name the sending page in ``Origin`` on
  every POST, engines send no ``Origin``: a change whose ``Origin`` is not the server's own
  (same host and port as ``Host``) is refused 403. A change with a body that is not declared
  JSON (engines send ``application/json``, or no ``Content-Type`` with no body) is refused 415,
  a second wall should a browser ever leave ``Origin`` out.
- DNS rebinding: a page on a name the attacker controls re-points that name at kvmeta's
  address, and is then same-origin with it (so ``Origin`` matches ``Host``) and may read the
  replies. The ``Host`` then carries the attacker's name: a server bound to loopback answers
  only ``localhost`` and loopback addresses; on other addresses any ``Host`` unless
  ``--allowed-hosts`` lists the names (IP addresses are always accepted there: a page's own
  address is no name an attacker can re-point).

Safe methods (GET, HEAD, OPTIONS) change nothing and a page of another origin cannot read their
replies, so only ``Host`` is checked for them. A request with no ``Host`` (HTTP/1.0, raw
sockets) is no browser's. The checks run on the headers (``App.head_check``, after the
token), so a refused request is answered before its body is read, changes nothing, and closes
its connection; each refusal names the header and the fix. An accepted ``Host`` value is
remembered, so the engines' requests (one value all day) cost a set lookup.
"""

from __future__ import annotations

import ipaddress
import socket

from kvmeta.errors import Forbidden, UnsupportedMediaType
from kvmeta.server.http import Request

__all__ = [
    "SAFE_METHODS",
    "RequestGuard",
    "bound_to_loopback",
    "for_settings",
]

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_JSON = b"application/json"
_REMEMBERED = 256  # accepted Host values kept (engines use one or two)
_IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(text: str) -> _IP | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _is_loopback(ip: _IP) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def _loopback_name(name: str) -> bool:
    """``localhost`` and its subdomains (RFC 6761: browsers resolve them to loopback
    themselves, never through DNS)."""
    return name == "localhost" or name.endswith(".localhost")


def bound_to_loopback(host: str) -> bool:
    """Whether ``--host`` serves this machine only (every address it resolves to is
    loopback). Empty, ``0.0.0.0`` and ``::`` serve every interface."""
    text = host.strip().strip("[]").lower().rstrip(".")
    if not text:
        return False
    ip = _ip(text)
    if ip is not None:
        return _is_loopback(ip)
    if _loopback_name(text):
        return True
    try:
        infos = socket.getaddrinfo(text, None, type=socket.SOCK_STREAM)
    except OSError:
        return False  # the bind fails on its own, naming the host
    addresses = [_ip(str(info[4][0]).split("%", 1)[0]) for info in infos]
    return bool(addresses) and all(a is not None and _is_loopback(a) for a in addresses)


def _shown(value: bytes) -> str:
    text = value.decode("latin-1")
    return repr(text if len(text) <= 100 else text[:97] + "...")


def _split_host(value: bytes) -> str | None:
    """The host of a ``Host`` value (``name``, ``name:port``, ``[v6]:port``), lowercased and
    without a trailing dot; None when it is not of that form."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            return None
        name, rest = text[1:end], text[end + 1 :]
        if _ip(name.split("%", 1)[0]) is None:
            return None
    else:
        name, sep, port = text.partition(":")
        rest = sep + port
    if rest and not (rest[0] == ":" and rest[1:].isdigit() and rest[1:].isascii()):
        return None
    return name.rstrip(".") if name else None


def _origin_matches(origin: bytes, host: bytes) -> bool:
    """Whether ``Origin`` (``scheme://host[:port]``) names the same host and port as the
    request's ``Host`` (a default port written or left out alike)."""
    text = origin.decode("latin-1").strip().lower()
    scheme, sep, authority = text.partition("://")
    if not sep or scheme not in ("http", "https") or not authority or "/" in authority:
        return False
    default = ":80" if scheme == "http" else ":443"
    own = host.decode("latin-1").strip().lower()
    return authority.removesuffix(default) == own.removesuffix(default)


class RequestGuard:
    """``App.guard`` (run by ``App.head_check``): raises ``Forbidden`` (Host, Origin) or
    ``UnsupportedMediaType``.

    ``loopback``: the server is bound to loopback only. ``allowed``: ``--allowed-hosts`` (None:
    not given). ``where``: the bound address, as refusals name it."""

    def __init__(self, loopback: bool, allowed: tuple[str, ...] | None, where: str) -> None:
        self.loopback = loopback
        self.allowed = allowed
        self.where = where
        self.any_host = (allowed is not None and "*" in allowed) or (
            allowed is None and not loopback
        )
        names = allowed or ()
        self._exact = frozenset(n for n in names if not n.startswith("*"))
        self._suffixes = tuple(n[1:] for n in names if n.startswith("*."))
        self._good: set[bytes] = set()
        self.refused = {"host": 0, "origin": 0, "content_type": 0}

    def __call__(self, request: Request) -> None:
        host = request.host
        if host is not None and not self.any_host and host not in self._good:
            self.check_host(host)
        if request.method in SAFE_METHODS:
            return
        origin = request.origin
        if origin is not None and (host is None or not _origin_matches(origin, host)):
            self.refused["origin"] += 1
            raise Forbidden(self._origin_refusal(origin, host))
        ctype = request.content_type
        if ctype is not None and ctype != _JSON and not _is_json(ctype):
            self.refused["content_type"] += 1
            raise UnsupportedMediaType(
                f"Content-Type {_shown(ctype)} is not accepted for {request.method} "
                f"{request.path}: send the body as JSON with `Content-Type: application/json` "
                "(or no Content-Type). Form and text bodies are refused because a web page of "
                "any site can make a browser send them (curl: add -H 'Content-Type: "
                "application/json')",
                "Content-Type",
            )

    def check_host(self, value: bytes) -> None:
        """Raises Forbidden unless the ``Host`` value is accepted; remembers it if it is."""
        if not value.strip():
            return  # no authority to check (as if no Host was sent)
        name = _split_host(value)
        if name is None:
            self.refused["host"] += 1
            raise Forbidden(
                f"Host header {_shown(value)} is not a host name or address with an optional "
                "port; send the server's address, e.g. Host: 127.0.0.1:18000"
            )
        if not self._accepts(name):
            self.refused["host"] += 1
            raise Forbidden(self._host_refusal(value))
        if len(self._good) >= _REMEMBERED:
            self._good.clear()
        self._good.add(value)

    def _accepts(self, name: str) -> bool:
        if _loopback_name(name) or name in self._exact:
            return True
        ip = _ip(name.split("%", 1)[0])
        if ip is not None:
            return _is_loopback(ip) or not self.loopback or str(ip) in self._exact
        return any(name.endswith(suffix) for suffix in self._suffixes)

    def _host_refusal(self, value: bytes) -> str:
        listed = (
            f"--allowed-hosts lists {', '.join(self.allowed)}"
            if self.allowed
            else "no --allowed-hosts is set"
        )
        if self.loopback:
            accepted = "localhost or a loopback address"
        else:
            accepted = "an IP address, localhost, or a name in --allowed-hosts"
        return (
            f"Host header {_shown(value)} is not accepted: this server, bound to {self.where}, "
            f"answers Host {accepted} ({listed}), so that a web page cannot reach it through "
            "a DNS name it controls (DNS rebinding). Use the server's address (e.g. "
            "http://127.0.0.1:PORT), or add the name to --allowed-hosts (KVMETA_ALLOWED_HOSTS)"
        )

    def _origin_refusal(self, origin: bytes, host: bytes | None) -> str:
        own = "unknown: the request has no Host" if host is None else _shown(host)
        return (
            f"Origin header {_shown(origin)} is not this server's own (Host {own}): a request "
            "that may change state is refused when a web page of another site made a browser "
            "send it (cross-site request forgery). Engines and scripts send no Origin header: "
            "call the server from a program, not from a web page of another origin"
        )

    def counters(self) -> dict[str, int]:
        return dict(self.refused)


def _is_json(value: bytes) -> bool:
    """``application/json`` with parameters (``; charset=utf-8``), any case."""
    return value.split(b";", 1)[0].strip().lower() == _JSON


def for_settings(host: str, allowed_hosts: tuple[str, ...] | None) -> RequestGuard:
    """The guard for a server bound to ``host`` (``--host``)."""
    return RequestGuard(bound_to_loopback(host), allowed_hosts, host or "every interface")
