"""Checks of ``prefixgate serve``'s values that need no engine: run before torch is imported.

A port already in use, a keys file that cannot be read or a model folder that does not exist
is told in one line before the engine's imports (torch's is the slow part of a start). This
module and what it imports stay torch-free; ``tests/gateway/test_serve_early_checks.py`` holds
that.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "CannotListenError",
    "check_before_imports",
    "check_keys_file",
    "check_model_path",
    "check_port_free",
    "engine_requirements",
    "extra_requirements",
]


class CannotListenError(Exception):
    """The server could not bind its ``--host`` / ``--port`` (exit code 1, as a bind that fails
    later, at the server's start)."""


def check_port_free(host: str, port: int) -> None:
    """Refuse a ``host:port`` the server could not bind (port 0, any free port, checks the
    host alone).

    Binds and closes a socket with ``SO_REUSEADDR``, as the server's own listener does, so a
    port left in TIME_WAIT by a stopped server passes and one another process listens on fails.

    Raises:
        CannotListenError: the port is in use or not permitted, or ``host`` is not an address
            of this machine (one line naming the address and the flag to change).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CannotListenError(
            f"cannot listen on {host}:{port}: {exc.strerror} (choose another --host)"
        ) from None
    except UnicodeError:  # a name idna cannot encode: an empty or over-long label (foo..bar)
        raise CannotListenError(
            f"cannot listen on {host[:80]}:{port}: not a host name (choose another --host)"
        ) from None
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            if sys.platform != "win32":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
        except OSError as exc:
            hint = {
                errno.EADDRINUSE: "another server listens there: stop it, or choose another "
                "--port (0 = any free port)",
                errno.EACCES: "ports below 1024 need privileges: choose another --port",
                errno.EADDRNOTAVAIL: "not an address of this machine: choose another --host "
                "(127.0.0.1 for local clients, 0.0.0.0 for every interface)",
            }.get(exc.errno or 0, "choose another --port")
            raise CannotListenError(
                f"cannot listen on {host}:{port}: {exc.strerror} ({hint})"
            ) from None
        finally:
            sock.close()


def check_keys_file(path: str) -> list[Any]:
    """Read and validate the keys file as the server will (``tenancy/keys.load_keys_file``):
    its ``KeySpec`` list, which the server is then built with (the file is read once).

    Raises:
        ValueError: unreadable file, bad syntax, or an entry with unknown or invalid fields.
    """
    from prefixgate.gateway.tenancy.keys import load_keys_file

    return load_keys_file(path)


def check_model_path(model: str | None) -> None:
    """Refuse a ``--model`` that is neither a folder, a built-in preset nor a hub id ``org/name``.

    A hub id is fetched later, when the model loads (the network is not asked here).

    Raises:
        ValueError: the path does not exist, or is a file rather than a model folder.
    """
    if model is None:
        return
    from prefixgate.engine.models.hub import is_hub_id
    from prefixgate.engine.models.presets import PRESETS

    path = os.path.expanduser(model)
    if os.path.isdir(path) or model in PRESETS:
        return
    if os.path.exists(path):
        raise ValueError(f"--model {model}: a file, not a model folder (its config.json's folder)")
    if not is_hub_id(model):
        raise ValueError(
            f"--model {model}: no such folder (nor is it a Hugging Face hub id org/name, "
            f"or a preset: {', '.join(PRESETS)})"
        )


ENGINE_EXTRA = "engine"
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?([^;]*)(?:;(.*))?$")
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def extra_requirements(requires: list[str], extra: str, project: str = "prefixgate") -> list[str]:
    """The distribution names an ``extra`` of ``project`` brings, read from its core metadata's
    ``Requires-Dist`` lines (``requires``: ``importlib.metadata.requires``), the project's own
    extras it names (``prefixgate[proxy]``) expanded; in the order first met, each once.

    A line's marker is read for its ``extra == "NAME"`` only (the project's extras carry no
    other marker).
    """
    by_extra: dict[str, list[tuple[str, list[str]]]] = {}
    for line in requires:
        found = _REQUIREMENT.match(line)
        if found is None:
            continue
        name, extras, _, marker = found.groups()
        on = _EXTRA_MARKER.search(marker or "")
        wanted = [e.strip() for e in (extras or "").split(",") if e.strip()]
        by_extra.setdefault(on.group(1) if on else "", []).append((name, wanted))
    out: dict[str, None] = {}
    seen: set[str] = set()

    def add(which: str) -> None:
        if which in seen:
            return
        seen.add(which)
        for name, wanted in by_extra.get(which, []):
            if _normalized(name) == _normalized(project):
                for inner in wanted:
                    add(inner)
            else:
                out.setdefault(name)

    add(extra)
    return list(out)


def _normalized(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def engine_requirements() -> list[str]:
    """The distributions of the ``[engine]`` extra (the local engine's packages): read from
    the installed ``prefixgate``'s metadata, else (a checkout run without installing) from the
    checkout's ``pyproject.toml``; empty when neither is found (the engine's imports then say
    what is missing)."""
    try:
        requires = metadata.requires("prefixgate") or []
    except metadata.PackageNotFoundError:
        requires = _checkout_requires()
    return extra_requirements(requires, ENGINE_EXTRA)


def _checkout_requires() -> list[str]:
    """``Requires-Dist`` lines of the checkout's ``pyproject.toml`` optional dependencies
    (``[]`` without one)."""
    import tomllib

    path = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        project = tomllib.loads(path.read_text(encoding="utf-8")).get("project", {})
    except (OSError, ValueError):
        return []
    extras = project.get("optional-dependencies", {})
    return [f'{req}; extra == "{name}"' for name, reqs in extras.items() for req in reqs]


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def check_engine_installed() -> None:
    """Local mode's packages are installed (a proxy-only install has none of them): every
    distribution of the ``[engine]`` extra (``engine_requirements``).

    Raises:
        ValueError: one line naming the missing distributions and the extra that brings them.
    """
    missing = [name for name in engine_requirements() if not _installed(name)]
    if missing:
        raise ValueError(
            f"serving a local model needs the engine's packages ({', '.join(missing)} not "
            "installed): pip install -e '.[engine]' from the checkout, or serve in front of "
            "other servers with --upstream URL"
        )


def check_before_imports(args: Any) -> list[Any] | None:
    """The keys file and the model path of the parsed ``serve`` flags; the first failure is
    raised. The port is checked by the caller once every flag's value is (``check_port_free``).

    Returns:
        The keys file's ``KeySpec`` list (``check_keys_file``), None without ``--keys-file``.

    Raises:
        ValueError: one line naming the flag and what is wrong with its value.
    """
    specs = check_keys_file(args.keys_file) if args.keys_file else None
    if not args.upstreams and not args.config:
        check_model_path(args.model)
        check_engine_installed()
    return specs
