"""The flags of ``prefixgate serve``: one argparse flag per gateway option and per
``EngineConfig`` field (typed from its annotation), with the help text of ``serve_help.py`` and
each default appended; byte sizes parse with ``parse_bytes``. Turning the parsed flags into
settings is ``serve_config.py``; running the server is ``serve_cli.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import types
import typing
from typing import Any

from prefixgate.gateway.proxy.policies import POLICIES
from prefixgate.gateway.serve.help_text import ENGINE_HELP, GATEWAY_HELP
from prefixgate.gateway.settings import CACHE_SALT_MODES, GatewaySettings
from prefixgate.gateway.wire.tool_parsers import PARSERS

__all__ = [
    "add_serve_arguments",
    "check_parallel_sizes",
    "in_flag_words",
    "parse_bytes",
    "positional_model",
]

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
# More spellings of an engine flag: vLLM's names where they differ from the field's.
_ALIASES = {
    "speculative_method": ("--speculative",),
    "prompt_lookup_min": ("--ngram-prompt-lookup-min",),
    "prompt_lookup_max": ("--ngram-prompt-lookup-max",),
}


def parse_bytes(text: str) -> int:
    """``"268435456"``, ``"256MiB"``, ``"1.5GB"`` → bytes (int).

    Raises:
        argparse.ArgumentTypeError: on anything else.
    """
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 268435456, 256MiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def port_number(text: str) -> int:
    """A TCP port, ``"0"`` to ``"65535"`` → int.

    Raises:
        argparse.ArgumentTypeError: on anything else (argparse prints it as one line).
    """
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a TCP port: give an integer from 0 to 65535 (0 = any free port)"
        )
    return port


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
        elif f.name == "dtype":
            from prefixgate.engine.config import DTYPES

            kwargs["choices"] = list(DTYPES)
        elif base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif base in (int, float):
            kwargs["type"] = base
        else:
            kwargs["type"] = str
        default = f.default if f.default is not dataclasses.MISSING else None
        # a field without an entry gets its bare name (test_serve_help fails on it)
        kwargs["help"] = _with_default(ENGINE_HELP.get(f.name, f.name), default)
        group.add_argument("--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, ()), **kwargs)
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
        help="turn the prefix cache off: the same as --no-enable-prefix-caching (default: on)",
    )
    group.add_argument(
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=argparse.SUPPRESS,
        help="vLLM's: whether requests sharing a prompt prefix reuse its KV blocks; "
        "--no-enable-prefix-caching turns the prefix cache off (default: on)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        dest="tensor_parallel_size",
        type=int,
        default=1,
        help="vLLM's: GPUs one model is split over; prefixgate runs a model on one device, so "
        "only 1 is taken (more: run replicas behind --upstream) (default: 1)",
    )
    group.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        dest="pipeline_parallel_size",
        type=int,
        default=1,
        help="vLLM's: pipeline stages of one model; only 1 is taken, as "
        "--tensor-parallel-size (default: 1)",
    )
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="vLLM's permission to run a hub model's own Python code; taken so vLLM's command "
        "lines run, and it permits nothing: prefixgate never runs a model's code, it runs "
        "the architectures it implements (a model of another architecture is refused either "
        "way) (default: off)",
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


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Add every ``serve`` flag to ``p`` (gateway, limits, logging, then engine options), and
    the optional positional ``MODEL`` (``vllm serve MODEL``'s; ``positional_model``)."""
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as in vLLM's 'vllm serve MODEL': the same as --model MODEL (default: --model's)",
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
        type=port_number,
        default=8000,
        help="TCP port, 0 to 65535; 0 = any free port, logged at start (default: 8000)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model ids the API serves, one or more as vLLM's: each is listed in "
        "/v1/models and accepted in requests, answers name the first; any other gets 404 "
        "model_not_found; local engine only (default: the hub id, or the model folder's name)",
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
        "--config",
        default=None,
        metavar="FILE",
        help="proxy to the model list of this TOML or YAML file instead: models, each with "
        "deployments (URL, credential from an env var or a file, weight, max in flight, "
        "TLS), aliases and fallbacks; checked at start-up (docs/proxy.md) "
        "(default: none)",
    )
    p.add_argument(
        "--upstream-api-key",
        default=None,
        help="Bearer key sent to the upstreams (default: $PREFIXGATE_UPSTREAM_API_KEY, else "
        "none; without keys of its own the gateway passes the client's key through). A "
        "command line is visible to every local user (ps): prefer --upstream-api-key-file "
        "or the environment variable",
    )
    p.add_argument(
        "--upstream-api-key-file",
        default=None,
        metavar="PATH",
        help="read the upstreams' Bearer key from this file (its content, surrounding "
        "whitespace stripped; not with --upstream-api-key) (default: none)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(PARSERS),
        help="parse tool calls of tool_choice='auto' answers in this format (default: none, "
        "'auto' is refused; 'required' and named functions always work)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's flag, taken so vLLM's command lines run: tool_choice='auto' is served "
        "whenever --tool-call-parser is set; given without --tool-call-parser it is refused, "
        "as vLLM refuses it (default: off)",
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
        "(hash of the system prompt), round_robin, least_loaded, precise (the blocks each "
        "upstream's engine holds, from its KV events, against its load; needs --tokenizer, "
        "feeds from --upstream-kv-events) (default: cache_aware)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="--routing precise: the upstreams' model folder, whose tokenizer and chat "
        "template the gateway tokenizes requests with, as the upstreams do (default: none)",
    )
    p.add_argument(
        "--upstream-kv-events",
        action="append",
        default=[],
        metavar="URL=PUB[,REPLAY]",
        help="--routing precise: the KV event endpoints of upstream URL's engine (its "
        "--kv-events, e.g. http://e0:8000=tcp://e0:5557; REPLAY defaults to the next port, "
        "'-' for none) (repeatable; an upstream without one makes routing fall back to "
        "cache_aware) (default: none)",
    )
    p.add_argument(
        "--trust-pool-headers",
        action="store_true",
        default=False,
        help="local engine only: read the Gateway API Inference Extension's headers "
        "x-gateway-inference-fairness-id (the request's tenant for fair scheduling) and "
        "x-gateway-inference-objective (its priority, by --objective-priority); only behind "
        "an inference gateway that sets them, since a client could set them too (default: "
        "off, the headers are ignored)",
    )
    p.add_argument(
        "--objective-priority",
        action="append",
        default=[],
        metavar="NAME=INT",
        help="with --trust-pool-headers: the engine priority (lower first, --scheduling-policy "
        "priority) of requests whose x-gateway-inference-objective is NAME (repeatable; an "
        "objective not given here gets the key's default priority) (default: none)",
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
        ("max_request_tools", int),
        ("max_request_values", int),
        ("max_queued_requests", int),
        ("max_queued_tokens", int),
        ("max_running", int),
        ("keepalive_s", float),
        ("max_prefix_ttl_s", float),
        ("key_max_prefixes", int),
        ("key_max_pinned_fraction", float),
        ("upstream_timeout_s", float),
        ("health_interval_s", float),
        ("health_check_timeout_s", float),
        ("unhealthy_threshold", int),
        ("healthy_threshold", int),
        ("upstream_consecutive_failures", int),
        ("upstream_base_ejection_s", float),
        ("upstream_max_ejection_s", float),
        ("upstream_max_ejection_percent", float),
        ("header_timeout_s", float),
        ("body_timeout_s", float),
        ("max_connections", int),
        ("shutdown_grace_s", float),
        ("redis_lease_ttl_s", float),
        ("balance_abs_threshold", int),
        ("balance_rel_threshold", float),
        ("precise_max_load_ratio", float),
        ("precise_overlap_weight", float),
        ("upstream_metrics_interval_s", float),
    ):
        g.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=getattr(defaults, name),
            help=_with_default(GATEWAY_HELP.get(name, name), getattr(defaults, name)),
        )
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="vLLM's: stop logging each request's prompt and parameters; taken so vLLM's "
        "command lines run, and it changes nothing: prefixgate never logs a request's "
        "content (its per-request access line is --no-access-log) (default: off)",
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


