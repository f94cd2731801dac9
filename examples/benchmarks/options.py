"""The options every in-process engine benchmark takes: ``--threads N`` (torch intra-op
threads) and ``--json OUT`` (``args.json_out``: where the results are written), the writing
of those results, and ``add_flags``: a benchmark's plain numeric knobs as one table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_common_options(ap: argparse.ArgumentParser, json_help: str | None = None) -> None:
    """Add ``--threads`` (default: torch's own) and ``--json`` (dest ``json_out``)."""
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--json", dest="json_out", default=None, help=json_help)


Flag = int | float | str


def add_flags(ap: argparse.ArgumentParser, **defaults: Flag | tuple[Flag, str]) -> None:
    """Add ``--name`` (underscores as dashes, dest ``name``) for each keyword, typed as its
    default (``int``, ``float`` or ``str``), in the order given; a ``(default, help)`` pair
    gives the flag its help text, to which ``(default: ...)`` is added."""
    for name, value in defaults.items():
        default, text = value if isinstance(value, tuple) else (value, None)
        ap.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            help=None if text is None else f"{text} (default: {default})",
        )


def parse_with_threads(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the command line, then set torch's intra-op threads when ``--threads`` was
    given (torch is imported here, so a benchmark loads it only when it runs)."""
    args = ap.parse_args()
    import torch  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def write_results(path: str | None, results: Any) -> None:
    """Write ``results`` to ``path`` (``--json``) as indented JSON (values JSON does not
    know as their ``str``); nothing when ``path`` is None."""
    if path:
        Path(path).write_text(json.dumps(results, indent=2, default=str))
