"""``prefixgate`` command line: ``prefixgate serve ...``, ``prefixgate bench ...`` and
``prefixgate sim ...`` (the fleet simulator, ``gateway/sim/``).

Also ``python -m prefixgate.gateway.cli``. It lives in the gateway because its imports point
down: ``serve`` is the gateway's, ``bench`` the SDK's (the gateway may import the SDK; the SDK
imports nothing of the project). This module imports neither at load time, only the one
command that runs: ``prefixgate bench serve`` needs only the SDK (no aiohttp, no torch; the
``prefixgate.gateway`` package's ``__init__`` imports nothing), while ``prefixgate serve`` needs
the ``engine`` extra (aiohttp; torch for a local model), or ``proxy`` for ``--upstream``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Any

SERVE_HELP = "serve the OpenAI API (local engine or upstreams)"
BENCH_HELP = "benchmark a server, or compare prefixgate with baselines"
SIM_HELP = "simulate a fleet of gateways and replicas on a virtual clock"


def version() -> str:
    """The installed distribution's version (``"unknown"`` when run from an uninstalled tree)."""
    try:
        return metadata.version("prefixgate")
    except metadata.PackageNotFoundError:
        return "unknown"


def _serve_parser() -> Callable[[Any], object]:
    from prefixgate.gateway.serve.runner import add_serve_parser

    return add_serve_parser


def _bench_parser() -> Callable[[Any], object]:
    from prefixgate.sdk.bench.commands import add_bench_parser

    return add_bench_parser


def _sim_parser() -> Callable[[Any], object]:
    from prefixgate.gateway.sim.cli import add_sim_parser

    return add_sim_parser


# command: (help, its sub-parser's builder (imported only when the command runs), what needs
# the engine extra (None: the SDK-only install has it), what else does instead)
_COMMANDS: dict[str, tuple[str, Callable[[], Callable[[Any], object]], str | None, str]] = {
    "serve": (SERVE_HELP, _serve_parser, "the server", " (or '.[proxy]' for --upstream only)"),
    "bench": (BENCH_HELP, _bench_parser, None, ""),
    "sim": (SIM_HELP, _sim_parser, "the simulator", ""),
}


class CommandParser(argparse.ArgumentParser):
    """A parser that refuses the arguments it does not know itself, in its own usage.

    argparse's sub-parsers hand what they do not know back to the parser above them, so
    ``prefixgate serve --unknown-flag`` was told in the top-level usage; with this class (the
    top-level parser's, which ``add_subparsers`` gives every sub-parser below it) the
    sub-command's own parser says it: ``usage: prefixgate serve ...``, exit code 2.
    """

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only ``command``'s sub-parser is built in full (the rest are stubs).

    Raises SystemExit with a one-line reason when ``serve`` or ``sim`` is asked for without the
    engine extra.
    """
    parser = CommandParser(
        prog="prefixgate",
        description="prefixgate: serve the OpenAI API (prefixgate serve) or benchmark a server (prefixgate bench).",
    )
    parser.add_argument("--version", action="version", version=f"prefixgate {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,bench,sim}")
    for name, (help_text, builder, needs_engine, instead) in _COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        try:
            add_parser = builder()
        except ImportError as exc:  # the SDK-only install: `pip install -e .`
            if needs_engine is None:
                raise
            raise SystemExit(
                f"prefixgate {name}: {needs_engine} needs the engine extra ({exc.name} is missing):"
                f" pip install -e '.[engine]'{instead}"
            ) from None
        add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``prefixgate`` script; returns the process exit code.

    Ctrl-C before a command has its own handling (``serve``'s drain starts with its server:
    until then it is importing torch and the engine, reading the model's config) ends with
    one line and exit code 130, not a ``KeyboardInterrupt`` traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command == "serve":  # before torch loads (OpenMP reads it once): engine/threads.py
        try:
            from prefixgate.engine.threads import bounded_wait_env
        except ImportError:  # no engine: the parser below says which extra to install
            pass
        else:
            bounded_wait_env()
    try:
        args = build_parser(command).parse_args(argv)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("prefixgate: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
