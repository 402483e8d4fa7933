"""The ``kvmeta`` command: ``serve``, ``status``, ``events``, ``check``, ``bench``.

The only module that configures logging or prints; everything else logs through its module
logger. Each subcommand's work lives elsewhere; this module parses and dispatches.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import select
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvmeta import __version__
from kvmeta.config import add_arguments, env_setting, settings_from_args, unknown_env
from kvmeta.config_file import add_config_argument
from kvmeta.errors import KvmetaError, MissingExtra

__all__ = ["main"]

logger = logging.getLogger(__name__)


class _JsonFormatter(logging.Formatter):
    """One JSON object per record. A record logged with ``extra={"fields": {...}}`` (the access
    log) has those fields at the top level, so a log pipeline can filter on them without
    parsing ``msg``; they never replace the four standard keys."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                line.setdefault(str(key), value)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line)


def log_formatter(fmt: str = "text") -> logging.Formatter:
    """The formatter of ``--log-format`` (shared with whatever else renders the server's log)."""
    if fmt == "json":
        return _JsonFormatter()
    return logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(log_formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _warn_unknown_env(logged: bool) -> None:
    """Say which ``KVMETA_*`` variables no command reads: through the log where the command
    has configured one (its format may be JSON), else as a plain line on stderr."""
    for line in unknown_env():
        if logged:
            logger.warning("%s", line)
        else:
            print(f"kvmeta: warning: {line}", file=sys.stderr)


def _add_bench(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvmeta.bench.commands import add_arguments as add_bench_arguments

    bench = sub.add_parser("bench", help="benchmark a server (either dialect) or the core")
    add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvmeta.bench.commands import run as run_bench

    configure_logging("info")
    _warn_unknown_env(logged=True)
    print(run_bench(args))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvmeta.config_file import config_path, load_config_file
    from kvmeta.server.runner import serve

    path = config_path(args)
    file_values = load_config_file(path) if path else None
    settings = settings_from_args(args, file_values=file_values)
    configure_logging(settings.log_level, settings.log_format)
    _warn_unknown_env(logged=True)
    if path:
        logger.info(
            "settings file: %s (%d settings; flags and KVMETA_* variables win over it)",
            path,
            len(file_values or {}),
        )
    serve(settings)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from kvmeta.status import server_url, status

    _warn_unknown_env(logged=False)
    url = server_url(args.url)
    token = args.token or env_setting("auth_token")
    if args.watch is not None:
        from kvmeta.status import watch

        if args.watch <= 0:
            raise KvmetaError("`--watch` takes a positive number of seconds, e.g. --watch 2")
        return watch(url, token, args.watch, sys.stdout, as_json=args.json)
    code, text = status(url, token, args.json)
    print(text, file=sys.stdout if code == 0 else sys.stderr)
    return code


def _add_status(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cmd = sub.add_parser(
        "status",
        help="show a server's readiness and pools (exit 1: not ready, 2: unreachable)",
    )
    cmd.add_argument(
        "--url",
        default="http://127.0.0.1:18000",
        help="server base URL; HOST:PORT means http://HOST:PORT (default %(default)s)",
    )
    cmd.add_argument(
        "--token",
        default=None,
        help="auth token (default: env KVMETA_AUTH_TOKEN; or put it in the URL as the password)",
    )
    cmd.add_argument("--json", action="store_true", help="print the raw JSON instead")
    cmd.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C, like top",
    )
    cmd.set_defaults(func=_cmd_status)


def _cmd_events(args: argparse.Namespace) -> int:
    try:
        from kvmeta.events.tail import TailOptions, tail
    except ImportError as exc:
        raise MissingExtra("`kvmeta events`", "events", exc) from None
    options = TailOptions(
        address=args.address,
        replay=args.replay,
        start=args.start,
        encoding=args.format,
        as_json=args.json,
        count=args.count,
        timeout=args.timeout,
        pools=tuple(args.pool or ()),
        tenants=None if args.tenant is None else tuple(args.tenant),
    )
    return tail(options, sys.stdout, sys.stderr)


def _add_events(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cmd = sub.add_parser(
        "events",
        help="print a server's KV events as they are published, one line each (exit 1: "
        "--timeout passed, 2: wrong option or replay socket)",
        description="Subscribe to a server's KV event feed (kvmeta serve --events) and print "
        "each event. New runs (restarts) and missed batches are said on stderr.",
    )
    cmd.add_argument(
        "address",
        metavar="ADDRESS",
        help="the server's --events address, e.g. tcp://127.0.0.1:5557",
    )
    cmd.add_argument(
        "--replay",
        metavar="ADDRESS",
        default=None,
        help="the server's --events-replay address: missed batches are fetched from it",
    )
    cmd.add_argument(
        "--from",
        dest="start",
        type=int,
        metavar="SEQ",
        default=None,
        help="first show the batches from sequence SEQ on (from --replay), then go on live",
    )
    cmd.add_argument(
        "--format",
        choices=("map", "array"),
        default=None,
        help="the server's --events-format (default: told by each event's shape)",
    )
    cmd.add_argument(
        "--json", action="store_true", help="one JSON object per event, every field decoded"
    )
    cmd.add_argument(
        "--count", type=int, metavar="N", default=None, help="stop after N events (exit 0)"
    )
    cmd.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        default=None,
        help="exit 1 when no batch arrives for SECONDS",
    )
    cmd.add_argument(
        "--pool",
        action="extend",
        nargs="+",
        metavar="POOL",
        default=None,
        help="show only these pools' events (s:RANK:NAMESPACE or v:RANK; may repeat); clears "
        "of every pool are always shown",
    )
    cmd.add_argument(
        "--tenant",
        action="extend",
        nargs="+",
        metavar="TENANT",
        default=None,
        help='show only these tenants\' events (may repeat; "" is the default tenant); '
        "clears of every pool are always shown",
    )
    cmd.set_defaults(func=_cmd_events)


def _cmd_check(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvmeta.store.disk.check import check_data_dir

    directory = Path(args.data_dir)
    report = check_data_dir(directory)
    for line in report.lines:
        print(line)
    for problem in report.problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    print(report.summary)
    if not args.repair:
        return report.exit_code
    from kvmeta.store.disk.repair import repair_data_dir

    print(f"repairing {directory}: keeping every pool, dropping every key")
    for line in repair_data_dir(directory).lines:
        print(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmeta",
        description="KV-cache page metadata service for SGLang HiCache and vLLM HF3FS.",
    )
    parser.add_argument("--version", action="version", version=f"kvmeta {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_bench(sub)
    serve = sub.add_parser(
        "serve",
        help="run the metadata server",
        description="Run the metadata server. Every flag can also be set by the environment "
        "variable shown in its help, or in a --config file; flags win over the environment, "
        "which wins over the file.",
    )
    add_config_argument(serve)
    add_arguments(serve)
    serve.set_defaults(func=_cmd_serve)
    _add_status(sub)
    _add_events(sub)
    check = sub.add_parser(
        "check",
        help="verify a data directory offline (exit 0 ok, 1 problems, 3 in use by a server)",
        description="Verify a data directory offline, changing nothing (exit 0 ok, 1 problems, "
        "3 no problem found but a server holds it). With --repair, then make it safe to "
        "start on: keep every pool, drop every key (exit 0 repaired, 2 could not).",
    )
    check.add_argument(
        "--data-dir", default="./kvmeta-data", help="directory to check (default %(default)s)"
    )
    check.add_argument(
        "--repair",
        action="store_true",
        help="after the check, keep every pool (rank, namespace, size, tenant) and drop every "
        "key, moving the journal and snapshots into DIR/retired-<time>/: the way to start "
        "again after damage, a restored backup or journal files moved by hand (an older "
        "state would serve pages rewritten since). Stop the server first",
    )
    check.set_defaults(func=_cmd_check)
    return parser


def _unrecognized(
    parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]
) -> None:
    """Report flags no parser took with the usage of the command they were given to (argparse
    would print the top-level usage) and the closest real flag."""
    command = getattr(args, "command", None)
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    target = parser
    if command and subparsers:
        target = subparsers[0].choices.get(command, parser)
    message = f"unrecognized arguments: {' '.join(extra)}"
    known = [s for a in target._actions for s in a.option_strings if s.startswith("--")]
    for word in extra:
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.6)
            if close:
                message += f" (did you mean {close[0]}?)"
                break
    target.error(message)


def _stdout_closed() -> bool:
    """True when stdout is a pipe nobody reads any more (poll reports an error on it): a
    BrokenPipeError from anything else, such as a socket, is a real failure."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or no real stdout
        return False


def _run(args: argparse.Namespace) -> int:
    """Run the command; a reader of its output that went away (``| head -1``) ends it quietly
    with exit 0, as a pager quitting is no error: stdout is pointed at /dev/null so that
    Python's own flush at exit does not fail on the closed pipe again."""
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, not at exit, where a closed pipe could no longer be caught
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unrecognized(parser, args, extra)
    try:
        return _run(args)
    except KvmetaError as exc:
        print(f"kvmeta: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
