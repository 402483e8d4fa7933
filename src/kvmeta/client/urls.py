"""Server URLs as people type them: a bare ``host:port`` read as http, credentials taken out.

A token may ride in a server URL as its password (``http://:TOKEN@host:18000``), the form
stock engine clients use. Whatever connects takes it out once, here, and whatever shows the
URL shows it with the password as ``***``: a URL ends up in errors, logs and reports that are
pasted into tickets, and the token must not.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit

__all__ = ["REDACTED", "ServerUrl", "command_line_url", "split_credentials", "with_scheme"]

REDACTED = "***"


@dataclass(frozen=True)
class ServerUrl:
    """``url`` without credentials; ``username`` and ``password`` as given (None: absent);
    ``shown`` the URL as given with the password as ``***``, for messages."""

    url: str
    username: str | None
    password: str | None
    shown: str

    @property
    def token(self) -> str | None:
        """The URL's password, as kvmeta servers read it: an auth token (None: no password)."""
        return self.password or None


def split_credentials(url: str) -> ServerUrl:
    """Take the credentials out of ``url``; nothing else about it is checked or changed."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at:
        return ServerUrl(url, None, None, url)
    user, colon, password = userinfo.partition(":")
    bare = urlunsplit(parts._replace(netloc=hostport))
    # A lone user name is redacted too: a token typed without its colon lands there.
    hidden = f"{user}:{REDACTED}" if colon else REDACTED
    shown = urlunsplit(parts._replace(netloc=f"{hidden}@{hostport}"))
    return ServerUrl(bare, unquote(user), unquote(password) if colon else None, shown)


def with_scheme(text: str) -> str:
    """``text`` from a ``--url`` flag with ``http://`` put in front when it names no scheme
    (``host:port``), as curl reads it."""
    text = text.strip().rstrip("/")
    return text if "://" in text else "http://" + text


def command_line_url(text: str) -> ServerUrl:
    """``text`` from a ``--url`` flag (see ``with_scheme``) with its credentials taken out."""
    return split_credentials(with_scheme(text))
