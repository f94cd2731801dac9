"""From the parsed ``prefixgate serve`` flags to what the server runs with: the
``EngineConfig``, the ``GatewaySettings``, the served model name, the ``--chat-template``
source and what the keys file adds (tenant weights, warnings about fields the scheduling
policy ignores). Every function raises ``ValueError`` on a value it refuses (``run`` turns it
into one "bad option" line and exit code 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixgate.gateway.settings import GatewaySettings

if TYPE_CHECKING:
    from prefixgate.gateway.tenancy.keys import KeySpec

__all__ = [
    "default_model_name",
    "engine_config",
    "key_policy_warnings",
    "key_weights",
    "load_chat_template",
    "objective_policy_warning",
    "objective_priorities",
    "settings_from_args",
]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")  # org/name


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


def engine_config(args: argparse.Namespace) -> Any:
    """The EngineConfig from the parsed flags (fields not given keep their defaults).

    Raises:
        ValueError: on a value EngineConfig refuses.
    """
    from prefixgate.engine.config import EngineConfig

    names = {f.name for f in dataclasses.fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["model"] = args.model
    if values.get("threads") is None:
        from prefixgate.engine.threads import default_threads

        values["threads"] = default_threads()
    return EngineConfig(**values)


def default_model_name(model: str | None) -> str:
    """The served id of ``--model``: a hub id as given (``org/name``, as vLLM), a folder's
    name, or ``"tiny-random"``."""
    if not model:
        return "tiny-random"
    if not os.path.exists(os.path.expanduser(model)) and _HUB_ID.match(model):
        return model
    return os.path.basename(os.path.normpath(model))


UPSTREAM_KEY_ENV = "PREFIXGATE_UPSTREAM_API_KEY"


def upstream_api_key(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The upstreams' Bearer key: ``--upstream-api-key``, else the content of
    ``--upstream-api-key-file`` (whitespace stripped), else ``$PREFIXGATE_UPSTREAM_API_KEY``,
    else None.

    Raises:
        ValueError: both flags given, an unreadable or empty key file, or a key holding
            whitespace or control characters.
    """
    key, path = args.upstream_api_key, getattr(args, "upstream_api_key_file", None)
    if key is not None and path is not None:
        raise ValueError("give one of --upstream-api-key and --upstream-api-key-file")
    source = "--upstream-api-key"
    if path is not None:
        source = f"--upstream-api-key-file {path}"
        try:
            key = Path(path).expanduser().read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read {source}: {exc}") from None
        if not key:
            raise ValueError(f"{source} is empty")
    elif key is None and environ.get(UPSTREAM_KEY_ENV):
        key, source = environ[UPSTREAM_KEY_ENV].strip(), f"${UPSTREAM_KEY_ENV}"
    if key is not None and (not key or any(c.isspace() or ord(c) < 0x20 for c in key)):
        raise ValueError(f"the upstream key of {source} must be one word without whitespace")
    return key


# GatewaySettings fields set from the flag of the same dest, as parsed
_SAME_NAME_OPTIONS = (
    "keys_file",
    "upstream_cache_salt",
    "max_body_bytes",
    "max_request_tools",
    "max_request_values",
    "max_queued_requests",
    "max_queued_tokens",
    "max_running",
    "keepalive_s",
    "max_prefix_ttl_s",
    "key_max_prefixes",
    "key_max_pinned_fraction",
    "upstream_timeout_s",
    "health_interval_s",
    "health_check_timeout_s",
    "unhealthy_threshold",
    "healthy_threshold",
    "upstream_consecutive_failures",
    "upstream_base_ejection_s",
    "upstream_max_ejection_s",
    "upstream_max_ejection_percent",
    "header_timeout_s",
    "body_timeout_s",
    "max_connections",
    "shutdown_grace_s",
    "tool_call_parser",
    "routing",
    "tokenizer",
    "precise_max_load_ratio",
    "precise_overlap_weight",
    "upstream_metrics_interval_s",
    "balance_abs_threshold",
    "balance_rel_threshold",
    "redis_url",
    "redis_lease_ttl_s",
    "trust_pool_headers",
)


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    """GatewaySettings from the parsed flags.

    Raises:
        ValueError: an option out of its range (``GatewaySettings``), a bad upstream key
            (``upstream_api_key``), a ``--served-model-name`` given twice, or one that is a
            model folder or hub id with no model given (the positional MODEL it swallowed).
    """
    names = list(args.served_model_name or [])
    if not names and not args.upstreams and not args.config:
        names = [default_model_name(args.model)]
    if len(set(names)) != len(names):
        raise ValueError(f"--served-model-name: a name given twice: {' '.join(names)}")
    last = names[-1] if len(names) > 1 else ""
    if args.model is None and (os.path.isdir(os.path.expanduser(last)) or _HUB_ID.match(last)):
        # `serve --served-model-name a PATH` once served PATH as a; nargs="+" takes PATH too
        raise ValueError(
            f"--served-model-name took {last[:200]!r}, a model, as a name (it takes every word "
            "after it): give the model first (prefixgate serve MODEL --served-model-name ...) "
            "or as --model"
        )
    return GatewaySettings(
        model_name=names[0] if names else None,
        model_aliases=names[1:],
        api_keys=list(args.api_keys),
        upstream_api_key=upstream_api_key(args),
        upstream_kv_events=upstream_kv_events(args.upstream_kv_events),
        objective_priority=objective_priorities(args.objective_priority),
        **{name: getattr(args, name) for name in _SAME_NAME_OPTIONS},
    )


