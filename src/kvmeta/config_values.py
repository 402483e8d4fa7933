"""The parsers of ``kvmeta serve``'s flag values (``config.OPTIONS`` names one per option) and
the ranges they hold values to.

Apart from ``config`` so the option table stays readable; each parser takes the text as given on
the command line, in the env or in the ``--config`` file, and raises ``ValueError`` with a
message that says what a right value looks like (``config.settings_from_args`` adds the flag's
name).
"""

from __future__ import annotations

import ipaddress

__all__ = [
    "MAX_COUNT",
    "MAX_RATIO",
    "MAX_SECONDS",
    "MAX_WORKERS",
    "MIN_SECONDS",
    "allowed_hosts",
    "boolean",
    "byte_size",
    "medium",
    "non_negative_int",
    "port",
    "positive_float",
    "positive_int",
    "ratio",
    "seconds",
    "workers",
    "zmq_endpoint",
]


# Sane ranges of the numeric flags. A duration is at least a millisecond (below the timers'
# resolution, and no lease or timeout that short makes sense) and at most a year: Redis's WAIT
# takes milliseconds as a 64-bit integer (--replica-ack-timeout 1e300 failed every
# acknowledged write), and a lease of 1e300 s would hold a pool's pages after a Redis data
# loss forever. A count is at most 2**53: exact as a double, as Redis scripts and JSON readers
# see numbers.
MIN_SECONDS = 0.001
MAX_SECONDS = 365 * 24 * 3600.0
MAX_COUNT = 1 << 53
MAX_WORKERS = 1024


def _finite(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("must be a finite number of seconds")
    return value


def _in_seconds_range(value: float, what: str) -> float:
    if not MIN_SECONDS <= value <= MAX_SECONDS:
        raise ValueError(
            f"must be {what}from {MIN_SECONDS:g} to {MAX_SECONDS:.0f} seconds (365 days)"
        )
    return value


def positive_float(text: str) -> float:
    """Seconds where 0 means off (or 'only at shutdown'): 0, or a duration in range."""
    value = _finite(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value if value == 0 else _in_seconds_range(value, "0 (off) or ")


def seconds(text: str) -> float:
    """Seconds that must pass before something happens: > 0 (0 would mean 'at once, always')."""
    value = _finite(text)
    if value <= 0:
        raise ValueError("must be > 0 seconds")
    return _in_seconds_range(value, "")


def _count(text: str, low: int, high: int) -> int:
    value = int(text)
    if value < low:
        raise ValueError("must be > 0" if low == 1 else f"must be >= {low}")
    if value > high:
        raise ValueError(f"must be at most {high:,}")
    return value


def positive_int(text: str) -> int:
    return _count(text, 1, MAX_COUNT)


def non_negative_int(text: str) -> int:
    return _count(text, 0, MAX_COUNT)


def workers(text: str) -> int:
    return _count(text, 1, MAX_WORKERS)


# A journal budget of more than a thousand snapshots is no budget: 0 says "off" plainly.
MAX_RATIO = 1000.0


def ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value <= MAX_RATIO:  # nan fails both comparisons
        raise ValueError(f"must be a number from 0 (off) to {MAX_RATIO:,.0f}")
    return value


_UNITS = {"": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def byte_size(text: str) -> int:
    """A size: a whole number of bytes, or one followed by KiB, MiB or GiB."""
    number = text.strip()
    unit = number[-3:] if number[-3:] in _UNITS else ""
    try:
        value = int(number[: len(number) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise ValueError("a whole number of bytes, e.g. 67108864 or 64MiB (0: off)") from None
    if value < 0:
        raise ValueError("must be >= 0 (0: off)")
    if value > MAX_COUNT:
        raise ValueError(f"must be at most {MAX_COUNT:,}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("a TCP port is 0..65535 (0 picks a free one)")
    return value


def boolean(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("must be true or false")


def zmq_endpoint(text: str) -> str:
    if not text.startswith(("tcp://", "ipc://")):
        raise ValueError("a ZeroMQ address such as tcp://127.0.0.1:5557 (or ipc:///path)")
    return text


def _valid_name(name: str) -> bool:
    labels = name.split(".")
    return all(
        label
        and len(label) <= 63
        and all(c.isascii() and (c.isalnum() or c in "-_") for c in label)
        for label in labels
    )


def allowed_hosts(text: str) -> tuple[str, ...]:
    """``--allowed-hosts``: comma-separated host names (``kvmeta.internal``), ``*.suffix`` for
    every name under a domain, IP addresses, or ``*`` for any Host; no ports (any port is
    accepted). Lowercased, trailing dots dropped (``server.guard`` matches Host against them).

    Raises:
        ValueError: an entry that is none of these (the message names it).
    """
    entries: list[str] = []
    for raw in text.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        if entry == "*":
            entries.append(entry)
            continue
        try:
            entries.append(str(ipaddress.ip_address(entry.strip("[]"))))
            continue
        except ValueError:
            pass
        name = entry.rstrip(".")
        bare = name[2:] if name.startswith("*.") else name
        if not bare or not _valid_name(bare):
            raise ValueError(
                f"{raw.strip()!r} is not a host name, *.domain or IP address (no scheme, port "
                "or path), e.g. kvmeta.internal,*.svc.cluster.local"
            )
        entries.append(name)
    if not entries:
        raise ValueError("give at least one host name, e.g. kvmeta.internal (or * for any)")
    return tuple(entries)


def medium(text: str) -> str:
    if not text or len(text) > 64:
        raise ValueError("a tier name of 1-64 characters, e.g. EXTERNAL")
    return text