def engine_flags_given(args: argparse.Namespace) -> list[str]:
    """The engine options set on the command line (``--max-num-seqs``, ``--kv-cache-memory``,
    ...): every engine flag but ``--model`` defaults to "not given" (``argparse.SUPPRESS``),
    so a name in ``args`` was given. vLLM's ``--trust-remote-code`` (it permits, it
    configures nothing) and the parallel sizes (``check_parallel_sizes`` takes 1 only) are
    not engine options."""
    from prefixgate.engine.config import EngineConfig

    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]
    return ["--" + n.replace("_", "-") for n in names if n in vars(args)]


def check_no_engine_flags(args: argparse.Namespace) -> None:
    """With ``--upstream`` or ``--config`` no local engine runs: an engine option given then
    would be taken and do nothing.

    Raises:
        ValueError: naming the engine options given.
    """
    given = engine_flags_given(args)
    if given:
        raise ValueError(
            f"{', '.join(given)} configure{'s' if len(given) == 1 else ''} the local engine; "
            "with --upstream or --config the upstreams run their own engines (set such "
            "options on them)"
        )


def positional_model(args: argparse.Namespace) -> None:
    """Fold ``serve``'s positional ``MODEL`` into ``args.model`` (``prefixgate serve PATH`` is
    ``--model PATH``, as ``vllm serve PATH``).

    Raises:
        ValueError: both given and different.
    """
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise ValueError(
            f"the positional MODEL {tag[:200]!r} and --model {args.model[:200]!r} differ: give one"
        )
    args.model = tag


