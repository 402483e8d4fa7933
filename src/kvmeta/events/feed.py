"""Reading the event feed as a subscriber does, for ``kvmeta events``: a batch decoded into its
events, each event as one line a person reads or one JSON object for ``jq``, and where the
reader stands in the server's runs and sequence numbers (``Follower``).

Pure functions and one small state machine, no sockets (``tail`` has those), so that what an
operator is shown is tested without a server. Events are decoded without the wire classes'
types, from their shape: a map (the ``map`` encoding) or a positional array whose first
element is the type (``array``), the positions being those ``wire`` writes. A feed is read
whichever encoding the server was started with, and an engine's own events (the same classes,
without kvmeta's fields) read the same way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import msgspec

from kvmeta.events.wire import (
    ENCODINGS,
    ArrayCleared,
    ArrayRemoved,
    ArrayStored,
    MapCleared,
    MapRemoved,
    MapStored,
)

__all__ = [
    "ALL_POOLS",
    "Batch",
    "FIELDS",
    "Follower",
    "MalformedEvent",
    "NO_TIME",
    "Step",
    "decode_batch",
    "event_fields",
    "format_json",
    "format_line",
    "format_time",
    "gap_notice",
    "json_value",
    "matches_pools",
    "matches_tenants",
    "run_notice",
    "split_topic",
]

# How a line shows the pool of an ``AllBlocksCleared`` that has none: every pool of the server.
ALL_POOLS = "*"
# Each type's field names in the positional encoding, in order (the single source is ``wire``).
_POSITIONAL: dict[str, tuple[str, ...]] = {
    str(cls.__struct_config__.tag): cls.__struct_fields__
    for cls in (ArrayStored, ArrayRemoved, ArrayCleared)
}
# kvmeta's own fields in every event, and their values where an event has none (a pool of ""
# in a clear: every pool).
_DEFAULTS: dict[str, Any] = {"pool": "", "reason": "", "tenant": ""}
# Each type's fields (the map encoding's, which has them all) and the value of each that an
# event leaves out: the map encoding omits kvmeta's fields at their default, the positional one
# has no ``lora_name``, an engine's own events have no kvmeta fields. A decoded event has every
# field whichever the encoding, so a filter (``jq 'select(.reason == "capacity")'``) needs no
# default of its own and both encodings read the same.
FIELDS: dict[str, dict[str, Any]] = {
    str(cls.__struct_config__.tag): {
        f.name: _DEFAULTS.get(f.name) if f.default is msgspec.NODEFAULT else f.default
        for f in msgspec.structs.fields(cls)
    }
    for cls in (MapStored, MapRemoved, MapCleared)
}
_TYPE_WIDTH = len("AllBlocksCleared")
# How a line shows the time of a batch that carries none (a ts of 0, below 0 or not a finite
# number: a publisher that does not set it): as wide as a time, so that the columns line up.
NO_TIME = "--:--:--.---"
_DAY_MS = 86_400_000


class MalformedEvent(ValueError):
    """An event (or batch) that is not one the feed defines; the message says what it was."""


@dataclass(frozen=True)
class Batch:
    """One message of the feed: its topic, sequence number, time and events (still raw)."""

    topic: bytes
    seq: int
    ts: float
    events: Sequence[Any]


def split_topic(topic: bytes) -> tuple[str, str]:
    """``(epoch, run)`` of a ``kvmeta/<epoch>/<run>`` topic. Another publisher's topic (an
    engine's, often empty) is its own run: ``("", topic)``."""
    text = topic.decode("utf-8", "backslashreplace")
    head, sep, run = text.rpartition("/")
    if sep and head.startswith("kvmeta/"):
        return head[len("kvmeta/") :], run
    return "", text


def decode_batch(topic: bytes, seq: int, payload: bytes) -> Batch:
    """The ``[ts, events]`` payload of one message, its events left raw (``event_fields``)."""
    try:
        body = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedEvent(f"batch {seq}: not msgpack ({exc})") from None
    if (
        not isinstance(body, list)
        or len(body) < 2
        or not isinstance(body[0], (int, float))
        or not isinstance(body[1], list)
    ):
        raise MalformedEvent(f"batch {seq}: not an EventBatch [ts, events]")
    return Batch(topic, seq, float(body[0]), body[1])


