"""``prefixgate`` command line: ``prefixgate serve ...`` and ``prefixgate bench ...``."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per command."""
    parser = argparse.ArgumentParser(prog="prefixgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    try:
        from prefixgate.gateway.serve_cli import add_serve_parser
    except ImportError as exc:  # the SDK-only install: `pip install prefixgate`
        raise SystemExit(
            f"prefixgate: the server and benchmarks need the engine extra ({exc.name} is missing):"
            " pip install 'prefixgate[engine]'"
        ) from None

    add_serve_parser(sub)
    from prefixgate.gateway.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``prefixgate`` script; returns the process exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
