"""Count what one chat request walks through: project files with a function called, and
project classes instantiated, between the HTTP handler and the response (local mode).

``python -m examples.benchmarks.request_walk --model ../shared/models/aidreams-260k``

A ``sys.setprofile`` / ``threading.setprofile`` hook records every Python call in the server's
event-loop thread and the engine's step thread while one non-streaming (or ``--stream``) chat
request runs, after one warm-up request (so first-use imports and caches are not counted).
A file counts when one of its functions is called; a class counts when an ``__init__`` (or
``__post_init__``) runs with ``self`` of that class, or a pydantic model of it is built. The
figures are the architecture page's "one chat request's walk" counts (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("sdk", "gateway", "engine", "kernels")


class Walk:
    """Files and classes of the project seen by the profile hook while ``active``."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.classes: set[str] = set()
        self.active = False
        self._lock = threading.Lock()

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.active:
            return
        code = frame.f_code
        rel = _project_file(code.co_filename)
        if rel is not None and rel != "examples/benchmarks/request_walk.py":
            with self._lock:
                self.files.add(rel)
        if code.co_name in ("__init__", "__post_init__") and code.co_varnames[:1] == ("self",):
            obj = frame.f_locals.get("self")
            cls = type(obj) if obj is not None else None
            if cls is not None and cls.__module__.startswith("prefixgate."):
                with self._lock:
                    self.classes.add(f"{cls.__module__}.{cls.__qualname__}")

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The hook on this thread and every thread started inside (server, step loop)."""
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)
        try:
            yield
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]


_FILES: dict[str, str | None] = {}


def _project_file(filename: str) -> str | None:
    hit = _FILES.get(filename, "")
    if hit != "":
        return hit
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
        out = str(rel) if rel.parts and rel.parts[0] in PARTS else None
    except ValueError:
        out = None
    _FILES[filename] = out
    return out


def measure(model: str, stream: bool) -> dict[str, Any]:
    """Run one warm-up and one measured chat request on a real gateway; the counts."""
    import httpx
    from prefixgate.engine import AsyncEngine, EngineConfig
    from prefixgate.gateway.app import create_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.local.serving import LOCAL
    from prefixgate.gateway.settings import GatewaySettings

    walk = Walk()
    body = {
        "model": Path(model).name,
        "messages": [{"role": "user", "content": "I sense the nodes"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }

    def make() -> Any:
        engine = AsyncEngine(EngineConfig(model=model, num_kv_blocks=64))
        # the dashboard's sampler only at start: its ticks are no part of a request's walk
        quiet = GatewaySettings(poll_s=0.02, dashboard_sample_s=3600.0, dashboard_window_s=3600.0)
        return create_app(engine, quiet)

    with walk.installed(), BackgroundServer(make) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            http.post("/v1/chat/completions", json=body).raise_for_status()  # warm-up
            walk.active = True
            try:
                http.post("/v1/chat/completions", json=body).raise_for_status()
            finally:
                walk.active = False
        srv.call(srv.app[LOCAL].engine.shutdown)
    return {
        "stream": stream,
        "files": sorted(walk.files),
        "num_files": len(walk.files),
        "classes": sorted(walk.classes),
        "num_classes": len(walk.classes),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a Hugging Face Llama-family folder")
    p.add_argument("--stream", action="store_true", help="measure a streaming request")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    args = p.parse_args(argv)
    out = measure(args.model, args.stream)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"files: {out['num_files']}  classes: {out['num_classes']}")
        for f in out["files"]:
            print("  file ", f)
        for c in out["classes"]:
            print("  class", c)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
