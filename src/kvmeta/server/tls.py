"""The server's TLS context from ``--ssl-certfile`` / ``--ssl-keyfile``, checked at start-up.

OpenSSL's own errors name neither the file nor the flag ("PEM lib", "key values mismatch") and,
for an encrypted key, it prompts for a passphrase on the terminal, which a service has not got.
So each file is read and checked on its own first, and every failure becomes one
``ConfigError`` line naming the flag, the file and what to do.
"""

from __future__ import annotations

import ssl

from kvmeta.errors import ConfigError

__all__ = ["server_context"]

_CERT_FLAG = "--ssl-certfile"
_KEY_FLAG = "--ssl-keyfile"


class _NeedsPassphrase(Exception):
    """Raised by the passphrase callback: the key is encrypted and nobody can type one."""


def _no_passphrase() -> str:
    raise _NeedsPassphrase


def _readable(flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except FileNotFoundError:
        problem = "no such file"
    except IsADirectoryError:
        problem = "is a directory, not a PEM file"
    except PermissionError:
        problem = "not readable by this user (check its owner and mode)"
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror})"
    raise ConfigError(f"`{flag} {path}`: {problem}", flag.lstrip("-").replace("-", "_"))


def server_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """The context ``kvmeta serve`` listens with.

    Raises:
        ConfigError: one line naming ``--ssl-certfile`` or ``--ssl-keyfile`` and the problem
        (missing, unreadable, not PEM, key of another certificate, encrypted key).
    """
    _readable(_CERT_FLAG, certfile)
    key_text = _readable(_KEY_FLAG, keyfile)
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        probe.load_verify_locations(cafile=certfile)
    except ssl.SSLError:
        raise ConfigError(
            f"`{_CERT_FLAG} {certfile}` holds no PEM certificate (a block beginning "
            "-----BEGIN CERTIFICATE-----); give the certificate file, and its key to "
            f"{_KEY_FLAG}",
            "ssl_certfile",
        ) from None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile, password=_no_passphrase)
    except _NeedsPassphrase:
        raise ConfigError(
            f"`{_KEY_FLAG} {keyfile}` is encrypted (it needs a passphrase, and the server has "
            "no terminal to ask for one); give an unencrypted key, e.g. made with "
            f"`openssl pkey -in {keyfile} -out key.pem`, readable only by the server's user",
            "ssl_keyfile",
        ) from None
    except ssl.SSLError as exc:
        if getattr(exc, "reason", None) == "KEY_VALUES_MISMATCH":
            problem = (
                f"does not match the certificate in `{_CERT_FLAG} {certfile}`; give the key "
                "that certificate was made with"
            )
        elif b"PRIVATE KEY-----" not in key_text:
            problem = "holds no PEM private key (a block beginning -----BEGIN PRIVATE KEY-----)"
        else:
            problem = f"cannot be used as the certificate's private key ({exc})"
        raise ConfigError(f"`{_KEY_FLAG} {keyfile}` {problem}", "ssl_keyfile") from None
    return context