def check_parallel_sizes(args: argparse.Namespace) -> None:
    """``--tensor-parallel-size`` / ``--pipeline-parallel-size`` (vLLM's) are taken at 1 only:
    prefixgate runs one model on one device.

    Raises:
        ValueError: either above 1, or below 1.
    """
    for dest, flag in (
        ("tensor_parallel_size", "--tensor-parallel-size"),
        ("pipeline_parallel_size", "--pipeline-parallel-size"),
    ):
        size = getattr(args, dest, 1)
        if size < 1:
            raise ValueError(f"{flag} must be >= 1, got {size}")
        if size > 1:
            raise ValueError(
                f"{flag} {size}: prefixgate runs a model on one device (1 only, no model "
                "parallelism); to use several GPUs, run one server per GPU and a gateway "
                "in front (--upstream URL per server)"
            )


def check_auto_tool_choice(args: argparse.Namespace) -> None:
    """``--enable-auto-tool-choice`` (vLLM's) needs ``--tool-call-parser``, as in vLLM; with it,
    the flag changes nothing ('auto' is served whenever a parser is set).

    Raises:
        ValueError: the flag without ``--tool-call-parser``.
    """
    if getattr(args, "enable_auto_tool_choice", False) and args.tool_call_parser is None:
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser (one of "
            f"{', '.join(PARSERS)}): the parser reads the tool calls of 'auto' answers"
        )


@functools.cache
def serve_flags() -> dict[str, str]:
    """Every ``serve`` option's field (its argparse ``dest``, the ``EngineConfig`` or
    ``GatewaySettings`` field it sets) → its flag (``max_model_len`` → ``--max-model-len``):
    the one table that names a config field as the user typed it."""
    p = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(p)
    return {a.dest: a.option_strings[0] for a in p._actions if a.option_strings}


_LEADING_NAME = re.compile(r"[a-z][a-z0-9_]*")


def in_flag_words(message: str) -> str:
    """A refused option's message with its leading config field named by its flag
    (``"max_model_len must be >= 1, got 0"`` → ``"--max-model-len must be >= 1, got 0"``): the
    configs (``EngineConfig``, ``GatewaySettings``) name their fields; a ``serve`` user typed
    flags. A message that starts otherwise is kept as it is."""
    found = _LEADING_NAME.match(message)
    if found is None:
        return message
    flag = serve_flags().get(found.group())
    return message if flag is None else flag + message[found.end() :]