def event_fields(event: Any, encoding: str | None = None) -> dict[str, Any]:
    """An event as ``{"type": ..., field: value, ...}`` from either encoding (``encoding``
    None: told by its shape; else the shape must be that one), with every field of its type
    (``FIELDS``: the ones it leaves out at their defaults), in the map encoding's order.
    Values are as decoded (hashes int or bytes)."""
    if encoding is not None and encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    if isinstance(event, dict):
        shape = "map"
    elif isinstance(event, list) and event and isinstance(event[0], str):
        shape = "array"
    else:
        raise MalformedEvent(f"neither a map nor a tagged array: {_preview(event)}")
    if encoding is not None and shape != encoding:
        raise MalformedEvent(
            f"an event in the {shape} encoding, not {encoding} (--format {encoding}; "
            "leave --format out to read either)"
        )
    if isinstance(event, dict):
        kind = event.get("type")
        if not isinstance(kind, str):
            raise MalformedEvent(f"a map without a type: {_preview(event)}")
        given = {str(k): v for k, v in event.items() if k != "type"}
    else:
        kind, values = event[0], event[1:]
        names = _POSITIONAL.get(kind)
        if names is None:  # a type kvmeta does not publish: shown, its values unnamed
            return {"type": kind, **_DEFAULTS, "values": values}
        given = dict(zip(names, values, strict=False))
        if len(values) > len(names):
            given["extra"] = values[len(names) :]
    defaults = FIELDS.get(kind, _DEFAULTS)
    return {"type": kind, **{k: _plain(v) for k, v in defaults.items()}, **given}


def _plain(value: Any) -> Any:
    """A default as decoded msgpack has it: a (shared, immutable) tuple as a new list."""
    return list(value) if isinstance(value, tuple) else value


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def matches_pools(fields: dict[str, Any], pools: Sequence[str]) -> bool:
    """Whether ``--pool`` shows this event: every event when no pool is named; an event
    without a pool (an ``AllBlocksCleared`` of every pool) concerns every pool, so always."""
    return not pools or not fields.get("pool") or fields["pool"] in pools


def matches_tenants(fields: dict[str, Any], tenants: Sequence[str] | None) -> bool:
    """Whether ``--tenant`` shows this event: every event when no tenant is named (None; the
    default tenant is ``""``); an event without a pool (an ``AllBlocksCleared`` of every
    pool of the server) concerns every tenant, so always."""
    return tenants is None or not fields.get("pool") or fields.get("tenant", "") in tenants


def _hash_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bytes):
        return _text(value)
    return str(value)


def _text(raw: bytes) -> str:
    """A vLLM pool's block hash is its page key's bytes: shown as the key it is."""
    return raw.decode("utf-8", "backslashreplace")


def format_time(ts: float) -> str:
    """The time of day of ``ts`` (a batch's, seconds since the epoch) as ``HH:MM:SS.mmm`` in
    UTC: the same on every reader whatever its timezone, and the zone of kvmeta's JSON logs.

    Milliseconds are truncated, never rounded up, so that a time never shows a second that had
    not begun. They are cut from the decimal ``--json`` prints for the same ``ts`` (the
    shortest that reads back as that float), so a line and its JSON object agree digit for
    digit: ``1700000000.123`` shows ``.123``, where the float's exact value, a hair below,
    would truncate to ``.122``; and that decimal never reaches a whole second the float is
    below, a whole second being a float itself. The time of day is ``ts`` modulo a day (epoch
    time has no leap seconds), without ``time.gmtime``, so no ``ts`` overflows the platform's
    calendar. ``NO_TIME`` when ``ts`` is 0, below 0 or not finite: no clock's time."""
    if not (math.isfinite(ts) and ts > 0):
        return NO_TIME
    millis = int(Decimal(repr(float(ts))).scaleb(3)) % _DAY_MS
    seconds, ms = divmod(millis, 1000)
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}.{ms:03d}"


