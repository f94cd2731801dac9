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
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

from prefixgate.gateway.proxy.config import ProxyConfig, load_config
from prefixgate.gateway.proxy.policies import check_settings
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.proxy.upstream import normalize_url
from prefixgate.gateway.serve.args import (
    add_serve_arguments,
    check_auto_tool_choice,
    check_no_engine_flags,
    check_parallel_sizes,
    in_flag_words,
    parse_bytes,
    positional_model,
)
from prefixgate.gateway.serve.configure import (
    default_model_name,
    engine_config,
    key_policy_warnings,
    key_weights,
    load_chat_template,
    objective_policy_warning,
    settings_from_args,
)
from prefixgate.gateway.serve.early_checks import (
    CannotListenError,
    check_before_imports,
    check_port_free,
)
from prefixgate.gateway.settings import GatewaySettings

__all__ = [
    "add_serve_parser",
    "default_model_name",
    "engine_config",
    "key_policy_warnings",
    "key_weights",
    "load_chat_template",
    "parse_bytes",
    "run",
    "serve",
    "settings_from_args",
]

logger = logging.getLogger("prefixgate.gateway")


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` command to ``subparsers``; its ``func`` returns the exit code."""
    p = subparsers.add_parser(
        "serve",
        help="serve the OpenAI API (local engine or upstreams)",
        # a short usage: a bad flag is its error line, not 30 lines of flags above it
        usage="prefixgate serve [MODEL] [options]  (every option: prefixgate serve --help)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``prefixgate serve``: returns 0 after a graceful stop, 1 when the model fails to load,
    2 on bad options."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        positional_model(args)  # `prefixgate serve PATH` = --model PATH, as vLLM's
        check_auto_tool_choice(args)  # vLLM's flag: only beside --tool-call-parser
        check_parallel_sizes(args)  # vLLM's flags: one device only
        key_specs = check_before_imports(args)  # keys file, model path: before torch
        settings = settings_from_args(args)
        check_settings(settings)  # each routing policy's options
        upstreams: list[str] | ProxyConfig = args.upstreams
        if args.config:
            if args.upstreams:
                raise ValueError("give --config or --upstream, not both")
            upstreams = load_config(args.config)
        config = None if upstreams else engine_config(args)
        chat_template = load_chat_template(args.chat_template) if args.chat_template else None
        if chat_template and upstreams:
            raise ValueError("--chat-template applies to a local model, not to --upstream")
        if upstreams:
            check_no_engine_flags(args)  # they would configure an engine that does not run
        if args.served_model_name and upstreams:
            raise ValueError(
                "--served-model-name names a local model; with --upstream or --config the "
                "upstreams' model ids are served (a --config renames them with its model "
                "names and aliases)"
            )
        if args.trust_pool_headers and upstreams:
            raise ValueError(
                "--trust-pool-headers applies to a local engine (an InferencePool's model "
                "server), not to --upstream or --config"
            )
        if args.stats_interval_s < 0:
            raise ValueError(f"--stats-interval-s must be >= 0, got {args.stats_interval_s}")
        # every flag's value is checked above (a bad one is exit 2 even when the port is
        # taken); the port next, still before the engine's imports
        for url in args.upstreams or ():
            normalize_url(url)  # a malformed --upstream is a bad option (exit 2)
        if args.model and (args.upstreams or args.config):
            raise ValueError(
                "--model serves a local model; with --upstream or --config the upstreams serve "
                "theirs: give one or the other"
            )
        for key in args.api_keys or ():
            if not key.strip():
                raise ValueError("--api-key: every API key must be a non-empty string")
        check_port_free(args.host, args.port)
        if config is not None:
            preflight(config)
        if config is not None:
            warning = objective_policy_warning(
                settings.objective_priority, config.scheduling_policy
            )
            if warning:
                logger.warning("%s", warning)
        if config is not None and key_specs is not None:
            weights = key_weights(key_specs, args.keys_file)
            config.tenant_weights = {**weights, **config.tenant_weights}
            for line in key_policy_warnings(key_specs, args.keys_file, config.scheduling_policy):
                logger.warning("%s", line)
    except CannotListenError as exc:  # as a bind that fails at the server's start: exit 1
        logger.error("%s", exc)
        return 1
    except (ValueError, TypeError) as exc:
        logger.error("bad option: %s", in_flag_words(str(exc)))  # names the flag, not the field
        return 2
    try:
        code = asyncio.run(
            serve(
                settings,
                config,
                upstreams,
                args.host,
                args.port,
                chat_template,
                access_log=args.access_log,
                stats_interval_s=args.stats_interval_s,
                key_specs=key_specs,
            )
        )
    except KeyboardInterrupt:
        code = 0
    if code == 0:  # a normal stop (SIGINT/SIGTERM): everything it owned is closed
        _exit_now(code)
    return code


def preflight(config: Any) -> None:
    """Check what needs the model's ``config.json`` — ``max_model_len`` within the model's
    limit, the checkpoint's dtype and architecture — before the port is bound, for a preset or
    a local folder (a hub id is checked when it is loaded, after its download). It also
    imports torch and the engine here, before the server answers anyone, not in the loading
    thread while ``/health`` waits for the interpreter lock.

    Raises:
        ValueError: what ``ModelConfig.from_engine_config`` refuses (one line), or
            ``--gpu-memory-utilization`` off CUDA.
    """
    import prefixgate.engine.async_engine  # noqa: F401 - the engine's imports, done now
    from prefixgate.engine.kv_cache import check_gpu_memory_utilization
    from prefixgate.engine.models.config import ModelConfig, resolve_device
    from prefixgate.engine.models.presets import PRESETS

    if config.gpu_memory_utilization is not None:
        check_gpu_memory_utilization(config.gpu_memory_utilization, resolve_device(config.device))
    model = config.model
    if model is not None and not os.path.isdir(os.path.expanduser(model)) and model not in PRESETS:
        return
    mc = ModelConfig.from_engine_config(config)
    if config.runner == "generate":
        # The model's skeleton on the meta device (no memory): its first build imports much
        # of torch (torch._dynamo: seconds), which in the loading thread held the
        # interpreter from the event loop (/health waited; docs/benchmarks/health-while-loading.md).
        import torch
        from prefixgate.engine.models.llama import CausalLM
        from prefixgate.kernels import default_backend, get_backend

        kernels = get_backend(config.attention_backend or default_backend(mc.device))
        with torch.device("meta"):
            CausalLM(mc, kernels)


def _exit_now(code: int) -> None:
    """End the process at once: every socket, request and the engine are closed by now, and
    the interpreter's own finalization (torch's teardown) can take seconds, past the
    ``--shutdown-grace-s`` + 1 s a stopping server promises."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def serve(
    settings: GatewaySettings,
    config: Any,
    upstreams: list[str] | ProxyConfig,
    host: str,
    port: int,
    chat_template: str | None = None,
    *,
    access_log: bool = False,
    stats_interval_s: float = 0.0,
    key_specs: list[Any] | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM. ``settings``: checked by the caller (``run``:
    ``policies.check_settings``, before its imports; the app does not check them again).
    ``config`` is an EngineConfig (local) or None (upstreams);
    ``chat_template`` (Jinja source) replaces the model's default chat template; ``access_log``
    logs a line per request; ``stats_interval_s`` > 0 logs the engine line that often;
    ``key_specs``: the keys file as ``run`` read it (``settings.keys_file`` is not read again)."""
    from prefixgate.gateway.app import attach_engine, create_app, create_proxy_app
    from prefixgate.gateway.http.connections import raise_nofile_limit
    from prefixgate.gateway.http.server import start_server
    from prefixgate.gateway.local.engine_log import log_engine_stats

    raise_nofile_limit()  # before any socket: a connection flood must not starve model loading

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        # the first SIGINT/SIGTERM drains; a second one (Ctrl-C again) exits at once
        if stop.is_set():
            logger.warning("second interrupt: exiting now, without draining")
            _exit_now(130)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):
            pass  # not the main thread / not supported: Ctrl-C raises KeyboardInterrupt
    try:
        # run() checked the routing policies' options before its imports: not again here
        if upstreams:
            app = create_proxy_app(upstreams, settings, settings_checked=True, key_specs=key_specs)
        else:
            app = create_app(None, settings, settings_checked=True, key_specs=key_specs)
    except ValueError as exc:
        logger.error("bad option: %s", in_flag_words(str(exc)))
        return 2
    try:
        server = await start_server(app, host, port, access_log=access_log)
    except OSError as exc:  # port in use, address not available, no permission
        flag = "--host" if isinstance(exc, socket.gaierror) else "--port"
        logger.error(
            "cannot listen on %s:%d: %s (choose another %s)", host, port, exc.strerror or exc, flag
        )
        return 1
    logger.info("prefixgate listening on %s (OpenAI API at %s/v1)", server.url, server.url)
    engine = None
    stats_task: asyncio.Task | None = None
    code = 0
    loader_done = threading.Event()  # the load thread waits for it (see _in_daemon_thread)
    try:
        if upstreams:
            router = app[PROXY].router
            logger.info("upstream mode: %s", ", ".join(u["url"] for u in router.describe()))
        else:
            engine, code = await _load_engine(config, stop, loader_done)
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
        try:
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
        finally:
            loader_done.set()  # the load thread may end now
    return code


async def _load_engine(
    config: Any, stop: asyncio.Event, loader_done: threading.Event
) -> tuple[Any, int]:
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

        load = _in_daemon_thread(PoolingEngine, config, hold=loader_done)
    else:
        load = _in_daemon_thread(AsyncEngine, config, hold=loader_done)
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


def _in_daemon_thread(fn: Any, *args: Any, hold: threading.Event | None = None) -> asyncio.Future:
    """``fn(*args)`` in a daemon thread, as a future of the running loop. Unlike
    ``asyncio.to_thread``, a stop during a long model load does not wait for the load to end
    (``asyncio.run`` joins its executor's threads), so SIGTERM exits on time.

    With ``hold``, the thread then waits for ``hold`` before it ends: the model load runs
    torch's first intra-op parallel regions, so that thread owns the OpenMP thread pool, and
    once it exits every later parallel region of the engine's thread ran many times slower,
    with RSS growing per request (docs/benchmarks/threads.md); parked, it costs nothing."""
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
        if hold is not None:
            hold.wait()

    threading.Thread(target=work, name="prefixgate-load", daemon=True).start()
    return fut