def objective_priorities(specs: list[str]) -> dict[str, int]:
    """``--objective-priority NAME=INT`` flags → objective name → engine priority.

    Raises:
        ValueError: a flag not ``NAME=INT``, or one name given twice.
    """
    out: dict[str, int] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        name = name.strip()
        try:
            prio = int(value.strip()) if sep and name else None
        except ValueError:
            prio = None
        if prio is None:
            raise ValueError(f"--objective-priority {spec!r}: expected NAME=INT, e.g. batch=10")
        if name in out:
            raise ValueError(f"--objective-priority: {name} given twice")
        out[name] = prio
    return out


def upstream_kv_events(specs: list[str]) -> dict[str, tuple[str, str | None]]:
    """``--upstream-kv-events URL=PUB[,REPLAY]`` flags → upstream URL → (PUB, REPLAY).

    Raises:
        ValueError: a malformed flag, or one URL given twice.
    """
    from prefixgate.gateway.proxy.kv_index import parse_kv_events_spec  # noqa: PLC0415

    out: dict[str, tuple[str, str | None]] = {}
    for spec in specs:
        url, pub, replay = parse_kv_events_spec(spec)
        if url in out:
            raise ValueError(f"--upstream-kv-events: {url} given twice")
        out[url] = (pub, replay)
    return out


def key_weights(specs: list[KeySpec], keys_file: str) -> dict[str, float]:
    """Tenant weights of the keys file's ``specs`` (key name → ``weight``) for the fair
    scheduler; keys of one name must agree on their weight (``keys_file``: its path, named in
    the error).

    Raises:
        ValueError: one name with two weights.
    """
    weights: dict[str, float] = {}
    for spec in specs:
        if weights.setdefault(spec.name, spec.weight) != spec.weight:
            raise ValueError(f"keys file {keys_file}: key name {spec.name} has two weights")
    return weights


def key_policy_warnings(specs: list[KeySpec], keys_file: str, policy: str) -> list[str]:
    """What the keys file (its ``specs``, read from ``keys_file``) asks that the engine's
    ``scheduling_policy`` will not do: a key's ``priority`` acts only under a policy that
    ``uses_priority``, its ``weight`` only under one that ``uses_tenant_weights`` (logged at
    start-up so the setting is not a silent no-op)."""
    from prefixgate.engine.scheduling_policy import policy_class

    cls = policy_class(policy)
    out = []
    prio = sorted({s.name or "unnamed" for s in specs if s.priority != 0})
    if prio and not cls.uses_priority:
        out.append(
            f"keys file {keys_file}: 'priority' of {', '.join(prio)} has no effect under "
            f"--scheduling-policy {policy} (it orders requests under 'priority')"
        )
    weighted = sorted({s.name or "unnamed" for s in specs if s.weight != 1.0})
    if weighted and not cls.uses_tenant_weights:
        out.append(
            f"keys file {keys_file}: 'weight' of {', '.join(weighted)} shares the admission "
            f"queue but not the engine under --scheduling-policy {policy} (engine fair share "
            "needs 'fair')"
        )
    return out


def objective_policy_warning(objectives: dict[str, int], policy: str) -> str | None:
    """The start-up warning when ``--objective-priority`` is given under a scheduling policy
    that ignores priorities (None when it does not apply).

    Raises:
        ValueError: an unknown policy name.
    """
    from prefixgate.engine.scheduling_policy import policy_class  # noqa: PLC0415

    if not objectives or policy_class(policy).uses_priority:
        return None
    return (
        f"--objective-priority has no effect under --scheduling-policy {policy} (it orders "
        "requests under 'priority')"
    )
