"""prefixgate serve: the gateway on a local engine, or a proxy to upstream servers.

    prefixgate serve [--model PATH | org/name] [--host 127.0.0.1] [--port 8000]
                     [--api-key KEY ...] [--keys-file FILE] [--upstream URL ...] [engine options]

Without --model the engine's built-in tiny-random preset is served (dummy random weights: its
text is gibberish by design). The HTTP server starts first (/health answers 200, /ready 503)
and the model loads in a worker thread (/ready then answers 200); SIGINT/SIGTERM stop it
gracefully: requests in flight get --shutdown-grace-s seconds, then every stream still running
ends with an error event and every other request with a 503 error object; registered prefixes
are released, the engine is shut down. The soft open-file limit is raised to the hard limit at
start. Sizes in bytes accept 268435456, 256MiB or 1.5GB.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import signal
import sys
import threading
import types
import typing
from typing import Any

from prefixgate.gateway.routing import POLICIES
from prefixgate.gateway.serve_help import ENGINE_HELP, GATEWAY_HELP
from prefixgate.gateway.state import STATE, GatewaySettings
from prefixgate.gateway.tool_parsers import PARSERS
from prefixgate.gateway.upstream import CACHE_SALT_MODES

logger = logging.getLogger("prefixgate.gateway")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")  # org/name
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "ki": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "mi": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "gi": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
    "ti": 2**40,
}

# Flags whose generic name would be awkward; value: (flag, argparse kwargs).
_SPECIAL = {"model", "enable_prefix_caching", "hf_overrides", "kv_cache_memory", "tenant_weights"}


def parse_bytes(text: str) -> int:
    """``"268435456"``, ``"256MiB"``, ``"1.5GB"`` → bytes (int).

    Raises:
        argparse.ArgumentTypeError: on anything else.
    """
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 268435456, 256MiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def _shown(value: Any) -> str:
    """A default as the help shows it: sizes in MiB, ``None`` as "unset"."""
    if value is None:
        return "unset"
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= 2**20
        and value % 2**20 == 0
    ):
        return f"{value // 2**20}MiB"
    return str(value)


def _with_default(text: str, default: Any) -> str:
    return text if "(default:" in text else f"{text} (default: {_shown(default)})"


def load_chat_template(value: str) -> str:
    """The template source of ``--chat-template``: a file's text when ``value`` names a file,
    else ``value`` itself when it holds Jinja markup.

    Raises:
        ValueError: neither a file nor a template (e.g. a mistyped path), or bad Jinja syntax.
    """
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            source = f.read()
    elif "{{" in value or "{%" in value:
        source = value
    else:
        raise ValueError(f"--chat-template: no such file {value!r}, and not a Jinja template")
    import jinja2

    try:
        jinja2.Environment().parse(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: bad Jinja syntax: {exc}") from None
    return source


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _engine_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per EngineConfig field, typed from its annotation."""
    from prefixgate.engine.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SPECIAL:
            continue
        hint = hints[f.name]
        base = hint
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None → X
            base = next(a for a in typing.get_args(hint) if a is not type(None))
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        if typing.get_origin(base) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(base))
        elif base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif base in (int, float):
            kwargs["type"] = base
        else:
            kwargs["type"] = str
        default = f.default if f.default is not dataclasses.MISSING else None
        # a field without an entry gets its bare name (test_serve_help fails on it)
        kwargs["help"] = _with_default(ENGINE_HELP.get(f.name, f.name), default)
        group.add_argument("--" + f.name.replace("_", "-"), **kwargs)
    group.add_argument(
        "--kv-cache-memory",
        dest="kv_cache_memory",
        type=parse_bytes,
        default=argparse.SUPPRESS,
        help="KV cache size in bytes, K and V of all layers (268435456, 256MiB, 2GiB; >= 1) "
        "(default: 256MiB on CPU; what --num-kv-blocks needs when that is given)",
    )
    group.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=argparse.SUPPRESS,
        help="turn the prefix cache off (default: on: requests sharing a prompt prefix reuse "
        "its KV blocks)",
    )
    group.add_argument(
        "--hf-overrides",
        dest="hf_overrides",
        type=_json_object,
        default=argparse.SUPPRESS,
        help="keys of the model's config.json to override, as a JSON object, e.g. "
        "'{\"num_hidden_layers\": 2}' (default: none)",
    )
    group.add_argument(
        "--tenant-weights",
        dest="tenant_weights",
        type=_json_object,
        default=argparse.SUPPRESS,
        help="fair-share weight per tenant as JSON (scheduling policy 'fair'), e.g. "
        "'{\"team-a\": 2}'; keys-file 'weight' fields add to it (default: every tenant 1)",
    )


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` command to ``subparsers``; its ``func`` returns the exit code."""
    p = subparsers.add_parser(
        "serve",
        help="serve the OpenAI API (local engine or upstreams)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="the model: a Hugging Face model folder, or a hub id org/name fetched with "
        "huggingface_hub into its cache (HF_HOME / HF_HUB_CACHE; HF_HUB_OFFLINE=1: the cache "
        "only; HF_TOKEN for gated models) (default: the built-in tiny-random preset)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; 0.0.0.0 for every interface (default: 127.0.0.1)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=8000,
        help="TCP port, 0 to 65535; 0 = any free port, logged at start (default: 8000)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id the API serves and requests must name; any other gets 404 "
        "model_not_found (default: the hub id, or the model folder's name)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template for chat requests, as a file path or the template itself "
        "(default: the model's own, from tokenizer_config.json or chat_template.jinja)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        dest="api_keys",
        help="an API key clients must send as a Bearer token, without limits (repeatable) "
        "(default: none; with no --keys-file either, the server is open)",
    )
    p.add_argument(
        "--keys-file",
        default=None,
        help="JSON or TOML file of API keys with per-key names, limits and cache salts "
        "(default: none)",
    )
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        dest="upstreams",
        help="base URL of an OpenAI-compatible server to proxy to instead of a local engine "
        "(repeatable: requests are routed by prompt-prefix affinity) (default: none)",
    )
    p.add_argument(
        "--upstream-api-key",
        default=None,
        help="Bearer key sent to the upstreams (default: none; without keys of its own the "
        "gateway passes the client's key through)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(PARSERS),
        help="parse tool calls of tool_choice='auto' answers in this format (default: none, "
        "'auto' is refused; 'required' and named functions always work)",
    )
    p.add_argument(
        "--upstream-cache-salt",
        choices=CACHE_SALT_MODES,
        default="auto",
        help="whether the upstreams take cache_salt, which keeps tenants' prefix caches apart "
        "(auto: asked from GET /v1/models, prefixgate and vLLM do; an upstream without it is "
        "named in the log and /ready) (default: auto)",
    )
    p.add_argument(
        "--routing",
        default="cache_aware",
        choices=POLICIES,
        help="how --upstream requests pick an upstream: cache_aware (the longest prompt-prefix "
        "match of what each upstream was sent, unless it has more than "
        "--balance-abs-threshold requests in flight beyond the least loaded), rendezvous "
        "(hash of the system prompt), round_robin, least_loaded (default: cache_aware)",
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="redis://host:port/db shared by gateway replicas: per-key limits, concurrency "
        "slots (leases), registered prefixes and usage counters are kept there; when it is "
        "unreachable each replica serves on its own limits (default: none, in-process state)",
    )
    g = p.add_argument_group("gateway limits")
    defaults = GatewaySettings()
    for name, kind in (
        ("max_body_bytes", parse_bytes),
        ("max_queued_requests", int),
        ("max_queued_tokens", int),
        ("max_running", int),
        ("keepalive_s", float),
        ("max_prefix_ttl_s", float),
        ("key_max_prefixes", int),
        ("key_max_pinned_fraction", float),
        ("upstream_timeout_s", float),
        ("health_interval_s", float),
        ("header_timeout_s", float),
        ("body_timeout_s", float),
        ("max_connections", int),
        ("shutdown_grace_s", float),
        ("redis_lease_ttl_s", float),
        ("balance_abs_threshold", int),
        ("balance_rel_threshold", float),
    ):
        g.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=getattr(defaults, name),
            help=_with_default(GATEWAY_HELP.get(name, name), getattr(defaults, name)),
        )
    p.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        help="no per-request log line (default: one INFO line per request: client, route, "
        "status, key name, prompt/completion/cached tokens, seconds)",
    )
    p.add_argument(
        "--stats-interval-s",
        type=float,
        default=10.0,
        help="seconds between engine lines (prompt and generation tokens/s, running, waiting, "
        "KV cache use, prefix hit rate), printed only after activity; 0 = never (default: 10.0)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="least severe log level printed (default: INFO)",
    )
    _engine_flags(p.add_argument_group("engine options"))
    p.set_defaults(func=run)
    return p


def engine_config(args: argparse.Namespace) -> Any:
    """The EngineConfig from the parsed flags (fields not given keep their defaults).

    Raises:
        ValueError: on a value EngineConfig refuses.
    """
    from prefixgate.engine.config import EngineConfig

    names = {f.name for f in dataclasses.fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["model"] = args.model
    return EngineConfig(**values)


def default_model_name(model: str | None) -> str:
    """The served id of ``--model``: a hub id as given (``org/name``, as vLLM), a folder's
    name, or ``"tiny-random"``."""
    if not model:
        return "tiny-random"
    if not os.path.exists(os.path.expanduser(model)) and _HUB_ID.match(model):
        return model
    return os.path.basename(os.path.normpath(model))


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    """GatewaySettings from the parsed flags."""
    name = args.served_model_name
    if name is None and not args.upstreams:
        name = default_model_name(args.model)
    return GatewaySettings(
        model_name=name,
        api_keys=list(args.api_keys),
        keys_file=args.keys_file,
        upstream_api_key=args.upstream_api_key,
        upstream_cache_salt=args.upstream_cache_salt,
        max_body_bytes=args.max_body_bytes,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        max_running=args.max_running,
        keepalive_s=args.keepalive_s,
        max_prefix_ttl_s=args.max_prefix_ttl_s,
        key_max_prefixes=args.key_max_prefixes,
        key_max_pinned_fraction=args.key_max_pinned_fraction,
        upstream_timeout_s=args.upstream_timeout_s,
        health_interval_s=args.health_interval_s,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        max_connections=args.max_connections,
        shutdown_grace_s=args.shutdown_grace_s,
        tool_call_parser=args.tool_call_parser,
        routing=args.routing,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        redis_url=args.redis_url,
        redis_lease_ttl_s=args.redis_lease_ttl_s,
    )


def key_weights(keys_file: str) -> dict[str, float]:
    """Tenant weights of the keys file (key name → ``weight``) for the fair scheduler; keys of
    one name must agree on their weight.

    Raises:
        ValueError: an unreadable keys file, or one name with two weights.
    """
    from prefixgate.gateway.auth import load_keys_file

    weights: dict[str, float] = {}
    for spec in load_keys_file(keys_file):
        if weights.setdefault(spec.name, spec.weight) != spec.weight:
            raise ValueError(f"keys file {keys_file}: key name {spec.name} has two weights")
    return weights


def key_policy_warnings(keys_file: str, policy: str) -> list[str]:
    """What the keys file asks that the engine's ``scheduling_policy`` will not do: a key's
    ``priority`` acts only under ``priority``, its ``weight`` only under ``fair`` (logged at
    start-up so the setting is not a silent no-op).

    Raises:
        ValueError: an unreadable keys file.
    """
    from prefixgate.gateway.auth import load_keys_file

    specs = load_keys_file(keys_file)
    out = []
    prio = sorted({s.name or "unnamed" for s in specs if s.priority != 0})
    if prio and policy != "priority":
        out.append(
            f"keys file {keys_file}: 'priority' of {', '.join(prio)} has no effect under "
            f"--scheduling-policy {policy} (it orders requests under 'priority')"
        )
    weighted = sorted({s.name or "unnamed" for s in specs if s.weight != 1.0})
    if weighted and policy != "fair":
        out.append(
            f"keys file {keys_file}: 'weight' of {', '.join(weighted)} shares the admission "
            f"queue but not the engine under --scheduling-policy {policy} (engine fair share "
            "needs 'fair')"
        )
    return out


def run(args: argparse.Namespace) -> int:
    """``prefixgate serve``: returns 0 after a graceful stop, 1 when the model fails to load,
    2 on bad options."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = settings_from_args(args)
        config = None if args.upstreams else engine_config(args)
        chat_template = load_chat_template(args.chat_template) if args.chat_template else None
        if chat_template and args.upstreams:
            raise ValueError("--chat-template applies to a local model, not to --upstream")
        if args.stats_interval_s < 0:
            raise ValueError(f"--stats-interval-s must be >= 0, got {args.stats_interval_s}")
        if config is not None and args.keys_file:
            config.tenant_weights = {**key_weights(args.keys_file), **config.tenant_weights}
            for line in key_policy_warnings(args.keys_file, config.scheduling_policy):
                logger.warning("%s", line)
    except (ValueError, TypeError) as exc:
        logger.error("bad option: %s", exc)
        return 2
    try:
        code = asyncio.run(
            serve(
                settings,
                config,
                args.upstreams,
                args.host,
                args.port,
                chat_template,
                access_log=args.access_log,
                stats_interval_s=args.stats_interval_s,
            )
        )
    except KeyboardInterrupt:
        code = 0
    if code == 0:  # a normal stop (SIGINT/SIGTERM): everything it owned is closed
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process at once: every socket, request and the engine are closed by now, and
    the interpreter's own finalization (torch's teardown) took 4 s on a loaded 2-core machine,
    past the ``--shutdown-grace-s`` + 1 s a stopping server promises."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def serve(
    settings: GatewaySettings,
    config: Any,
    upstreams: list[str],
    host: str,
    port: int,
    chat_template: str | None = None,
    *,
    access_log: bool = False,
    stats_interval_s: float = 0.0,
) -> int:
    """Serve until SIGINT/SIGTERM. ``config`` is an EngineConfig (local) or None (upstreams);
    ``chat_template`` (Jinja source) replaces the model's default chat template; ``access_log``
    logs a line per request; ``stats_interval_s`` > 0 logs the engine line that often."""
    from prefixgate.gateway.app import attach_engine, create_app, create_proxy_app
    from prefixgate.gateway.engine_log import log_engine_stats
    from prefixgate.gateway.protocol import raise_nofile_limit
    from prefixgate.gateway.server import start_server

    raise_nofile_limit()  # before any socket: a connection flood must not starve model loading

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass  # not the main thread / not supported: Ctrl-C raises KeyboardInterrupt
    try:
        app = create_proxy_app(upstreams, settings) if upstreams else create_app(None, settings)
    except ValueError as exc:
        logger.error("bad option: %s", exc)
        return 2
    try:
        server = await start_server(app, host, port, access_log=access_log)
    except OSError as exc:  # port in use, address not available, no permission
        logger.error(
            "cannot listen on %s:%d: %s (choose another --port)", host, port, exc.strerror or exc
        )
        return 1
    logger.info("prefixgate listening on %s (OpenAI API at %s/v1)", server.url, server.url)
    engine = None
    stats_task: asyncio.Task | None = None
    code = 0
    try:
        if upstreams:
            router = app[STATE].router
            assert router is not None  # create_proxy_app sets it
            logger.info("upstream mode: %s", ", ".join(u["url"] for u in router.describe()))
        else:
            engine, code = await _load_engine(config, stop)
            if engine is not None:
                if chat_template:
                    engine.tokenizer.chat_templates["default"] = chat_template
                attach_engine(app, engine)
                if stats_interval_s > 0:
                    stats_task = asyncio.create_task(
                        log_engine_stats(engine.stats, stats_interval_s)
                    )
                logger.info(
                    "model %r ready (max_model_len %d)", settings.model_name, engine.max_model_len
                )
        if code == 0:
            await stop.wait()
            logger.info("shutting down")
    finally:
        if stats_task is not None:
            stats_task.cancel()
        summary = await server.drain(settings.shutdown_grace_s)
        logger.info(
            "stopped: %d request(s) finished in the grace period, %d ended with an error (%.2f s)",
            summary["finished"],
            summary["ended"],
            summary["seconds"],
        )
        if engine is not None:
            await engine.shutdown()
            logger.info("engine stopped")
    return code


async def _load_engine(config: Any, stop: asyncio.Event) -> tuple[Any, int]:
    from prefixgate.engine import AsyncEngine

    if config.model is None:
        logger.info(
            "no --model given: serving the built-in 'tiny-random' preset "
            "(dummy random weights, byte tokenizer; its text is gibberish by design)"
        )
    else:
        logger.info("loading %s (load_format=%s)", config.model, config.load_format)
    if config.runner == "pooling":
        from prefixgate.engine.pooling import PoolingEngine

        load = _in_daemon_thread(PoolingEngine, config)
    else:
        load = _in_daemon_thread(AsyncEngine, config)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({load, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not load.done():
        logger.info("stopped while loading the model")
        load.add_done_callback(lambda f: f.cancelled() or f.exception())
        return None, 0
    try:
        return load.result(), 0
    except Exception as exc:  # noqa: BLE001 - reported plainly, exit code 1
        logger.error("cannot load the model: %s: %s", type(exc).__name__, exc)
        return None, 1


def _in_daemon_thread(fn: Any, *args: Any) -> asyncio.Future:
    """``fn(*args)`` in a daemon thread, as a future of the running loop. Unlike
    ``asyncio.to_thread``, a stop during a long model load does not wait for the load to end
    (``asyncio.run`` joins its executor's threads), so SIGTERM exits on time."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def work() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the loop
            result, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:
            pass  # the loop has closed: nobody waits any more

    threading.Thread(target=work, name="prefixgate-load", daemon=True).start()
    return fut