def format_line(ts: float, seq: int, run: str, fields: dict[str, Any]) -> str:
    """One event on one line: ``12:03:04.123 seq=12 run=3f6c0d2a BlockStored      pool=s:0:kv
    blocks=5 parent=-4437…``. First the batch's time (``ts``, shown by ``format_time``), so
    that an operator sees when each event happened without ``--json``; then the type padded so
    that the columns line up, the rest ``key=value`` (a pool of ``*``: every pool; ``tenant``
    only when not the default; ``reason`` only when there is one; ``parent`` only for
    ``BlockStored``, ``none`` when it has none)."""
    kind = str(fields["type"])
    parts = [
        format_time(ts),
        f"seq={seq}",
        f"run={run}",
        kind.ljust(_TYPE_WIDTH),
        f"pool={fields['pool'] or ALL_POOLS}",
    ]
    if fields.get("tenant"):
        parts.append(f"tenant={fields['tenant']}")
    hashes = fields.get("block_hashes")
    if isinstance(hashes, list):
        parts.append(f"blocks={len(hashes)}")
    if kind == "BlockStored":
        parts.append(f"parent={_hash_text(fields.get('parent_block_hash'))}")
    if fields.get("reason"):
        parts.append(f"reason={fields['reason']}")
    if "values" in fields:
        parts.append(f"values={_preview(fields['values'])}")
    return " ".join(parts)


def json_value(value: Any) -> Any:
    """A decoded value made JSON: bytes (a vLLM pool's block hash, its page key) as text, the
    rest as it is (hashes stay integers)."""
    if isinstance(value, bytes):
        return _text(value)
    if isinstance(value, list):
        return [json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    return value


def format_json(batch: Batch, fields: dict[str, Any]) -> str:
    """One event as one JSON object: where it came from (``seq``, ``run``, ``epoch``,
    ``topic``, the batch's ``ts``) and every field of the event, decoded."""
    epoch, run = split_topic(batch.topic)
    head = {
        "seq": batch.seq,
        "run": run,
        "epoch": epoch,
        "topic": batch.topic.decode("utf-8", "backslashreplace"),
        "ts": batch.ts,
    }
    return json.dumps({**head, **json_value(fields)}, separators=(", ", ": "))


@dataclass(frozen=True)
class Step:
    """What a batch is to the reader (``Follower.check``): a batch already shown
    (``duplicate``), the first of a run after another (``new_run``), and the sequence numbers
    it skips over (``missing``, empty when none)."""

    duplicate: bool
    new_run: bool
    missing: range


class Follower:
    """Where the reader stands: the run (topic) it follows and the next sequence number it
    expects (None: whatever comes first, a reader joining a feed mid-run without ``--from``).

    A new topic is a new run (the server restarted): it starts at 0 and its first batches are
    the resync, so a run's first batch seen later than 0 has skipped some. Within a run, a
    batch below the one expected was shown already (a replay overlapping the live feed)."""

    def __init__(self, start: int | None = None) -> None:
        self.topic: bytes | None = None
        self.next: int | None = start

    def check(self, topic: bytes, seq: int) -> Step:
        """What the batch ``(topic, seq)`` would be; changes nothing (``advance`` does)."""
        if self.topic is not None and topic != self.topic:
            return Step(False, True, range(0, seq))
        expected = self.next
        if expected is None:
            return Step(False, False, range(0))
        if seq < expected:
            return Step(True, False, range(0))
        return Step(False, False, range(expected, seq))

    def advance(self, topic: bytes, seq: int) -> None:
        """The batch ``(topic, seq)`` was shown: the next one expected is ``seq + 1``."""
        self.topic = topic
        self.next = seq + 1


def _span(missing: range) -> str:
    first, last = missing.start, missing.stop - 1
    return f"batch {first}" if first == last else f"batches {first}-{last}"


def run_notice(topic: bytes, first: bool) -> str:
    """The stderr line for the run of ``topic``: the first one seen, or a new one (a restart,
    whose next events are the resync that replaces what the reader knew of that server)."""
    epoch, run = split_topic(topic)
    where = f"run {run}" + (f" (epoch {epoch})" if epoch else "")
    if first:
        return f"following {where}"
    return f"new {where}: the server restarted; its resync follows (forget what it said before)"


def gap_notice(missing: range, run: str, hint: str) -> str:
    """The stderr line for batches that will not be shown (lost on the way, or gone from
    the replay buffer too), with ``hint``: why, or what to do."""
    return f"{_span(missing)} of run {run} missed: {hint}"
